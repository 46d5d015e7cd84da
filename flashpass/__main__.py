"""Command line: explain or rewrite an exported artifact.

python -m flashpass explain FILE [--kernel K] [--platform P] [--json]
python -m flashpass rewrite IN OUT [--kernel K] [--platform P] [--vjp-order N]
                                  [--route lift|splice]

FILE/IN is a serialized `jax.export.Exported`, a StableHLO portable artifact,
MLIR bytecode or MLIR text; OUT is written as a serialized `Exported`.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flashpass", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help="print what the rewrite would do")
    explain.add_argument("file")
    explain.add_argument("--json", action="store_true", help="print the report as JSON")
    rewrite = commands.add_parser("rewrite", help="write the rewritten artifact")
    rewrite.add_argument("input")
    rewrite.add_argument("output")
    rewrite.add_argument(
        "--vjp-order",
        type=int,
        default=0,
        help="derivative orders serialized with the artifact (1: jax.grad works on it)",
    )
    rewrite.add_argument("--quiet", action="store_true", help="do not print the report")
    rewrite.add_argument(
        "--route",
        choices=("lift", "splice"),
        default="lift",
        help="lift: re-export the lifted program (default); splice: replace only the "
        "sites' ops, leaving the rest of the module as it is (derivative: lift's)",
    )
    for sub in (explain, rewrite):
        sub.add_argument(
            "--kernel",
            action="append",
            help="kernel name to use (repeat for an order of preference)",
        )
        sub.add_argument(
            "--platform",
            action="append",
            help="platform to rewrite for (repeat; default: the artifact's platforms)",
        )
        sub.add_argument(
            "--module-platform",
            action="append",
            help="for a bare module: the platforms it runs on (default: this host's)",
        )
        sub.add_argument(
            "--interpret", action="store_true", help="Pallas kernels in interpret mode"
        )
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from flashpass import export

    path = args.file if args.command == "explain" else args.input
    with open(path, "rb") as f:
        data = f.read()
    options = {}
    if args.kernel:
        options["kernel"] = args.kernel[0] if len(args.kernel) == 1 else list(args.kernel)
    if args.interpret:
        options["interpret"] = True
    if args.platform:
        options["platforms"] = tuple(args.platform)
    try:
        exp = export.load(data, platforms=args.module_platform)
        if args.command == "explain":
            report = export.explain(exp, **options)
            print(report.to_json(indent=2) if args.json else report)
            return 0
        new, report = export.rewrite_and_explain(exp, route=args.route, **options)
        with open(args.output, "wb") as f:
            f.write(new.serialize(vjp_order=args.vjp_order))
    except (ValueError, TypeError, export.LiftError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
