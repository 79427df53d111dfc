"""The checks of exercise 11_across_devices: one table per graded part (:mod:`attnlab.grading.engine`), in ``TABLES``.

- ``ring-forward``: the learner's ``ring_step`` driven round a ring simulated in this process (the grader's learner
  runs in fresh processes of a sandbox, with no process group): at step t every rank r gets the K/V shard of rank
  (r - t) % P and the running (O, L) its own step t - 1 returned; each step is compared with the reference's step
  from the same state, then the ranks' final (O, L) with single-device attention over the whole sequence, and the
  bytes each rank said it sent with ``attnlab.iomodel.ring_attention_bytes``;
- ``ring-group``: the learner's ``ring_forward`` on every rank of a real gloo group of 1 to 4 ranks, forked by the
  process that holds the learner's functions (:mod:`attnlab.distributed.group`; a deadlock is stopped after 10 s, a
  rank that raised is named): every rank's (O, L) against single-device attention over the whole sequence, a wrong
  one diagnosed by playing the known wrong rings here with the reference's step; and the bytes sent, read under
  ``attnlab grade`` from the loopback of the sandbox's own network namespace, outside the learner's processes (all
  ranks together against P x ``ring_attention_bytes``, with a slack for gloo's and TCP's framing measured in
  docs/grading.md), elsewhere as the ranks report them (feedback). An ``all_gather`` sends the same bytes: the part
  forbids the collectives;
- ``comm-bytes``: reproduced by ``attnlab.iomodel`` (equal to the real ring's and all-to-all's on a gloo group,
  tests/test_distributed.py), with a salted case of fewer KV heads than query heads (and than ranks at P = 8).
"""

import math
import os

import torch

from attnlab import iomodel
from attnlab.distributed import attention_lse, shard
from attnlab.distributed import group as ranks
from attnlab.grading.core import (Fail, Mistake, clone, case_line, diagnose, each_result, gen as _gen, mismatch,
                                  present, randn as _randn, salted_ints, value_of)
from attnlab.grading.engine import Function, Measured, run
from attnlab.grading.exercises.e11 import spec as specs


# ----------------------------------------------------------------------------- merge-partials

def _merge_cases():
    cases = []
    for seed, (label, (B, H, m, d, n1, n2), amp, shift, empty1, empty2) in enumerate([
            ("unequal shards: 3 keys and 6 keys (B=1, H=2, 5 queries, d=8)", (1, 2, 5, 8, 3, 6), 1.0, 0.0, 0, 0),
            ("B=2, rows 0-2 see no key of shard 2 (there O2 = 0, L2 = -inf)", (2, 1, 6, 4, 5, 2), 1.0, 0.0, 0, 3),
            ("rows 0-1 see no key on either side (L1 = L2 = -inf): O = 0, L = -inf", (1, 2, 4, 8, 4, 4), 1.0, 0.0,
             2, 3),
            ("large logits (q, k x 20: L in the hundreds), 7 and 2 keys", (1, 2, 3, 8, 7, 2), 20.0, 0.0, 0, 0),
            ("every L shifted by +800 (exp(L) is inf in float32)", (1, 1, 4, 4, 3, 5), 1.0, 800.0, 0, 0)]):
        g = _gen(11_000 + seed)
        q = _randn(g, B, H, m, d, scale=amp)
        k, v = _randn(g, B, H, n1 + n2, d, scale=amp), _randn(g, B, H, n1 + n2, d)
        o1, l1 = attention_lse(q, k[:, :, :n1], v[:, :, :n1])
        o2, l2 = attention_lse(q, k[:, :, n1:], v[:, :, n1:])
        l1, l2 = l1 + shift, l2 + shift
        o1[:, :, :empty1], l1[:, :, :empty1] = 0.0, float("-inf")
        o2[:, :, :empty2], l2[:, :, :empty2] = 0.0, float("-inf")
        cases.append((label, (o1, l1, o2, l2), {}))
    return cases


def _merge_with(weights="stable", lse="logaddexp", guard=True, normalise=True, swap=False):
    """A wrong merge_two."""
    def impl(o1, l1, o2, l2):
        o1, l1, o2, l2 = o1.float(), l1.float(), o2.float(), l2.float()
        m = torch.maximum(l1, l2)
        total = m + torch.log(torch.exp(l1 - m) + torch.exp(l2 - m))
        if weights == "unshifted":
            total = torch.log(torch.exp(l1) + torch.exp(l2))
        if weights == "mean":
            w1 = w2 = torch.full_like(l1, 0.5)
        elif weights == "unshifted":
            w1, w2 = torch.exp(l1) / (torch.exp(l1) + torch.exp(l2)), torch.exp(l2) / (torch.exp(l1) + torch.exp(l2))
        elif normalise:
            w1, w2 = torch.exp(l1 - total), torch.exp(l2 - total)
        else:
            w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
        if swap:
            w1, w2 = w2, w1
        out_l = {"logaddexp": total, "max": m, "sum": l1 + l2}[lse]
        if guard:
            empty = torch.isneginf(m)
            w1, w2 = torch.where(empty, 0.0, w1), torch.where(empty, 0.0, w2)
            out_l = torch.where(empty, float("-inf"), out_l)
        return w1[..., None] * o1 + w2[..., None] * o2, out_l
    return impl


