"""FlashAttention built in steps: the smallest kernels that are the algorithm, one idea at a time.

What you learn here, in the order lesson 07 reads it:

(a) ``fwd_loop_kernel``: the forward loop and nothing else. One program per block of
    ``BLOCK_M`` queries of one (batch, head) loads its Q block once, streams K and V past it
    block by block, keeps the running max ``m_i``, sum ``l_i`` and unnormalised output ``acc``
    on chip (the online softmax), and writes O once. No masks: N must be a multiple of both
    block sizes.
(b) ``fwd_masked_kernel``: (a) plus boundary masks, so any N works: rows past N are not
    loaded or stored, keys past N are not loaded and get score ``-inf`` (weight 0).
(c) ``fwd_causal_kernel``: (b) plus causal attention. A query block stops its loop at the
    diagonal, so the key blocks above it are never loaded; the one block that crosses it
    is masked element by element.

The backward at the same size (``bwd_dkdv_kernel``, ``bwd_dq_kernel``; no masks, not causal)
recomputes each tile of P from Q, K and the log-sum-exp L that the forward stores, instead
of reading an N x N matrix: P_ij = exp(S_ij - L_i). One kernel owns a block of keys and
accumulates dK and dV over all queries; the other owns a block of queries and accumulates
dQ over all keys, so neither ever writes to a block another program writes.

The shipped kernel, ``flash_attention.py``, is (c) plus what a GPU and the course need: any
strides (these take contiguous (B, H, N, d) tensors), Nq != Nk, ``exp2`` with log2(e) folded
into the scale, the masks only on the blocks that need them (``EVEN_N``, the diagonal test),
the log-sum-exp output for the backward, and grouped-query attention. Lesson 08's block-sparse
kernels (``block_sparse_attention.py``) are a copy of those with their changes marked ``# NEW`` too.

Memory traffic per (batch, head), in elements, for N queries and keys and head dim d (not
causal): read Nd (Q) + (N / BLOCK_M) x 2Nd (K and V once per query block), write Nd (O).
``attnlab.iomodel.flash_forward_io`` counts the same, plus the shipped kernel's N log-sum-exp
values, and ``attnlab.memory.trace`` measures it.

Each step repeats the one before it on purpose, with the lines it adds marked ``# NEW``: a
reader compares (a), (b) and (c) side by side, which a shared helper would hide.
"""

import torch
import triton
import triton.language as tl

from attnlab import validate

from ._runtime import jit, use_interpreter

__all__ = ["flash_forward_loop", "flash_forward_masked", "flash_forward_causal", "flash_backward_minimal",
           "fwd_loop_kernel", "fwd_masked_kernel", "fwd_causal_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"]


# ---------------------------------------------------------------------------------------
# (a) the loop only: no masks, N a multiple of BLOCK_M and BLOCK_N
# ---------------------------------------------------------------------------------------
@jit
def fwd_loop_kernel(
    Q, K, V, O,                           # contiguous (B, H, N, d)
    N, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)              # which block of BLOCK_M queries
    base = tl.program_id(1) * N * HEAD_DIM  # which (batch, head): its first element
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # read BLOCK_M * d elements of Q, once
    q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # running row max
    l_i = tl.zeros([BLOCK_M], tl.float32)                 # running row sum of exp(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)       # running unnormalised output
    for start_n in range(0, N, BLOCK_N):
        kv = base + (start_n + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv)                               # read BLOCK_N * d elements of K
        v = tl.load(V + kv)                               # read BLOCK_N * d elements of V
        s = tl.dot(q, tl.trans(k)) * sm_scale             # (BLOCK_M, BLOCK_N) scores, on chip only
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)                       # rescale what was accumulated so far
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # write BLOCK_M * d elements of O
    tl.store(O + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))
    # per (batch, head): read Nd + (N / BLOCK_M) * 2Nd, write Nd elements


