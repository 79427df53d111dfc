"""``attnlab grade PATH... [--exercise NAME] [--json FILE] [--csv FILE] [--gradescope FILE] [--nbgrader-db URL] [-j N]``.

Each notebook is graded by a trusted worker process (:func:`attnlab.grading.sandbox.runner.grade_in_subprocess`,
:func:`attnlab.grading.scoring.grade_notebook`) that never runs the learner's code; what is printed and written is
:mod:`attnlab.grading.reports`'. PATHs may be notebooks or folders (searched recursively, nbgrader's
``submitted/<student>/<assignment>/`` included); the exercise comes from the notebook's metadata and grade_ids, with
a warning when the file name disagrees. The JSON report is rewritten atomically after each notebook. Exit status: 0
when every notebook found was graded, 1 otherwise.

Example: ``attnlab grade my-work/02_queries_keys_values.ipynb --json report.json``
"""

import json
import sys
import threading

from attnlab.grading import sandbox
from attnlab.grading.layout import discover, manifest, who
from attnlab.grading.reports import _json_doc, _write_atomic, csv_text, format_report, gradescope_doc, sanitize
from attnlab.grading.sandbox.runner import DEFAULT_CELL_TIMEOUT, DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT, grade_in_subprocess


def add_arguments(parser):
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="exercise notebooks (.ipynb) or folders of them (searched recursively)")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE (updated per notebook)")
    parser.add_argument("--csv", metavar="FILE", help="also write one row per student and exercise to FILE")
    parser.add_argument("--gradescope", metavar="FILE",
                        help="also write Gradescope's autograder results (results.json) to FILE")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT, metavar="S",
                        help=f"seconds one cell may run (default {DEFAULT_CELL_TIMEOUT})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds a whole notebook may run (default {DEFAULT_TIMEOUT})")
    parser.add_argument("--memory", type=int, default=DEFAULT_MEMORY_MB, metavar="MB",
                        help=f"memory a notebook's kernel may allocate (default {DEFAULT_MEMORY_MB} MB)")
    parser.add_argument("--exercise", action="append", default=[], metavar="NAME",
                        help="the exercise the assignment grades (02 or 02_queries_keys_values; repeat for more): "
                             "a notebook of any other exercise is reported and never credited; --gradescope needs it")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="notebooks graded at once (default 1)")
    parser.add_argument("--nbgrader-db", metavar="URL",
                        help="write each part's score into nbgrader's gradebook (e.g. sqlite:///course/gradebook.db), "
                             "after nbgrader autograde: the credit nbgrader exports is then attnlab grade's")


def run(args):
    from concurrent.futures import ThreadPoolExecutor, as_completed

    try:
        expected = manifest(getattr(args, "exercise", None) or []) or None
    except ValueError as exc:
        print(f"attnlab grade: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "gradescope", None) and expected is None:
        print("attnlab grade: --gradescope needs --exercise NAME: Gradescope's score is that exercise's, and a "
              "submission may hold other notebooks", file=sys.stderr)
        return 2
    sandbox.protect_grader()
    jobs = max(1, args.jobs)
    if jobs > 1 and not sandbox.Cgroup.available():
        # without a cgroup the limits are per process and per user id: one submission's process flood or tmpfs
        # pages would take a neighbour's share (its ring parts went from 13/13 to 6/13)
        print(f"attnlab grade: -j {jobs} needs a cgroup per submission, which cannot be made here (not root, or no "
              f"delegated cgroup): grading one notebook at a time", file=sys.stderr)
        jobs = 1
    paths, skipped = discover(args.paths)
    for s in skipped:
        print(f"skipped {s['path']}: {s['reason']}", file=sys.stderr)
    reports, lock = [], threading.Lock()
    memory = getattr(args, "memory", DEFAULT_MEMORY_MB)

    def one(p):
        report = grade_in_subprocess(p, args.cell_timeout, args.timeout, memory)
        report["student"], report["assignment"] = who(p)
        if expected is not None and report.get("exercise") and report["exercise"] not in expected:
            report.update(score=0, parts=[], error=f"exercise {report['exercise']}, not one this assignment grades "
                                                   f"({', '.join(expected)}): not credited")
        return sanitize(report)

    if args.json:
        _write_atomic(args.json, json.dumps(_json_doc([], skipped), indent=2) + "\n")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(one, p): p for p in paths}
        for future in as_completed(futures):
            report = future.result()
            with lock:
                reports.append(report)
                reports.sort(key=lambda r: str(r["path"]))
                print(format_report(report), flush=True)
                print(flush=True)
                if args.json:
                    _write_atomic(args.json, json.dumps(_json_doc(reports, skipped), indent=2) + "\n")
    sandbox.kill_descendants()
    graded = [r for r in reports if not r.get("error")]
    if len(reports) > 1:
        print(f"all notebooks: {sum(r['score'] for r in graded)}/{sum(r['max_score'] for r in graded)}")
    print(f"isolation: {sandbox.isolation()}")
    if getattr(args, "csv", None):
        _write_atomic(args.csv, csv_text(reports))
    problems = []
    if getattr(args, "nbgrader_db", None):
        from attnlab.grading.commands.nbgrader import write_gradebook

        problems = write_gradebook(args.nbgrader_db, reports)
        for problem in problems:
            print(f"nbgrader: {problem}", file=sys.stderr)
    if getattr(args, "gradescope", None):
        _write_atomic(args.gradescope, json.dumps(gradescope_doc(reports, skipped, expected), indent=2) + "\n")
    if not graded:
        print("attnlab grade: nothing was graded" + (" (see the skipped files above)" if skipped else ""),
              file=sys.stderr)
        return 1
    return 0 if len(graded) == len(reports) and not problems else 1


if __name__ == "__main__":
    from attnlab.cli import main

    sys.exit(main(["grade", *sys.argv[1:]]))
