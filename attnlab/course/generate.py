"""``attnlab generate``: write exercises/ from solutions/ (instructors).

solutions/NN_name.ipynb are the source notebooks. In each:

- a region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` becomes
  ``# YOUR CODE HERE`` + ``raise NotImplementedError()`` (``YOUR ANSWER HERE`` in
  markdown), at the indentation of the BEGIN line;
- a region between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` is dropped;
- outputs and execution counts are cleared.

A markdown cell holding ``<!-- manual: PART -->`` and a solution region is the written answer of a
manual part (nbgrader's manually graded answer: ``grade`` and ``solution``, the part's points).

Every cell gets nbgrader's schema-3 metadata, so an instructor can put solutions/
into nbgrader's ``source/`` folder unchanged: a cell with a solution region is an
autograded answer (``solution``), a cell that calls ``check("part-id")`` is an
autograder test (``grade``, ``locked``, the part's ``points``, ``grade_id`` = the part
id), every other cell is locked. The solutions get the same metadata (written
back to them, sources untouched), and the output is deterministic, so a test
can regenerate and compare: ``attnlab generate --check`` exits 1 when exercises/
or the solutions' metadata are stale.

Example: ``attnlab generate`` then ``git diff exercises/``.
"""

import re
import sys
from pathlib import Path

from attnlab.course import add_course_argument, find_course

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
CHECK_CALL = re.compile(r"""\bcheck\(\s*["']([A-Za-z0-9_-]+)["']""")
MANUAL_MARK = re.compile(r"<!--\s*manual:\s*([A-Za-z0-9_-]+)\s*-->")
SCHEMA_VERSION = 3


def _strip_region(source, begin, end, replacement):
    """Replace each begin/end region by ``replacement(indent)`` lines (None drops it)."""
    out, inside, found = [], False, False
    for number, line in enumerate(source.split("\n"), 1):
        stripped = line.strip()
        if stripped == begin:
            if inside:
                raise ValueError(f"line {number}: {begin} inside another {begin}")
            inside, found = True, True
            indent = line[: len(line) - len(line.lstrip())]
            if replacement is not None:
                out.extend(indent + r for r in replacement)
            continue
        if stripped == end:
            if not inside:
                raise ValueError(f"line {number}: {end} without {begin}")
            inside = False
            continue
        if not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{begin} is never closed by {end}")
    return "\n".join(out), found


def check_ids(source):
    """The part ids a cell's ``check("...")`` calls name."""
    return CHECK_CALL.findall(source)


def has_solution(cell):
    return any(line.strip() == BEGIN_SOLUTION for line in cell.source.split("\n"))


def annotate(nb, exercise, points):
    """Set nbgrader schema-3 metadata, cell ids and attnlab's exercise name on ``nb`` (in place).

    points: {part id: points}. Raises ValueError when the check cells do not name
    exactly the registered parts of ``exercise``, in order.
    """
    # the part a cell belongs to is the one whose check comes next
    next_part, parts_seen = [None] * len(nb.cells), []
    pending = None
    for i in range(len(nb.cells) - 1, -1, -1):
        cell = nb.cells[i]
        ids = check_ids(cell.source) if cell.cell_type == "code" else []
        if ids:
            pending = ids[0]
        next_part[i] = pending
    answer_count = {}
    for i, cell in enumerate(nb.cells):
        ids = check_ids(cell.source) if cell.cell_type == "code" else []
        meta = {"schema_version": SCHEMA_VERSION}
        manual = MANUAL_MARK.findall(cell.source) if cell.cell_type == "markdown" else []
        if manual:
            part = manual[0]
            if len(manual) != 1 or not has_solution(cell):
                raise ValueError(f"cell {i + 1}: a manual answer cell holds one <!-- manual: PART --> mark and a "
                                 f"{BEGIN_SOLUTION} ... {END_SOLUTION} region")
            if part not in points:
                raise ValueError(f"cell {i + 1}: <!-- manual: {part} --> names no part of {exercise}")
            parts_seen.append(part)
            meta.update(grade=True, solution=True, locked=False, grade_id=part, points=points[part])
        elif ids:
            if len(ids) != 1:
                raise ValueError(f"cell {i + 1}: one check per cell, found {ids}")
            part = ids[0]
            if part not in points:
                raise ValueError(f"cell {i + 1}: check({part!r}) names no part of {exercise}")
            parts_seen.append(part)
            meta.update(grade=True, solution=False, locked=True, grade_id=part, points=points[part])
        elif has_solution(cell):
            part = next_part[i] or "extra"
            answer_count[part] = answer_count.get(part, 0) + 1
            suffix = "" if answer_count[part] == 1 else f"-{answer_count[part]}"
            meta.update(grade=False, solution=True, locked=False, grade_id=f"{part}-answer{suffix}")
        else:
            meta.update(grade=False, solution=False, locked=True, grade_id=f"{exercise[:2]}-cell-{i + 1:02d}")
        cell.metadata = {"nbgrader": meta}
        if meta["locked"]:
            cell.metadata["editable"] = False
            cell.metadata["deletable"] = False
        elif meta["solution"]:
            cell.metadata["deletable"] = False
        cell.id = meta["grade_id"]
    if parts_seen != list(points):
        raise ValueError(f"{exercise}: the check cells name {parts_seen}, the registry has {list(points)}")
    from attnlab.grading.layout import demo_marks
    from attnlab.grading.parts import TABLE

    learner_names = {n for row in TABLE.get(exercise, []) for n in row.names}
    for i, demo in demo_marks(nb, list(points), learner_names).items():  # what `attnlab grade` leaves out of them
        nb.cells[i].metadata["attnlab"] = {"demo": demo}
    nb.metadata = {
        "attnlab": {"exercise": exercise},
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": nb.metadata.get("language_info", {"name": "python"}),
    }
    nb.nbformat, nb.nbformat_minor = 4, 5
    from attnlab.notebook_format import normalise

    return normalise(nb)  # as JupyterLab saves it: opening an exercise changes nothing


