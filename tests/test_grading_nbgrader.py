"""A real nbgrader 0.9.6 round trip agrees with `attnlab grade`.

nbgrader comes from the ``nbgrader`` extra, which ``make test`` installs into .venv beside the pinned
set (``pip install -c attnlab/constraints.txt -e '.[nbgrader]'``): nothing is downloaded while the
tests run, and nbgrader runs with the venv's Python, so its kernels import the same attnlab, torch and
triton as the course. Without the extra these tests are skipped, saying how to install it.

Three exercises go through ``nbgrader generate_assignment``, ``autograde`` and ``export``, with
submissions in nbgrader's layout: each exercise's solution and its untouched release, and for
exercise 02 the one-line cheats (``check`` rebound, ``check`` and ``autograde`` rebound,
``NBGRADER_EXECUTION`` unset) over wrong answers. Between ``autograde`` and ``export``, ``attnlab grade
--nbgrader-db`` writes its own scores into the gradebook (the hidden tests in the students' kernels are
feedback only): nbgrader's score of every submission must equal `attnlab grade`'s on the same files.
"""

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NBGRADER = "0.9.6"   # pyproject.toml's nbgrader extra
EXERCISES = ["02_queries_keys_values", "03_scaled_dot_product", "05_quadratic_cost"]

pytestmark = pytest.mark.slow


