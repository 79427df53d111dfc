"""End to end: `attnlab grade` on real notebooks, each run in a fresh sandboxed Python process.

One module-scoped run grades every solution (full marks), every untouched exercise
(zero) and a few broken copies of solutions (syntax error, exception, endless loop,
sys.exit, a killed process, a redefined `check`, a wrong implementation), so the
processes start once per notebook and the notebooks are graded three at a time.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))

pytestmark = pytest.mark.slow


def _edit(source_name, edits, dest):
    """A copy of a solution with some cells' sources replaced: {grade_id: new source or callable}."""
    nb = nbformat.read(str(ROOT / "solutions" / source_name), as_version=4)
    by_id = {c.metadata["nbgrader"]["grade_id"]: c for c in nb.cells}
    for grade_id, change in edits.items():
        cell = by_id[grade_id]
        cell.source = change(cell.source) if callable(change) else change
    nbformat.write(nb, str(dest))
    return dest


BROKEN = {
    # part 1's function loops forever (only the grader's check calls it), part 2's experiment loops forever,
    # part 3 has a syntax error
    "02_syntax_and_loop.ipynb": ("02_queries_keys_values.ipynb", {
        "padding-mask-answer": "def padding_mask(lengths, max_len):\n    while True:\n        pass\n",
        "02-cell-06": "print('not calling it here')\n",
        "02-cell-11": "while True:\n    pass\n",
        "02-cell-16": "print('no experiment')\n",
        "attention-masks-answer": lambda s: s + "\n\ndef broken(:\n    pass\n",
    }),
    # part 1 raises, part 2 calls sys.exit, part 3 is fine
    "02_raise_and_exit.ipynb": ("02_queries_keys_values.ipynb", {
        "02-cell-06": "raise ValueError('a bug in my experiment')\n",
        "02-cell-11": "import sys\nsys.exit(3)\n",
    }),
    # part 1 is fine, part 2 redefines check to always pass (and breaks causal_mask), part 3 kills its process
    "02_cheat_and_kill.ipynb": ("02_queries_keys_values.ipynb", {
        "causal-mask-answer": ("def causal_mask(n_q, n_k, device=None):\n"
                               "    return torch.ones(n_q, n_k, dtype=torch.bool)\n\n\n"
                               "def check(part_id, namespace=None):\n    print(f'[PASS] {part_id}')\n"),
        "02-cell-16": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    }),
    # part 1 calls IPython's exit(), part 2 is wrong, part 3 is right but its check cell was deleted
    "03_scale_forgotten.ipynb": ("03_scaled_dot_product.ipynb", {
        "03-cell-06": "exit()\n",
        "scaled-attention-answer": ("def scaled_dot_product_attention(q, k, v, scale=None):\n"
                                    "    return softmax(q @ k.transpose(-2, -1), dim=-1) @ v\n"),
        "variance-experiment": "",
    }),
    # the experiment's own code takes the library's attention, which the part forbids (its syntax shows it)
    "01_library_attention.ipynb": ("01_soft_alignment.ipynb", {
        "alignment-crossing-answer": lambda s: "from attnlab.attention import masked_softmax\n" + s.replace(
            "    ### BEGIN SOLUTION\n", "    ### BEGIN SOLUTION\n    sm = masked_softmax\n", 1),
    }),
}


