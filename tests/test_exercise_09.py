"""Exercise 09 (the capstone): wrong implementations fail their check with the matching diagnosis, shortcuts
are refused, the traffic budget and the tolerances hold, and the notebook states the recipe the grader uses."""

import re
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.exercises.e09 import checks as e09
from attnlab.grading.exercises.e09 import spec as specs
from attnlab.grading.parts import forbidden
from attnlab.grading.shortcuts import uses
from attnlab.models.gpt import GPT
from attnlab.train import train_lm
from mistakes import Wrong, variant as _variant

ROOT = Path(__file__).resolve().parents[1]
WRONG = Wrong()


# ---------------------------------------------------------------------------------------------
# part 1: my_sdpa, as a learner would write it
# ---------------------------------------------------------------------------------------------

# its known mistakes are proven by the check's own emulations (tests/test_every_mistake.py)

def _sdpa(scaled=True, honour_causal=True):
    """A learner's my_sdpa; ``scaled=False`` forgets the scale, ``honour_causal=False`` ignores is_causal."""
    def my_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        scale = 1 / q.shape[-1] ** 0.5 if scale is None else scale
        s = torch.matmul(q, k.transpose(-1, -2)) * (scale if scaled else 1.0)
        allowed = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool)
        if is_causal and honour_causal:
            allowed = torch.tril(allowed)
        if attn_mask is not None:
            allowed = allowed & attn_mask
        s = torch.where(allowed, s, torch.tensor(float("-inf")))
        s = s - s.max(dim=-1, keepdim=True).values
        w = s.exp() / s.exp().sum(dim=-1, keepdim=True)
        return w @ v
    return my_sdpa


