"""The checks of exercise 07_flash_attention: one table per graded part (:mod:`attnlab.grading.engine`), in ``TABLES``.

The PyTorch parts are compared with :func:`attnlab.tiled.tiled_attention` (through ``spec.py``); the
Triton parts are launched by the grader itself (:func:`attnlab.grading.engine.launch`: sentinel-guarded
buffers whose strides are not the row length) and, in the interpreter, held to a byte budget: K and V read
once per query block (only the blocks a causal block needs), each output written once, nothing else. Known
mistakes are recognised by running *emulations*: the algorithm written block by block in PyTorch with a
switch per mistake (``_forward_emulation``, ``_backward_emulation``), so one function gives the right answer
and each wrong one.

**Why the causal skip of the PyTorch forward rests on a NaN-poisoned tail under ``attnlab grade``.** The
grader can measure the learner's process from outside only by what the operating system reports about it.
Peak memory cannot show skipped tiles (a loop that computes a masked tile allocates the same tiles as one that
skips it). Operation counts (``FlopCounterMode``, a dispatch trace) are taken inside the process that runs the
learner's code, so they are the learner's word. CPU time from outside (the cgroup's ``cpu.stat``) is the
learner's true cost, but a causal loop that skips nothing costs about twice as much, and on a shared machine
that ratio is within the noise of one run: it would fail honest answers. So the check computes what no
skipping loop can fake: with ``Nk > Nq`` and ``V = NaN`` in the keys no query may see, a key block that is
computed reaches ``O`` (``0 * NaN = NaN`` in ``P V``), one that is skipped never does. A loop's bound is one
expression of the query block, and the last query block's bound is the one the poisoned keys test (one block
too many already reaches them). Where the learner's code runs in this process (the inline ``check()``), the
matmul FLOPs are also counted, as feedback.
"""

import math
import numbers

import torch

from attnlab.grading.core import (Fail, Mistake, case_line, check_function, check_with_gradients, diagnose,
                                  each_result, gen as _gen, learner_of, mismatch, present, randn as _randn, value_of)
from attnlab.grading.engine import Function, Kernel, Launch, Measured
from attnlab.grading.exercises.e07 import spec as specs
from attnlab.grading.kernel_check import attention_launch, cdiv
from attnlab.grading.sandbox.footprint import measured_call, peak_growth
from attnlab.tiled import tiled_attention

RTOL, ATOL = 1e-4, 1e-5          # float32: the order of additions differs from the reference's, nothing else
GRAD_RTOL, GRAD_ATOL = 1e-4, 5e-5


# ----------------------------------------------------------------------------- online-softmax-update

def _online_cases():
    cases = []
    for seed, (m_rows, nb, dv, first) in enumerate([(4, 8, 5, True), (3, 16, 4, False), (6, 5, 8, False),
                                                      (2, 4, 3, False)]):
        g = _gen(1300 + seed)
        scale = 30.0 if seed == 3 else 1.0
        s_block, v_block = _randn(g, m_rows, nb, scale=scale), _randn(g, nb, dv)
        if first:
            m = torch.full((m_rows,), float("-inf"))
            l, acc = torch.zeros(m_rows), torch.zeros(m_rows, dv)
            label = f"the first block (m = -inf, l = 0, acc = 0), M={m_rows}, Nb={nb}"
        else:
            m, l, acc = _randn(g, m_rows) * 2 * scale, torch.rand(m_rows, generator=g) + 0.5, _randn(g, m_rows, dv)
            label = f"a later block, M={m_rows}, Nb={nb}" + (", scores ~ 30" if scale > 1 else "")
        cases.append((label, (m, l, acc, s_block, v_block), {}))
    return cases


def _online_with(rescale_acc=True, rescale_l=True, update_max=True, inverted=False, p_old_max=False):
    def impl(m, l, acc, s_block, v_block):
        m_new = torch.maximum(m, s_block.amax(-1)) if update_max else m
        alpha = torch.exp(m_new - m) if inverted else torch.exp(m - m_new)
        p = torch.exp(s_block - (m if p_old_max else m_new)[:, None])
        l_new = (alpha * l if rescale_l else l) + p.sum(-1)
        acc_new = (alpha[:, None] * acc if rescale_acc else acc) + p @ v_block
        return m_new, l_new, acc_new
    return impl


_ONLINE_MISTAKES = [
    Mistake("acc-not-rescaled", "the accumulator is not rescaled: multiply acc by exp(m_old - m_new) before adding "
            "the new block", _online_with(rescale_acc=False)),
    Mistake("l-not-rescaled", "the running sum l is not rescaled by exp(m_old - m_new)", _online_with(rescale_l=False)),
    Mistake("max-not-updated", "the running max is not updated with the new block's max",
            _online_with(update_max=False)),
    Mistake("rescale-inverted", "the rescale factor is inverted: it is exp(m_old - m_new) <= 1",
            _online_with(inverted=True)),
    Mistake("p-uses-old-max", "the new block's exponentials are taken against the old max: P = exp(S - m_new), "
            "with the max that includes this block (against m = -inf the first block overflows)",
            _online_with(p_old_max=True)),
]


# ----------------------------------------------------------------------------- the forward, with a switch per mistake
# (parts tiled-forward and flash-kernel-loop)