# ---------------------------------------------------------------------------------------
# (b) plus boundary masks: any N
# ---------------------------------------------------------------------------------------
@jit
def fwd_masked_kernel(
    Q, K, V, O,
    N, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    base = tl.program_id(1) * N * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < N                          # NEW: query rows past N
    # read BLOCK_M * d elements of Q (rows past N masked off: they cost nothing)
    q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, N, BLOCK_N):
        cols = start_n + offs_n
        kv = base + cols[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv, mask=cols[:, None] < N, other=0.0)   # NEW: keys past N are not loaded
        v = tl.load(V + kv, mask=cols[:, None] < N, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        s = tl.where(cols[None, :] < N, s, float("-inf"))        # NEW: ... and get weight exp(-inf) = 0
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # write BLOCK_M * d elements of O (rows past N masked off)
    tl.store(O + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=row_ok)
    # per (batch, head): read Nd + ceil(N / BLOCK_M) * 2Nd, write Nd elements


# ---------------------------------------------------------------------------------------
# (c) plus causal block skipping
# ---------------------------------------------------------------------------------------
@jit
def fwd_causal_kernel(
    Q, K, V, O,
    N, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,                 # NEW: query i sees key j <= i
):
    pid_m = tl.program_id(0)
    base = tl.program_id(1) * N * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < N
    q = tl.load(Q + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:  # NEW: the last query of this block is min((pid_m + 1) BLOCK_M, N) - 1: no key after it is seen
        hi = tl.minimum((pid_m + 1) * BLOCK_M, N)         # key blocks from hi on are never loaded
    else:
        hi = N
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv = base + cols[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv, mask=cols[:, None] < N, other=0.0)
        v = tl.load(V + kv, mask=cols[:, None] < N, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        s = tl.where(cols[None, :] < N, s, float("-inf"))
        if CAUSAL:  # NEW: inside the block that crosses the diagonal, key j > query i gets weight 0
            s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))        # finite: every row sees key 0 in the first block
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    tl.store(O + base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=row_ok)
    # per (batch, head), causal: K and V are read only for the tiles on or below the diagonal,
    # about half of (b)'s ceil(N / BLOCK_M) * 2Nd


# ---------------------------------------------------------------------------------------
# The backward, minimal: no masks, not causal (N a multiple of the blocks)
# ---------------------------------------------------------------------------------------
@jit
def bwd_dkdv_kernel(
    Q, K, V, DO, L, D, DK, DV,            # L, D: (B, H, N) float32, the log-sum-exp and rowsum(dO * O)
    N, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)              # which block of BLOCK_N keys
    bh = tl.program_id(1)
    base = bh * N * HEAD_DIM
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv = base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv)                   # read BLOCK_N * d elements of K, once
    v = tl.load(V + kv)                   # read BLOCK_N * d elements of V, once
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start_m in range(0, N, BLOCK_M):  # every query block sees this key block
        rows = start_m + offs_m
        qo = base + rows[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(Q + qo)               # read BLOCK_M * d elements of Q
        do = tl.load(DO + qo)             # read BLOCK_M * d elements of dO
        lse = tl.load(L + bh * N + rows)  # read BLOCK_M floats of L
        delta = tl.load(D + bh * N + rows)  # read BLOCK_M floats of D
        p = tl.exp(tl.dot(q, tl.trans(k)) * sm_scale - lse[:, None])  # P recomputed: exp(S - L), on chip
        dv += tl.dot(tl.trans(p).to(do.dtype), do)        # dV += P^T dO
        dp = tl.dot(do, tl.trans(v))                      # dP = dO V^T
        ds = p * (dp - delta[:, None])                    # dS = P * (dP - D), the softmax backward
        dk += tl.dot(tl.trans(ds).to(q.dtype), q)         # dK += dS^T Q
    tl.store(DK + kv, (dk * sm_scale).to(DK.dtype.element_ty))  # write BLOCK_N * d elements of dK
    tl.store(DV + kv, dv.to(DV.dtype.element_ty))                # write BLOCK_N * d elements of dV
    # per (batch, head): read 2Nd + (N / BLOCK_N) * (2Nd + 2N floats), write 2Nd elements


@jit
def bwd_dq_kernel(
    Q, K, V, DO, L, D, DQ,
    N, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)              # which block of BLOCK_M queries
    bh = tl.program_id(1)
    base = bh * N * HEAD_DIM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    qo = base + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + qo)                   # read BLOCK_M * d elements of Q, once
    do = tl.load(DO + qo)                 # read BLOCK_M * d elements of dO, once
    lse = tl.load(L + bh * N + offs_m)    # read BLOCK_M floats of L, once
    delta = tl.load(D + bh * N + offs_m)  # read BLOCK_M floats of D, once
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, N, BLOCK_N):  # the same key blocks as the forward
        kv = base + (start_n + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv)               # read BLOCK_N * d elements of K
        v = tl.load(V + kv)               # read BLOCK_N * d elements of V
        p = tl.exp(tl.dot(q, tl.trans(k)) * sm_scale - lse[:, None])  # P recomputed, as in the other kernel
        dp = tl.dot(do, tl.trans(v))      # dP = dO V^T
        ds = p * (dp - delta[:, None])    # dS = P * (dP - D)
        dq += tl.dot(ds.to(k.dtype), k)   # dQ += dS K
    tl.store(DQ + qo, (dq * sm_scale).to(DQ.dtype.element_ty))   # write BLOCK_M * d elements of dQ
    # per (batch, head): read 2Nd + 2N floats + (N / BLOCK_M) * 2Nd, write Nd elements


