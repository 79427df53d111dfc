"""Run each lesson N times back to back (Run All in a fresh kernel each time) and report every failure.

Usage: python benchmarks/stress_lessons.py [--runs 20] [--timeout 300] [--keep DIR] [lessons/07_flash_attention.ipynb ...]

An intermittent failure (a race, a timing-dependent bug) shows up in one Run All of ten or
twenty, not in the test suite's single run. This runs every lesson given (default: all of
lessons/) ``--runs`` times in a row, each time as ``benchmarks/run_lessons.py`` does (nbclient,
a fresh kernel, the notebook unchanged on disk), and prints one line per run and a table:
runs, failures, the cell and error of each failure, and the fastest/median/slowest Run All.
With ``--keep DIR`` the executed copy of each failed run is written there for a post-mortem.
Exit status 1 if any run failed. Not part of CI: 20 runs of every lesson take hours on a CPU.
"""

import argparse
import pathlib
import statistics
import sys

from run_lessons import execute  # one Run All, as run_lessons.py does it (this folder is on sys.path)

REPO = pathlib.Path(__file__).resolve().parent.parent


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lessons", nargs="*", type=pathlib.Path, help="default: every lessons/*.ipynb")
    ap.add_argument("--runs", type=int, default=20, help="Run Alls per lesson (default 20)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds one cell may take")
    ap.add_argument("--keep", type=pathlib.Path, default=None, help="folder for the executed copies of failed runs")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs: expected a positive number, got {args.runs}")
    lessons = args.lessons or sorted((REPO / "lessons").glob("*.ipynb"))
    for path in lessons:
        if not path.is_file():
            ap.error(f"lessons: {path} is not a file")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        if any(args.keep.resolve() == p.resolve().parent for p in lessons):
            ap.error("--keep must not be the lessons' own folder")
    import nbformat

    summary = []
    for path in lessons:
        times, failures = [], []
        for run in range(1, args.runs + 1):
            seconds, failure, nb = execute(path, args.timeout)
            times.append(seconds)
            result = "ok"
            if failure is not None:
                failures.append((run, *failure))
                result = f"FAILED in cell {failure[0]}: {failure[1]}"
                if args.keep is not None:
                    nbformat.write(nb, args.keep / f"{path.stem}.run{run}.ipynb")
            print(f"{path.name} run {run}/{args.runs}: {seconds:.1f} s {result}", flush=True)
        summary.append((path.name, times, failures))

    print()
    print(f"{'lesson':<32} {'runs':>4} {'failed':>6} {'fastest s':>9} {'median s':>8} {'slowest s':>9}")
    for name, times, failures in summary:
        print(f"{name:<32} {len(times):>4} {len(failures):>6} {min(times):>9.1f} {statistics.median(times):>8.1f} "
              f"{max(times):>9.1f}")
        for run, cell, error in failures:
            print(f"    run {run}: cell {cell}: {error}")
    return 1 if any(f for _, _, f in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