def _install():
    """nbgrader from the venv (the nbgrader extra, installed by `make test`); never from the network here."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        found = version("nbgrader")
    except PackageNotFoundError:
        pytest.skip("nbgrader is not installed: `make test` installs it, or "
                    "pip install -c attnlab/constraints.txt -e '.[nbgrader]'")
    assert found == NBGRADER, f"these tests are written for nbgrader {NBGRADER}, this is {found}"


def _env(course):
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    # nbgrader runs `alembic` for a new db: the venv's bin, where the extra put it
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), PATH=path)


def _nbgrader(course, *args):
    run = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=_env(course),
                         capture_output=True, text=True, timeout=3000)
    assert run.returncode == 0, f"nbgrader {' '.join(args)}:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    return run


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    _install()
    course = tmp_path_factory.mktemp("course")
    (course / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        f"c.CourseDirectory.root = {str(course)!r}\n"
        f"c.CourseDirectory.db_url = 'sqlite:///{course}/gradebook.db'\n"
        "c.ExecutePreprocessor.timeout = 900\n")
    submissions = {}  # (student, assignment) -> source notebook
    for exercise in EXERCISES:
        assignment = f"ex{exercise[:2]}"
        (course / "source" / assignment).mkdir(parents=True)
        shutil.copyfile(ROOT / "solutions" / f"{exercise}.ipynb", course / "source" / assignment / f"{exercise}.ipynb")
        submissions[("solution", assignment)] = ROOT / "solutions" / f"{exercise}.ipynb"
        submissions[("untouched", assignment)] = None  # the release, as generated
    submissions[("rebinds-check", "ex02")] = ROOT / "tests" / "hostile" / "nbgrader_check_rebound.ipynb"
    submissions[("unsets-env", "ex02")] = ROOT / "tests" / "hostile" / "nbgrader_env_unset.ipynb"
    submissions[("rebinds-autograde", "ex02")] = ROOT / "tests" / "hostile" / "nbgrader_autograde_rebound.ipynb"
    # the same, with cells carrying every part id of exercise 06: credited to neither, and ex02's cells in the
    # gradebook (where its kernel's rebound hidden tests wrote full marks) must still end at 0
    submissions[("misidentified", "ex02")] = _misidentified(course)
    # the untouched release where nbgrader looks, and the solution in a folder below it: the copy is never credited
    submissions[("nested-copy", "ex02")] = None
    # the students in one command (each nbgrader command is a process of its own); generate_assignment adds the
    # assignment to the gradebook itself (its create_assignment, on by default)
    (course / "students.csv").write_text("id\n" + "".join(f"{s}\n" for s in sorted({s for s, _ in submissions})))
    _nbgrader(course, "db", "student", "import", str(course / "students.csv"))
    for exercise in EXERCISES:
        _nbgrader(course, "generate_assignment", f"ex{exercise[:2]}", "--force")
    for (student, assignment), source in submissions.items():
        exercise = next(e for e in EXERCISES if e[:2] == assignment[2:])
        folder = course / "submitted" / student / assignment
        folder.mkdir(parents=True)
        shutil.copyfile(source or course / "release" / assignment / f"{exercise}.ipynb", folder / f"{exercise}.ipynb")
    nested = course / "submitted" / "nested-copy" / "ex02" / "old" / "02_queries_keys_values.ipynb"
    nested.parent.mkdir()
    shutil.copyfile(ROOT / "solutions" / "02_queries_keys_values.ipynb", nested)
    for exercise in EXERCISES:
        _nbgrader(course, "autograde", f"ex{exercise[:2]}", "--force")
    run = subprocess.run([sys.executable, "-m", "attnlab", "grade", str(course / "submitted"), "-j", "2",
                          "--csv", str(course / "attnlab.csv"), "--nbgrader-db", f"sqlite:///{course}/gradebook.db"],
                         env=_env(course), capture_output=True, text=True, timeout=3000)
    _nbgrader(course, "export")
    with open(course / "grades.csv") as f:
        nbgrader_scores = {(r["student_id"], r["assignment"]): float(r["raw_score"]) for r in csv.DictReader(f)}
    with open(course / "attnlab.csv") as f:   # the notebooks nbgrader grades: those in the assignment's own folder
        attnlab_scores = {(r["student"], r["assignment"]): float(r["score"]) for r in csv.DictReader(f)
                          if Path(r["path"]).parent.name == r["assignment"]}
    return {"course": course, "submissions": submissions, "nbgrader": nbgrader_scores, "attnlab": attnlab_scores,
            "run": run}


def _misidentified(course):
    import nbformat

    from attnlab.grading.parts import exercises

    nb = nbformat.read(str(ROOT / "tests" / "hostile" / "nbgrader_autograde_rebound.ipynb"), as_version=4)
    for part in exercises()["06_triton_primer"]:
        cell = nbformat.v4.new_markdown_cell(f"notes on {part}")
        cell.metadata["nbgrader"] = {"grade": False, "grade_id": f"{part}-answer-notes", "locked": False,
                                     "schema_version": 3, "solution": False}
        nb.cells.append(cell)
    path = course / "misidentified.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_the_release_is_the_generated_exercise(round_trip):
    import nbformat

    for exercise in EXERCISES:
        release = nbformat.read(str(round_trip["course"] / "release" / f"ex{exercise[:2]}" / f"{exercise}.ipynb"), 4)
        ours = nbformat.read(str(ROOT / "exercises" / f"{exercise}.ipynb"), 4)
        assert [c.source for c in release.cells] == [c.source for c in ours.cells]


def test_attnlab_grade_reads_nbgrader_s_layout(round_trip):
    # one problem, said and in the exit status: the notebook in ex02's slot whose cells are exercise 06's is credited
    # to neither (its file name is 02's), and every autograded cell of it gets 0
    # and the solved copy in a folder below nested-copy's ex02 is said and not credited
    problems = sorted(line for line in round_trip["run"].stderr.splitlines() if line.startswith("nbgrader:"))
    assert round_trip["run"].returncode == 1 and len(problems) == 2, round_trip["run"].stderr[-3000:]
    assert "misidentified" in problems[0] and "filed as 02_queries_keys_values" in problems[0] \
        and "06_triton_primer" in problems[0] and "0 points" in problems[0]
    assert "nested-copy/ex02/old/02_queries_keys_values.ipynb" in problems[1] and "not credited" in problems[1]
    assert set(round_trip["attnlab"]) == set(round_trip["submissions"])


def test_nbgrader_scores_equal_attnlab_grade_s(round_trip):
    # nbgrader's export has a row for every student and assignment; compare those that were submitted
    assert set(round_trip["submissions"]) <= set(round_trip["nbgrader"])
    submitted = {key: round_trip["nbgrader"][key] for key in round_trip["submissions"]}
    assert submitted == round_trip["attnlab"]


def test_solutions_score_full_and_cheats_score_nothing(round_trip):
    scores = {key: round_trip["nbgrader"][key] for key in round_trip["submissions"]}
    assert all(scores[("solution", a)] > 0 for a in {a for _, a in scores})
    for student in ("untouched", "rebinds-check", "unsets-env", "rebinds-autograde", "misidentified", "nested-copy"):
        assert all(v == 0 for (s, _), v in scores.items() if s == student), scores
