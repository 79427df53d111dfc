"""All-to-all sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): re-shard by heads, attend, re-shard back.

Each rank holds a shard of the sequence for all ``H`` heads. One all-to-all gives each rank the *whole*
sequence for ``H / P`` of the heads (rank j sends rank p its sequence shard of head group p); every rank
then runs ordinary single-device attention on its heads, with no communication inside; a second all-to-all
returns the output to sequence shards. The backward is the same two all-to-alls in reverse (the gradient of
an all-to-all is the opposite all-to-all). It needs ``H`` divisible by ``P``.

Bytes per rank (checked against :func:`attnlab.iomodel.ulysses_attention_bytes`): each all-to-all of a
tensor of ``B H (n/P) d`` local elements sends all but its own ``1/P`` of it, ``(P - 1) / P`` of its size;
the forward moves q, k, v and O (four tensors), the backward dO, dQ, dK and dV.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from attnlab.iomodel import attention_flops

from .ring import _check_common, _compute, check_shards, flash_lse, scaled_query

__all__ = ["ulysses_attention", "seq_to_heads", "heads_to_seq"]


def _all_to_all(pieces, group, trace, phase):
    """pieces: (P, ...) with pieces[p] for rank p -> (P, ...) with [j] from rank j."""
    pieces = pieces.contiguous()
    received = torch.empty_like(pieces)
    start = time.perf_counter()
    dist.all_to_all_single(received, pieces, group=group)
    if trace is not None:
        world = pieces.shape[0]
        off_rank = pieces[0].numel() * pieces.element_size() * (world - 1)   # our own piece never leaves
        trace.add(phase, "transfer", start, time.perf_counter(), sent=off_rank, received=off_rank)
        trace.add(phase, "wait", start, time.perf_counter())                  # a blocking collective: all exposed
    return received


def _seq_to_heads(x, group, trace, phase):
    B, H, n, d = x.shape                                             # (B, H, n/P, d) sequence shard
    world = dist.get_world_size(group)
    pieces = x.reshape(B, world, H // world, n, d).transpose(0, 1)  # (P, B, H/P, n/P, d): [p] for rank p
    got = _all_to_all(pieces, group, trace, phase)                  # (P, B, H/P, n/P, d): [j] = rank j's positions
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // world, world * n, d)   # (B, H/P, n, d) whole sequence


def _heads_to_seq(x, group, trace, phase):
    B, h, N, d = x.shape                                             # (B, H/P, n, d) head shard
    world = dist.get_world_size(group)
    pieces = x.reshape(B, h, world, N // world, d).permute(2, 0, 1, 3, 4)   # (P, B, H/P, n/P, d): [p]'s positions
    got = _all_to_all(pieces, group, trace, phase)                  # (P, B, H/P, n/P, d): [j] = rank j's heads
    return got.transpose(0, 1).reshape(B, world * h, N // world, d)          # (B, H, n/P, d)


class _SeqToHeads(torch.autograd.Function):
    # the backward applies the opposite Function (not the bare all-to-all), so that under create_graph=True the
    # gradient has a graph too: an all-to-all is linear, and double backward through it is exact
    @staticmethod
    def forward(ctx, x, group, trace, phase):
        ctx.group, ctx.trace = group, trace
        return _seq_to_heads(x, group, trace, phase)

    @staticmethod
    def backward(ctx, grad):
        return _HeadsToSeq.apply(grad, ctx.group, ctx.trace, "backward"), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, trace, phase):
        ctx.group, ctx.trace = group, trace
        return _heads_to_seq(x, group, trace, phase)

    @staticmethod
    def backward(ctx, grad):
        return _SeqToHeads.apply(grad, ctx.group, ctx.trace, "backward"), None, None, None


def seq_to_heads(x, group=None, trace=None):
    """All-to-all (B, H, n/P, d) sequence shard -> (B, H/P, n, d) head shard, differentiable."""
    return _SeqToHeads.apply(x, group, trace, "forward")


def heads_to_seq(x, group=None, trace=None):
    """All-to-all (B, H/P, n, d) head shard -> (B, H, n/P, d) sequence shard, differentiable."""
    return _HeadsToSeq.apply(x, group, trace, "forward")


def ulysses_attention(q, k, v, causal=False, group=None, attn_fn=None, *, scale=None, trace=None):
    """Exact attention over a contiguously sharded sequence by two all-to-alls (DeepSpeed-Ulysses).

    q, k, v: (B, H, n_local, d), rank r's positions [r n_local, (r + 1) n_local) for all H heads, with H
    divisible by the world size P. attn_fn: ``fn(q, k, v, causal) -> (O, L)`` (default :func:`flash_lse`),
    differentiable in O (the gradients flow through it by autograd; double backward too where ``attn_fn``
    supports it, as :func:`attention_lse` does; the Triton kernel raises). scale: the softmax scale, default
    1/sqrt(d) (applied by scaling q, see :func:`~attnlab.distributed.ring.scaled_query`). Returns O
    (B, H, n_local, d).
    Example: ``o = ulysses_attention(shard(q, P, rank), shard(k, P, rank), shard(v, P, rank), causal=True)``
    """
    if attn_fn is not None and not callable(attn_fn):
        raise TypeError(f"attn_fn: expected a callable fn(q, k, v, causal) -> (O, L) or None, got {type(attn_fn).__name__}")
    _check_common(q, k, v, causal, group, trace)
    world = dist.get_world_size(group)
    if q.shape[1] % world:
        raise ValueError(f"q: all-to-all attention gives each rank heads / world_size heads, so the heads must divide "
                         f"by the world size; got {q.shape[1]} heads on {world} ranks (use ring_attention, or a "
                         f"world size that divides {q.shape[1]})")
    q = scaled_query(q, scale)                                   # checks scale before any communication
    check_shards(q, k, v, group)
    qh, kh, vh = (seq_to_heads(t, group, trace) for t in (q, k, v))     # (B, H/P, n, d) each
    with _compute(trace, "forward"):
        oh, _ = (attn_fn or flash_lse)(qh, kh, vh, causal)              # (B, H/P, n, d) single-device attention
    if trace is not None:
        B, h, N, d = qh.shape
        trace.add_flops("forward", attention_flops(B, h, N, N, d, causal=causal))
    return heads_to_seq(oh, group, trace)
