"""Flash-Decoding in Triton: a few new queries against a long KV cache, split over the keys, then merged.

What you learn here:

* why decoding is a different problem from training: one step of generation has ``Nq`` new
  queries (1 for plain sampling, a few for speculative decoding) and a cache of ``L`` keys and
  values. FlashAttention's grid (one program per block of queries) would launch
  ``B x H`` programs of one query each, far too few to fill a GPU, each reading the whole
  cache alone. Flash-Decoding (Dao, Haziza, Massa and Sizov, 2023) also splits the *keys*:
  one program per (batch, KV head, split) computes a partial output over its chunk of the
  cache and that chunk's log-sum-exp, and a second kernel merges the splits;
* that the merge is lesson 07's online-softmax rescaling once more: a split's partial output
  ``o_s`` (normalised over its own keys) and log-sum-exp ``lse_s`` combine as
  ``o = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)`` with ``M = max_s lse_s``;
* grouped-query attention (Ainslie et al. 2023; multi-query when there is one KV head,
  Shazeer 2019) without copying K and V: the ``G = H_q / H_kv`` query heads that share a KV
  head are the rows of one program's Q tile, so each KV head's cache is read once per split,
  not once per query head;
* a paged cache as in vLLM's PagedAttention (Kwon et al. 2023): with ``block_table`` the
  cache is a pool of pages ``(num_pages, H_kv, page_size, D)`` and sequence ``b``'s key
  ``n`` lives in page ``block_table[b, n // page_size]`` at row ``n % page_size``. The kernel
  reads one int per page and does pointer arithmetic with it, as lesson 08's block-sparse
  kernel does with ``kv_indices``.

Conventions: q ``(B, H_q, Nq, D)``; the cache ``(B, H_kv, S, D)`` (contiguous, room for
``S >= max(cache_seqlens)`` tokens) or paged as above; ``cache_seqlens`` ``(B,)`` int32 counts
the valid tokens of each sequence, *including* the ``Nq`` new ones, whose K and V are already
written. Query ``i`` sits at position ``cache_seqlens[b] - Nq + i`` and sees the keys at
positions ``<=`` its own (causal, bottom-right aligned: the alignment of decoding).

The naive version (``attnlab.kvcache.decode_reference``) gathers each sequence's cache,
repeats the KV heads for GQA and runs the reference attention under a mask::

  per (batch, query head): read L d (K) + L d (V) + Nq d (Q), write Nq d (O),
  plus an Nq x L score matrix written and read twice, and with GQA a copy of K and V per query head.

This kernel, per (batch, KV head), whatever the split count::

  split kernel: read 4 bytes (the length) and G Nq d (Q) per split, L d (K) + L d (V) once,
                one int32 per page when paged; write G Nq (d + 1) fp32 (partial O and lse) per split;
  merge kernel: per query head read num_splits Nq (d + 1) fp32, write Nq d (O).

``attnlab.iomodel.decode_io`` counts exactly this and ``attnlab.memory.trace`` measures it.
Any finite scale: above ``attnlab.tiled.HUGE_SCALE`` (``HUGE_SCALE``) the split kernel takes the max of
the raw scores and scales after subtracting it, as ``flash_attention.py`` does, and keeps each split's
lse divided by ``|scale|``; the merge multiplies their differences by ``|scale|`` (``lse_scale``), and
``return_splits`` hands back the natural lse.
FLOPs: 4 G Nq L d per (batch, KV head), against 2 x 2 L d bytes of K and V in fp16: the
arithmetic intensity is about G Nq FLOP per byte, far below any GPU's ridge point.
"""

import os

import torch
import triton
import triton.language as tl

from attnlab import validate
from attnlab.tiled import huge_scale

from ._runtime import dot_precision, jit, use_interpreter

__all__ = ["flash_decode", "choose_num_splits", "MAX_QUERIES", "decode_split_kernel", "decode_merge_kernel"]

