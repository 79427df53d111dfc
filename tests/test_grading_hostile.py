"""`attnlab grade` against hostile notebooks (tests/hostile/, written by tests/hostile/build.py).

Every probe must get the score and the reason it earned and no more, leave every other file
untouched and no process behind, and the batch must finish in time. The probes forge the
grader's results (json, torch.allclose, exec, an input transformer, fake modules, the frame protocol, a daemon),
take shortcuts (the grader's references, torch.softmax, F.scaled_dot_product_attention, attnlab's
own attention), pass objects that only look like Triton kernels, delete files, fork sleepers,
write into other processes' stdout, allocate 2 GB under a 1 GB limit, raise after the last
check, reorder parts, and hide under odd names in nested folders.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ROOT / "tests" / "hostile"
MARKERS = ("4243", "4244", "attnlab-probe-daemon-4242")
TIMEOUT = 150

pytestmark = pytest.mark.slow

sys.path.insert(0, str(HOSTILE))
import build  # noqa: E402

sys.path.remove(str(HOSTILE))


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _survivors():
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(m in cmdline for m in MARKERS) and "pytest" not in cmdline:
                found.append(cmdline)
    return found


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    probes = tmp / "class"
    for rel, nb in build.probes().items():
        (probes / rel).parent.mkdir(parents=True, exist_ok=True)
        (probes / rel).write_text(build.render(nb))
    neighbour = probes / "a neighbour's notes.txt"
    neighbour.write_text("must survive")
    (probes / "another student").mkdir()
    (probes / "another student" / "secret.txt").write_text("SECRET-4247")
    before = _digest(probes)
    out = tmp / "report.json"
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "attnlab", "grade", str(probes), "-j", "2", "--memory", "1024",
                          "--timeout", str(TIMEOUT), "--cell-timeout", "60", "--json", str(out)],
                         capture_output=True, text=True, env=_env(), timeout=3600)
    elapsed = time.monotonic() - start
    time.sleep(1)
    doc = json.loads(out.read_text())
    reports = {str(Path(r["path"]).relative_to(probes)): r for r in doc["notebooks"]}
    return {"run": run, "reports": reports, "doc": doc, "before": before, "after": _digest(probes),
            "elapsed": elapsed, "survivors": _survivors(), "count": len(reports)}


def _parts(report):
    return {p["name"]: p for p in report["parts"]}


def test_every_probe_is_graded_and_files_are_untouched(graded):
    # one notebook is not credited by design (exercise 03's cells filed as 05_quadratic_cost): the exit status says so
    not_credited = {name for name, r in graded["reports"].items() if r.get("error")}
    assert not_credited == {"nested/05_quadratic_cost.ipynb"}, {n: graded["reports"][n]["error"] for n in not_credited}
    assert graded["run"].returncode == 1, graded["run"].stdout[-3000:] + graded["run"].stderr[-3000:]
    assert set(graded["reports"]) == set(build.probes())
    assert graded["before"] == graded["after"]


def test_no_process_is_left_behind(graded):
    assert graded["survivors"] == []


def test_the_batch_finishes_in_time(graded):
    # with 2 at a time, the batch is bounded by the per-notebook limit times half the notebooks
    assert graded["elapsed"] < (TIMEOUT + 10) * (graded["count"] + 1) / 2


@pytest.mark.parametrize("name", ["forge_json", "forge_allclose", "forge_exec", "forge_transformer", "forge_module",
                                  "forge_daemon", "nbgrader_check_rebound", "nbgrader_env_unset",
                                  "nbgrader_autograde_rebound", "forge_launch", "forge_frames"])
def test_forged_results_score_nothing(graded, name):
    """forge_frames patches the frame protocol and the agent in its own process (sys.modules, _send, handle) and
    writes frames by hand into its pipes: what its process answers is data, so wrong answers stay wrong."""
    report = graded["reports"][f"{name}.ipynb"]
    assert report["score"] == 0, json.dumps(report, indent=1)


def test_code_in_a_kernel_s_def_line_never_runs_where_kernels_are_launched(graded):
    # the kernels are empty: were the default's exec run in the kernels' process, its launcher would answer for them
    parts = _parts(graded["reports"]["forge_default_06.ipynb"])
    for part in ("softmax-kernel", "online-softmax-kernel"):
        assert parts[part]["points"] == 0, parts[part]


def test_meta_tensors_are_not_answers(graded):
    report = graded["reports"]["forge_meta_03.ipynb"]
    assert report["score"] == 0, json.dumps(report, indent=1)
    assert "a tensor on the meta device" in _parts(report)["stable-softmax"]["feedback"]


def test_the_measured_call_s_inputs_cannot_be_worked_out_from_the_warm_up_s(graded):
    # the warm-up's values were (x - 0.125) * 2 of the measured ones: a copying decode_attention computed the
    # measured result during the warm-up and returned it, so the measured call held no copy
    parts = _parts(graded["reports"]["forge_predicted_10.ipynb"])
    assert parts["decode-attention"]["points"] == 0, parts["decode-attention"]
    assert "peak memory grew" in parts["decode-attention"]["feedback"]


def test_an_experiment_s_numbers_written_as_the_formula_score_nothing(graded):
    # right numbers, and not what the part measures: no trace of the kernel, no ring driven
    parts = _parts(graded["reports"]["forge_predicted_10.ipynb"])
    assert parts["decode-bytes"]["points"] == 0
    assert "never uses `attnlab.memory.trace`" in parts["decode-bytes"]["feedback"]
    parts = _parts(graded["reports"]["shortcut_collective_11.ipynb"])
    assert parts["comm-bytes"]["points"] == 0 and parts["comm-bytes"]["diagnosis"] == ["ring-row-not-from-ring-step"], \
        parts["comm-bytes"]   # the tap saw no ring_step call behind the ring's row (the syntax rule says so too)


def test_a_required_function_called_for_show_earns_nothing(graded):
    # the syntax rule is met (the function is called), the numbers come from elsewhere: the taps see it
    parts = _parts(graded["reports"]["show_calls_02.ipynb"])
    assert parts["loop-timing"]["points"] == 0 and parts["loop-timing"]["diagnosis"] == ["row-never-called"], \
        parts["loop-timing"]
    assert parts["attention-row"]["points"] == parts["attention-row"]["max_points"]  # the rest keeps its points
    parts = _parts(graded["reports"]["show_calls_11.ipynb"])
    assert parts["comm-bytes"]["points"] == 0 and parts["comm-bytes"]["diagnosis"] == ["ring-row-not-from-ring-step"], \
        parts["comm-bytes"]
    assert parts["ring-forward"]["points"] == parts["ring-forward"]["max_points"]


def test_a_forbidden_function_under_another_module_s_name_is_read(graded):
    parts = _parts(graded["reports"]["shortcut_collective_11.ipynb"])
    assert parts["ring-group"]["points"] == 0
    assert "(which is torch.distributed.all_gather)" in parts["ring-group"]["feedback"]
    assert parts["ring-forward"]["points"] == 3  # the rest of the solution keeps its points
    parts = _parts(graded["reports"]["shortcut_backend_09.ipynb"])
    assert parts["capstone-train"]["points"] == 0 and "'sdpa' (the name of one of the library's backends)" in \
        parts["capstone-train"]["feedback"]
    assert parts["capstone-local-global"]["points"] == 0 and \
        "(which is torch.nn.functional.scaled_dot_product_attention)" in parts["capstone-local-global"]["feedback"]


def test_a_forbidden_call_in_a_nested_def_or_a_helper_s_helper_is_read(graded):
    parts = _parts(graded["reports"]["shortcut_nested_03.ipynb"])
    assert parts["stable-softmax"]["points"] == 0 and "uses `torch.softmax`" in parts["stable-softmax"]["feedback"]
    assert parts["scaled-attention"]["points"] == 0
    assert "scaled_dot_product_attention` (line 2 of another cell of yours, which defines `_helper2`)" in \
        parts["scaled-attention"]["feedback"]


def test_a_launch_forged_in_the_kernel_s_process_scores_nothing(graded):
    parts = _parts(graded["reports"]["forge_launch.ipynb"])
    assert parts["masked-scale"]["points"] == 0 and "not implemented" in parts["masked-scale"]["feedback"]


def test_nothing_reaches_the_grader_s_stdout(graded):
    assert "FORGED-4245" not in graded["run"].stdout + graded["run"].stderr
    report = graded["reports"]["write_stdout.ipynb"]
    assert report["score"] == report["max_score"]


@pytest.mark.parametrize("name", ["forked_sleeper", "delete_files"])
def test_sleepers_and_deletions_cost_nothing_else(graded, name):
    report = graded["reports"][f"{name}.ipynb"]
    assert report["score"] == report["max_score"], json.dumps(report, indent=1)


def test_a_2gb_allocation_under_a_1gb_limit_costs_its_part(graded):
    parts = _parts(graded["reports"]["big_allocation.ipynb"])
    assert parts["padding-mask"]["points"] == 0
    assert "allocate" in parts["padding-mask"]["feedback"]
    assert parts["causal-mask"]["points"] == 1 and parts["attention-masks"]["points"] == 3


def test_a_raise_after_the_last_check_costs_nothing(graded):
    report = graded["reports"]["raise_after_last_check.ipynb"]
    assert report["score"] == report["max_score"]
    assert any("a cell of no part" in n for n in report["notes"])


def test_reordered_parts_charge_each_failure_to_its_own_part(graded):
    parts = _parts(graded["reports"]["reordered_parts.ipynb"])
    assert parts["causal-mask"]["points"] == 0 and "NameError" in parts["causal-mask"]["feedback"]
    assert parts["padding-mask"]["points"] == 1 and parts["attention-masks"]["points"] == 3


def test_odd_names_in_nested_folders_are_found_and_identified(graded):
    plain = graded["reports"]["nested/deeper/my homework.ipynb"]
    assert plain["exercise"] == "03_scaled_dot_product" and plain["score"] == plain["max_score"]
    assert not plain.get("warnings")
    misnamed = graded["reports"]["nested/05_quadratic_cost.ipynb"]   # exercise 03's cells in 05's slot: credited
    assert misnamed["exercise"] == "03_scaled_dot_product" and misnamed["score"] == 0      # to neither, and said
    assert "filed as 05_quadratic_cost" in misnamed["error"]
    assert any("file name suggests 05_quadratic_cost" in w for w in misnamed["warnings"])


@pytest.mark.parametrize("exercise", sorted(build.SHORTCUTS))
def test_one_line_shortcuts_score_nothing(graded, exercise):
    parts = _parts(graded["reports"][f"shortcut_{exercise[:2]}.ipynb"])
    for answer in build.SHORTCUTS[exercise]:
        part = parts[answer.rsplit("-answer", 1)[0]]
        assert part["points"] == 0 and "does not allow" in part["feedback"], part


def test_a_forbidden_function_captured_early_is_still_read(graded):
    # `_sm = torch.softmax` in a cell of no part feeds the answer's `_sm(x)`: the syntax check reads it for the part
    parts = _parts(graded["reports"]["shortcut_captured_early.ipynb"])
    assert parts["stable-softmax"]["points"] == 0 and "uses `torch.softmax`" in parts["stable-softmax"]["feedback"]
    assert parts["variance-experiment"]["points"] == 1


@pytest.mark.parametrize("exercise", sorted(build.FAKE_KERNELS))
def test_objects_that_only_look_like_kernels_are_refused(graded, exercise):
    parts = _parts(graded["reports"][f"fake_kernel_{exercise[:2]}.ipynb"])
    for answer in build.FAKE_KERNELS[exercise]:
        part = parts[answer.rsplit("-answer", 1)[0]]
        assert part["points"] == 0 and "must be a Triton kernel" in part["feedback"], part


def test_the_report_says_which_isolation_was_used(graded):
    assert graded["doc"]["isolation"]
    assert all(r["isolation"] for r in graded["reports"].values())


def test_an_empty_folder_grades_nothing_and_says_so(tmp_path):
    empty = tmp_path / "submissions"
    empty.mkdir()
    run = subprocess.run([sys.executable, "-m", "attnlab", "grade", str(empty), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert run.returncode == 1
    assert "nothing was graded" in run.stderr and "no notebook" in run.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["notebooks"] == [] and doc["skipped"][0]["reason"].startswith("a folder with no notebook")


def test_the_hostile_notebooks_are_up_to_date():
    assert build.main(["--check"]) == 0, "run: python tests/hostile/build.py"


def test_bubblewrap_is_used_where_installed():
    from attnlab.grading import sandbox

    if shutil.which("bwrap") is None or not sys.platform.startswith("linux"):
        pytest.skip("no bubblewrap on this machine")
    assert sandbox.bwrap() is not None
    assert "bubblewrap" in sandbox.isolation() and "no capabilities" in sandbox.isolation()


@pytest.mark.parametrize("name", sorted(build.SANDBOX_PROBES))
def test_the_sandbox_holds_whoever_runs_the_grader(graded, name):
    """Remounting / writable, reading solutions/ or another submission or the live report, three children and
    /dev/shm beyond --memory, filling the disk, printing without end: none escapes, none costs a point."""
    from attnlab.grading import sandbox

    if shutil.which("bwrap") is None:
        pytest.skip("no bubblewrap on this machine: only rlimits hold")
    report = graded["reports"][f"{name}.ipynb"]
    text = json.dumps(report)
    if name == "sandbox_memory_children" and not sandbox.Cgroup.available():
        pytest.skip("no cgroup can be made here (not root, no delegated cgroup v2): memory is capped per process only")
    assert "ESCAPE-" not in text, text[-3000:]
    assert report["score"] == report["max_score"], text[-3000:]
    assert not (ROOT / "attnlab" / "grading" / "ESCAPE-4246").exists() and not Path("/ESCAPE-4246").exists()
    # sandbox_print_flood: 64 MiB printed into /dev/null, read by nobody (the worker did not grow: it graded)
