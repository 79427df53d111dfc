"""Predict by formula, without running anything, the HBM bytes and FLOPs of attention's kernels.

Every count here is a formula you can check by hand, and each one is the *exact* traffic of
the matching kernel in ``attnlab.kernels`` for the same block sizes (``attnlab.memory.trace``
measures it; the tests compare the two). Counts are per call, summed over batch x heads.

Functions (all return an :class:`IO` with ``bytes_read``, ``bytes_written``, ``flops``,
``total_bytes``, ``arithmetic_intensity`` and a per-kernel ``parts`` breakdown):

* ``standard_forward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, block_m=None,
  score_bytes=None)``: three kernels, S = QK^T (written), softmax (S read, P written), O = PV
  (P read); ``score_bytes=4`` counts S in float32, as ``standard_attention`` stores it.
  ``block_m=None`` is the ideal of Dao et al. 2022, Algorithm 0 (every operand read once);
  a block size gives the tiled kernels' count (K and V are read once per query block).
* ``standard_backward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, blocks=None)``:
  dV = P^T dO, dP = dO V^T, dS (softmax backward), dQ = dS K, dK = dS^T Q; ``blocks`` is the
  matmul tile (BLOCK_M, BLOCK_N, BLOCK_K) or None for the ideal.
* ``flash_forward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, *, block_m=None,
  block_n=None, sram_bytes=None, causal=False, block_mask=None, loop_order="q_outer", lse_bytes=4,
  kv_heads=None, grad=False)`` and ``flash_backward_io(...)`` (same arguments, no ``loop_order``
  or ``grad``): FlashAttention-2 as in ``kernels/flash_attention.py``; ``kv_heads`` < ``heads`` is
  grouped-query attention (the dK/dV kernel reads K and V, and writes dK and dV, once per KV
  head); ``grad=True`` is the forward of a training step, which with 2-byte elements also writes
  O in float32 for the backward's D. Give the block sizes, or ``sram_bytes`` to derive them as
  in the paper: ``flash_block_sizes(sram_bytes, d, bytes_per_element)`` -> (B_r, B_c) with
  B_c = ceil(M / 4d), B_r = min(B_c, d), M = SRAM size in elements. ``loop_order="kv_outer"``
  counts the paper's Algorithm 1 (K/V outside, Q/O/l/m re-read and re-written per K/V block).
* ``block_sparse_forward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, *,
  block_mask=None, density=None, block_size=(64, 64), causal=False)`` and
  ``block_sparse_backward_io(...)``: the same kernels walking a BlockMask's lists, full and
  partial blocks (a partial one also reads its block_m x block_n int8 mask tile); with a
  ``BlockMask`` (or bool tile tensor) exact, with ``density`` the expected value.
* ``selected_attention_forward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, *,
  block_indices, block_size, causal=True, kv_heads=None, grad=False)`` and
  ``selected_attention_backward_io(...)``: ``attnlab.kernels.selected_attention`` (NSA's
  selection, DeepSeek Sparse Attention) for a given selection: the flash kernels over the selected
  tiles only, plus the int32 lists (a count per query block, an id per selected block); linear in topk.
* ``paper_standard_forward_io`` / ``paper_standard_backward_io(batch, heads, n, d=64,
  bytes_per_element=2, *, mask="additive", dropout=True)``: standard attention as Dao et al.
  2022's PyTorch baseline runs it, one kernel per operation (S, mask, softmax, dropout, PV; the
  backward through the saved P);
* ``paper_flash_forward_io`` / ``paper_flash_backward_io(batch, heads, n, d=64,
  bytes_per_element=2, *, sram_bytes=A100_SRAM_BYTES)``: the paper's Algorithm 1/2 and
  Algorithm 4 (K/V loop outside, Q/O/dQ streamed past each key block) at its block sizes;
* ``fig2(...)``: both bars of Dao et al. 2022, Fig. 2 (left) from the four above, term by term,
  beside the paper's 40.3 GB and 4.4 GB (``FIG2``).
* ``softmax_io(rows, cols, bytes_per_element=4)``: the fused softmax kernel.
* ``attention_flops(batch, heads, n_q, n_k=None, d=64, causal=False)``: 4 n_q n_k d (the
  two matmuls of the forward; causal halves the useful work, not the standard kernels').
* ``theorem2(n, d, sram_elements)``: the asymptotic orders of Dao et al. 2022, Theorem 2,
  without constants: standard N d + N^2, flash N^2 d^2 / M.
* ``ring_attention_bytes(batch, heads, n, d, world_size, bytes_per_element=2, *, backward=False,
  grad_bytes_per_element=4)`` and ``ulysses_attention_bytes(batch, heads, n, d, world_size,
  bytes_per_element=2, *, backward=False)``: communication, not HBM: the bytes each rank sends (and
  receives) in ``attnlab.distributed``'s ring and all-to-all attention over a sequence of ``n`` sharded
  on ``world_size`` ranks (see the section "Communication"); both take ``kv_heads`` (grouped-query
  attention), and ``allgather_attention_bytes(...)`` (same arguments) counts all-gather context
  parallelism (Llama 3's).
* ``MACHINES``: name -> :class:`Machine` (A100, H100, H200, T4, "this machine").
* ``roofline(flops, bytes_moved, machine="A100")`` -> :class:`Roofline`: arithmetic
  intensity, the machine's ridge point, whether the work is memory- or compute-bound, and
  the lower bound on time. ``roofline(io, machine=...)`` takes an :class:`IO` directly.
* ``decode_io(batch, heads, seqlens, d=64, bytes_per_element=2, *, kv_heads=None, n_q=1,
  num_splits=1, page_size=None)``: one decoding step of ``kernels/flash_decode.py`` (split-K
  Flash-Decoding, GQA/MQA through ``kv_heads``, paged through ``page_size``), and
  ``kv_cache_bytes(tokens, layers, kv_heads, d, bytes_per_element)``: the cache's size.
* ``queries_per_read(heads, seqlen, d, ..., n_q=(1, 2, 4, 8, 16))`` and ``mixed_batch_io(requests, heads,
  d, ...)``: decode_io with several queries per read of a cache (speculative verification, prefill
  chunks batched with decodes).
* ``decode_step_bytes(batch, context, *, params, layers, heads, d, kv_heads=None,
  bytes_per_element=2, cache_bytes_per_token=None)``: a whole model's decoding step, the weights
  (read once, shared by the batch) and each sequence's cache; ``decode_crossover_tokens(...)``:
  the batch x context where the two reads are equal; ``mla_cache_bytes(tokens, layers, d_latent,
  d_rope, bytes_per_element)``: multi-head latent attention's cache (``attnlab.mla``).

Element sizes: Q, K, V, O, dO, dQ, dK, dV, S, P, dP, dS use ``bytes_per_element`` (2 for
fp16/bf16, 4 for fp32); the per-row statistics L (log-sum-exp) and D = rowsum(dO * O) are
always fp32 (``lse_bytes=4``), and so is the O the flash backward reads for D (the forward of a
training step keeps a float32 copy when the elements are narrower); block-sparse index lists
are int32.

FLOPs count the multiply-adds of the matmuls the kernels perform (2 per multiply-add) on
the tiles they visit; the softmax's exponentials are not counted. The FlashAttention
backward here does 7 matmuls per tile (S and dP are recomputed in both the dK/dV and the dQ
kernel): 14 n_q n_k d, against the 10 n_q n_k d of a fused backward.

Example::

    from attnlab.iomodel import standard_forward_io, flash_forward_io
    std = standard_forward_io(1, 1, 1024, d=64)
    fa = flash_forward_io(1, 1, 1024, d=64, sram_bytes=100 * 1024)
    std.total_bytes / fa.total_bytes
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from attnlab import validate

__all__ = [
    "IO", "Machine", "Roofline", "MACHINES", "roofline", "flash_block_sizes", "softmax_io",
    "standard_forward_io", "standard_backward_io", "flash_forward_io", "flash_backward_io",
    "block_sparse_forward_io", "block_sparse_backward_io", "attention_flops", "theorem2", "matmul_io",
    "A100_SRAM_BYTES", "FIG2", "fig2", "paper_flash_forward_io", "paper_flash_backward_io",
    "paper_standard_forward_io", "paper_standard_backward_io", "ring_attention_bytes", "ulysses_attention_bytes",
]


@dataclass(frozen=True)
class IO:
    """Bytes read and written from/to HBM and FLOPs; ``parts`` maps kernel name -> IO."""

    bytes_read: int
    bytes_written: int
    flops: int = 0
    parts: dict = field(default_factory=dict, compare=False)

    @property
    def total_bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.total_bytes if self.total_bytes else float("inf")

    def __add__(self, other: "IO") -> "IO":
        parts = dict(self.parts)
        for k, v in other.parts.items():
            parts[k] = parts[k] + v if k in parts else v
        return IO(self.bytes_read + other.bytes_read, self.bytes_written + other.bytes_written,
                  self.flops + other.flops, parts)

    def scaled(self, factor: int) -> "IO":
        return IO(self.bytes_read * factor, self.bytes_written * factor, self.flops * factor,
                  {k: v.scaled(factor) for k, v in self.parts.items()})

    def __repr__(self):
        return (f"IO(read={self.bytes_read:,} B, written={self.bytes_written:,} B, total={self.total_bytes:,} B, "
                f"flops={self.flops:,})")


def _part(name, read, written, flops=0):
    io = IO(int(read), int(written), int(flops))
    return IO(io.bytes_read, io.bytes_written, io.flops, {name: io})


def _check(batch, heads, n_q, n_k, d, bytes_per_element):
    for name, val in (("batch", batch), ("heads", heads), ("n_q", n_q), ("n_k", n_k), ("d", d),
                      ("bytes_per_element", bytes_per_element)):
        validate.integer(val, name)


def _check_block(name, val):
    validate.integer(val, name, allow_none=True)


def _check_kv_heads(heads, kv_heads):
    """kv_heads (None: heads) must divide heads: each KV head serves heads / kv_heads query heads."""
    if kv_heads is None:
        return heads
    validate.integer(kv_heads, "kv_heads")
    if heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of heads={heads}, got {kv_heads}")
    return kv_heads


# ---------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------
def softmax_io(rows: int, cols: int, bytes_per_element: int = 4, max_fused: int = 16384) -> IO:
    """The fused softmax kernel on a (rows, cols) matrix: one read and one write per element,
    or two reads when a row is longer than ``max_fused`` (the two-pass loop)."""
    one_pass = 2 ** math.ceil(math.log2(max(cols, 1))) <= max_fused
    reads = rows * cols * (1 if one_pass else 2)
    return _part("softmax", reads * bytes_per_element, rows * cols * bytes_per_element)


def matmul_io(m: int, n: int, k: int, bytes_per_element: int, block_m=None, block_n=None, name="matmul") -> IO:
    """C (m, n) = A (m, k) @ B (k, n) tiled by (block_m, block_n): A is read once per column
    of tiles, B once per row of tiles, C written once. None = one tile (each read once)."""
    tm = 1 if block_m is None else math.ceil(m / block_m)
    tn = 1 if block_n is None else math.ceil(n / block_n)
    reads = m * k * tn + k * n * tm
    return _part(name, reads * bytes_per_element, m * n * bytes_per_element, 2 * m * n * k)


def attention_flops(batch, heads, n_q, n_k=None, d=64, causal=False) -> int:
    """Useful FLOPs of the attention forward: QK^T and PV, 2 * 2 n_q n_k d (causal: only the
    pairs key <= query)."""
    n_k = n_q if n_k is None else n_k
    pairs = sum(min(i + 1, n_k) for i in range(n_q)) if causal else n_q * n_k
    return 4 * batch * heads * pairs * d


def flash_block_sizes(sram_bytes: int, d: int, bytes_per_element: int = 2) -> tuple[int, int]:
    """(B_r, B_c) from the SRAM size as in Dao et al. 2022, Algorithm 1:
    M = sram_bytes / bytes_per_element elements, B_c = ceil(M / 4d), B_r = min(B_c, d)."""
    validate.integer(sram_bytes, "sram_bytes")
    m = sram_bytes // bytes_per_element
    b_c = math.ceil(m / (4 * d))
    return min(b_c, d), b_c


# ---------------------------------------------------------------------------------------
# Standard attention
# ---------------------------------------------------------------------------------------
def standard_forward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, block_m=None, block_n=None,
                        score_bytes=None) -> IO:
    """Three kernels, per head: S = QK^T (read Q once and K once per query block, write
    n_q n_k), softmax (read S and write P, n_q n_k each), O = PV (read P once and V once per
    query block, write n_q d). ``block_n`` does not change the traffic (it is accepted to mirror
    the kernels' arguments). ``score_bytes``: the bytes of one element of S; None means
    ``bytes_per_element`` (Algorithm 0, everything in one dtype). attnlab's
    ``standard_attention`` stores S in float32 for any input, so its count is ``score_bytes=4``.

    Example: ``standard_forward_io(1, 1, 1024, d=64, bytes_per_element=2, score_bytes=4).total_bytes``"""
    n_k = n_q if n_k is None else n_k
    _check(batch, heads, n_q, n_k, d, bytes_per_element)
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    validate.integer(score_bytes, "score_bytes", allow_none=True)
    e = bytes_per_element
    es = e if score_bytes is None else score_bytes
    tr = 1 if block_m is None else math.ceil(n_q / block_m)
    p = softmax_io(n_q, n_k, e)                      # P written in the inputs' dtype; S read below
    s_reads = p.bytes_read // e * es
    io = (_part("scores", (n_q * d + tr * n_k * d) * e, n_q * n_k * es, 2 * n_q * n_k * d)
          + _part("softmax", s_reads, p.bytes_written)
          + _part("pv", (n_q * n_k + tr * n_k * d) * e, n_q * d * e, 2 * n_q * n_k * d))
    return io.scaled(batch * heads)


def standard_backward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, blocks=None) -> IO:
    """Standard backward from the saved P (Dao et al. 2022, Algorithm 3), per head:
    dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(P * dP)) (read P and dP, write dS),
    dQ = dS K, dK = dS^T Q. ``blocks`` = (BLOCK_M, BLOCK_N, BLOCK_K) of the matmul kernel."""
    n_k = n_q if n_k is None else n_k
    _check(batch, heads, n_q, n_k, d, bytes_per_element)
    bm, bn = (None, None) if blocks is None else blocks[:2]
    e = bytes_per_element
    io = (matmul_io(n_k, d, n_q, e, bm, bn, "dv")
          + matmul_io(n_q, n_k, d, e, bm, bn, "dp")
          + _part("softmax_bwd", 2 * n_q * n_k * e, n_q * n_k * e)
          + matmul_io(n_q, d, n_k, e, bm, bn, "dq")
          + matmul_io(n_k, d, n_q, e, bm, bn, "dk"))
    return io.scaled(batch * heads)


# ---------------------------------------------------------------------------------------
# FlashAttention and block-sparse FlashAttention: sums over the visited tiles
# ---------------------------------------------------------------------------------------
def _tiles(n_q, n_k, block_m, block_n):
    tr, tc = math.ceil(n_q / block_m), math.ceil(n_k / block_n)
    rows = torch.tensor([min(block_m, n_q - i * block_m) for i in range(tr)], dtype=torch.int64)
    cols = torch.tensor([min(block_n, n_k - j * block_n) for j in range(tc)], dtype=torch.int64)
    return rows, cols


def _causal_tiles(n_q, n_k, block_m, block_n):
    """Tiles holding at least one pair key <= query (the causal kernels visit exactly these)."""
    tr, tc = math.ceil(n_q / block_m), math.ceil(n_k / block_n)
    q_hi = torch.clamp((torch.arange(tr) + 1) * block_m, max=n_q) - 1
    k_lo = torch.arange(tc) * block_n
    return k_lo[None, :] <= q_hi[:, None]


def _visit_masks(batch, heads, n_q, n_k, block_m, block_n, causal, block_mask):
    """Bool (B', H', Tr, Tc) of visited tiles, and the multiplicity of each (b, h) slice."""
    tr, tc = math.ceil(n_q / block_m), math.ceil(n_k / block_n)
    if block_mask is None:
        m = torch.ones(1, 1, tr, tc, dtype=torch.bool)
    else:
        m = block_mask.mask if hasattr(block_mask, "mask") else block_mask
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
            raise TypeError(f"block_mask: expected a BlockMask or a bool tensor, got {type(m).__name__}")
        if m.dim() == 2:
            m = m[None, None]
        if tuple(m.shape[-2:]) != (tr, tc) or m.shape[0] not in (1, batch) or m.shape[1] not in (1, heads):
            raise ValueError(f"block_mask: expected shape ({batch} or 1, {heads} or 1, {tr}, {tc}), got {tuple(m.shape)}")
        m = m.cpu()
    if causal:
        m = m & _causal_tiles(n_q, n_k, block_m, block_n)
    mult = (batch // m.shape[0]) * (heads // m.shape[1])
    return m, mult


def _resolve_blocks(d, bytes_per_element, block_m, block_n, sram_bytes):
    if block_m is None or block_n is None:
        if sram_bytes is None:
            raise ValueError("give block_m and block_n, or sram_bytes to derive them as in the paper")
        b_r, b_c = flash_block_sizes(sram_bytes, d, bytes_per_element)
        block_m = b_r if block_m is None else block_m
        block_n = b_c if block_n is None else block_n
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    return block_m, block_n


def _list_bytes(slices, outer, mf, partial, block_m, block_n):
    """Bytes of the block lists a block-sparse kernel reads: per outer block (a program's query or
    key block) two int32 counts (full and partial blocks); per visited tile one int32 index; per
    partial tile one int32 tile id and its block_m x block_n int8 element mask."""
    n_partial = 0 if partial is None else int(partial.to(torch.int64).sum())
    return 4 * (2 * slices * outer + int(mf.sum())) + n_partial * (4 + block_m * block_n)


def _o_bytes(e):
    """Bytes per element of the O the flash backward reads for D = rowsum(dO * O): float32 at least
    (kernels/flash_attention.py's forward keeps a float32 O for float16 inputs that need gradients)."""
    return max(e, 4)


def _flash_fwd(batch, heads, n_q, n_k, d, e, block_m, block_n, causal, block_mask, sparse, lse_bytes, partial=None,
               grad=False):
    rows, cols = _tiles(n_q, n_k, block_m, block_n)
    m, mult = _visit_masks(batch, heads, n_q, n_k, block_m, block_n, causal, block_mask)
    mf = m.to(torch.int64)
    kv_elems = int((mf * cols).sum())                        # sum over visited tiles of cols_j
    pair_elems = int((mf * rows[:, None] * cols[None, :]).sum())
    slices = m.shape[0] * m.shape[1]
    reads = slices * n_q * d * e + 2 * kv_elems * d * e
    if sparse:
        reads += _list_bytes(slices, rows.numel(), mf, partial, block_m, block_n)
    writes = slices * (n_q * d * e + n_q * lse_bytes)
    if grad and _o_bytes(e) != e:   # a training step: O once more, in float32, for the backward's D
        writes += slices * n_q * d * _o_bytes(e)
    return _part("flash_fwd", reads, writes, 4 * pair_elems * d).scaled(mult)


def _flash_bwd(batch, heads, n_q, n_k, d, e, block_m, block_n, causal, block_mask, sparse, lse_bytes, partial=None,
               kv_heads=None):
    rows, cols = _tiles(n_q, n_k, block_m, block_n)
    m, mult = _visit_masks(batch, heads, n_q, n_k, block_m, block_n, causal, block_mask)
    mf = m.to(torch.int64)
    slices = m.shape[0] * m.shape[1]
    q_elems = int((mf * rows[:, None]).sum())      # sum over visited tiles of rows_i
    kv_elems = int((mf * cols[None, :]).sum())     # sum over visited tiles of cols_j
    pair_elems = int((mf * rows[:, None] * cols[None, :]).sum())
    idx = ((lambda outer: _list_bytes(slices, outer, mf, partial, block_m, block_n)) if sparse
           else (lambda outer: 0))
    pre = _part("bwd_preprocess", slices * n_q * d * (_o_bytes(e) + e), slices * n_q * lse_bytes)   # O (fp32), dO
    # dK/dV: per query head, Q, dO, L and D of every visited tile (the loop over a KV head's group)
    dkdv = _part("bwd_dkdv", q_elems * (2 * d * e + 2 * lse_bytes) + idx(cols.numel()), 0, 8 * pair_elems * d)
    dq = _part("bwd_dq",
               slices * (2 * n_q * d * e + 2 * n_q * lse_bytes) + 2 * kv_elems * d * e + idx(rows.numel()),
               slices * n_q * d * e, 6 * pair_elems * d)
    # and K, V read, dK, dV written, once per KV head (kv_heads = heads without GQA)
    kv = batch * (heads if kv_heads is None else kv_heads) * 2 * n_k * d * e
    return (pre + dkdv + dq).scaled(mult) + _part("bwd_dkdv", kv, kv)


def flash_forward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, *, block_m=None, block_n=None,
                     sram_bytes=None, causal=False, block_mask=None, loop_order="q_outer", lse_bytes=4,
                     kv_heads=None, grad=False) -> IO:
    """FlashAttention forward, per head with B_r = block_m query rows and B_c = block_n keys:

    ``q_outer`` (FlashAttention-2, the kernel): read Q once (n_q d) and, for every visited
    tile, its K and V blocks (2 B_c d); write O (n_q d) and the log-sum-exp (n_q, fp32).
    Not causal: n_q d + ceil(n_q / B_r) 2 n_k d read, n_q d + n_q written.
    ``kv_heads`` (grouped-query attention) changes nothing here: every query head's programs read
    their KV head's blocks. ``grad=True`` (inputs that need gradients) with fewer than 4 bytes per
    element: O is also written in float32 (4 n_q d bytes more), the O the backward's D is made of.

    ``kv_outer`` (Dao et al. 2022, Algorithm 1; dense, not causal): read K and V once; for each
    of the ceil(n_k / B_c) key blocks read Q and O and the statistics l, m, and write O, l, m.
    """
    n_k = n_q if n_k is None else n_k
    _check(batch, heads, n_q, n_k, d, bytes_per_element)
    _check_kv_heads(heads, kv_heads)
    validate.flag(grad, "grad")
    block_m, block_n = _resolve_blocks(d, bytes_per_element, block_m, block_n, sram_bytes)
    e = bytes_per_element
    if loop_order == "kv_outer":
        if causal or block_mask is not None:
            raise ValueError("loop_order: expected 'q_outer' with causal or a block_mask ('kv_outer' models the "
                             "paper's dense, non-causal Algorithm 1 only), got 'kv_outer'")
        alg1 = _algorithm1(n_q, n_k, d, e, block_n, lse_bytes, init=False)  # the loop only, no initialisation
        return _part("flash_fwd_alg1", alg1.bytes_read, alg1.bytes_written, alg1.flops).scaled(batch * heads)
    validate.one_of(loop_order, "loop_order", ("q_outer", "kv_outer"))
    return _flash_fwd(batch, heads, n_q, n_k, d, e, block_m, block_n, causal, block_mask, block_mask is not None, lse_bytes,
                      grad=grad)


