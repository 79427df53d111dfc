"""The FlashAttention algorithm in plain PyTorch: tiles, online softmax, recomputing backward.

Standard attention writes the (N, N) matrices S = q k^T and P = softmax(S) to memory. FlashAttention
(Dao et al., 2022) never builds them: it walks over blocks of queries and, for each, over blocks of
keys/values, keeping per query row only a running maximum ``m``, a running sum ``l`` and an output
accumulator ``acc``. When a new block raises the maximum from ``m`` to ``m_new``, everything computed
so far is rescaled by ``exp(m - m_new)`` (the *online softmax*, Milakov & Gimelshein 2018). At the end
``out = acc / l`` and the log-sum-exp ``lse = m + log(l)`` is all that is kept for the backward pass.

The backward pass (FlashAttention-2, Dao 2023) recomputes each block of P from q, k and the saved
``lse`` instead of storing P:

    P_ij  = exp(q_i k_j^T * scale - lse_i)
    dV_j += P_ij^T dO_i
    dP_ij = dO_i V_j^T
    dS_ij = P_ij * (dP_ij - D_i),   D_i = rowsum(dO_i * O_i)
    dQ_i += dS_ij K_j * scale,      dK_j += dS_ij^T Q_i * scale

Extra memory is O(block_m * block_n) per (batch, head) and thread instead of O(Nq * Nk).

This file is the plain-PyTorch version of the algorithm the Triton kernel in ``kernels/``
implements. ``_forward_reference`` and ``_backward_reference`` are the loops written for one
(batch, head) with no tricks; ``_flash_forward`` and ``_flash_backward`` are the fast path they
explain, and on a CPU it is genuinely fast (see ``benchmarks/cpu_attention.py``):

- each tile step is a few large batched matmuls over all (batch * heads) at once, updated in place;
- blocks run in parallel like a GPU grid: one task per query block (forward) or key block
  (backward) on a small thread pool (``_run_blocks``);
- FlashAttention's own arithmetic trick: fold ``log2(e)`` into the scale and use ``exp2``
  (``exp(x) = 2^(x log2 e)``), several times cheaper than ``exp``.

At a huge scale (``|scale| > HUGE_SCALE``) the scaled scores overflow float32 (``1e37 * 24 * log2 e`` is past
3.4e38, and ``inf - inf`` is NaN), and the backward's ``exp(s - lse)`` subtracts two numbers of 1e31
whose roundings alone are 1e24. There, and only there (see :func:`huge_scale`), the max is taken of the
raw scores ``q k^T`` (times the scale's sign) and the scale multiplies *after* subtracting it, where
``s - m <= 0`` can only go to ``-inf``; the lse is kept divided by ``|scale|``, so that ``s - lse`` is
exactly 0 at a one-hot row's max (and rounded up where the row's other mass would round away, so that
a recomputed P of exactly 1 means a one-hot row); and there dS is 0, the exact value, instead of
``dP - D``'s rounding times the scale (1e24 at a scale of 1e30). The kernels in ``kernels/`` do the same.

Conventions: tensors ``(B, H, N, D)``; ``causal=True`` is top-left aligned (query i sees keys
j <= i, as ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``), and blocks that lie
entirely above the diagonal are skipped, never computed. With top-left alignment every query row sees
key 0, so a row can only be fully masked when there are no keys at all (Nk == 0): such rows output
zeros and have ``lse = -inf``, and their gradients are zero.
"""

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from attnlab import validate

__all__ = ["tiled_attention"]

DEFAULT_BLOCK_M = 512
DEFAULT_BLOCK_N = 512
LOG2E = math.log2(math.e)   # exp(x) == exp2(x * LOG2E); exp2 is 2-4x cheaper than exp on this CPU
LN2 = math.log(2.0)
# |scale| above which scores are scaled after the max is subtracted (huge_scale). Below it, every scale a
# model uses (1/sqrt(d), temperatures into the hundreds), the usual order (scale, then subtract) is kept bit
# for bit. Above it that order loses P's precision, |s| * 2**-24 in each exponent of the backward: with
# scores q.k of a few units (float32, d = 16 and 64, a loss on O and the lse) the kernels' gradients were off
# by up to 1e-3 (relative) at a scale of 1e3, 2e-2 at 1e4, 2 at 1e6 and NaN at 1e37, against 2e-6 in the
# other order, which at scales of 30 and 300 was about as exact as the usual one
HUGE_SCALE = 2.0 ** 10


