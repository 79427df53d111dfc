"""Ring attention (Liu, Zaharia and Abbeel 2023): the sequence sharded across ranks, K/V shards passed round a ring.

Every rank keeps its shard of the queries. The key/value shards travel round the ring: at step ``s`` rank
``r`` holds the keys and values of rank ``r - s``, posts their transfer to rank ``r + 1`` (and the receive of
the next shard from rank ``r - 1``) with ``batch_isend_irecv``, computes attention of its queries against the
shard it holds while the transfer is in flight, and merges that partial result into its running one. After
``P`` steps every query has seen every key, and the output is exact: the merge is lesson 07's online softmax,
one shard at a time instead of one tile at a time (:func:`merge_partials`):

    L = log(exp(L_1) + exp(L_2)),   O = exp(L_1 - L) O_1 + exp(L_2 - L) O_2

The backward (an ``autograd.Function``) walks the same ring again. Every rank recomputes, per block, the
probabilities from the *global* log-sum-exp it saved, ``P = exp(q k^T * scale - L)``, exactly as
FlashAttention's backward does within one device (lesson 07), so no gradient through the blocks' ``L`` is
needed. The global ``L`` that ``return_lse`` gives is differentiable: its gradient ``dlse`` enters as
``D - dlse`` (dL_i/dS_ij = P_ij), as in FlashAttention's backward:

    dV += P^T dO,   dP = dO V^T,   dS = P * (dP - D) with D = rowsum(dO * O) - dlse,
    dQ += dS K * scale,   dK += dS^T Q * scale

dQ stays at home; the dK/dV of a shard are accumulated by every rank it visits and travel round the ring
with it, one step behind, until they arrive back at the shard's owner.

Causal masks and layouts: with ``layout="contiguous"`` rank ``r`` holds positions ``[r n/P, (r+1) n/P)``; under
a causal mask its queries need only the shards of ranks ``<= r``, so rank 0 does one block and rank ``P - 1``
does ``P``. ``layout="zigzag"`` cuts the sequence into ``2P`` chunks and gives rank ``r`` chunks ``r`` and
``2P - 1 - r``, one early and one late, so every rank does the same work (the imbalance Brandon et al. 2023,
Striped Attention, fix by striping). :func:`shard` and :func:`unshard` move a whole sequence to and from a
layout.

Bytes each rank sends (and receives), checked against :func:`attnlab.iomodel.ring_attention_bytes`:
forward ``2 (P - 1)`` shards of K and V; backward the same again plus ``P`` shards of dK and dV (float32).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from attnlab import validate
from attnlab.attention import causal_mask
from attnlab.iomodel import attention_flops

from .trace import Trace

__all__ = ["ring_attention", "RingAttention", "scaled_query", "merge_partials", "attention_lse", "flash_lse", "block_backward", "shard", "unshard",
           "shard_indices", "chunk_ids", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")


# ---------------------------------------------------------------------------------------------
# the pieces: one block's attention with its log-sum-exp, the merge, one block's backward
# ---------------------------------------------------------------------------------------------

def attention_lse(q, k, v, causal=False):
    """Plain-PyTorch attention returning (O, L): the reference ``attn_fn`` (scale 1/sqrt(head_dim)).

    q: (B, H, m, d), k, v: (B, H, n, d) -> O (B, H, m, d) in q's dtype, L (B, H, m) float32, the natural
    log-sum-exp of each row's scaled scores. ``causal`` is top-left aligned, as SDPA's ``is_causal``.
    Example: ``o, lse = attention_lse(q, k, v, causal=True)``
    """
    s = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])        # (B, H, m, n)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], device=q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                               # (B, H, m)
    o = torch.exp(s - lse[..., None]) @ v.float()                                  # (B, H, m, d)
    return o.to(q.dtype), lse


def flash_lse(q, k, v, causal=False):
    """The course's Triton kernel as an ``attn_fn``: ``attnlab.kernels.flash_attention(..., return_lse=True)``."""
    from attnlab.kernels import flash_attention   # imported here: ring attention itself needs no Triton
    return flash_attention(q, k, v, causal=causal, return_lse=True)


def merge_partials(o1, l1, o2, l2):
    """Merge two partial attention results over disjoint sets of keys into the result over their union.

    o1, o2: (B, H, m, d) outputs, each normalised over its own keys; l1, l2: (B, H, m) their log-sum-exps.
    Returns (O, L), float32: ``L = logaddexp(L1, L2)``, ``O = exp(L1 - L) O1 + exp(L2 - L) O2``. A row with
    no keys on either side (L = -inf) stays O = 0, L = -inf.
    Example: ``o, lse = merge_partials(*attention_lse(q, k[..., :4, :], v[..., :4, :]), *attention_lse(q, k[..., 4:, :], v[..., 4:, :]))``
    """
    l1, l2 = l1.float(), l2.float()
    lse = torch.logaddexp(l1, l2)                                                  # (B, H, m)
    empty = torch.isneginf(lse)
    w1 = torch.where(empty, 0.0, torch.exp(l1 - lse))[..., None]                   # (B, H, m, 1)
    w2 = torch.where(empty, 0.0, torch.exp(l2 - lse))[..., None]
    o = o1.float() * w1                                                            # (B, H, m, d) one new tensor,
    return o.addcmul_(o2.float(), w2), lse                                         # the second term added in place