def flash_backward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, *, block_m=None, block_n=None,
                      sram_bytes=None, causal=False, block_mask=None, lse_bytes=4, kv_heads=None) -> IO:
    """FlashAttention-2 backward as three kernels, per head:

    preprocess: read O (in float32: 4 n_q d bytes, the forward's float32 copy for 2-byte elements)
    and dO (n_q d), write D (n_q, fp32);
    dK/dV: one program per key block and KV head reads its K and V (2 B_c d) and, per visited tile
    of each query head of its group, the query block's Q and dO (2 B_r d) and L and D (2 B_r,
    fp32); writes dK and dV (2 n_k d per KV head: ``kv_heads`` of them, ``heads`` without GQA);
    dQ: one program per query block reads Q, dO, L, D and, per visited tile, K and V; writes dQ.
    """
    n_k = n_q if n_k is None else n_k
    _check(batch, heads, n_q, n_k, d, bytes_per_element)
    kv_heads = _check_kv_heads(heads, kv_heads)
    block_m, block_n = _resolve_blocks(d, bytes_per_element, block_m, block_n, sram_bytes)
    return _flash_bwd(batch, heads, n_q, n_k, d, bytes_per_element, block_m, block_n, causal, block_mask,
                      block_mask is not None, lse_bytes, kv_heads=kv_heads)