_MERGE_MISTAKES = [
    Mistake("mean-of-partials", "the two partial outputs are averaged: each weighs by its share of the softmax "
            "mass, exp(L_i - L)", _merge_with(weights="mean")),
    Mistake("exp-overflows", "exp(L) is taken without subtracting the max of L1 and L2: log-sum-exps in the "
            "hundreds overflow to inf and the weights become NaN", _merge_with(weights="unshifted", guard=False)),
    Mistake("lse-max-only", "the merged L is max(L1, L2): it is log(exp(L1) + exp(L2)), larger than both",
            _merge_with(lse="max")),
    Mistake("lse-added", "the merged L is L1 + L2: masses add, so logs combine as log(exp(L1) + exp(L2))",
            _merge_with(lse="sum")),
    Mistake("empty-rows-nan", "a row with no keys on either side (L1 = L2 = -inf) gives -inf - (-inf) = NaN: "
            "keep O = 0 and L = -inf there", _merge_with(guard=False)),
    Mistake("not-normalised", "the weights exp(L_i - M) are not divided by their sum (use exp(L_i - L))",
            _merge_with(normalise=False)),
    Mistake("weights-swapped", "O1 is weighed by shard 2's share and O2 by shard 1's", _merge_with(swap=True)),
]


# ----------------------------------------------------------------------------- shard-positions

def _shard_cases():
    p, m, r, z = salted_ints(11_100, (2, 6), (1, 9), (0, 5), (0, 1))    # a shard no notebook can know in advance
    salted = (2 * p * m, p, r % p, ("contiguous", "zigzag")[z])
    return [(f"n={n}, world_size={p}, rank={r}, {layout}", (n, p, r), {"layout": layout}) for n, p, r, layout in [
        (8, 2, 1, "contiguous"), (12, 3, 2, "contiguous"), (8, 2, 0, "zigzag"), (8, 2, 1, "zigzag"),
        (24, 3, 1, "zigzag"), (32, 4, 3, "zigzag"), (16, 4, 0, "zigzag"), (6, 1, 0, "zigzag"), salted]]


def _positions_with(late="mirror", chunk="2P", order="early-first", zigzag=True, contiguous="chunk"):
    """A wrong shard_positions."""
    def impl(n, world_size, rank, layout="contiguous"):
        P = world_size
        if layout == "contiguous" or not zigzag:
            if contiguous == "strided":
                return torch.arange(rank, n, P)
            c = n // P
            return torch.arange(rank * c, (rank + 1) * c)
        c = n // (2 * P) if chunk == "2P" else n // P
        other = {"mirror": 2 * P - 1 - rank, "mirror+1": 2 * P - rank, "shift": rank + P}[late]
        ids = [rank, other] if order == "early-first" else [other, rank]
        return torch.cat([torch.arange(i * c, (i + 1) * c) for i in ids]) % max(n, 1)
    return impl


_SHARD_MISTAKES = [
    Mistake("late-chunk-off-by-one", "the late chunk is 2P - r: rank r holds chunks r and 2P - 1 - r (rank 0 gets "
            "the last chunk, 2P - 1)", _positions_with(late="mirror+1")),
    Mistake("late-chunk-shifted", "the late chunk is r + P: that gives every rank the same shape of work only "
            "without a mask; zigzag mirrors it, 2P - 1 - r", _positions_with(late="shift")),
    Mistake("zigzag-chunks-too-big", "zigzag cuts the sequence into 2P chunks of n / (2P), not P chunks of n / P",
            _positions_with(chunk="P")),
    Mistake("late-chunk-first", "the late chunk comes first: keep the positions in order, chunk r then chunk "
            "2P - 1 - r", _positions_with(order="late-first")),
    Mistake("layout-ignored", "the zigzag layout gives the contiguous shard: layout='zigzag' holds two chunks",
            _positions_with(zigzag=False)),
    Mistake("contiguous-strided", "the contiguous shard is every P-th position (r, r + P, ...): it is one block, "
            "r n/P .. (r + 1) n/P - 1", _positions_with(contiguous="strided")),
]


# ----------------------------------------------------------------------------- ring-schedule

def _schedule_cases():
    p, r, t, z, c = salted_ints(11_200, (2, 7), (0, 6), (0, 6), (0, 1), (0, 1))
    salted = [(r % p, p, t % p, ("contiguous", "zigzag")[z], bool(c))]
    return [(f"rank {r} of {p}, step {t}, {layout}, causal={causal}", (r, p, t), {"layout": layout, "causal": causal})
            for r, p, t, layout, causal in [
                (0, 2, 0, "contiguous", True), (1, 3, 1, "contiguous", True), (0, 3, 1, "contiguous", True),
                (2, 4, 3, "contiguous", False), (0, 2, 1, "zigzag", True), (1, 4, 2, "zigzag", True),
                (3, 4, 1, "zigzag", True), (2, 3, 0, "zigzag", True), (1, 3, 2, "zigzag", False)] + salted]


