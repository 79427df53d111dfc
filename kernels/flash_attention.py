"""FlashAttention-2 in Triton: forward with the online softmax, backward with recomputation.

What you learn here:

* how one program per (block of queries, batch x head) walks the keys and values block by
  block, keeping a running max ``m``, a running sum ``l`` and an unnormalised output ``acc``
  on chip, so the N x N score matrix never reaches global memory (Dao et al. 2022; the loop
  order with queries outside is FlashAttention-2, Dao 2023);
* why the forward stores the log-sum-exp ``L`` of each row (N numbers) and how the
  backward uses it to *recompute* the probabilities P instead of reading them;
* how causal attention skips whole blocks above the diagonal (they are never loaded), and
  how boundary masks make any sequence length work;
* the memory traffic of each kernel, counted in comments and predicted exactly by
  :mod:`attnlab.iomodel` (``flash_forward_io``, ``flash_backward_io``).

Conventions: q (B, H, Nq, d), k and v (B, H, Nk, d); causal means query i sees key j <= i
(top-left alignment, exactly ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``,
also when Nq != Nk). A query row that sees no key at all (possible only with a block-sparse
mask) gets output 0, gradient 0 and log-sum-exp -inf.

The same kernels, with ``SPARSE=True``, are the block-sparse kernels of
``block_sparse_attention.py``: the loop over key blocks then walks a list of block
indices instead of a range.
"""

import torch
import triton
import triton.language as tl

from attnlab import validate

from ._runtime import dot_precision, jit, use_interpreter
from ._tuning import INTERPRETER_BLOCKS, default_block_sizes, launch, native_options

__all__ = ["flash_attention", "SUPPORTED_HEAD_DIMS"]

