"""Selected-block attention: each query block attends only to the key blocks a selector chose.

What you learn here (the attention of Native Sparse Attention's selection branch, Yuan et al.
2025, arXiv:2502.11089, and of DeepSeek Sparse Attention, DeepSeek-V3.2, arXiv:2512.02556):

* a cheap scorer (the "lightning indexer", :func:`attnlab.sparse.indexer_block_scores`) ranks
  the key blocks for every block of queries, :func:`attnlab.sparse.select_blocks` keeps the
  ``topk`` best, and attention runs over those blocks only: per query about ``topk *
  block_size`` keys instead of N, O(N k) work and traffic instead of O(N^2);
* the selection arrives as ``block_indices`` (B, H_kv, n_q_blocks, topk) int32, ``-1`` for an
  unused slot. It is per *KV head*: the query heads of a GQA group share one selection, as NSA
  shares it across a group, so each K/V block a group reads serves all its heads (DSA, with
  MLA in its MQA form, has one KV head: H_kv = 1);
* the kernels below are a copy of ``flash_attention.py``'s, with every change marked ``# NEW``:
  instead of ``for start_n in range(0, hi, BLOCK_N)``, each query block reads how many key blocks
  it selected and their ids, and loads only those. A block that was not selected is never
  loaded: its cost in time *and* traffic is zero;
* causality is kept element by element on the diagonal block only, exactly as in
  ``flash_attention.py``: a selected block wholly in the future holds no key any query of the
  block may see, so the wrapper drops it from the lists before launch (it is never read);
* a query row that sees no key outputs zeros, log-sum-exp -inf, and gets zero gradient (as in
  ``block_sparse_attention.py``, whose NaN guards these kernels copy);
* the backward's dK/dV kernel loops over *query* blocks for each key block, so it needs the lists
  the other way round: for each key block, the query blocks that selected it. They are built on
  the host with a stable sort (:func:`_transposed_lists`), O(N k) memory like the selection, never
  an N x N table.

Duplicated ids in a row of ``block_indices`` are refused (``ValueError``): a block attended twice
would count its keys twice in the softmax, and no selector means that.

The naive version is dense attention under the element mask the selection implies
(:func:`attnlab.sparse.selected_attention_reference`, which is ``attnlab.attention``'s reference
with :func:`attnlab.sparse.selected_mask`). Per (batch, head), with N queries and keys:

    s = q @ k.transpose(-2, -1) * scale     # read 2 N d;       write N^2    (every pair scored)
    s = s.masked_fill(~mask, -inf)          # read N^2 + N^2 mask bytes;  write N^2
    p = softmax(s)                          # read N^2;         write N^2
    o = p @ v                               # read N^2 + N d;   write N d
    # about 6 N^2 elements, whatever topk is: the selection saves nothing

The kernel, per (batch, query head) with ``kk`` selected blocks of ``bs`` keys per query block::

    read  N d (Q) + (N / bs) * kk * 2 bs d (K, V of the selected blocks)  =  N d + 2 N kk d
          + 4 bytes per query block (the count) + 4 bytes per selected block (its id)
    write N d (O) + N (L, float32)

so the traffic falls linearly with ``topk``; ``attnlab.iomodel.selected_attention_forward_io``
gives the exact count for given ``block_indices`` (what ``attnlab.memory.trace`` measures). The
ids are loaded from a tensor and added to a pointer, an ordinary load, so these kernels run in
Triton's CPU interpreter too.
"""

import torch
import triton
import triton.language as tl

from attnlab import validate
from attnlab.sparse import check_block_indices, n_blocks
from attnlab.tiled import huge_scale

from ._runtime import dot_precision, jit, use_interpreter
from ._tuning import launch, native_options
from .flash_attention import LN2, LOG2E, _f32_o, _preprocess, _rows_contiguous, _strides

__all__ = ["selected_attention"]


