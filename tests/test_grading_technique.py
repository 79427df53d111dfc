"""The technique checks of exercises 06-08 and 10 under `attnlab grade`, not only in the inline check().

Since the trust boundary (docs/grading.md) the learner's kernels launch in a fresh sandboxed process and
their PyTorch functions run in the notebook's sandboxed kernel, so what footprint.py measures (peak
memory, the work of a causal call, NaN in the masked lanes of a load without other=) must be measured by
the grader about that process. Each known wrong answer below is the solution notebook with the mistake
written into its answer cell, graded the way CI and learners grade: it scores less than full, with the
part's diagnosis named.
"""

import json
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = {"06": "06_triton_primer.ipynb", "07": "07_flash_attention.ipynb", "08": "08_block_sparse.ipynb",
             "10": "10_inference.ipynb"}

_DENSE_FORWARD = '''
def tiled_attention_forward(q, k, v, causal=False, block_m=16, block_n=16):
    """The whole score matrix at once: right numbers, an N x N matrix held."""
    s = q @ k.transpose(1, 2) * q.shape[-1] ** -0.5  # (B, Nq, Nk)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)  # (B, Nq, Nk): N x N
    l = p.sum(dim=-1, keepdim=True)
    return p / l @ v, (m + torch.log(l)).squeeze(-1)
'''

_DENSE_BACKWARD = '''
def tiled_attention_backward(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    """The whole P recomputed at once from L: right gradients, an N x N matrix held."""
    scale = q.shape[-1] ** -0.5
    p = torch.exp(q @ k.transpose(1, 2) * scale - L[..., None])  # (B, Nq, Nk)
    if causal:
        p = p.masked_fill(torch.ones(p.shape[1:], dtype=torch.bool).triu(1), 0.0)
    ds = p * (do @ v.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(1, 2) @ q * scale, p.transpose(1, 2) @ do
'''

def _answer_cell(name, as_name):
    """The source of test_exercise_07's ``name`` (a wrong answer written as a learner would), renamed ``as_name``."""
    import importlib
    import inspect

    source = inspect.getsource(getattr(importlib.import_module("test_exercise_07"), name))
    return "\n" + source.replace(f"def {name}(", f"def {as_name}(", 1)


_ROW_BLOCK_FORWARD = _answer_cell("_row_block_forward", "tiled_attention_forward")
_ROW_BLOCK_BACKWARD = _answer_cell("_row_block_backward", "tiled_attention_backward")

# (exercise, grade_id of the answer cell, part, diagnosis, text replaced, its replacement (None: append))
MISTAKES = {
    "row-sum-without-other": ("06", "row-sum-answer", "row-sum", "other-missing",
                              "mask=cols < n_cols, other=0.0)", "mask=cols < n_cols)"),
    "causal-tile-pid-skip": ("06", "causal-tile-answer", "causal-tile", "tile-skip-by-program-id",
                             "keep = inside & (cols[None, :] <= rows[:, None])",
                             "keep = inside & (cols[None, :] <= rows[:, None]) "
                             "& (tl.program_id(1) <= tl.program_id(0))"),
    "whole-matrix-forward": ("07", "tiled-forward-answer", "tiled-forward", "holds-n-by-n", None, _DENSE_FORWARD),
    "whole-p-backward": ("07", "tiled-backward-answer", "tiled-backward", "holds-n-by-n", None, _DENSE_BACKWARD),
    "row-blocks-forward": ("07", "tiled-forward-answer", "tiled-forward", "row-block-against-all-keys", None,
                           _ROW_BLOCK_FORWARD),
    "row-blocks-backward": ("07", "tiled-backward-answer", "tiled-backward", "row-block-against-all-keys", None,
                            _ROW_BLOCK_BACKWARD),
    "flash-kernel-ignores-scale": ("07", "flash-kernel-loop-answer", "flash-kernel-loop", "scale-argument-ignored",
                                   'tl.dot(q, tl.trans(k), input_precision="ieee") * scale',
                                   'tl.dot(q, tl.trans(k), input_precision="ieee") * (1.0 / HEAD_DIM ** 0.5)'),
    "traffic-ignores-blocks": ("07", "traffic-experiment-answer", "traffic-experiment", "blocks-ignored",
                               "q, k, v, causal, block_m, block_n).total_bytes", "q, k, v, causal).total_bytes"),
    "gqa-cache-copied-per-head": ("10", "decode-attention-answer", "decode-attention", "cache-copied-per-head",
                                  "group = H_q // k_cache.shape[1]",
                                  "group = H_q // k_cache.shape[1]\n    heads = torch.arange(H_q) // group\n"
                                  "    k_cache, v_cache, group = k_cache[:, heads], v_cache[:, heads], 1"),
    "block-sparse-ignores-scale": ("08", "block-sparse-loop-answer", "block-sparse-loop", "scale-argument-ignored",
                                   "s = tl.dot(q, tl.trans(k)) * scale",
                                   "s = tl.dot(q, tl.trans(k)) * (1.0 / HEAD_DIM ** 0.5)"),
}


