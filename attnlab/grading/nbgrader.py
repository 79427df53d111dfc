"""nbgrader's hidden tests: every autograded cell asks ``attnlab grade`` for its part's score.

In ``solutions/`` (nbgrader's ``source/``) every check cell ends with::

    ### BEGIN HIDDEN TESTS
    __import__("attnlab.grading.nbgrader", fromlist=["autograde"]).autograde("padding-mask")
    ### END HIDDEN TESTS

nbgrader drops the block from the students' release and puts it back when it autogrades. Then
:func:`autograde` finds the notebook's file next to the kernel (the submission nbgrader is
grading), grades it with ``attnlab grade`` in a separate process (once per file: the result is
kept for the other cells) and raises AssertionError unless the part got its full points. So
nbgrader's score for the cell is ``attnlab grade``'s, whatever the notebook did to ``check``, to
environment variables or to its own kernel's state before the cell: the grade comes from the
grader's own process, which runs the submission in a fresh sandboxed kernel.

``attnlab grade`` itself removes hidden tests before it runs a notebook (it grades on its own).
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

    from attnlab.grading.grade import identify
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
        root = str(Path(__file__).resolve().parents[2])
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
    from attnlab.grading.course import find_course

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
    if part["points"] < part["max_points"]:
        raise AssertionError(f"{part_id}: {part['points']}/{part['max_points']} from attnlab grade: {part['feedback']}")
    print(f"[attnlab grade] {part_id}: {part['points']}/{part['max_points']}")
