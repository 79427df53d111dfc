"""exercises/ is what `attnlab generate` makes of solutions/; nbgrader metadata; working copies; finding the course."""

import re
from pathlib import Path

import nbformat
import pytest

from attnlab.cli import main as cli
from attnlab.course import generate
from attnlab.course import progress
from attnlab.course import find_course
from attnlab.grading.parts import TABLE, exercises, points

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))


def test_there_is_one_exercise_per_lesson():
    names = [p.stem for p in SOLUTIONS]
    assert names == list(TABLE) == [p.stem for p in EXERCISES]
    # the lessons after 00_start_here, by their own names: every lesson has its exercise, of the same name
    lessons = sorted(p.stem for p in (ROOT / "lessons").glob("[0-9][0-9]_*.ipynb") if not p.stem.startswith("00"))
    assert names == lessons, f"exercises {names} are not the lessons {lessons}"


def test_exercises_and_solutions_are_what_generation_gives():
    built = generate.build(ROOT)
    stale = [str(p.relative_to(ROOT)) for p, text in built.items() if p.read_text() != text]
    assert not stale, f"run `attnlab generate`: {stale}"
    assert cli(["generate", "--check", "--course", str(ROOT)]) == 0


def test_generate_check_reports_a_stale_exercise(tmp_path, capsys):
    for folder in ("solutions", "exercises"):
        (tmp_path / folder).mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    src = SOLUTIONS[1]
    (tmp_path / "solutions" / src.name).write_text(src.read_text())
    assert cli(["generate", "--check", "--course", str(tmp_path)]) == 1
    assert "out of date: exercises/" in capsys.readouterr().out
    assert cli(["generate", "--course", str(tmp_path)]) == 0
    assert (tmp_path / "exercises" / src.name).read_text() == (ROOT / "exercises" / src.name).read_text()
    assert cli(["generate", "--check", "--course", str(tmp_path)]) == 0


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_exercise_has_stubs_and_no_solutions_hidden_tests_or_outputs(path):
    text = path.read_text()
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "HIDDEN TESTS"):
        assert marker not in text
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    answers = [c for c in nb.cells if c.metadata["nbgrader"]["solution"] and c.cell_type == "code"]
    assert answers and all("# YOUR CODE HERE\n" in c.source and "raise NotImplementedError()" in c.source
                           if c.cell_type == "code" else "<!-- manual:" in c.source and "YOUR ANSWER HERE" in c.source
                           for c in answers)
    written = [c for c in nb.cells if c.metadata["nbgrader"]["solution"] and c.cell_type == "markdown"]
    assert all("YOUR ANSWER HERE" in c.source for c in written)  # a manual part's answer cell
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None