def _check_density(density):
    validate.number_in(density, "density", 0, 1)


def _sparse_io(kind, batch, heads, n_q, n_k, d, bytes_per_element, block_mask, density, block_size, causal, lse_bytes,
               kv_heads=None, grad=False):
    n_k = n_q if n_k is None else n_k
    _check(batch, heads, n_q, n_k, d, bytes_per_element)
    kv_heads = _check_kv_heads(heads, kv_heads)
    validate.flag(grad, "grad")
    extra = {"grad": grad} if kind == "fwd" else {"kv_heads": kv_heads}
    if block_mask is not None:
        from attnlab.kernels.block_mask import BlockMask

        if not isinstance(block_mask, BlockMask):
            if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
                raise TypeError(f"block_mask: expected a BlockMask or a bool tensor, got {type(block_mask).__name__}")
            _visit_masks(batch, heads, n_q, n_k, *block_size, False, block_mask)   # the shape check
            block_mask = BlockMask(block_mask.cpu(), block_size)
        bm, bn = block_mask.block_size
        _visit_masks(batch, heads, n_q, n_k, bm, bn, False, block_mask)           # the shape check
        if causal:   # the kernel walks the mask AND causal, element by element (its own tiles)
            block_mask = block_mask.and_causal(n_q, n_k)
        kept, partial = block_mask.mask.cpu(), block_mask.partial_blocks.cpu()
        fn = _flash_fwd if kind == "fwd" else _flash_bwd
        return fn(batch, heads, n_q, n_k, d, bytes_per_element, bm, bn, False, kept, True, lse_bytes, partial, **extra)
    if density is None:
        raise ValueError("block_mask, density: expected one of them (block_mask exact, density an expected value), "
                         "got neither")
    _check_density(density)
    if causal:
        raise ValueError("causal: expected False with density (not modelled): give the causal BlockMask instead, got True")
    bm, bn = block_size
    tr, tc = math.ceil(n_q / bm), math.ceil(n_k / bn)
    fn = _flash_fwd if kind == "fwd" else _flash_bwd
    extra = {"grad": grad} if kind == "fwd" else {}    # one head: K/V once per KV head is scaled below
    full = fn(1, 1, n_q, n_k, d, bytes_per_element, bm, bn, False, torch.ones(1, 1, tr, tc, dtype=torch.bool), True,
              lse_bytes, **extra)
    empty = fn(1, 1, n_q, n_k, d, bytes_per_element, bm, bn, False, torch.zeros(1, 1, tr, tc, dtype=torch.bool), True,
               lse_bytes, **extra)

    def lerp(a, b):
        return round(b + density * (a - b))

    io = IO(lerp(full.bytes_read, empty.bytes_read), lerp(full.bytes_written, empty.bytes_written),
            lerp(full.flops, empty.flops))
    io = IO(io.bytes_read, io.bytes_written, io.flops, {f"block_sparse_{kind}": io}).scaled(batch * heads)
    if kind == "bwd" and kv_heads != heads:   # K and V read, dK and dV written, per KV head, not per query head
        kv = batch * (heads - kv_heads) * 2 * n_k * d * bytes_per_element
        io = IO(io.bytes_read - kv, io.bytes_written - kv, io.flops,
                {k: IO(v.bytes_read - kv, v.bytes_written - kv, v.flops) for k, v in io.parts.items()})
    return io