def _schedule_with(direction=-1, diagonal="diagonal", causal_rule="a>b", zigzag=True, transpose=False):
    """A wrong ring_schedule."""
    def impl(rank, world_size, step, layout="contiguous", causal=True):
        P = world_size
        src = (rank + direction * step) % P

        def ids(r):
            return [r] if layout == "contiguous" or not zigzag else [r, 2 * P - 1 - r]

        def kind(a, b):
            if not causal:
                return 2
            if a == b:
                return 1 if diagonal == "diagonal" else 2
            return 2 if (a > b if causal_rule == "a>b" else a < b if causal_rule == "a<b" else True) else 0

        work = torch.tensor([[kind(a, b) for b in ids(src)] for a in ids(rank)], dtype=torch.int64)
        return src, work.T if transpose else work
    return impl


_SCHEDULE_MISTAKES = [
    Mistake("ring-turns-the-wrong-way", "at step t rank r holds rank (r + t)'s shard: shards travel to the next rank, "
            "so what r holds came from (r - t) % P", _schedule_with(direction=+1)),
    Mistake("diagonal-as-full", "a diagonal block (a == b) is full: its queries see only the keys up to themselves "
            "(1, causal inside)", _schedule_with(diagonal="full")),
    Mistake("future-blocks-computed", "blocks of later key chunks (a < b) are computed: under a causal mask they "
            "are skipped (0)", _schedule_with(causal_rule="all")),
    Mistake("causal-inverted", "the past is skipped and the future computed: query chunk a sees key chunk b when "
            "a > b", _schedule_with(causal_rule="a<b")),
    Mistake("layout-ignored", "the zigzag layout is treated as contiguous: a zigzag rank holds chunks r and "
            "2P - 1 - r, a (2, 2) table", _schedule_with(zigzag=False)),
    Mistake("table-transposed", "rows are the key chunks: rows are the rank's query chunks, columns the held "
            "shard's key chunks", _schedule_with(transpose=True)),
]


# ----------------------------------------------------------------------------- ring-forward

RING_CONFIGS = [  # (label, B, H, positions per rank, d, P, causal, layout, scale of q and k)
    ("2 ranks, no mask, B=1, H=2, 4 positions per rank, d=8", 1, 2, 4, 8, 2, False, "contiguous", 1.0),
    ("3 ranks, causal, contiguous, 3 positions per rank, q and k x 6 (scores near 100)", 1, 2, 3, 8, 3, True,
     "contiguous", 6.0),
    ("2 ranks, causal, zigzag, B=2, 4 positions per rank", 2, 1, 4, 4, 2, True, "zigzag", 1.0),
    ("4 ranks, causal, zigzag, 4 positions per rank", 1, 2, 4, 8, 4, True, "zigzag", 1.0),
    ("3 ranks, no mask, zigzag, 2 positions per rank", 1, 1, 2, 4, 3, False, "zigzag", 1.0),
    ("1 rank, causal (the ring is the rank alone)", 1, 2, 5, 4, 1, True, "contiguous", 1.0),
]


def _ring_inputs(seed, B, H, m, d, P, layout, amp=1.0):
    """q, k, v (B, H, P m, d) from ``_gen(seed)``, q and k times ``amp``, and each rank's shards [q, k, v]."""
    g = _gen(seed)
    q, k, v = _randn(g, B, H, P * m, d, scale=amp), _randn(g, B, H, P * m, d, scale=amp), _randn(g, B, H, P * m, d)
    return q, k, v, [[shard(x, P, r, layout) for x in (q, k, v)] for r in range(P)]


def _ring_step_with(direction=-1, causal_rule="right", diagonal="masked", merge="rescale", sent_rule="k+v",
                    zigzag=True, scaled=True):
    """A wrong ring_step."""
    def impl(o, lse, q, k, v, rank, step, world_size, causal=False, layout="contiguous"):
        P = world_size
        lay = layout if zigzag else "contiguous"
        src = (rank + direction * step) % P
        ids = (lambda r: [r]) if lay == "contiguous" else (lambda r: [r, 2 * P - 1 - r])
        c = len(ids(rank))
        o_ch, l_ch = list(o.float().chunk(c, dim=2)), list(lse.float().chunk(c, dim=2))
        for i, (a, qa) in enumerate(zip(ids(rank), q.chunk(c, dim=2))):
            for b, kb, vb in zip(ids(src), k.chunk(c, dim=2), v.chunk(c, dim=2)):
                if causal and a < b and causal_rule == "right":
                    continue
                mask = causal and a == b and diagonal == "masked"
                # unscaled scores: q sqrt(d) . k / sqrt(d) = q . k
                o_ab, l_ab = attention_lse(qa if scaled else qa * math.sqrt(qa.shape[-1]), kb, vb, causal=mask)
                if merge == "rescale":
                    o_ch[i], l_ch[i] = specs.merge_two(o_ch[i], l_ch[i], o_ab, l_ab)
                elif merge == "added":
                    o_ch[i], l_ch[i] = o_ch[i] + o_ab, specs.merge_two(o_ch[i], l_ch[i], o_ab, l_ab)[1]
                else:                                               # "lse-kept": L never updated after step 0
                    new_o, new_l = specs.merge_two(o_ch[i], l_ch[i], o_ab, l_ab)
                    o_ch[i], l_ch[i] = new_o, torch.where(torch.isneginf(l_ch[i]), new_l, l_ch[i])
        nbytes = {"k+v": k.numel() * k.element_size() + v.numel() * v.element_size(),
                  "k": k.numel() * k.element_size()}[sent_rule if sent_rule != "every-step" else "k+v"]
        sent = nbytes if (step < P - 1 or sent_rule == "every-step") else 0
        return torch.cat(o_ch, dim=2), torch.cat(l_ch, dim=2), sent
    return impl