def _forward_emulation(q, k, v, causal=False, scale=None, block_m=16, block_n=16, rescale_acc=True, use_scale=True,
                       drop_tail=False, mask_tail=True, causal_strict=False, diagonal_unmasked=False, skip=True,
                       lse="ok", exp2=False, normalise=True, causal_in_tile=False):
    """FlashAttention-2's forward as the learner writes it: q (B, Nq, d), k, v (B, Nk, d) -> (O, L).

    The switches are the known mistakes: ``mask_tail=False`` lets keys past Nk (loaded as 0) into the
    softmax, ``causal_strict`` masks j >= i, ``diagonal_unmasked`` skips the blocks above the diagonal but
    masks nothing inside the one that crosses it, ``lse`` is "ok", "no-max" (log l), "max" (m) or
    "base2", ``exp2`` uses exp2 without folding log2(e) into the scale.
    """
    B, Nq, d = q.shape
    Nk = k.shape[1]
    sc = (d ** -0.5 if scale is None else scale) if use_scale else 1.0
    o = q.new_zeros(B, Nq, v.shape[-1])                                    # (B, Nq, dv)
    L = q.new_zeros(B, Nq)                                                 # (B, Nq)
    ex = (lambda x: torch.exp2(x)) if exp2 else torch.exp
    for q0 in range(0, Nq, block_m):
        q1 = min(q0 + block_m, Nq)
        rows = torch.arange(q0, q1)[:, None]                               # (bq, 1)
        m = q.new_full((B, q1 - q0), float("-inf"))
        l = q.new_zeros(B, q1 - q0)
        acc = q.new_zeros(B, q1 - q0, v.shape[-1])
        hi = min(q1, Nk) if (causal and skip) else Nk
        for k0 in range(0, hi, block_n):
            if drop_tail and k0 + block_n > Nk:
                continue
            kb, vb = k[:, k0:k0 + block_n], v[:, k0:k0 + block_n]         # (B, <= bk, d)
            if not mask_tail and kb.shape[1] < block_n:                    # loaded as 0, never masked
                pad = block_n - kb.shape[1]
                kb = torch.cat([kb, kb.new_zeros(B, pad, d)], 1)
                vb = torch.cat([vb, vb.new_zeros(B, pad, vb.shape[-1])], 1)
            cols = torch.arange(k0, k0 + kb.shape[1])[None, :]             # (1, bk)
            s = q[:, q0:q1] @ kb.transpose(1, 2) * sc                      # (B, bq, bk)
            if causal and not diagonal_unmasked:
                keep = cols < rows if causal_strict else cols <= rows
                if causal_in_tile:  # positions inside the tile compared, not absolute ones
                    keep = (cols - k0) <= (rows - q0)
                s = s.masked_fill(~keep, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            alpha = ex(m - m_new)
            p = ex(s - m_new[..., None])
            l = alpha * l + p.sum(-1)
            acc = (alpha[..., None] * acc if rescale_acc else acc) + p @ vb
            m = m_new
        o[:, q0:q1] = acc / l[..., None] if normalise else acc
        if lse == "no-max":
            L[:, q0:q1] = torch.log(l)
        elif lse == "max":
            L[:, q0:q1] = m
        elif lse == "base2":
            L[:, q0:q1] = (m + torch.log(l)) * math.log2(math.e)
        else:
            L[:, q0:q1] = m + (torch.log2(l) if exp2 else torch.log(l))
    return o, L


def _fwd(**flags):
    """A wrong ``tiled_attention_forward`` (one mistake's switches, kept on it as ``flags``)."""
    def impl(q, k, v, causal=False, block_m=16, block_n=16):
        return _forward_emulation(q, k, v, causal, None, block_m, block_n, **flags)
    impl.flags = flags
    return impl


_OUT_MISTAKES = [   # mistakes visible in O (and in L): compared on O
    Mistake("acc-not-rescaled", "the accumulator is not rescaled when the running max grows: "
            "acc = acc * exp(m_old - m_new)[:, None] + P V", _fwd(rescale_acc=False)),
    Mistake("scale-forgotten", "the scores are not multiplied by the scale 1/sqrt(d)", _fwd(use_scale=False)),
    Mistake("off-by-one-block-edge", "the last, partial block of keys is skipped: loop over range(0, N, block) "
            "and let the last block be shorter", _fwd(drop_tail=True)),
    Mistake("causal-off-by-one", "the causal mask is off by one: query i sees keys j <= i (its own key included), "
            "so no row is empty", _fwd(causal_strict=True)),
    Mistake("causal-diagonal-unmasked", "the blocks above the diagonal are skipped, but inside the block that "
            "crosses it keys j > i are not masked: set their scores to -inf", _fwd(diagonal_unmasked=True)),
    Mistake("not-normalised", "the output is not divided by the running sum l at the end", _fwd(normalise=False)),
    Mistake("causal-positions-in-tile", "the causal mask compares positions inside the tile (0 ... block - 1) instead "
            "of absolute ones: query q0 + i sees key k0 + j when k0 + j <= q0 + i, so build the two position "
            "vectors from q0 and k0", _fwd(causal_in_tile=True)),
]
_LSE_MISTAKES = [   # O right, L wrong: compared on L
    Mistake("lse-missing-max", "L is log(l) only: l is a sum of exp(S - m), so L = m + log(l)", _fwd(lse="no-max")),
    Mistake("lse-is-max", "L is the running max m alone: L = m + log(l)", _fwd(lse="max")),
    Mistake("lse-in-base-2", "L is in base-2 units (log2(e) folded in for exp2): the log-sum-exp the backward "
            "needs is natural, L = m + log(l) with m in the units of exp", _fwd(lse="base2")),
]


def _first(impl, index):
    return lambda *args, **kwargs: impl(*args, **kwargs)[index]


# FlashAttentionFunction returns O alone
_FUNCTION_MISTAKES = [Mistake(m.key, m.message, _first(m.impl, 0)) for m in _OUT_MISTAKES]


def _compare_outputs(name, label, got, want, names, mistakes, args, kwargs, spec, rtol=RTOL, atol=ATOL):
    """Fail at the first of ``names`` (e.g. O, L) where ``got`` differs from ``want``, naming the known
    mistakes whose same output equals the learner's. ``mistakes``: one list per output; ``spec``: the function
    whose parameter names label the inputs in the counterexample."""
    if not isinstance(got, (tuple, list)) or len(got) != len(want):
        kind = f"a tuple of {len(got)} values" if isinstance(got, (tuple, list)) else type(got).__name__
        raise Fail(f"`{name}` on {label}: expected a tuple ({', '.join(names)}), got {kind}")
    for i, (g, w, what) in enumerate(zip(got, want, names)):
        why = mismatch(g, w, rtol, atol)
        if why:
            found = diagnose(g, [Mistake(m.key, m.message, _first(m.impl, i)) for m in mistakes[i]], args, kwargs,
                             rtol, atol)
            raise Fail("\n    ".join([f"`{name}` on {label}: {what}: {why}", case_line(label, args, kwargs, spec)]),
                       found)


# ----------------------------------------------------------------------------- tiled-forward

def _tiled_cases():
    cases = []
    for seed, (b, nq, nk, causal, bq, bk, amp) in enumerate([
            (2, 32, 32, False, 16, 16, 1.0), (2, 40, 40, True, 16, 16, 1.0), (1, 24, 37, False, 16, 8, 1.0),
            (2, 48, 48, True, 16, 32, 3.0), (1, 5, 5, True, 16, 16, 1.0)]):
        g = _gen(1400 + seed)
        q, k, v = _randn(g, b, nq, 16, scale=amp), _randn(g, b, nk, 16, scale=amp), _randn(g, b, nk, 16)
        shape = f"B={b}, Nq={nq}" + (f", Nk={nk}" if nk != nq else "")
        label = (f"{shape}, d=16, causal={causal}, block_m={bq}, block_n={bk}"
                 + (" with large scores (q, k ~ 3 randn)" if amp > 1 else "")
                 + (", N not a multiple of the blocks" if nq % bq or nk % bk else ""))
        cases.append((label, (q, k, v, causal, bq, bk), {}))
    return cases


def _measure_tiled_forward(learner):
    learner = learner_of(learner)
    cases = _tiled_cases()
    name = "tiled_attention_forward"
    for label, args, kwargs, got in each_result(learner, name, cases):
        _compare_outputs(name, label, got, specs.tiled_attention_forward(*args, **kwargs), ("O", "L"),
                         (_OUT_MISTAKES, _OUT_MISTAKES + _LSE_MISTAKES), args, kwargs, specs.tiled_attention_forward)
    # the autograd.Function's forward (no gradient asked here): the same O
    n = check_function(learner, "flash_attention_pytorch", specs.flash_attention_pytorch, [cases[1], cases[2]],
                       _FUNCTION_MISTAKES)
    technique = _check_technique(learner, name)
    return (f"{len(cases)} cases match O and L (causal, Nq != Nk, partial blocks, large scores), and "
            f"FlashAttentionFunction's forward on {n}; {technique}")


# the technique, measured from outside the learner's code (attnlab/grading/sandbox/footprint.py)

PEAK_N = 4096                      # an N x N float32 matrix is 64 MiB here; q, k, v are 256 KiB each
PEAK_BLOCK = 128                   # tiles of 128 x 128 (64 KiB): 1024 of them, quick to run
ROW_BLOCK = 4 * PEAK_BLOCK * PEAK_N     # one (block_m, N) row block of scores: 2 MiB
PEAK_LIMIT = 2 * ROW_BLOCK         # a tiled call grew by 0.75 MiB (forward) and 0.25 (backward) under attnlab grade;
#                                    row blocks against all keys by 20-24 MiB, the whole matrix by more than 64
FULL_MATRIX = Mistake("holds-n-by-n", "the function holds an N x N matrix (the whole score matrix S or P at once): "
                      "walk K and V in tiles of block_n keys with the online softmax (forward) or recompute P tile "
                      "by tile from L (backward), so that nothing larger than (block_m, block_n) is ever held", None)
ROW_BLOCKS = Mistake("row-block-against-all-keys", "the function holds a row block of scores against every key, "
                    "(block_m, N) at once: tiled in the queries only. Walk K and V in tiles of block_n keys too, with "
                    "the online softmax (forward) or P recomputed tile by tile from L (backward)", None)
NOT_SKIPPED_PT = Mistake("causal-blocks-not-skipped", "with causal=True the loop still computes the key blocks "
                         "above the diagonal (masked to -inf, so the numbers look right): a query block ending at "
                         "row r needs keys < min(r + 1, Nk) only, so stop the key loop there", None)


def _peak_case(seed, n=PEAK_N, grad=False):
    g = _gen(seed)
    q, k, v = (_randn(g, 1, n, 16) for _ in range(3))
    case = [(q, k, v, False, PEAK_BLOCK, PEAK_BLOCK), {}]
    return case + [_randn(g, 1, n, 16)] if grad else case


def _check_memory(learner, name, seed, grad=None, case=None, second=None):
    """Fail when the peak memory of a call at N = PEAK_N (``case``, else :func:`_peak_case`; measured again on
    ``second``, else fresh values) grows by more than PEAK_LIMIT, or cannot be measured."""
    case = case if case is not None else _peak_case(seed, grad=grad is not None)
    peak = peak_growth(learner, name, case, f"B=1, N={PEAK_N}, d=16", "that no N x N matrix is held", grad=grad,
                       spec=getattr(specs, name), second=second, limit=PEAK_LIMIT)
    if peak > PEAK_LIMIT:
        raise Fail(f"`{name}` on B=1, N={PEAK_N}, d=16, block_m=block_n={PEAK_BLOCK}: the process's peak memory "
                   f"grew by {peak / 2**20:.1f} MiB during the call, where one N x N float32 matrix is "
                   f"{4 * PEAK_N ** 2 / 2**20:.0f} MiB, one (block_m, N) row block of scores "
                   f"{ROW_BLOCK / 2**20:.0f} MiB, and a tiled function needs less than two row blocks",
                   [FULL_MATRIX if peak > 4 * PEAK_N ** 2 // 2 else ROW_BLOCKS])
    return (f"no N x N matrix and no row block against all keys held at N={PEAK_N} (peak memory growth under "
            f"{PEAK_LIMIT // 2**20} MiB)")


def _causal_work(bq, bk, n, d):
    """Matmul FLOPs of a causal forward that skips the tiles above the diagonal: QK^T and PV on each tile it keeps."""
    tiles = sum(min(q0 + bq, n) > k0 for q0 in range(0, n, bq) for k0 in range(0, n, bk))
    return tiles * 2 * 2 * bq * bk * d


def _check_technique(learner, name):
    """tiled-forward's technique: no N x N matrix, and causal tiles skipped (a poisoned tail, counted FLOPs)."""
    notes = [_check_memory(learner, name, 1491)]
    # keys past the last query block's tiles are seen by no query: NaN there reaches O only through a
    # block that is computed (0 * NaN = NaN in P V), never through one that is skipped
    g = _gen(1490)
    q, k, v = _randn(g, 1, 32, 16), _randn(g, 1, 64, 16), _randn(g, 1, 64, 16)
    v[:, 32:] = float("nan")
    label = "B=1, Nq=32, Nk=64, d=16, causal=True, block_m=block_n=16, V = NaN in the keys no query sees"
    reply = learner.call(name, [[(q, k, v, True, 16, 16), {}]])
    present(reply, name)
    got = value_of((reply.get("results") or [{"raised": "no result"}])[0], name, label)
    if isinstance(got, (tuple, list)) and got and torch.is_tensor(got[0]) and torch.isnan(got[0]).any():
        raise Fail(f"`{name}` on {label}: O holds NaN, so the NaN values of V reached it through key blocks that no "
                   f"query may see", [NOT_SKIPPED_PT])
    n, bq = 256, 32
    reply, cost = measured_call(learner, name, [(*(_randn(g, 1, n, 16) for _ in range(3)), True, bq, bq), {}])
    present(reply, name)
    value_of((reply.get("results") or [{"raised": "no result"}])[0], name, f"B=1, N={n}, causal=True")
    if cost["flops"] is not None:
        budget = _causal_work(bq, bq, n, 16)
        if cost["flops"] > 1.3 * budget:
            raise Fail(f"`{name}` on B=1, N={n}, d=16, causal=True, block_m=block_n={bq}: {cost['flops']:,} matmul "
                       f"FLOPs, where skipping the tiles above the diagonal needs {budget:,} "
                       f"({cost['flops'] / budget:.2f}x)", [NOT_SKIPPED_PT])
        notes.append("causal tiles skipped (counted matmul FLOPs)")
    return ", ".join(notes)


# ----------------------------------------------------------------------------- the backward, with a switch per mistake
# (parts tiled-backward and dkdv-kernel)

def _backward_emulation(q, k, v, o, lse, do, causal=False, scale=None, block_m=16, block_n=16, subtract_d=True,
                        sign_flipped=False, scale_grads=True, recompute_scaled=True, mask="ok", d_per_tile=False):
    """dQ, dK, dV from L with the known mistakes as switches; all (B, N, d). ``mask``: "ok", "none" (causal mask
    forgotten in the backward), "blocks" or "kblocks" (the tiles above the diagonal skipped, in a loop over query
    blocks or over key blocks, and the tiles that cross it left unmasked)."""
    d = q.shape[-1]
    sc = d ** -0.5 if scale is None else scale
    Nq, Nk = q.shape[1], k.shape[1]
    s = q @ k.transpose(1, 2) * (sc if recompute_scaled else 1.0)            # (B, Nq, Nk)
    p = torch.exp(s - lse[..., None])                                        # (B, Nq, Nk) recomputed from L
    rows, cols = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
    if causal and mask == "ok":
        p = p.masked_fill(cols > rows, 0.0)
    elif causal and mask == "blocks":   # query-block loop: key blocks that start after the block's last row skipped
        end = torch.clamp((rows // block_m + 1) * block_m, max=Nq)             # (Nq, 1)
        p = p.masked_fill((cols // block_n) * block_n >= end, 0.0)
    elif causal and mask == "kblocks":  # key-block loop: query blocks that end before the key block starts skipped
        p = p.masked_fill(rows < ((cols // block_n) * block_n // block_m) * block_m, 0.0)
    dv = p.transpose(1, 2) @ do                                              # (B, Nk, dv)
    dp = do @ v.transpose(1, 2)                                              # (B, Nq, Nk)
    if d_per_tile:   # D_i summed over one key tile only
        D = torch.zeros_like(dp)
        for k0 in range(0, Nk, block_n):
            D[..., k0:k0 + block_n] = (p[..., k0:k0 + block_n] * dp[..., k0:k0 + block_n]).sum(-1, keepdim=True)
    else:
        D = (do * o).sum(-1, keepdim=True)                                   # (B, Nq, 1)
    if not subtract_d:
        ds = p * dp
    elif sign_flipped:
        ds = p * (D - dp)
    else:
        ds = p * (dp - D)                                                    # (B, Nq, Nk)
    g = sc if scale_grads else 1.0
    return ds @ k * g, ds.transpose(1, 2) @ q * g, dv


class _WrongBackward(torch.autograd.Function):
    """The right forward (the reference) with a backward from ``_backward_emulation``'s switches."""

    @staticmethod
    def forward(ctx, q, k, v, causal, block_m, block_n, flags):
        o, lse = specs.tiled_attention_forward(q, k, v, causal, block_m, block_n)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, block_m, block_n, flags)
        return o

    @staticmethod
    def backward(ctx, do):
        causal, block_m, block_n, flags = ctx.args
        return (*_backward_emulation(*ctx.saved_tensors, do, causal, None, block_m, block_n, **flags), *[None] * 4)


def _bwd(**flags):
    """A wrong ``flash_attention_pytorch`` (one mistake's switches in its backward, kept on it as ``flags``)."""
    def impl(q, k, v, causal=False, block_m=16, block_n=16):
        return _WrongBackward.apply(q, k, v, causal, block_m, block_n, flags)
    impl.flags = flags
    return impl


_BACKWARD_MISTAKES = [
    Mistake("d-not-subtracted", "dS = P * (dP - D) with D_i = rowsum(dO_i * O_i): the softmax backward subtracts "
            "each row's D", _bwd(subtract_d=False)),
    Mistake("ds-sign-flipped", "the sign of dS is flipped: dS = P * (dP - D)", _bwd(sign_flipped=True)),
    Mistake("grad-scale-forgotten", "dQ and dK miss the scale: S = Q K^T * scale, so dQ = dS K * scale and "
            "dK = dS^T Q * scale", _bwd(scale_grads=False)),
    Mistake("recompute-scale-forgotten", "P is recomputed from unscaled scores: P = exp(Q K^T * scale - L)",
            _bwd(recompute_scaled=False)),
    Mistake("causal-mask-missing-in-backward", "the backward forgets the causal mask: the recomputed P must be 0 "
            "where j > i, as in the forward", _bwd(mask="none")),
    Mistake("causal-mask-missing-in-backward", "the backward skips the blocks above the diagonal but does not "
            "mask j > i inside the block that crosses it", _bwd(mask="blocks")),
    Mistake("causal-mask-missing-in-backward", "the backward skips the tiles above the diagonal but does not "
            "mask j > i inside the tiles that cross it", _bwd(mask="kblocks")),
    Mistake("d-from-one-tile", "D is summed over one key tile: D_i = rowsum(dO_i * O_i) is a whole-row quantity "
            "(it equals sum_j P_ij dP_ij over all keys), computed once before the loops", _bwd(d_per_tile=True)),
]


# ----------------------------------------------------------------------------- tiled-backward

def _backward_cases():
    cases = []
    for seed, (b, nq, nk, causal, bq, bk) in enumerate([(2, 32, 32, False, 16, 16), (2, 40, 40, True, 16, 16),
                                                        (1, 24, 37, False, 16, 8), (2, 48, 48, True, 16, 32)]):
        g = _gen(1800 + seed)
        q, k, v = _randn(g, b, nq, 16), _randn(g, b, nk, 16), _randn(g, b, nk, 16)
        do = _randn(g, b, nq, 16)
        shape = f"B={b}, Nq={nq}" + (f", Nk={nk}" if nk != nq else "")
        label = (f"{shape}, d=16, causal={causal}, block_m={bq}, block_n={bk}"
                 + (", N not a multiple of the blocks" if nq % bq or nk % bk else ""))
        cases.append((label, (q, k, v, causal, bq, bk), {}, do))
    return cases


def _direct(**flags):
    """A wrong ``tiled_attention_backward(q, k, v, o, L, do, causal, block_m, block_n)`` (one mistake's switches)."""
    return lambda q, k, v, o, L, do, causal=False, block_m=16, block_n=16: _backward_emulation(
        q, k, v, o, L, do, causal, None, block_m, block_n, **flags)


# the same mistakes, as the hand-written backward that the grader calls itself
_DIRECT_MISTAKES = [Mistake(m.key, m.message, _direct(**m.impl.flags)) for m in _BACKWARD_MISTAKES]
_GRADS = ("dq", "dk", "dv")


GRADIENT_MISSING = Mistake("gradient-missing", "the backward must return exactly (dq, dk, dv), three tensors shaped "
                           "like q, k and v: the grader calls tiled_attention_backward itself, and a gradient that is "
                           "None or missing (or dk and dv swapped) is one the Function's backward cannot return", None)


def _three_gradients(name, label, got, args):
    """Fail unless ``got`` is exactly (dq, dk, dv), tensors shaped like q, k, v (a None said as such)."""
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        kind = f"{len(got)} values" if isinstance(got, (tuple, list)) else type(got).__name__
        raise Fail(f"`{name}` on {label}: expected three gradients (dq, dk, dv), one per input q, k, v; got {kind}",
                   [GRADIENT_MISSING])
    for what, g, x in zip(_GRADS, got, args[:3]):
        if g is None:
            raise Fail(f"`{name}` on {label}: {what} is None: return a gradient for each of q, k and v",
                       [GRADIENT_MISSING])
        if not torch.is_tensor(g) or tuple(g.shape) != tuple(x.shape):
            shape = f"shape {tuple(g.shape)}" if torch.is_tensor(g) else type(g).__name__
            raise Fail(f"`{name}` on {label}: {what} should be shaped like {what[1]}, {tuple(x.shape)}; got {shape}",
                       [GRADIENT_MISSING])


def _measure_tiled_backward(learner):
    learner = learner_of(learner)
    name = "tiled_attention_backward"
    cases = [(label, (q, k, v, *specs.tiled_attention_forward(q, k, v, causal, bq, bk), do, causal, bq, bk), {})
             for label, (q, k, v, causal, bq, bk), _kw, do in _backward_cases()]   # with the grader's own O and L
    for label, args, kwargs, got in each_result(learner, name, cases):
        _three_gradients(name, label, got, args)
        _compare_outputs(name, label, got, specs.tiled_attention_backward(*args, **kwargs), _GRADS,
                         [_DIRECT_MISTAKES] * 3, args, kwargs, specs.tiled_attention_backward, GRAD_RTOL, GRAD_ATOL)
    # the peak memory of the hand-written backward itself, at a size where one N x N matrix dominates
    def backward_case(seed):   # q, k, v, dO, and the grader's own O and L of them
        (q, k, v, *_), _kw, do = _peak_case(seed, grad=True)
        o, lse = specs.tiled_attention_forward(q, k, v, False, PEAK_BLOCK, PEAK_BLOCK)
        return [(q, k, v, o, lse, do, False, PEAK_BLOCK, PEAK_BLOCK), {}]

    memory = _check_memory(learner, name, 1890, case=backward_case(1890), second=backward_case(1891))
    # the autograd.Function routes its backward there: one small case, through autograd
    check_with_gradients(learner, "flash_attention_pytorch", specs.flash_attention_pytorch, _backward_cases()[1:2],
                         inputs=[0, 1, 2], mistakes=_BACKWARD_MISTAKES, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                         labels=["dQ", "dK", "dV"])
    return (f"{len(cases)} cases match dQ, dK and dV (causal, Nq != Nk, partial blocks); {memory}; "
            f"FlashAttentionFunction's backward gives the same gradients")


# ----------------------------------------------------------------------------- the kernels
# (flash-kernel-loop, dkdv-kernel): Kernel rows, held to float32's tolerance on a GPU too (a failure that TF32's
# passes is named tf32-dot), their stride diagnosis in this exercise's words, the causal skip read from the traffic

IGNORES_STRIDES = Mistake("ignores-strides", "the kernel is right on contiguous tensors but not on the grader's, "
                          "whose rows are padded: address each tensor with its own strides (offs_n[:, None] * "
                          "stride_kn + offs_d[None, :], pid * stride_kb), never with N or HEAD_DIM, and never with "
                          "another tensor's strides", None)
TF32 = Mistake("tf32-dot", "close, but only to about 1e-3: on an NVIDIA GPU tl.dot multiplies float32 in TF32 "
               "(10 mantissa bits) unless you pass input_precision=\"ieee\"", None)


def _with_scale(q, k, v, causal, scale):
    """O (B, N, d) and L (B, N) of attention with this ``scale``: attnlab.tiled's FlashAttention."""
    o, lse = tiled_attention(q[:, None], k[:, None], v[:, None], causal=causal, scale=scale, block_m=64, block_n=64,
                             return_lse=True)
    return o[:, 0], lse[:, 0]


def _launch_of(label, case, names, tensors, pads, strided, block, budget, want):
    """A :class:`Launch` of one of this exercise's kernels on ``case`` (Q, ..., CAUSAL, scale, BLOCK_M, BLOCK_N):
    ``tensors`` {buffer: an input, or an output's shape}, each padded by ``pads`` (rows, columns) so that its
    strides are its own; the arguments are the buffers in that order, the batch and row strides of ``strided``,
    L's batch stride, N and the scale; one program per ``block`` rows and batch entry."""
    (b, n, d), (causal, scale, bm, bn) = case[0].shape, case[-4:]
    buffers, args = attention_launch(tensors, pads, [*strided, ("l", 0)], [n, scale])
    return Launch(label, buffers, (cdiv(n, block), b), args,
                  {"HEAD_DIM": d, "BLOCK_M": bm, "BLOCK_N": bn, "CAUSAL": causal}, want, case, names,
                  budget(b, n, d, causal, bm, bn))


def _not_skipped(buffer, budget, mistake):
    """A traffic diagnosis: with CAUSAL, loading as many bytes of ``buffer`` as a non-causal launch
    (``budget(b, n, d, False, bm, bn)``) is ``mistake``."""
    def diagnosis(case, traffic):
        c, (b, n, d) = case.constexprs, case.inputs[0].shape
        full = budget(b, n, d, False, c["BLOCK_M"], c["BLOCK_N"])[buffer][0]
        return [mistake] if c["CAUSAL"] and traffic[buffer]["load_bytes"] >= full > case.budget[buffer][0] else []
    return diagnosis


# ----------------------------------------------------------------------------- flash-kernel-loop

# each tensor padded differently, so that its strides are its own and not the row length
_FLASH_PADS = {"q": (16, 0), "k": (8, 16), "v": (4, 0), "o": (8, 8), "l": (0, 8)}
_FWD_NAMES = ("Q", "K", "V", "CAUSAL", "scale", "BLOCK_M", "BLOCK_N")   # the inputs, in a counterexample


def _flash_launches():
    launches = []
    # scale is never only 1/sqrt(HEAD_DIM) = 0.25: a kernel must use its scale argument
    for seed, (b, n, causal, bm, bn, amp, sc) in enumerate([
            (2, 32, False, 16, 16, 1.0, 0.25), (2, 40, True, 16, 16, 1.0, 0.6), (2, 37, False, 32, 16, 3.0, 0.25),
            (2, 48, True, 32, 16, 1.0, 0.4), (1, 7, True, 16, 16, 1.0, 0.25), (2, 40, True, 16, 32, 1.0, 0.15)]):
        g = _gen(1500 + seed)
        q, k, v = _randn(g, b, n, 16, scale=amp), _randn(g, b, n, 16, scale=amp), _randn(g, b, n, 16)
        o, lse = _with_scale(q, k, v, causal, sc)
        label = (f"B={b}, N={n}, HEAD_DIM=16, causal={causal}, scale={sc}, BLOCK_M={bm}, BLOCK_N={bn}"
                 + (" with large scores" if amp > 1 else "") + (", N < BLOCK" if n < bm else
                                                                 ", a partial last block" if n % bn or n % bm else ""))
        launches.append(_launch_of(label, (q, k, v, causal, sc, bm, bn), _FWD_NAMES,
                                   {"q": q, "k": k, "v": v, "o": (b, n, 16), "l": (b, n)}, _FLASH_PADS, "qkvo", bm,
                                   _forward_budget, {"o": o, "l": lse}))
    return launches


def _kv_blocks_needed(n, causal, bm, bn):
    """Key rows a forward loads per (batch entry), summed over its query blocks: all N per query block, or with
    causal only the blocks that start before the query block's end (masked at N)."""
    total = 0
    for q0 in range(0, n, bm):
        hi = min(q0 + bm, n) if causal else n
        total += sum(min(bn, n - k0) for k0 in range(0, hi, bn))
    return total


def _forward_budget(b, n, d, causal, bm, bn, es=4):
    kv = b * _kv_blocks_needed(n, causal, bm, bn) * d * es
    return {"q": (b * n * d * es, 0), "k": (kv, 0), "v": (kv, 0), "o": (0, b * n * d * es), "l": (0, b * n * es)}


def _kernel_fwd(index, **flags):
    """Output ``index`` (0: O, 1: L) of a forward kernel's mistake, with the kernel's own scale argument. O and L
    differ in shape, so each output's mistakes are only ever matched against that output."""
    return lambda q, k, v, causal, scale, bm, bn: _forward_emulation(q, k, v, causal, scale, bm, bn, **flags)[index]


_EXP2 = Mistake("exp2-without-log2e", "exp2 is used without folding log2(e) into the scale: exp(x) = exp2(x * "
                "log2(e)), so multiply the scores by scale * 1.4426950408889634 before exp2 (or use tl.exp)",
                _kernel_fwd(0, exp2=True))
_FLASH_MISTAKES = [Mistake(m.key, m.message, _kernel_fwd(0, **m.impl.flags)) for m in _OUT_MISTAKES] + [
    Mistake("scale-argument-ignored", "the kernel ignores its `scale` argument (1/sqrt(HEAD_DIM) written in "
            "instead?): the caller chooses the scale, so multiply the scores by `scale`",
            lambda q, k, v, causal, scale, bm, bn: _forward_emulation(q, k, v, causal, None, bm, bn)[0]),
    Mistake("masked-keys-not-masked", "keys past N are loaded as 0 and join the softmax with score 0: set their "
            "scores to -inf (offs_n < N)", _kernel_fwd(0, mask_tail=False)),
    _EXP2,
] + [Mistake(m.key, m.message, _kernel_fwd(1, **m.impl.flags)) for m in _LSE_MISTAKES]
NOT_SKIPPED = Mistake("causal-blocks-not-skipped", "with CAUSAL the loop still loads the key blocks above the "
                      "diagonal: a query block ending at row r needs keys < min(r + 1, N) only, so stop the loop "
                      "there (the numbers are right, the bytes are not)", None)
_FLASH = Kernel("flash_fwd_kernel", _flash_launches, _FLASH_MISTAKES,
                says="{n} launches match O and L (causal, partial blocks, N < BLOCK, large scores)",
                budget_says="Q read once, K and V once per query block (with CAUSAL only the blocks on or below the "
                "diagonal), O and L written once", traffic_diagnosis=_not_skipped("k", _forward_budget, NOT_SKIPPED),
                tf32=TF32, stride_mistake=IGNORES_STRIDES)


# ----------------------------------------------------------------------------- dkdv-kernel

# DK has K's layout, DV has V's, D has L's
_DKDV_PADS = {"q": (16, 0), "k": (8, 16), "v": (4, 0), "do": (8, 8), "l": (0, 8), "d": (0, 8), "dk": (8, 16),
              "dv": (4, 0)}


def _dkdv_launches():
    launches = []
    for seed, (b, n, causal, bm, bn, sc) in enumerate([(2, 32, False, 16, 16, 0.25), (2, 40, True, 16, 16, 0.6),
                                                       (1, 37, False, 32, 16, 0.4), (2, 48, True, 16, 32, 0.25)]):
        g = _gen(1900 + seed)
        q, k, v, do = _randn(g, b, n, 16), _randn(g, b, n, 16), _randn(g, b, n, 16), _randn(g, b, n, 16)
        o, lse = _with_scale(q, k, v, causal, sc)
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        _with_scale(qq, kk, vv, causal, sc)[0].backward(do)
        label = (f"B={b}, N={n}, HEAD_DIM=16, causal={causal}, scale={sc}, BLOCK_M={bm}, BLOCK_N={bn}"
                 + (", a partial last block" if n % bm or n % bn else ""))
        launches.append(_launch_of(label, (q, k, v, do, causal, sc, bm, bn), ("Q", "K", "V", "DO", *_FWD_NAMES[3:]),
                                   {"q": q, "k": k, "v": v, "do": do, "l": lse, "d": (do * o).sum(-1),
                                    "dk": (b, n, 16), "dv": (b, n, 16)}, _DKDV_PADS, ("q", "k", "v", "do"), bn,
                                   _dkdv_budget, {"dk": kk.grad, "dv": vv.grad}))
    return launches


def _dkdv_budget(b, n, d, causal, bm, bn, es=4):
    rows = 0   # query rows each key block's program loads, summed
    for k0 in range(0, n, bn):
        lo = (k0 // bm) * bm if causal else 0
        rows += n - lo
    qd = b * rows * d * es
    kv = b * n * d * es
    return {"q": (qd, 0), "do": (qd, 0), "l": (b * rows * es, 0), "d": (b * rows * es, 0), "k": (kv, 0),
            "v": (kv, 0), "dk": (0, kv), "dv": (0, kv)}


def _dkdv_wrong(use_scale=True, padded_rows=False, **flags):
    """dK of a dK/dV kernel's mistake (``_backward_emulation``'s switches), from the reference's L and D. Every
    known mistake shows in dK, which is compared before dV."""
    def impl(q, k, v, do, causal, scale, bm, bn):
        o, lse = _with_scale(q, k, v, causal, scale)
        dk = _backward_emulation(q, k, v, o, lse, do, causal, scale if use_scale else None, bm, bn, **flags)[1]
        # rows past N in a partial last query block: P = exp(0 - (-inf)) = inf against every key, times dO = 0
        return torch.full_like(dk, float("nan")) if padded_rows and q.shape[1] % bm else dk
    return impl


_DKDV_MISTAKES = [
    Mistake("d-not-subtracted", "dS = P * (dP - D): subtract D_i (loaded from D) from each row of dP",
            _dkdv_wrong(subtract_d=False)),
    Mistake("ds-sign-flipped", "the sign of dS is flipped: dS = P * (dP - D)", _dkdv_wrong(sign_flipped=True)),
    Mistake("grad-scale-forgotten", "dK misses the scale: dK = dS^T Q * scale", _dkdv_wrong(scale_grads=False)),
    Mistake("recompute-scale-forgotten", "P is recomputed from unscaled scores: P = exp(Q K^T * scale - L)",
            _dkdv_wrong(recompute_scaled=False)),
    Mistake("causal-mask-missing-in-backward", "with CAUSAL the recomputed P must be 0 where key j > query i",
            _dkdv_wrong(mask="none")),
    Mistake("causal-mask-missing-in-backward", "with CAUSAL the query blocks that see none of this key block "
            "are skipped, but inside the tile that crosses the diagonal P is not zeroed where j > i",
            _dkdv_wrong(mask="kblocks")),
    Mistake("scale-argument-ignored", "the kernel ignores its `scale` argument (1/sqrt(HEAD_DIM) written in "
            "instead?): recompute P = exp(Q K^T * scale - L) and scale dK with the `scale` it is given",
            _dkdv_wrong(use_scale=False)),
    Mistake("padded-rows-not-zeroed", "NaN or inf in dK or dV with a partial last query block: the rows past N get "
            "P = exp(S - L) from whatever L was loaded there (other=-inf gives exp(+inf)), and inf times their "
            "dO = 0 is NaN; zero P where offs_m >= N and load L and D with other=0.0", _dkdv_wrong(padded_rows=True)),
]
NOT_SKIPPED_BWD = Mistake("causal-blocks-not-skipped", "with CAUSAL a key block starting at key c is seen only by "
                          "queries i >= c: start the loop at the query block that holds row c, "
                          "(c // BLOCK_M) * BLOCK_M, instead of 0", None)
_DKDV = Kernel("flash_bwd_dkdv_kernel", _dkdv_launches, _DKDV_MISTAKES, says="{n} launches match dK and dV",
               budget_says="K and V read once, Q, dO, L and D once per key block (with CAUSAL only from the first "
               "query block that sees it), dK and dV written once",
               traffic_diagnosis=_not_skipped("q", _dkdv_budget, NOT_SKIPPED_BWD), tf32=TF32,
               stride_mistake=IGNORES_STRIDES)


# ----------------------------------------------------------------------------- traffic-experiment

TRAFFIC_RTOL = 0.01   # the part's stated tolerance: bytes are exact for a kernel that moves only what it needs


def _traffic_cases():
    g = _gen(1700)
    cases = []
    # block sizes that differ from the default and from each other: a measurement must pass them on
    for causal, low, bm, bn in ((False, 24, 16, 16), (True, 48, 16, 16), (True, 48, 32, 16), (False, 32, 16, 32)):
        n = low + 8 * int(torch.randint(0, 3, (1,), generator=g))         # 24 ... 40, then 48 ... 64
        seed = int(torch.randint(0, 10_000, (1,), generator=g))
        cases.append((f"n={n}, causal={causal}, block_m={bm}, block_n={bn}, seed={seed}", (n, causal, bm, bn, seed),
                      {}))
    return cases


def _traffic_of(value, kwargs=lambda causal, bm, bn: dict(causal=causal, block_m=bm, block_n=bn)):
    """A wrong measurement: ``value`` reads a trace of the reference kernel, launched with ``kwargs``."""
    def impl(n, causal=False, block_m=16, block_n=16, seed=0):
        from attnlab.kernels import flash_attention
        from attnlab.memory import trace

        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 1, n, 16, generator=g) for _ in range(3))
        return value(trace(flash_attention, q, k, v, **kwargs(causal, block_m, block_n)))
    return impl


_TRAFFIC_MISTAKES = [
    Mistake("reads-only", "only the bytes read are counted: the stores of O and L move bytes too",
            _traffic_of(lambda t: t.bytes_read)),
    Mistake("unique-bytes", "each byte is counted once however often it moves (unique_bytes_read): the part asks "
            "for every access, K and V once per query block",
            _traffic_of(lambda t: t.unique_bytes_read + t.unique_bytes_written)),
    Mistake("elements-not-bytes", "these are elements: a float32 moves 4 bytes",
            _traffic_of(lambda t: t.total_bytes // 4)),
    Mistake("causal-ignored", "the causal flag is not passed on: the measurement is of the non-causal kernel",
            _traffic_of(lambda t: t.total_bytes, lambda causal, bm, bn: dict(causal=False, block_m=bm, block_n=bn))),
    Mistake("blocks-ignored", "block_m and block_n are not passed on: the measurement is of the kernel with 16 x 16 "
            "blocks whatever the blocks asked for",
            _traffic_of(lambda t: t.total_bytes, lambda causal, bm, bn: dict(causal=causal, block_m=16, block_n=16))),
    Mistake("kv-only", "only K and V are counted: Q, O and L are traffic too",
            _traffic_of(lambda t: t.by_tensor["K"]["read"] + t.by_tensor["V"]["read"])),
]


def _bytes(x):
    return torch.tensor(float(x), dtype=torch.float64)


def _measure_traffic(learner):
    name = "forward_traffic"
    tolerance = dict(rtol=TRAFFIC_RTOL, atol=0.0)
    mistakes = [Mistake(m.key, m.message, lambda *a, impl=m.impl, **kw: _bytes(impl(*a, **kw)))
                for m in _TRAFFIC_MISTAKES]
    lines = []
    for label, args, kwargs, got in each_result(learner, name, _traffic_cases()):
        if torch.is_tensor(got) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            raise Fail(f"`{name}` on {label}: expected a number of bytes, got {type(got).__name__}")
        want = specs.forward_traffic(*args, **kwargs)
        if mismatch(_bytes(got), _bytes(want), **tolerance):    # NaN is never within it
            found = diagnose(_bytes(got), mistakes, args, kwargs, **tolerance)
            hint_text = (" (more than a kernel that reads K and V once per query block: does your kernel pass "
                         "flash-kernel-loop's traffic check?)" if got > want and not found else "")
            raise Fail(f"`{name}` on {label}: measured {got:,.0f} bytes; reproduced with the reference kernel: "
                       f"{want:,} bytes (tolerance {TRAFFIC_RTOL:.0%}){hint_text}", found)
        lines.append(f"{want:,} B at n={args[0]}{' causal' if args[1] else ''}, blocks {args[2]} x {args[3]}")
    return f"your measurements reproduce ({', '.join(lines)}) within {TRAFFIC_RTOL:.0%}"


TABLES = {
    "online-softmax-update": Function("online_softmax_update", specs.online_softmax_update, _online_cases,
                                      _ONLINE_MISTAKES, says="{n} cases match the spec, including the first block"),
    "tiled-forward": Measured("peak-memory", _measure_tiled_forward, {
        "tiled_attention_forward": _OUT_MISTAKES + _LSE_MISTAKES, "flash_attention_pytorch": _FUNCTION_MISTAKES}),
    "flash-kernel-loop": _FLASH,
    "traffic-experiment": Measured("experiment", _measure_traffic, {"forward_traffic": _TRAFFIC_MISTAKES}),
    "tiled-backward": Measured("peak-memory", _measure_tiled_backward, {
        "tiled_attention_backward": _DIRECT_MISTAKES, "flash_attention_pytorch": _BACKWARD_MISTAKES}),
    "dkdv-kernel": _DKDV,
}