def _sdpa_without_autograd(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """Right numbers, computed under torch.no_grad() ("attention needs no gradients of its own"): not differentiable."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with torch.no_grad():
        s = q @ k.transpose(-2, -1) * scale
        if is_causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
        p = torch.exp(s - s.amax(-1, keepdim=True))
        return (p / p.sum(-1, keepdim=True)) @ v


# right numbers, no gradients: a failure path the emulations (differentiable by design) do not take
WRONG.add("capstone-sdpa", "not-differentiable", my_sdpa=_sdpa_without_autograd)


# ---------------------------------------------------------------------------------------------
# part 2: the causal kernel; mistake switches are globals of the kernel's code (see mistakes.variant)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _kernel_body(Q, K, V, O, stride_h, stride_n, n_ctx, scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    base = tl.program_id(1) * stride_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * stride_n + offs_d[None, :], mask=offs_m[:, None] < n_ctx, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    if LOOP == 0:
        end = (pid_m + 1) * BLOCK_M
    elif LOOP == 1:
        end = (pid_m + 1) * BLOCK_N
    else:
        end = n_ctx
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if Q_TWICE:
            q = tl.load(Q + base + offs_m[:, None] * stride_n + offs_d[None, :], mask=offs_m[:, None] < n_ctx,
                        other=0.0)
        if MASK_LOADS:
            k = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx, other=0.0)
            v = tl.load(V + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx, other=0.0)
        else:
            k = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :])
            v = tl.load(V + base + offs_n[:, None] * stride_n + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        if SCALE:
            s = s * scale
        if CAUSAL:
            s = tl.where((offs_n[None, :] <= offs_m[:, None] + DIAG) & (offs_n[None, :] < n_ctx), s, float("-inf"))
        else:
            s = tl.where(offs_n[None, :] < n_ctx, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        if RESCALE_SUM:
            l_i = l_i * alpha + tl.sum(p, axis=1)
        else:
            l_i = l_i + tl.sum(p, axis=1)
        if RESCALE:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        else:
            acc = acc + tl.dot(p, v)
        m_i = m_new
    if NORMALISE:
        acc = acc / l_i[:, None]
    if MASK_STORE:
        tl.store(O + base + offs_m[:, None] * stride_n + offs_d[None, :], acc, mask=offs_m[:, None] < n_ctx)
    else:
        tl.store(O + base + offs_m[:, None] * stride_n + offs_d[None, :], acc)


_KERNEL_OK = dict(LOOP=0, Q_TWICE=False, MASK_LOADS=True, SCALE=True, CAUSAL=True, DIAG=0, RESCALE=True,
                  RESCALE_SUM=True, NORMALISE=True, MASK_STORE=True)


def _kernel(**flags):
    return _variant(_kernel_body, **{**_KERNEL_OK, **flags})


WRONG.add("capstone-kernel", "acc-not-rescaled", causal_attn_kernel=_kernel(RESCALE=False))
WRONG.add("capstone-kernel", "sum-not-rescaled", causal_attn_kernel=_kernel(RESCALE_SUM=False))
WRONG.add("capstone-kernel", "scale-forgotten", causal_attn_kernel=_kernel(SCALE=False))
WRONG.add("capstone-kernel", "not-normalised", causal_attn_kernel=_kernel(NORMALISE=False))
WRONG.add("capstone-kernel", "causal-diagonal-excluded", causal_attn_kernel=_kernel(DIAG=-1))
WRONG.add("capstone-kernel", "causal-mask-missing", causal_attn_kernel=_kernel(CAUSAL=False))
WRONG.add("capstone-kernel", "not-causal", causal_attn_kernel=_kernel(CAUSAL=False, LOOP=2))
WRONG.add("capstone-kernel", "loop-bound-block-n", causal_attn_kernel=_kernel(LOOP=1))


@triton.jit
def _one_tile_kernel(Q, K, V, O, stride_h, stride_n, n_ctx, scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # no online softmax: one tile of 64 keys and a plain softmax over it, its loads stopped at the diagonal (within
    # the traffic budget, and right while n_ctx <= 64)
    pid_m, pid_h = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, 64)
    offs_d = tl.arange(0, HEAD_DIM)
    base = pid_h * stride_h
    q = tl.load(Q + base + offs_m[:, None] * stride_n + offs_d[None, :], mask=offs_m[:, None] < n_ctx, other=0.0)
    seen = offs_n[:, None] < tl.minimum((pid_m + 1) * BLOCK_M, n_ctx)
    k = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=seen, other=0.0)
    v = tl.load(V + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=seen, other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where((offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < n_ctx), s, float("-inf"))
    p = tl.exp(s - tl.max(s, axis=1)[:, None])
    o = tl.dot(p, v) / tl.sum(p, axis=1)[:, None]
    tl.store(O + base + offs_m[:, None] * stride_n + offs_d[None, :], o, mask=offs_m[:, None] < n_ctx)


WRONG.add("capstone-kernel", "one-fixed-tile", causal_attn_kernel=_one_tile_kernel)
# right values, traffic over budget
WRONG.add("capstone-kernel", "dense-loop", causal_attn_kernel=_kernel(LOOP=2))
WRONG.add("capstone-kernel", "extra-traffic", causal_attn_kernel=_kernel(Q_TWICE=True))
WRONG.add("capstone-kernel", "out-of-bounds-load", causal_attn_kernel=_kernel(MASK_LOADS=False))
WRONG.add("capstone-kernel", "out-of-bounds-store", causal_attn_kernel=_kernel(MASK_STORE=False))


# ---------------------------------------------------------------------------------------------
# part 3: the training loop
# ---------------------------------------------------------------------------------------------

_attend = _sdpa()  # the test's own attention, written by hand (the learner's kernel computes the same function)
_not_causal = _sdpa(honour_causal=False)  # what a kernel without its causal mask computes


def _train(attend=None, batch_seed=0, seeded=True):
    """A learner's training loop, through ``attend`` (default: the test's own attention); from other initial weights
    (``seeded=False``) or another first batch (``batch_seed``), the first loss differs."""
    def train_gpt(seed, steps, attention=None):
        corpus = specs._corpus()
        model = GPT(**specs.TINY, attention=attention or attend or _attend, seed=seed if seeded else None)
        optimizer = torch.optim.Adam(model.parameters(), lr=specs.LR)
        g = torch.Generator().manual_seed(seed + batch_seed)
        out = []
        for _ in range(steps):
            x, y = corpus.batch("train", specs.BATCH, specs.SEQ, g)
            loss = model(x, y)[1]
            model.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), specs.CLIP)
            optimizer.step()
            out.append(loss.item())
        return out
    return train_gpt


# the mistakes the check emulates are proven by tests/test_every_mistake.py; these have no emulation:
# the loop right, through a kernel that is not (not causal): the diagnosis points at part 2
WRONG.add("capstone-train", "capstone-kernel-fails", train_gpt=_train(attend=_not_causal),
          causal_attn_kernel=_kernel(CAUSAL=False))
WRONG.add("capstone-train", "first-step-differs", train_gpt=_train(batch_seed=1))
WRONG.add("capstone-train", "first-step-differs", train_gpt=_train(seeded=False))


# ---------------------------------------------------------------------------------------------
# part 4: the experiment
# ---------------------------------------------------------------------------------------------

def _experiment(attend=None):
    """A learner's experiment, through ``attend`` (default: the test's own attention)."""
    train_gpt = _train()
    _attend = attend or globals()["_attend"]

    def local_vs_dense(seed, steps, window, n_global):
        rows, cols = torch.arange(specs.SEQ).view(-1, 1), torch.arange(specs.SEQ).view(1, -1)
        mask = (rows - cols < window) | (cols < n_global)

        def dense(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
            return _attend(q, k, v, is_causal=True)

        def local(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
            return _attend(q, k, v, attn_mask=mask & (cols <= rows))

        return train_gpt(seed, steps, dense), train_gpt(seed, steps, local)
    return local_vs_dense


# the mistakes the check emulates are proven by tests/test_every_mistake.py; this one has no emulation:
# the experiment right, through a my_sdpa that is not: the diagnosis points at part 1
WRONG.add("capstone-local-global", "capstone-sdpa-fails",
          local_vs_dense=_experiment(attend=_sdpa(scaled=False)), my_sdpa=_sdpa(scaled=False))


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


# ---------------------------------------------------------------------------------------------
# right answers written differently, shortcuts, budgets, tolerances
# ---------------------------------------------------------------------------------------------

def test_right_answers_written_differently_pass():
    ns = {"my_sdpa": _sdpa(), "causal_attn_kernel": _kernel(), "train_gpt": _train(),
          "local_vs_dense": _experiment()}
    for part in ("capstone-sdpa", "capstone-kernel", "capstone-train", "capstone-local-global"):
        # the part's own list, less the references: this file's answers read their constants from the spec module
        allowed = [p for p in forbidden(part) if not p.startswith("attnlab.grading.exercises")]
        result = run_check(part, LocalLearner(ns, forbidden=allowed))
        assert result.passed, result.message


def test_dense_loop_and_a_second_q_load_are_told_apart():
    result = run_check("capstone-kernel", LocalLearner({"causal_attn_kernel": _kernel(LOOP=2)}, forbidden=[]))
    assert {"dense-loop", "extra-traffic"} <= set(result.diagnosis) and "32768 bytes from `k`" in result.message
    result = run_check("capstone-kernel", LocalLearner({"causal_attn_kernel": _kernel(Q_TWICE=True)}, forbidden=[]))
    assert result.diagnosis == ["extra-traffic"] and "from `q`" in result.message


def test_the_traffic_budget_at_the_model_s_shape_is_the_one_the_notebook_states():
    budget = e09.traffic_budget(e09.BH_MODEL, specs.SEQ, e09.HS_MODEL, e09.TILE_MODEL, e09.TILE_MODEL)
    assert budget == {"q": (16384, 0), "k": (24576, 0), "v": (24576, 0), "o": (0, 16384)}
    dense = e09.BH_MODEL * 2 * specs.SEQ * e09.HS_MODEL * 4
    text = _cells("markdown")
    for number in (16384, 24576, dense):
        assert f"{number:,}" in text
    assert e09.causal_kv_rows(40, 16, 16) == 16 + 32 + 40 and e09.causal_kv_rows(40, 32, 16) == 32 + 40


def test_shortcuts_are_refused():
    def sdpa_shortcut(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    def train_with_sdpa(seed, steps, attention=None):
        return _train()(seed, steps, attention="sdpa")

    def train_with_library_loop(seed, steps, attention=None):
        # imported before the check (in a notebook: an earlier cell); an import in an answer cell is refused from
        # the cell's syntax (test_the_model_is_allowed_where_the_capstone_builds_it_and_nowhere_else)
        model = GPT(**specs.TINY, attention=_attend, seed=seed)
        return train_lm(model, specs._corpus(), steps, batch_size=specs.BATCH, seq_len=specs.SEQ, lr=specs.LR,
                        seed=seed, clip=specs.CLIP, progress=False)["loss"]

    def experiment_with_library(seed, steps, window, n_global):
        from attnlab.attention import scaled_dot_product_attention

        def dense(q, k, v, **kwargs):
            return scaled_dot_product_attention(q, k, v, causal=True)

        return _train()(seed, steps, dense), _train()(seed, steps, dense)

    for part, ns in (("capstone-sdpa", {"my_sdpa": sdpa_shortcut}),
                     ("capstone-train", {"train_gpt": train_with_sdpa}),
                     ("capstone-train", {"train_gpt": train_with_library_loop}),
                     ("capstone-local-global", {"local_vs_dense": experiment_with_library})):
        result = run_check(part, ns)
        assert not result.passed and "shortcut" in result.diagnosis, (part, result.message)


def test_a_kernel_part_needs_a_real_triton_kernel():
    def causal_attn_kernel(*args, **kwargs):  # PyTorch pretending to be a kernel
        raise AssertionError("never called")

    result = run_check("capstone-kernel", {"causal_attn_kernel": causal_attn_kernel})
    assert not result.passed and "must be a Triton kernel" in result.message


def test_the_model_is_allowed_where_the_capstone_builds_it_and_nowhere_else():
    answer = "def train_gpt(seed, steps, attention=None):\n    model = GPT(**TINY, attention=attention, seed=seed)\n"
    imports = "from attnlab.models.gpt import GPT\n"
    assert uses([answer], forbidden("capstone-train"), [imports, answer]) == []
    assert uses([answer], forbidden("capstone-local-global"), [imports, answer]) == []
    assert uses([answer], forbidden("capstone-sdpa"), [imports, answer]) != []
    assert "attnlab.models.*" in forbidden("capstone-kernel")
    loop = "from attnlab.train import fit\ndef train_gpt(seed, steps, attention=None):\n    return fit\n"
    assert uses([loop], forbidden("capstone-train")) != []


def test_the_training_tolerance_passes_rounding_and_fails_a_real_difference():
    good = _train()

    def off_by(delta):
        return lambda seed, steps, attention=None: [x + delta for x in good(seed, steps)]

    assert e09.train_tolerance() == 1e-3
    assert run_check("capstone-train", LocalLearner({"train_gpt": off_by(5e-4)}, forbidden=[])).passed
    result = run_check("capstone-train", LocalLearner({"train_gpt": off_by(3e-3)}, forbidden=[]))
    assert not result.passed and "within 0.001" in result.message


def test_the_experiment_tolerance_passes_rounding_and_fails_a_real_difference():
    good = _experiment()

    def off_by(delta):
        return lambda *args: tuple([x + delta for x in c] for c in good(*args))

    assert run_check("capstone-local-global", LocalLearner({"local_vs_dense": off_by(5e-4)}, forbidden=[])).passed
    result = run_check("capstone-local-global", LocalLearner({"local_vs_dense": off_by(3e-3)}, forbidden=[]))
    assert not result.passed and "within 0.001" in result.message


def test_the_local_global_mask_is_the_worked_example():
    want = ["100000", "110000", "111000", "101100", "100110", "100011"]
    assert ["".join(str(int(b)) for b in row) for row in specs.local_global_mask(6, 2, 1)] == want
    assert "\n".join(" ".join(r) for r in want) in _cells("markdown")


def _cells(kind):
    nb = nbformat.read(ROOT / "solutions" / "09_capstone.ipynb", as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == kind)


def test_the_notebook_states_the_recipe_the_grader_uses():
    setup = next(c.source for c in nbformat.read(ROOT / "solutions" / "09_capstone.ipynb", as_version=4).cells
                 if c.cell_type == "code" and "TINY = " in c.source)
    ns = {}
    for line in setup.splitlines():
        if re.match(r"^(TINY|BATCH, SEQ, LR, CLIP) = ", line):
            exec(line, ns)
    assert ns["TINY"] == specs.TINY
    assert (ns["BATCH"], ns["SEQ"], ns["LR"], ns["CLIP"]) == (specs.BATCH, specs.SEQ, specs.LR, specs.CLIP)
    text = _cells("markdown")
    assert f"one run of {e09.TRAIN_STEPS} steps" in text and f"experiments of {e09.EXPERIMENT_STEPS} steps" in text


def test_the_grader_s_seeds_are_salted():
    from attnlab.grading import core

    plain = e09._salted_seed(2100)
    core._SALT[0] = 12345
    try:
        assert e09._salted_seed(2100) != plain
    finally:
        core._SALT[0] = 0
