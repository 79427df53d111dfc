"""The grader stays small enough to read (issue 44): all of ``attnlab/grading`` at most 9,500 lines, and the
modules outside the exercise packages (the engine, the boundary, the commands) at most 4,800.

Lines as ``wc -l`` counts them, blank lines and docstrings included. Hints and the course's own commands are
not grading: they live in ``attnlab/course``.
"""

from pathlib import Path

GRADING = Path(__file__).resolve().parents[1] / "attnlab" / "grading"


def _lines(paths):
    return sum(len(p.read_text().splitlines()) for p in paths)


def test_the_grader_is_at_most_9500_lines_and_its_engine_and_boundary_4800():
    every = sorted(GRADING.rglob("*.py"))
    packages = [p for p in every if p.parent.parent.name == "exercises"]  # exercises/eNN/*.py
    assert packages and len(packages) < len(every)
    total, outside = _lines(every), _lines(every) - _lines(packages)
    assert total <= 9500, f"attnlab/grading has {total} lines (at most 9,500)"
    assert outside <= 4800, f"attnlab/grading outside the exercise packages has {outside} lines (at most 4,800)"
