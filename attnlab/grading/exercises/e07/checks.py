"""The checks of exercise 07_flash_attention (:mod:`attnlab.grading.engine`); known mistakes are emulations, the
algorithm block by block in PyTorch with a switch per mistake.

Why the PyTorch forward's causal skip is tested with a NaN-poisoned tail: peak memory cannot show skipped tiles, FLOP
counts taken in the learner's process are its word, and CPU time (honest) only doubles, within one run's noise. With
``Nk > Nq`` and ``V = NaN`` in the keys no query sees, a computed key block reaches ``O`` (``0 * NaN``), a skipped one
never does (one block past the last query block's bound already does). The inline ``check()`` counts FLOPs too.
"""

import math
import numbers
from functools import partial

import torch

from attnlab.grading.core import (Fail, Mistake, case_line, check_function, check_with_gradients, diagnose,
                                  each_result, gen, learner_of, mismatch, mistakes, present, randn, salted_ints, table,
                                  value_of)
from attnlab.grading.engine import Function, Kernel, Launch, Measured
from attnlab.grading.exercises.e07 import spec as specs
from attnlab.grading.kernel_check import attention_budget, attention_launch, cdiv
from attnlab.grading.sandbox.footprint import measured_call, peak_growth

RTOL, ATOL = 1e-4, 1e-5          # float32: the order of additions differs from the reference's, nothing else
GRAD_RTOL, GRAD_ATOL = 1e-4, 5e-5


# ----------------------------------------------------------------------------- online-softmax-update
def _online_case(g, rows, nb, dv, first, scale):
    s_block, v_block = randn(g, rows, nb, scale=scale), randn(g, nb, dv)
    state = ((torch.full((rows,), float("-inf")), torch.zeros(rows), torch.zeros(rows, dv)) if first else
             (randn(g, rows) * 2 * scale, torch.rand(rows, generator=g) + 0.5, randn(g, rows, dv)))
    label = (f"the first block (m = -inf, l = 0, acc = 0), M={rows}, Nb={nb}" if first else
             f"a later block, M={rows}, Nb={nb}" + (", scores ~ 30" if scale > 1 else ""))
    return label, (*state, s_block, v_block), {}


_online_cases = partial(table, 1300, [(4, 8, 5, True, 1.0), (3, 16, 4, False, 1.0), (6, 5, 8, False, 1.0),
                                      (2, 4, 3, False, 30.0)], _online_case)


def _online_with(mistake):
    def impl(m, l, acc, s_block, v_block):
        m_new = m if mistake == "max" else torch.maximum(m, s_block.amax(-1))
        alpha = torch.exp(m_new - m if mistake == "inverted" else m - m_new)
        p = torch.exp(s_block - (m if mistake == "p-old-max" else m_new)[:, None])
        return (m_new, (l if mistake == "l" else alpha * l) + p.sum(-1),
                (acc if mistake == "acc" else alpha[:, None] * acc) + p @ v_block)
    return impl


_ONLINE_MISTAKES = mistakes(_online_with, [
    ("acc-not-rescaled", "multiply acc by exp(m_old - m_new) before adding the new block", {"mistake": "acc"}),
    ("l-not-rescaled", "rescale the running sum l by exp(m_old - m_new) too", {"mistake": "l"}),
    ("max-not-updated", "update the running max with the new block's max", {"mistake": "max"}),
    ("rescale-inverted", "the rescale factor is exp(m_old - m_new) <= 1, not its inverse", {"mistake": "inverted"}),
    ("p-uses-old-max", "P = exp(S - m_new), with the max that includes this block", {"mistake": "p-old-max"})])