# ---------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------
def _check_step_args(q, k, v, block_m, block_n, even=False):
    """q, k, v as for ``flash_attention``, one length N for all three, contiguous layout is made here;
    block sizes powers of two >= 16; ``even``: N must be a multiple of both (the unmasked kernels)."""
    validate.kernel_qkv(q, k, v, interpreted=use_interpreter)
    validate.qkv(q, k, v, same_length=True)            # the step kernels take one length N
    validate.kernel_blocks(block_m, block_n)
    n = q.shape[-2]
    if even and (n % block_m or n % block_n):
        raise ValueError(f"q: expected N a multiple of block_m = {block_m} and block_n = {block_n} (this kernel has "
                         f"no masks: use flash_forward_masked), got shape {tuple(q.shape)}")


def _launch_forward(kernel, q, k, v, block_m, block_n, **meta):
    B, H, n, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    grid = (triton.cdiv(n, block_m), B * H)   # one program per (query block, batch x head)
    kernel[grid](q, k, v, o, n, d ** -0.5, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, **meta)
    return o


def flash_forward_loop(q, k, v, block_m=64, block_n=64):
    """Step (a): FlashAttention's forward loop, no masks. q, k, v: (B, H, N, d) with N a multiple
    of ``block_m`` and ``block_n`` -> o (B, H, N, d). Not differentiable.

    Example: ``o = flash_forward_loop(q, k, v, 64, 64)``
    """
    _check_step_args(q, k, v, block_m, block_n, even=True)
    return _launch_forward(fwd_loop_kernel, q, k, v, block_m, block_n)


def flash_forward_masked(q, k, v, block_m=64, block_n=64):
    """Step (b): the loop plus boundary masks, any N. q, k, v: (B, H, N, d) -> o (B, H, N, d).

    Example: ``o = flash_forward_masked(q, k, v, 64, 32)``
    """
    _check_step_args(q, k, v, block_m, block_n)
    return _launch_forward(fwd_masked_kernel, q, k, v, block_m, block_n)


def flash_forward_causal(q, k, v, causal=True, block_m=64, block_n=64):
    """Step (c): (b) plus causal block skipping. q, k, v: (B, H, N, d) -> o (B, H, N, d); causal:
    query i sees keys j <= i, and key blocks above the diagonal are never loaded.

    Example: ``o = flash_forward_causal(q, k, v)``
    """
    _check_step_args(q, k, v, block_m, block_n)
    validate.flag(causal, "causal")
    return _launch_forward(fwd_causal_kernel, q, k, v, block_m, block_n, CAUSAL=causal)


def flash_backward_minimal(q, k, v, o, lse, do, block_m=64, block_n=64):
    """The minimal backward: dq, dk, dv from q, k, v, the forward's o and log-sum-exp ``lse``
    (B, H, N) and the upstream gradient ``do``; not causal, N a multiple of the blocks.

    D = rowsum(dO * O) is computed here in PyTorch (the shipped backward has a kernel for it);
    then ``bwd_dkdv_kernel`` and ``bwd_dq_kernel`` run.
    Example: ``o, lse = flash_attention(q, k, v, return_lse=True); dq, dk, dv = flash_backward_minimal(q, k, v, o, lse, do)``
    """
    _check_step_args(q, k, v, block_m, block_n, even=True)
    B, H, n, d = q.shape
    for name, t, shape in (("o", o, q.shape), ("do", do, q.shape), ("lse", lse, (B, H, n))):
        validate.tensor(t, name)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    q, k, v, do = (t.contiguous() for t in (q, k, v, do))
    lse = lse.float().contiguous()
    delta = (o.float() * do.float()).sum(-1).contiguous()   # (B, H, N): D_i = rowsum(dO_i * O_i)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scale = d ** -0.5
    bwd_dkdv_kernel[(n // block_n, B * H)](q, k, v, do, lse, delta, dk, dv, n, scale,
                                           HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n)
    bwd_dq_kernel[(n // block_m, B * H)](q, k, v, do, lse, delta, dq, n, scale,
                                         HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n)
    return dq, dk, dv