def mistaken(key, folder):
    """The solution notebook with mistake ``key`` written into its answer cell, saved in ``folder``."""
    ex, grade_id, _part, _diag, old, new = MISTAKES[key]
    nb = nbformat.read(ROOT / "solutions" / SOLUTIONS[ex], as_version=4)
    cells = [c for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id]
    assert len(cells) == 1, grade_id
    cell = cells[0]
    if old is None:
        cell.source = cell.source.rstrip() + "\n" + new  # redefined at the end of the answer cell
    else:
        assert cell.source.count(old) == 1, (key, old)
        cell.source = cell.source.replace(old, new)
    path = Path(folder) / f"{key}.ipynb"
    nbformat.write(nb, path)
    return path


def _part(report, part):
    return next(p for p in report["parts"] if p["name"] == part)


def _grade(path):
    from attnlab.grading.sandbox.runner import grade_in_subprocess

    return grade_in_subprocess(path, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(MISTAKES))
def test_known_mistake_scores_less_under_attnlab_grade(key, tmp_path):
    _ex, _gid, part, diagnosis, _old, _new = MISTAKES[key]
    report = _grade(mistaken(key, tmp_path))
    assert not report.get("error"), report.get("error")
    got = _part(report, part)
    assert got["points"] < got["max_points"], got
    assert diagnosis in (got.get("diagnosis") or []), got


if __name__ == "__main__":  # write every mistaken notebook into a folder: python tests/test_grading_technique.py DIR
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for key in MISTAKES:
        print(mistaken(key, out))


@pytest.mark.slow
def test_solution_07_scores_full_with_its_memory_measured(tmp_path):
    report = _grade(ROOT / "solutions" / SOLUTIONS["07"])
    assert report["score"] == report["max_score"] > 0, report
    for part in ("tiled-forward", "tiled-backward"):
        assert "no N x N matrix and no row block against all keys held" in _part(report, part)["feedback"], \
            _part(report, part)


@pytest.mark.slow
def test_solution_10_scores_full_with_its_cache_read_in_place(tmp_path):
    report = _grade(ROOT / "solutions" / SOLUTIONS["10"])
    assert report["score"] == report["max_score"] > 0, report
    assert "the cache is read in place" in _part(report, "decode-attention")["feedback"], report


# --- fast: what the grader's side measures, through the wrappers a check is given --------------------------

