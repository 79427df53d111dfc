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
# part 1: my_sdpa, written wrong the ways a learner would
# ---------------------------------------------------------------------------------------------

def _sdpa(stable=True, default_scale="sqrt", honour_scale=True, diagonal=0, bottom_right=False, inverted=False,
          after=False, dim=-1, honour_causal=True, drop_mask_when_causal=False):
    def my_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        d = q.shape[-1]
        if scale is None or not honour_scale:
            scale = 1 / d if default_scale == "d" else 1 / d ** 0.5
        s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 if default_scale == "none" else scale)
        nq, nk = s.shape[-2], s.shape[-1]
        allowed = torch.ones(nq, nk, dtype=torch.bool)
        if is_causal and honour_causal:
            allowed = torch.tril(allowed, diagonal=diagonal + (nk - nq if bottom_right else 0))
        if attn_mask is not None and not (drop_mask_when_causal and is_causal):
            allowed = allowed & ~attn_mask if inverted else allowed & attn_mask
        if not after:
            s = torch.where(allowed, s, torch.tensor(float("-inf")))
        if stable:
            s = s - s.max(dim=dim, keepdim=True).values
        w = s.exp() / s.exp().sum(dim=dim, keepdim=True)
        if after:
            w = torch.where(allowed, w, torch.zeros(()))
        return w @ v
    return my_sdpa


WRONG.add("capstone-sdpa", "no-max-subtraction", my_sdpa=_sdpa(stable=False))
WRONG.add("capstone-sdpa", "scale-1-over-d", my_sdpa=_sdpa(default_scale="d"))
WRONG.add("capstone-sdpa", "scale-missing", my_sdpa=_sdpa(default_scale="none"))
WRONG.add("capstone-sdpa", "scale-ignored", my_sdpa=_sdpa(honour_scale=False))
WRONG.add("capstone-sdpa", "causal-diagonal-excluded", my_sdpa=_sdpa(diagonal=-1))
WRONG.add("capstone-sdpa", "causal-bottom-right", my_sdpa=_sdpa(bottom_right=True))
WRONG.add("capstone-sdpa", "mask-inverted", my_sdpa=_sdpa(inverted=True))
WRONG.add("capstone-sdpa", "mask-after-softmax", my_sdpa=_sdpa(after=True))
WRONG.add("capstone-sdpa", "softmax-wrong-axis", my_sdpa=_sdpa(dim=-2))
WRONG.add("capstone-sdpa", "is-causal-ignored", my_sdpa=_sdpa(honour_causal=False))
WRONG.add("capstone-sdpa", "causal-replaces-mask", my_sdpa=_sdpa(drop_mask_when_causal=True))


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


def _train(zero=True, clip=True, lr=specs.LR, same_batch=False, opt="adam", step=True, batch_seed=0, seeded=True,
           attend=None):
    def train_gpt(seed, steps, attention=None):
        corpus = specs._corpus()
        model = GPT(**specs.TINY, attention=attention or attend or _attend, seed=seed if seeded else None)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr) if opt == "adam" else \
            torch.optim.SGD(model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(seed + batch_seed)
        out = []
        for i in range(steps):
            if same_batch:
                g = torch.Generator().manual_seed(seed + batch_seed + (i if same_batch == "per-step" else 0))
            x, y = corpus.batch("train", specs.BATCH, specs.SEQ, g)
            loss = model(x, y)[1]
            if zero:
                model.zero_grad()
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), specs.CLIP)
            if step:
                optimizer.step()
            out.append(loss.item())
        return out
    return train_gpt


WRONG.add("capstone-train", "grads-accumulate", train_gpt=_train(zero=False))
WRONG.add("capstone-train", "no-clip", train_gpt=_train(clip=False))
WRONG.add("capstone-train", "same-batch", train_gpt=_train(same_batch=True))
WRONG.add("capstone-train", "generator-per-step", train_gpt=_train(same_batch="per-step"))
# the loop right, through a kernel that is not (not causal): the diagnosis points at part 2
WRONG.add("capstone-train", "capstone-kernel-fails", train_gpt=_train(attend=_not_causal),
          causal_attn_kernel=_kernel(CAUSAL=False))
WRONG.add("capstone-train", "wrong-lr", train_gpt=_train(lr=1e-3))
WRONG.add("capstone-train", "no-update", train_gpt=_train(step=False))
WRONG.add("capstone-train", "sgd", train_gpt=_train(opt="sgd"))
WRONG.add("capstone-train", "first-step-differs", train_gpt=_train(batch_seed=1))
WRONG.add("capstone-train", "first-step-differs", train_gpt=_train(seeded=False))


# ---------------------------------------------------------------------------------------------
# part 4: the experiment
# ---------------------------------------------------------------------------------------------

def _experiment(window_plus=0, with_global=True, causal=True, swap=False, second_seed=0, mask_dense=False,
                symmetric=True, attend=None):
    train_gpt = _train()
    _attend = attend or globals()["_attend"]

    def local_vs_dense(seed, steps, window, n_global):
        rows, cols = torch.arange(specs.SEQ).view(-1, 1), torch.arange(specs.SEQ).view(1, -1)
        near = (rows - cols).abs() if symmetric and not causal else rows - cols
        near = near < window + window_plus
        mask = near | (cols < n_global) if with_global else near

        def dense(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
            if mask_dense:
                return _attend(q, k, v, attn_mask=mask & (cols <= rows))
            return _attend(q, k, v, is_causal=True)

        def local(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
            return _attend(q, k, v, attn_mask=mask & (cols <= rows) if causal else mask)

        d, s = train_gpt(seed, steps, dense), train_gpt(seed + second_seed, steps, local)
        return (s, d) if swap else (d, s)
    return local_vs_dense


WRONG.add("capstone-local-global", "window-off-by-one", local_vs_dense=_experiment(window_plus=1))
WRONG.add("capstone-local-global", "global-missing", local_vs_dense=_experiment(with_global=False))
WRONG.add("capstone-local-global", "local-not-causal", local_vs_dense=_experiment(causal=False))
WRONG.add("capstone-local-global", "local-not-causal", local_vs_dense=_experiment(causal=False, symmetric=False))
WRONG.add("capstone-local-global", "swapped", local_vs_dense=_experiment(swap=True))
WRONG.add("capstone-local-global", "different-seeds", local_vs_dense=_experiment(second_seed=1))
WRONG.add("capstone-local-global", "both-masked", local_vs_dense=_experiment(mask_dense=True))
# the experiment right, through a my_sdpa that is not: the diagnosis points at part 1
WRONG.add("capstone-local-global", "capstone-sdpa-fails",
          local_vs_dense=_experiment(attend=_sdpa(default_scale="none")), my_sdpa=_sdpa(default_scale="none"))


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
