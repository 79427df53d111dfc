"""nbgrader: the credit comes from ``attnlab grade``, written into nbgrader's gradebook with nbgrader's API.

In ``solutions/`` (nbgrader's ``source/``) every check cell ends with::

    ### BEGIN HIDDEN TESTS
    __import__("attnlab.grading.commands.nbgrader", fromlist=["autograde"]).autograde("padding-mask")
    ### END HIDDEN TESTS

nbgrader drops the block from the students' release and puts it back when it autogrades. That cell runs in the
student's kernel, which the student's own cells can change: whatever it does there is **feedback only**, and it says
so. :func:`autograde` grades the notebook's file with ``attnlab grade`` in a separate process and prints the part's
result (AssertionError when it failed). The credit is written afterwards, from the grader's own process: ``attnlab
grade submitted/ --nbgrader-db sqlite:///course/gradebook.db`` (after ``nbgrader autograde``, before ``nbgrader
export``) sets each autograded cell's score in the gradebook (:func:`write_gradebook`), replacing what the student's
kernel earned.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CACHE = {}


def _notebook_for(part_id, folder):
    """The .ipynb in ``folder`` that is the exercise of ``part_id``; FileNotFoundError otherwise."""
    import nbformat

    from attnlab.grading.layout import identify
    from attnlab.grading.parts import exercises

    exercise = next((ex for ex, parts in exercises().items() if part_id in parts), None)
    if exercise is None:
        raise ValueError(f"part_id: unknown exercise part {part_id!r}")
    found = []
    for path in sorted(Path(folder).glob("*.ipynb")):
        try:
            nb = nbformat.read(str(path), as_version=4)
        except Exception:
            continue
        if identify(nb, path)[0] == exercise:
            found.append(path)
    if len(found) != 1:
        raise FileNotFoundError(f"found {len(found)} notebooks of {exercise} in {folder}; the autograder grades "
                                f"exactly one (the submission)")
    return found[0]


def report_for(path, timeout=600):
    """``attnlab grade``'s report of one notebook file (graded once per file content)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _CACHE:
        root = str(Path(__file__).resolve().parents[3])
        env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "PYTHONPATH": root,
               "HOME": os.environ.get("HOME", tempfile.gettempdir())}
        with tempfile.TemporaryDirectory(prefix="attnlab-nbgrader-") as tmp:
            out = Path(tmp) / "report.json"
            subprocess.run([sys.executable, "-m", "attnlab", "grade", str(path), "--json", str(out),
                            "--timeout", str(timeout)], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=timeout + 120, cwd=tmp)
            doc = json.loads(out.read_text())
        _CACHE[key] = doc["notebooks"][0]
    return _CACHE[key]


def _is_course_source(folder):
    """True in the course checkout's own solutions/ folder (the source notebooks, run by nbval and by
    instructors): they are graded by the tests (tests/test_grading_notebooks.py), not once more here.
    A submission is never there: nbgrader grades in autograded/<student>/<assignment>/."""
    from attnlab.course import find_course

    try:
        course = find_course()
    except FileNotFoundError:
        return False
    return Path(folder).resolve() == (course / "solutions").resolve()


def autograde(part_id, folder="."):
    """nbgrader's hidden test of ``part_id``: AssertionError unless ``attnlab grade`` gives it full points."""
    if _is_course_source(folder):
        print(f"[attnlab grade] {part_id}: the course's own solution notebook (graded by its tests, not here)")
        return
    report = report_for(_notebook_for(part_id, folder))
    if report.get("error"):
        raise AssertionError(f"{part_id}: attnlab grade could not grade this notebook: {report['error']}")
    part = next((p for p in report["parts"] if p["name"] == part_id), None)
    if part is None:
        raise AssertionError(f"{part_id}: not in attnlab grade's report")
    note = "(feedback only: the credit is written by `attnlab grade --nbgrader-db`, from its own process)"
    if part["points"] < part["max_points"]:
        raise AssertionError(f"{part_id}: {part['points']}/{part['max_points']} from attnlab grade: "
                             f"{part['feedback']}\n{note}")
    print(f"[attnlab grade] {part_id}: {part['points']}/{part['max_points']} {note}")


def write_gradebook(db_url, reports):
    """Set the score of every autograded cell that nbgrader's gradebook at ``db_url`` holds for each notebook of
    ``reports`` (``attnlab grade``'s, with student and assignment from nbgrader's layout): the points attnlab grade
    gave that part, or 0 where it gave none (a notebook that could not be graded, or one graded as another exercise:
    whatever the student's kernel wrote there is replaced). Returns [problems]."""
    from nbgrader.api import Gradebook, MissingEntry

    from attnlab.grading.parts import MANUAL

    problems = []
    with Gradebook(db_url) as gb:
        for r in reports:
            student, assignment, notebook = r.get("student"), r.get("assignment"), Path(r["path"]).stem
            if not (student and assignment):
                problems.append(f"{r['path']}: not in nbgrader's submitted/<student>/<assignment>/ layout")
                continue
            where = Path(r["path"]).parents
            if len(where) < 3 or [where[0].name, where[1].name, where[2].name] != [assignment, student, "submitted"]:
                # nbgrader grades the assignment folder's own notebooks: a copy of the same name in a folder below
                # it (a solved one, say) is never the submission, and never replaces its credit
                problems.append(f"{r['path']}: in a folder below submitted/{student}/{assignment}/, which nbgrader "
                                f"does not grade: not credited")
                continue
            try:  # every autograded cell nbgrader holds for the notebook: what attnlab grade scored, else 0
                cells = [c.name for c in gb.find_notebook(notebook, assignment).grade_cells if c.name not in MANUAL]
            except MissingEntry:
                problems.append(f"{r['path']}: the gradebook has no notebook {notebook} in {assignment} "
                                f"(run nbgrader autograde {assignment} first)")
                continue
            if r.get("error"):   # not graded, or not credited (filed in another exercise's slot): said, and 0
                problems.append(f"{r['path']}: {r['error']}: 0 points for every part of {assignment}")
            points = {} if r.get("error") else {p["name"]: p["points"] for p in r["parts"] if not p.get("manual")}
            if points and set(cells) - set(points):
                problems.append(f"{r['path']}: graded as {r.get('exercise')}, which has no part "
                                f"{', '.join(sorted(set(cells) - set(points)))} of {assignment}: 0 points for them")
            for name in cells:
                try:
                    grade = gb.find_grade(name, notebook, assignment, student)
                except MissingEntry:
                    problems.append(f"{r['path']}: no autograded result for {name} in the gradebook "
                                    f"(run nbgrader autograde {assignment} first)")
                    continue
                grade.auto_score = float(points.get(name, 0))
                grade.manual_score = None
            gb.db.commit()
    return problems
