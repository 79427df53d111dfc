"""Batch grading's bookkeeping without kernels: finding notebooks, students, exercise identity,
part ownership, the frames that cross between grader and sandboxed processes, the syntax check of shortcuts, CSV and Gradescope output."""

import io
import math

import nbformat
import pytest
import torch

from attnlab.grading.sandbox import frames, isolated

from attnlab.grading.commands import grade

from attnlab.grading import layout, shortcuts
from attnlab.grading.parts import exercises, forbidden

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_discover_searches_recursively_and_says_what_it_skips(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "my work.ipynb").write_text("{}")
    (tmp_path / "a" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "a" / ".ipynb_checkpoints" / "x-checkpoint.ipynb").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "empty").mkdir()
    found, skipped = grade.discover([tmp_path / "a", tmp_path / "notes.txt", tmp_path / "empty", tmp_path / "nope"])
    assert [p.name for p in found] == ["my work.ipynb"]
    reasons = {Path(s["path"]).name: s["reason"] for s in skipped}
    assert "checkpoint" in reasons["x-checkpoint.ipynb"]
    assert "not a notebook" in reasons["notes.txt"]
    assert "no notebook" in reasons["empty"]
    assert "does not exist" in reasons["nope"]


def test_students_come_from_nbgrader_s_layout(tmp_path):
    nb = tmp_path / "course" / "submitted" / "alice" / "ex02" / "02_queries_keys_values.ipynb"
    assert grade.who(nb) == ("alice", "ex02")
    assert grade.who(tmp_path / "bob" / "02.ipynb") == ("bob", "")


def test_the_exercise_comes_from_the_cells_and_a_wrong_file_name_warns():
    nb = nbformat.read(str(ROOT / "solutions" / "03_scaled_dot_product.ipynb"), 4)
    assert layout.identify(nb, "homework.ipynb") == ("03_scaled_dot_product", [])
    exercise, warnings = layout.identify(nb, "05_quadratic_cost.ipynb")
    assert exercise == "03_scaled_dot_product" and "file name suggests 05_quadratic_cost" in warnings[0]
    nb.metadata["attnlab"]["exercise"] = "01_soft_alignment"
    exercise, warnings = layout.identify(nb, "x.ipynb")
    assert exercise == "03_scaled_dot_product" and "metadata says 01_soft_alignment" in warnings[0]


def test_cells_belong_to_their_part_wherever_they_are():
    nb = nbformat.read(str(ROOT / "exercises" / "02_queries_keys_values.ipynb"), 4)
    parts = exercises()["02_queries_keys_values"]
    canonical = layout._layout([layout._grade_id(c) for c in nb.cells], parts)
    added = nbformat.v4.new_code_cell("raise ValueError()")
    nb.cells.insert(0, nbformat.v4.new_code_cell("x = 1"))  # above every answer cell: no part
    nb.cells = nb.cells[:1] + nb.cells[1:][::-1]  # any order
    last_answer = max(i for i, c in enumerate(nb.cells) if "-answer" in (layout._grade_id(c) or ""))
    nb.cells.insert(last_answer + 1, added)
    nb.cells.append(nbformat.v4.new_code_cell("def causal_mask(a, b):\n    pass"))
    owner = layout.owners(nb, parts, canonical)
    by_id = {layout._grade_id(c): o for c, o in zip(nb.cells, owner)}
    assert by_id["padding-mask-answer"] == "padding-mask" and by_id["02-cell-06"] == "padding-mask"
    assert by_id["02-cell-02"] == "setup" and by_id["02-cell-16"] == "attention-masks"
    # a cell without a grade_id belongs to the answer cell above it (here the reversed notebook's last: part 1's)
    above = layout._grade_id(nb.cells[last_answer]).split("-answer")[0]
    assert owner[0] is None and owner[last_answer + 1] == above and owner[-1] == above


def _round_trip(value):
    stream = io.BytesIO()
    isolated._send(stream, value)
    stream.seek(0)
    return isolated._receive(stream)