def _digest(paths):
    return {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


def _start_grading(paths, out, *extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "attnlab", "grade", *map(str, paths), "--json", str(out), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc):
    out, err = proc.communicate(timeout=900)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _grade(paths, out, *extra):
    return _finish(_start_grading(paths, out, *extra))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("graded")
    broken = {name: _edit(src, edits, tmp / name) for name, (src, edits) in BROKEN.items()}
    looping = broken.pop("02_syntax_and_loop.ipynb")
    paths = [*SOLUTIONS, *EXERCISES, *broken.values()]
    before = _digest(paths + [looping])
    # a learner's working folder: one finished exercise, one untouched
    work = tmp / "my-work"
    work.mkdir()
    (work / "05_quadratic_cost.ipynb").write_bytes((ROOT / "solutions" / "05_quadratic_cost.ipynb").read_bytes())
    (work / "01_soft_alignment.ipynb").write_bytes((ROOT / "exercises" / "01_soft_alignment.ipynb").read_bytes())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    progress = subprocess.Popen([sys.executable, "-m", "attnlab", "progress", str(work)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
    # the endless loop waits out its cell timeout alongside the others
    loop = _start_grading([looping], tmp / "loop.json", "--cell-timeout", "20")
    main = _grade(paths, tmp / "report.json", "--jobs", "2")
    loop = _finish(loop)
    progress = _finish(progress)
    after = _digest(paths + [looping])
    reports = {}
    for run, out in ((main, tmp / "report.json"), (loop, tmp / "loop.json")):
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        for nb in json.loads(out.read_text())["notebooks"]:
            reports[Path(nb["path"]).name if "solutions" not in nb["path"] else "solution:" + Path(nb["path"]).name] = nb
    return {"reports": reports, "stdout": main.stdout, "unchanged": before == after, "progress": progress}


def _parts(report):
    return {p["name"]: p for p in report["parts"]}


def test_learner_files_are_never_modified(graded):
    assert graded["unchanged"]


def test_json_report_has_the_documented_shape(graded):
    for nb in graded["reports"].values():
        assert {"path", "score", "max_score", "parts"} <= set(nb)
        assert nb["score"] == sum(p["points"] for p in nb["parts"])
        for p in nb["parts"]:
            assert {"name", "points", "max_points", "feedback"} <= set(p)
            assert 0 <= p["points"] <= p["max_points"]


def test_the_table_has_every_part_and_a_total(graded):
    out = graded["stdout"]
    assert "part" in out and "points" in out and "feedback" in out and "total" in out
    assert "attention-masks" in out and "block-sparse-loop" in out


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_every_solution_scores_full_marks(graded, path):
    report = graded["reports"]["solution:" + path.name]
    assert not report.get("error"), report
    assert len(report["parts"]) >= 5  # at least 4 graded parts and a written one
    assert report["score"] == report["max_score"] > 0, json.dumps(report, indent=1)


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_every_untouched_exercise_scores_zero(graded, path):
    report = graded["reports"][path.name]
    assert not report.get("error"), report
    assert report["score"] == 0 and report["max_score"] > 0
    for p in report["parts"]:
        if p.get("manual"):  # a written answer, graded by hand: reported, never scored here
            assert p["points"] == 0 and "no answer written yet" in p["feedback"], p
            continue
        assert "not implemented yet" in p["feedback"], p


def test_endless_loops_and_a_syntax_error_are_graded_with_reasons(graded):
    parts = _parts(graded["reports"]["02_syntax_and_loop.ipynb"])
    assert parts["padding-mask"]["points"] == 0
    assert "the check of your code did not finish within" in parts["padding-mask"]["feedback"]
    assert parts["causal-mask"]["points"] == 0 and "did not finish within" in parts["causal-mask"]["feedback"]
    assert parts["attention-masks"]["points"] == 0 and "SyntaxError" in parts["attention-masks"]["feedback"]


def test_exception_and_sys_exit_cost_only_their_parts(graded):
    parts = _parts(graded["reports"]["02_raise_and_exit.ipynb"])
    assert parts["padding-mask"]["points"] == 0
    assert "ValueError: a bug in my experiment" in parts["padding-mask"]["feedback"]
    assert parts["causal-mask"]["points"] == 0 and "sys.exit" in parts["causal-mask"]["feedback"]
    assert parts["attention-masks"]["points"] == parts["attention-masks"]["max_points"]


def test_redefined_check_and_killed_process_are_caught(graded):
    parts = _parts(graded["reports"]["02_cheat_and_kill.ipynb"])
    assert parts["padding-mask"]["points"] == parts["padding-mask"]["max_points"]
    # the notebook's own check() is feedback only: the grader checks causal_mask in its own process
    assert parts["causal-mask"]["points"] == 0 and "entries differ" in parts["causal-mask"]["feedback"]
    assert parts["attention-masks"]["points"] == 0
    assert "died or was killed" in parts["attention-masks"]["feedback"]


def test_exit_a_wrong_implementation_and_a_deleted_check_cell(graded):
    parts = _parts(graded["reports"]["03_scale_forgotten.ipynb"])
    assert parts["stable-softmax"]["points"] == 0 and "called exit()" in parts["stable-softmax"]["feedback"]
    assert parts["scaled-attention"]["points"] == 0
    assert "likely mistake (scale-forgotten)" in parts["scaled-attention"]["feedback"]
    assert parts["variance-experiment"]["points"] == parts["variance-experiment"]["max_points"]
    assert "check cell is missing" in parts["variance-experiment"]["feedback"]


def test_an_experiment_run_on_the_librarys_attention_scores_nothing(graded):
    parts = _parts(graded["reports"]["01_library_attention.ipynb"])
    crossing = parts["alignment-crossing"]
    assert crossing["points"] == 0 and "attnlab.attention.masked_softmax" in crossing["feedback"], crossing
    assert all(parts[p]["points"] == parts[p]["max_points"] for p in ("additive-score", "context-vector", "decode-step"))


def test_a_file_that_is_not_a_notebook_cannot_be_graded(tmp_path):
    bad = tmp_path / "01_soft_alignment.ipynb"
    bad.write_text("{ not json")
    run = _grade([bad], tmp_path / "r.json")
    assert run.returncode == 1
    assert "could not grade" in run.stdout
    assert json.loads((tmp_path / "r.json").read_text())["notebooks"][0]["error"]


def test_progress_shows_which_parts_pass(graded):
    run = graded["progress"]
    assert run.returncode == 0, run.stderr[-2000:]
    lines = {line.split()[0]: line for line in run.stdout.splitlines() if line[:2].isdigit()}
    assert "10/10" in lines["05_quadratic_cost"] and "[x] arithmetic-intensity" in lines["05_quadratic_cost"]
    assert "[w] prediction-explain" in lines["05_quadratic_cost"]  # a written answer: graded by hand
    assert "0/9" in lines["01_soft_alignment"] and "[ ] additive-score" in lines["01_soft_alignment"]
    assert "[ ] explain-crossing" in lines["01_soft_alignment"]
    assert "5 of 9 parts pass" in run.stdout