def block_sparse_forward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, *, block_mask=None,
                            density=None, block_size=(64, 64), causal=False, lse_bytes=4, kv_heads=None,
                            grad=False) -> IO:
    """Block-sparse FlashAttention forward: the flash forward summed over the kept tiles only
    (full and partial), plus the int32 block lists (two counts per query block, full and partial;
    one index per kept tile) and, per partial tile, its int32 id and block_m x block_n int8 mask.
    ``causal`` counts the mask AND causal (the kernel's ``causal=True``).
    With ``density`` instead of a mask: the expected traffic when that fraction of tiles is kept
    (the tile-proportional part scales with density; Q, O, L and the counts do not).
    ``kv_heads`` and ``grad`` as in :func:`flash_forward_io`."""
    return _sparse_io("fwd", batch, heads, n_q, n_k, d, bytes_per_element, block_mask, density, block_size, causal, lse_bytes,
                      kv_heads, grad)


def block_sparse_backward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, *, block_mask=None,
                             density=None, block_size=(64, 64), causal=False, lse_bytes=4, kv_heads=None) -> IO:
    """Block-sparse FlashAttention backward (preprocess, dK/dV over q_indices, dQ over kv_indices);
    ``kv_heads`` as in :func:`flash_backward_io`."""
    return _sparse_io("bwd", batch, heads, n_q, n_k, d, bytes_per_element, block_mask, density, block_size, causal, lse_bytes,
                      kv_heads)


# ---------------------------------------------------------------------------------------
# Dao et al. 2022 as the paper ran it: the two bars of Fig. 2 (left), in bytes
# ---------------------------------------------------------------------------------------
# "A100 GPU has 40-80GB of high bandwidth memory (HBM) ... and 192KB of on-chip SRAM per each of
# 108 streaming multiprocessors" (Dao et al. 2022, Section 2.1). Algorithm 1 sizes its blocks from
# that M: B_c = ceil(M / 4d), B_r = min(B_c, d), M counted in elements (here float16).
A100_SRAM_BYTES = 192 * 1024

# Dao et al. 2022 (arXiv:2205.14135v2), Fig. 2 left: GPT-2 medium's attention, forward + backward,
# on an A100: sequence 1024, head dim 64, 16 heads, batch 64, float16. HBM reads + writes in GB.
FIG2 = {"batch": 64, "heads": 16, "n": 1024, "d": 64, "bytes_per_element": 2,
        "standard_gb": 40.3, "flash_gb": 4.4}


def _algorithm1(n_q, n_k, d, e, block_n, stats_bytes, init=True):
    """Algorithm 1/2's forward for one head: the K/V loop outside, the Q loop inside."""
    tc = math.ceil(n_k / block_n)                  # passes over Q, O, l, m: one per K/V block
    flops = 4 * n_q * n_k * d
    return (_part("init O, l, m", 0, (n_q * d * e + 2 * n_q * stats_bytes) if init else 0)
            + _part("K_j, V_j in (once)", 2 * n_k * d * e, 0)
            + _part("Q_i, O_i, l_i, m_i in (per K/V block)", tc * (2 * n_q * d * e + 2 * n_q * stats_bytes), 0)
            + _part("O_i, l_i, m_i out (per K/V block)", 0, tc * (n_q * d * e + 2 * n_q * stats_bytes), flops))


def paper_flash_forward_io(batch, heads, n, d=64, bytes_per_element=2, *, sram_bytes=A100_SRAM_BYTES,
                           block_m=None, block_n=None, stats_bytes=4, init=True) -> IO:
    """FlashAttention's forward as Dao et al. 2022 write it (Algorithm 1, and Algorithm 2 with
    dropout, which moves the same bytes: the dropout mask is regenerated, never stored), per head:

    initialise O = 0, l = 0, m = -inf in HBM (``init``); for each of the T_c = ceil(N / B_c) key
    blocks: read K_j, V_j once, and for every query block read Q_i, O_i, l_i, m_i and write O_i,
    l_i, m_i back. Block sizes from the SRAM as in the paper (``flash_block_sizes``) unless given;
    l and m are float32 (``stats_bytes``). Dense: a causal mask is applied on chip, no block skipped.
    Parts name each term. Example: ``paper_flash_forward_io(64, 16, 1024).total_bytes / 1e9``
    """
    _check(batch, heads, n, n, d, bytes_per_element)
    block_m, block_n = _resolve_blocks(d, bytes_per_element, block_m, block_n, sram_bytes)
    return _algorithm1(n, n, d, bytes_per_element, block_n, stats_bytes, init).scaled(batch * heads)


