"""The checks of exercise 11_across_devices: one table per graded part (:mod:`attnlab.grading.engine`), in ``TABLES``.

``ring-forward`` drives ``ring_step`` round a ring simulated here; ``ring-group`` runs ``ring_forward`` on every rank
of a real gloo group (each rank starts from its own shard only) and counts the bytes on the sandbox's loopback from
outside the learner's processes; ``comm-bytes``' ring row is seen through a tap summing ``ring_step``'s sends."""

import math
import os

import torch

from attnlab import iomodel
from attnlab.distributed import attention_lse, shard
from attnlab.distributed import group as ranks
from attnlab.grading.core import (Fail, Mistake, clone, case_line, diagnose, each_result, gen as _gen, mismatch,
                                  mistakes, present, randn as _randn, salted_ints, table, value_of)
from attnlab.grading.engine import Function, Measured, run
from attnlab.grading.exercises.e11 import spec as specs


def _merge_case(g, label, shape, amp, shift, empty1, empty2):
    B, H, m, d, n1, n2 = shape
    q = _randn(g, B, H, m, d, scale=amp)
    k, v = _randn(g, B, H, n1 + n2, d, scale=amp), _randn(g, B, H, n1 + n2, d)
    (o1, l1), (o2, l2) = attention_lse(q, k[:, :, :n1], v[:, :, :n1]), attention_lse(q, k[:, :, n1:], v[:, :, n1:])
    l1, l2 = l1 + shift, l2 + shift
    o1[:, :, :empty1], l1[:, :, :empty1] = 0.0, float("-inf")
    o2[:, :, :empty2], l2[:, :, :empty2] = 0.0, float("-inf")
    return label, (o1, l1, o2, l2), {}


def _merge_cases():
    return table(11_000, [
        ("unequal shards: 3 keys and 6 keys (B=1, H=2, 5 queries, d=8)", (1, 2, 5, 8, 3, 6), 1.0, 0.0, 0, 0),
        ("B=2, rows 0-2 see no key of shard 2 (there O2 = 0, L2 = -inf)", (2, 1, 6, 4, 5, 2), 1.0, 0.0, 0, 3),
        ("rows 0-1 see no key on either side (L1 = L2 = -inf): O = 0, L = -inf", (1, 2, 4, 8, 4, 4), 1.0, 0.0, 2, 3),
        ("large logits (q, k x 20: L in the hundreds), 7 and 2 keys", (1, 2, 3, 8, 7, 2), 20.0, 0.0, 0, 0),
        ("every L shifted by +800 (exp(L) is inf in float32)", (1, 1, 4, 4, 3, 5), 1.0, 800.0, 0, 0)], _merge_case)


def _merge_with(shifted=True, weights="share", lse="logaddexp", guard=True, swap=False):
    def impl(o1, l1, o2, l2):
        o1, l1, o2, l2 = o1.float(), l1.float(), o2.float(), l2.float()
        m = torch.maximum(l1, l2)
        c = m if shifted else torch.zeros_like(m)   # unshifted: exp(L) itself, which overflows
        e1, e2 = torch.exp(l1 - c), torch.exp(l2 - c)
        w1, w2 = {"share": (e1 / (e1 + e2), e2 / (e1 + e2)), "unnormalised": (e1, e2),
                  "mean": (torch.full_like(l1, 0.5),) * 2}[weights]
        w1, w2 = (w2, w1) if swap else (w1, w2)
        out_l = {"logaddexp": c + torch.log(e1 + e2), "max": m, "sum": l1 + l2}[lse]
        if guard:
            empty = torch.isneginf(m)
            w1, w2, out_l = w1.masked_fill(empty, 0.0), w2.masked_fill(empty, 0.0), out_l.masked_fill(empty, -math.inf)
        return w1[..., None] * o1 + w2[..., None] * o2, out_l
    return impl


_MERGE_MISTAKES = mistakes(_merge_with, [
    ("mean-of-partials", "the partial outputs are averaged: weigh each by exp(L_i - L)", {"weights": "mean"}),
    ("exp-overflows", "exp(L) overflows: subtract max(L1, L2) before exp", {"shifted": False, "guard": False}),
    ("lse-max-only", "the merged L is max(L1, L2): it is log(exp(L1) + exp(L2))", {"lse": "max"}),
    ("lse-added", "the merged L is L1 + L2: it is log(exp(L1) + exp(L2))", {"lse": "sum"}),
    ("empty-rows-nan", "a row with L1 = L2 = -inf gives NaN: keep O = 0 and L = -inf there", {"guard": False}),
    ("not-normalised", "the weights exp(L_i - M) are not divided by their sum", {"weights": "unnormalised"}),
    ("weights-swapped", "O1 is weighed by shard 2's share and O2 by shard 1's", {"swap": True})])


