"""Block-sparse FlashAttention: the FlashAttention kernels, walking a BlockMask's lists.

What you learn here (PyTorch FlexAttention's kernel design, Dong et al. 2024):

* the kernels below are a copy of ``flash_attention.py``'s, with every change marked ``# NEW``:
  instead of ``for start_n in range(0, hi, BLOCK_N)``, each query block reads how many key
  blocks it visits and their indices, from a :class:`~attnlab.kernels.block_mask.BlockMask`
  made by ``create_block_mask``. A tile left out of the lists is never loaded and never
  computed: its cost in time *and* in memory traffic is zero (compare a dense kernel that
  masks the tile with ``-inf``: it still loads K and V);
* there are two lists: **full** blocks, computed with no element mask at all (the causal
  diagonal test is gone too: causality is part of the mask), and **partial** blocks, masked
  element by element with the block's mask tile read from memory (``block_m * block_n`` int8
  values, written once by ``create_block_mask``; ``block_mask.py`` says why a tile and not the
  mask_mod compiled into the kernel);
* a query row that sees no key at all outputs zeros (and log-sum-exp -inf, gradient zero);
* the backward pass needs the lists the other way round: for each key block, the query blocks
  that see it (``q_indices``, ``full_q_indices``), because the dK/dV kernel loops over query
  blocks;
* the traffic therefore scales with the density: per (batch, head), about
  ``Nq d + visited tiles * 2 block_n d`` elements read for the forward, plus
  ``block_m * block_n`` bytes per partial tile (``attnlab.iomodel.block_sparse_forward_io``
  gives the exact count for a given mask).

The naive version is dense attention under the element mask (``BlockMask.to_element_mask()``
with ``attnlab.attention``'s reference): it does all the work and throws most away. Loading an
integer index from a tensor and adding it to a pointer is an ordinary load, so these kernels
run in Triton's CPU interpreter too (which cannot load *pointers* from tensors).
"""

import math

import torch
import triton
import triton.language as tl

from attnlab import validate
from attnlab.tiled import huge_scale

from ._runtime import dot_precision, jit, use_interpreter
from ._tuning import launch, native_options
from .block_mask import BlockMask, _check_block_size
from .flash_attention import LN2, LOG2E, _f32_o, _preprocess, _rows_contiguous, _strides

__all__ = ["block_sparse_attention", "prepare_block_mask", "bsa_fwd_kernel"]