def paper_flash_backward_io(batch, heads, n, d=64, bytes_per_element=2, *, sram_bytes=A100_SRAM_BYTES,
                            block_m=None, block_n=None, stats_bytes=4, init=True) -> IO:
    """FlashAttention's backward as Dao et al. 2022 write it (Appendix B, Algorithm 4), per head:

    initialise dQ, dK, dV = 0 in HBM (``init``); for each of the T_c key blocks: read K_j, V_j
    once, and for every query block read Q_i, O_i, dO_i, dQ_i, l_i, m_i and write dQ_i back
    (dQ accumulates in HBM); write dK_j, dV_j once. P and dP are recomputed on chip.
    Example: ``paper_flash_backward_io(64, 16, 1024).total_bytes / 1e9``
    """
    _check(batch, heads, n, n, d, bytes_per_element)
    block_m, block_n = _resolve_blocks(d, bytes_per_element, block_m, block_n, sram_bytes)
    e, s = bytes_per_element, stats_bytes
    tc = math.ceil(n / block_n)
    io = (_part("init dQ, dK, dV", 0, 3 * n * d * e if init else 0)
          + _part("K_j, V_j in (once)", 2 * n * d * e, 0)
          + _part("Q_i, O_i, dO_i, dQ_i, l_i, m_i in (per K/V block)", tc * (4 * n * d * e + 2 * n * s), 0)
          + _part("dQ_i out (per K/V block)", 0, tc * n * d * e)
          + _part("dK_j, dV_j out (once)", 0, 2 * n * d * e, 10 * n * n * d))
    return io.scaled(batch * heads)


def _check_mask_kind(mask):
    validate.one_of(mask, "mask", (None, "additive", "fill"))


def paper_standard_forward_io(batch, heads, n, d=64, bytes_per_element=2, *, mask="additive", dropout=True,
                              dropout_mask_bytes=1) -> IO:
    """Standard attention's forward as the paper's PyTorch baseline runs it: one kernel per
    operation, each reading its N x N input from HBM and writing its N x N output, per head:

    S = QK^T * scale (read Q, K; write S); the causal mask (read S, write S'; ``mask=None`` skips
    it); softmax (read, write P); dropout (read P, write P~ and its mask, ``dropout_mask_bytes``
    per element: PyTorch keeps a bool mask for the backward); O = P~ V (read P~, V; write O).
    The mask tensor itself is one (N, N) tensor broadcast over batch x heads: counted once per
    call ("mask tensor"), as broadcast operands are everywhere in attnlab.
    Example: ``paper_standard_forward_io(64, 16, 1024).total_bytes / 1e9``
    """
    _check(batch, heads, n, n, d, bytes_per_element)
    _check_mask_kind(mask)
    e, nn_, nd = bytes_per_element, n * n * bytes_per_element, n * d * bytes_per_element
    io = _part("S = QK^T", 2 * nd, nn_, 2 * n * n * d)
    if mask is not None:
        io = io + _part("mask", nn_, nn_)
    io = io + _part("softmax", nn_, nn_)
    if dropout:
        io = io + _part("dropout", nn_, nn_ + n * n * dropout_mask_bytes)
    io = (io + _part("O = PV", nn_ + nd, nd, 2 * n * n * d)).scaled(batch * heads)
    if mask is not None:
        io = io + _part("mask tensor (read once, broadcast)", n * n * e, 0)
    return io


def paper_standard_backward_io(batch, heads, n, d=64, bytes_per_element=2, *, mask="additive", dropout=True,
                               dropout_mask_bytes=1) -> IO:
    """Standard attention's backward through the saved P, one kernel per operation, per head:

    dV = P~^T dO (read P~, dO; write dV); dP~ = dO V^T (read dO, V; write dP~); the dropout
    backward (read dP~ and the mask; write dP); the softmax backward dS = P * (dP - rowsum(P * dP))
    (read P and dP; write dS); the mask's backward (``mask="fill"``, a masked_fill or where: read and
    write dS; an ``"additive"`` mask's gradient passes through unchanged, no kernel); dQ = dS K and
    dK = dS^T Q (read dS and K or Q; write dQ or dK).
    Example: ``paper_standard_backward_io(64, 16, 1024).total_bytes / 1e9``
    """
    _check(batch, heads, n, n, d, bytes_per_element)
    _check_mask_kind(mask)
    nn_, nd = n * n * bytes_per_element, n * d * bytes_per_element
    mm = 2 * n * n * d
    io = (_part("dV = P^T dO", nn_ + nd, nd, mm)
          + _part("dP = dO V^T", 2 * nd, nn_, mm))
    if dropout:
        io = io + _part("dropout backward", nn_ + n * n * dropout_mask_bytes, nn_)
    io = io + _part("softmax backward", 2 * nn_, nn_)
    if mask == "fill":
        io = io + _part("mask backward", nn_, nn_)
    io = io + _part("dQ = dS K", nn_ + nd, nd, mm) + _part("dK = dS^T Q", nn_ + nd, nd, mm)
    return io.scaled(batch * heads)


def fig2(batch=FIG2["batch"], heads=FIG2["heads"], n=FIG2["n"], d=FIG2["d"],
         bytes_per_element=FIG2["bytes_per_element"], *, sram_bytes=A100_SRAM_BYTES, mask="additive",
         dropout=True) -> dict:
    """Both bars of Dao et al. 2022, Fig. 2 (left), predicted from the paper's own algorithms.

    Returns {"standard": IO, "flash": IO (forward + backward, parts per term), "standard_forward",
    "standard_backward", "flash_forward", "flash_backward": IO, "blocks": (B_r, B_c),
    "paper_gb": {"standard", "flash"}, "model_gb": {...}, "relative_error": {...}}.
    Example: ``fig2()["model_gb"]``
    """
    kw = dict(mask=mask, dropout=dropout)
    sf = paper_standard_forward_io(batch, heads, n, d, bytes_per_element, **kw)
    sb = paper_standard_backward_io(batch, heads, n, d, bytes_per_element, **kw)
    ff = paper_flash_forward_io(batch, heads, n, d, bytes_per_element, sram_bytes=sram_bytes)
    fb = paper_flash_backward_io(batch, heads, n, d, bytes_per_element, sram_bytes=sram_bytes)
    paper = {"standard": FIG2["standard_gb"], "flash": FIG2["flash_gb"]}
    model = {"standard": (sf + sb).total_bytes / 1e9, "flash": (ff + fb).total_bytes / 1e9}
    return {"standard": sf + sb, "flash": ff + fb, "standard_forward": sf, "standard_backward": sb,
            "flash_forward": ff, "flash_backward": fb,
            "blocks": flash_block_sizes(sram_bytes, d, bytes_per_element),
            "paper_gb": paper, "model_gb": model,
            "relative_error": {k: model[k] / paper[k] - 1 for k in paper}}


def theorem2(n: int, d: int, sram_elements: int, density: float = 1.0) -> dict:
    """Orders of growth of HBM accesses (Dao et al. 2022, Theorem 2 and Proposition 4), no constants:
    standard N d + N^2; FlashAttention N^2 d^2 / M; block-sparse N d + N^2 d^2 s / M."""
    return {
        "standard": n * d + n * n,
        "flash": n * n * d * d / sram_elements,
        "block_sparse": n * d + n * n * d * d * density / sram_elements,
    }


# ---------------------------------------------------------------------------------------
# Communication: the bytes each rank sends in sequence-parallel attention (attnlab.distributed)
# ---------------------------------------------------------------------------------------
def _check_comm(batch, heads, n, d, world_size, bytes_per_element):
    for name, val in (("batch", batch), ("heads", heads), ("n", n), ("d", d), ("world_size", world_size),
                      ("bytes_per_element", bytes_per_element)):
        validate.integer(val, name)
    if n % world_size:
        raise ValueError(f"n: expected a multiple of world_size = {world_size} (equal shards), got {n}")