def _shard_cases():
    p, m, r, z = salted_ints(11_100, (2, 6), (1, 9), (0, 5), (0, 1))    # a shard no notebook can know in advance
    salted = (2 * p * m, p, r % p, ("contiguous", "zigzag")[z])
    return [(f"n={n}, world_size={p}, rank={r}, {layout}", (n, p, r), {"layout": layout}) for n, p, r, layout in [
        (8, 2, 1, "contiguous"), (12, 3, 2, "contiguous"), (8, 2, 0, "zigzag"), (8, 2, 1, "zigzag"),
        (24, 3, 1, "zigzag"), (32, 4, 3, "zigzag"), (16, 4, 0, "zigzag"), (6, 1, 0, "zigzag"), salted]]


def _positions_with(late=-1, chunks=2, late_first=False, zigzag=True, strided=False):
    """Rank r's late chunk is 2P + late - r (r + P for late=None)."""
    def impl(n, world_size, rank, layout="contiguous"):
        P = world_size
        if layout == "contiguous" or not zigzag:
            return torch.arange(rank, n, P) if strided else torch.arange(rank * (n // P), (rank + 1) * (n // P))
        c = n // (chunks * P)
        ids = [rank, rank + P if late is None else 2 * P + late - rank]
        return torch.cat([torch.arange(i * c, (i + 1) * c) for i in (ids[::-1] if late_first else ids)]) % max(n, 1)
    return impl


_SHARD_MISTAKES = mistakes(_positions_with, [
    ("late-chunk-off-by-one", "the late chunk is 2P - r: it is 2P - 1 - r (rank 0 gets chunk 2P - 1)", {"late": 0}),
    ("late-chunk-shifted", "the late chunk is r + P: zigzag mirrors it, 2P - 1 - r", {"late": None}),
    ("zigzag-chunks-too-big", "zigzag cuts 2P chunks of n / (2P), not P of n / P", {"chunks": 1}),
    ("late-chunk-first", "the late chunk comes first: chunk r, then chunk 2P - 1 - r", {"late_first": True}),
    ("layout-ignored", "layout='zigzag' gives the contiguous shard: it holds two chunks", {"zigzag": False}),
    ("contiguous-strided", "the contiguous shard is one block, r n/P .. (r + 1) n/P - 1", {"strided": True})])


def _schedule_cases():
    p, r, t, z, c = salted_ints(11_200, (2, 7), (0, 6), (0, 6), (0, 1), (0, 1))
    salted = [(r % p, p, t % p, ("contiguous", "zigzag")[z], bool(c))]
    return [(f"rank {r} of {p}, step {t}, {layout}, causal={causal}", (r, p, t), {"layout": layout, "causal": causal})
            for r, p, t, layout, causal in [
                (0, 2, 0, "contiguous", True), (1, 3, 1, "contiguous", True), (0, 3, 1, "contiguous", True),
                (2, 4, 3, "contiguous", False), (0, 2, 1, "zigzag", True), (1, 4, 2, "zigzag", True),
                (3, 4, 1, "zigzag", True), (2, 3, 0, "zigzag", True), (1, 3, 2, "zigzag", False)] + salted]


def _schedule_with(direction=-1, diagonal=1, past=2, future=0, zigzag=True, transpose=False):
    """The kinds given a diagonal block, a past one (a > b) and a future one (a < b)."""
    def impl(rank, world_size, step, layout="contiguous", causal=True):
        P = world_size
        src = (rank + direction * step) % P
        ids = (lambda r: [r, 2 * P - 1 - r]) if layout != "contiguous" and zigzag else (lambda r: [r])
        work = torch.tensor([[2 if not causal else diagonal if a == b else past if a > b else future
                              for b in ids(src)] for a in ids(rank)], dtype=torch.int64)
        return src, work.T if transpose else work
    return impl


_SCHEDULE_MISTAKES = mistakes(_schedule_with, [
    ("ring-turns-the-wrong-way", "shards travel to the next rank: at step t rank r holds (r - t) % P's",
     {"direction": 1}),
    ("diagonal-as-full", "a diagonal block (a == b) is 1 (causal inside), not full", {"diagonal": 2}),
    ("future-blocks-computed", "causal: blocks of later key chunks (a < b) are skipped (0)", {"future": 2}),
    ("causal-inverted", "past and future swapped: query chunk a sees key chunk b if a > b", {"past": 0, "future": 2}),
    ("layout-ignored", "a zigzag rank holds chunks r and 2P - 1 - r: a (2, 2) table", {"zigzag": False}),
    ("table-transposed", "rows are the rank's query chunks, columns the held shard's key chunks", {"transpose": True})])


RING_CONFIGS = [  # (label, B, H, positions per rank, d, P, causal, layout, scale of q and k)
    ("2 ranks, no mask, B=1, H=2, 4 positions per rank, d=8", 1, 2, 4, 8, 2, False, "contiguous", 1.0),
    ("3 ranks, causal, contiguous, 3 positions, q and k x 6 (scores near 100)", 1, 2, 3, 8, 3, True, "contiguous", 6.0),
    ("2 ranks, causal, zigzag, B=2, 4 positions per rank", 2, 1, 4, 4, 2, True, "zigzag", 1.0),
    ("4 ranks, causal, zigzag, 4 positions per rank", 1, 2, 4, 8, 4, True, "zigzag", 1.0),
    ("3 ranks, no mask, zigzag, 2 positions per rank", 1, 1, 2, 4, 3, False, "zigzag", 1.0),
    ("1 rank, causal (the ring is the rank alone)", 1, 2, 5, 4, 1, True, "contiguous", 1.0),
]


def _ring_inputs(seed, B, H, m, d, P, causal, layout, amp=1.0):
    """Each rank's [q, k, v] shards (q and k times ``amp``), and its (O, L) of attention over the whole sequence."""
    g = _gen(seed)
    q, k, v = _randn(g, B, H, P * m, d, scale=amp), _randn(g, B, H, P * m, d, scale=amp), _randn(g, B, H, P * m, d)
    o, lse = attention_lse(q, k, v, causal=causal)
    return ([[shard(x, P, r, layout) for x in (q, k, v)] for r in range(P)],
            [(shard(o, P, r, layout), shard(lse[..., None], P, r, layout)[..., 0]) for r in range(P)])


def _step_with(schedule=specs.ring_schedule, merge="rescale", sends="k+v", scaled=True):
    def impl(o, lse, q, k, v, rank, step, world_size, causal=False, layout="contiguous"):
        work = schedule(rank, world_size, step, layout, causal)[1]
        c = work.shape[0]
        o_ch, l_ch = list(o.float().chunk(c, dim=2)), list(lse.float().chunk(c, dim=2))
        for i, qa in enumerate(q.chunk(c, dim=2) if scaled else (q * math.sqrt(q.shape[-1])).chunk(c, dim=2)):
            for j, (kb, vb) in enumerate(zip(k.chunk(c, dim=2), v.chunk(c, dim=2))):
                if work[i, j] != specs.SKIPPED:
                    o_ab, l_ab = attention_lse(qa, kb, vb, causal=bool(work[i, j] == specs.DIAGONAL))
                    o_new, l_new = specs.merge_two(o_ch[i], l_ch[i], o_ab, l_ab)
                    o_ch[i], l_ch[i] = (o_ch[i] + o_ab if merge == "added" else o_new,
                                        torch.where(torch.isneginf(l_ch[i]), l_new, l_ch[i]) if merge == "lse-kept"
                                        else l_new)
        sent = k.numel() * k.element_size() + (0 if sends == "k" else v.numel() * v.element_size())
        last = step == world_size - 1 and sends != "every-step"
        return torch.cat(o_ch, dim=2), torch.cat(l_ch, dim=2), 0 if last else sent
    return impl


_RING_MISTAKES = mistakes(_step_with, [
    ("ring-turns-the-wrong-way", "the held shard came from the left: src = (rank - step) % P, not rank + step",
     {"schedule": _schedule_with(direction=1)}),
    ("future-blocks-computed", "under the causal mask, skip the blocks of later key chunks (a < b)",
     {"schedule": _schedule_with(future=2)}),
    ("diagonal-unmasked", "the diagonal block (a == b) needs its causal mask",
     {"schedule": _schedule_with(diagonal=2)}),
    ("partials-added", "the block's output is added to the running one: merge with your merge_two", {"merge": "added"}),
    ("lse-not-updated", "the running L stays the first block's: after each merge it is the merged log-sum-exp",
     {"merge": "lse-kept"}),
    ("scale-missing", "the block's scores are not scaled: s = q_a @ k_b^T / sqrt(d)", {"scaled": False}),
    ("sends-at-the-last-step", "nothing is sent at the last step: a rank sends P - 1 times", {"sends": "every-step"}),
    ("sends-k-only", "only the keys' bytes are counted: the rank forwards K and V", {"sends": "k"}),
    ("layout-ignored", "a zigzag shard is chunks r and 2P - 1 - r, its blocks decided chunk by chunk",
     {"schedule": _schedule_with(zigzag=False)})])


def _measure_ring(learner):
    """Every rank of every ring at step t in one request, each compared with the reference's step from the same
    state; the learner's own (O, L) travels on to its next step. Then the whole ring against one device."""
    rings = []
    for seed, (label, B, H, m, d, P, causal, layout, amp) in enumerate(RING_CONFIGS):
        shards, want = _ring_inputs(11_300 + seed, B, H, m, d, P, causal, layout, amp)
        rings.append(dict(label=label, shards=shards, P=P, kwargs={"causal": causal, "layout": layout}, want=want,
                          owed=iomodel.ring_attention_bytes(B, H, P * m, d, P, 4),
                          state=[(torch.zeros(B, H, m, d), torch.full((B, H, m), -math.inf))] * P, sent=[0] * P))
    for step in range(max(r["P"] for r in rings)):
        at = [(ring, rank) for ring in rings if step < ring["P"] for rank in range(ring["P"])]
        cases = [(f"{ring['label']}: rank {rank}, step {step}", (*ring["state"][rank], ring["shards"][rank][0],
                  *ring["shards"][(rank - step) % ring["P"]][1:], rank, step, ring["P"]), ring["kwargs"])
                 for ring, rank in at]
        for (ring, rank), (label, args, kwargs, got) in zip(at, each_result(learner, "ring_step", cases, copy=True)):
            with torch.no_grad():
                why = mismatch(got, specs.ring_step(*clone(args), **clone(kwargs)))
            if why:
                raise Fail(f"`ring_step` on {label}: {why}\n    {case_line(label, args, kwargs, specs.ring_step)}",
                           diagnose(got, _RING_MISTAKES, args, kwargs))
            ring["state"][rank] = (got[0], got[1])
            ring["sent"][rank] += int(got[2])
    for ring in rings:
        for rank, (got, want) in enumerate(zip(ring["state"], ring["want"])):
            why = mismatch(got, want)
            if why:
                raise Fail(f"`ring_step` on {ring['label']}: after all {ring['P']} steps rank {rank}'s (O, L) "
                           f"differs from attention over the whole sequence: {why}")
            if mismatch(ring["sent"][rank], ring["owed"]):
                raise Fail(f"`ring_step` on {ring['label']}: rank {rank} sent {ring['sent'][rank]} bytes in all, the "
                           f"ring's 2 (P - 1) shards of K and V are {ring['owed']}",
                           [m for m in _RING_MISTAKES if m.key.startswith("sends")])
    return (f"{len(rings)} rings of 1 to 4 ranks driven step by step: every rank's O and L equal attention over the "
            "whole sequence, and its bytes the ring's 2 (P - 1) shards")


# (label, B, H, positions per rank, d, P, causal, layout): shards of 8 to 16 KiB outweigh gloo's and TCP's framing
GROUP_CONFIGS = [
    ("2 ranks, no mask, contiguous, H=2, 32 positions per rank, d=64", 1, 2, 32, 64, 2, False, "contiguous"),
    ("3 ranks, causal, contiguous, 32 positions per rank", 1, 2, 32, 64, 3, True, "contiguous"),
    ("2 ranks, causal, zigzag, B=2, H=1, 32 positions per rank", 2, 1, 32, 64, 2, True, "zigzag"),
    ("4 ranks, causal, zigzag, 16 positions per rank", 1, 2, 16, 64, 4, True, "zigzag"),
    ("3 ranks, no mask, zigzag, 32 positions per rank", 1, 2, 32, 32, 3, False, "zigzag"),
    ("1 rank (a group of one: nothing to send)", 1, 2, 8, 16, 1, True, "contiguous"),
]

# bytes on top of the payload (docs/grading.md): packet headers, taken off, then gloo's framing and set-up. Under load
# a message was sent twice with no retransmission counted (correct rings failed a 2 % limit): the limit sits halfway
# to the nearest wrong ring (one that also sends at the last step), plus 1 KiB a pair, 16 KiB or more under it
HEADER_BYTES = 52           # per packet transmitted on the loopback
GROUP_TRIES = 3             # runs of a group whose segments TCP retransmitted (counted in the sandbox's net/snmp)
FRAMING_PER_PAIR = 1024     # gloo's framing, connection set-up and close (600 to 620 measured)


def bytes_slack(want_sent, P):
    """Bytes a group of ``P`` ranks may send on top of ``want_sent``: half the distance to a ring that also sends at
    the last step (``want_sent / (P - 1)`` more), plus the framing of every pair of ranks."""
    return (want_sent / (2 * (P - 1)) if P > 1 else 0) + FRAMING_PER_PAIR * P * (P - 1) // 2


def _ring_with(direction=-1, causal_kept=True, layout_kept=True, rotate=True, received_first=False):
    """A wrong ring forward, all ranks played here: shards ([q, k, v] per rank), causal, layout -> [(O, L)]."""
    def impl(shards, causal, layout):
        P, out = len(shards), []
        for r, (q, _, _) in enumerate(shards):
            o, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], -math.inf)
            for t in range(P):
                held = min(t + 1, P - 1) if received_first else t  # waited and swapped before computing
                src = (r + direction * held) % P if rotate else r
                o, lse, _ = specs.ring_step(o, lse, q, shards[src][1], shards[src][2], r, t, P,
                                            causal and causal_kept, layout if layout_kept else "contiguous")
            out.append((o, lse))
        return out
    return impl


