"""``attnlab progress [DIR]``: which parts of which exercises pass in your working folder.

Every exercise notebook in DIR (default ``./my-work``) is graded exactly as
``attnlab grade`` does (a fresh kernel, the checks run by the grader), and one
line per exercise shows each part as passing or not, with the score.

Example: ``attnlab progress`` ::

    01_soft_alignment        6/6   [x] additive-score  [x] context-vector  [x] decode-step
    02_queries_keys_values   1/5   [x] padding-mask  [ ] causal-mask  [ ] attention-masks

A written (manual) part, graded by hand, shows ``[w]`` once it has an answer and counts in neither
the parts that pass nor the score.
"""

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from attnlab.grading.grade import DEFAULT_CELL_TIMEOUT, DEFAULT_TIMEOUT, grade_in_subprocess
from attnlab.grading.workspace import DEFAULT_DIR


def _mark(part):
    if part.get("manual"):  # graded by hand: written or not, never "passing" here
        return "w" if part.get("answer") else " "
    return "x" if part["points"] == part["max_points"] else " "


def summarize(report):
    """One line for a grade report."""
    name = Path(report["path"]).stem
    if report.get("error"):
        return f"{name:<24} could not grade: {report['error']}"
    marks = "  ".join(f"[{_mark(p)}] {p['name']}" for p in report["parts"])
    score = f"{report['score']}/{report['max_score']}"
    return f"{name:<24} {score:>5}   {marks}"


def add_arguments(parser):
    parser.add_argument("dir", nargs="?", default=DEFAULT_DIR, metavar="DIR",
                        help=f"your working folder (default ./{DEFAULT_DIR})")
    parser.add_argument("--json", metavar="FILE", help="also write the full grade report as JSON to FILE")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="notebooks graded at once (default 1)")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT, metavar="S",
                        help=f"seconds one cell may run (default {DEFAULT_CELL_TIMEOUT})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds a whole notebook may run (default {DEFAULT_TIMEOUT})")


def run(args):
    folder = Path(args.dir)
    notebooks = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        print(f"attnlab progress: no exercise notebooks in {folder} (run `attnlab start` first)", file=sys.stderr)
        return 2
    print(f"grading {len(notebooks)} notebooks in {folder.resolve()} (each runs in a fresh kernel)...", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        reports = list(pool.map(lambda p: grade_in_subprocess(p, args.cell_timeout, args.timeout), notebooks))
    for report in reports:
        print(summarize(report))
    graded = [r for r in reports if not r.get("error")]
    auto = [p for r in graded for p in r["parts"] if not p.get("manual")]
    done, total = sum(p["points"] == p["max_points"] for p in auto), len(auto)
    print(f"{done} of {total} parts pass; score {sum(r['score'] for r in graded)}/{sum(r['max_score'] for r in graded)}")
    print("details and the likely mistakes: `attnlab grade PATH`")
    if args.json:
        Path(args.json).write_text(json.dumps({"notebooks": reports}, indent=2) + "\n")
    return 0 if len(graded) == len(reports) else 1
