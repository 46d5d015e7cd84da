"""The zoo's command line.

python -m benchmarks.zoo sweep [--suite S ...] [--models A,B] [--modes M,N]
    run suites and refresh their expected files (naming models or modes
    refreshes only those records);
python -m benchmarks.zoo check [--suite S ...] [--sample]
    run (the CI sample of) suites and fail on any regression against the
    expected files, writing nothing;
python -m benchmarks.zoo render
    write docs/zoo.md and its plot from the expected files;
python -m benchmarks.zoo tidy [--suite S ...]
    redo the expected files' accounting (paths, kept artifacts) without a sweep.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from . import sweep

MINE = ("hf_flax", "keras_hub", "jax_native")

#: Modes the CI sample checks (the full sweep runs them all): the forward and
#: the training step, where the matcher's forward and backward readings live.
SAMPLE_MODES = ("direct", "train")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zoo")
    parser.add_argument("command", choices=("sweep", "check", "render", "tidy"))
    parser.add_argument("--suite", action="append", choices=sweep.SUITES)
    parser.add_argument("--sample", action="store_true", help="only the CI sample")
    parser.add_argument("--models", help="comma-separated model names")
    parser.add_argument("--modes", help="comma-separated modes")
    parser.add_argument(
        "--reverse", action="store_true", help="models in reverse order (a second sweeper)"
    )
    args = parser.parse_args(argv)
    sweep.prepare_environment()
    if args.command == "tidy":  # redo the accounting of the expected files, no sweep
        for suite in args.suite or MINE:
            sweep.tidy(suite)
        return 0
    if args.command == "render":
        from .render import render

        print(render())
        return 0
    suites = args.suite or list(MINE)
    names = args.models.split(",") if args.models else None
    modes = args.modes.split(",") if args.modes else None
    command = "python -m benchmarks.zoo " + " ".join(shlex.quote(a) for a in argv)
    failed = []
    for suite in suites:
        start = time.perf_counter()
        merge = bool(names or modes or args.sample or args.reverse)
        each = None
        if args.command == "sweep":
            # Kept as it goes (merged into the file), then written whole.
            def each(done, suite=suite, start=start):
                sweep.save(suite, done, command, time.perf_counter() - start, True)

        if args.command == "check" and args.sample and not modes:
            modes = list(SAMPLE_MODES)
        records = sweep.run(
            suite,
            sample=args.sample,
            names=names,
            modes=modes,
            log=sys.stdout,
            each=each,
            reverse=args.reverse,
        )
        wall = time.perf_counter() - start
        if args.command == "sweep":
            path = sweep.save(suite, records, command, wall, merge)
            print(f"[{suite}] {len(records)} records in {wall:.0f} s -> {path}")
        else:
            from .compare import regressions

            bad = regressions(sweep.load(suite)["records"], records)
            print(f"[{suite}] {len(records)} records in {wall:.0f} s, {len(bad)} regression(s)")
            failed += [f"[{suite}] {line}" for line in bad]
    for line in failed:
        print("REGRESSION", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
