"""The references of exercise 11_across_devices (never shown in the exercise): the maths is the library's
(:mod:`attnlab.distributed`, the bytes :mod:`attnlab.iomodel`); specific to the exercise are one rank's ring step
as a function of the shard it holds, and the schedule as a table of block kinds."""

import torch

from attnlab import iomodel
from attnlab.distributed import attention_lse, chunk_ids, merge_partials, shard_indices
from attnlab.distributed.ring import _visible

SKIPPED, DIAGONAL, FULL = 0, 1, 2   # a block's kind in the schedule's table
_KIND = {None: SKIPPED, "diagonal": DIAGONAL, "full": FULL}


def merge_two(o1, l1, o2, l2):
    """(O, L) over the union of two partials' keys, float32; a row with no keys on either side is O = 0, L = -inf."""
    return merge_partials(o1, l1, o2, l2)


def shard_positions(n, world_size, rank, layout="contiguous"):
    """The positions of a length-n sequence rank ``rank`` of ``world_size`` holds, int64, in order."""
    return shard_indices(n, world_size, rank, layout)


def ring_schedule(rank, world_size, step, layout="contiguous", causal=True):
    """(src, work): the rank whose K/V shard ``rank`` holds at ``step``, and an int64 (c, c) table, query chunk i
    of ``rank`` (rows) against key chunk j of ``src`` (columns): 2 full, 1 diagonal (causal inside), 0 skipped."""
    src = (rank - step) % world_size
    work = torch.tensor([[_KIND[_visible(a, b, causal)] for b in chunk_ids(src, world_size, layout)]
                         for a in chunk_ids(rank, world_size, layout)], dtype=torch.int64)
    return src, work


def ring_step(o, lse, q, k, v, rank, step, world_size, causal=False, layout="contiguous"):
    """One ring step of ``rank`` holding k, v (rank (rank - step) % P's shard): (o, lse, sent), its running result
    merged with this shard's blocks, float32, and the bytes it forwards (k and v, except at the last step)."""
    src, work = ring_schedule(rank, world_size, step, layout, causal)
    c = work.shape[0]
    o_chunks, l_chunks = list(o.float().chunk(c, dim=2)), list(lse.float().chunk(c, dim=2))
    for i, qa in enumerate(q.chunk(c, dim=2)):
        for j, (kb, vb) in enumerate(zip(k.chunk(c, dim=2), v.chunk(c, dim=2))):
            if work[i, j] != SKIPPED:
                o_ab, l_ab = attention_lse(qa, kb, vb, causal=bool(work[i, j] == DIAGONAL))
                o_chunks[i], l_chunks[i] = merge_partials(o_chunks[i], l_chunks[i], o_ab, l_ab)
    sent = 0 if step == world_size - 1 else k.numel() * k.element_size() + v.numel() * v.element_size()
    return torch.cat(o_chunks, dim=2), torch.cat(l_chunks, dim=2), sent


def comm_bytes(world_sizes, n=48, heads=12, d=8, kv_heads=None):
    """Bytes one rank sends in the forward (batch 1, float32), int64 (2, len(world_sizes)): row 0 the ring (rank 0
    driven through its P steps, its sends added up), row 1 the all-to-all; K and V have ``kv_heads`` heads."""
    kv = heads if kv_heads is None else kv_heads
    ring = []
    for p in world_sizes:
        q, k, v = (torch.zeros(1, kv, n // p, d) for _ in range(3))   # one shard: what is sent depends on its size
        o, lse, sent = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf")), 0
        for step in range(p):
            o, lse, nbytes = ring_step(o, lse, q, k, v, 0, step, p)
            sent += nbytes
        ring.append(sent)
    return torch.tensor([ring, [iomodel.ulysses_attention_bytes(1, heads, n, d, p, 4, kv_heads=kv_heads)
                                for p in world_sizes]], dtype=torch.int64)
