"""Rank functions that lessons, tests and benchmarks ``launch``: importable, so spawned processes can run them.

Each runs on every rank of a group started by :func:`attnlab.distributed.launch` (or ``torchrun``) and returns
a small, picklable result for that rank. Inputs are made from a seed, identically on every rank, and each
rank keeps its own shard, so a rank can also compute the single-device reference itself.

* :func:`exactness`: ring (both layouts) and Ulysses attention against SDPA, forward and backward, with bytes.
* :func:`profile`: one timed forward + backward with a :class:`~attnlab.distributed.Trace` per rank.
* :func:`longest_sequence`: the longest sequence whose per-rank peak memory fits a budget, for 1..P ranks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .launch import rank_device
from .ring import attention_lse, flash_lse, ring_attention, shard_indices
from .trace import Trace
from .ulysses import ulysses_attention

__all__ = ["exactness", "profile", "profile_methods", "longest_sequence", "METHODS", "attn_fn", "run"]

METHODS = {"ring-contiguous": ("ring", "contiguous"), "ring-zigzag": ("ring", "zigzag"),
           "ulysses": ("ulysses", "contiguous")}


def tiled_lse(q, k, v, causal=False):
    """attnlab.tiled's FlashAttention in PyTorch as an ``attn_fn`` (memory linear in the sequence)."""
    from attnlab.tiled import tiled_attention
    return tiled_attention(q, k, v, causal=causal, block_m=64, block_n=64, return_lse=True)


def attn_fn(name):
    """``"plain"`` (:func:`attention_lse`), ``"flash"`` (the Triton kernel) or ``"tiled"`` (attnlab.tiled)."""
    fns = {"plain": attention_lse, "flash": flash_lse, "tiled": tiled_lse}
    if name not in fns:
        raise ValueError(f"attn: expected one of {tuple(fns)}, got {name!r}")
    return fns[name]


def _inputs(n, heads, d, batch, seed, count=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, d, generator=g) for _ in range(count)]    # (B, H, n, d) each


def run(method, q, k, v, causal, attn="plain", trace=None, group=None):
    """One sequence-parallel attention call on this rank's shards by ``method`` (a key of :data:`METHODS`)."""
    kind, layout = METHODS[method]
    if kind == "ring":
        return ring_attention(q, k, v, causal, group=group, layout=layout, attn_fn=attn_fn(attn), trace=trace)
    return ulysses_attention(q, k, v, causal, group=group, attn_fn=attn_fn(attn), trace=trace)


