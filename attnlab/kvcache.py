"""The KV cache of autoregressive decoding, in plain PyTorch: the reference, a paged pool, a rolling cache.

Decoding a sequence one token at a time attends the newest query to every key and value
before it. Those keys and values do not change once computed, so a model keeps them: each
token's K and V are computed once, written once into the cache, and read at every later
step. This module holds the plain versions that ``kernels/flash_decode.py`` is checked
against and that lesson 10 shows:

* :func:`decode_reference`: attention of ``Nq`` new queries against a cache of per-sequence
  lengths, with grouped-query heads and an optional page table: the cache is gathered, the
  KV heads repeated, and ``attnlab.attention.scaled_dot_product_attention`` run under the
  decoding mask (query ``i`` at position ``L - Nq + i`` sees keys ``<=`` it);
* :func:`gather_cache`: one sequence's keys (or values) out of a contiguous or paged cache;
* :func:`append_to_cache`: write each sequence's new keys and values at its current length
  (contiguous or through the block table), what ``flash_attn_with_kvcache(k=, v=)`` does before
  it attends;
* :func:`to_paged`: a contiguous cache cut into pages of a pool, in a shuffled order, and the
  block table that finds them again (vLLM's PagedAttention, Kwon et al. 2023);
* :func:`allocation_bytes`: what a contiguous cache (room for the longest request, for
  every request) wastes against pages, for ragged requests;
* :class:`KVCache`: one layer's growing cache, written once per token;
* :class:`RollingCache`: StreamingLLM's cache (Xiao et al. 2023): it keeps the first
  ``sinks`` tokens and the last ``window``, and evicts the rest.

Shapes: q (B, H_q, Nq, D); a contiguous cache (B, H_kv, S, D); a paged pool
(num_pages, H_kv, page_size, D) with a block table (B, max_pages) int32; lengths (B,) int32.

Example::

    o = decode_reference(q, k_cache, v_cache, torch.tensor([7, 3], dtype=torch.int32))
"""

from __future__ import annotations

import torch

from attnlab import validate
from attnlab.attention import scaled_dot_product_attention

__all__ = ["decode_reference", "gather_cache", "append_to_cache", "to_paged", "allocation_bytes", "KVCache", "RollingCache"]