_RING_MISTAKES = [
    Mistake("ring-turns-the-wrong-way", "the held shard is taken as rank (rank + step)'s: it came from the left, "
            "src = (rank - step) % P, and the causal decisions depend on which chunks it holds",
            _ring_step_with(direction=+1)),
    Mistake("future-blocks-computed", "under the causal mask the blocks of later key chunks (a < b) are computed: "
            "queries see keys after them; skip those blocks", _ring_step_with(causal_rule="none")),
    Mistake("diagonal-unmasked", "the diagonal block (a == b) is computed without its causal mask: its queries "
            "see the later keys of their own chunk", _ring_step_with(diagonal="full")),
    Mistake("partials-added", "the new block's output is added to the running one: merge them by their "
            "log-sum-exps (your merge_two)", _ring_step_with(merge="added")),
    Mistake("lse-not-updated", "the running L is kept from the first block: after each merge it is the merged "
            "log-sum-exp, or later merges weigh the shards wrongly", _ring_step_with(merge="lse-kept")),
    Mistake("scale-missing", "the block's scores are not scaled: s = q_a @ k_b^T / sqrt(d), in the output and the "
            "log-sum-exp alike", _ring_step_with(scaled=False)),
    Mistake("sends-at-the-last-step", "the rank also forwards its shard at the last step (P - 1): nobody needs it "
            "then, a rank sends P - 1 times", _ring_step_with(sent_rule="every-step")),
    Mistake("sends-k-only", "only the keys' bytes are counted: the rank forwards its K and its V shard",
            _ring_step_with(sent_rule="k")),
    Mistake("layout-ignored", "the zigzag layout is treated as contiguous: a zigzag shard is two chunks, "
            "r and 2P - 1 - r, and the causal blocks are decided chunk by chunk", _ring_step_with(zigzag=False)),
]


def _measure_ring(learner):
    """Every rank of every ring at step t in one request, each step compared with the reference's from the same
    state; the learner's own (O, L) travels on to its next step. Then the whole ring against one device."""
    rings = []
    for seed, (label, B, H, m, d, P, causal, layout, amp) in enumerate(RING_CONFIGS):
        q, k, v, shards = _ring_inputs(11_300 + seed, B, H, m, d, P, layout, amp)
        state = [(torch.zeros(B, H, m, d), torch.full((B, H, m), float("-inf"))) for _ in range(P)]
        rings.append(dict(label=label, q=q, k=k, v=v, shards=shards, P=P, causal=causal, layout=layout,
                          state=state, sent=[0] * P))
    for step in range(max(r["P"] for r in rings)):
        at = [(ring, rank) for ring in rings if step < ring["P"] for rank in range(ring["P"])]
        cases = [(f"{ring['label']}: rank {rank}, step {step}",
                  (*ring["state"][rank], ring["shards"][rank][0], *ring["shards"][(rank - step) % ring["P"]][1:],
                   rank, step, ring["P"]), {"causal": ring["causal"], "layout": ring["layout"]}) for ring, rank in at]
        for (ring, rank), (label, args, kwargs, got) in zip(at, each_result(learner, "ring_step", cases, copy=True)):
            with torch.no_grad():
                want = specs.ring_step(*clone(args), **clone(kwargs))
            why = mismatch(got, want)
            if why:
                raise Fail("\n    ".join([f"`ring_step` on {label}: {why}",
                                          case_line(label, args, kwargs, specs.ring_step)]),
                           diagnose(got, _RING_MISTAKES, args, kwargs))
            ring["state"][rank] = (got[0], got[1])
            ring["sent"][rank] += int(got[2])
    for ring in rings:                                               # the whole ring against one device
        o_ref, l_ref = attention_lse(ring["q"], ring["k"], ring["v"], causal=ring["causal"])
        B, H, n, d = ring["q"].shape
        owed = iomodel.ring_attention_bytes(B, H, n, d, ring["P"], 4)
        for rank, (o, lse) in enumerate(ring["state"]):
            want = (shard(o_ref, ring["P"], rank, ring["layout"]),
                    shard(l_ref[..., None], ring["P"], rank, ring["layout"])[..., 0])
            why = mismatch((o, lse), want)
            if why:
                raise Fail(f"`ring_step` on {ring['label']}: after all {ring['P']} steps rank {rank}'s (O, L) "
                           f"differs from attention over the whole sequence: {why}")
            if mismatch(ring["sent"][rank], owed):
                raise Fail(f"`ring_step` on {ring['label']}: rank {rank} sent {ring['sent'][rank]} bytes in all, the "
                           f"ring sends 2 (P - 1) shards of K and V = {owed} bytes",
                           [m for m in _RING_MISTAKES if m.key.startswith("sends")])
    return (f"{len(rings)} rings of 1 to 4 ranks driven step by step: every rank's O and L equal attention over the "
            "whole sequence, and its bytes the ring's 2 (P - 1) shards")


