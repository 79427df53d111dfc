"""``attnlab progress``: only the notebooks whose answers changed are graded again; a notebook as `attnlab start`
copied it is not graded at all; the cache lives outside the learner's folder; every mark is explained."""

import shutil
import time
from pathlib import Path

from attnlab.cli import main as cli
from attnlab.course import progress

ROOT = Path(__file__).resolve().parents[1]


def _fake_grader(calls):
    def grade(path, cell_timeout, timeout):
        calls.append(Path(path).name)
        return {"path": str(path), "score": 1, "max_score": 2, "parts": [
            {"name": "a", "points": 1, "max_points": 1}, {"name": "b", "points": 0, "max_points": 1},
            {"name": "why", "points": 0, "max_points": 0, "manual": True, "answer": "because"}]}
    return grade


def test_progress_grades_only_what_changed(tmp_path, monkeypatch, capsys):
    work, cache = tmp_path / "my-work", tmp_path / "cache"
    work.mkdir()
    for name in ("01_soft_alignment.ipynb", "06_triton_primer.ipynb"):
        shutil.copyfile(ROOT / "exercises" / name, work / name)
    monkeypatch.setenv("ATTNLAB_CACHE", str(cache))
    calls = []
    monkeypatch.setattr(progress, "grade_in_subprocess", _fake_grader(calls))
    before = {p.name: p.read_bytes() for p in work.iterdir()}

    assert cli(["progress", str(work), "--course", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert calls == [] and out.count("(not started)") == 2, out  # copies as `attnlab start` made them: no kernel
    assert "[w]" in out and "a written part with an answer" in out, out  # every mark is explained

    answered = work / "06_triton_primer.ipynb"
    answered.write_text(answered.read_text().replace("raise NotImplementedError()", "pass  # my answer", 1))
    assert cli(["progress", str(work), "--course", str(ROOT)]) == 0
    assert calls == ["06_triton_primer.ipynb"], calls
    capsys.readouterr()

    start = time.perf_counter()
    assert cli(["progress", str(work), "--course", str(ROOT)]) == 0  # nothing changed: nothing graded
    assert time.perf_counter() - start < 10
    out = capsys.readouterr().out
    assert calls == ["06_triton_primer.ipynb"] and "(unchanged since the last run)" in out, out
    assert "06_triton_primer           1/2   [x] a  [ ] b  [w] why" in out, out

    answered.write_text(answered.read_text().replace("pass  # my answer", "pass  # my better answer", 1))
    assert cli(["progress", str(work), "--course", str(ROOT)]) == 0
    assert calls == ["06_triton_primer.ipynb"] * 2  # changed again: graded again
    assert (cache / "progress.json").is_file() and not list(work.glob(".*"))  # the cache is not in my-work
    assert before["01_soft_alignment.ipynb"] == (work / "01_soft_alignment.ipynb").read_bytes()


def test_running_or_saving_a_notebook_does_not_count_as_a_change(tmp_path):
    import json

    nb = json.loads((ROOT / "exercises" / "02_queries_keys_values.ipynb").read_text())
    a = tmp_path / "a.ipynb"
    a.write_text(json.dumps(nb))
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [{"output_type": "stream", "name": "stdout", "text": "x"}], 3
    nb["metadata"]["widgets"] = {"state": {}}
    b = tmp_path / "b.ipynb"
    b.write_text(json.dumps(nb))
    assert progress.answers_of(a) == progress.answers_of(b)
