"""All-gather context parallelism (Llama 3, arXiv:2407.21783, section 3.3.2): gather K and V, attend locally.

Each rank holds a shard of the sequence for q, k and v. One all-gather gives every rank the *whole* K and V
(every rank's shard, in rank order); the rank then attends its own queries to all the keys, with the causal
mask taken from the positions each query and key really have in the sequence, so any layout works. With the
zigzag layout (rank r holds chunks r and 2P - 1 - r of 2P, as Llama 3 does, the load balancing of lesson 11)
every rank has the same unmasked work. No merge of partial results is needed: each rank sees all the keys at
once. The backward of an all-gather is a reduce-scatter: every rank computed dK and dV for the *whole*
sequence's keys from its own queries; rank p needs the sum, over ranks, of the rows of its own shard. Here
that reduce-scatter is an all-to-all of float32 pieces followed by a local sum (gloo has no reduce-scatter;
the bytes are a reduce-scatter's: each rank sends P - 1 shard-sized pieces).

Why Llama 3 chose it over the ring: the all-gather is exposed (nothing to overlap it with), but with
grouped-query attention K and V are small next to Q (8 KV heads against 32 or more query heads), and any mask
(a document mask, say) is easy when every rank sees all the keys. The price is memory: every rank holds the
whole K and V, ``2 H_kv N d`` elements, kept for the backward (so the backward does not gather again).

Bytes per rank (checked against :func:`attnlab.iomodel.allgather_attention_bytes`): forward ``2 (P - 1)``
shards of K and V in their dtype; backward ``2 (P - 1)`` shards of dK and dV in float32.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from attnlab import validate
from attnlab.attention import scaled_dot_product_attention

from .launch import rank_device
from .ring import LAYOUTS, _check_common, _compute, check_shards, shard_indices
from .trace import Trace

__all__ = ["allgather_attention", "gather_sequence", "allgather_exactness"]


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather of (B, H, m, d) shards -> (B, H, P m, d) in rank order. Backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, trace):
        world = dist.get_world_size(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        start = time.perf_counter()
        dist.all_gather(parts, x, group=group)                         # P x (B, H, m, d)
        if trace is not None:
            sent = x.numel() * x.element_size() * (world - 1)          # our shard reaches the P - 1 others
            trace.add("forward", "transfer", start, time.perf_counter(), sent=sent, received=sent)
            trace.add("forward", "wait", start, time.perf_counter())   # a blocking collective: all exposed
        ctx.group, ctx.trace, ctx.dtype = group, trace, x.dtype
        return torch.cat(parts, dim=-2)                                 # (B, H, P m, d)

    @staticmethod
    def backward(ctx, grad):
        group, trace = ctx.group, ctx.trace
        world = dist.get_world_size(group)
        B, H, N, d = grad.shape
        pieces = grad.float().reshape(B, H, world, N // world, d).permute(2, 0, 1, 3, 4).contiguous()  # (P, B, H, m, d)
        received = torch.empty_like(pieces)                             # [j]: rank j's gradient for our keys
        start = time.perf_counter()
        dist.all_to_all_single(received, pieces, group=group)
        if trace is not None:
            sent = pieces[0].numel() * pieces.element_size() * (world - 1)
            trace.add("backward", "transfer", start, time.perf_counter(), sent=sent, received=sent)
            trace.add("backward", "wait", start, time.perf_counter())
        return received.sum(0).to(ctx.dtype), None, None                # (B, H, m, d): the reduce-scatter's sum


def gather_sequence(x, group=None, trace=None):
    """All-gather (B, H, m, d) sequence shards -> (B, H, P m, d) in rank order, differentiable (the backward is
    a reduce-scatter, summed in float32).

    Example: ``k_all = gather_sequence(k_local)   # every rank's shard, rank 0's first``
    """
    return _GatherSequence.apply(x, group, trace)


def allgather_attention(q, k, v, causal=False, group=None, layout="contiguous", *, scale=None, trace=None):
    """Exact attention over a sequence sharded across ``group``: all-gather K and V, attend the local queries.

    q: (B, H, m, d), k, v: (B, H_kv, m, d) with H a multiple of H_kv (grouped-query attention), this rank's
    shard of a sequence of ``n = P m`` positions in ``layout`` ("contiguous" or "zigzag", see
    :func:`attnlab.distributed.shard`); every rank's shards have one shape. ``causal``: query at position i
    sees keys at positions j <= i of the whole sequence. ``scale``: default 1/sqrt(d). ``trace``: a
    :class:`Trace` that records the bytes sent, the compute span and the FLOPs of the unmasked pairs.
    Returns O (B, H, m, d) in q's dtype, differentiable (dQ, dK, dV equal single-device attention's).
    Example: ``o = allgather_attention(shard(q, P, r, "zigzag"), shard(k, P, r, "zigzag"), shard(v, P, r, "zigzag"), causal=True, layout="zigzag")``
    """
    validate.one_of(layout, "layout", LAYOUTS)
    validate.qkv(q, k, v, same_length=True, gqa=True)                  # k, v may have fewer heads than q
    scale = validate.scale(scale, q.shape[-1])
    _check_common(q, q, q, causal, group, trace)                       # causal, group, trace, a process group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    m = q.shape[-2]
    n = m * world
    q_pos = shard_indices(n, world, rank, layout).to(q.device)        # (m,) where this rank's queries sit
    check_shards(q, k, v, group)
    k_all, v_all = (gather_sequence(t, group, trace) for t in (k, v))  # (B, H_kv, n, d), rank-major order
    k_pos = torch.cat([shard_indices(n, world, r, layout) for r in range(world)]).to(q.device)   # (n,)
    group_size = q.shape[1] // k.shape[1]
    with _compute(trace, "forward"):
        if group_size > 1:                                             # each KV head serves group_size query heads
            k_all, v_all = (t.repeat_interleave(group_size, dim=1) for t in (k_all, v_all))   # (B, H, n, d)
        mask = (k_pos[None, :] <= q_pos[:, None]) if causal else None  # (m, n): the real positions, any layout
        o = scaled_dot_product_attention(q, k_all, v_all, mask=mask, scale=scale)   # (B, H, m, d)
    if trace is not None:
        pairs = int(mask.sum()) if causal else m * n                   # (query, key) pairs computed with effect
        trace.add_flops("forward", 4 * q.shape[0] * q.shape[1] * pairs * q.shape[-1])
    return o


def allgather_exactness(n=24, heads=4, kv_heads=2, d=8, batch=1, layouts=LAYOUTS, causals=(False, True),
                        scale=None, seed=0):
    """A rank function for :func:`attnlab.distributed.launch`: :func:`allgather_attention` on this rank's shard
    against PyTorch's SDPA over the whole sequence (``enable_gqa``), forward and backward, float32.

    Returns ``{(layout, causal): {"O", "dQ", "dK", "dV": max |error|, "sent_forward", "sent_backward",
    "received_forward", "received_backward": bytes, "flops": this rank's forward FLOPs}}``.
    Example: ``launch(allgather_exactness, 4, 32, 8, 2, 16)``
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, d, generator=g)                   # (B, H, n, d)
    k, v = (torch.randn(batch, kv_heads, n, d, generator=g) for _ in range(2))   # (B, H_kv, n, d)
    do = torch.randn(batch, heads, n, d, generator=g)
    results = {}
    for causal in causals:
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*ref, is_causal=causal, scale=scale, enable_gqa=kv_heads != heads)
        out.backward(do)
        for layout in layouts:
            idx = shard_indices(n, world, rank, layout)
            local = [t[..., idx, :].to(device).requires_grad_() for t in (q, k, v)]   # this rank's shards
            trace = Trace(rank)
            o = allgather_attention(*local, causal, layout=layout, scale=scale, trace=trace)
            o.backward(do[..., idx, :].to(device))
            res = {name: (got.detach().cpu() - want[..., idx, :]).abs().max().item() for name, got, want in
                   (("O", o, out.detach()), ("dQ", local[0].grad, ref[0].grad),
                    ("dK", local[1].grad, ref[1].grad), ("dV", local[2].grad, ref[2].grad))}
            for phase in ("forward", "backward"):
                res[f"sent_{phase}"] = trace.bytes_sent(phase)
                res[f"received_{phase}"] = trace.bytes_received(phase)
            res["flops"] = trace.flops.get("forward", 0)
            results[layout, causal] = res
    return results