def _opaque(ns):
    """A learner in another process that offers no way to measure it (no pid, no runner)."""
    from attnlab.grading.core import LocalLearner

    inner = LocalLearner(ns, forbidden=[])

    class Opaque:
        def call(self, name, cases, grad=None):
            return inner.call(name, cases, grad=grad)

        def launch(self, request):
            return inner.launch(request)
    return Opaque()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_peak_memory_is_measured_through_the_checks_wrapper():
    import torch

    from attnlab.grading.core import LocalLearner, _Counted
    from attnlab.grading.sandbox.footprint import measured_call

    counted = _Counted(LocalLearner({"dense": lambda n: torch.ones(n, n).sum()}, forbidden=[]))
    counted.call("dense", [[(8,), {}]])
    reply, cost = measured_call(counted, "dense", [(4096,), {}])  # a 64 MiB matrix held
    assert counted.calls == 2 and "results" in reply
    assert cost["peak_bytes"] is not None and cost["peak_bytes"] > 32 * 2**20, cost


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_memory_freed_before_a_call_does_not_hide_its_peak():
    # a long-lived process (the test suite, a notebook kernel) keeps memory it freed resident in its heap, and a
    # later allocation reusing it adds nothing to the resident memory the check reads: CI's whole-suite run passed a
    # copy of exercise 10's KV cache per query head that way, until every call request gave the free heap back.
    # In a fresh Python, so that glibc's malloc is in the one state this sets up whatever ran before in this process
    import subprocess

    code = f"""if True:
        import sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from attnlab.grading.core import Fail, LocalLearner
        from attnlab.grading.exercises.e10 import checks
        from test_exercise_10 import _copying

        torch.ones(2**23 - 1024).sum()  # a block under 32 MiB freed: glibc's mmap threshold rises to its size
        held = [torch.randn(256, 1024) for _ in range(1024)]  # 1 GiB of 1 MiB tensors: now from the heap
        pinned = torch.randn(16)  # allocated above them: the heap cannot shrink when they are freed
        del held
        try:
            checks._check_no_copy(LocalLearner({{"decode_attention": _copying}}, forbidden=[]))
            print("passed")
        except Fail as exc:
            print(",".join(m.key for m in exc.mistakes))
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert run.stdout.split()[-1] == "cache-copied-per-head", run.stdout


def test_unmeasurable_peak_memory_scores_zero_not_a_pass():
    from attnlab.grading.core import Fail
    from attnlab.grading.exercises.e07 import checks
    from attnlab.grading.exercises.e07.spec import tiled_attention_forward

    with pytest.raises(Fail, match="could not measure the peak memory"):
        checks._check_memory(_opaque({"tiled_attention_forward": tiled_attention_forward}),
                             "tiled_attention_forward", 1)


def test_undefined_other_reaches_every_launch_through_the_checks_wrapper(monkeypatch):
    import contextlib

    from attnlab import _interp_hooks
    from attnlab.grading.sandbox import agent
    from attnlab.grading.core import _Counted
    from attnlab.grading.sandbox.footprint import undefined_other

    sent = []
    counted = _Counted(type("L", (), {"launch": lambda self, request: sent.append(request) or {}})())
    undefined_other(counted).launch({"name": "k"})
    assert counted.calls == 1 and sent == [{"name": "k", "undefined_other": True}]
    used = []

    @contextlib.contextmanager
    def spy():
        used.append(True)
        yield
    monkeypatch.setattr(_interp_hooks, "nan_for_missing_other", spy)
    assert agent.run_launch(None, {"sentinels": []}) == [] and not used  # local and isolated launches alike
    assert agent.run_launch(None, {"sentinels": [], "undefined_other": True}) == [] and used == [True]


def test_a_cell_that_resets_its_own_peak_memory_is_a_shortcut():
    # without a cgroup the grader reads VmHWM from outside; resetting it hides an N x N matrix
    from attnlab.grading import shortcuts

    cell = "with open('/proc/self/clear_refs', 'w') as f:\n    f.write('5')"
    assert shortcuts.uses([cell], ["torch.softmax"]) == [("/proc/self/clear_refs (named in a string)", 1)]
    assert shortcuts.uses(["peak = 0"], ["torch.softmax"]) == []