MAX_QUERIES = 16      # Nq, the new queries per step: 1 for sampling, a few for speculative decoding
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# ---------------------------------------------------------------------------------------
# Split kernel: one program per (split, batch x KV head)
# ---------------------------------------------------------------------------------------
@jit
def _decode_split_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, O_PART, L_PART,
    stride_qb, stride_qh, stride_qn,
    stride_kp, stride_kh, stride_kn,     # K: (B, H_kv, S, D), or paged (num_pages, H_kv, page_size, D)
    stride_vp, stride_vh, stride_vn,
    stride_btb,                          # block table (B, max_pages), paged only
    stride_ob, stride_oh, stride_os, stride_on,   # O_PART (B, H_q, num_splits, Nq, D) fp32
    stride_lb, stride_lh, stride_ls,              # L_PART (B, H_q, num_splits, Nq) fp32
    H_KV, N_Q, GROUP, CHUNK, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, HUGE_SCALE: tl.constexpr = False,   # as flash_attention.py's
):
    pid_s = tl.program_id(0)             # which split: keys [pid_s * CHUNK, (pid_s + 1) * CHUNK)
    pid_bh = tl.program_id(1)            # which (batch, KV head)
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    # read 1 int: this sequence's length (the new queries included)
    seqlen = tl.load(SEQLENS + b)

    # The Q tile: row r is query i = r % Nq of query head h_kv * G + r // Nq. The G query heads
    # that share this KV head are rows of ONE tile, so K and V below are read once for all of them.
    offs_r = tl.arange(0, BLOCK_M)
    g = offs_r // N_Q
    i = offs_r % N_Q
    row_ok = offs_r < GROUP * N_Q
    h_q = h_kv * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM)
    # read G * Nq * d elements of Q (padding rows masked off)
    q = tl.load(Q + b * stride_qb + h_q[:, None] * stride_qh + i[:, None] * stride_qn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    q_pos = seqlen - N_Q + i             # each query's position in its sequence (decoding's alignment)
    qk_scale = sm_scale * LOG2E          # exp2 below, as in flash_attention.py
    # s = q.k * s_scale, P = exp2((s - m) * exp_scale): a huge scale (HUGE_SCALE) would overflow s (inf - inf
    # = NaN), so there s is the raw score times the scale's sign and the scale multiplies s - m <= 0 instead
    s_scale, exp_scale = (tl.where(sm_scale < 0, -1.0, 1.0), tl.abs(qk_scale)) if HUGE_SCALE else (qk_scale, 1.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    start = pid_s * CHUNK
    end = tl.minimum(start + CHUNK, seqlen)          # a short sequence may leave a split empty
    n_blocks = (tl.maximum(end - start, 0) + BLOCK_N - 1) // BLOCK_N
    for it in range(0, n_blocks):
        start_n = start + it * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < end
        if PAGED:
            # read 1 int: the page that holds keys [start_n, start_n + page_size) (BLOCK_N == page_size)
            page = tl.load(BLOCK_TABLE + b * stride_btb + start_n // BLOCK_N)
            rows_in_page = tl.arange(0, BLOCK_N)
            k_ptrs = K + page * stride_kp + h_kv * stride_kh + rows_in_page[:, None] * stride_kn + offs_d[None, :]
            v_ptrs = V + page * stride_vp + h_kv * stride_vh + rows_in_page[:, None] * stride_vn + offs_d[None, :]
        else:
            k_ptrs = K + b * stride_kp + h_kv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
            v_ptrs = V + b * stride_vp + h_kv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :]
        # read BLOCK_N * d elements of K (keys past this split's end masked off: they cost nothing)
        k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * s_scale    # (BLOCK_M, BLOCK_N), on chip
        # causal: query i sees the keys at positions <= its own (the last Nq keys are the queries')
        visible = key_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # online softmax (lesson 07). A row may see no key of this split: subtract 0, not -inf
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2((s - m_safe[:, None]) * exp_scale)
        alpha = tl.math.exp2((m_i - m_safe) * exp_scale)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # read BLOCK_N * d elements of V
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]            # this split's output, normalised over its own keys (0 if none)
    # natural log (HUGE_SCALE: divided by |scale|, in s's units, where it cannot overflow; the merge scales back)
    lse = m_i + tl.math.log2(l_safe) / exp_scale if HUGE_SCALE else (m_i + tl.math.log2(l_safe)) * LN2
    lse = tl.where(l_i == 0.0, float("-inf"), lse)
    # write G * Nq * d fp32 (partial O) and G * Nq fp32 (its log-sum-exp)
    o_ptrs = O_PART + b * stride_ob + h_q[:, None] * stride_oh + pid_s * stride_os + i[:, None] * stride_on \
        + offs_d[None, :]
    tl.store(o_ptrs, o, mask=row_ok[:, None])
    tl.store(L_PART + b * stride_lb + h_q * stride_lh + pid_s * stride_ls + i, lse, mask=row_ok)


# ---------------------------------------------------------------------------------------
# Merge kernel: one program per (batch x query head); lesson 07's rescaling, over splits
# ---------------------------------------------------------------------------------------
@jit
def _decode_merge_kernel(
    O_PART, L_PART, O,
    stride_pb, stride_ph, stride_ps, stride_pn,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_on,
    H_Q, N_Q, NUM_SPLITS,
    lse_scale,                           # the splits' lse are natural / lse_scale: 1, or |scale| (HUGE_SCALE)
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // H_Q
    h = pid % H_Q
    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_q < N_Q
    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)    # running max of the splits' lse
    w_sum = tl.zeros([BLOCK_Q], tl.float32)              # running sum of exp(lse_s - m)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)      # running sum of exp(lse_s - m) o_s
    for s in range(0, NUM_SPLITS):
        # read Nq fp32 (lse_s) and Nq * d fp32 (o_s)
        lse = tl.load(L_PART + b * stride_lb + h * stride_lh + s * stride_ls + offs_q, mask=rows,
                      other=float("-inf"))
        o_s = tl.load(O_PART + b * stride_pb + h * stride_ph + s * stride_ps + offs_q[:, None] * stride_pn
                      + offs_d[None, :], mask=rows[:, None], other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp((m - m_safe) * lse_scale)   # rescale what was merged so far (lesson 07's alpha)
        w = tl.exp((lse - m_safe) * lse_scale)     # this split's weight: its softmax mass, exp(lse_s), rescaled
        acc = acc * alpha[:, None] + w[:, None] * o_s
        w_sum = w_sum * alpha + w
        m = m_new
    o = acc / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]
    # write Nq * d elements of O
    tl.store(O + b * stride_ob + h * stride_oh + offs_q[:, None] * stride_on + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=rows[:, None])


# public names for lessons that show or trace the kernels (the private names stay)
decode_split_kernel, decode_merge_kernel = _decode_split_kernel, _decode_merge_kernel


# ---------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------
BLOCK_N = 64          # keys per loop step when the cache is contiguous (paged: one page per step)


def _parallel_units(device):
    """How many programs it takes to keep ``device`` busy: the GPU's SM count, or the CPU's cores."""
    if not use_interpreter(device) and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1


def choose_num_splits(batch, kv_heads, max_seqlen, block_n, units):
    """The split count ``flash_decode`` takes for ``num_splits=None``.

    Enough programs to fill the machine: ``ceil(units / (batch * kv_heads))`` splits, where
    ``units`` is the GPU's SM count (or the CPU's cores in the interpreter), but never more
    splits than there are ``block_n``-key blocks in the longest sequence (a split of no keys
    only costs), and at least 1. A large batch already fills the machine and gets 1 split;
    a single long sequence gets many.

    Example: ``choose_num_splits(1, 8, 4096, 64, units=132)  # 17``
    """
    blocks = max(1, -(-max_seqlen // block_n))
    wanted = -(-units // max(1, batch * kv_heads))
    return max(1, min(wanted, blocks))


def _check_decode(q, k_cache, v_cache, cache_seqlens, num_splits, block_table, scale):
    """Every check before launch; returns (scale, page_size or None, max_seqlen)."""
    validate.tensor(q, "q", 4, "(batch, heads, new queries, head_dim)", floating=True,
                    dtypes=validate.KERNEL_DTYPES, nonempty=True)
    B, H_q, n_q, d = q.shape
    if d not in validate.KERNEL_HEAD_DIMS:
        raise ValueError(f"q: expected head_dim in {validate.KERNEL_HEAD_DIMS}, got shape {tuple(q.shape)}")
    if n_q > MAX_QUERIES:
        raise ValueError(f"q: expected 1 to {MAX_QUERIES} new queries (dim 2), got shape {tuple(q.shape)}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q: expected a CPU (interpreter) or CUDA tensor, got device {q.device}")
    paged = block_table is not None
    layout = "(num_pages, kv_heads, page_size, head_dim)" if paged else "(batch, kv_heads, capacity, head_dim)"
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        validate.tensor(x, name, 4, layout, floating=True, nonempty=True)
        validate.like(x, name, q, "q")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)} like k_cache, got {tuple(v_cache.shape)}")
    H_kv = k_cache.shape[1]
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache: expected head_dim {d} like q, got shape {tuple(k_cache.shape)}")
    if H_q % H_kv:
        raise ValueError(f"k_cache: expected a number of KV heads that divides q's {H_q} heads "
                         f"(grouped-query attention), got {H_kv}")
    validate.tensor(cache_seqlens, "cache_seqlens", 1, "(batch,)", dtypes=(torch.int32,))
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens: expected shape ({B},), one length per sequence, got "
                         f"{tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens: expected device {q.device} (the device of q), got {cache_seqlens.device}")
    lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
    if lo < n_q:
        raise ValueError(f"cache_seqlens: expected every length >= {n_q} (the new queries' K and V are in the "
                         f"cache already), got {lo}")
    page_size = None
    if paged:
        validate.tensor(block_table, "block_table", 2, "(batch, max_pages)", dtypes=(torch.int32,))
        if block_table.shape[0] != B:
            raise ValueError(f"block_table: expected {B} rows (one per sequence), got shape {tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"block_table: expected device {q.device} (the device of q), got {block_table.device}")
        page_size = k_cache.shape[2]
        try:
            validate.power_of_two(page_size, "page_size", minimum=16)
        except ValueError as e:
            raise ValueError(f"k_cache: expected a page size (dim 2) that is a power of two >= 16, got shape "
                             f"{tuple(k_cache.shape)}") from e
        capacity = block_table.shape[1] * page_size
        used = (cache_seqlens.long() + page_size - 1) // page_size               # (B,) pages in use
        cols = torch.arange(block_table.shape[1], device=q.device)[None, :]
        live = block_table[cols < used[:, None]]
        if hi <= capacity and live.numel() and (int(live.min()) < 0 or int(live.max()) >= k_cache.shape[0]):
            raise ValueError(f"block_table: expected page numbers in [0, {k_cache.shape[0]}) for the pages in use, "
                             f"got [{int(live.min())}, {int(live.max())}]")
    else:
        if k_cache.shape[0] != B:
            raise ValueError(f"k_cache: expected batch {B} like q (or pass block_table for a paged cache), "
                             f"got shape {tuple(k_cache.shape)}")
        capacity = k_cache.shape[2]
    if hi > capacity:
        raise ValueError(f"cache_seqlens: expected lengths <= {capacity}, the cache's capacity, got {hi}")
    validate.integer(num_splits, "num_splits", allow_none=True)
    if torch.is_grad_enabled():
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if x.requires_grad:
                raise ValueError(f"{name}: flash_decode is inference only (its output carries no gradient), but "
                                 f"{name} requires grad; call it under torch.no_grad() or pass {name}.detach(), or "
                                 f"use attnlab.kvcache.decode_reference, which is differentiable")
    scale = validate.scale(scale, d)
    validate.interpreter_dtypes(use_interpreter, q=q, k_cache=k_cache, v_cache=v_cache)
    return scale, page_size, hi


def flash_decode(q, k_cache, v_cache, cache_seqlens, *, num_splits=None, block_table=None, scale=None,
                 return_splits=False):
    """Attention of ``Nq`` new queries against a KV cache, split over the keys (Flash-Decoding).

    q: (B, H_q, Nq, D), Nq from 1 to 16, D in 16, 32, 64, 128; float32 or float16 (bfloat16 on
    a GPU only). k_cache, v_cache: (B, H_kv, S, D) contiguous, or with ``block_table``
    (B, max_pages) int32 a paged pool (num_pages, H_kv, page_size, D), page_size a power of
    two >= 16. H_q % H_kv == 0 (grouped-query; H_kv = 1 is multi-query). cache_seqlens (B,)
    int32: each sequence's valid tokens, the new ones included; query i is at position
    ``cache_seqlens - Nq + i`` and sees keys up to it. Returns o (B, H_q, Nq, D) in q's dtype,
    and with ``return_splits`` also the partial outputs (B, H_q, num_splits, Nq, D) and their
    log-sum-exps (B, H_q, num_splits, Nq), both fp32.

    ``num_splits=None`` takes :func:`choose_num_splits`: enough (batch, KV head, split)
    programs to fill the GPU's SMs (the CPU's cores in the interpreter), capped by the number
    of key blocks of the longest sequence. Each split covers ``CHUNK`` keys, the longest
    length divided by ``num_splits`` rounded up to whole blocks (pages when paged).

    Inference only: with grad mode on, inputs that require grad raise a ``ValueError`` (the output
    would carry no gradient). The new tokens' K and V are written before the call, by
    :func:`attnlab.kvcache.append_to_cache` (flash-attn's ``k=``, ``v=`` of ``flash_attn_with_kvcache``).

    Example: ``o = flash_decode(q, k_cache, v_cache, torch.tensor([100, 37], dtype=torch.int32))``
    """
    scale, page_size, max_len = _check_decode(q, k_cache, v_cache, cache_seqlens, num_splits, block_table, scale)
    B, H_q, n_q, d = q.shape
    H_kv = k_cache.shape[1]
    group = H_q // H_kv
    block_n = page_size if page_size is not None else BLOCK_N
    if num_splits is None:
        num_splits = choose_num_splits(B, H_kv, max_len, block_n, _parallel_units(q.device))
    chunk = -(-(-(-max_len // num_splits)) // block_n) * block_n      # ceil(max_len / splits), whole blocks
    q = q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    seqlens = cache_seqlens.contiguous()
    o_part = torch.empty((B, H_q, num_splits, n_q, d), device=q.device, dtype=torch.float32)
    l_part = torch.empty((B, H_q, num_splits, n_q), device=q.device, dtype=torch.float32)
    table = block_table.contiguous() if block_table is not None else None
    _decode_split_kernel[(num_splits, B * H_kv)](
        q, k_cache, v_cache, seqlens, table, o_part, l_part,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        table.stride(0) if table is not None else 0,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        l_part.stride(0), l_part.stride(1), l_part.stride(2),
        H_kv, n_q, group, chunk, scale,
        HEAD_DIM=d, BLOCK_M=max(16, triton.next_power_of_2(group * n_q)), BLOCK_N=block_n,
        PAGED=table is not None, DOT_PRECISION=dot_precision(q.dtype), HUGE_SCALE=huge_scale(scale),
    )
    o = torch.empty_like(q)
    _decode_merge_kernel[(B * H_q,)](
        o_part, l_part, o,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        l_part.stride(0), l_part.stride(1), l_part.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        H_q, n_q, num_splits, abs(scale) if huge_scale(scale) else 1.0,
        HEAD_DIM=d, BLOCK_Q=triton.next_power_of_2(n_q),
    )
    if return_splits and huge_scale(scale):
        l_part = l_part * abs(scale)     # natural log-sum-exps (the kernels kept them divided by |scale|)
    return (o, o_part, l_part) if return_splits else o