def gather_cache(cache, b, length, block_table=None):
    """Sequence ``b``'s first ``length`` entries of a cache: (H_kv, length, D).

    cache: (B, H_kv, S, D) contiguous, or a paged pool (num_pages, H_kv, page_size, D) with
    ``block_table`` (B, max_pages): entry ``n`` lives in page ``block_table[b, n // page_size]``.

    Example: ``gather_cache(k_pages, 0, 40, block_table).shape  # (H_kv, 40, D)``
    """
    if block_table is None:
        return cache[b, :, :length]                                       # (H_kv, L, D)
    page_size = cache.shape[2]
    n_pages = -(-length // page_size)
    pages = block_table[b, :n_pages].long()                               # (n_pages,)
    kv = cache[pages]                                                     # (n_pages, H_kv, page_size, D)
    kv = kv.transpose(0, 1).reshape(cache.shape[1], n_pages * page_size, cache.shape[3])   # (H_kv, P * ps, D)
    return kv[:, :length]                                                 # (H_kv, L, D)


def append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, *, block_table=None):
    """Write each sequence's new keys and values into the cache at its current length, in place.

    k_cache, v_cache: (B, H_kv, S, D) contiguous, or a paged pool (num_pages, H_kv, page_size, D) with
    ``block_table`` (B, max_pages) int32. k_new, v_new: (B, H_kv, N_new, D). cache_seqlens: (B,) int32,
    each sequence's length *before* the append (flash-attn's ``cache_seqlens`` when it is given ``k=``
    and ``v=``): sequence b's new token t goes to position ``cache_seqlens[b] + t``, in page
    ``block_table[b, pos // page_size]`` at row ``pos % page_size`` when paged. Returns the lengths
    after the append, ``cache_seqlens + N_new`` (B,) int32, which is what
    :func:`attnlab.kernels.flash_decode` takes (its lengths count the new tokens, already written).

    flash-attn folds this write into its decoding call (``flash_attn_with_kvcache(q, k_cache, v_cache,
    k=k_new, v=v_new, cache_seqlens=...)``); here it is its own step, so that an attention call never
    writes into its inputs and the lengths keep one meaning::

        lens = append_to_cache(k_cache, v_cache, k_new, v_new, lens)    # the new tokens written
        o = flash_decode(q, k_cache, v_cache, lens)                     # and attended to

    Example: ``lens = append_to_cache(k_cache, v_cache, k1, v1, torch.tensor([5, 9], dtype=torch.int32))``
    """
    paged = block_table is not None
    layout = "(num_pages, kv_heads, page_size, head_dim)" if paged else "(batch, kv_heads, capacity, head_dim)"
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        validate.tensor(x, name, 4, layout, floating=True)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)} like k_cache, got {tuple(v_cache.shape)}")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        validate.tensor(x, name, 4, "(batch, kv_heads, new tokens, head_dim)", floating=True)
        validate.like(x, name, k_cache, "k_cache")
    if v_new.shape != k_new.shape:
        raise ValueError(f"v_new: expected shape {tuple(k_new.shape)} like k_new, got {tuple(v_new.shape)}")
    B, H_kv, n_new, D = k_new.shape
    if (k_cache.shape[1], k_cache.shape[3]) != (H_kv, D):
        raise ValueError(f"k_new: expected (batch, {k_cache.shape[1]}, new tokens, {k_cache.shape[3]}) like the "
                         f"cache's KV heads and head_dim, got shape {tuple(k_new.shape)}")
    validate.tensor(cache_seqlens, "cache_seqlens", 1, "(batch,)", dtypes=(torch.int32,))
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens: expected shape ({B},), one length per sequence, got "
                         f"{tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != k_cache.device:
        raise ValueError(f"cache_seqlens: expected device {k_cache.device} (the cache's), got {cache_seqlens.device}")
    lens = cache_seqlens.long()                                              # (B,)
    if B and int(lens.min()) < 0:
        raise ValueError(f"cache_seqlens: expected lengths >= 0, got {cache_seqlens.tolist()}")
    if paged:
        validate.tensor(block_table, "block_table", 2, "(batch, max_pages)", dtypes=(torch.int32,))
        if block_table.shape[0] != B:
            raise ValueError(f"block_table: expected {B} rows (one per sequence), got shape {tuple(block_table.shape)}")
        if block_table.device != k_cache.device:
            raise ValueError(f"block_table: expected device {k_cache.device} (the cache's), got {block_table.device}")
        page_size = k_cache.shape[2]
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != B:
            raise ValueError(f"k_new: expected batch {k_cache.shape[0]} like k_cache (or pass block_table for a "
                             f"paged cache), got shape {tuple(k_new.shape)}")
        capacity = k_cache.shape[2]
    if B and int(lens.max()) + n_new > capacity:
        raise ValueError(f"k_new: {n_new} new tokens after lengths {cache_seqlens.tolist()} pass the cache's "
                         f"capacity of {capacity} tokens")
    pos = lens[:, None] + torch.arange(n_new, device=k_cache.device)[None, :]   # (B, N_new) positions written
    b = torch.arange(B, device=k_cache.device)[:, None].expand(B, n_new)       # (B, N_new) their sequence
    if paged:
        pages = block_table.long()[b, pos // page_size]                         # (B, N_new) the page of each
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= k_cache.shape[0]):
            raise ValueError(f"block_table: expected page numbers in [0, {k_cache.shape[0]}) for the pages written, "
                             f"got [{int(pages.min())}, {int(pages.max())}]")
        rows = pos % page_size                                                  # (B, N_new) the row in it
        # cache[page, :, row] for every (b, t): advanced indices around the head slice -> (B, N_new, H_kv, D)
        k_cache[pages, :, rows] = k_new.permute(0, 2, 1, 3)
        v_cache[pages, :, rows] = v_new.permute(0, 2, 1, 3)
    else:
        k_cache[b, :, pos] = k_new.permute(0, 2, 1, 3)                          # (B, N_new, H_kv, D)
        v_cache[b, :, pos] = v_new.permute(0, 2, 1, 3)
    return (lens + n_new).to(torch.int32)