def block_backward(do, q, k, v, lse, delta, causal=False):
    """One block's share of the gradients, from the *global* log-sum-exp ``lse`` and ``delta = rowsum(dO * O)``.

    do, q: (B, H, m, d); k, v: (B, H, n, d); lse, delta: (B, H, m) float32. Returns (dq, dk, dv), float32:
    this block's terms of the sums over key blocks (dq) and query blocks (dk, dv).
    Example: ``dq, dk, dv = block_backward(do, q, k, v, lse, (do * o).sum(-1))``
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v, do = q.float(), k.float(), v.float(), do.float()
    s = (q @ k.transpose(-2, -1)) * scale                                          # (B, H, m, n)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], device=q.device), float("-inf"))
    p = torch.exp(s - lse[..., None])                                              # (B, H, m, n) global softmax
    dv = p.transpose(-2, -1) @ do                                                  # (B, H, n, d)
    dp = do @ v.transpose(-2, -1)                                                  # (B, H, m, n)
    ds = p * (dp - delta[..., None])                                               # (B, H, m, n)
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


# ---------------------------------------------------------------------------------------------
# layouts: which chunks of the sequence a rank holds
# ---------------------------------------------------------------------------------------------

def chunk_ids(rank, world_size, layout="contiguous"):
    """The chunks rank ``rank`` holds, in order: contiguous ``[rank]`` of P chunks; zigzag ``[rank, 2P-1-rank]`` of 2P."""
    validate.one_of(layout, "layout", LAYOUTS)
    return [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]


def shard_indices(n, world_size, rank, layout="contiguous"):
    """The positions of a length-``n`` sequence that ``rank`` holds: a LongTensor of n / world_size positions.

    Example: ``shard_indices(8, 2, 0, "zigzag")  # tensor([0, 1, 6, 7])``
    """
    validate.integer(n, "n")
    validate.integer(world_size, "world_size")
    validate.integer(rank, "rank", minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
    n_chunks = world_size * (1 if validate.one_of(layout, "layout", LAYOUTS) == "contiguous" else 2)
    if n % n_chunks:
        raise ValueError(f"n: the {layout} layout cuts the sequence into {n_chunks} equal chunks, so n must be a "
                         f"multiple of {n_chunks}; got n = {n} (pad the sequence)")
    c = n // n_chunks
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, world_size, layout)])


def shard(x, world_size, rank, layout="contiguous"):
    """Rank ``rank``'s shard of ``x`` (..., seq, d) along the sequence dim (-2).

    Example: ``q_local = shard(q, 4, rank, "zigzag")``
    """
    validate.tensor(x, "x")
    return x.index_select(-2, shard_indices(x.shape[-2], world_size, rank, layout).to(x.device))


def unshard(shards, layout="contiguous"):
    """The whole sequence back from the list of every rank's shard (rank order), inverse of :func:`shard`."""
    world_size = len(shards)
    n = sum(s.shape[-2] for s in shards)
    order = torch.cat([shard_indices(n, world_size, r, layout) for r in range(world_size)])
    whole = torch.cat(list(shards), dim=-2)
    return whole.index_select(-2, torch.argsort(order).to(whole.device))


# ---------------------------------------------------------------------------------------------
# the ring: post a transfer to the next rank, wait for it later
# ---------------------------------------------------------------------------------------------

def _global(group, r):
    return r if group is None else dist.get_global_rank(group, r)


class _Transfer:
    """Sends ``tensors`` to the next rank and receives same-shaped ones from the previous, in flight until ``wait``."""

    def __init__(self, tensors, group, trace, phase, tag):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        nxt, prv = _global(group, (rank + 1) % world), _global(group, (rank - 1) % world)
        # gloo sends only contiguous tensors; q, k, v may be views (slices of a packed qkv, as
        # ring-flash-attention passes them): what is sent is made contiguous (a copy only for such views)
        tensors = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, nxt, group, tag + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, b, prv, group, tag + i) for i, b in enumerate(self.received)]
        self.trace, self.phase = trace, phase
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.start = time.perf_counter()
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self):
        waited = time.perf_counter()
        for req in self.requests:
            req.wait()
        end = time.perf_counter()
        if self.trace is not None:
            self.trace.add(self.phase, "transfer", self.start, end, sent=self.nbytes, received=self.nbytes)
            self.trace.add(self.phase, "wait", waited, end)
        return self.received