def test_what_crosses_round_trips_and_refuses_code():
    value = {"t": torch.arange(6.0).view(2, 3), "b": torch.tensor([True, False]), "x": (1, 2.5, float("nan")),
             "h": torch.ones(2, dtype=torch.bfloat16), "n": None, "s": "ok", "big": 2**70}
    back = _round_trip(value)
    assert torch.equal(back["t"], value["t"]) and torch.equal(back["b"], value["b"])
    assert back["x"][:2] == (1, 2.5) and math.isnan(back["x"][2]) and back["h"].dtype == torch.bfloat16
    assert back["n"] is None and back["s"] == "ok" and back["big"] == float(2**70)
    assert isinstance(_round_trip({"f": lambda: 0})["f"], frames.Unsupported)
    import pickle
    import struct

    class Evil:
        def __reduce__(self):
            return (print, ("ran code",))

    buffer = io.BytesIO()
    torch.save({"x": Evil()}, buffer)
    frame = io.BytesIO(struct.pack("<Q", len(buffer.getvalue())) + buffer.getvalue())
    with pytest.raises(pickle.UnpicklingError):  # a pickle that runs code is refused
        isolated._receive(frame)
    with pytest.raises(ValueError):  # a frame larger than the limit is not read
        isolated._receive(io.BytesIO(struct.pack("<Q", 2**40)))


def test_the_syntax_check_resolves_imports():
    imports = "import torch\nimport torch.nn.functional as F\nfrom attnlab.grading import specs\nimport attnlab\n"
    pats = forbidden("scaled-attention")

    def found(src):
        return [n for n, _ in shortcuts.uses([src], pats, [imports, src])]

    assert found("def f(x):\n    return torch.softmax(x, -1)") == ["torch.softmax"]
    assert found("def f(x):\n    return x.softmax(-1)") == ["torch.Tensor.softmax"]
    assert found("def f(q):\n    return F.scaled_dot_product_attention(q, q, q)") == [
        "torch.nn.functional.scaled_dot_product_attention"]
    assert found("def f(q):\n    return attnlab.scaled_dot_product_attention(q, q, q)") == [
        "attnlab.attention.scaled_dot_product_attention"]
    assert found("from attnlab.grading.exercises.e03.spec import softmax as s\n") == ["attnlab.grading.exercises.e03.spec.softmax"]
    assert found("def f(x):\n    e = (x - x.amax(-1, keepdim=True)).exp()\n    return e / e.sum(-1, keepdim=True)") == []


def test_csv_and_gradescope_outputs():
    reports = [{"path": "s/alice/ex02/02.ipynb", "student": "alice", "assignment": "ex02",
                "exercise": "02_queries_keys_values", "score": 1, "max_score": 5,
                "parts": [{"name": "padding-mask", "points": 1, "max_points": 1, "feedback": "ok"},
                          {"name": "causal-mask", "points": 0, "max_points": 4, "feedback": "wrong"}]},
               {"path": "s/bob/ex02/x.ipynb", "student": "bob", "score": 0, "max_score": 0, "parts": [],
                "error": "could not read"}]
    lines = grade.csv_text(reports).splitlines()
    assert lines[0] == "student,assignment,exercise,score,max_score,path,error"
    assert lines[1].startswith("alice,ex02,02_queries_keys_values,1,5,")
    doc = grade.gradescope_doc(reports, [{"path": "y.txt", "reason": "not a notebook (.ipynb)"}])
    assert doc["score"] == 1
    assert {t["name"]: t["score"] for t in doc["tests"]} == {
        "02_queries_keys_values: padding-mask": 1, "02_queries_keys_values: causal-mask": 0, "x: could not grade": 0}
    assert all({"name", "score", "max_score", "output"} <= set(t) for t in doc["tests"])
    assert "y.txt" in doc["output"]


def test_hidden_tests_grade_submissions_but_not_the_course_s_own_solutions(tmp_path, monkeypatch, capsys):
    # nbval and instructors run solutions/ top to bottom: its hidden tests do not grade the source again
    # (tests/test_grading_notebooks.py does); anywhere else (nbgrader's autograded/ folders) they grade
    from attnlab.grading.commands import nbgrader

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root / "solutions")
    assert nbgrader._is_course_source(root / "solutions")
    nbgrader.autograde("causal-mask", str(root / "solutions"))
    assert "the course's own solution notebook" in capsys.readouterr().out
    assert not nbgrader._is_course_source(tmp_path)
    with pytest.raises(FileNotFoundError):
        nbgrader.autograde("causal-mask", str(tmp_path))  # an empty folder: no submission to grade