def decode_reference(q, k_cache, v_cache, cache_seqlens, block_table=None, scale=None):
    """The reference for :func:`attnlab.kernels.flash_decode`, sequence by sequence, in PyTorch.

    q (B, H_q, Nq, D); k_cache, v_cache (B, H_kv, S, D) or paged (num_pages, H_kv, page_size, D)
    with ``block_table`` (B, max_pages); cache_seqlens (B,) ints, each >= Nq. Query ``i`` of
    sequence ``b`` sits at position ``cache_seqlens[b] - Nq + i`` and sees the keys at
    positions up to it. Each KV head serves ``H_q // H_kv`` consecutive query heads.
    Returns o (B, H_q, Nq, D).

    Example: ``decode_reference(q, k, v, torch.tensor([5, 9], dtype=torch.int32))``
    """
    validate.tensor(q, "q", 4, "(batch, heads, new queries, head_dim)", floating=True)
    validate.tensor(k_cache, "k_cache", 4, floating=True)
    validate.tensor(v_cache, "v_cache", 4, floating=True)
    validate.tensor(cache_seqlens, "cache_seqlens", 1, "(batch,)")
    B, H_q, n_q, _ = q.shape
    H_kv = k_cache.shape[1]
    if H_q % H_kv:
        raise ValueError(f"k_cache: expected a number of KV heads that divides q's {H_q} heads, got {H_kv}")
    G = H_q // H_kv
    out = torch.empty_like(q)
    for b in range(B):
        L = int(cache_seqlens[b])
        if L < n_q:
            raise ValueError(f"cache_seqlens: expected every length >= {n_q}, got {L}")
        k = gather_cache(k_cache, b, L, block_table)                      # (H_kv, L, D), read in place
        v = gather_cache(v_cache, b, L, block_table)
        pos = torch.arange(L - n_q, L, device=q.device)[:, None]          # (Nq, 1) the queries' positions
        mask = torch.arange(L, device=q.device)[None, :] <= pos           # (Nq, L) True = attend
        # the G query heads of a KV head as G * Nq rows against it: the cache is never copied per query head
        grouped = q[b].reshape(H_kv, G * n_q, q.shape[-1])[None]          # (1, H_kv, G * Nq, D)
        o = scaled_dot_product_attention(grouped, k[None], v[None], mask=mask.repeat(G, 1), scale=scale)
        out[b] = o[0].reshape(H_q, n_q, -1)
    return out                                                            # (B, H_q, Nq, D)


