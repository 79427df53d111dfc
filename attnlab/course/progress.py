"""``attnlab progress [DIR]``: which parts of which exercises pass in your working folder.

Every exercise notebook in DIR (default ``./my-work``) is graded exactly as ``attnlab grade`` does (a
fresh kernel, the checks run by the grader), and one line per exercise shows each part's mark, with the
score. Only notebooks whose answers changed since the last run are graded again: the last reports are
kept in a cache outside DIR (``~/.cache/attnlab/progress.json``, or ``$ATTNLAB_CACHE``), keyed by a hash
of the notebook's cells (their sources, not their outputs: running or saving a notebook changes nothing)
and of the grader's own code. A notebook still as ``attnlab start`` copied it is not graded at all: every
part is still to do. Your notebooks are only ever read.

Example: ``attnlab progress`` ::

    01_soft_alignment        6/6   [x] additive-score  [x] context-vector  [x] decode-step
    02_queries_keys_values   1/5   [x] padding-mask  [ ] causal-mask  [ ] attention-masks

Marks: ``[x]`` the part passes; ``[ ]`` not yet (``attnlab grade PATH`` says why); ``[w]`` a written part,
graded by hand, that has an answer (``[ ]`` while it has none): it counts in neither the parts that pass
nor the score.
"""

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from attnlab.course import add_course_argument
from attnlab.course.start import DEFAULT_DIR
from attnlab.grading.commands.grade import DEFAULT_CELL_TIMEOUT, DEFAULT_TIMEOUT, grade_in_subprocess


def _mark(part):
    if part.get("manual"):  # graded by hand: written or not, never "passing" here
        return "w" if part.get("answer") else " "
    return "x" if part["points"] == part["max_points"] else " "


MARKS = "[x] passes   [ ] not yet (`attnlab grade PATH` says why)   [w] a written part with an answer, graded by hand"


def cache_file():
    """Where the last reports are kept (never in the learner's folder)."""
    root = os.environ.get("ATTNLAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attnlab")
    return Path(root) / "progress.json"


def _grader_fingerprint():
    """A hash of the grader's code and the library its references use: a report made by other checks is not reused."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]  # all of attnlab
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def answers_of(path):
    """A hash of a notebook's cells (types and sources: what grading runs), or None when it cannot be read."""
    try:
        nb = json.loads(Path(path).read_text())
        cells = [(c.get("cell_type"), "".join(c.get("source", [])) if isinstance(c.get("source"), list)
                  else c.get("source", "")) for c in nb.get("cells", [])]
    except (OSError, ValueError, AttributeError):
        return None
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()


def _load_cache():
    try:
        return json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(cache):
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(path)
    except OSError:
        pass  # no cache this time: the next run grades again


def _pristine(path, course):
    """Whether ``path`` holds the course's exercise notebook of that name untouched."""
    if course is None:
        return False
    original = Path(course) / "exercises" / Path(path).name
    return original.is_file() and answers_of(original) == answers_of(path)


def _untouched_report(path):
    """The report of a notebook nobody has answered yet: every part still to do (nothing to grade)."""
    from attnlab.grading.parts import TABLE

    exercise = Path(path).stem
    parts = [{"name": p.id, "points": 0, "max_points": 0 if p.kind == "manual" else p.points,
              "manual": p.kind == "manual", "answer": "", "diagnosis": [],
              "feedback": "not started: the notebook is as `attnlab start` copied it"} for p in TABLE.get(exercise, [])]
    return {"path": str(path), "exercise": exercise, "score": 0,
            "max_score": sum(p["max_points"] for p in parts), "parts": parts, "untouched": True}


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
    add_course_argument(parser)
    parser.add_argument("--json", metavar="FILE", help="also write the full grade report as JSON to FILE")
    parser.add_argument("--fresh", action="store_true",
                        help="grade every notebook again, whatever the last run found")
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
    try:
        from attnlab.course import find_course

        course = find_course(args.course)
    except FileNotFoundError:
        course = None
    fingerprint = _grader_fingerprint()
    cache = {} if getattr(args, "fresh", False) else _load_cache()
    reports, todo, how = [None] * len(notebooks), [], {}
    for i, path in enumerate(notebooks):
        key = f"{answers_of(path)}:{fingerprint}"
        entry = cache.get(str(path.resolve()))
        if entry and entry.get("key") == key:
            reports[i], how[i] = entry["report"], "unchanged since the last run"
        elif _pristine(path, course):
            reports[i], how[i] = _untouched_report(path), "not started"
        else:
            todo.append((i, path, key))
    if todo:
        print(f"grading {len(todo)} of {len(notebooks)} notebooks in {folder.resolve()} (each runs in a fresh "
              f"kernel; the others are unchanged since the last run or not started)...", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        graded = list(pool.map(lambda t: grade_in_subprocess(t[1], args.cell_timeout, args.timeout), todo))
    for (i, path, key), report in zip(todo, graded):
        reports[i] = report
        if not report.get("error"):  # an error (a timeout, a dead kernel) is worth another try next time
            cache[str(path.resolve())] = {"key": key, "report": report}
    if todo:
        _save_cache(cache)
    for i, report in enumerate(reports):
        print(summarize(report) + (f"   ({how[i]})" if i in how else ""))
    graded = [r for r in reports if not r.get("error")]
    auto = [p for r in graded for p in r["parts"] if not p.get("manual")]
    done, total = sum(p["points"] == p["max_points"] for p in auto), len(auto)
    print(f"{done} of {total} parts pass; score {sum(r['score'] for r in graded)}/{sum(r['max_score'] for r in graded)}")
    print(f"marks: {MARKS}")
    print("details and the likely mistakes: `attnlab grade PATH`")
    if args.json:
        Path(args.json).write_text(json.dumps({"notebooks": reports}, indent=2) + "\n")
    return 0 if len(graded) == len(reports) else 1