# ----------------------------------------------------------------------------- ring-group

# (label, B, H, positions per rank, d, P, causal, layout): shards of 8 to 16 KiB, where the payload outweighs gloo's
# framing (144 bytes a message) and TCP's (a few hundred bytes a connection and per round trip)
GROUP_CONFIGS = [
    ("2 ranks, no mask, contiguous, H=2, 32 positions per rank, d=64", 1, 2, 32, 64, 2, False, "contiguous"),
    ("3 ranks, causal, contiguous, 32 positions per rank", 1, 2, 32, 64, 3, True, "contiguous"),
    ("2 ranks, causal, zigzag, B=2, H=1, 32 positions per rank", 2, 1, 32, 64, 2, True, "zigzag"),
    ("4 ranks, causal, zigzag, 16 positions per rank", 1, 2, 16, 64, 4, True, "zigzag"),
    ("3 ranks, no mask, zigzag, 32 positions per rank", 1, 2, 32, 32, 3, False, "zigzag"),
    ("1 rank (a group of one: nothing to send)", 1, 2, 8, 16, 1, True, "contiguous"),
]

# bytes on top of the payload. The loopback counts every packet's IP and TCP headers: 52 bytes a packet (IPv4, TCP
# with timestamps), read with the bytes (the packets transmitted) and taken off them, because how many packets carry
# the same bytes depends on the machine's load (ACKs, segments: a P = 3 group of one CI run sent 22 KiB on top of
# the payload, where quiet runs send 5.7 to 6.1 KiB in 75 to 83 packets). What is left on top of the payload is
# gloo's framing and the connections' set-up and close: 600 to 620 bytes per pair of ranks in every group above,
# quiet or loaded, unless a segment travels twice. TCP's retransmissions (net/snmp's RetransSegs) make the group run
# again; but with three notebooks graded at once on 2 loaded cores, one 8 KiB message in 5 to 10 groups was sent
# twice with RetransSegs unchanged (measured: P = 4, 208,640 and 208,580 bytes for 196,608; P = 3, 108,476 for
# 98,304), and 2 of 5 correct rings lost the part under a limit of 2 % and 4 KiB per pair. The limit is therefore
# set halfway between a right ring and the nearest wrong one: a ring that also sends at the last step sends 2 more
# shards per rank, the payload / (P - 1) more, so a group may send up to half of
# that on top of its payload, plus 1 KiB per pair for the framing: 2 to 6 whole extra messages of 8 to 16 KiB at
# the part's sizes, and still 16 KiB or more under what the wrong ring sends
HEADER_BYTES = 52           # per packet transmitted on the loopback
GROUP_TRIES = 3             # runs of a group whose segments TCP retransmitted (counted in the sandbox's net/snmp)
FRAMING_PER_PAIR = 1024     # gloo's framing, connection set-up and close (600 to 620 measured)


def bytes_slack(want_sent, P):
    """Bytes a group of ``P`` ranks may send on top of ``want_sent``: half the distance to a ring that also sends at
    the last step (``want_sent / (P - 1)`` more), plus the framing of every pair of ranks."""
    return (want_sent / (2 * (P - 1)) if P > 1 else 0) + FRAMING_PER_PAIR * P * (P - 1) // 2


def _simulated_ring(direction=-1, causal_kept=True, layout_kept=True, rotate=True, received_first=False):
    """A wrong ring forward, every rank of it played here with the reference's step: shards(list of [q, k, v] per
    rank), causal, layout -> [(O, L)] per rank."""
    def impl(shards, causal, layout):
        P = len(shards)
        out = []
        for r, (q, _, _) in enumerate(shards):
            o, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], float("-inf"))
            for t in range(P):
                held = min(t + 1, P - 1) if received_first else t  # waited and swapped before computing
                src = (r + direction * held) % P if rotate else r
                o, lse, _ = specs.ring_step(o, lse, q, shards[src][1], shards[src][2], r, t, P,
                                            causal and causal_kept, layout if layout_kept else "contiguous")
            out.append((o, lse))
        return out
    return impl