def ring_attention_bytes(batch, heads, n, d, world_size, bytes_per_element=2, *, backward=False,
                         grad_bytes_per_element=4, kv_heads=None) -> int:
    """Bytes each rank sends (and, by symmetry, receives) in ring attention over ``n`` positions on P ranks.

    A shard of K (or V) is ``batch * heads * (n / P) * d`` elements. Forward: every rank forwards a K and a
    V shard at each of the P - 1 steps after its own, ``2 (P - 1)`` shards. Backward: the same K/V trip
    again, plus the dK/dV accumulators (``grad_bytes_per_element``, float32), which travel one step behind
    and need P hops to come home: ``2 (P - 1)`` shards + ``2 P`` gradient shards. The ring uses one link per
    rank (to the next rank), so this is also the bytes per link. Independent of a causal mask (skipped
    blocks still travel). ``kv_heads`` (None: ``heads``) is the number of K/V heads (grouped-query
    attention): only K and V travel, so the bytes scale with ``kv_heads``, not with the query heads.
    Example: ``ring_attention_bytes(1, 8, 4096, 64, 4, 2)  # 2 * 3 * 8 * 1024 * 64 * 2 = 6291456``
    """
    _check_comm(batch, heads, n, d, world_size, bytes_per_element)
    validate.integer(grad_bytes_per_element, "grad_bytes_per_element")
    kv_heads = _check_kv_heads(heads, kv_heads)
    shard = batch * kv_heads * (n // world_size) * d                 # elements of one K (or V) shard
    if world_size == 1:
        return 0                                                     # one rank: nothing leaves it
    if not backward:
        return 2 * (world_size - 1) * shard * bytes_per_element
    return (2 * (world_size - 1) * shard * bytes_per_element
            + 2 * world_size * shard * grad_bytes_per_element)


def ulysses_attention_bytes(batch, heads, n, d, world_size, bytes_per_element=2, *, backward=False,
                            kv_heads=None) -> int:
    """Bytes each rank sends (and receives) in all-to-all (DeepSpeed-Ulysses) attention on P ranks.

    Each all-to-all of a local ``batch * heads * (n / P) * d`` tensor keeps 1/P of it and sends the other
    (P - 1)/P, ``batch * (heads / P) * (n / P) * d`` elements to each of the P - 1 other ranks. What a rank
    sends in all, about ``4 batch heads n d / P`` elements, is Jacobs et al. 2023's "communication volume per
    link" (one link per device into a switched network): constant when n and P grow together, where the
    ring's grows with P. The forward moves q, k, v to head shards and O back (4 all-to-alls); the backward dO,
    then dQ, dK, dV (4 more), all in the inputs' dtype. ``backward`` returns the backward's bytes.
    ``kv_heads`` (None: ``heads``, multi-head attention): with grouped-query attention K and V have fewer
    heads. Where ``kv_heads >= P`` each rank gets ``kv_heads / P`` of them; where ``kv_heads < P`` (P a
    multiple of ``kv_heads``) each KV head is replicated on the ``P / kv_heads`` ranks whose query heads
    share it, so every rank receives one KV head: q and O move ``(P - 1) B (H/P) (n/P) d`` elements each, K
    and V ``(P - 1) B max(kv_heads/P, 1) (n/P) d`` each. The query heads must still divide by P.
    Example: ``ulysses_attention_bytes(1, 8, 4096, 64, 4, 2)  # 4 * 3 * 2 * 1024 * 64 * 2 = 3145728``
    """
    _check_comm(batch, heads, n, d, world_size, bytes_per_element)
    if heads % world_size:
        raise ValueError(f"heads: expected a multiple of world_size = {world_size} (a head shard per rank), got {heads}")
    kv_heads = _check_kv_heads(heads, kv_heads)
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"kv_heads: expected a multiple or a divisor of world_size = {world_size} (whole KV heads "
                         f"per rank, or each replicated on world_size / kv_heads ranks), got {kv_heads}")
    per_link = batch * (heads // world_size) * (n // world_size) * d   # q (or O) elements one rank sends one other
    kv_link = batch * max(kv_heads // world_size, 1) * (n // world_size) * d   # K (or V) elements, likewise
    return 2 * (world_size - 1) * (per_link + kv_link) * bytes_per_element


__all__ += ["allgather_attention_bytes"]


def allgather_attention_bytes(batch, heads, n, d, world_size, bytes_per_element=2, *, backward=False,
                              grad_bytes_per_element=4, kv_heads=None) -> int:
    """Bytes each rank sends (and receives) in all-gather context parallelism (Llama 3, arXiv:2407.21783,
    section 3.3.2; :func:`attnlab.distributed.allgather_attention`) on P ranks.

    Forward: one all-gather of K and one of V, each rank's ``batch * kv_heads * (n / P) * d`` shard reaching
    the P - 1 others: ``2 (P - 1)`` shards, the ring's forward bytes, but all at once before the compute
    (nothing to overlap them with) and the whole K and V then held on every rank. Backward: the gathered K
    and V were kept, so only the reduce-scatter of dK and dV (``grad_bytes_per_element``, float32):
    ``2 (P - 1)`` gradient shards. ``kv_heads`` (None: ``heads``) is the number of K/V heads.
    Example: ``allgather_attention_bytes(1, 32, 4096, 128, 4, 2, kv_heads=8)  # 2 * 3 * 8 * 1024 * 128 * 2``
    """
    _check_comm(batch, heads, n, d, world_size, bytes_per_element)
    validate.integer(grad_bytes_per_element, "grad_bytes_per_element")
    kv_heads = _check_kv_heads(heads, kv_heads)
    shard = batch * kv_heads * (n // world_size) * d                 # elements of one K (or V) shard
    return 2 * (world_size - 1) * shard * (grad_bytes_per_element if backward else bytes_per_element)


# ---------------------------------------------------------------------------------------
# Decoding: one step of generation against a KV cache (kernels/flash_decode.py)
# ---------------------------------------------------------------------------------------
__all__ += ["decode_io", "kv_cache_bytes"]


def kv_cache_bytes(tokens, layers=1, kv_heads=1, d=64, bytes_per_element=2) -> int:
    """Bytes of the KV cache holding ``tokens`` tokens: 2 (K and V) x layers x kv_heads x d x bytes.

    Multi-head attention has ``kv_heads = heads``; grouped-query fewer; multi-query 1.
    Example: ``kv_cache_bytes(1, layers=32, kv_heads=32, d=128)  # 524,288: 0.5 MiB per token``
    """
    for name, val in (("layers", layers), ("kv_heads", kv_heads), ("d", d), ("bytes_per_element", bytes_per_element)):
        validate.integer(val, name)
    validate.integer(tokens, "tokens", minimum=0)
    return 2 * layers * kv_heads * d * bytes_per_element * tokens


def decode_io(batch, heads, seqlens, d=64, bytes_per_element=2, *, kv_heads=None, n_q=1, num_splits=1,
              page_size=None, lse_bytes=4) -> IO:
    """One decoding step of ``kernels/flash_decode.py``: ``n_q`` new queries per sequence against
    caches of lengths ``seqlens`` (an int for every sequence, or one per sequence), exactly.

    Per (batch b, KV head), with G = heads / kv_heads query heads per KV head and S = num_splits:

    * split kernel (``decode_split``), S programs: read 4 B (the length) and the G n_q d Q rows
      each; read the L_b d keys and L_b d values once in all (a split reads only its own chunk);
      paged (``page_size``): one int32 per page, ceil(L_b / page_size); write G n_q (d + 1) fp32
      each (the partial output and its log-sum-exp);
    * merge kernel (``decode_merge``), per query head: read S n_q (d + 1) fp32, write n_q d.

    FLOPs: 4 n_q L_b d per query head (Q K^T and P V over every cached key). With one query
    and fp16 K and V that is 4 L d FLOPs against 4 L d bytes per KV head: intensity G, about 1
    FLOP per byte for multi-head attention (``kv_heads=heads``), ``heads`` for multi-query.
    Per generated token: divide by ``batch * n_q``.

    Example: ``decode_io(1, 32, 4096, d=128, kv_heads=8).total_bytes``
    """
    kv_heads = heads if kv_heads is None else kv_heads
    for name, val in (("batch", batch), ("heads", heads), ("kv_heads", kv_heads), ("d", d),
                      ("bytes_per_element", bytes_per_element), ("n_q", n_q), ("num_splits", num_splits)):
        validate.integer(val, name)
    if heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of heads={heads}, got {kv_heads}")
    validate.integer(page_size, "page_size", allow_none=True)
    lens = [seqlens] * batch if isinstance(seqlens, int) and not isinstance(seqlens, bool) else [int(s) for s in seqlens]
    if len(lens) != batch:
        raise ValueError(f"seqlens: expected an int or {batch} lengths (one per sequence), got {len(lens)}")
    if any(s < n_q for s in lens):
        raise ValueError(f"seqlens: expected every length >= n_q={n_q}, got {min(lens)}")
    e, g, s_ = bytes_per_element, heads // kv_heads, num_splits
    programs = batch * kv_heads * s_
    keys = sum(lens) * kv_heads                                     # (b, KV head, key) triples
    pages = sum(-(-L // page_size) for L in lens) * kv_heads if page_size else 0
    split = _part("decode_split",
                  programs * (4 + g * n_q * d * e) + 2 * keys * d * e + 4 * pages,
                  programs * g * n_q * (d + 1) * lse_bytes,
                  4 * n_q * d * g * keys)
    merge = _part("decode_merge", batch * heads * s_ * n_q * (d + 1) * lse_bytes, batch * heads * n_q * d * e)
    return split + merge


__all__ += ["queries_per_read", "mixed_batch_io"]


def queries_per_read(heads, seqlen, d=64, bytes_per_element=2, *, kv_heads=None, n_q=(1, 2, 4, 8, 16), num_splits=1):
    """One sequence's decoding step with ``n`` queries per read of its cache, for each ``n`` of
    ``n_q``: {n: :func:`decode_io`}. 1 is plain decoding; k + 1 verifies k drafted tokens at once
    (speculative decoding, Leviathan et al. 2023); a chunk of a prompt is many. The cache's
    ``2 seqlen d`` elements per KV head are read once whatever n is, the FLOPs grow with n:
    the intensity (``.arithmetic_intensity``) grows about in proportion, the bytes per query
    (``.total_bytes / n``) fall.

    Example: ``{n: io.arithmetic_intensity for n, io in queries_per_read(32, 4096, 128, kv_heads=8).items()}``
    """
    ns = [n_q] if isinstance(n_q, int) and not isinstance(n_q, bool) else list(n_q)
    if not ns:
        raise ValueError("n_q: expected a positive int or a non-empty list of them, got none")
    return {n: decode_io(1, heads, seqlen, d, bytes_per_element, kv_heads=kv_heads, n_q=n, num_splits=num_splits)
            for n in ns}


def mixed_batch_io(requests, heads, d=64, bytes_per_element=2, *, kv_heads=None, num_splits=1, page_size=None) -> IO:
    """A batch that mixes decodes and prefill chunks (continuous batching, Yu et al. 2022, Orca;
    chunked prefill, Agrawal et al. 2024, Sarathi-Serve): ``requests`` lists ``(n_q, seqlen)``,
    ``n_q`` new tokens of a sequence whose cache (the new tokens included) holds ``seqlen``.
    The attention's traffic is each request's :func:`decode_io` summed, ``flash_decode`` run once
    per request (or once per group of equal ``n_q``: the counts add over sequences). Each
    request reads its own cache, so a decode stays at its low intensity beside a chunk; what
    such batches share is the read of the weights in the linear layers (:func:`decode_step_bytes`).

    Example: ``mixed_batch_io([(1, 4000), (1, 900), (16, 512)], 32, 128, kv_heads=8).arithmetic_intensity``
    """
    reqs = list(requests)
    for r in reqs:
        if not isinstance(r, (tuple, list)) or len(r) != 2:
            raise ValueError(f"requests: expected (n_q, seqlen) pairs, got {r!r}")
        validate.integer(r[0], "requests")                          # n_q >= 1
        validate.integer(r[1], "requests")                          # seqlen >= 1
    if not reqs:
        raise ValueError("requests: expected at least one (n_q, seqlen) pair, got none")
    total = IO(0, 0, 0)
    for n, L in reqs:
        total = total + decode_io(1, heads, L, d, bytes_per_element, kv_heads=kv_heads, n_q=n,
                                  num_splits=num_splits, page_size=page_size)
    return total


# Decoding a whole model: the weights (read once per step, shared by the batch) and each sequence's cache
__all__ += ["mla_cache_bytes", "decode_step_bytes", "decode_crossover_tokens"]


def mla_cache_bytes(tokens, layers=1, d_latent=512, d_rope=64, bytes_per_element=2) -> int:
    """Bytes of a multi-head latent attention cache (DeepSeek-V2, ``attnlab.mla``) holding ``tokens``
    tokens: per token and layer one latent of ``d_latent`` plus one rotary key of ``d_rope``, shared
    by every head (against ``2 x kv_heads x d`` for :func:`kv_cache_bytes`).

    Example: ``mla_cache_bytes(1, layers=1, d_latent=512, d_rope=64)  # 1,152: 576 fp16 elements``
    """
    for name, val in (("layers", layers), ("d_latent", d_latent), ("bytes_per_element", bytes_per_element)):
        validate.integer(val, name)
    validate.integer(d_rope, "d_rope", minimum=0)
    validate.integer(tokens, "tokens", minimum=0)
    return layers * (d_latent + d_rope) * bytes_per_element * tokens


def _positive_number(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive number, got {value!r}")
    return value


def decode_step_bytes(batch, context, *, params, layers, heads, d, kv_heads=None, bytes_per_element=2,
                      cache_bytes_per_token=None) -> IO:
    """One decoding step of a whole model for ``batch`` sequences of ``context`` cached tokens each:
    an :class:`IO` with two parts.

    * ``"weights"``: all ``params`` parameters read once, ``params x e`` bytes, **shared by the
      batch** (every sequence's token is multiplied by the same matrices); FLOPs ``2 params`` per
      sequence (a multiply-add per parameter).
    * ``"kv_cache"``: **each sequence's** cache read, ``context x c`` bytes, and its new token's
      entry written, ``c`` bytes, where ``c`` is the cache per token,
      ``kv_cache_bytes(1, layers, kv_heads, d, e)`` unless ``cache_bytes_per_token`` is given (for
      instance :func:`mla_cache_bytes`); FLOPs ``4 x context x d x heads x layers`` per sequence
      (``q K^T`` and ``p V`` of every query head).

    Per generated token: divide by ``batch``. The cache's read equals the weights' when
    ``batch x context`` = :func:`decode_crossover_tokens`; below that the weights dominate (at batch 1
    a 7B fp16 model reads about 13 GB of weights per token against 2 GiB of MHA cache at 4,096 tokens).
    Activations, the embedding lookup and the logits' write are not counted.

    Example: ``decode_step_bytes(8, 4096, params=6.7e9, layers=32, heads=32, d=128).parts["kv_cache"]``
    """
    kv_heads = heads if kv_heads is None else kv_heads
    for name, val in (("batch", batch), ("layers", layers), ("heads", heads), ("kv_heads", kv_heads), ("d", d),
                      ("bytes_per_element", bytes_per_element)):
        validate.integer(val, name)
    validate.integer(context, "context", minimum=0)
    if heads % kv_heads:
        raise ValueError(f"kv_heads: expected a divisor of heads={heads}, got {kv_heads}")
    _positive_number(params, "params")
    if cache_bytes_per_token is None:
        per_token = kv_cache_bytes(1, layers, kv_heads, d, bytes_per_element)
    else:
        per_token = validate.integer(cache_bytes_per_token, "cache_bytes_per_token")
    weights = _part("weights", params * bytes_per_element, 0, 2 * params * batch)
    cache = _part("kv_cache", batch * context * per_token, batch * per_token,
                  4 * context * d * heads * layers * batch)
    return weights + cache


def decode_crossover_tokens(*, params, layers, d, kv_heads, bytes_per_element=2, cache_bytes_per_token=None) -> float:
    """``batch x context`` at which one decoding step reads as many cache bytes as weight bytes:
    ``params x e / c``, with ``c`` the cache bytes per token (as in :func:`decode_step_bytes`).

    Example: ``decode_crossover_tokens(params=6.7e9, layers=32, d=128, kv_heads=32)  # about 25,600``
    """
    for name, val in (("layers", layers), ("kv_heads", kv_heads), ("d", d), ("bytes_per_element", bytes_per_element)):
        validate.integer(val, name)
    _positive_number(params, "params")
    if cache_bytes_per_token is None:
        per_token = kv_cache_bytes(1, layers, kv_heads, d, bytes_per_element)
    else:
        per_token = validate.integer(cache_bytes_per_token, "cache_bytes_per_token")
    return params * bytes_per_element / per_token


# ---------------------------------------------------------------------------------------
# Machines and the roofline
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """peak_flops: dense fp16/bf16 tensor-core FLOP/s (CPU: fp32 vector FLOP/s);
    hbm_bandwidth: bytes/s; sram_per_sm: on-chip shared memory/L1 per SM (CPU: L2 per core), bytes."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    sram_per_sm: int
    num_sms: int
    note: str = ""

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound."""
        return self.peak_flops / self.hbm_bandwidth


def _this_machine() -> Machine:
    cores = os.cpu_count() or 1
    ghz, flops_per_cycle, l2 = 2.5, 16, 1 << 20
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        mhz = [float(line.split(":")[1]) for line in info.splitlines() if line.startswith("cpu MHz")]
        if mhz:
            ghz = mhz[0] / 1000
        if " avx512f" in info or (" avx2" in info and " fma" in info):
            flops_per_cycle = 32  # two 256-bit FMA pipes: 2 x 8 fp32 x 2 FLOPs
    except OSError:
        pass
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            s = f.read().strip()
        l2 = int(s[:-1]) * (1024 if s.endswith("K") else 1024 * 1024) if s[-1] in "KM" else int(s)
    except (OSError, ValueError):
        pass
    return Machine("this machine", cores * ghz * 1e9 * flops_per_cycle, 20e9, l2, cores,
                   note=f"rough: {cores} CPU cores x {ghz:.1f} GHz x {flops_per_cycle} fp32 FLOP/cycle; "
                        "DRAM bandwidth a guess (20 GB/s); 'SRAM' is the L2 cache per core")


MACHINES = {
    "A100": Machine("NVIDIA A100 SXM4 40GB", 312e12, 1.555e12, 192 * 1024, 108,
                    "the GPU of Dao et al. 2022 (1.5 TB/s HBM, 192 KB on-chip SRAM per SM, 108 SMs)"),
    "H100": Machine("NVIDIA H100 SXM5", 989e12, 3.35e12, 228 * 1024, 132, "dense fp16 tensor peak (no sparsity)"),
    "H200": Machine("NVIDIA H200 SXM", 989e12, 4.8e12, 228 * 1024, 132, "H100 compute with faster HBM3e"),
    "T4": Machine("NVIDIA T4", 65e12, 320e9, 64 * 1024, 40, "Colab's free GPU; fp16 tensor peak"),
    "this machine": _this_machine(),
}


@dataclass(frozen=True)
class Roofline:
    flops: float
    bytes_moved: float
    machine: Machine
    arithmetic_intensity: float
    ridge_point: float
    bound: str            # "memory" or "compute"
    time_s: float         # lower bound: max(flops / peak, bytes / bandwidth)
    attainable_flops: float

    def __repr__(self):
        return (f"Roofline({self.machine.name}: intensity {self.arithmetic_intensity:.1f} FLOP/B vs ridge "
                f"{self.ridge_point:.1f} -> {self.bound}-bound, >= {self.time_s * 1e3:.3f} ms)")


def roofline(flops, bytes_moved=None, machine="A100") -> Roofline:
    """Where work of ``flops`` FLOPs moving ``bytes_moved`` bytes sits on ``machine``'s roofline.

    ``flops`` may be an :class:`IO` (its flops and total bytes are used). ``machine`` is a key
    of :data:`MACHINES` or a :class:`Machine`.
    Example: ``roofline(flash_forward_io(1, 16, 1024, d=64, block_m=128, block_n=64), machine="H100").bound``
    """
    if isinstance(flops, IO):
        flops, bytes_moved = flops.flops, flops.total_bytes
    if bytes_moved is None or bytes_moved <= 0:
        raise ValueError(f"bytes_moved: expected a positive number, got {bytes_moved!r}")
    if isinstance(machine, str):
        if machine not in MACHINES:
            validate.one_of(machine, "machine", sorted(MACHINES))
        machine = MACHINES[machine]
    ai = flops / bytes_moved
    ridge = machine.ridge_point
    time_s = max(flops / machine.peak_flops, bytes_moved / machine.hbm_bandwidth)
    return Roofline(flops, bytes_moved, machine, ai, ridge, "memory" if ai < ridge else "compute", time_s,
                    min(machine.peak_flops, ai * machine.hbm_bandwidth))


# ---------------------------------------------------------------------------------------
# Selected-block attention (kernels/selected_attention.py): NSA's selection, DeepSeek Sparse Attention
# ---------------------------------------------------------------------------------------
__all__ += ["selected_attention_forward_io", "selected_attention_backward_io"]


def _selected_visits(batch, heads, n_q, n_k, d, bytes_per_element, block_indices, block_size, causal, kv_heads):
    """The tiles each query head visits, bool (B', heads or 1, nqb, nkb), the block size and kv_heads:
    a query head walks its KV head's list, without the future blocks under causal."""
    from attnlab.sparse import check_block_indices, selected_tiles

    _check(batch, heads, n_q, n_k, d, bytes_per_element)
    kv_heads = _check_kv_heads(heads, kv_heads)
    validate.flag(causal, "causal")
    block_size = check_block_indices(block_indices, block_size, n_q, n_k, batch=batch, kv_heads=kv_heads)
    table = selected_tiles(block_indices, n_q, n_k, block_size, causal).cpu()    # (B', H_kv or 1, nqb, nkb)
    if table.shape[1] > 1:
        table = table.repeat_interleave(heads // kv_heads, dim=1)                 # (B', heads, nqb, nkb)
    visits = int(table.sum()) * (batch // table.shape[0]) * (heads // table.shape[1])   # over all (b, query head)
    return table, block_size, kv_heads, visits


def selected_attention_forward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, *, block_indices,
                                  block_size, causal=True, lse_bytes=4, kv_heads=None, grad=False) -> IO:
    """``attnlab.kernels.selected_attention``'s forward for this ``block_indices``, exactly.

    The flash forward summed over the selected tiles (a future block under ``causal`` is dropped
    before launch, so it is not counted): per query head read Q (n_q d) and, per selected block,
    its K and V (2 bs d; fewer for a ragged last block); write O (n_q d) and L (n_q, fp32). Plus the
    int32 lists: one count per query block and one id per selected block, per query head (a GQA
    group's heads each read their KV head's list). About n_q d + 2 n_q topk d elements per head:
    linear in topk. ``kv_heads`` and ``grad`` as in :func:`flash_forward_io`.

    Example: ``selected_attention_forward_io(1, 1, 256, d=64, block_indices=select_blocks(torch.randn(1, 4, 4), 2)[:, None], block_size=64)``
    """
    n_k = n_q if n_k is None else n_k
    validate.flag(grad, "grad")
    table, bs, _, visits = _selected_visits(batch, heads, n_q, n_k, d, bytes_per_element, block_indices, block_size,
                                            causal, kv_heads)
    fwd = _flash_fwd(batch, heads, n_q, n_k, d, bytes_per_element, bs, bs, False, table, False, lse_bytes, grad=grad)
    lists = 4 * (batch * heads * table.shape[2] + visits)
    return _part("selected_fwd", fwd.bytes_read + lists, fwd.bytes_written, fwd.flops)


def selected_attention_backward_io(batch, heads, n_q, n_k=None, d=64, bytes_per_element=2, *, block_indices,
                                   block_size, causal=True, lse_bytes=4, kv_heads=None) -> IO:
    """``attnlab.kernels.selected_attention``'s backward for this ``block_indices``, exactly: the
    flash backward (preprocess, dK/dV, dQ; :func:`flash_backward_io`) over the selected tiles, plus
    the int32 lists: the dQ kernel reads the forward's (a count per query block, an id per selected
    block, per query head), the dK/dV kernel the transposed ones (a count per key block and KV head,
    and an id per selected tile for each query head of the group). Parts "bwd_preprocess",
    "bwd_dkdv", "bwd_dq", one per kernel launch."""
    n_k = n_q if n_k is None else n_k
    table, bs, kv_heads, visits = _selected_visits(batch, heads, n_q, n_k, d, bytes_per_element, block_indices,
                                                   block_size, causal, kv_heads)
    bwd = _flash_bwd(batch, heads, n_q, n_k, d, bytes_per_element, bs, bs, False, table, False, lse_bytes,
                     kv_heads=kv_heads)
    nqb, nkb = table.shape[2], table.shape[3]
    return (bwd + _part("bwd_dkdv", 4 * (batch * kv_heads * nkb + visits), 0)
            + _part("bwd_dq", 4 * (batch * heads * nqb + visits), 0))