SUPPORTED_HEAD_DIMS = validate.KERNEL_HEAD_DIMS  # (16, 32, 64, 128); the checks live in attnlab.validate
# exp(x) == exp2(x * LOG2E) and ln(x) == log2(x) * LN2: exp2 and log2 are the GPU's native instructions
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# ---------------------------------------------------------------------------------------
# The naive version first: what FlashAttention replaces (attnlab.attention's reference):
#   s = q @ k.transpose(-2, -1) * scale      # read (Nq + Nk) d;   write Nq Nk   (S)
#   p = torch.softmax(s, dim=-1)             # read Nq Nk;         write Nq Nk   (P)
#   o = p @ v                                # read Nq Nk + Nk d;  write Nq d    (O)
# per head: 3 Nq Nk + (2 Nq + 2 Nk) d elements at least; FlashAttention: O((Nq + Nk) d)
# per pass over K/V, and the Nq x Nk terms are gone.
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Forward kernel
# ---------------------------------------------------------------------------------------
@jit
def _attn_fwd_kernel(
    Q, K, V, O, L,                       # L: log-sum-exp per query row, a (B, H, Nq, 1) column
    KV_NUM, KV_IDX,                      # block-sparse only: (B, H, nqb) counts, (B, H, nqb, nkb) indices
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxq,
    H, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, SPARSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,                # Nk % BLOCK_N == 0: no key block runs past the end
):
    pid_m = tl.program_id(0)             # which block of BLOCK_M queries
    pid_bh = tl.program_id(1)            # which (batch, head)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    # read BLOCK_M * d elements of Q, once (rows past Nq are masked off and cost nothing)
    q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)
    qk_scale = sm_scale * LOG2E          # fold log2(e) in: use exp2 below
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)                # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)      # running unnormalised output

    # which key blocks this query block visits
    if SPARSE:
        n_blocks = tl.load(KV_NUM + b * stride_numb + h * stride_numh + pid_m)  # read 1 int
        idx_base = KV_IDX + b * stride_idxb + h * stride_idxh + pid_m * stride_idxq
    else:
        if CAUSAL:
            # query rows < min((pid_m + 1) * BLOCK_M, Nq) see keys < that bound: blocks
            # entirely above the diagonal are never loaded
            hi = tl.minimum(tl.minimum((pid_m + 1) * BLOCK_M, N_Q), N_K)
        else:
            hi = N_K
        n_blocks = (hi + BLOCK_N - 1) // BLOCK_N

    for it in range(0, n_blocks):
        if SPARSE:
            start_n = tl.load(idx_base + it) * BLOCK_N   # read 1 int: the block's index
        else:
            start_n = it * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
        # read BLOCK_N * d elements of K (keys past Nk masked off)
        if EVEN_N:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), on chip
        # masks cost time on every element, so each is applied only to the blocks that need it
        if not EVEN_N:
            s = tl.where(offs_n[None, :] < N_K, s, float("-inf"))
        if CAUSAL:
            if start_n + BLOCK_N > pid_m * BLOCK_M + 1:  # the block crosses the diagonal
                s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        # online softmax: new max, rescale what was accumulated so far
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if SPARSE:  # a row may have seen no key yet (m_new = -inf): subtract 0, not -inf, to avoid NaN
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:       # dense: every row sees key 0 in the first block, so m_new is finite
            m_new_safe = m_new
        p = tl.math.exp2(s - m_new_safe[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # read BLOCK_N * d elements of V
        if EVEN_N:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    # write BLOCK_M * d elements of O
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=offs_m[:, None] < N_Q)
    # write BLOCK_M elements of L: log-sum-exp in natural-log units (-inf for an empty row)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    tl.store(L + b * stride_lb + h * stride_lh + offs_m, lse, mask=offs_m < N_Q)
    # per program: read (1 + 2 * visited blocks) tiles, write one O tile and one L column.
    # per (batch, head), not causal: read Nq d + ceil(Nq / BLOCK_M) * 2 Nk d, write Nq d + Nq


# ---------------------------------------------------------------------------------------
# Backward kernels. Their opening lines (program ids, batch and head, offsets, the loads of a
# block) repeat the forward's on purpose, as in Triton's fused-attention tutorial: each kernel
# reads on its own from top to bottom.
# ---------------------------------------------------------------------------------------
@jit
def _attn_bwd_preprocess_kernel(
    O, DO, DELTA,                        # DELTA: (B, H, Nq, 1) column, like L
    stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don, stride_deltab, stride_deltah,
    H, N_Q,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] < N_Q
    # read 2 * BLOCK_M * d elements (O and dO)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :], mask=rows, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij
    # write BLOCK_M elements
    tl.store(DELTA + b * stride_deltab + h * stride_deltah + offs_m, delta, mask=offs_m < N_Q)


@jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, L, DELTA, DK, DV,
    Q_NUM, Q_IDX,                        # block-sparse only: for each key block, the query blocks that see it
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_lb, stride_lh,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxk,
    H, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, SPARSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,   # Nq % BLOCK_M == 0, Nk % BLOCK_N == 0
):
    # one program per (block of BLOCK_N keys, batch x head); it loops over query blocks
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_rows = offs_n[:, None] < N_K
    # read 2 * BLOCK_N * d elements (K and V), once
    k = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_rows, other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_rows, other=0.0)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    l_base = L + b * stride_lb + h * stride_lh
    delta_base = DELTA + b * stride_lb + h * stride_lh   # DELTA has L's layout (asserted by the wrapper)
    qk_scale = sm_scale * LOG2E
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    if SPARSE:
        n_blocks = tl.load(Q_NUM + b * stride_numb + h * stride_numh + pid_n)   # read 1 int
        idx_base = Q_IDX + b * stride_idxb + h * stride_idxh + pid_n * stride_idxk
        first = 0
    else:
        n_blocks = (N_Q + BLOCK_M - 1) // BLOCK_M
        if CAUSAL:
            first = (pid_n * BLOCK_N) // BLOCK_M   # query blocks wholly above this key block see none of it
            n_blocks = tl.where(pid_n * BLOCK_N < N_Q, n_blocks, first)  # keys past the last query: none
        else:
            first = 0

    for it in range(first, n_blocks):
        if SPARSE:
            start_m = tl.load(idx_base + it) * BLOCK_M   # read 1 int
        else:
            start_m = it * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = q_base + offs_m[:, None] * stride_qn + offs_d[None, :]
        do_ptrs = do_base + offs_m[:, None] * stride_don + offs_d[None, :]
        # read 2 * BLOCK_M * d elements (Q and dO) and 2 * BLOCK_M (L and D); rows past Nq masked off
        if EVEN_M:
            q = tl.load(q_ptrs)
            lse = tl.load(l_base + offs_m)
        else:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)
            lse = tl.load(l_base + offs_m, mask=offs_m < N_Q, other=0.0)
        # recompute P^T for this tile from Q, K and L (never stored in the forward)
        lse2 = lse * LOG2E
        if SPARSE:  # a row that saw no key has L = -inf: make its P 0, not exp2(+inf)
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse2)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale      # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if not (EVEN_M and EVEN_N):
            p_t = tl.where((offs_m[None, :] < N_Q) & (offs_n[:, None] < N_K), p_t, 0.0)
        if CAUSAL:
            if start_m < pid_n * BLOCK_N + BLOCK_N - 1:  # the tile crosses the diagonal
                p_t = tl.where(offs_n[:, None] <= offs_m[None, :], p_t, 0.0)
        if EVEN_M:
            do = tl.load(do_ptrs)
        else:
            do = tl.load(do_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)            # dV += P^T dO
        if EVEN_M:
            delta = tl.load(delta_base + offs_m)
        else:
            delta = tl.load(delta_base + offs_m, mask=offs_m < N_Q, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)               # (dP)^T = V dO^T
        ds_t = p_t * (dp_t - delta[None, :])                                         # dS = P * (dP - D)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)             # dK += dS^T Q
    dk = dk * sm_scale
    # write 2 * BLOCK_N * d elements (dK and dV)
    tl.store(DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_rows)
    tl.store(DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_rows)


@jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, L, DELTA, DQ,
    KV_NUM, KV_IDX,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqn,
    stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxq,
    H, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, SPARSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    # one program per (block of BLOCK_M queries, batch x head); the same key blocks as the forward
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = offs_m[:, None] < N_Q
    # read 2 * BLOCK_M * d elements (Q, dO) and 2 * BLOCK_M (L, D), once
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :], mask=q_rows, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :], mask=q_rows, other=0.0)
    lse = tl.load(L + b * stride_lb + h * stride_lh + offs_m, mask=offs_m < N_Q, other=0.0)
    delta = tl.load(DELTA + b * stride_lb + h * stride_lh + offs_m, mask=offs_m < N_Q, other=0.0)
    lse2 = lse * LOG2E
    if SPARSE:  # a row that saw no key: P = 0
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse2)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    qk_scale = sm_scale * LOG2E
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # the same walk over key blocks as the forward kernel: written out again on purpose, so that
    # each kernel reads on its own from top to bottom, as in Triton's fused-attention tutorial
    if SPARSE:
        n_blocks = tl.load(KV_NUM + b * stride_numb + h * stride_numh + pid_m)   # read 1 int
        idx_base = KV_IDX + b * stride_idxb + h * stride_idxh + pid_m * stride_idxq
    else:
        if CAUSAL:
            hi = tl.minimum(tl.minimum((pid_m + 1) * BLOCK_M, N_Q), N_K)
        else:
            hi = N_K
        n_blocks = (hi + BLOCK_N - 1) // BLOCK_N

    for it in range(0, n_blocks):
        if SPARSE:
            start_n = tl.load(idx_base + it) * BLOCK_N   # read 1 int
        else:
            start_n = it * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
        # read 2 * BLOCK_N * d elements (K and V); keys past Nk masked off
        if EVEN_N:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])                  # recomputed P tile
        if not EVEN_N:
            p = tl.where(offs_n[None, :] < N_K, p, 0.0)
        if CAUSAL:
            if start_n + BLOCK_N > pid_m * BLOCK_M + 1:      # the tile crosses the diagonal
                p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        if EVEN_N:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # dP = dO V^T
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)  # dQ += dS K
    dq = dq * sm_scale
    # write BLOCK_M * d elements
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_rows)


# ---------------------------------------------------------------------------------------
# Wrappers (the launch configurations are chosen in _tuning.py)
# ---------------------------------------------------------------------------------------
def _explicit_blocks(q, block_m, block_n):
    """(BLOCK_M, BLOCK_N) fixed by the caller (a missing one takes the default), checked; or
    (None, None) when neither is given: then each kernel's blocks are chosen at launch."""
    if block_m is None and block_n is None:
        return None, None
    dm, dn = default_block_sizes(q.shape[-1], q.dtype, q.device)
    blocks = (dm if block_m is None else block_m, dn if block_n is None else block_n)
    return validate.kernel_blocks(*blocks)


def _sparse_args(num, idx):
    """Pointer and strides for the block lists, or placeholders when not sparse."""
    if num is None:
        return (None, None), (0, 0, 0, 0, 0)
    return (num, idx), (num.stride(0), num.stride(1), idx.stride(0), idx.stride(1), idx.stride(2))


def _flash_forward(q, k, v, causal, scale, block_m=None, block_n=None, kv_num=None, kv_idx=None):
    """Launch the forward kernel. Returns o (B, H, Nq, d) and lse (B, H, Nq) float32.
    Block sizes None: chosen by :func:`_tuning.choose_config`."""
    B, H, n_q, d = q.shape
    n_k = k.shape[-2]
    o = torch.empty_like(q)
    lse = torch.empty((B, H, n_q, 1), device=q.device, dtype=torch.float32)
    (num, idx), sp = _sparse_args(kv_num, kv_idx)

    def run(config):
        bm, bn = config["block_m"], config["block_n"]
        _attn_fwd_kernel[(triton.cdiv(n_q, bm), B * H)](
            q, k, v, o, lse, num, idx,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            lse.stride(0), lse.stride(1),
            *sp,
            H, n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
            CAUSAL=bool(causal), SPARSE=kv_num is not None, DOT_PRECISION=dot_precision(q.dtype),
            EVEN_N=n_k % bn == 0,
            **native_options(config),
        )

    launch("fwd", run, q, n_q, n_k, causal, block_m, block_n)
    return o, lse.squeeze(-1)