def clean(nb):
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def exercise_from_solution(solution):
    """The exercise notebook for an annotated solution notebook (a new object)."""
    import copy

    nb = copy.deepcopy(solution)
    for i, cell in enumerate(nb.cells):
        try:
            if cell.cell_type == "code":
                cell.source, _ = _strip_region(cell.source, BEGIN_SOLUTION, END_SOLUTION,
                                               ["# YOUR CODE HERE", "raise NotImplementedError()"])
                cell.source, _ = _strip_region(cell.source, BEGIN_HIDDEN, END_HIDDEN, None)
            else:
                cell.source, _ = _strip_region(cell.source, BEGIN_SOLUTION, END_SOLUTION, ["YOUR ANSWER HERE"])
        except ValueError as exc:
            raise ValueError(f"cell {i + 1}: {exc}") from None
    return clean(nb)


def render(nb):
    """Deterministic text of a notebook (sorted keys, one-space indent, final newline)."""
    import nbformat

    return nbformat.writes(nb, version=4) + "\n"


def build(course):
    """{path: text} of every annotated solution and generated exercise of ``course``."""
    import nbformat

    from attnlab.grading.parts import exercises, points

    EXERCISES, POINTS = exercises(), points()
    course = Path(course)
    solutions = sorted((course / "solutions").glob("[0-9][0-9]_*.ipynb"))
    if not solutions:
        raise FileNotFoundError(f"no solutions/NN_*.ipynb in {course}")
    out = {}
    for path in solutions:
        exercise = path.stem
        if exercise not in EXERCISES:
            raise ValueError(f"{path.name}: no exercise named {exercise!r} in attnlab/grading/parts.py")
        nb = nbformat.read(str(path), as_version=4)
        try:
            annotate(clean(nb), exercise, {pid: POINTS[pid] for pid in EXERCISES[exercise]})
            exercise_nb = exercise_from_solution(nb)
        except ValueError as exc:
            raise ValueError(f"{path.name}: {exc}") from None
        out[path] = render(nb)
        out[course / "exercises" / path.name] = render(exercise_nb)
    return out


def add_arguments(parser):
    add_course_argument(parser)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if exercises/ or the solutions' metadata are out of date")


def run(args):
    try:
        course = find_course(args.course)
        files = build(course)
    except (FileNotFoundError, ValueError) as exc:
        print(f"attnlab generate: {exc}", file=sys.stderr)
        return 2
    stale = [p for p, text in files.items() if not p.is_file() or p.read_text() != text]
    expected_exercises = {p for p in files if p.parent.name == "exercises"}
    extra = sorted(p for p in (course / "exercises").glob("*.ipynb") if p not in expected_exercises)
    if args.check:
        for p in stale:
            print(f"out of date: {p.relative_to(course)}")
        for p in extra:
            print(f"not generated from a solution: {p.relative_to(course)}")
        if stale or extra:
            print("run `attnlab generate` to update", file=sys.stderr)
            return 1
        print(f"up to date: {len(files) // 2} solutions and their exercises")
        return 0
    (course / "exercises").mkdir(exist_ok=True)
    for p in stale:
        p.write_text(files[p])
        print(f"wrote {p.relative_to(course)}")
    for p in extra:
        print(f"note: {p.relative_to(course)} has no solution notebook (left alone)")
    print(f"{len(files) // 2} exercises up to date in {course / 'exercises'}")
    return 0