def huge_scale(scale):
    """Whether ``scale`` is so large that attention scales the scores after subtracting their max (the
    kernels' ``HUGE_SCALE`` branch; see the module docstring). Example: ``huge_scale(1e30)  # True``"""
    return abs(scale) > HUGE_SCALE


# ---------------------------------------------------------------------------------------------
# the plain loop: one (batch, head), one query block at a time, no tricks
# ---------------------------------------------------------------------------------------------

def _forward_reference(q, k, v, scale, block_m, block_n):
    """FlashAttention forward for one head, written as plainly as possible (non-causal).

    q: (Nq, D), k: (Nk, D), v: (Nk, Dv) -> out (Nq, Dv), lse (Nq,). Used by the tests and
    shown in the lessons; ``_flash_forward`` is the same loop over all heads at once.
    """
    Nq, Nk = q.shape[0], k.shape[0]
    out = q.new_zeros(Nq, v.shape[1])                                 # (Nq, Dv)
    lse = q.new_full((Nq,), float("-inf"))                            # (Nq,)
    for i in range(0, Nq, block_m):
        qi = q[i:i + block_m]                                         # (bm, D)
        m = q.new_full((qi.shape[0],), float("-inf"))                 # (bm,) running max
        l = q.new_zeros(qi.shape[0])                                  # (bm,) running sum
        acc = q.new_zeros(qi.shape[0], v.shape[1])                    # (bm, Dv) running output
        for j in range(0, Nk, block_n):
            s = (qi @ k[j:j + block_n].T) * scale                     # (bm, bn) one tile of S
            m_new = torch.maximum(m, s.amax(dim=1))                   # (bm,)
            p = torch.exp(s - m_new[:, None])                         # (bm, bn) one tile of P
            alpha = torch.exp(m - m_new)                              # (bm,) rescale old stats
            l = alpha * l + p.sum(dim=1)                              # (bm,)
            acc = alpha[:, None] * acc + p @ v[j:j + block_n]         # (bm, Dv)
            m = m_new
        if Nk > 0:
            out[i:i + block_m] = acc / l[:, None]                     # (bm, Dv)
            lse[i:i + block_m] = m + torch.log(l)                     # (bm,)
    return out, lse


def _backward_reference(q, k, v, out, lse, dout, scale, block_m, block_n):
    """FlashAttention-2 backward for one head, plainly (non-causal): P is recomputed tile by tile.

    q: (Nq, D), k: (Nk, D), v: (Nk, Dv), out: (Nq, Dv), lse: (Nq,), dout: (Nq, Dv)
    -> dq (Nq, D), dk (Nk, D), dv (Nk, Dv). ``_flash_backward`` is the same loop for all heads.
    """
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (dout * out).sum(dim=1)                                   # (Nq,) D_i = rowsum(dO * O)
    for j in range(0, k.shape[0], block_n):                           # outer loop: key blocks
        kj, vj = k[j:j + block_n], v[j:j + block_n]                   # (bn, D), (bn, Dv)
        for i in range(0, q.shape[0], block_m):                       # inner loop: query blocks
            qi, doi = q[i:i + block_m], dout[i:i + block_m]           # (bm, D), (bm, Dv)
            p = torch.exp((qi @ kj.T) * scale - lse[i:i + block_m, None])   # (bm, bn) P from lse
            dv[j:j + block_n] += p.T @ doi                            # (bn, Dv)
            dp = doi @ vj.T                                           # (bm, bn)
            ds = p * (dp - delta[i:i + block_m, None])                # (bm, bn)
            dq[i:i + block_m] += (ds @ kj) * scale                    # (bm, D)
            dk[j:j + block_n] += (ds.T @ qi) * scale                  # (bn, D)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# the fast path: all (batch * heads) per block step, in-place updates, causal block skipping