_GROUP_MISTAKES = [
    Mistake("sent-to-the-previous-rank", "the shards go to the previous rank (and come from the next): at step t "
            "rank r then holds rank (r + t) % P's shard while its ring_step computes the causal blocks of rank "
            "(r - t) % P's. Send to (rank + 1) % P, receive from (rank - 1) % P", _simulated_ring(direction=+1)),
    Mistake("causal-not-passed-on", "the causal flag is not passed on to ring_step: every block is computed in "
            "full, the queries see later keys", _simulated_ring(causal_kept=False)),
    Mistake("layout-not-passed-on", "the layout is not passed on to ring_step: a zigzag shard is treated as one "
            "contiguous chunk", _simulated_ring(layout_kept=False)),
    Mistake("own-shard-every-step", "every step computes with the rank's own K/V shard: after waiting on the "
            "requests, the shard received (into its own buffers) is the one to hold at the next step",
            _simulated_ring(rotate=False)),
    Mistake("computes-after-the-swap", "each step computes with the shard it has just received: wait on the requests "
            "and swap the buffers *after* ring_step, so that step t computes with the shard held at step t (its own "
            "at step 0); computed after the swap, the rank's own shard is never used and the last one twice",
            _simulated_ring(received_first=True)),
]

_DEADLOCK = Mistake("ranks-hung", "a rank waited for a transfer that never came (a deadlock): every isend needs "
                    "the matching irecv on its peer. Send to (rank + 1) % P and receive from (rank - 1) % P, post a "
                    "step's sends and receives together in one batch_isend_irecv, wait on every request it "
                    "returns, and stop sending after step P - 2 on every rank alike", None)
_EXTRA_SENDS = Mistake("sends-at-the-last-step", "the ranks also transfer at the last step (P - 1): nobody needs "
                       "that shard, a rank sends 2 (P - 1) shards of K and V in all", None)


def _retransmitted(pid):
    """TCP segments retransmitted so far in ``pid``'s network namespace (/proc/PID/net/snmp), or None."""
    try:
        with open(f"/proc/{pid}/net/snmp") as f:
            head, values = [line.split() for line in f if line.startswith("Tcp:")][:2]
        return int(values[head.index("RetransSegs")])
    except (OSError, ValueError, IndexError):
        return None