def exactness(n=24, heads=12, d=8, batch=1, attn="plain", methods=tuple(METHODS), causals=(False, True), seed=0):
    """Max |error| of O, dQ, dK, dV on this rank's shard against SDPA on the whole sequence, and bytes sent.

    Returns ``{(method, causal): {"O": .., "dQ": .., "dK": .., "dV": .., "sent_forward": .., "sent_backward": ..,
    "received_forward": .., "received_backward": ..}}``; Ulysses is left out where heads do not divide by P.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    q, k, v, do = _inputs(n, heads, d, batch, seed)
    results = {}
    for causal in causals:
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*ref, is_causal=causal)                # (B, H, n, d)
        out.backward(do)
        for method in methods:
            kind, layout = METHODS[method]
            if kind == "ulysses" and heads % world:
                continue
            idx = shard_indices(n, world, rank, layout)
            local = [t[..., idx, :].to(device).requires_grad_() for t in (q, k, v)]  # (B, H, n/P, d) each
            trace = Trace(rank)
            o = run(method, *local, causal, attn=attn, trace=trace)
            o.backward(do[..., idx, :].to(device))
            errors = {name: (got.detach().cpu() - want[..., idx, :]).abs().max().item() for name, got, want in
                      (("O", o, out.detach()), ("dQ", local[0].grad, ref[0].grad),
                       ("dK", local[1].grad, ref[1].grad), ("dV", local[2].grad, ref[2].grad))}
            for phase in ("forward", "backward"):
                errors[f"sent_{phase}"] = trace.bytes_sent(phase)
                errors[f"received_{phase}"] = trace.bytes_received(phase)
            results[method, causal] = errors
    return results


def profile(method="ring-contiguous", n=1024, heads=4, d=32, batch=1, causal=False, attn="plain", backward=True,
            seed=0):
    """One forward (+ backward) on this rank, after a warm-up, between barriers; returns its timeline.

    Returns ``{"rank", "t0", "t1", "events": [(phase, kind, start, end), ...], "forward": summary,
    "backward": summary}`` with times from ``time.perf_counter()`` (one clock for the machine's processes)
    and summaries from :meth:`Trace.summary`. ``t1 - t0`` is this rank's span; the slowest rank's sets the step.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    q, k, v, do = _inputs(n, heads, d, batch, seed)
    idx = shard_indices(n, world, rank, METHODS[method][1])
    local = [t[..., idx, :].to(device) for t in (q, k, v, do)]

    def once(trace):
        qkv = [t.clone().requires_grad_() for t in local[:3]]
        o = run(method, *qkv, causal, attn=attn, trace=trace)
        if backward:
            o.backward(local[3])
        if device.type == "cuda":
            torch.cuda.synchronize()

    once(None)                                     # warm-up: first calls pay for allocation and compilation
    dist.barrier()
    trace = Trace(rank)
    t0 = time.perf_counter()
    once(trace)
    t1 = time.perf_counter()
    dist.barrier()
    return {"rank": rank, "world_size": world, "t0": t0, "t1": t1,
            "events": [(e.phase, e.kind, e.start, e.end) for e in trace.events],
            "forward": trace.summary("forward"), "backward": trace.summary("backward")}


def longest_sequence(budget_bytes, d=32, heads=1, batch=1, world_sizes=None, attn="tiled", step=64, n_start=256,
                     n_max=1 << 16, seed=0):
    """For each world size P (a subgroup of the first P ranks), the longest sequence whose ring forward fits.

    A probe of length n runs ring attention over n positions on P ranks (inputs made inside, so counted) and
    measures each rank's peak allocated memory (:func:`attnlab.measure.peak_memory`); it fits when the
    largest rank's peak is within ``budget_bytes``. The search starts at ``n_start * P``, halves or doubles
    until it brackets the limit, then bisects on multiples of ``step`` (a multiple of every P). Returns, on
    every rank, ``{P: {"n", "peak_bytes", "n_over", "peak_over", "probes": [(n, peak), ...]}}``.
    """
    from attnlab.measure import peak_memory
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    world_sizes = list(world_sizes or range(1, world + 1))
    found = {}
    for P in world_sizes:
        group = dist.new_group(list(range(P)))               # every rank takes part in new_group
        if rank < P:
            probes = {}

            def fits(n):
                if n not in probes:
                    def call():
                        g = torch.Generator().manual_seed(seed + rank)
                        q, k, v = (torch.randn(batch, heads, n // P, d, generator=g).to(device) for _ in range(3))
                        return ring_attention(q, k, v, group=group, attn_fn=attn_fn(attn))

                    with torch.no_grad():
                        _, peak = peak_memory(call, device=device)
                    peak = torch.tensor([peak], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
                    probes[n] = int(peak.item())
                return probes[n] <= budget_bytes

            start = min(n_start * P, n_max)                   # memory per rank ~ n / P: start near the answer
            lo, hi = (start, None) if fits(start) else (None, start)
            while lo is None and hi > step:                   # halve until one fits
                nxt = max(hi // 2 // step * step, step)
                lo, hi = (nxt, hi) if fits(nxt) else (None, nxt)
            while lo is not None and hi is None and lo < n_max:   # double until one does not
                nxt = min(2 * lo, n_max)
                lo, hi = (nxt, None) if fits(nxt) else (lo, nxt)
            while lo is not None and hi is not None and hi - lo > step:   # bisect on multiples of step
                mid = (lo + hi) // 2 // step * step
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            found[P] = {"n": lo, "peak_bytes": probes.get(lo), "n_over": hi, "peak_over": probes.get(hi),
                        "probes": sorted(probes.items())}
        dist.barrier()
    return found


def profile_methods(methods=tuple(METHODS), **kwargs):
    """:func:`profile` for each method in turn on this group (one launch for all): ``{method: profile}``.
    Ulysses is skipped where the heads do not divide by the world size."""
    heads, world = kwargs.get("heads", 4), dist.get_world_size()
    return {m: profile(m, **kwargs) for m in methods if not (METHODS[m][0] == "ulysses" and heads % world)}