def test_the_functions_process_runs_the_learner_s_cells_and_given_definitions_not_demos():
    from attnlab.grading.checks import PARTS

    nb = nbformat.read(str(ROOT / "exercises" / "06_triton_primer.ipynb"), 4)
    exercise = "06_triton_primer"
    parts = exercises()[exercise]
    given = layout.given_sources(exercise)
    by_id = {layout._grade_id(c): i for i, c in enumerate(nb.cells)}
    nb.cells[by_id["06-cell-05"]].source += "\nprint('edited: now the learner s')\n"
    owner = layout.owners(nb, parts, layout.canonical_layout(exercise, parts))
    names = {n for p in parts if p in PARTS for n in PARTS[p].names}
    runs = dict(layout.to_run(nb, owner, given, layout.given_demos(exercise), parts, names))
    assert by_id["06-cell-02"] in runs and by_id["masked-scale-answer"] in runs  # setup, an answer cell
    assert by_id["masked-scale"] not in runs  # a check cell
    assert runs[by_id["06-cell-05"]] == nb.cells[by_id["06-cell-05"]].source  # an edited given cell: whole
    matmul = runs[by_id["06-cell-29"]]  # the given wrapper matmul_traffic needs runs, its demo does not
    assert "def matmul(" in matmul and "print" not in matmul and "allclose" not in matmul
    assert by_id["06-cell-37"] not in runs  # a demo of matmul_traffic, nothing defined: not run at all


def test_demos_are_marked_when_the_exercise_is_generated_and_read_from_the_course_s_copy():
    """``attnlab generate`` marks each given cell's demo statements in the exercise (``attnlab.demo``); the grader
    reads the marks of the course's copy, so a submission that unmarks its demos (or marks a definition) changes
    nothing that runs."""
    from attnlab.grading.checks import PARTS

    exercise = "06_triton_primer"
    nb = nbformat.read(str(ROOT / "exercises" / f"{exercise}.ipynb"), 4)
    parts = exercises()[exercise]
    names = {n for p in parts if p in PARTS for n in PARTS[p].names}
    marked = {layout._grade_id(nb.cells[i]): d for i, d in layout.demo_marks(nb, parts, names).items()}
    assert marked == layout.given_demos(exercise) and marked["06-cell-37"]  # what generate stored, and a demo
    assert all(nb.cells[i].metadata.get("attnlab", {}).get("demo") == marked.get(layout._grade_id(c))
               for i, c in enumerate(nb.cells) if layout._grade_id(c) in marked)
    owner = layout.owners(nb, parts, layout.canonical_layout(exercise, parts))
    given = layout.given_sources(exercise)
    before = layout.to_run(nb, owner, given, layout.given_demos(exercise), parts, names)
    for c in nb.cells:  # the learner's copy: every mark dropped, a definition marked instead
        c.metadata.pop("attnlab", None)
    nb.cells[[layout._grade_id(c) for c in nb.cells].index("06-cell-29")].metadata["attnlab"] = {"demo": [0]}
    assert layout.to_run(nb, owner, given, layout.given_demos(exercise), parts, names) == before


def test_the_inline_check_reads_the_cells_the_learner_ran_as_the_grader_reads_the_file():
    # IPython's In: a given cell (exercise 01's data cell imports the course's RNNsearch) is not the learner's even
    # when the answer reads a name it defines; an answer the learner fixed is read in its latest version; a name
    # captured in another cell is followed
    import types

    from attnlab.grading.layout import given_sources

    given = list(given_sources("01_soft_alignment").values())
    data = next(s for s in given if "import RNNsearch" in s)
    patterns = forbidden("context-vector")
    assert shortcuts.uses([data], patterns)  # the library's model: forbidden in this part's own code
    first = "import torch\ndef context_vector(s, h, mask=None):\n    return torch.softmax(s, -1), SWAPS\n"
    fixed = "def context_vector(s, h, mask=None):\n    e = s.exp()\n    return e / e.sum(-1, keepdim=True), SWAPS\n"
    ns = {"In": ["", data, first, fixed], "context_vector": types.SimpleNamespace()}
    assert shortcuts.in_namespace(ns, ["context_vector"], patterns, given) == []
    answer = "def context_vector(s, h, mask=None):\n    return RNNsearch, SWAPS\n"
    reads_model = {"In": ["", data, answer]}
    # the answer reads the course's model, which the given cell imports: the grader resolves it through the given
    # cells (all of the notebook's code) and so does the inline check
    assert shortcuts.uses([answer], patterns, given + [answer]) != []
    assert shortcuts.in_namespace(reads_model, ["context_vector"], patterns, given) != []
    assert shortcuts.in_namespace(ns, ["context_vector"], patterns) == []  # SWAPS's statements import no model
    ns["In"] += ["import torch\n_sm = torch.softmax\n", "def context_vector(s, h, mask=None):\n    return _sm(s, -1)\n"]
    assert [n for n, _ in shortcuts.in_namespace(ns, ["context_vector"], patterns, given)] == ["torch.softmax"]
    assert shortcuts.uses(["m = __import__('attnlab.iomodel')\n"], patterns) == [("builtins.__import__", 1)]