# ---------------------------------------------------------------------------------------
# Forward kernel: flash_attention.py's, walking the lists
# ---------------------------------------------------------------------------------------
@jit
def _bsa_fwd_kernel(
    Q, K, V, O, L,
    O_F32,                               # O in float32 too, laid out like O (None unless KEEP_F32_O)
    KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX,   # NEW: (B, H, nqb) counts and (B, H, nqb, nkb) indices
    TILE_IDS, TILES,                     # NEW: (B, H, nqb, nkb) int32 tile of each partial block; (T, BM, BN) int8
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxq,   # NEW: 0 where the mask broadcasts
    stride_tb, stride_th, stride_tq,     # NEW: TILE_IDS
    H, GROUP, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,         # NEW: no CAUSAL: causality is part of the mask
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
    # NEW: where this query block's lists start
    num_off = b * stride_numb + h * stride_numh + pid_m
    idx_off = b * stride_idxb + h * stride_idxh + pid_m * stride_idxq
    tile_row = TILE_IDS + b * stride_tb + h * stride_th + pid_m * stride_tq
    tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]   # NEW: in a tile

    # read BLOCK_M * d elements of Q, once
    q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)
    qk_scale = sm_scale * LOG2E
    # s = q.k * s_scale, P = exp2((s - m) * exp_scale). A huge scale would overflow s (inf - inf = NaN):
    # there s is the raw score times the scale's sign, and the scale multiplies s - m <= 0 instead
    s_scale, exp_scale = (tl.where(sm_scale < 0, -1.0, 1.0), tl.abs(qk_scale)) if HUGE_SCALE else (qk_scale, 1.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # NEW: first the full blocks, then the partial ones (read 1 int each: how many)
    n_full = tl.load(FULL_KV_NUM + num_off)
    n_partial = tl.load(KV_NUM + num_off)
    for it in range(0, n_full + n_partial):
        is_full = it < n_full                                        # NEW
        if is_full:                                                  # NEW: read 1 int, the block's index
            kv_block = tl.load(FULL_KV_IDX + idx_off + it)
        else:
            kv_block = tl.load(KV_IDX + idx_off + (it - n_full))
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
        if not EVEN_N:   # (a mask made from a tile pattern may keep a ragged last block as full)
            s = tl.where(offs_n[None, :] < N_K, s, float("-inf"))
        if not is_full:  # NEW: a partial block: read its BLOCK_M * BLOCK_N int8 mask tile (and 1 int, its id)
            tile = tl.load(TILES + tl.load(tile_row + kv_block).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offs)
            s = tl.where(tile != 0, s, float("-inf"))
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
    # per program: read 1 Q tile, 2 tiles (K, V) per visited block, a mask tile per partial
    # block and 2 + visited ints of lists; write one O tile (two with KEEP_F32_O) and one L column


bsa_fwd_kernel = _bsa_fwd_kernel   # a public name for lessons that show or trace it (the private name stays)


# ---------------------------------------------------------------------------------------
# Backward kernels (the preprocess kernel, D = rowsum(dO * O) - dlse, is flash_attention.py's)
# ---------------------------------------------------------------------------------------
@jit
def _bsa_bwd_dkdv_kernel(
    Q, K, V, DO, L, DELTA, DK, DV,
    Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX,   # NEW: for each key block, the query blocks that see it
    TILE_IDS, TILES,                     # NEW
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_lb, stride_lh,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxk,   # NEW
    stride_tb, stride_th, stride_tq,     # NEW: TILE_IDS (its key-block stride is 1)
    H_KV, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,                 # query heads per KV head: the loop over them is unrolled
    DOT_PRECISION: tl.constexpr,
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
    tile_offs_t = tl.arange(0, BLOCK_N)[:, None] + tl.arange(0, BLOCK_M)[None, :] * BLOCK_N   # NEW: a tile, transposed

    for g in tl.static_range(GROUP):   # unrolled: one simple loop per query head (a nested loop spills)
        h = h_kv * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        l_base = L + b * stride_lb + h * stride_lh
        delta_base = DELTA + b * stride_lb + h * stride_lh
        # NEW: this key block's lists for query head h
        num_off = b * stride_numb + h * stride_numh + pid_n
        idx_off = b * stride_idxb + h * stride_idxh + pid_n * stride_idxk
        n_full = tl.load(FULL_Q_NUM + num_off)
        n_partial = tl.load(Q_NUM + num_off)
        for it in range(0, n_full + n_partial):
            is_full = it < n_full                                    # NEW
            if is_full:
                q_block = tl.load(FULL_Q_IDX + idx_off + it)         # NEW: read 1 int
            else:
                q_block = tl.load(Q_IDX + idx_off + (it - n_full))
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
            if not is_full:  # NEW: read the partial block's mask tile, transposed
                tile_id = tl.load(TILE_IDS + b * stride_tb + h * stride_th + q_block * stride_tq + pid_n)
                tile = tl.load(TILES + tile_id.to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offs_t)
                p_t = tl.where(tile != 0, p_t, 0.0)
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
def _bsa_bwd_dq_kernel(
    Q, K, V, DO, L, DELTA, DQ,
    KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX,   # NEW
    TILE_IDS, TILES,                     # NEW
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqn,
    stride_numb, stride_numh, stride_idxb, stride_idxh, stride_idxq,   # NEW
    stride_tb, stride_th, stride_tq,     # NEW
    H, GROUP, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
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
    num_off = b * stride_numb + h * stride_numh + pid_m             # NEW
    idx_off = b * stride_idxb + h * stride_idxh + pid_m * stride_idxq
    tile_row = TILE_IDS + b * stride_tb + h * stride_th + pid_m * stride_tq
    tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]

    # the same walk over the lists as the forward kernel, written out again on purpose
    n_full = tl.load(FULL_KV_NUM + num_off)                         # NEW
    n_partial = tl.load(KV_NUM + num_off)
    for it in range(0, n_full + n_partial):
        is_full = it < n_full                                        # NEW
        if is_full:
            kv_block = tl.load(FULL_KV_IDX + idx_off + it)
        else:
            kv_block = tl.load(KV_IDX + idx_off + (it - n_full))
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
        if not is_full:  # NEW: the partial block's mask tile
            tile = tl.load(TILES + tl.load(tile_row + kv_block).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offs)
            p = tl.where(tile != 0, p, 0.0)
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
# Wrappers
# ---------------------------------------------------------------------------------------
def prepare_block_mask(block_mask, block_size, n_q, n_k, batch, heads, causal=False, device="cpu"):
    """Check ``block_mask`` against the shapes; return the BlockMask the kernels walk, on ``device``.

    block_mask: a :class:`BlockMask`, or a bool tile tensor (B or 1, H or 1, nqb, nkb) with
    ``block_size`` (default (64, 64)). ``causal``: the mask AND causal (made once, kept by the mask).
    A mask made for other lengths is refused (``ValueError`` naming ``block_mask``).
    """
    if isinstance(block_mask, BlockMask):
        if block_size is not None and _check_block_size(block_size) != block_mask.block_size:
            raise ValueError(f"block_size: expected {block_mask.block_size} (the block_mask's block_size), "
                             f"got {tuple(block_size)}")
        bm = block_mask
    elif isinstance(block_mask, torch.Tensor):
        if block_mask.dtype != torch.bool:
            raise TypeError(f"block_mask: expected a BlockMask or a bool tensor, got a tensor of dtype {block_mask.dtype}")
        bm = BlockMask(block_mask, _check_block_size((64, 64) if block_size is None else block_size))
    else:
        raise TypeError(f"block_mask: expected a BlockMask or a bool tensor, got {type(block_mask).__name__}")
    bq, bk = bm.block_size
    want = (math.ceil(n_q / bq), math.ceil(n_k / bk))
    b, h = bm.shape[:2]
    if bm.num_blocks != want or b not in (1, batch) or h not in (1, heads):
        raise ValueError(
            f"block_mask: expected shape ({batch} or 1, {heads} or 1, {want[0]}, {want[1]}) for q with {n_q} positions, "
            f"k with {n_k}, batch {batch}, heads {heads} and block_size {bm.block_size}, got {bm.shape}"
        )
    bm.check_lengths(n_q, n_k)
    if causal:
        bm = bm.and_causal(n_q, n_k)
    return bm.to(device)


def _lists(bm, B, H, transposed=False):
    """The four lists (expanded to (B, H, ...) as stride-0 views: never copied), their strides,
    and TILE_IDS' strides."""
    names = (("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices") if transposed else
             ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"))
    num, idx, fnum, fidx = (getattr(bm, n) for n in names)
    num, fnum = (t.expand(B, H, t.shape[-1]) for t in (num, fnum))
    idx, fidx = (t.expand(B, H, *t.shape[-2:]) for t in (idx, fidx))
    assert num.stride() == fnum.stride() and idx.stride() == fidx.stride(), "one layout for partial and full lists"
    tid = bm.tile_ids.expand(B, H, *bm.tile_ids.shape[-2:])
    strides = (num.stride(0), num.stride(1), idx.stride(0), idx.stride(1), idx.stride(2))
    return (num, idx, fnum, fidx), strides, (tid, bm.mask_tiles), _strides(tid)


def _bsa_forward(q, k, v, bm, scale, needs_grad=False):
    B, H, n_q, d = q.shape
    n_k = k.shape[-2]
    block_m, block_n = bm.block_size
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    o32 = _f32_o(q, needs_grad)    # the O the backward reads: float32 for float16 inputs (flash_attention.py)
    assert o32 is None or o32.stride() == o.stride(), "O_F32 must share O's layout (the kernel uses O's strides)"
    lse = torch.empty((B, H, n_q, 1), device=q.device, dtype=torch.float32)
    lists, sl, tiles, st = _lists(bm, B, H)

    def run(config):
        _bsa_fwd_kernel[(triton.cdiv(n_q, block_m), B * H)](
            q, k, v, o, lse, o32, *lists, *tiles,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            lse.stride(0), lse.stride(1), *sl, *st,
            H, H // k.shape[1], n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
            DOT_PRECISION=dot_precision(q.dtype), EVEN_N=n_k % block_n == 0, KEEP_F32_O=o32 is not None,
            HUGE_SCALE=huge_scale(scale),
            **native_options(config),
        )

    launch("fwd", run, q, n_q, n_k, False, block_m, block_n)
    return o, lse, (o if o32 is None else o32)


def _bsa_backward(do, dlse, q, k, v, o, lse, bm, scale):
    B, H, n_q, d = q.shape
    H_kv, n_k = k.shape[1], k.shape[2]
    block_m, block_n = bm.block_size
    do = _rows_contiguous(do)
    delta = _preprocess(o, do, dlse, n_q, H, B, d, block_m)
    assert delta.stride() == lse.stride(), "DELTA must share L's layout (the kernels use L's strides for it)"
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    q_lists, sq, tiles, st = _lists(bm, B, H, transposed=True)
    kv_lists, skv, _, _ = _lists(bm, B, H)
    huge = huge_scale(scale)

    def run_dkdv(config):
        _bsa_bwd_dkdv_kernel[(triton.cdiv(n_k, block_n), B * H_kv)](
            q, k, v, do, lse, delta, dk, dv, *q_lists, *tiles,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do),
            lse.stride(0), lse.stride(1), *_strides(dk), *_strides(dv), *sq, *st,
            H_kv, n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, GROUP=H // H_kv, DOT_PRECISION=dot_precision(q.dtype),
            EVEN_M=n_q % block_m == 0, EVEN_N=n_k % block_n == 0,
            HUGE_SCALE=huge, ONE_HOT_ZERO=huge and dlse is None,
            **native_options(config),
        )

    def run_dq(config):
        _bsa_bwd_dq_kernel[(triton.cdiv(n_q, block_m), B * H)](
            q, k, v, do, lse, delta, dq, *kv_lists, *tiles,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do),
            lse.stride(0), lse.stride(1), *_strides(dq), *skv, *st,
            H, H // H_kv, n_q, n_k, scale,
            HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype),
            EVEN_N=n_k % block_n == 0, HUGE_SCALE=huge, ONE_HOT_ZERO=huge and dlse is None,
            **native_options(config),
        )

    launch("dkdv", run_dkdv, q, n_q, n_k, False, block_m, block_n)
    launch("dq", run_dq, q, n_q, n_k, False, block_m, block_n)
    return dq, dk, dv


