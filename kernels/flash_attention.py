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

* grouped-query attention (GQA, Ainslie et al. 2023; MQA, Shazeer 2019): k and v may have
  fewer heads than q; query head ``h`` reads KV head ``h // GROUP`` (``GROUP = H_q / H_kv``)
  through its pointer, so K and V are never copied, and the dK/dV kernel sums over the group;
* with float16 inputs that need gradients the forward also writes O in float32 (``KEEP_F32_O``),
  and the backward's D = rowsum(dO * O) is made of it: a float16 O rounds every D_i, and
  dQ_i = sum_j P_ij (dP_ij - D_i) K_j carries that rounding times the keys (at inputs of magnitude
  about 100, dQ's error went from up to twice PyTorch's float16 error to below it; FlashAttention's
  own kernels keep only the float16 O);
* offsets are 64-bit where a program id (or a block's first row) times a stride can pass 2**31
  (``.to(tl.int64)`` on the batch, the head and the block start, as Triton's fused-attention
  tutorial does for the batch and head); offsets inside a block stay 32-bit, so the masks'
  index vectors cost no extra registers;
* any finite scale: above ``attnlab.tiled.HUGE_SCALE`` (``HUGE_SCALE=True``, the wrapper's choice)
  the scores times the scale can overflow float32 (``inf - inf`` is NaN), and the backward's
  ``s - L``, a difference of two numbers near 1e31 at a scale of 1e30, is all rounding; there the max
  is taken of the raw scores and the scale multiplies after subtracting it, L is kept divided by
  ``|scale|`` (the wrapper multiplies it back), and dS is 0 in one-hot rows. Below it the arithmetic
  is the usual one, bit for bit (``attnlab.tiled`` says why, with the same two orders in PyTorch).

This file is lesson 07's step (c) (``flash_steps.fwd_causal_kernel``) plus what a GPU and the
course need: any strides, Nq != Nk, ``exp2``, masks only on the blocks that need them, the
log-sum-exp, GQA. The block-sparse kernels are a marked copy of these, in
``block_sparse_attention.py``.

Conventions: q (B, H, Nq, d), k and v (B, H_kv, Nk, d); causal means query i sees key j <= i
(top-left alignment, exactly ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``,
also when Nq != Nk). The log-sum-exp that ``flash_attention(..., return_lse=True)`` returns is
differentiable: its gradient enters the backward as ``D_i - dlse_i`` (below), which is what merging
partial attentions through their log-sum-exp (ring attention, split-K decoding) needs.
"""

import torch
import triton
import triton.language as tl

from attnlab import validate
from attnlab.tiled import huge_scale

from ._runtime import dot_precision, jit, use_interpreter
from ._tuning import INTERPRETER_BLOCKS, default_block_sizes, launch, native_options

__all__ = ["flash_attention", "SUPPORTED_HEAD_DIMS", "attn_fwd_kernel"]


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
    O_F32,                               # O in float32 too, laid out like O (None unless KEEP_F32_O)
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    H, GROUP, N_Q, N_K, sm_scale,        # GROUP = H / H_kv query heads per KV head (1 without GQA)
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,                # Nk % BLOCK_N == 0: no key block runs past the end
    KEEP_F32_O: tl.constexpr,            # float16 inputs that need gradients: keep O unrounded for the backward
    HUGE_SCALE: tl.constexpr = False,    # |scale| > attnlab.tiled.HUGE_SCALE: scale after the max (below)
):
    pid_m = tl.program_id(0)             # which block of BLOCK_M queries
    pid_bh = tl.program_id(1)            # which (batch, head)
    b = (pid_bh // H).to(tl.int64)       # 64-bit: b * stride_qb can pass 2**31
    h = (pid_bh % H).to(tl.int64)
    h_kv = h // GROUP                    # the KV head this query head reads (GQA), never a copy
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + rows
    row0 = pid_m.to(tl.int64) * BLOCK_M  # 64-bit: the block's first row times a stride can pass 2**31 too
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + h * stride_qh + row0 * stride_qn + rows[:, None] * stride_qn + offs_d[None, :]
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh

    # read BLOCK_M * d elements of Q, once (rows past Nq are masked off and cost nothing)
    q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)
    qk_scale = sm_scale * LOG2E          # fold log2(e) in: use exp2 below
    # s = q.k * s_scale, P = exp2((s - m) * exp_scale). A huge scale would overflow s (inf - inf = NaN):
    # there s is the raw score times the scale's sign, and the scale multiplies s - m <= 0 instead
    s_scale, exp_scale = (tl.where(sm_scale < 0, -1.0, 1.0), tl.abs(qk_scale)) if HUGE_SCALE else (qk_scale, 1.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max of s (log2 units; raw: HUGE_SCALE)
    l_i = tl.zeros([BLOCK_M], tl.float32)                # running row sum of exp2((s - m_i) * exp_scale)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)      # running unnormalised output

    if CAUSAL:
        # query rows < min((pid_m + 1) * BLOCK_M, Nq) see keys < that bound: blocks
        # entirely above the diagonal are never loaded
        hi = tl.minimum(tl.minimum((pid_m + 1) * BLOCK_M, N_Q), N_K)
    else:
        hi = N_K
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + cols
        col0 = tl.cast(start_n, tl.int64)   # 64-bit: block start times stride
        k_ptrs = k_base + col0 * stride_kn + cols[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + col0 * stride_vn + cols[:, None] * stride_vn + offs_d[None, :]
        # read BLOCK_N * d elements of K (keys past Nk masked off)
        if EVEN_N:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * s_scale   # (BLOCK_M, BLOCK_N), on chip
        # masks cost time on every element, so each is applied only to the blocks that need it
        if not EVEN_N:
            s = tl.where(offs_n[None, :] < N_K, s, float("-inf"))
        if CAUSAL:
            if start_n + BLOCK_N > pid_m * BLOCK_M + 1:  # the block crosses the diagonal
                s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        # online softmax: new max, rescale what was accumulated so far (every row sees key 0 in
        # the first block, so m_new is finite)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2((s - m_new[:, None]) * exp_scale)
        alpha = tl.math.exp2((m_i - m_new) * exp_scale)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # read BLOCK_N * d elements of V
        if EVEN_N:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    # write BLOCK_M * d elements of O
    o_offs = b * stride_ob + h * stride_oh + row0 * stride_on + rows[:, None] * stride_on + offs_d[None, :]
    tl.store(O + o_offs, o.to(O.dtype.element_ty), mask=offs_m[:, None] < N_Q)
    if KEEP_F32_O:
        # write BLOCK_M * d float32 elements more: the backward's D = rowsum(dO * O) from a float16 O
        # loses dQ at large inputs (a rounding of O is a rounding of every D_i, multiplied by K in dQ)
        tl.store(O_F32 + o_offs, o, mask=offs_m[:, None] < N_Q)
    # write BLOCK_M elements of L: log-sum-exp in natural-log units (HUGE_SCALE: divided by |scale|, in s's
    # units, so that the backward's s - L is exactly 0 at a one-hot row's max; the wrapper multiplies it back)
    lse = m_i + tl.math.log2(l_i) / exp_scale if HUGE_SCALE else (m_i + tl.math.log2(l_i)) * LN2
    if HUGE_SCALE:  # the row's other mass rounded away in m + log2(l) / exp_scale: round up, so P == 1 means one-hot
        lse = tl.where((l_i > 1.0) & (lse == m_i), m_i + tl.abs(m_i) * 1.1920928955078125e-07, lse)   # 2**-23: 1-2 ulps
    tl.store(L + b * stride_lb + h * stride_lh + offs_m, lse, mask=offs_m < N_Q)
    # per program: read (1 + 2 * visited blocks) tiles, write one O tile (two with KEEP_F32_O) and one L column.
    # per (batch, head), not causal: read Nq d + ceil(Nq / BLOCK_M) * 2 Nk d, write Nq d + Nq


attn_fwd_kernel = _attn_fwd_kernel   # a public name for lessons that show or trace it (the private name stays)


# ---------------------------------------------------------------------------------------
# Backward kernels. Their opening lines (program ids, batch and head, offsets, the loads of a
# block) repeat the forward's on purpose, as in Triton's fused-attention tutorial: each kernel
# reads on its own from top to bottom.
#
# With dlse, the gradient of the log-sum-exp output (dL_i/dS_ij = P_ij), the softmax backward
# dS = P * (dP - D) becomes dS = P * (dP - (D - dlse)): the preprocess kernel folds dlse into D,
# and the other two kernels are unchanged.
#
# HUGE_SCALE: P = exp2(min((s - L) * exp_scale, 0)) from the raw scores and L / |scale| (the forward's
# order; the cap: P <= 1, against a rounding of s above L). A recomputed P of exactly 1 marks a one-hot
# row (the forward rounds L up, off the max, wherever the row has other mass). There D_i = dP_ij and the
# exact dS_ij is 0, while the computed dP_ij - D_i is a rounding (two sums of the same products in
# different orders) that dQ and dK multiply by the scale: at 1e30 that gave entries of 1e24 where the
# exact gradient is 0. So without a gradient into the lse (ONE_HOT_ZERO) dS is 0 there; with one, D
# holds dlse too and dS is left as computed (its exact value, dlse_i, is then as large as the
# rounding's error is small).
# ---------------------------------------------------------------------------------------
@jit
def _attn_bwd_preprocess_kernel(
    O, DO, DELTA, DLSE,                  # DELTA: (B, H, Nq, 1) column, like L; DLSE: L's layout too
    stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don, stride_deltab, stride_deltah,
    H, N_Q,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr,              # the log-sum-exp output has a gradient
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + rows
    row0 = pid_m.to(tl.int64) * BLOCK_M  # 64-bit: the block's first row times a stride can pass 2**31 too
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < N_Q
    # read 2 * BLOCK_M * d elements (O, float32 for float16 inputs: the forward kept it, and dO)
    o = tl.load(O + b * stride_ob + h * stride_oh + row0 * stride_on + rows[:, None] * stride_on + offs_d[None, :], mask=row_ok, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + row0 * stride_don + rows[:, None] * stride_don + offs_d[None, :], mask=row_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij
    if HAS_DLSE:  # read BLOCK_M floats of dlse
        delta -= tl.load(DLSE + b * stride_deltab + h * stride_deltah + offs_m, mask=offs_m < N_Q, other=0.0)
    # write BLOCK_M elements
    tl.store(DELTA + b * stride_deltab + h * stride_deltah + offs_m, delta, mask=offs_m < N_Q)


@jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, L, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_lb, stride_lh,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    H_KV, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,                 # query heads per KV head: the loop over them is unrolled
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,   # Nq % BLOCK_M == 0, Nk % BLOCK_N == 0
    HUGE_SCALE: tl.constexpr = False,    # as the forward's (see above)
    ONE_HOT_ZERO: tl.constexpr = False,  # HUGE_SCALE and no gradient into the lse: dS = 0 in one-hot rows
):
    # one program per (block of BLOCK_N keys, batch x KV head); it loops over the GROUP query
    # heads that read this KV head and, for each, over query blocks: dK and dV sum over both
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    h_kv = (pid_bh % H_KV).to(tl.int64)
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    offs_n = pid_n * BLOCK_N + cols
    col0 = pid_n.to(tl.int64) * BLOCK_N  # 64-bit, as row0 in the forward
    offs_d = tl.arange(0, HEAD_DIM)
    kv_rows = offs_n[:, None] < N_K
    # read 2 * BLOCK_N * d elements (K and V), once
    k = tl.load(K + b * stride_kb + h_kv * stride_kh + col0 * stride_kn + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_rows, other=0.0)
    v = tl.load(V + b * stride_vb + h_kv * stride_vh + col0 * stride_vn + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_rows, other=0.0)
    qk_scale = sm_scale * LOG2E
    s_scale, exp_scale = (tl.where(sm_scale < 0, -1.0, 1.0), tl.abs(qk_scale)) if HUGE_SCALE else (qk_scale, 1.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    n_blocks = (N_Q + BLOCK_M - 1) // BLOCK_M
    if CAUSAL:
        first = (pid_n * BLOCK_N) // BLOCK_M   # query blocks wholly above this key block see none of it
        n_blocks = tl.where(pid_n * BLOCK_N < N_Q, n_blocks, first)  # keys past the last query: none
    else:
        first = 0

    for g in tl.static_range(GROUP):   # unrolled: one simple loop per query head (a nested loop spills)
        h = h_kv * GROUP + g                     # a query head of this KV head's group
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        l_base = L + b * stride_lb + h * stride_lh
        delta_base = DELTA + b * stride_lb + h * stride_lh   # DELTA has L's layout (asserted by the wrapper)
        for it in range(first, n_blocks):
            start_m = it * BLOCK_M
            offs_m = start_m + rows
            row0 = tl.cast(start_m, tl.int64)
            q_ptrs = q_base + row0 * stride_qn + rows[:, None] * stride_qn + offs_d[None, :]
            do_ptrs = do_base + row0 * stride_don + rows[:, None] * stride_don + offs_d[None, :]
            # read 2 * BLOCK_M * d elements (Q and dO) and 2 * BLOCK_M (L and D); rows past Nq masked off
            if EVEN_M:
                q = tl.load(q_ptrs)
                lse = tl.load(l_base + offs_m)
            else:
                q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)
                lse = tl.load(l_base + offs_m, mask=offs_m < N_Q, other=0.0)
            # recompute P^T for this tile from Q, K and L (never stored in the forward)
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * s_scale       # (BLOCK_N, BLOCK_M)
            if HUGE_SCALE:  # L is in s's units: subtract, then scale (the forward's order)
                p_t = tl.math.exp2(tl.minimum((s_t - lse[None, :]) * exp_scale, 0.0))
            else:
                p_t = tl.math.exp2(s_t - lse[None, :] * LOG2E)
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
            if ONE_HOT_ZERO:  # P == 1 in a one-hot row, whose dP - D is a rounding (see above)
                ds_t = tl.where((p_t == 1.0), 0.0, ds_t)
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)             # dK += dS^T Q
    dk = dk * sm_scale
    # write 2 * BLOCK_N * d elements (dK and dV)
    tl.store(DK + b * stride_dkb + h_kv * stride_dkh + col0 * stride_dkn + cols[:, None] * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_rows)
    tl.store(DV + b * stride_dvb + h_kv * stride_dvh + col0 * stride_dvn + cols[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_rows)


@jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, L, DELTA, DQ,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqn,
    H, GROUP, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
    HUGE_SCALE: tl.constexpr = False, ONE_HOT_ZERO: tl.constexpr = False,   # as in the dK/dV kernel
):
    # one program per (block of BLOCK_M queries, batch x head); the same key blocks as the forward
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    h_kv = h // GROUP
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + rows
    row0 = pid_m.to(tl.int64) * BLOCK_M  # 64-bit: the block's first row times a stride can pass 2**31 too
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = offs_m[:, None] < N_Q
    # read 2 * BLOCK_M * d elements (Q, dO) and 2 * BLOCK_M (L, D), once
    q = tl.load(Q + b * stride_qb + h * stride_qh + row0 * stride_qn + rows[:, None] * stride_qn + offs_d[None, :], mask=q_rows, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + row0 * stride_don + rows[:, None] * stride_don + offs_d[None, :], mask=q_rows, other=0.0)
    lse = tl.load(L + b * stride_lb + h * stride_lh + offs_m, mask=offs_m < N_Q, other=0.0)
    delta = tl.load(DELTA + b * stride_lb + h * stride_lh + offs_m, mask=offs_m < N_Q, other=0.0)
    lse2 = lse if HUGE_SCALE else lse * LOG2E                       # HUGE_SCALE: in s's units already
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    qk_scale = sm_scale * LOG2E
    s_scale, exp_scale = (tl.where(sm_scale < 0, -1.0, 1.0), tl.abs(qk_scale)) if HUGE_SCALE else (qk_scale, 1.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # the same walk over key blocks as the forward kernel: written out again on purpose, so that
    # each kernel reads on its own from top to bottom, as in Triton's fused-attention tutorial
    if CAUSAL:
        hi = tl.minimum(tl.minimum((pid_m + 1) * BLOCK_M, N_Q), N_K)
    else:
        hi = N_K
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + cols
        col0 = tl.cast(start_n, tl.int64)   # 64-bit: block start times stride
        k_ptrs = k_base + col0 * stride_kn + cols[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + col0 * stride_vn + cols[:, None] * stride_vn + offs_d[None, :]
        # read 2 * BLOCK_N * d elements (K and V); keys past Nk masked off
        if EVEN_N:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * s_scale
        if HUGE_SCALE:  # as in the dK/dV kernel
            p = tl.math.exp2(tl.minimum((s - lse2[:, None]) * exp_scale, 0.0))
        else:
            p = tl.math.exp2(s - lse2[:, None])              # recomputed P tile
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
        if ONE_HOT_ZERO:  # as in the dK/dV kernel
            ds = tl.where((p == 1.0), 0.0, ds)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)  # dQ += dS K
    dq = dq * sm_scale
    # write BLOCK_M * d elements
    tl.store(DQ + b * stride_dqb + h * stride_dqh + row0 * stride_dqn + rows[:, None] * stride_dqn + offs_d[None, :],
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


def _rows_contiguous(t):
    """The kernels take any strides but a head dim of stride 1 (one row is one vector load)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t, n=3):
    return tuple(t.stride(i) for i in range(n))


def _preprocess(o, do, dlse, n_q, H, B, d, block_m):
    """D = rowsum(dO * O) - dlse, a (B, H, Nq, 1) float32 column laid out like L (``o`` is the
    float32 O the forward kept for float16 inputs)."""
    delta = torch.empty((B, H, n_q, 1), device=o.device, dtype=torch.float32)
    if dlse is not None:
        dlse = dlse.float().contiguous().view(B, H, n_q, 1)
        assert dlse.stride() == delta.stride(), "dlse must share DELTA's layout (the kernel uses DELTA's strides)"
    _attn_bwd_preprocess_kernel[(triton.cdiv(n_q, block_m), B * H)](
        o, do, delta, dlse,
        *_strides(o), *_strides(do), delta.stride(0), delta.stride(1),
        H, n_q, HEAD_DIM=d, BLOCK_M=block_m, HAS_DLSE=dlse is not None,
    )
    return delta


def _f32_o(q, needs_grad):
    """The float32 O the forward keeps for the backward's D, or None: only for inputs narrower
    than float32 that need gradients (a float32 O is its own)."""
    if not needs_grad or q.dtype == torch.float32:
        return None
    return torch.empty(q.shape, device=q.device, dtype=torch.float32)


def _flash_forward(q, k, v, causal, scale, block_m=None, block_n=None, needs_grad=False):
    """Launch the forward kernel. Returns o (B, H, Nq, d), lse (B, H, Nq, 1) float32, and the O the
    backward reads: o itself, or a float32 copy written beside it (``needs_grad`` with float16).
    Block sizes None: chosen by :func:`_tuning.choose_config`."""
    B, H, n_q, d = q.shape
    n_k = k.shape[-2]
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    o32 = _f32_o(q, needs_grad)
    assert o32 is None or o32.stride() == o.stride(), "O_F32 must share O's layout (the kernel uses O's strides)"
    lse = torch.empty((B, H, n_q, 1), device=q.device, dtype=torch.float32)

    def run(config):
        bm, bn = config["block_m"], config["block_n"]
        _attn_fwd_kernel[(triton.cdiv(n_q, bm), B * H)](
            q, k, v, o, lse, o32,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            lse.stride(0), lse.stride(1),
            H, H // k.shape[1], n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
            CAUSAL=bool(causal), DOT_PRECISION=dot_precision(q.dtype),
            EVEN_N=n_k % bn == 0, KEEP_F32_O=o32 is not None, HUGE_SCALE=huge_scale(scale),
            **native_options(config),
        )

    launch("fwd", run, q, n_q, n_k, causal, block_m, block_n)
    return o, lse, (o if o32 is None else o32)


def _flash_backward(do, dlse, q, k, v, o, lse, causal, scale, block_m=None, block_n=None):
    """Launch the three backward kernels. Returns dq, dk, dv. Block sizes None: chosen by
    :func:`_tuning.choose_config`, separately for the dK/dV and the dQ kernel."""
    B, H, n_q, d = q.shape
    H_kv, n_k = k.shape[1], k.shape[2]
    do = _rows_contiguous(do)
    pre_m = block_m if block_m is not None else (INTERPRETER_BLOCKS[0] if use_interpreter(q.device) else 64)
    delta = _preprocess(o, do, dlse, n_q, H, B, d, pre_m)
    # the dK/dV and dQ kernels address DELTA with L's strides, so that layout is a requirement
    assert delta.stride() == lse.stride(), "DELTA must share L's layout (the kernels use L's strides for it)"
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    huge = huge_scale(scale)

    def run_dkdv(config):
        bm, bn = config["block_m"], config["block_n"]
        _attn_bwd_dkdv_kernel[(triton.cdiv(n_k, bn), B * H_kv)](
            q, k, v, do, lse, delta, dk, dv,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do),
            lse.stride(0), lse.stride(1),
            *_strides(dk), *_strides(dv),
            H_kv, n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, GROUP=H // H_kv,
            CAUSAL=bool(causal), DOT_PRECISION=dot_precision(q.dtype),
            EVEN_M=n_q % bm == 0, EVEN_N=n_k % bn == 0,
            HUGE_SCALE=huge, ONE_HOT_ZERO=huge and dlse is None,
            **native_options(config),
        )

    def run_dq(config):
        bm, bn = config["block_m"], config["block_n"]
        _attn_bwd_dq_kernel[(triton.cdiv(n_q, bm), B * H)](
            q, k, v, do, lse, delta, dq,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do),
            lse.stride(0), lse.stride(1),
            *_strides(dq),
            H, H // H_kv, n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
            CAUSAL=bool(causal), DOT_PRECISION=dot_precision(q.dtype),
            EVEN_N=n_k % bn == 0, HUGE_SCALE=huge, ONE_HOT_ZERO=huge and dlse is None,
            **native_options(config),
        )

    launch("dkdv", run_dkdv, q, n_q, n_k, causal, block_m, block_n)
    launch("dq", run_dq, q, n_q, n_k, causal, block_m, block_n)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    """Forward saves q, k, v, o and the log-sum-exp (not P); backward recomputes P block by block.
    Both outputs are differentiable (the lse's gradient folds into D)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, blocks_fwd, blocks_bwd):
        o, lse, o_saved = _flash_forward(q, k, v, causal, scale, *blocks_fwd, needs_grad=any(ctx.needs_input_grad[:3]))
        ctx.save_for_backward(q, k, v, o_saved, lse)   # o_saved: float32 for float16 inputs (D's precision)
        ctx.causal, ctx.scale, ctx.blocks_bwd = causal, scale, blocks_bwd
        ctx.set_materialize_grads(False)   # an unused lse sends None, not a tensor of zeros
        lse = lse.squeeze(-1)
        return o, (lse * abs(scale) if huge_scale(scale) else lse)   # the kernel's L is lse / |scale| there

    @staticmethod
    def backward(ctx, do, dlse):
        validate.no_double_backward("flash_attention")
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(q)
        dq, dk, dv = _flash_backward(do, dlse, q, k, v, o, lse, ctx.causal, ctx.scale, *ctx.blocks_bwd)
        return dq, dk, dv, None, None, None, None


def flash_attention(q, k, v, causal=False, scale=None, *, return_lse=False, block_m=None, block_n=None):
    """FlashAttention-2 forward (and, through autograd, backward) as Triton kernels.

    q: (B, H, Nq, d), k and v: (B, H_kv, Nk, d) with H % H_kv == 0 (grouped-query attention;
    H_kv = 1 is multi-query; equal to SDPA's ``enable_gqa=True``); d in 16, 32, 64, 128; float32
    or float16 (bfloat16 on a GPU); any strides with a contiguous last dim. Returns o (B, H, Nq, d),
    and lse (B, H, Nq) float32 (natural log, differentiable) when ``return_lse``.
    ``block_m``/``block_n`` fix the block sizes (forward and backward alike). By default the
    interpreter uses 128 x 128, and a GPU the fastest of a few configurations
    (:func:`attnlab.kernels._tuning.gpu_candidates`), timed at the first call for each shape, as
    ``@triton.autotune`` does; ``ATTNLAB_AUTOTUNE=0`` takes :func:`attnlab.kernels._tuning.gpu_config`'s
    instead. Double backward (``create_graph=True``) raises a ``RuntimeError``. With float16 inputs
    that need gradients the forward also keeps O in float32 for the backward (4 bytes per element).

    Example: ``o = flash_attention(q, k, v, causal=True)``
    """
    scale = validate.kernel_qkv(q, k, v, scale, causal, interpreted=use_interpreter, gqa=True)  # 1/sqrt(d) for None
    validate.flag(return_lse, "return_lse")
    blocks = _explicit_blocks(q, block_m, block_n)   # (None, None): chosen at launch, per kernel
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    o, lse = _FlashAttention.apply(q, k, v, causal, scale, blocks, blocks)  # forward and backward blocks
    return (o, lse) if return_lse else o