def _visible(a, b, causal):
    """How query chunk ``a`` attends to key chunk ``b``: "full", "diagonal" (causal inside) or None (skipped)."""
    if not causal or a > b:
        return "full"
    return "diagonal" if a == b else None


def _blocks(rank, world, layout, x):
    return list(zip(chunk_ids(rank, world, layout), x.chunk(len(chunk_ids(rank, world, layout)), dim=-2)))


def _record_flops(trace, phase, q, kb, mode):
    if trace is not None:
        B, H, m, d = q.shape
        trace.add_flops(phase, attention_flops(B, H, m, kb.shape[-2], d, causal=mode == "diagonal"))


def _compute(trace, phase):
    return trace.compute(phase) if trace is not None else _Nothing()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, group, layout, attn_fn, trace):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        q_blocks = _blocks(rank, world, layout, q)              # [(chunk id, (B, H, c, d)), ...]
        out = [None] * len(q_blocks)                            # running (O, L) per query chunk
        k_cur, v_cur = k, v                                     # (B, H, n_local, d): rank - step's shard
        for step in range(world):
            src = (rank - step) % world
            transfer = _Transfer([k_cur, v_cur], group, trace, "forward", 0) if step < world - 1 else None
            with _compute(trace, "forward"):                    # overlaps the transfer just posted
                for (a, qa), i in zip(q_blocks, range(len(q_blocks))):
                    for (b, kb), (_, vb) in zip(_blocks(src, world, layout, k_cur), _blocks(src, world, layout, v_cur)):
                        mode = _visible(a, b, causal)
                        if mode is None:
                            continue                            # a causal block above the diagonal: no work
                        o_ab, l_ab = attn_fn(qa, kb, vb, mode == "diagonal")
                        _record_flops(trace, "forward", qa, kb, mode)
                        out[i] = (o_ab.float(), l_ab.float()) if out[i] is None else merge_partials(*out[i], o_ab, l_ab)
            if transfer is not None:
                k_cur, v_cur = transfer.wait()
        o = torch.cat([o_i for o_i, _ in out], dim=-2).to(q.dtype)   # (B, H, n_local, d)
        lse = torch.cat([l_i for _, l_i in out], dim=-1)             # (B, H, n_local) float32
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.group, ctx.layout, ctx.trace = causal, group, layout, trace
        ctx.set_materialize_grads(False)                        # an unused output sends None, not zeros
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        validate.no_double_backward("ring_attention")
        q, k, v, o, lse = ctx.saved_tensors
        causal, group, layout, trace = ctx.causal, ctx.group, ctx.layout, ctx.trace
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if do is None:                                           # only L was used
            do = torch.zeros_like(o)
        delta = (do.float() * o.float()).sum(-1)                 # (B, H, n_local) D = rowsum(dO * O)
        if dlse is not None:
            # L_i = log sum_j exp(S_ij) has dL_i/dS_ij = P_ij, so a gradient into L adds dlse_i P_ij to dS_ij:
            # dS = P * (dP - (D - dlse)), as in flash_attention's backward (its preprocess folds dlse into D)
            delta = delta - dlse.float()                         # (B, H, n_local)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        rows = [(a, qa, dqa, doa, la, da) for (a, qa), (_, dqa), (_, doa), (_, la), (_, da) in zip(
            _blocks(rank, world, layout, q), _blocks(rank, world, layout, dq), _blocks(rank, world, layout, do),
            _blocks(rank, world, layout, lse[..., None]), _blocks(rank, world, layout, delta[..., None]))]
        k_cur, v_cur = k, v
        incoming = None                                          # dK/dV of the shard we hold, from rank - 1
        for step in range(world):
            src = (rank - step) % world
            transfer = _Transfer([k_cur, v_cur], group, trace, "backward", 0) if step < world - 1 else None
            dk_blk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)   # this rank's share for src's K
            dv_blk = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            with _compute(trace, "backward"):
                cols = list(zip(_blocks(src, world, layout, k_cur), _blocks(src, world, layout, v_cur),
                                _blocks(src, world, layout, dk_blk), _blocks(src, world, layout, dv_blk)))
                for a, qa, dqa, doa, la, da in rows:
                    for (b, kb), (_, vb), (_, dkb), (_, dvb) in cols:
                        mode = _visible(a, b, causal)
                        if mode is None:
                            continue
                        g_q, g_k, g_v = block_backward(doa, qa, kb, vb, la[..., 0], da[..., 0], mode == "diagonal")
                        _record_flops(trace, "backward", qa, kb, mode)
                        dqa += g_q                              # views: these add into dq, dk_blk, dv_blk
                        dkb += g_k
                        dvb += g_v
            if incoming is not None:                             # what the ranks before us added for this shard
                dk_in, dv_in = incoming.wait()
                dk_blk += dk_in
                dv_blk += dv_in
            if world == 1:                                       # alone: the shard never leaves, nor do its grads
                return dq.to(q.dtype), dk_blk.to(k.dtype), dv_blk.to(v.dtype), None, None, None, None, None
            incoming = _Transfer([dk_blk, dv_blk], group, trace, "backward", 2)    # one step behind K, V
            if transfer is not None:
                k_cur, v_cur = transfer.wait()
        dk, dv = incoming.wait()                                 # our own shard's, back from its trip round the ring
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