# ---------------------------------------------------------------------------------------------

def _causal_keep(q0, bm, k0, bn, device):
    """Bool (bm, bn): True where key k0 + c <= query q0 + r (top-left causal) inside one tile."""
    rows = torch.arange(q0, q0 + bm, device=device)[:, None]    # (bm, 1)
    cols = torch.arange(k0, k0 + bn, device=device)[None, :]    # (1, bn)
    return cols <= rows                                         # (bm, bn)


def _k_blocks(q0, q1, Nk, block_n, causal):
    """Key blocks [k0, k1) that query rows [q0, q1) must visit, and whether the tile needs the mask."""
    # top-left causal: row r sees keys [0, r]; the last row of the block sees keys [0, q1 - 1]
    stop = min(Nk, q1) if causal else Nk
    for k0 in range(0, stop, block_n):
        k1 = min(k0 + block_n, Nk)
        # the tile is cut by the diagonal iff some key in it lies after some row in it
        yield k0, k1, causal and (k1 - 1) > q0


def _q_blocks(k0, k1, Nq, block_m, causal):
    """Query blocks [q0, q1) that see some key in [k0, k1), and whether the tile needs the mask."""
    for q0 in range(0, Nq, block_m):
        q1 = min(q0 + block_m, Nq)
        if causal and q1 - 1 < k0:          # every row of this block is before every key: skip
            continue
        yield q0, q1, causal and (k1 - 1) > q0


_THREADS_LOCK = threading.Lock()


def _run_blocks(program, n_blocks, device):
    """Run ``program(i)`` for i in range(n_blocks), in parallel like a GPU grid.

    On a GPU each block of queries (forward) or keys (backward) is one program instance. Here
    each is a task for a pool of ``torch.get_num_threads()`` Python threads (torch releases the
    GIL inside its ops), and each op runs single-threaded meanwhile. Parallel *blocks* beat
    parallel *ops*: intra-op threads must synchronise after every small op of every tile, which
    on a busy machine cost more than the work itself (measured: 6x slower at N = 4096).
    On a GPU the ops are asynchronous launches already, so the blocks simply run in order.

    Grad mode is per thread in torch, and a new thread starts with it on. The programs run
    under the caller's mode (off inside autograd's forward and backward): with it on, the
    no-grad views of inputs that require grad count as requiring grad, so each thread would
    record a graph and, writing its rows of the shared output, rewrite that tensor's autograd
    history while the other threads write theirs; that race raised "a leaf Variable that
    requires grad is being used in an in-place operation" about once in 80 calls.
    """
    n_threads = torch.get_num_threads()
    if device.type != "cpu" or n_threads <= 1 or n_blocks <= 1:
        for i in range(n_blocks):
            program(i)
        return
    grad_enabled = torch.is_grad_enabled()

    def program_in_callers_mode(i):
        with torch.set_grad_enabled(grad_enabled):
            program(i)

    with _THREADS_LOCK:                     # one parallel section at a time: the thread count is global
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(max_workers=min(n_threads, n_blocks)) as pool:
                list(pool.map(program_in_callers_mode, range(n_blocks)))   # list() re-raises a program's error
        finally:
            torch.set_num_threads(n_threads)