_GROUP_MISTAKES = mistakes(_ring_with, [
    ("sent-to-the-previous-rank", "the shards go to the previous rank, so ring_step's causal blocks are another "
     "shard's: send to (rank + 1) % P, receive from (rank - 1) % P", {"direction": 1}),
    ("causal-not-passed-on", "pass the causal flag on to ring_step: queries see later keys", {"causal_kept": False}),
    ("layout-not-passed-on", "pass the layout on to ring_step: zigzag is read as contiguous", {"layout_kept": False}),
    ("own-shard-every-step", "every step uses its own K/V: after waiting, hold the shard received", {"rotate": False}),
    ("computes-after-the-swap", "each step computes with the shard just received: wait and swap the buffers *after* "
     "ring_step, so step 0 uses the rank's own shard", {"received_first": True})])

_DEADLOCK = Mistake("ranks-hung", "a deadlock: send to (rank + 1) % P, receive from (rank - 1) % P in one "
                    "batch_isend_irecv, wait on every request, stop sending after step P - 2 on every rank", None)
_EXTRA_SENDS = Mistake("sends-at-the-last-step", "the ranks also transfer at the last step (P - 1): a rank sends 2 "
                       "(P - 1) shards of K and V in all", None)


def _lo_sent(pid):
    """(bytes, packets, TCP retransmits or None) on ``pid``'s loopback; None if its net namespace is ours or unread."""
    try:
        if pid is None or os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            return None
        try:
            with open(f"/proc/{pid}/net/snmp") as f:
                head, values = [line.split() for line in f if line.startswith("Tcp:")][:2]
            retransmitted = int(values[head.index("RetransSegs")])
        except (OSError, ValueError, IndexError):
            retransmitted = None
        with open(f"/proc/{pid}/net/dev") as f:
            lo = [counters.split() for name, _, counters in (line.partition(":") for line in f) if name.strip() == "lo"]
        return (int(lo[0][8]), int(lo[0][9]), retransmitted) if lo else None   # received: 8 fields, then transmitted
    except (OSError, ValueError, IndexError):
        return None


