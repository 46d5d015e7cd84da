"""Command line: explain or rewrite an exported artifact.

python -m flashpass explain FILE [--kernel K] [--platform P] [--json]
python -m flashpass rewrite IN OUT [--kernel K] [--platform P] [--vjp-order N]
                                  [--route lift|splice] [--force]

FILE/IN is a serialized `jax.export.Exported`, a StableHLO portable artifact,
MLIR bytecode or MLIR text; OUT is written as a serialized `Exported`.
Platforms are jax.export's: cpu, cuda, rocm, tpu (gpu: the artifact's cuda or
rocm).  Errors are one line on stderr, naming the file, with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys


class UsageError(Exception):
    """A problem with the command line or its files: one line, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    from flashpass import __version__

    parser = argparse.ArgumentParser(prog="python -m flashpass", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"flashpass {__version__}")
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
        "--force", action="store_true", help="allow OUT to be IN (overwrite the input)"
    )
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
            help="platform to rewrite for: cpu, cuda, rocm, tpu, or gpu for the artifact's "
            "cuda or rocm (repeat; default: the artifact's platforms)",
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


def _read(path: str) -> bytes:
    """The bytes of the input ``path``, or a `UsageError` naming it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{path}: is a folder, not an artifact") from None
    except OSError as err:
        raise UsageError(f"{path}: cannot read it ({err.strerror or err})") from None
    if not data.strip():
        raise UsageError(f"{path}: the file is empty")
    return data


def _check_output(path: str, source: str, force: bool) -> None:
    """Refuse, before any work, an output that cannot be written or that is
    the input (unless ``force``)."""
    if os.path.isdir(path):
        raise UsageError(f"{path}: is a folder; name the file to write")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{path}: not writable")
    same = os.path.exists(path) and os.path.samefile(path, source)
    if same and not force:
        raise UsageError(f"{path}: is the input; pass --force to overwrite it")


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def main(argv=None) -> int:
    """Run the command line; returns the exit status (0, or 2 for an error)."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, as command-line tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv) -> int:
    args = _parser().parse_args(argv)
    path = args.file if args.command == "explain" else args.input
    try:
        if args.command == "rewrite":
            _check_output(args.output, args.input, args.force)
        data = _read(path)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from flashpass import export

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
            print(report.to_json(indent=2) if args.json else report, flush=True)
            return 0
        new, report = export.rewrite_and_explain(exp, route=args.route, **options)
        blob = new.serialize(vjp_order=args.vjp_order)
        with open(args.output, "wb") as f:
            f.write(blob)
    except (ValueError, TypeError, export.LiftError) as err:
        print(f"error: {path}: {_one_line(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # (an OSError too: the reader went away, `main` stops quietly)
    except OSError as err:  # writing OUT failed after the checks (disk full...)
        print(f"error: {args.output}: cannot write it ({err.strerror or err})", file=sys.stderr)
        return 2
    if not args.quiet:
        print(report)
    changed = "rewritten" if report.route != "kept" else "unchanged (see the report)"
    print(f"wrote {args.output} ({len(blob)} bytes, {changed})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