def _flash_forward(q, k, v, scale, causal, block_m, block_n):
    """q (BH, Nq, D), k (BH, Nk, D), v (BH, Nk, Dv), float32 -> out (BH, Nq, Dv), lse (BH, Nq)
    (divided by ``|scale|`` when :func:`huge_scale`: the backward's L)."""
    BH, Nq, _ = q.shape
    Nk, Dv = k.shape[1], v.shape[2]
    out = q.new_empty(BH, Nq, Dv)                                   # (BH, Nq, Dv)
    lse = q.new_empty(BH, Nq)                                       # (BH, Nq)
    kT = k.transpose(1, 2)                                          # (BH, D, Nk) a view
    huge = huge_scale(scale)
    # huge: q takes only the scale's sign, and the scale multiplies after the max (scores * scale overflow)
    q_scale, exp_scale = (math.copysign(1.0, scale), abs(scale) * LOG2E) if huge else (scale * LOG2E, 1.0)

    def program(i):
        """One block of queries, rows [q0, q1), against all the key blocks it sees; all heads at once."""
        q0 = i * block_m
        q1 = min(q0 + block_m, Nq)
        # fold scale and log2(e) into q: scores come out in base-2 units, so exp2 replaces exp
        qi = q[:, q0:q1] * q_scale                                  # (BH, bm, D)
        m = q.new_full((BH, q1 - q0, 1), float("-inf"))             # (BH, bm, 1) running max
        l = q.new_zeros(BH, q1 - q0, 1)                             # (BH, bm, 1) running sum
        acc = q.new_zeros(BH, q1 - q0, Dv)                          # (BH, bm, Dv) running output
        for k0, k1, on_diagonal in _k_blocks(q0, q1, Nk, block_n, causal):
            s = torch.bmm(qi, kT[:, :, k0:k1])                      # (BH, bm, bn) tile of S
            if on_diagonal:
                keep = _causal_keep(q0, q1 - q0, k0, k1 - k0, q.device)   # (bm, bn)
                s.masked_fill_(~keep, float("-inf"))                # (BH, bm, bn)
            m_new = torch.maximum(m, s.amax(dim=2, keepdim=True))   # (BH, bm, 1)
            # rows with nothing seen yet keep m_new = -inf: shift by 0 so exp(-inf) = 0, not NaN
            shift = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)  # (BH, bm, 1)
            s.sub_(shift)
            if huge:
                s.mul_(exp_scale)                                   # (BH, bm, bn) <= 0: nothing overflows
            p = s.exp2_()                                           # (BH, bm, bn) tile of P, in place
            alpha = torch.exp2((m - shift) * exp_scale)             # (BH, bm, 1) rescale old stats
            l.mul_(alpha).add_(p.sum(dim=2, keepdim=True))          # (BH, bm, 1)
            acc.mul_(alpha).baddbmm_(p, v[:, k0:k1])                # (BH, bm, Dv) acc = alpha*acc + p v
            m = m_new
        seen = l > 0                                                # (BH, bm, 1) False only if Nk == 0
        out[:, q0:q1] = acc / torch.where(seen, l, torch.ones_like(l))            # (BH, bm, Dv)
        lse2 = torch.where(seen, m + torch.log2(l) / exp_scale, m.new_tensor(float("-inf")))  # (BH, bm, 1)
        if huge:   # the row's other mass rounded away in m + log2(l) / exp_scale: round up, so P == 1 means one-hot
            lse2 = torch.where((l > 1) & (lse2 == m), m + m.abs() * torch.finfo(m.dtype).eps, lse2)
        lse[:, q0:q1] = lse2[..., 0] * (1.0 if huge else LN2)       # (BH, bm) natural (huge: / |scale|)

    _run_blocks(program, -(-Nq // block_m), q.device)
    return out, lse


def _flash_backward(q, k, v, out, lse, dout, dlse, scale, causal, block_m, block_n):
    """FlashAttention-2 backward, recomputing P per tile from the saved lse. All (BH, N, D).

    As in FlashAttention-2 the outer loop runs over key blocks: each program owns dK_j and dV_j
    and adds its share of dQ into a per-thread buffer (a GPU uses atomic adds there).
    """
    BH, Nq, D = q.shape
    Nk = k.shape[1]
    dk = torch.empty_like(k)                                        # (BH, Nk, D)
    dv = torch.empty_like(v)                                        # (BH, Nk, Dv)
    dq_per_thread = {}                                              # thread id -> (BH, Nq, D)
    # D_i = rowsum(dO_i * O_i); a gradient on lse adds dlse_i * P_ij to dS_ij, i.e. D_i -= dlse_i
    delta = (dout * out).sum(dim=2, keepdim=True)                   # (BH, Nq, 1)
    if dlse is not None:
        delta = delta - dlse[..., None]                             # (BH, Nq, 1)
    # rows with no keys (lse = -inf) have P = 0: use +inf so exp(s - lse) = 0; base 2 as in forward
    lse = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse)   # (BH, Nq)
    huge = huge_scale(scale)
    if huge:   # as the forward: raw scores (times the scale's sign), the lse divided by |scale|
        lse2, q_scaled = lse[..., None], q * math.copysign(1.0, scale)                  # (BH, Nq, 1), (BH, Nq, D)
    else:
        lse2 = (lse * LOG2E)[..., None]                             # (BH, Nq, 1)
        q_scaled = q * (scale * LOG2E)                              # (BH, Nq, D) base-2 scores

    def program(j):
        """One block of keys, [k0, k1), against all the query blocks that see it; all heads at once."""
        k0 = j * block_n
        k1 = min(k0 + block_n, Nk)
        tid = threading.get_ident()
        if tid not in dq_per_thread:                                # only this thread writes this key
            dq_per_thread[tid] = torch.zeros_like(q)
        dq = dq_per_thread[tid]                                     # (BH, Nq, D)
        kj, vj = k[:, k0:k1], v[:, k0:k1]                           # (BH, bn, D), (BH, bn, Dv)
        dkj = torch.zeros_like(kj)                                  # (BH, bn, D)
        dvj = torch.zeros_like(vj)                                  # (BH, bn, Dv)
        for q0, q1, on_diagonal in _q_blocks(k0, k1, Nq, block_m, causal):
            qi, doi = q[:, q0:q1], dout[:, q0:q1]                   # (BH, bm, D), (BH, bm, Dv)
            s = torch.bmm(q_scaled[:, q0:q1], kj.transpose(1, 2))   # (BH, bm, bn) recomputed S tile
            if on_diagonal:
                keep = _causal_keep(q0, q1 - q0, k0, k1 - k0, q.device)   # (bm, bn)
                s.masked_fill_(~keep, float("-inf"))
            s.sub_(lse2[:, q0:q1])
            if huge:   # scale after subtracting; P <= 1, so a rounding above the lse is capped at 0
                s.mul_(abs(scale) * LOG2E).clamp_(max=0.0)
            p = s.exp2_()                                           # (BH, bm, bn) recomputed P tile
            dvj.baddbmm_(p.transpose(1, 2), doi)                    # (BH, bn, Dv) dV_j += P^T dO_i
            dp = torch.bmm(doi, vj.transpose(1, 2))                 # (BH, bm, bn) dP = dO_i V_j^T
            ds = dp.sub_(delta[:, q0:q1]).mul_(p)                   # (BH, bm, bn) dS = P * (dP - D)
            if huge and dlse is None:   # one-hot: dS = 0 (dP - D is a rounding, times the scale below)
                ds.masked_fill_(p == 1.0, 0.0)
            dq[:, q0:q1].baddbmm_(ds, kj, alpha=scale)              # (BH, bm, D)  dQ_i += dS K_j * scale
            dkj.baddbmm_(ds.transpose(1, 2), qi, alpha=scale)       # (BH, bn, D)  dK_j += dS^T Q_i * scale
        dk[:, k0:k1] = dkj
        dv[:, k0:k1] = dvj

    _run_blocks(program, -(-Nk // block_n), q.device)
    dq = sum(dq_per_thread.values()) if dq_per_thread else torch.zeros_like(q)   # (BH, Nq, D)
    return dq, dk, dv


# public names for the lessons that show these functions (the private names stay); not in __all__: they are
# the algorithm's inside (one head, or (BH, N, D) float tensors, unchecked), shown rather than called
forward_reference, backward_reference = _forward_reference, _backward_reference
flash_forward, flash_backward = _flash_forward, _flash_backward


class _TiledAttention(torch.autograd.Function):
    """autograd wrapper: saves q, k, v, out and lse (never P), recomputes tiles in backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_m, block_n):
        B, H, Nq, D = q.shape
        Nk, Dv = k.shape[2], v.shape[3]
        dtype = q.dtype
        # low-precision inputs are computed in float32 (as FlashAttention accumulates in fp32)
        work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        q3 = q.reshape(B * H, Nq, D).to(work)                       # (BH, Nq, D)
        k3 = k.reshape(B * H, Nk, D).to(work)                       # (BH, Nk, D)
        v3 = v.reshape(B * H, Nk, Dv).to(work)                      # (BH, Nk, Dv)
        out3, lse3 = _flash_forward(q3, k3, v3, scale, causal, block_m, block_n)
        ctx.save_for_backward(q3, k3, v3, out3, lse3)
        ctx.set_materialize_grads(False)   # an unused output (often lse) gets grad None, not zeros
        ctx.causal, ctx.scale, ctx.block_m, ctx.block_n = causal, scale, block_m, block_n
        ctx.shapes, ctx.dtype = (B, H, Nq, Nk, D, Dv), dtype
        out = out3.reshape(B, H, Nq, Dv).to(dtype)                  # (B, H, Nq, Dv)
        lse = lse3.reshape(B, H, Nq)                                # (B, H, Nq) kept in the work dtype
        if huge_scale(scale):
            lse = lse * abs(scale)                                  # (B, H, Nq) natural: the forward kept lse / |scale|
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # once_differentiable only delays the error to a later backward and hands out a first-order gradient
        # meanwhile: refuse create_graph=True here, as the kernels do
        validate.no_double_backward("tiled_attention")
        q3, k3, v3, out3, lse3 = ctx.saved_tensors
        B, H, Nq, Nk, D, Dv = ctx.shapes
        work = q3.dtype
        if dout is None:                                            # only lse was used
            dout = out3.new_zeros(B, H, Nq, Dv)
        dout3 = dout.reshape(B * H, Nq, Dv).to(work)                # (BH, Nq, Dv)
        dlse3 = None if dlse is None else dlse.reshape(B * H, Nq).to(work)   # (BH, Nq)
        dq, dk, dv = _flash_backward(q3, k3, v3, out3, lse3, dout3, dlse3,
                                     ctx.scale, ctx.causal, ctx.block_m, ctx.block_n)
        return (dq.reshape(B, H, Nq, D).to(ctx.dtype), dk.reshape(B, H, Nk, D).to(ctx.dtype),
                dv.reshape(B, H, Nk, Dv).to(ctx.dtype), None, None, None, None)


@validate.renamed_keywords(block_q="block_m", block_k="block_n")   # the README's "Changes" lists it
def tiled_attention(q, k, v, causal=False, scale=None, block_m=DEFAULT_BLOCK_M, block_n=DEFAULT_BLOCK_N, *,
                    return_lse=False):
    """FlashAttention in PyTorch: exact attention without ever materialising the (Nq, Nk) matrices.

    q: (B, H, Nq, D), k: (B, H, Nk, D), v: (B, H, Nk, Dv); any lengths, Nq != Nk allowed.
    causal: top-left aligned (query i sees keys j <= i, as torch SDPA ``is_causal``); tiles above
    the diagonal are skipped. scale: default ``1/sqrt(D)``. block_m, block_n: tile sizes,
    query rows by key columns (Triton's BLOCK_M and BLOCK_N, the paper's B_r and B_c; large tiles
    are fastest on a CPU, small ones make the algorithm easy to watch in a lesson; ``block_q`` and
    ``block_k`` are their old names, deprecated).
    Returns out (B, H, Nq, Dv), or (out, lse) with ``lse`` (B, H, Nq) the natural log-sum-exp of
    each row's scaled scores (float32 for fp16/bf16 inputs; ``-inf`` for rows without keys, whose
    output is zero). Differentiable in out and lse; the backward pass recomputes P tile by tile.
    Double backward (``create_graph=True``) raises a ``RuntimeError``.

    Example: ``out, lse = tiled_attention(q, k, v, causal=True, block_m=64, block_n=64, return_lse=True)``
    """
    validate.qkv(q, k, v)
    scale = validate.scale(scale, q.shape[-1])
    validate.integer(block_m, "block_m")
    validate.integer(block_n, "block_n")
    validate.flag(causal, "causal")
    out, lse = _TiledAttention.apply(q, k, v, causal, scale, block_m, block_n)
    return (out, lse) if return_lse else out