def _group_outcomes(reply, label, P):
    """The P ranks' (O, L) and reported bytes; Fail for a rank that raised, died or hung (its own error first)."""
    present(reply, "ring_forward")
    outcomes = (reply.get("results") or [None])[0]
    if not isinstance(outcomes, list) or len(outcomes) != P:
        raise Fail(f"`ring_forward`: the grader got no result from the {P} ranks for {label}")
    failed = [(r, o) for r, o in enumerate(outcomes) if not isinstance(o, dict) or "ok" not in o]
    if failed:
        rank, outcome = min(failed, key=lambda ro: (bool(ro[1].get("hung")),
                                                    "gloo" in str(ro[1].get("raised", "")).lower()))
        if outcome.get("hung"):
            hung = [r for r, o in failed if o.get("hung")]
            raise Fail(f"`ring_forward` on {label}: rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} "
                       f"of {P} did not finish in {ranks.DEFAULT_TIMEOUT:.0f} s (the group was stopped)", [_DEADLOCK])
        value_of(outcome, "ring_forward", f"{label}, rank {rank} of {P}")
    return [o["ok"] for o in outcomes], [o.get("written") for o in outcomes]


def _measure_group(learner):
    """Each of GROUP_CONFIGS on a gloo group of its ranks: every rank's (O, L), then the bytes sent."""
    from attnlab.grading.sandbox.footprint import pid_of

    pid = pid_of(learner)
    measured = []
    for seed, (label, B, H, m, d, P, causal, layout) in enumerate(GROUP_CONFIGS):
        kwargs = {"causal": causal, "layout": layout}
        for attempt in range(GROUP_TRIES):  # TCP retransmitted a segment: run again, on new values of the same shapes
            # (a rank that returned its shard as its answer would have handed it to every rank of the next run)
            shards, wants = _ring_inputs(11_500 + seed + len(GROUP_CONFIGS) * attempt, B, H, m, d, P, causal, layout)
            before = _lo_sent(pid)
            reply = learner.call("ring_forward", [[[clone(s), dict(kwargs)] for s in shards]], ranks=P)
            after = _lo_sent(pid)
            if before is None or after is None or after[2] == before[2]:
                break
        got, written = _group_outcomes(reply, label, P)
        for rank, want in enumerate(wants):
            why = mismatch(got[rank], want)
            if why:
                raise Fail(f"`ring_forward` on {label}: rank {rank}'s (O, L) differs from attention over the whole "
                           f"sequence at its positions: {why}\n    (each rank r was called with its shard of q, k, v "
                           f"(B, H, n/P, d) and {kwargs})",
                           diagnose(got, _GROUP_MISTAKES, (shards, causal, layout), {}))
        owed = iomodel.ring_attention_bytes(B, H, P * m, d, P, 4)   # what each rank sends
        if before is not None and after is not None:                 # the sandbox's loopback, read from outside
            sent, want_sent, headers = after[0] - before[0], P * owed, HEADER_BYTES * (after[1] - before[1])
            whose = f"the {P} ranks together sent {sent:,} bytes ({headers:,} of them packet headers)"
        elif None in written:
            continue
        else:                                                        # what the ranks say they wrote (feedback)
            sent, want_sent, headers, whose = max(written), owed, 0, f"a rank sent {max(written):,} bytes"
        measured.append((P, sent - headers, want_sent))
        slack = bytes_slack(want_sent, P)
        too_many = sent - headers > want_sent + slack
        if not want_sent <= sent or too_many:
            raise Fail(f"`ring_forward` on {label}: {whose}{'' if None in written else f' (ranks: {written})'}; "
                       f"the ring sends 2 (P - 1) shards of K and V per rank ({owed:,} bytes, {want_sent:,} in all) "
                       f"+ {slack:,.0f} of framing at most", [_EXTRA_SENDS] if too_many else [])
    where = ("measured on the sandbox's loopback, from outside your process, less the packets' IP and TCP headers"
             if pid is not None and _lo_sent(pid) is not None else "as your ranks report them")
    framing = ", ".join(f"P={P}: {sent:,} for {want:,}" for P, sent, want in measured if want)
    return (f"{len(GROUP_CONFIGS)} process groups of 1 to 4 gloo ranks: every rank's O and L right, and the bytes sent "
            f"({where}) the ring's 2 (P - 1) shards per rank and framing ({framing})")


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