RingAttention = _RingAttention   # a public name for the lesson that shows it (the private name stays)


def check_shards(q, k, v, group=None):
    """Every rank's (q, k, v) shards have one shape: checked by one all_gather of 12 integers, so that every
    rank raises the same ValueError for ragged shards (instead of one rank hanging in the ring)."""
    shapes = torch.tensor([list(q.shape), list(k.shape), list(v.shape)], dtype=torch.int64)   # (3, 4)
    device = q.device if (dist.get_backend(group) == "nccl") else torch.device("cpu")
    gathered = [torch.empty_like(shapes, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, shapes.to(device), group=group)
    seen = [tuple(tuple(row) for row in g.tolist()) for g in gathered]
    if len(set(seen)) > 1:
        detail = ", ".join(f"rank {r}: q {s[0]}, k {s[1]}, v {s[2]}" for r, s in enumerate(seen))
        raise ValueError(f"q, k, v: every rank must hold shards of one shape (ragged shards are not supported; "
                         f"pad the sequence to a multiple of the world size); got {detail}")


def scaled_query(q, scale):
    """q such that attention at the default scale 1/sqrt(d) is attention of the given q at ``scale``:
    ``q * (scale * sqrt(d))`` (q itself for None), so an ``attn_fn(q, k, v, causal)`` needs no scale argument.
    Example: ``attention_lse(scaled_query(q, 0.3), k, v)  # softmax(0.3 q k^T) v``"""
    scale = validate.scale(scale, q.shape[-1])
    default = 1.0 / math.sqrt(q.shape[-1])
    return q if scale == default else q * (scale / default)


def _check_common(q, k, v, causal, group, trace):
    validate.qkv(q, k, v, same_length=True)
    validate.flag(causal, "causal")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if trace is not None and not isinstance(trace, Trace):
        raise TypeError(f"trace: expected an attnlab.distributed.Trace or None, got {type(trace).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("no process group: call this inside attnlab.distributed.launch(...) or a script "
                           "started by torchrun (attnlab.distributed.init_from_env())")


def ring_attention(q, k, v, causal=False, group=None, layout="contiguous", attn_fn=None, *, scale=None,
                   return_lse=False, trace=None):
    """Exact attention over a sequence sharded across the ranks of ``group``; K/V shards travel round a ring.

    q, k, v: (B, H, n_local, d), this rank's shard of the sequence in ``layout`` ("contiguous": positions
    [rank n_local, (rank + 1) n_local); "zigzag": chunks rank and 2P - 1 - rank of 2P, see :func:`shard`);
    every rank's shards have one shape; views with a contiguous last dim are fine (what travels is made
    contiguous). attn_fn: ``fn(q, k, v, causal) -> (O, L)`` for one block with scale 1/sqrt(d) (default
    :func:`flash_lse`, the course's Triton kernel; :func:`attention_lse` in plain PyTorch). scale: the softmax
    scale, default 1/sqrt(d) (any other is applied by scaling q by ``scale * sqrt(d)``, so every ``attn_fn``
    keeps its signature). Returns O (B, H, n_local, d), differentiable (dQ, dK, dV equal single-device
    attention's), and with ``return_lse`` also L (B, H, n_local) float32, differentiable too. ``trace``: a
    :class:`Trace` that records bytes and times. Double backward (``create_graph=True``) raises.
    Example: ``o = ring_attention(shard(q, P, rank), shard(k, P, rank), shard(v, P, rank), causal=True)``
    """
    validate.one_of(layout, "layout", LAYOUTS)
    if attn_fn is not None and not callable(attn_fn):
        raise TypeError(f"attn_fn: expected a callable fn(q, k, v, causal) -> (O, L) or None, got {type(attn_fn).__name__}")
    _check_common(q, k, v, causal, group, trace)
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"q: the zigzag layout holds two equal chunks per rank, so the local sequence length must "
                         f"be even; got shape {tuple(q.shape)}")
    q = scaled_query(q, scale)                                   # checks scale before any communication
    check_shards(q, k, v, group)
    o, lse = _RingAttention.apply(q, k, v, causal, group, layout, attn_fn or flash_lse, trace)
    return (o, lse) if return_lse else o