class _BlockSparseAttention(torch.autograd.Function):
    """Forward saves q, k, v, o and the log-sum-exp; backward walks the mask's transposed lists."""

    @staticmethod
    def forward(ctx, q, k, v, bm, scale):
        o, lse, o_saved = _bsa_forward(q, k, v, bm, scale, needs_grad=any(ctx.needs_input_grad[:3]))
        ctx.save_for_backward(q, k, v, o_saved, lse)   # o_saved: float32 for float16 inputs (D's precision)
        ctx.bm, ctx.scale = bm, scale
        ctx.set_materialize_grads(False)
        lse = lse.squeeze(-1)
        return o, (lse * abs(scale) if huge_scale(scale) else lse)   # the kernel's L is lse / |scale| there

    @staticmethod
    def backward(ctx, do, dlse):
        validate.no_double_backward("block_sparse_attention")
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(q)
        dq, dk, dv = _bsa_backward(do, dlse, q, k, v, o, lse, ctx.bm, ctx.scale)
        return dq, dk, dv, None, None


def block_sparse_attention(q, k, v, block_mask, block_size=None, causal=False, scale=None, *, return_lse=False):
    """Attention computed only on the tiles a block mask keeps, exact inside them; differentiable.

    q: (B, H, Nq, d), k and v: (B, H_kv, Nk, d) with H % H_kv == 0 (grouped-query attention),
    d in 16, 32, 64, 128. block_mask: a :class:`BlockMask` made for these lengths (by
    ``create_block_mask``, with B and H equal to q's or 1), or a bool tile tensor
    (B or 1, H or 1, ceil(Nq/block_m), ceil(Nk/block_n)) with ``block_size=(block_m, block_n)``
    (default (64, 64)), every element of a kept tile kept. ``causal`` ANDs the mask with
    :func:`attnlab.mask_mods.causal`. Query rows that see no key output zeros. Returns o
    (B, H, Nq, d), and lse (B, H, Nq) float32 (differentiable; -inf for an empty row) with
    ``return_lse``. Equal to ``torch.nn.attention.flex_attention.flex_attention(q, k, v,
    block_mask=...)`` for the same mask_mod (``enable_gqa=True`` for GQA). Double backward raises.

    Example: ``o = block_sparse_attention(q, k, v, create_block_mask(mask_mods.sliding_window(100), None, None, 512, 512))``
    """
    scale = validate.kernel_qkv(q, k, v, scale, causal, interpreted=use_interpreter, gqa=True)  # 1/sqrt(d) for None
    validate.flag(return_lse, "return_lse")
    B, H, n_q, d = q.shape
    n_k = k.shape[-2]
    bm = prepare_block_mask(block_mask, block_size, n_q, n_k, B, H, causal, q.device)
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    o, lse = _BlockSparseAttention.apply(q, k, v, bm, scale)
    return (o, lse) if return_lse else o