_BYTES_MISTAKES = mistakes(_bytes_with, [
    ("ring-sends-every-step", "the last step forwards nothing: 2 (P - 1) shards of K and V", {"ring": "2P"}),
    ("ring-k-only", "the ring row counts only K: each step forwards K and V", {"ring": "P-1"}),
    ("all-to-all-sends-own-piece", "a rank keeps its own all-to-all piece: it sends P - 1, not P", {"keep": False}),
    ("all-to-all-output-forgotten", "four all-to-alls: q, K, V, and the output back to positions", {"ulysses": "3"}),
    ("all-to-all-whole-shard", "an all-to-all piece is 1/P of the local shard (heads / P heads)", {"ulysses": "whole"}),
    ("transposed", "row 0 is the ring, row 1 the all-to-all, one column per world size", {"transpose": True}),
    ("kv-heads-ignored", "K and V have kv_heads heads (grouped-query): the ring and the all-to-alls of K and V send "
     "kv_heads / heads of the bytes; q and the output keep every head", {"kv": "ignored"}),
    ("kv-heads-not-replicated", "with fewer KV heads than ranks, K and V were cut into kv_heads pieces "
     "(.chunk(P, dim=1)): each of the P - 1 others still needs its KV head of n/P positions",
     {"kv": "not-replicated"})])


