"""How long ``attnlab grade`` takes for one notebook: each solution and each untouched exercise, one at a time.

Usage: python benchmarks/grade_times.py [--limit 60] [NOTEBOOK ...]   (default: every solutions/ and exercises/ notebook)

Each notebook is graded alone (a worker, its sandboxed functions process, the fresh process of the Triton parts), as
``attnlab grade`` does it; the table shows the wall time, the score and whether it is within ``--limit``
seconds (the course's budget per notebook on a 2-core CPU). Nothing is asserted: the numbers are this machine's.
Exit status 1 when a solution is not at full marks or an untouched exercise scores anything.
"""

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path)
    parser.add_argument("--limit", type=float, default=60.0)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from attnlab.grading.sandbox.runner import grade_in_subprocess
    from attnlab.grading.sandbox import isolation

    notebooks = args.notebooks or sorted((ROOT / "solutions").glob("[0-9]*.ipynb")) + \
        sorted((ROOT / "exercises").glob("[0-9]*.ipynb"))
    print(f"isolation: {isolation()}")
    print(f"{'notebook':<44} {'seconds':>8} {'score':>7}  within {args.limit:g} s")
    bad = False
    for path in notebooks:
        start = time.perf_counter()
        report = grade_in_subprocess(path)
        seconds = time.perf_counter() - start
        score = f"{report.get('score', 0)}/{report.get('max_score', 0)}"
        expected_full = path.parent.name == "solutions"
        wrong = report.get("error") or (report["score"] != report["max_score"] if expected_full else report["score"] != 0)
        bad = bad or bool(wrong)
        print(f"{path.parent.name + '/' + path.name:<44} {seconds:>8.1f} {score:>7}  "
              f"{'yes' if seconds <= args.limit else 'NO'}{'  (unexpected score)' if wrong else ''}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