def _lo_sent(pid):
    """(bytes, packets, TCP segments retransmitted or None) so far on the loopback of ``pid``'s network namespace
    (/proc/PID/net/dev and net/snmp), or None when that namespace is this process's own (no sandbox: other traffic
    shares it) or cannot be read."""
    if pid is None:
        return None
    try:
        if os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            return None
        retransmitted = _retransmitted(pid)
        with open(f"/proc/{pid}/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == "lo":
                    fields = counters.split()   # received: 8 fields, then transmitted bytes and packets
                    return int(fields[8]), int(fields[9]), retransmitted
    except (OSError, ValueError, IndexError):
        return None
    return None


def _group_outcomes(reply, label, P):
    """The P ranks' (O, L); raises Fail for a rank that raised, died or hung (a rank's own error first: the
    others often fail because it left)."""
    present(reply, "ring_forward")
    results = reply.get("results", [])
    outcomes = results[0] if results else None
    if not isinstance(outcomes, list) or len(outcomes) != P:
        raise Fail(f"`ring_forward`: the grader got no result from the {P} ranks for {label}")
    failed = [(r, o) for r, o in enumerate(outcomes) if not isinstance(o, dict) or "ok" not in o]
    first = sorted(failed, key=lambda ro: (bool(ro[1].get("hung")), "gloo" in str(ro[1].get("raised", "")).lower()))
    if first:
        rank, outcome = first[0]
        if outcome.get("hung"):
            hung = [r for r, o in failed if o.get("hung")]
            raise Fail(f"`ring_forward` on {label}: rank{'s' if len(hung) > 1 else ''} "
                       f"{', '.join(map(str, hung))} of {P} did not finish within the grader's time "
                       f"({ranks.DEFAULT_TIMEOUT:.0f} s; every rank of the group was stopped)", [_DEADLOCK])
        value_of(outcome, "ring_forward", f"{label}, rank {rank} of {P}")
    return [o["ok"] for o in outcomes], [o.get("written") for o in outcomes]


def _measure_group(learner):
    """Each of GROUP_CONFIGS on a gloo group of its ranks: every rank's (O, L), then the bytes sent."""
    from attnlab.grading.sandbox.footprint import pid_of

    pid = pid_of(learner)
    measured = []
    for seed, (label, B, H, m, d, P, causal, layout) in enumerate(GROUP_CONFIGS):
        kwargs = {"causal": causal, "layout": layout}
        for attempt in range(GROUP_TRIES):  # a group in which TCP retransmitted a segment sent it twice: it runs
            # again, on new values of the same shapes (a rank of the first run that returned its shard as its answer
            # would otherwise have handed it to the forking process, and so to every rank of the next run)
            q, k, v, shards = _ring_inputs(11_500 + seed + len(GROUP_CONFIGS) * attempt, B, H, m, d, P, layout)
            before = _lo_sent(pid)
            reply = learner.call("ring_forward", [[[clone(s), dict(kwargs)] for s in shards]], ranks=P)
            after = _lo_sent(pid)
            if before is None or after is None or after[2] == before[2]:
                break
        got, written = _group_outcomes(reply, label, P)
        o_ref, l_ref = attention_lse(q, k, v, causal=causal)
        for rank in range(P):
            want = (shard(o_ref, P, rank, layout), shard(l_ref[..., None], P, rank, layout)[..., 0])
            why = mismatch(got[rank], want)
            if why:
                found = diagnose(got, _GROUP_MISTAKES, (shards, causal, layout), {})
                raise Fail("\n    ".join([f"`ring_forward` on {label}: rank {rank}'s (O, L) differs from attention "
                                          f"over the whole sequence at its positions: {why}",
                                          f"(each rank r was called with its shard of q, k, v (B, H, n/P, d) and "
                                          f"{kwargs})"]), found)
        owed = iomodel.ring_attention_bytes(B, H, P * m, d, P, 4)   # what each rank sends
        headers = 0
        if before is not None and after is not None:                 # the sandbox's loopback, read from outside
            sent, want_sent, whose = after[0] - before[0], P * owed, f"the {P} ranks together"
            headers = HEADER_BYTES * (after[1] - before[1])
        else:                                                        # what the ranks say they wrote (feedback)
            sent = None if None in written else max(written)
            want_sent, whose = owed, "a rank (as the ranks report it)"
        if sent is None:
            continue
        measured.append((P, sent - headers, want_sent))
        slack = bytes_slack(want_sent, P)
        if not want_sent <= sent or sent - headers > want_sent + slack:
            per_rank = "" if None in written else f" (the ranks report {written})"
            in_all = "" if want_sent == owed else f", {want_sent:,} in all"
            on_top = f" ({headers:,} of them packet headers)" if headers else ""
            raise Fail(f"`ring_forward` on {label}: {whose} sent {sent:,} bytes{on_top}{per_rank}; the ring sends "
                       f"2 (P - 1) shards of K and V per rank ({owed:,} bytes{in_all}), plus at most {slack:,.0f} of "
                       f"framing", [_EXTRA_SENDS] if sent - headers > want_sent + slack else [])
    where = ("measured on the sandbox's loopback, from outside your process, less the packets' IP and TCP headers"
             if pid is not None and _lo_sent(pid) is not None else "as your ranks report them")
    framing = ", ".join(f"P={P}: {sent:,} for {want:,}" for P, sent, want in measured if want)
    return (f"{len(GROUP_CONFIGS)} process groups of 1 to 4 gloo ranks: every rank's O and L equal attention over the "
            f"whole sequence, and the bytes sent ({where}) the ring's 2 (P - 1) shards per rank and framing "
            f"({framing})")


# ----------------------------------------------------------------------------- comm-bytes

WORLD_SIZES, N, HEADS, D = [1, 2, 3, 4], 48, 12, 8


def _bytes_with(ring="2(P-1)", ulysses="4", keep=True, transpose=False, kv="right"):
    def impl(world_sizes, n=48, heads=12, d=8, kv_heads=None):
        h_kv = heads if kv_heads is None or kv == "ignored" else kv_heads
        rows = [[], []]
        for P in world_sizes:
            head = (n // P) * d * 4                                       # bytes of one head of a local shard
            rows[0].append({"2(P-1)": 2 * (P - 1), "2P": 2 * P, "P-1": P - 1}[ring] * h_kv * head)
            pieces = (P - 1) if keep else P
            q_heads = heads if ulysses == "whole" else heads // P         # heads of one piece of q (or O)
            kv_piece = h_kv if ulysses == "whole" else max(h_kv // P, 1)  # heads of one piece of K (or V)
            kv_sent = (min(h_kv, P) - 1) * kv_piece if kv == "not-replicated" else pieces * kv_piece
            rows[1].append(((1 if ulysses == "3" else 2) * pieces * q_heads + 2 * kv_sent) * head)
        out = torch.tensor(rows, dtype=torch.int64)
        return out.T if transpose else out
    return impl


_BYTES_MISTAKES = [
    Mistake("ring-sends-every-step", "the ring row counts P sends per rank: the last step forwards nothing, "
            "2 (P - 1) shards of K and V", _bytes_with(ring="2P")),
    Mistake("ring-k-only", "the ring row counts only the keys: each step forwards K and V", _bytes_with(ring="P-1")),
    Mistake("all-to-all-sends-own-piece", "the all-to-all row counts all P pieces: a rank keeps its own piece, it "
            "sends P - 1", _bytes_with(keep=False)),
    Mistake("all-to-all-output-forgotten", "the all-to-all row counts three all-to-alls: the output goes back from "
            "heads to positions, a fourth", _bytes_with(ulysses="3")),
    Mistake("all-to-all-whole-shard", "each piece of the all-to-all is counted as the whole local shard: it is "
            "1/P of it (heads / P of the heads)", _bytes_with(ulysses="whole")),
    Mistake("transposed", "rows are world sizes: row 0 is the ring, row 1 the all-to-all, one column per world "
            "size", _bytes_with(transpose=True)),
    Mistake("kv-heads-ignored", "K and V are counted with all the query heads: with grouped-query attention they "
            "have kv_heads heads, so the ring sends kv_heads / heads of the bytes, and so do the all-to-alls of K "
            "and V (q and the output keep every head)", _bytes_with(kv="ignored")),
    Mistake("kv-heads-not-replicated", "with fewer KV heads than ranks, K (and V) was cut into kv_heads pieces "
            "(what .chunk(P, dim=1) gives then): every other rank still needs the KV head its query heads share, "
            "one head of (n/P) positions to each of the P - 1 others", _bytes_with(kv="not-replicated")),
]


def _bytes_cases():
    h, d, m, kv = salted_ints(11_300, (1, 4), (2, 16), (1, 4), (0, 2))
    kv = (1, 2, 4)[kv]
    sizes = [1, 2, 3, 4, 6]
    return [(f"world sizes {WORLD_SIZES}, n={N}, heads={HEADS}, d={D}", (WORLD_SIZES,),
             {"n": N, "heads": HEADS, "d": D}),
            (f"world sizes {sizes}, n={24 * m}, heads={12 * h}, d={d}", (sizes,),
             {"n": 24 * m, "heads": 12 * h, "d": d}),
            (f"world sizes [1, 2, 4, 8], n={16 * m}, heads={8 * h}, d={d}, kv_heads={kv} (grouped-query; fewer "
             f"KV heads than ranks at P=8)", ([1, 2, 4, 8],), {"n": 16 * m, "heads": 8 * h, "d": d, "kv_heads": kv})]


_BYTES = specs.comm_bytes(WORLD_SIZES, N, HEADS, D)   # what the notebook's run gives

NOT_FROM_RING_STEP = Mistake("ring-row-not-from-ring-step", "the numbers are right, but the ring's row is not the sum "
                             "of what your ring_step reported sending: drive rank 0 through its steps with ring_step "
                             "(by that name) and add up the `sent` each call returns", None)


def _check_ring_row_from_ring_step(learner):
    """Seen by the grader, not read from the code: comm_bytes runs again, one world size P per case, with the
    learner's ring_step tapped (agent._tapped: the int its k-th call returns grows by k times a step drawn from the
    secret salt). A ring row that adds up the `sent` of c calls grows by step * c (c + 1) / 2; rank 0 driven through
    its P steps makes c = P calls (P - 1 where the last one, which sends nothing, is skipped). The all-to-all row
    does not move."""
    step = 1000 + int(torch.randint(0, 1000, (1,), generator=_gen(11_350)))
    h, d = salted_ints(11_351, (1, 3), (2, 8))
    cases = [(f"world size {p}, n={12 * p}, heads={12 * h}, d={d}, ring_step's k-th send grown by k x {step}", ([p],),
              {"n": 12 * p, "heads": 12 * h, "d": d}) for p in (2, 3, 4)]
    for label, args, kwargs, got in each_result(learner, "comm_bytes", cases, copy=True,
                                                tap={"name": "ring_step", "step": float(step)}):
        want, p = specs.comm_bytes(*args, **kwargs), args[0][0]
        if not torch.is_tensor(got) or got.shape != want.shape:
            raise Fail(f"`comm_bytes` on {label}: expected an int64 tensor of shape {tuple(want.shape)}")
        grown = int(got[0, 0]) - int(want[0, 0])
        if mismatch(got[1], want[1], rtol=0, atol=0) is None and grown in {step * c * (c + 1) // 2 for c in (p - 1, p)}:
            continue
        raise Fail(f"`comm_bytes` on {label}: the ring's row grew by {grown} where {p} calls of ring_step, their "
                   f"sends added up, grow it by {step * p * (p + 1) // 2}", [NOT_FROM_RING_STEP])
    return len(cases)


def _measure_bytes(learner):
    message = run(_COMM, learner)
    return message + f"; the ring's row is the sum of your ring_step's sends ({_check_ring_row_from_ring_step(learner)} " \
                     f"world sizes seen)"


_COMM = Function("comm_bytes", specs.comm_bytes, _bytes_cases, _BYTES_MISTAKES,
                 says="your counted bytes equal the IO model's to the byte; at "
                      f"P={WORLD_SIZES[-1]} a ring rank sends {_BYTES[0, -1] / _BYTES[1, -1]:.1f}x the "
                      "bytes of an all-to-all rank")


TABLES = {
    "merge-partials": Function("merge_two", specs.merge_two, _merge_cases, _MERGE_MISTAKES,
                               says="{n} cases match: unequal shards, rows with no keys, log-sum-exps in the hundreds "
                                    "and past 800"),
    "shard-positions": Function("shard_positions", specs.shard_positions, _shard_cases, _SHARD_MISTAKES,
                                says="{n} shards match, contiguous and zigzag, on 1 to 4 ranks"),
    "ring-schedule": Function("ring_schedule", specs.ring_schedule, _schedule_cases, _SCHEDULE_MISTAKES,
                              says="{n} steps of the ring match, contiguous and zigzag, with and without the causal "
                                   "mask"),
    # a ring simulated in this process: each step's inputs are the learner's own previous outputs
    "ring-forward": Measured("function", _measure_ring, {"ring_step": _RING_MISTAKES}),
    "ring-group": Measured("process-group", _measure_group,
                           {"(every rank at once)": _GROUP_MISTAKES + [_DEADLOCK, _EXTRA_SENDS]}),
    "comm-bytes": Measured("experiment", _measure_bytes, {"comm_bytes": _BYTES_MISTAKES,
                                                          "(the calls seen)": [NOT_FROM_RING_STEP]}),
}