def _bytes_cases():
    h, d, m, kv = salted_ints(11_300, (1, 4), (2, 16), (1, 4), (0, 2))
    return [(f"world sizes {sizes}, n={n}, heads={heads}, d={dim}" + "".join(f", {k}={v}" for k, v in gqa.items())
             + note, (sizes,), {"n": n, "heads": heads, "d": dim, **gqa}) for sizes, n, heads, dim, gqa, note in [
        (WORLD_SIZES, N, HEADS, D, {}, ""), ([1, 2, 3, 4, 6], 24 * m, 12 * h, d, {}, ""),
        ([1, 2, 4, 8], 16 * m, 8 * h, d, {"kv_heads": (1, 2, 4)[kv]}, " (grouped-query; fewer KV heads than ranks "
         "at P=8)")]]


_BYTES = specs.comm_bytes(WORLD_SIZES, N, HEADS, D)   # what the notebook's run gives
_COMM = Function("comm_bytes", specs.comm_bytes, _bytes_cases, _BYTES_MISTAKES,
                 says=f"your counted bytes equal the IO model's to the byte; at P={WORLD_SIZES[-1]} a ring rank "
                      f"sends {_BYTES[0, -1] / _BYTES[1, -1]:.1f}x the bytes of an all-to-all rank")
NOT_FROM_RING_STEP = Mistake("ring-row-not-from-ring-step", "the ring's row is not the sum of your ring_step's "
                             "sends: drive rank 0 through its steps with ring_step and add up each `sent`", None)


