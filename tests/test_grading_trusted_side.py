"""The trusted side reads untrusted input safely: names, paths and texts a submission controls never
run code in the grader, never name another student, never rewrite a terminal line or a spreadsheet,
and a notebook counted twice on Gradescope counts once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import triton
import triton.language as tl

from attnlab.grading.commands import grade

from attnlab.grading import reports, sandbox, scoring

from attnlab.grading.sandbox import runner

ROOT = Path(__file__).resolve().parents[1]


def test_the_student_comes_from_the_first_submitted_folder(tmp_path):
    # a submission that makes submitted/bob/ex03/ inside its own folder is still alice's ex02
    nb = tmp_path / "submitted" / "alice" / "ex02" / "submitted" / "bob" / "ex03" / "02.ipynb"
    assert grade.who(nb) == ("alice", "ex02")


def test_csv_cells_a_spreadsheet_would_run_are_escaped():
    text = grade.csv_text([{"path": "-x.ipynb", "student": "=HYPERLINK(\"http://evil\")", "assignment": "+1",
                            "exercise": "@SUM(A1)", "score": 0, "max_score": 9, "error": "\tdanger"}])
    row = text.splitlines()[1]
    assert "'=HYPERLINK" in row and "'+1" in row and "'@SUM" in row and "'-x.ipynb" in row
    assert ",=" not in row and ",+" not in row and ",@" not in row


def test_control_characters_never_reach_the_terminal_or_a_file():
    evil = "x\r\x1b[2K  total                9/9\x1b[0m\u202e"
    report = {"path": f"{evil}.ipynb", "score": 0, "max_score": 3, "warnings": [evil], "notes": [evil],
              "parts": [{"name": evil, "points": 0, "max_points": 3, "feedback": f"line one {evil}\nline two"}]}
    text = grade.format_report(report)
    assert "\r" not in text and "\x1b" not in text and "\u202e" not in text
    assert all(not line.startswith("  total ") or line.endswith("0/3 ") for line in text.splitlines())
    assert any(line.startswith("    ") and line.strip() == "line two" for line in text.splitlines())
    doc = grade.gradescope_doc([dict(report, exercise="02_queries_keys_values")], [])
    assert "\x1b" not in json.dumps(doc) and "\\u001b" not in json.dumps(doc)
    assert reports.safe_text("a\nb") == "a b" and reports.safe_text("a\nb", newlines=True) == "a\nb"


def test_gradescope_counts_each_exercise_once():
    def rep(path, score):
        return {"path": path, "exercise": "02_queries_keys_values", "score": score, "max_score": 9,
                "parts": [{"name": "padding-mask", "points": score, "max_points": 9, "feedback": ""}]}

    doc = grade.gradescope_doc([rep("a/02 copy.ipynb", 9), rep("a/02_queries_keys_values.ipynb", 4),
                                rep("a/02 again.ipynb", 9)], [])
    assert doc["score"] == 4  # the exercise's own file, once; the copies are listed, not added
    assert len(doc["tests"]) == 1
    assert doc["output"].count("not counted") == 2 and "02 copy.ipynb" in doc["output"]


def test_the_grader_credits_only_what_the_instructor_names():
    # Gradescope summed every exercise it found (a partial 03 beside a solved 02 scored 11 of 8)
    from attnlab.grading.layout import manifest

    assert manifest(["03"]) == ["03_scaled_dot_product"] and manifest(["02_queries_keys_values,3"]) == [
        "02_queries_keys_values", "03_scaled_dot_product"]
    with pytest.raises(ValueError, match="--exercise"):
        manifest(["99"])

    def rep(path, exercise, score, most):
        return {"path": path, "exercise": exercise, "score": score, "max_score": most,
                "parts": [{"name": "a-part", "points": score, "max_points": most, "feedback": ""}]}

    solved_02, partial_03 = rep("s/02_queries_keys_values.ipynb", "02_queries_keys_values", 9, 9), \
        rep("s/03_scaled_dot_product.ipynb", "03_scaled_dot_product", 2, 7)
    doc = grade.gradescope_doc([solved_02, partial_03], [], expected=["03_scaled_dot_product"])
    assert doc["score"] == 2 and [t["name"] for t in doc["tests"]] == ["03_scaled_dot_product: a-part"]
    assert "not one this assignment grades" in doc["output"] and "02_queries_keys_values.ipynb" in doc["output"]
    doc = grade.gradescope_doc([solved_02], [], expected=["03_scaled_dot_product"])
    assert doc["score"] == 0 and doc["tests"][0]["name"] == "03_scaled_dot_product: no notebook" \
        and doc["tests"][0]["max_score"] > 0


def test_gradescope_output_needs_the_assignment_s_exercise(tmp_path, capsys):
    from attnlab.cli import main as cli

    assert cli(["grade", str(tmp_path), "--gradescope", str(tmp_path / "results.json")]) == 2
    assert "--exercise" in capsys.readouterr().err and not (tmp_path / "results.json").exists()
    assert cli(["grade", str(tmp_path), "--exercise", "99"]) == 2


def test_a_notebook_filed_in_another_exercise_s_slot_is_not_credited(tmp_path):
    # an exercise-02 notebook (solved) filed as 05_...: credited to neither, and said why
    nb = nbformat.read(str(ROOT / "solutions" / "02_queries_keys_values.ipynb"), as_version=4)
    path = tmp_path / "05_quadratic_cost.ipynb"
    nbformat.write(nb, str(path))
    report = scoring.grade_notebook(path)
    assert report["score"] == 0 and "filed as 05_quadratic_cost" in report["error"], report
    assert "02_queries_keys_values" in report["error"]


def test_the_manual_part_says_1_point_not_1_points():
    assert reports.plural(1, "point") == "1 point" and reports.plural(2, "point") == "2 points"


def test_a_symlinked_notebook_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the first bytes of a file the submission may not read")
    link = tmp_path / "02_queries_keys_values.ipynb"
    link.symlink_to(secret)
    report = scoring.grade_notebook(link)
    assert "could not read the notebook" in report["error"] and "first bytes" not in json.dumps(report)
    with pytest.raises(OSError):
        sandbox.private_copy(link, tmp_path / "copy")


@pytest.mark.slow
def test_a_submission_s_own_modules_never_run_in_the_worker(tmp_path):
    """Grading from inside the submission's folder: its nbformat/ is not imported by the trusted worker."""
    marker = tmp_path / "ran"
    fake = tmp_path / "nbformat"
    fake.mkdir()
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('the submission ran in the grader')\n")
    nb = nbformat.read(str(ROOT / "exercises" / "01_soft_alignment.ipynb"), as_version=4)
    nbformat.write(nb, str(tmp_path / "01_soft_alignment.ipynb"))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        report = runner.grade_in_subprocess(Path("01_soft_alignment.ipynb"), timeout=300)
    finally:
        os.chdir(cwd)
    assert not marker.exists()
    assert not report.get("error") and report["score"] == 0, report
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "attnlab", "grade", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0