def _flash_backward(do, q, k, v, o, lse, causal, scale, block_m=None, block_n=None,
                    kv_num=None, kv_idx=None, q_num=None, q_idx=None):
    """Launch the three backward kernels. Returns dq, dk, dv. Block sizes None: chosen by
    :func:`_tuning.choose_config`, separately for the dK/dV and the dQ kernel."""
    B, H, n_q, d = q.shape
    n_k = k.shape[-2]
    do = do.contiguous()
    lse = lse.unsqueeze(-1)                       # (B, H, Nq, 1) column, as the forward stored it
    delta = torch.empty_like(lse)                 # D = rowsum(dO * O), laid out exactly like L:
    # the dK/dV and dQ kernels address DELTA with L's strides, so that layout is a requirement
    assert delta.stride() == lse.stride(), "DELTA must share L's layout (the kernels use L's strides for it)"
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    pre_m = block_m if block_m is not None else (INTERPRETER_BLOCKS[0] if use_interpreter(q.device) else 64)
    _attn_bwd_preprocess_kernel[(triton.cdiv(n_q, pre_m), B * H)](
        o, do, delta,
        o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2), delta.stride(0), delta.stride(1),
        H, n_q, HEAD_DIM=d, BLOCK_M=pre_m,
    )
    (qn, qi), sp_q = _sparse_args(q_num, q_idx)

    def run_dkdv(config):
        bm, bn = config["block_m"], config["block_n"]
        _attn_bwd_dkdv_kernel[(triton.cdiv(n_k, bn), B * H)](
            q, k, v, do, lse, delta, dk, dv, qn, qi,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            do.stride(0), do.stride(1), do.stride(2),
            lse.stride(0), lse.stride(1),
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            *sp_q,
            H, n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
            CAUSAL=bool(causal), SPARSE=q_num is not None, DOT_PRECISION=dot_precision(q.dtype),
            EVEN_M=n_q % bm == 0, EVEN_N=n_k % bn == 0,
            **native_options(config),
        )

    (kn, ki), sp_k = _sparse_args(kv_num, kv_idx)

    def run_dq(config):
        bm, bn = config["block_m"], config["block_n"]
        _attn_bwd_dq_kernel[(triton.cdiv(n_q, bm), B * H)](
            q, k, v, do, lse, delta, dq, kn, ki,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            do.stride(0), do.stride(1), do.stride(2),
            lse.stride(0), lse.stride(1),
            dq.stride(0), dq.stride(1), dq.stride(2),
            *sp_k,
            H, n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
            CAUSAL=bool(causal), SPARSE=kv_num is not None, DOT_PRECISION=dot_precision(q.dtype),
            EVEN_N=n_k % bn == 0,
            **native_options(config),
        )

    launch("dkdv", run_dkdv, q, n_q, n_k, causal, block_m, block_n)
    launch("dq", run_dq, q, n_q, n_k, causal, block_m, block_n)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    """Forward saves q, k, v, o and the log-sum-exp (not P); backward recomputes P block by block.

    ``sparse`` is None (dense) or the block lists (kv_num, kv_idx, q_num, q_idx) of a block mask.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, blocks_fwd, blocks_bwd, sparse=None):
        kv = sparse[:2] if sparse is not None else ()
        o, lse = _flash_forward(q, k, v, causal, scale, *blocks_fwd, *kv)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.blocks_bwd, ctx.sparse = causal, scale, blocks_bwd, sparse
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        sp = ctx.sparse if ctx.sparse is not None else ()
        dq, dk, dv = _flash_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, *ctx.blocks_bwd, *sp)
        return dq, dk, dv, None, None, None, None, None


def flash_attention(q, k, v, causal=False, scale=None, return_lse=False, *, block_m=None, block_n=None):
    """FlashAttention-2 forward (and, through autograd, backward) as Triton kernels.

    q: (B, H, Nq, d), k and v: (B, H, Nk, d); d in 16, 32, 64, 128; float32 or float16
    (bfloat16 on a GPU). Returns o (B, H, Nq, d), and lse (B, H, Nq) float32 (natural log)
    when ``return_lse``. ``block_m``/``block_n`` fix the block sizes (forward and backward
    alike). By default the interpreter uses 128 x 128, and a GPU the fastest of a few
    configurations (:func:`attnlab.kernels._tuning.gpu_candidates`), timed at the first call for each shape, as
    ``@triton.autotune`` does; ``ATTNLAB_AUTOTUNE=0`` takes :func:`attnlab.kernels._tuning.gpu_config`'s instead.

    Example: ``o = flash_attention(q, k, v, causal=True)``
    """
    scale = validate.kernel_qkv(q, k, v, scale, causal, interpreted=use_interpreter)   # 1/sqrt(d) for None
    blocks = _explicit_blocks(q, block_m, block_n)   # (None, None): chosen at launch, per kernel
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o, lse = _FlashAttention.apply(q, k, v, causal, scale, blocks, blocks)  # forward and backward blocks
    return (o, lse) if return_lse else o