# ----------------------------------------------------------------------- the forward (tiled-forward, flash-kernel-loop)
def _forward_emulation(q, k, v, causal=False, scale=None, block_m=16, block_n=16, rescale_acc=True, use_scale=True,
                       drop_tail=False, mask_tail=True, causal_strict=False, diagonal_unmasked=False, lse="ok",
                       exp2=False, normalise=True, causal_in_tile=False):
    """FlashAttention-2's forward, q (B, Nq, d), k, v (B, Nk, d) -> (O, L), a switch per known mistake."""
    (B, Nq, d), Nk, dv = q.shape, k.shape[1], v.shape[-1]
    sc = (d ** -0.5 if scale is None else scale) if use_scale else 1.0
    ex = torch.exp2 if exp2 else torch.exp
    o, L = q.new_zeros(B, Nq, dv), q.new_zeros(B, Nq)
    for q0 in range(0, Nq, block_m):
        q1 = min(q0 + block_m, Nq)
        rows = torch.arange(q0, q1)[:, None]                               # (bq, 1)
        m, l, acc = q.new_full((B, q1 - q0), float("-inf")), q.new_zeros(B, q1 - q0), q.new_zeros(B, q1 - q0, dv)
        for k0 in range(0, min(q1, Nk) if causal else Nk, block_n):
            if drop_tail and k0 + block_n > Nk:
                continue
            kb, vb = k[:, k0:k0 + block_n], v[:, k0:k0 + block_n]         # (B, <= bk, d)
            if not mask_tail:                                              # loaded as 0, never masked
                kb, vb = (torch.nn.functional.pad(t, (0, 0, 0, block_n - t.shape[1])) for t in (kb, vb))
            cols = torch.arange(k0, k0 + kb.shape[1])[None, :]             # (1, bk)
            s = q[:, q0:q1] @ kb.transpose(1, 2) * sc                      # (B, bq, bk)
            if causal and not diagonal_unmasked:   # causal_in_tile: positions inside the tile, not absolute ones
                keep = (cols - k0 <= rows - q0) if causal_in_tile else (cols < rows if causal_strict else cols <= rows)
                s = s.masked_fill(~keep, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            alpha, p = ex(m - m_new), ex(s - m_new[..., None])
            l = alpha * l + p.sum(-1)
            acc = (alpha[..., None] * acc if rescale_acc else acc) + p @ vb
            m = m_new
        o[:, q0:q1] = acc / l[..., None] if normalise else acc
        L[:, q0:q1] = {"no-max": torch.log(l), "max": m, "base2": (m + torch.log(l)) * math.log2(math.e)}.get(
            lse, m + (torch.log2(l) if exp2 else torch.log(l)))
    return o, L


def _fwd(index=slice(None), scale_argument=True, **switches):
    """(O, L), or output ``index`` alone (a kernel's O or L, matched only with its own); ``scale`` comes last."""
    return lambda q, k, v, causal=False, block_m=16, block_n=16, scale=None: _forward_emulation(
        q, k, v, causal, scale if scale_argument else None, block_m, block_n, **switches)[index]


_OUT = [   # (key, message, switches): the forward's mistakes, of the PyTorch function and the kernel alike; O wrong
    ("acc-not-rescaled", "rescale acc: acc = acc * exp(m_old - m_new)[:, None] + P V", dict(rescale_acc=False)),
    ("scale-forgotten", "multiply the scores by the scale 1/sqrt(d)", dict(use_scale=False)),
    ("off-by-one-block-edge", "last, partial key block dropped: loop over range(0, N, block)", dict(drop_tail=True)),
    ("causal-off-by-one", "query i sees keys j <= i, its own key included", dict(causal_strict=True)),
    ("causal-diagonal-unmasked", "in the block that crosses the diagonal, set the scores of keys j > i to -inf",
     dict(diagonal_unmasked=True)),
    ("not-normalised", "divide the output by the running sum l at the end", dict(normalise=False)),
    ("causal-positions-in-tile", "the causal mask compares positions inside the tile: build the query and key "
     "positions from q0 and k0 (key k0 + j is seen when k0 + j <= q0 + i)", dict(causal_in_tile=True))]
_LSE = [   # O right, L wrong
    ("lse-missing-max", "l is a sum of exp(S - m), so L = m + log(l), not log(l)", dict(lse="no-max")),
    ("lse-is-max", "L = m + log(l), not the running max m alone", dict(lse="max")),
    ("lse-in-base-2", "L is in base 2 (log2(e) folded in for exp2): the backward needs the natural m + log(l)",
     dict(lse="base2"))]
_FORWARD_MISTAKES = [Mistake(key, message, _fwd(**switches)) for key, message, switches in _OUT + _LSE]
_FUNCTION_MISTAKES = [Mistake(key, message, _fwd(0, **switches)) for key, message, switches in _OUT]  # O alone


def _compare_outputs(name, label, got, args, names, mistakes, expected="a tuple", missing=(), rtol=RTOL, atol=ATOL):
    """Fail unless ``got`` holds the reference's outputs ``names`` (else ``missing``); name the ``mistakes`` (each
    giving every output) whose output matches the first that differs."""
    spec = getattr(specs, name)
    want = spec(*args)
    if not isinstance(got, (tuple, list)) or len(got) != len(want):
        kind = f"a tuple of {len(got)} values" if isinstance(got, (tuple, list)) else type(got).__name__
        raise Fail(f"`{name}` on {label}: expected {expected} ({', '.join(names)}), got {kind}", list(missing))
    for g, w, what in zip(got, want, names):
        if not torch.is_tensor(g) or g.shape != w.shape:
            kind = f"of shape {tuple(g.shape)}" if torch.is_tensor(g) else "None" if g is None else type(g).__name__
            raise Fail(f"`{name}` on {label}: {what} is {kind}; expected a tensor of shape {tuple(w.shape)}",
                       list(missing))
    for i, (g, w, what) in enumerate(zip(got, want, names)):
        why = mismatch(g, w, rtol, atol)
        if why:
            found = diagnose(g, [Mistake(m.key, m.message, lambda *a, f=m.impl: f(*a)[i]) for m in mistakes], args,
                             {}, rtol, atol)
            raise Fail(f"`{name}` on {label}: {what}: {why}\n    {case_line(label, args, {}, spec)}", found)


def _qkv(g, b, nq, nk, amp=1.0, grad=False):
    """q and k (times ``amp``: large scores), v and, with ``grad``, dO, drawn from ``g``."""
    q, k, v = randn(g, b, nq, 16, scale=amp), randn(g, b, nk, 16, scale=amp), randn(g, b, nk, 16)
    return (q, k, v, randn(g, b, nq, 16)) if grad else (q, k, v)


def _case(g, b, nq, nk, causal, bq, bk, amp, grad=False):
    """A case (with dO last if ``grad``) of a row (B, Nq, Nk, causal, block_m, block_n, amp)."""
    q, k, v, *do = _qkv(g, b, nq, nk, amp, grad)
    label = (f"B={b}, Nq={nq}" + (f", Nk={nk}" if nk != nq else "") + f", d=16, causal={causal}, block_m={bq}, "
             f"block_n={bk}" + (" with large scores (q, k ~ 3 randn)" if amp > 1 else "")
             + (", N not a multiple of the blocks" if nq % bq or nk % bk else ""))
    return (label, (q, k, v, causal, bq, bk), {}, *do)


_tiled_cases = partial(table, 1400, [(2, 32, 32, False, 16, 16, 1.0), (2, 40, 40, True, 16, 16, 1.0),
                                     (1, 24, 37, False, 16, 8, 1.0), (2, 48, 48, True, 16, 32, 3.0),
                                     (1, 5, 5, True, 16, 16, 1.0)], _case)
_backward_cases = partial(table, 1800, [(2, 32, 32, False, 16, 16, 1.0), (2, 40, 40, True, 16, 16, 1.0),
                                        (1, 24, 37, False, 16, 8, 1.0), (2, 48, 48, True, 16, 32, 1.0)],
                          partial(_case, grad=True))


# ----------------------------------------------------------------------------- tiled-forward
def _measure_tiled_forward(learner):
    learner, name, cases = learner_of(learner), "tiled_attention_forward", _tiled_cases()
    for label, args, _kw, got in each_result(learner, name, cases):
        _compare_outputs(name, label, got, args, ("O", "L"), _FORWARD_MISTAKES)
    # the autograd.Function's forward (no gradient asked here): the same O
    n = check_function(learner, "flash_attention_pytorch", specs.flash_attention_pytorch, cases[1:3],
                       _FUNCTION_MISTAKES)
    return (f"{len(cases)} cases match O and L (causal, Nq != Nk, partial blocks, large scores), and "
            f"FlashAttentionFunction's forward on {n}; {_check_technique(learner, name)}")


# the technique, measured from outside the learner's code (attnlab/grading/sandbox/footprint.py)
PEAK_N = 4096                      # an N x N float32 matrix is 64 MiB here; q, k, v are 256 KiB each
PEAK_BLOCK = 128                   # tiles of 128 x 128 (64 KiB): 1024 of them, quick to run
ROW_BLOCK = 4 * PEAK_BLOCK * PEAK_N     # one (block_m, N) row block of scores: 2 MiB
PEAK_LIMIT = 2 * ROW_BLOCK   # tiled calls grew by 0.25-0.75 MiB under attnlab grade, row blocks by 20-24, N x N by 64+
_TILES = ("walk K and V in tiles of block_n keys with the online softmax (forward) or P recomputed tile by tile "
          "from L (backward)")
FULL_MATRIX = Mistake("holds-n-by-n", f"an N x N matrix (all of S or P) is held: {_TILES}", None)
ROW_BLOCKS = Mistake("row-block-against-all-keys", f"a (block_m, N) row block of scores is held: {_TILES}", None)
NOT_SKIPPED = Mistake("causal-blocks-not-skipped", "with causal the key blocks above the diagonal are still computed: "
                      "a query block ending at row r needs keys < min(r + 1, Nk) only", None)


def _check_memory(learner, name, seed, case=None, second=None):
    """Fail when a call at N = PEAK_N (``case``, else drawn from ``seed``) grows the peak memory over PEAK_LIMIT."""
    case = case or [(*_qkv(gen(seed), 1, PEAK_N, PEAK_N), False, PEAK_BLOCK, PEAK_BLOCK), {}]
    peak = peak_growth(learner, name, case, f"B=1, N={PEAK_N}, d=16", "that no N x N matrix is held",
                       spec=getattr(specs, name), second=second, limit=PEAK_LIMIT)
    if peak > PEAK_LIMIT:
        raise Fail(f"`{name}` on B=1, N={PEAK_N}, d=16, block_m=block_n={PEAK_BLOCK}: the peak memory grew by "
                   f"{peak / 2**20:.1f} MiB, where an N x N float32 matrix is {4 * PEAK_N ** 2 / 2**20:.0f} MiB, a "
                   f"(block_m, N) row block {ROW_BLOCK / 2**20:.0f} MiB; a tiled function needs under two row blocks",
                   [FULL_MATRIX if peak > 4 * PEAK_N ** 2 // 2 else ROW_BLOCKS])
    return f"no N x N matrix and no row block against all keys held at N={PEAK_N} (peak grew < {PEAK_LIMIT >> 20} MiB)"


def _check_technique(learner, name):
    """tiled-forward's technique: no N x N matrix, and causal tiles skipped (a poisoned tail, counted FLOPs)."""
    notes = [_check_memory(learner, name, 1491)]
    g = gen(1490)
    q, k, v = randn(g, 1, 32, 16), randn(g, 1, 64, 16), randn(g, 1, 64, 16)
    v[:, 32:] = float("nan")   # keys past the last query block's tiles: seen by no query
    label = "B=1, Nq=32, Nk=64, d=16, causal=True, block_m=block_n=16, V = NaN in the keys no query sees"
    for *_, got in each_result(learner, name, [(label, (q, k, v, True, 16, 16), {})]):
        if isinstance(got, (tuple, list)) and got and torch.is_tensor(got[0]) and torch.isnan(got[0]).any():
            raise Fail(f"`{name}` on {label}: O holds NaN, so the NaN values of V reached it through key blocks "
                       f"that no query may see", [NOT_SKIPPED])
    n, bq = 256, 32
    reply, cost = measured_call(learner, name, [(*(randn(g, 1, n, 16) for _ in range(3)), True, bq, bq), {}])
    present(reply, name)
    value_of((reply.get("results") or [{"raised": "no result"}])[0], name, f"B=1, N={n}, causal=True")
    if cost["flops"] is not None:   # QK^T and PV on each tile a causal forward keeps
        budget = sum(min(q0 + bq, n) > k0 for q0 in range(0, n, bq) for k0 in range(0, n, bq)) * 4 * bq * bq * 16
        if cost["flops"] > 1.3 * budget:
            raise Fail(f"`{name}` on B=1, N={n}, d=16, causal=True, block_m=block_n={bq}: {cost['flops']:,} matmul "
                       f"FLOPs; skipping the tiles above the diagonal needs {budget:,} ({cost['flops'] / budget:.2f}x)",
                       [NOT_SKIPPED])
        notes.append("causal tiles skipped (counted matmul FLOPs)")
    return ", ".join(notes)


# ------------------------------------------------------------------------ the backward (tiled-backward, dkdv-kernel)
def _backward_emulation(q, k, v, o, lse, do, causal=False, block_m=16, block_n=16, scale=None, subtract_d=True,
                        sign_flipped=False, scale_grads=True, recompute_scaled=True, mask="ok", d_per_tile=False):
    """dQ, dK, dV (B, N, d) from L with a switch per known mistake. ``mask``: "ok", "none", or the tiles above the
    diagonal skipped and those that cross it unmasked, looping on query blocks ("blocks") or key blocks ("kblocks")."""
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    p = torch.exp(q @ k.transpose(1, 2) * (sc if recompute_scaled else 1.0) - lse[..., None])   # (B, Nq, Nk)
    rows, cols = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
    if causal and mask != "none":
        first = cols // block_n * block_n                                   # each key's block's first key
        p = p.masked_fill({"ok": cols > rows, "kblocks": rows < first // block_m * block_m,
                           "blocks": first >= torch.clamp((rows // block_m + 1) * block_m, max=q.shape[1])}[mask], 0)
    dp = do @ v.transpose(1, 2)                                              # (B, Nq, Nk)
    if d_per_tile:   # D_i summed over one key tile only
        D = torch.cat([t.sum(-1, keepdim=True).expand_as(t) for t in (p * dp).split(block_n, -1)], -1)
    else:
        D = (do * o).sum(-1, keepdim=True)                                   # (B, Nq, 1)
    ds = p * (D - dp) if sign_flipped else p * (dp - D) if subtract_d else p * dp
    g = sc if scale_grads else 1.0
    return ds @ k * g, ds.transpose(1, 2) @ q * g, p.transpose(1, 2) @ do


class _WrongBackward(torch.autograd.Function):
    """The reference's forward, a backward with ``_backward_emulation``'s ``switches`` (given first to apply)."""

    @staticmethod
    def forward(ctx, switches, q, k, v, causal=False, block_m=16, block_n=16):
        o, lse = specs.tiled_attention_forward(q, k, v, causal, block_m, block_n)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, block_m, block_n, switches)
        return o

    @staticmethod
    def backward(ctx, do):
        causal, block_m, block_n, switches = ctx.args
        grads = _backward_emulation(*ctx.saved_tensors, do, causal, block_m, block_n, **switches)
        return None, *grads, *[None] * (len(ctx.needs_input_grad) - 4)


_CAUSAL_BWD = "with causal, set the recomputed P to 0 where key j > query i, in tiles crossing the diagonal too"
_BWD = [   # (key, message, switches): the backward's mistakes, of the PyTorch backward and of the dK/dV kernel alike
    ("d-not-subtracted", "subtract each row's D: dS = P * (dP - D), D_i = rowsum(dO_i * O_i)", dict(subtract_d=False)),
    ("ds-sign-flipped", "the sign of dS is flipped: dS = P * (dP - D)", dict(sign_flipped=True)),
    ("grad-scale-forgotten", "dQ = dS K * scale and dK = dS^T Q * scale", dict(scale_grads=False)),
    ("recompute-scale-forgotten", "scale recomputed scores: P = exp(Q K^T * scale - L)", dict(recompute_scaled=False)),
    *[("causal-mask-missing-in-backward", _CAUSAL_BWD, dict(mask=mask)) for mask in ("none", "blocks", "kblocks")],
    ("d-from-one-tile", "D_i = rowsum(dO_i * O_i) is over the whole row, not one key tile: compute it once before "
     "the loops", dict(d_per_tile=True))]
# a wrong flash_attention_pytorch (its backward wrong), and the hand-written backward that the grader calls itself
_BACKWARD_MISTAKES = [Mistake(key, message, partial(_WrongBackward.apply, switches)) for key, message, switches in _BWD]
_DIRECT_MISTAKES = [Mistake(key, message, partial(_backward_emulation, **switches)) for key, message, switches in _BWD]
GRADIENT_MISSING = Mistake("gradient-missing", "return (dq, dk, dv) shaped like q, k, v; the grader calls it", None)


# ----------------------------------------------------------------------------- tiled-backward
def _measure_tiled_backward(learner):
    learner, name = learner_of(learner), "tiled_attention_backward"

    def with_o_and_l(q, k, v, causal, bq, bk, do):   # the backward's arguments, with the grader's own O and L
        return (q, k, v, *specs.tiled_attention_forward(q, k, v, causal, bq, bk), do, causal, bq, bk)

    cases = [(label, with_o_and_l(*args, do), {}) for label, args, _kw, do in _backward_cases()]
    for label, args, _kw, got in each_result(learner, name, cases):
        _compare_outputs(name, label, got, args, ("dq", "dk", "dv"), _DIRECT_MISTAKES, "three gradients",
                         [GRADIENT_MISSING], GRAD_RTOL, GRAD_ATOL)
    # the peak memory of the hand-written backward itself, at a size where one N x N matrix dominates
    peak_cases = ([with_o_and_l(q, k, v, False, PEAK_BLOCK, PEAK_BLOCK, do), {}]
                  for q, k, v, do in (_qkv(gen(seed), 1, PEAK_N, PEAK_N, grad=True) for seed in (1890, 1891)))
    memory = _check_memory(learner, name, 1890, *peak_cases)
    # the autograd.Function routes its backward there: one small case, through autograd
    check_with_gradients(learner, "flash_attention_pytorch", specs.flash_attention_pytorch, _backward_cases()[1:2],
                         inputs=[0, 1, 2], mistakes=_BACKWARD_MISTAKES, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                         labels=["dQ", "dK", "dV"])
    return (f"{len(cases)} cases match dQ, dK and dV (causal, Nq != Nk, partial blocks); {memory}; "
            f"FlashAttentionFunction's backward gives the same gradients")


# ----------------------------------------------------------------------------- the kernels (held to float32 on a GPU)
IGNORES_STRIDES = Mistake("ignores-strides", "wrong on padded rows: address each tensor with its own strides "
                          "(offs_n[:, None] * stride_kn + offs_d[None, :], pid * stride_kb), never N or HEAD_DIM", None)
TF32 = Mistake("tf32-dot", "close only to ~1e-3: tl.dot uses TF32 for float32 unless input_precision=\"ieee\"", None)
SCALE_IGNORED = ("scale-argument-ignored", "multiply the scores (and, backward, dK) by `scale`, not 1/sqrt(HEAD_DIM)")
# each tensor padded differently, so that its strides are its own and not the row length (DK as K, DV as V, D as L)
_PADS = {"q": (16, 0), "k": (8, 16), "v": (4, 0), "o": (8, 8), "do": (8, 8), "l": (0, 8), "d": (0, 8), "dk": (8, 16),
         "dv": (4, 0)}


def _launch(g, b, n, causal, bm, bn, amp, sc, backward=False):
    """A forward (or dK/dV) kernel's :class:`Launch` of a row (B, N, causal, BLOCK_M, BLOCK_N, amp, scale)."""
    q, k, v, *do = _qkv(g, b, n, n, amp, backward)
    o, lse = specs.tiled_attention_forward(q, k, v, causal, scale=sc)
    label = (f"B={b}, N={n}, HEAD_DIM=16, causal={causal}, scale={sc}, BLOCK_M={bm}, BLOCK_N={bn}"
             + (" with large scores" if amp > 1 else "")
             + (", N < BLOCK" if n < bm else ", a partial last block" if n % bn or n % bm else ""))
    if backward:
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        specs.tiled_attention_forward(qq, kk, vv, causal, scale=sc)[0].backward(do[0])
        tensors = {"q": q, "k": k, "v": v, "do": do[0], "l": lse, "d": (do[0] * o).sum(-1), "dk": (b, n, 16),
                   "dv": (b, n, 16)}
        want, strided, budget = {"dk": kk.grad, "dv": vv.grad}, ("q", "k", "v", "do"), _dkdv_budget
    else:
        tensors = {"q": q, "k": k, "v": v, "o": (b, n, 16), "l": (b, n)}
        want, strided, budget = {"o": o, "l": lse}, ("q", "k", "v", "o"), _forward_budget
    # the buffers, the batch and row strides of ``strided``, L's batch stride, N and the scale
    buffers, args = attention_launch(tensors, _PADS, [*strided, ("l", 0)], [n, sc])
    return Launch(label, buffers, (cdiv(n, bn if backward else bm), b), args,
                  {"HEAD_DIM": 16, "BLOCK_M": bm, "BLOCK_N": bn, "CAUSAL": causal}, want,
                  (q, k, v, *do, causal, bm, bn, sc),
                  (*("Q", "K", "V", "DO")[:3 + backward], "CAUSAL", "BLOCK_M", "BLOCK_N", "scale"),
                  budget(b, n, 16, causal, bm, bn))


def _not_skipped(buffer, budget, mistake):
    """A traffic diagnosis: with CAUSAL, loading as many bytes of ``buffer`` as a non-causal launch is ``mistake``."""
    def diagnosis(case, traffic):
        c, (b, n, d) = case.constexprs, case.inputs[0].shape
        full = budget(b, n, d, False, c["BLOCK_M"], c["BLOCK_N"])[buffer][0]
        return [mistake] if c["CAUSAL"] and traffic[buffer]["load_bytes"] >= full > case.budget[buffer][0] else []
    return diagnosis


# ----------------------------------------------------------------------------- flash-kernel-loop
def _forward_budget(b, n, d, causal, bm, bn, es=4):
    """Q read once, K and V once per query block (with causal the key blocks that start before its end)."""
    kv_rows = sum(min(n, cdiv(min(q0 + bm, n) if causal else n, bn) * bn) for q0 in range(0, n, bm))
    return {**attention_budget((b, n, d), b * kv_rows, es), "l": (0, b * n * es)}


_FLASH = Kernel(  # scale is never only 1/sqrt(HEAD_DIM) = 0.25: a kernel must use its scale argument
    "flash_fwd_kernel", partial(table, 1500, [
        (2, 32, False, 16, 16, 1.0, 0.25), (2, 40, True, 16, 16, 1.0, 0.6), (2, 37, False, 32, 16, 3.0, 0.25),
        (2, 48, True, 32, 16, 1.0, 0.4), (1, 7, True, 16, 16, 1.0, 0.25), (2, 40, True, 16, 32, 1.0, 0.15)], _launch),
    _FUNCTION_MISTAKES + [Mistake(key, message, _fwd(1, **switches)) for key, message, switches in _LSE]
    + [Mistake(*SCALE_IGNORED, _fwd(0, scale_argument=False)),
       Mistake("masked-keys-not-masked", "keys past N need score -inf (offs_n < N)", _fwd(0, mask_tail=False)),
       Mistake("exp2-without-log2e", "exp(x) = exp2(x * log2(e)): multiply the scores by scale * 1.4426950408889634 "
               "before exp2 (or use tl.exp)", _fwd(0, exp2=True))],
    says="{n} launches match O and L (causal, partial blocks, N < BLOCK, large scores)",
    budget_says="Q read once, K and V once per query block (with CAUSAL only the blocks on or below the diagonal), O "
    "and L written once", traffic_diagnosis=_not_skipped("k", _forward_budget, NOT_SKIPPED), tf32=TF32,
    stride_mistake=IGNORES_STRIDES)


# ----------------------------------------------------------------------------- dkdv-kernel
def _dkdv_budget(b, n, d, causal, bm, bn, es=4):
    """K, V once; Q, dO, L and D once per key block (with causal from the first query block that sees it)."""
    rows = b * sum(n - (k0 // bm * bm if causal else 0) for k0 in range(0, n, bn))
    qd, kv = rows * d * es, b * n * d * es
    return {"q": (qd, 0), "do": (qd, 0), "l": (rows * es, 0), "d": (rows * es, 0), "k": (kv, 0), "v": (kv, 0),
            "dk": (0, kv), "dv": (0, kv)}


def _dkdv_wrong(scale_argument=True, padded_rows=False, **switches):
    """dK (where every known mistake shows, compared before dV) of a dK/dV kernel's mistake."""
    def impl(q, k, v, do, causal, bm, bn, scale):
        o, lse = specs.tiled_attention_forward(q, k, v, causal, scale=scale)
        dk = _backward_emulation(q, k, v, o, lse, do, causal, bm, bn, scale if scale_argument else None, **switches)[1]
        # rows past N in a partial last query block: P = exp(0 - (-inf)) = inf against every key, times dO = 0
        return torch.full_like(dk, float("nan")) if padded_rows and q.shape[1] % bm else dk
    return impl


NOT_SKIPPED_BWD = Mistake("causal-blocks-not-skipped", "with CAUSAL only queries i >= c see a key block starting at "
                          "c: start the loop at (c // BLOCK_M) * BLOCK_M, not 0", None)
_DKDV = Kernel(
    "flash_bwd_dkdv_kernel", partial(table, 1900, [
        (2, 32, False, 16, 16, 1.0, 0.25), (2, 40, True, 16, 16, 1.0, 0.6), (1, 37, False, 32, 16, 1.0, 0.4),
        (2, 48, True, 16, 32, 1.0, 0.25)], partial(_launch, backward=True)),
    [Mistake(key, message, _dkdv_wrong(**switches)) for key, message, switches in _BWD]
    + [Mistake(*SCALE_IGNORED, _dkdv_wrong(scale_argument=False)),
       Mistake("padded-rows-not-zeroed", "rows past N get P = exp(S - L) from the L loaded there, and inf * dO = 0 "
               "is NaN: zero P where offs_m >= N, load L and D with other=0.0", _dkdv_wrong(padded_rows=True))],
    says="{n} launches match dK and dV", budget_says="K and V read once, Q, dO, L and D once per key block (with "
    "CAUSAL only from the first query block that sees it), dK and dV written once",
    traffic_diagnosis=_not_skipped("q", _dkdv_budget, NOT_SKIPPED_BWD), tf32=TF32, stride_mistake=IGNORES_STRIDES)


# ----------------------------------------------------------------------------- traffic-experiment
TRAFFIC_RTOL = 0.01   # the part's stated tolerance: bytes are exact for a kernel that moves only what it needs
_bytes = partial(torch.tensor, dtype=torch.float64)   # compared by mismatch, within that tolerance


def _traffic_cases():
    draws, cases = iter(salted_ints(1700, *[(0, 2), (0, 9_999)] * 4)), []
    # block sizes that differ from the default and from each other: a measurement must pass them on
    for causal, low, bm, bn in ((False, 24, 16, 16), (True, 48, 16, 16), (True, 48, 32, 16), (False, 32, 16, 32)):
        n, seed = low + 8 * next(draws), next(draws)                      # n: 24 ... 40, then 48 ... 64
        cases.append((f"n={n}, causal={causal}, block_m={bm}, block_n={bn}, seed={seed}", (n, causal, bm, bn, seed),
                      {}))
    return cases


def _traffic_of(value, **forced):
    """A wrong measurement: ``value`` of the reference kernel's trace, launched with the ``forced`` arguments."""
    return lambda n, causal=False, block_m=16, block_n=16, seed=0: _bytes(value(specs.forward_trace(
        n, **{"causal": causal, "block_m": block_m, "block_n": block_n, **forced}, seed=seed)))


_TRAFFIC_MISTAKES = [Mistake(key, message, _traffic_of(value, **forced)) for key, message, value, forced in [
    ("reads-only", "count the stores of O and L too, not only the reads", lambda t: t.bytes_read, {}),
    ("unique-bytes", "count every access (K and V once per query block), not unique bytes",
     lambda t: t.unique_bytes_read + t.unique_bytes_written, {}),
    ("elements-not-bytes", "these are elements: a float32 moves 4 bytes", lambda t: t.total_bytes // 4, {}),
    ("causal-ignored", "pass the causal flag on to the kernel", lambda t: t.total_bytes, {"causal": False}),
    ("blocks-ignored", "pass block_m and block_n on", lambda t: t.total_bytes, {"block_m": 16, "block_n": 16}),
    ("kv-only", "Q, O and L are traffic too, not only K and V",
     lambda t: t.by_tensor["K"]["read"] + t.by_tensor["V"]["read"], {})]]


def _measure_traffic(learner):
    name, tolerance, lines = "forward_traffic", dict(rtol=TRAFFIC_RTOL, atol=0.0), []
    for label, args, _kw, got in each_result(learner, name, _traffic_cases()):
        if torch.is_tensor(got) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            raise Fail(f"`{name}` on {label}: expected a number of bytes, got {type(got).__name__}")
        want = specs.forward_traffic(*args)
        if mismatch(_bytes(float(got)), _bytes(want), **tolerance):    # NaN is never within it
            found = diagnose(_bytes(float(got)), _TRAFFIC_MISTAKES, args, {}, **tolerance)
            more = (" (more than a kernel that reads K and V once per query block: does your kernel pass "
                    "flash-kernel-loop's traffic check?)" if got > want and not found else "")
            raise Fail(f"`{name}` on {label}: measured {got:,.0f} bytes; reproduced with the reference kernel: "
                       f"{want:,} bytes (tolerance {TRAFFIC_RTOL:.0%}){more}", found)
        lines.append(f"{want:,} B at n={args[0]}{' causal' if args[1] else ''}, blocks {args[2]} x {args[3]}")
    return f"your measurements reproduce ({', '.join(lines)}) within {TRAFFIC_RTOL:.0%}"


TABLES = {
    "online-softmax-update": Function("online_softmax_update", specs.online_softmax_update, _online_cases,
                                      _ONLINE_MISTAKES, says="{n} cases match the spec, including the first block"),
    "tiled-forward": Measured("peak-memory", _measure_tiled_forward, {
        "tiled_attention_forward": _FORWARD_MISTAKES, "flash_attention_pytorch": _FUNCTION_MISTAKES}),
    "flash-kernel-loop": _FLASH,
    "traffic-experiment": Measured("experiment", _measure_traffic, {"forward_traffic": _TRAFFIC_MISTAKES}),
    "tiled-backward": Measured("peak-memory", _measure_tiled_backward, {
        "tiled_attention_backward": _DIRECT_MISTAKES, "flash_attention_pytorch": _BACKWARD_MISTAKES}),
    "dkdv-kernel": _DKDV,
}