@pytest.mark.parametrize("path", SOLUTIONS + EXERCISES, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_cells_carry_nbgrader_schema_3_metadata(path):
    nb = nbformat.read(str(path), as_version=4)
    assert nb.metadata["attnlab"]["exercise"] == path.stem
    ids = []
    graded = {}
    for c in nb.cells:
        meta = c.metadata["nbgrader"]
        assert meta["schema_version"] == 3
        assert {"grade", "solution", "locked", "grade_id"} <= set(meta)
        assert re.fullmatch(r"[A-Za-z0-9_-]+", meta["grade_id"])
        ids.append(meta["grade_id"])
        if meta["grade"] and c.cell_type == "markdown":  # a manual part's written answer (graded by hand)
            assert meta["solution"] and not meta["locked"] and f"<!-- manual: {meta['grade_id']} -->" in c.source
            graded[meta["grade_id"]] = meta["points"]
        elif meta["grade"]:
            assert meta["locked"] and not meta["solution"] and c.cell_type == "code"
            assert f'check("{meta["grade_id"]}")' in c.source
            graded[meta["grade_id"]] = meta["points"]
        elif meta["solution"]:
            assert not meta["locked"]
        else:
            assert meta["locked"]
    assert len(ids) == len(set(ids))
    assert graded == {p: points()[p] for p in exercises()[path.stem]}


def test_solution_regions_keep_their_indentation():
    src = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n"
    out, found = generate._strip_region(src, generate.BEGIN_SOLUTION, generate.END_SOLUTION,
                                        ["# YOUR CODE HERE", "raise NotImplementedError()"])
    assert found
    assert out == "def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError()\n"
    hidden = "check('x')\n### BEGIN HIDDEN TESTS\nassert f(1) == 2\n### END HIDDEN TESTS"
    assert generate._strip_region(hidden, generate.BEGIN_HIDDEN, generate.END_HIDDEN, None)[0] == "check('x')"
    with pytest.raises(ValueError, match="never closed"):
        generate._strip_region("### BEGIN SOLUTION\nx = 1", generate.BEGIN_SOLUTION, generate.END_SOLUTION, [])


def test_check_cells_must_match_the_parts_table():
    nb = nbformat.read(str(SOLUTIONS[0]), as_version=4)
    nb.cells = [c for c in nb.cells if 'check("decode-step")' not in c.source]
    with pytest.raises(ValueError, match="registry"):
        generate.annotate(nb, SOLUTIONS[0].stem, {p: points()[p] for p in exercises()[SOLUTIONS[0].stem]})


def test_start_copies_and_never_overwrites(tmp_path, capsys):
    work = tmp_path / "my-work"
    assert cli(["start", str(work), "--course", str(ROOT)]) == 0
    assert sorted(p.name for p in work.glob("*.ipynb")) == [p.name for p in EXERCISES]
    mine = work / EXERCISES[0].name
    mine.write_text("my own work")
    (work / EXERCISES[1].name).unlink()  # a learner who wants a fresh copy of one exercise
    capsys.readouterr()
    assert cli(["start", str(work), "--course", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert mine.read_text() == "my own work"
    assert f"kept    {EXERCISES[0].name}" in out and f"copied  {EXERCISES[1].name}" in out
    assert f"1 copied, {len(EXERCISES) - 1} kept" in out
    # the command it says opens that folder, not the course's lessons/
    import re
    import shlex

    from attnlab.lab import command

    said = shlex.split(re.search(r"`attnlab lab (--dir [^`]+)`", out).group(1))
    cmd = command(said[1], no_browser=True)
    assert f"--ServerApp.root_dir={work.parent}" in cmd and "--LabApp.default_url=/lab/tree/my-work" in cmd


def test_the_course_is_found_from_inside_it_and_by_option(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNLAB_COURSE", raising=False)
    assert find_course(start=ROOT / "exercises") == ROOT
    assert find_course(str(ROOT)) == ROOT
    with pytest.raises(FileNotFoundError, match="--course"):
        find_course(str(tmp_path))
    monkeypatch.setenv("ATTNLAB_COURSE", str(ROOT))
    assert find_course(start=tmp_path) == ROOT


def test_progress_summary_and_empty_folder(tmp_path, capsys):
    report = {"path": "my-work/02_queries_keys_values.ipynb", "score": 1, "max_score": 5, "parts": [
        {"name": "padding-mask", "points": 1, "max_points": 1, "feedback": ""},
        {"name": "causal-mask", "points": 0, "max_points": 1, "feedback": ""}]}
    line = progress.summarize(report)
    assert line.startswith("02_queries_keys_values") and "1/5" in line
    assert "[x] padding-mask" in line and "[ ] causal-mask" in line
    assert cli(["progress", str(tmp_path)]) == 2
    assert "attnlab start" in capsys.readouterr().err


def test_grade_format_report_is_a_table():
    from attnlab.grading.commands.grade import format_report

    text = format_report({"path": "x.ipynb", "score": 1, "max_score": 3, "parts": [
        {"name": "a", "points": 1, "max_points": 1, "feedback": "fine"},
        {"name": "b", "points": 0, "max_points": 2, "feedback": "wrong\n    likely mistake (k): m"}]})
    lines = text.splitlines()
    assert lines[1].split() == ["part", "points", "feedback"]
    assert lines[-1].split() == ["total", "1/3"]
    assert any("likely mistake (k)" in ln for ln in lines)