def to_paged(k_cache, v_cache, cache_seqlens, page_size, *, generator=None):
    """Cut a contiguous cache (B, H_kv, S, D) into pages of ``page_size`` tokens, placed in a pool
    in a shuffled order (as an allocator hands out free pages), and the table that finds them.

    Only the pages a sequence uses are allocated: ``ceil(L_b / page_size)`` for sequence b.
    Returns (k_pages, v_pages) (num_pages, H_kv, page_size, D) and block_table (B, max_pages)
    int32 (unused entries 0).

    Example: ``kp, vp, table = to_paged(k, v, lens, 16, generator=torch.Generator().manual_seed(0))``
    """
    validate.integer(page_size, "page_size")
    B, H_kv, S, D = k_cache.shape
    used = [-(-int(L) // page_size) for L in cache_seqlens]
    total = sum(used)
    order = torch.randperm(total, generator=generator) if generator is not None else torch.arange(total)
    k_pages = k_cache.new_zeros((total, H_kv, page_size, D))
    v_pages = v_cache.new_zeros((total, H_kv, page_size, D))
    table = torch.zeros((B, max(used + [1])), dtype=torch.int32)
    nxt = 0
    for b in range(B):
        for p in range(used[b]):
            page = int(order[nxt])
            nxt += 1
            table[b, p] = page
            lo, hi = p * page_size, min((p + 1) * page_size, S)
            k_pages[page, :, : hi - lo] = k_cache[b, :, lo:hi]
            v_pages[page, :, : hi - lo] = v_cache[b, :, lo:hi]
    return k_pages, v_pages, table.to(k_cache.device)


def allocation_bytes(seqlens, max_len, page_size, *, layers=1, kv_heads=1, d=64, bytes_per_element=2):
    """KV-cache memory for requests of lengths ``seqlens``: reserved and used, contiguous against paged.

    A contiguous cache reserves ``max_len`` tokens per request (it cannot know how long a
    request will grow); a paged cache reserves whole pages of what is used. Bytes per token:
    ``2 (K and V) * layers * kv_heads * d * bytes_per_element``. Returns a dict of
    ``used``, ``contiguous``, ``paged`` (bytes) and the wasted fractions.

    Example: ``allocation_bytes([100, 7, 900], max_len=2048, page_size=16)["paged_waste"]``
    """
    validate.integer(max_len, "max_len")
    validate.integer(page_size, "page_size")
    per_token = 2 * layers * kv_heads * d * bytes_per_element
    lens = [int(s) for s in seqlens]
    if any(s < 0 or s > max_len for s in lens):
        raise ValueError(f"seqlens: expected lengths in [0, {max_len}], got {lens}")
    used = sum(lens) * per_token
    contiguous = len(lens) * max_len * per_token
    paged = sum(-(-s // page_size) * page_size for s in lens) * per_token
    return {"used": used, "contiguous": contiguous, "paged": paged, "per_token": per_token,
            "contiguous_waste": 1 - used / contiguous if contiguous else 0.0,
            "paged_waste": 1 - used / paged if paged else 0.0}


class KVCache:
    """One layer's KV cache for a batch: room for ``capacity`` tokens, filled left to right.

    ``k``, ``v``: (B, H_kv, capacity, D); ``length``: how many positions are valid (the same for
    every sequence of the batch). ``append(k_new, v_new)`` writes (B, H_kv, T, D) once at
    positions ``length .. length + T - 1`` and returns the valid views (B, H_kv, length, D).
    ``writes`` counts the positions written (each token once).

    Example: ``cache = KVCache(1, 4, 128, 16); k, v = cache.append(k_new, v_new)``
    """

    def __init__(self, batch, kv_heads, capacity, head_dim, *, dtype=torch.float32, device="cpu"):
        for name, val in (("batch", batch), ("kv_heads", kv_heads), ("capacity", capacity), ("head_dim", head_dim)):
            validate.integer(val, name)
        self.k = torch.zeros((batch, kv_heads, capacity, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0
        self.writes = 0

    @property
    def capacity(self):
        return self.k.shape[2]

    def append(self, k_new, v_new):
        validate.tensor(k_new, "k_new", 4, "(batch, kv_heads, new tokens, head_dim)")
        T = k_new.shape[2]
        if self.length + T > self.capacity:
            raise ValueError(f"k_new: the cache holds {self.capacity} positions; {self.length} are used, "
                             f"{T} more do not fit")
        self.k[:, :, self.length:self.length + T] = k_new                 # written once, never again
        self.v[:, :, self.length:self.length + T] = v_new
        self.length += T
        self.writes += T
        return self.k[:, :, :self.length], self.v[:, :, :self.length]     # (B, H_kv, length, D)

    def seqlens(self):
        """(B,) int32: every sequence's valid length, for :func:`attnlab.kernels.flash_decode`."""
        return torch.full((self.k.shape[0],), self.length, dtype=torch.int32, device=self.k.device)


class RollingCache(KVCache):
    """StreamingLLM's cache (Xiao et al. 2023): keep the first ``sinks`` tokens and the last
    ``window``; a token that falls out of the window is evicted, the sinks never are.

    Holds at most ``sinks + window`` positions. ``append`` writes the new tokens' K and V,
    evicts what falls out of the window, and returns the kept (B, H_kv, kept, D) views, sinks
    first, then the window in order. ``positions`` lists the original positions kept: the
    mask ``attnlab.mask_mods.sink_window(sinks, window)`` selects the same keys.

    Example: ``cache = RollingCache(1, 4, 16, sinks=4, window=64)``
    """

    def __init__(self, batch, kv_heads, head_dim, *, sinks, window, dtype=torch.float32, device="cpu"):
        validate.integer(sinks, "sinks", minimum=0)
        validate.integer(window, "window")
        super().__init__(batch, kv_heads, sinks + window, head_dim, dtype=dtype, device=device)
        self.sinks, self.window = sinks, window
        self.positions = []           # the original position of each kept slot
        self.seen = 0                 # tokens appended so far

    def append(self, k_new, v_new):
        validate.tensor(k_new, "k_new", 4, "(batch, kv_heads, new tokens, head_dim)")
        for t in range(k_new.shape[2]):
            if self.length == self.capacity:          # full: drop the oldest token after the sinks
                s = self.sinks
                self.k[:, :, s:-1] = self.k[:, :, s + 1:].clone()
                self.v[:, :, s:-1] = self.v[:, :, s + 1:].clone()
                del self.positions[s]
                self.length -= 1
            self.k[:, :, self.length] = k_new[:, :, t]
            self.v[:, :, self.length] = v_new[:, :, t]
            self.positions.append(self.seen)
            self.length += 1
            self.seen += 1
            self.writes += 1
        return self.k[:, :, :self.length], self.v[:, :, :self.length]