def test_a_frame_of_shared_lists_or_meta_tensors_is_not_believed():
    import io
    import struct

    import torch

    from attnlab.grading.sandbox import frames

    def received(obj):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return frames._receive(io.BytesIO(struct.pack("<Q", len(buffer.getvalue())) + buffer.getvalue()))

    got = received({"out": torch.empty(3, 4, device="meta"), "fine": torch.ones(2)})
    assert isinstance(got["out"], frames.Unsupported) and "meta device" in got["out"].type_name
    assert torch.equal(got["fine"], torch.ones(2))
    repeated = received(torch.ones(1).expand(600_000_000))   # 4 bytes claiming 600 million values (2.4 GB)
    assert isinstance(repeated, frames.Unsupported) and "repeats its memory" in repeated.type_name
    nested = [1]
    for _ in range(24):  # 1.5 KB on the wire, 2**24 values unfolded
        nested = [nested, nested]
    with pytest.raises(ValueError, match="too many values"):
        received(nested)


@pytest.mark.skipif(sandbox.bwrap() is None, reason="no bubblewrap on this machine")
def test_the_references_are_hidden_from_the_sandbox_as_source_and_as_bytecode(tmp_path):
    """A byte-compiling install, or a checkout the grader wrote __pycache__ into, holds spec.pyc beside spec.py."""
    import importlib.util
    import py_compile

    from attnlab.grading import exercises

    spec = Path(exercises.__file__).resolve().parent / "e03" / "spec.py"
    try:
        py_compile.compile(str(spec), cfile=importlib.util.cache_from_source(str(spec)), doraise=True)
    except OSError:
        pytest.skip("the exercise packages are read-only here")
    probe = ("import glob, os\n"
             f"root = {str(spec.parent.parent)!r}\n"
             "print(sorted(glob.glob(root + '/**/*.pyc', recursive=True)))\n"
             f"print(os.path.getsize({str(spec)!r}), os.path.getsize(root + '/e03/__init__.py') > 0)\n")
    work, runtime = tmp_path / "work", tmp_path / "runtime"
    work.mkdir()
    runtime.mkdir()
    run = subprocess.run(sandbox.wrap_command([sys.executable, "-I", "-c", probe], str(work), str(runtime)),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[]", "0 True"]


def test_without_a_cgroup_submissions_are_graded_one_at_a_time(tmp_path, monkeypatch, capsys):
    # per-process and per-user limits cannot keep one submission's processes from a neighbour's share
    from attnlab.cli import main as cli

    monkeypatch.setattr(sandbox.Cgroup, "available", staticmethod(lambda: False))
    cli(["grade", str(tmp_path), "-j", "3"])
    assert "grading one notebook at a time" in capsys.readouterr().err



@triton.jit
def _scale_kernel(x_ptr, y_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * alpha, mask=mask)


class _Reported:
    """The honest kernel's launches, reported as a process that ran learner code might want them read: ``how``
    "untraced" (no trace at all, as on a GPU), "no-traffic" (a trace without its byte counts) or "short" (one
    tensor left out of the counts); "honest" changes nothing."""

    def __init__(self, how):
        from attnlab.grading.core import LocalLearner

        self.inner, self.how = LocalLearner({"scale_kernel": _scale_kernel}, forbidden=[]), how

    def call(self, *a, **kw):
        return self.inner.call(*a, **kw)

    def launch(self, request):
        reply = self.inner.launch(request)
        for run in reply["result"].get("ok", []):
            if self.how == "untraced":
                run["traced"] = False
                run.pop("traffic"), run.pop("loaded"), run.pop("loads_outside"), run.pop("not_stored")
            elif self.how == "no-traffic":
                run.pop("traffic")
            elif self.how == "short":
                run["traffic"].pop(sorted(run["traffic"])[0])
        return reply


@pytest.mark.parametrize("how", ["untraced", "no-traffic", "short"])
def test_whether_a_launch_was_traced_is_the_grader_s_decision(how):
    # on a CPU every launch is traced: a reply that says "not traced" (as a GPU's would) or leaves byte counts out
    # must not skip the part's byte budget, which is how an over-budget kernel scored before
    from attnlab.grading.checks import run_check

    assert run_check("masked-scale", _Reported("honest")).passed
    result = run_check("masked-scale", _Reported(how))
    assert not result.passed and "trace" in result.message, result.message