# ---------------------------------------------------------------------------------------
# Forward kernel: flash_attention.py's, walking the selected blocks
# ---------------------------------------------------------------------------------------
@jit
def _sel_fwd_kernel(
    Q, K, V, O, L,
    O_F32,                               # O in float32 too, laid out like O (None unless KEEP_F32_O)
    KV_NUM, KV_IDX,                      # NEW: (B, H_kv, nqb) counts and (B, H_kv, nqb, kk) key-block ids
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxq,   # NEW: 0 where the selection broadcasts
    H, GROUP, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,   # NEW: BLOCK_M == BLOCK_N
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
    KEEP_F32_O: tl.constexpr,            # float16 inputs that need gradients: keep O unrounded for the backward
    HUGE_SCALE: tl.constexpr = False,    # |scale| > attnlab.tiled.HUGE_SCALE: scale after the max (below)
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    h_kv = h // GROUP
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + rows
    row0 = pid_m.to(tl.int64) * BLOCK_M  # 64-bit: the block's first row times a stride can pass 2**31 too
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = Q + b * stride_qb + h * stride_qh + row0 * stride_qn + rows[:, None] * stride_qn + offs_d[None, :]
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    # NEW: where this query block's list starts (the KV head's: the GQA group shares it)
    num_off = b * stride_numb + h_kv * stride_numh + pid_m
    idx_off = b * stride_idxb + h_kv * stride_idxh + pid_m * stride_idxq

    # read BLOCK_M * d elements of Q, once
    q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)
    qk_scale = sm_scale * LOG2E
    # s = q.k * s_scale, P = exp2((s - m) * exp_scale). A huge scale would overflow s (inf - inf = NaN):
    # there s is the raw score times the scale's sign, and the scale multiplies s - m <= 0 instead
    s_scale, exp_scale = (tl.where(sm_scale < 0, -1.0, 1.0), tl.abs(qk_scale)) if HUGE_SCALE else (qk_scale, 1.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    n_sel = tl.load(KV_NUM + num_off)                                # NEW: read 1 int: how many blocks
    for it in range(0, n_sel):
        kv_block = tl.load(KV_IDX + idx_off + it)                    # NEW: read 1 int, the block's id
        start_n = kv_block * BLOCK_N                                 # NEW
        offs_n = start_n + cols
        col0 = tl.cast(start_n, tl.int64)   # 64-bit: block start times stride
        k_ptrs = k_base + col0 * stride_kn + cols[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + col0 * stride_vn + cols[:, None] * stride_vn + offs_d[None, :]
        # read BLOCK_N * d elements of K
        if EVEN_N:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * s_scale
        if not EVEN_N:
            s = tl.where(offs_n[None, :] < N_K, s, float("-inf"))
        if CAUSAL:
            if start_n + BLOCK_N > pid_m * BLOCK_M + 1:  # the block crosses the diagonal
                s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # NEW: a row may have seen no key yet (m_new = -inf): subtract 0, not -inf, to avoid NaN
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2((s - m_new_safe[:, None]) * exp_scale)
        alpha = tl.math.exp2((m_i - m_new_safe) * exp_scale)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # read BLOCK_N * d elements of V
        if EVEN_N:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)                          # NEW: a row that saw no key outputs 0
    o = acc / l_safe[:, None]
    # write BLOCK_M * d elements of O
    o_offs = b * stride_ob + h * stride_oh + row0 * stride_on + rows[:, None] * stride_on + offs_d[None, :]
    tl.store(O + o_offs, o.to(O.dtype.element_ty), mask=offs_m[:, None] < N_Q)
    if KEEP_F32_O:
        # write BLOCK_M * d float32 elements more: the backward's D = rowsum(dO * O) from a float16 O
        # loses dQ at large inputs (a rounding of O is a rounding of every D_i, multiplied by K in dQ)
        tl.store(O_F32 + o_offs, o, mask=offs_m[:, None] < N_Q)
    # write BLOCK_M elements of L (NEW: -inf for a row that saw no key; HUGE_SCALE: lse / |scale|, as flash's)
    lse = m_i + tl.math.log2(l_safe) / exp_scale if HUGE_SCALE else (m_i + tl.math.log2(l_safe)) * LN2
    if HUGE_SCALE:  # the row's other mass rounded away: round up, so that P == 1 means one-hot (flash_attention.py)
        lse = tl.where((l_i > 1.0) & (lse == m_i), m_i + tl.abs(m_i) * 1.1920928955078125e-07, lse)
    lse = tl.where(l_i == 0.0, float("-inf"), lse)
    tl.store(L + b * stride_lb + h * stride_lh + offs_m, lse, mask=offs_m < N_Q)
    # per program: read 1 Q tile, 2 tiles (K, V) per selected block and 1 + n_sel ints of the
    # list; write one O tile (two with KEEP_F32_O) and one L column


# ---------------------------------------------------------------------------------------
# Backward kernels (the preprocess kernel, D = rowsum(dO * O) - dlse, is flash_attention.py's)
# ---------------------------------------------------------------------------------------
@jit
def _sel_bwd_dkdv_kernel(
    Q, K, V, DO, L, DELTA, DK, DV,
    Q_NUM, Q_IDX,                        # NEW: (B, H_kv, nkb) and (B, H_kv, nkb, w): the query blocks that chose it
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_lb, stride_lh,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxk,   # NEW
    H_KV, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,                 # query heads per KV head: the loop over them is unrolled
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    HUGE_SCALE: tl.constexpr = False,    # as flash_attention.py's backward
    ONE_HOT_ZERO: tl.constexpr = False,  # HUGE_SCALE and no gradient into the lse: dS = 0 in one-hot rows
):
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
    # NEW: this key block's list, one for the KV head (its query heads share the selection)
    idx_off = b * stride_idxb + h_kv * stride_idxh + pid_n * stride_idxk
    n_sel = tl.load(Q_NUM + b * stride_numb + h_kv * stride_numh + pid_n)   # NEW: read 1 int, once

    for g in tl.static_range(GROUP):   # unrolled: one simple loop per query head (a nested loop spills)
        h = h_kv * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        l_base = L + b * stride_lb + h * stride_lh
        delta_base = DELTA + b * stride_lb + h * stride_lh
        for it in range(0, n_sel):
            q_block = tl.load(Q_IDX + idx_off + it)                  # NEW: read 1 int
            start_m = q_block * BLOCK_M                              # NEW
            offs_m = start_m + rows
            row0 = tl.cast(start_m, tl.int64)
            q_ptrs = q_base + row0 * stride_qn + rows[:, None] * stride_qn + offs_d[None, :]
            do_ptrs = do_base + row0 * stride_don + rows[:, None] * stride_don + offs_d[None, :]
            # read 2 * BLOCK_M * d elements (Q and dO) and 2 * BLOCK_M (L and D)
            if EVEN_M:
                q = tl.load(q_ptrs)
                lse = tl.load(l_base + offs_m)
            else:
                q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)
                lse = tl.load(l_base + offs_m, mask=offs_m < N_Q, other=0.0)
            lse2 = lse if HUGE_SCALE else lse * LOG2E                  # HUGE_SCALE: in s's units already
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse2)  # NEW: a row that saw no key: P = 0
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * s_scale
            if HUGE_SCALE:  # subtract, then scale (the forward's order); P <= 1 against a rounding
                p_t = tl.math.exp2(tl.minimum((s_t - lse2[None, :]) * exp_scale, 0.0))
            else:
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
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            if EVEN_M:
                delta = tl.load(delta_base + offs_m)
            else:
                delta = tl.load(delta_base + offs_m, mask=offs_m < N_Q, other=0.0)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            if ONE_HOT_ZERO:  # P == 1 in a one-hot row, whose dP - D is a rounding (flash_attention.py)
                ds_t = tl.where((p_t == 1.0), 0.0, ds_t)
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    dk = dk * sm_scale
    # write 2 * BLOCK_N * d elements (dK and dV)
    tl.store(DK + b * stride_dkb + h_kv * stride_dkh + col0 * stride_dkn + cols[:, None] * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_rows)
    tl.store(DV + b * stride_dvb + h_kv * stride_dvh + col0 * stride_dvn + cols[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_rows)


@jit
def _sel_bwd_dq_kernel(
    Q, K, V, DO, L, DELTA, DQ,
    KV_NUM, KV_IDX,                      # NEW: the forward's lists
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqn,
    stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxq,   # NEW
    H, GROUP, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
    HUGE_SCALE: tl.constexpr = False, ONE_HOT_ZERO: tl.constexpr = False,   # as in the dK/dV kernel
):
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
    lse2 = lse if HUGE_SCALE else lse * LOG2E                        # HUGE_SCALE: in s's units already
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse2)       # NEW: a row that saw no key: P = 0
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    qk_scale = sm_scale * LOG2E
    s_scale, exp_scale = (tl.where(sm_scale < 0, -1.0, 1.0), tl.abs(qk_scale)) if HUGE_SCALE else (qk_scale, 1.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    num_off = b * stride_numb + h_kv * stride_numh + pid_m          # NEW
    idx_off = b * stride_idxb + h_kv * stride_idxh + pid_m * stride_idxq

    # the same walk over the selected blocks as the forward kernel, written out again on purpose
    n_sel = tl.load(KV_NUM + num_off)                                # NEW
    for it in range(0, n_sel):
        kv_block = tl.load(KV_IDX + idx_off + it)                    # NEW
        start_n = kv_block * BLOCK_N
        offs_n = start_n + cols
        col0 = tl.cast(start_n, tl.int64)   # 64-bit: block start times stride
        k_ptrs = k_base + col0 * stride_kn + cols[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = v_base + col0 * stride_vn + cols[:, None] * stride_vn + offs_d[None, :]
        # read 2 * BLOCK_N * d elements (K and V)
        if EVEN_N:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * s_scale
        if HUGE_SCALE:  # as in the dK/dV kernel
            p = tl.math.exp2(tl.minimum((s - lse2[:, None]) * exp_scale, 0.0))
        else:
            p = tl.math.exp2(s - lse2[:, None])
        if not EVEN_N:
            p = tl.where(offs_n[None, :] < N_K, p, 0.0)
        if CAUSAL:
            if start_n + BLOCK_N > pid_m * BLOCK_M + 1:      # the tile crosses the diagonal
                p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        if EVEN_N:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_n[:, None] < N_K, other=0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if ONE_HOT_ZERO:  # as in the dK/dV kernel
            ds = tl.where((p == 1.0), 0.0, ds)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    dq = dq * sm_scale
    # write BLOCK_M * d elements
    tl.store(DQ + b * stride_dqb + h * stride_dqh + row0 * stride_dqn + rows[:, None] * stride_dqn + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_rows)


# ---------------------------------------------------------------------------------------
# The lists the kernels walk, built on the host with torch ops
# ---------------------------------------------------------------------------------------
def _forward_lists(block_indices, n_kb, causal):
    """For each query block, how many key blocks it attends to and which, ascending.

    block_indices: (B', H', nqb, kk) int32, checked. Returns kv_num (B', H', nqb) int32 and
    kv_idx (B', H', nqb, max(kk, 1)) int32, the ids first and -1 after them. Under ``causal`` a
    key block after the query block (id > query block: every key of it is after every query of
    it) is dropped: it would be read for nothing.
    """
    ids = block_indices.long()                                            # (B', H', nqb, kk)
    if causal:
        q_block = torch.arange(ids.shape[-2], device=ids.device)[:, None]  # (nqb, 1)
        ids = torch.where(ids > q_block, -1, ids)
    ids = torch.where(ids < 0, n_kb, ids).sort(dim=-1).values            # unused slots sort last
    kv_num = (ids < n_kb).sum(-1).to(torch.int32)                         # (B', H', nqb)
    kv_idx = torch.where(ids < n_kb, ids, -1).to(torch.int32)             # (B', H', nqb, kk)
    if kv_idx.shape[-1] == 0:   # no slot at all: one unused one, so the kernels get a real pointer
        kv_idx = torch.full((*kv_idx.shape[:-1], 1), -1, dtype=torch.int32, device=kv_idx.device)
    return kv_num.contiguous(), kv_idx.contiguous()


def _transposed_lists(kv_idx, n_kb):
    """For each key block, how many query blocks selected it and which, ascending: the lists the
    dK/dV kernel walks, from the forward's ``kv_idx`` (B', H', nqb, kk), -1 for unused.

    A stable sort of the (query block, slot) entries by key block groups them by key block with
    the query blocks still ascending; an entry's place in its group is its rank minus where the
    group starts. Memory O(nqb * kk), as the selection (never an nqb x nkb table). Returns q_num
    (B', H', nkb) int32 and q_idx (B', H', nkb, w) int32, w the most query blocks any key block has
    (at least 1), -1 after each list.
    """
    Bp, Hp, nqb, kk = kv_idx.shape
    dev = kv_idx.device
    key = kv_idx.reshape(Bp, Hp, nqb * kk).long()                          # (B', H', P) key block per entry
    key = torch.where(key < 0, n_kb, key)                                  # unused: an extra group n_kb
    q_of = torch.arange(nqb, device=dev).repeat_interleave(kk)              # (P,) query block per entry
    key_sorted, order = torch.sort(key, dim=-1, stable=True)               # (B', H', P) grouped by key block
    q_sorted = q_of[order]                                                 # (B', H', P) ascending within a group
    counts = torch.zeros(Bp, Hp, n_kb + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(-1, key, torch.ones_like(key))                     # (B', H', nkb + 1) group sizes
    start = counts.cumsum(-1) - counts                                     # where each group starts
    pos = torch.arange(nqb * kk, device=dev) - start.gather(-1, key_sorted)  # place in the group
    width = max(1, int(counts[..., :n_kb].max()))
    used = key_sorted < n_kb
    q_idx = torch.full((Bp, Hp, (n_kb + 1) * width), -1, dtype=torch.long, device=dev)
    q_idx.scatter_(-1, torch.where(used, key_sorted * width + pos, n_kb * width), torch.where(used, q_sorted, -1))
    q_idx = q_idx.view(Bp, Hp, n_kb + 1, width)[:, :, :n_kb]
    return counts[..., :n_kb].to(torch.int32).contiguous(), q_idx.to(torch.int32).contiguous()


def _launch_lists(num, idx, B, H_kv):
    """The lists expanded to (B, H_kv, ...) as stride-0 views (never copied), and their strides."""
    num = num.expand(B, H_kv, num.shape[-1])
    idx = idx.expand(B, H_kv, *idx.shape[-2:])
    return (num, idx), (num.stride(0), num.stride(1), idx.stride(0), idx.stride(1), idx.stride(2))


# ---------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------
def _sel_forward(q, k, v, kv_lists, block_size, causal, scale, needs_grad=False):
    B, H, n_q, d = q.shape
    H_kv, n_k = k.shape[1], k.shape[2]
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    o32 = _f32_o(q, needs_grad)    # the O the backward reads: float32 for float16 inputs (flash_attention.py)
    assert o32 is None or o32.stride() == o.stride(), "O_F32 must share O's layout (the kernel uses O's strides)"
    lse = torch.empty((B, H, n_q, 1), device=q.device, dtype=torch.float32)
    lists, sl = _launch_lists(*kv_lists, B, H_kv)

    def run(config):
        _sel_fwd_kernel[(triton.cdiv(n_q, block_size), B * H)](
            q, k, v, o, lse, o32, *lists,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            lse.stride(0), lse.stride(1), *sl,
            H, H // H_kv, n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=block_size, BLOCK_N=block_size,
            CAUSAL=causal, DOT_PRECISION=dot_precision(q.dtype),
            EVEN_N=n_k % block_size == 0, KEEP_F32_O=o32 is not None, HUGE_SCALE=huge_scale(scale),
            **native_options(config),
        )

    launch("fwd", run, q, n_q, n_k, causal, block_size, block_size)
    return o, lse, (o if o32 is None else o32)


def _sel_backward(do, dlse, q, k, v, o, lse, kv_lists, block_size, causal, scale):
    B, H, n_q, d = q.shape
    H_kv, n_k = k.shape[1], k.shape[2]
    do = _rows_contiguous(do)
    delta = _preprocess(o, do, dlse, n_q, H, B, d, block_size)
    assert delta.stride() == lse.stride(), "DELTA must share L's layout (the kernels use L's strides for it)"
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    q_lists, sq = _launch_lists(*_transposed_lists(kv_lists[1], triton.cdiv(n_k, block_size)), B, H_kv)
    kv_lists, skv = _launch_lists(*kv_lists, B, H_kv)
    huge = huge_scale(scale)

    def run_dkdv(config):
        _sel_bwd_dkdv_kernel[(triton.cdiv(n_k, block_size), B * H_kv)](
            q, k, v, do, lse, delta, dk, dv, *q_lists,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do),
            lse.stride(0), lse.stride(1), *_strides(dk), *_strides(dv), *sq,
            H_kv, n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=block_size, BLOCK_N=block_size, GROUP=H // H_kv,
            CAUSAL=causal, DOT_PRECISION=dot_precision(q.dtype),
            EVEN_M=n_q % block_size == 0, EVEN_N=n_k % block_size == 0,
            HUGE_SCALE=huge, ONE_HOT_ZERO=huge and dlse is None,
            **native_options(config),
        )

    def run_dq(config):
        _sel_bwd_dq_kernel[(triton.cdiv(n_q, block_size), B * H)](
            q, k, v, do, lse, delta, dq, *kv_lists,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do),
            lse.stride(0), lse.stride(1), *_strides(dq), *skv,
            H, H // H_kv, n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=block_size, BLOCK_N=block_size,
            CAUSAL=causal, DOT_PRECISION=dot_precision(q.dtype),
            EVEN_N=n_k % block_size == 0, HUGE_SCALE=huge, ONE_HOT_ZERO=huge and dlse is None,
            **native_options(config),
        )

    launch("dkdv", run_dkdv, q, n_q, n_k, causal, block_size, block_size)
    launch("dq", run_dq, q, n_q, n_k, causal, block_size, block_size)
    return dq, dk, dv


class _SelectedAttention(torch.autograd.Function):
    """Forward saves q, k, v, o and the log-sum-exp; backward builds the transposed lists and
    runs the dK/dV and dQ kernels."""

    @staticmethod
    def forward(ctx, q, k, v, kv_lists, block_size, causal, scale):
        o, lse, o_saved = _sel_forward(q, k, v, kv_lists, block_size, causal, scale,
                                       needs_grad=any(ctx.needs_input_grad[:3]))
        ctx.save_for_backward(q, k, v, o_saved, lse)   # o_saved: float32 for float16 inputs (D's precision)
        ctx.kv_lists, ctx.block_size, ctx.causal, ctx.scale = kv_lists, block_size, causal, scale
        ctx.set_materialize_grads(False)
        lse = lse.squeeze(-1)
        return o, (lse * abs(scale) if huge_scale(scale) else lse)   # the kernel's L is lse / |scale| there

    @staticmethod
    def backward(ctx, do, dlse):
        validate.no_double_backward("selected_attention")
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(q)
        dq, dk, dv = _sel_backward(do, dlse, q, k, v, o, lse, ctx.kv_lists, ctx.block_size, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None, None


def selected_attention(q, k, v, block_indices, *, block_size, causal=True, scale=None, return_lse=False):
    """Attention of each query block over the key blocks it selected only, exact on them; differentiable.

    q: (B, H, N, d), k and v: (B, H_kv, N_k, d) with H % H_kv == 0 (grouped-query attention), d in
    16, 32, 64, 128; float32 or float16 (bfloat16 on a GPU). block_indices: int32
    (B or 1, H_kv or 1, ceil(N / block_size), kk): for each KV head and block of ``block_size``
    queries, the ids of the key blocks (``block_size`` keys each) its queries attend to; -1 marks
    an unused slot, order does not matter, a repeated id is a ``ValueError``. The query heads of
    a KV head share its selection. ``causal`` (default True, as the selectors are) also masks
    key j > query i (top-left, as everywhere in attnlab); a selected block wholly after its query
    block is then skipped. block_size: a power of two >= 16. A query row that sees no key outputs
    zeros (lse -inf, zero gradient). Returns o (B, H, N, d), and lse (B, H, N) float32
    (differentiable) with ``return_lse``. Equal to
    :func:`attnlab.sparse.selected_attention_reference`. Double backward raises.

    Example: ``o = selected_attention(q, k, v, select_blocks(indexer_block_scores(qi, ki, block_size=64), 4)[:, None], block_size=64)``
    """
    scale = validate.kernel_qkv(q, k, v, scale, causal, interpreted=use_interpreter, gqa=True)  # 1/sqrt(d) for None
    validate.flag(return_lse, "return_lse")
    B, H, n_q, d = q.shape
    H_kv, n_k = k.shape[1], k.shape[2]
    block_size = check_block_indices(block_indices, block_size, n_q, n_k, batch=B, kv_heads=H_kv, device=q.device)
    kv_lists = _forward_lists(block_indices, n_blocks(n_k, block_size), causal)
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    o, lse = _SelectedAttention.apply(q, k, v, kv_lists, block_size, causal, scale)
    return (o, lse) if return_lse else o