def _measure_bytes(learner):
    """The table, then one world size P a case with ring_step tapped (agent._tapped: its k-th call's int grows by k
    salted steps): a ring row adding up c = P (or P - 1) calls grows by step * c (c + 1) / 2, the all-to-all row not."""
    message = run(_COMM, learner)
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
        if mismatch(got[1], want[1], rtol=0, atol=0) or grown not in {step * c * (c + 1) // 2 for c in (p - 1, p)}:
            raise Fail(f"`comm_bytes` on {label}: the ring's row grew by {grown} where {p} calls of ring_step, their "
                       f"sends added up, grow it by {step * p * (p + 1) // 2}", [NOT_FROM_RING_STEP])
    return message + f"; the ring's row is the sum of your ring_step's sends ({len(cases)} world sizes seen)"


TABLES = {
    "merge-partials": Function("merge_two", specs.merge_two, _merge_cases, _MERGE_MISTAKES,
                               says="{n} cases match: unequal shards, rows with no keys, L in the hundreds, past 800"),
    "shard-positions": Function("shard_positions", specs.shard_positions, _shard_cases, _SHARD_MISTAKES,
                                says="{n} shards match, contiguous and zigzag, on 1 to 4 ranks"),
    "ring-schedule": Function("ring_schedule", specs.ring_schedule, _schedule_cases, _SCHEDULE_MISTAKES,
                              says="{n} steps of the ring match, contiguous and zigzag, causal or not"),
    "ring-forward": Measured("function", _measure_ring, {"ring_step": _RING_MISTAKES}),
    "ring-group": Measured("process-group", _measure_group,
                           {"(every rank at once)": _GROUP_MISTAKES + [_DEADLOCK, _EXTRA_SENDS]}),
    "comm-bytes": Measured("experiment", _measure_bytes, {"comm_bytes": _BYTES_MISTAKES,
                                                          "(the calls seen)": [NOT_FROM_RING_STEP]}),
}
