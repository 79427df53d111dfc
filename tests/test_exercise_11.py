"""Exercise 11 (attention across devices): wrong implementations fail their check with the matching diagnosis,
shortcuts are refused, a right answer written another way passes, and the ring-forward check drives the learner's
step round a simulated ring (the learner's own running result travels on from step to step)."""

import math
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from attnlab.distributed import group as ranks

from attnlab.grading import sandbox
from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.distributed import attention_lse, unshard
from attnlab.grading.exercises.e11 import spec
from mistakes import Wrong

WRONG = Wrong()


# ---------------------------------------------------------------------------------------------
# merge-partials: a learner's merge, with one flaw each
# ---------------------------------------------------------------------------------------------

def _merge(flaw=None):
    def merge_two(o1, l1, o2, l2):
        o1, o2, l1, l2 = o1.float(), o2.float(), l1.float(), l2.float()
        if flaw == "exp-overflows":
            s = torch.exp(l1) + torch.exp(l2)
            return (torch.exp(l1) / s)[..., None] * o1 + (torch.exp(l2) / s)[..., None] * o2, torch.log(s)
        m = torch.where(l1 > l2, l1, l2)
        safe = m if flaw == "empty-rows-nan" else torch.where(torch.isinf(m), torch.zeros_like(m), m)
        e1, e2 = torch.exp(l1 - safe), torch.exp(l2 - safe)
        lse = safe + torch.log(e1 + e2)
        if flaw == "lse-max-only":
            lse = torch.where(torch.isinf(m), m, m)
        elif flaw == "lse-added":
            lse = l1 + l2
        if flaw == "mean-of-partials":
            return 0.5 * (o1 + o2), lse
        if flaw == "not-normalised":
            w1, w2 = e1, e2
        else:
            w1, w2 = e1 / (e1 + e2), e2 / (e1 + e2)
            if flaw != "empty-rows-nan":
                w1, w2 = torch.nan_to_num(w1), torch.nan_to_num(w2)
        if flaw == "weights-swapped":
            w1, w2 = w2, w1
        return o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1), lse
    return merge_two


for _key in ("mean-of-partials", "exp-overflows", "lse-max-only", "lse-added", "empty-rows-nan", "not-normalised",
             "weights-swapped"):
    WRONG.add("merge-partials", _key, merge_two=_merge(_key))


# ---------------------------------------------------------------------------------------------
# shard-positions
# ---------------------------------------------------------------------------------------------

def _positions(flaw=None):
    def shard_positions(n, world_size, rank, layout="contiguous"):
        P = world_size
        if layout == "contiguous" or flaw == "layout-ignored":
            if flaw == "contiguous-strided":
                return torch.tensor(list(range(rank, n, P)))
            size = n // P
            return torch.tensor(list(range(rank * size, rank * size + size)))
        size = n // P if flaw == "zigzag-chunks-too-big" else n // (2 * P)
        late = {"late-chunk-off-by-one": 2 * P - rank, "late-chunk-shifted": rank + P}.get(flaw, 2 * P - 1 - rank)
        chunks = [late, rank] if flaw == "late-chunk-first" else [rank, late]
        return torch.tensor([(c * size + i) % n for c in chunks for i in range(size)])
    return shard_positions


for _key in ("late-chunk-off-by-one", "late-chunk-shifted", "zigzag-chunks-too-big", "late-chunk-first",
             "layout-ignored", "contiguous-strided"):
    WRONG.add("shard-positions", _key, shard_positions=_positions(_key))


# ---------------------------------------------------------------------------------------------
# ring-schedule
# ---------------------------------------------------------------------------------------------

def _schedule(flaw=None):
    def ring_schedule(rank, world_size, step, layout="contiguous", causal=True):
        P = world_size
        src = (rank + step) % P if flaw == "ring-turns-the-wrong-way" else (rank - step) % P
        zig = layout == "zigzag" and flaw != "layout-ignored"
        mine = [rank, 2 * P - 1 - rank] if zig else [rank]
        theirs = [src, 2 * P - 1 - src] if zig else [src]
        rows = []
        for a in mine:
            row = []
            for b in theirs:
                if not causal:
                    row.append(2)
                elif a == b:
                    row.append(2 if flaw == "diagonal-as-full" else 1)
                elif flaw == "future-blocks-computed":
                    row.append(2)
                elif flaw == "causal-inverted":
                    row.append(2 if a < b else 0)
                else:
                    row.append(2 if a > b else 0)
            rows.append(row)
        work = torch.tensor(rows)
        if flaw == "table-transposed":
            work = work.t()
        return src, work
    return ring_schedule


for _key in ("ring-turns-the-wrong-way", "diagonal-as-full", "future-blocks-computed", "causal-inverted",
             "layout-ignored", "table-transposed"):
    WRONG.add("ring-schedule", _key, ring_schedule=_schedule(_key))


# ---------------------------------------------------------------------------------------------
# ring-forward: a learner's ring step, standalone (its own block attention and merge)
# ---------------------------------------------------------------------------------------------

def _block(q, k, v, causal, scaled=True):
    s = q @ k.transpose(-1, -2) / (math.sqrt(q.shape[-1]) if scaled else 1.0)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    m = s.max(-1, keepdim=True).values
    p = torch.exp(s - m)
    return (p @ v) / p.sum(-1, keepdim=True), (m + torch.log(p.sum(-1, keepdim=True))).squeeze(-1)


def _ring_step(flaw=None):
    merge = _merge()

    def ring_step(o, lse, q, k, v, rank, step, world_size, causal=False, layout="contiguous"):
        P = world_size
        src = (rank + step) % P if flaw == "ring-turns-the-wrong-way" else (rank - step) % P
        zig = layout == "zigzag" and flaw != "layout-ignored"
        ids = (lambda r: [r, 2 * P - 1 - r]) if zig else (lambda r: [r])
        c = len(ids(rank))
        outs, lses = [], []
        for a, qa, oa, la in zip(ids(rank), q.chunk(c, 2), o.chunk(c, 2), lse.chunk(c, 2)):
            first = la.clone()
            for b, kb, vb in zip(ids(src), k.chunk(c, 2), v.chunk(c, 2)):
                if causal and a < b and flaw != "future-blocks-computed":
                    continue
                ob, lb = _block(qa, kb, vb, causal and a == b and flaw != "diagonal-unmasked", flaw != "scale-missing")
                if flaw == "partials-added":
                    oa, la = oa + ob, merge(oa, la, ob, lb)[1]
                else:
                    oa, la = merge(oa, la, ob, lb)
            if flaw == "lse-not-updated":
                la = torch.where(torch.isinf(first), la, first)
            outs.append(oa)
            lses.append(la)
        per_shard = k.numel() * k.element_size() + (0 if flaw == "sends-k-only" else v.numel() * v.element_size())
        sent = per_shard if (step < P - 1 or flaw == "sends-at-the-last-step") else 0
        return torch.cat(outs, 2), torch.cat(lses, 2), sent
    return ring_step


for _key in ("ring-turns-the-wrong-way", "future-blocks-computed", "diagonal-unmasked", "partials-added",
             "lse-not-updated", "sends-at-the-last-step", "sends-k-only", "layout-ignored", "scale-missing"):
    WRONG.add("ring-forward", _key, ring_step=_ring_step(_key))


# ---------------------------------------------------------------------------------------------
# comm-bytes: the experiment, counted by simulating the ring and the all-to-all, with one flaw each
# ---------------------------------------------------------------------------------------------

def _measured(flaw=None):
    def comm_bytes(world_sizes, n=48, heads=12, d=8, kv_heads=None):
        h_kv = heads if kv_heads is None or flaw == "kv-heads-ignored" else kv_heads
        table = torch.zeros(2, len(world_sizes), dtype=torch.int64)
        for col, P in enumerate(world_sizes):
            q, k, v = torch.randn(1, h_kv, n, d), torch.randn(1, h_kv, n, d), torch.randn(1, h_kv, n, d)
            m = n // P
            o, lse = torch.zeros(1, h_kv, m, d), torch.full((1, h_kv, m), -math.inf)
            ring = 0
            for t in range(P - 1 if flaw == "last-step-skipped" else P):   # the last step sends nothing
                src = (0 - t) % P
                ks, vs = k[:, :, src * m:(src + 1) * m], v[:, :, src * m:(src + 1) * m]
                o, lse, sent = ring_step(o, lse, q[:, :, :m], ks, vs, 0, t, P)   # the notebook's, by its name
                if flaw == "ring-k-only":
                    sent = ks.numel() * ks.element_size() if t < P - 1 else 0
                ring += sent
                if flaw == "ring-sends-every-step" and t == P - 1:
                    ring += 2 * ks.numel() * 4
            a2a = 0
            for local, kind in ((torch.zeros(1, heads, m, d), "q"), (k[:, :, :m], "k"), (v[:, :, :m], "v"),
                                (torch.zeros(1, heads, m, d), "o")):
                if kind == "o" and flaw == "all-to-all-output-forgotten":
                    continue
                H = local.shape[1]
                if H >= P or flaw == "kv-heads-not-replicated":
                    pieces = list(local.chunk(P, dim=1))
                else:                                            # each other rank gets its one shared KV head
                    pieces = [local[:, r * H // P:r * H // P + 1] for r in range(P)]
                for r, piece in enumerate(pieces):
                    if r == 0 and flaw != "all-to-all-sends-own-piece":
                        continue
                    a2a += (local if flaw == "all-to-all-whole-shard" else piece).numel() * piece.element_size()
            table[0, col] = ring
            table[1, col] = a2a
        return table.T if flaw == "transposed" else table
    return comm_bytes


ring_step = _ring_step()   # the learner's right one, which comm_bytes reads as a notebook cell does (by its name)


def _ring_row_by_formula(world_sizes, n=48, heads=12, d=8, kv_heads=None):
    """comm_bytes with ring_step called, but the ring's row written as the formula: 2 (P - 1) shards' bytes."""
    table = _measured()(world_sizes, n, heads, d, kv_heads)
    h_kv = heads if kv_heads is None else kv_heads
    table[0] = torch.tensor([2 * (P - 1) * h_kv * (n // P) * d * 4 for P in world_sizes])
    return table


WRONG.add("comm-bytes", "ring-row-not-from-ring-step", comm_bytes=_ring_row_by_formula)


def test_the_ring_row_is_seen_to_come_from_ring_step_calls():
    """comm_bytes runs again with ring_step tapped (its k-th send grows by k times a salted step): P calls of rank 0,
    or P - 1 (the last step sends nothing), pass; one call whose send is multiplied does not."""
    for flaw in (None, "last-step-skipped"):
        result = run_check("comm-bytes", LocalLearner({"comm_bytes": _measured(flaw)}, forbidden=[]), salt=31)
        assert result.passed and "sum of your ring_step's sends" in result.message, result.message

    def once_then_multiplied(world_sizes, n=48, heads=12, d=8, kv_heads=None):
        table = _measured()(world_sizes, n, heads, d, kv_heads)
        h_kv = heads if kv_heads is None else kv_heads
        for col, P in enumerate(world_sizes):
            q = torch.randn(1, h_kv, n // P, d)
            o, lse = torch.zeros_like(q), torch.full(q.shape[:-1], -math.inf)
            table[0, col] = (P - 1) * ring_step(o, lse, q, q, q, 0, 0, P)[2]
        return table

    result = run_check("comm-bytes", LocalLearner({"comm_bytes": once_then_multiplied}, forbidden=[]))
    assert not result.passed and result.diagnosis == ["ring-row-not-from-ring-step"], result.message

for _key in ("ring-sends-every-step", "ring-k-only", "all-to-all-sends-own-piece", "all-to-all-output-forgotten",
             "all-to-all-whole-shard", "transposed", "kv-heads-ignored", "kv-heads-not-replicated"):
    WRONG.add("comm-bytes", _key, comm_bytes=_measured(_key))

# ---------------------------------------------------------------------------------------------
# ring-group: a learner's whole ring forward on a real gloo group (forked by attnlab.grading.sandbox.ranks)
# ---------------------------------------------------------------------------------------------

def _ring_forward(flaw=None):
    step_fn = _ring_step()

    def ring_forward(q, k, v, causal=False, layout="contiguous"):
        rank, P = dist.get_rank(), dist.get_world_size()
        nxt, prev = (rank + 1) % P, (rank - 1) % P
        if flaw == "sent-to-the-previous-rank":
            nxt, prev = prev, nxt
        if flaw == "ranks-hung":          # sends to the next rank, waits for the next rank: on 3 ranks nobody sends
            prev = nxt                    # to rank 0 what it waits for
        o, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], -math.inf)
        k_held, v_held = k.clone(), v.clone()
        for step in range(P):
            last = step == P - 1
            if not last or flaw == "sends-at-the-last-step":
                k_next, v_next = torch.empty_like(k_held), torch.empty_like(v_held)
                requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, k_held, nxt),
                                                   dist.P2POp(dist.isend, v_held, nxt),
                                                   dist.P2POp(dist.irecv, k_next, prev),
                                                   dist.P2POp(dist.irecv, v_next, prev)])
            if flaw == "computes-after-the-swap" and not last:   # waits and swaps first: computes what it received
                for request in requests:
                    request.wait()
                k_held, v_held = k_next, v_next
            o, lse, _ = step_fn(o, lse, q, k_held, v_held, rank, step, P,
                                causal and flaw != "causal-not-passed-on",
                                "contiguous" if flaw == "layout-not-passed-on" else layout)
            if (not last or flaw == "sends-at-the-last-step") and flaw != "computes-after-the-swap":
                for request in requests:
                    request.wait()
                if flaw != "own-shard-every-step":
                    k_held, v_held = k_next, v_next
        return o, lse
    return ring_forward


for _key in ("sent-to-the-previous-rank", "causal-not-passed-on", "layout-not-passed-on", "own-shard-every-step",
             "ranks-hung", "sends-at-the-last-step", "computes-after-the-swap"):
    WRONG.add("ring-group", _key, ring_forward=_ring_forward(_key))

test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


@pytest.fixture(autouse=True)
def short_rank_timeout(monkeypatch):
    """A deadlocked group is stopped after 5 s here (10 s in the grader): the ranks of a right ring finish in 0.1 s."""
    monkeypatch.setattr(ranks, "DEFAULT_TIMEOUT", 5.0)


@pytest.fixture(autouse=True)
def no_orphans():
    """Every rank a check forked is gone (killed and reaped, no zombie) when the test ends."""
    before = sandbox.descendants()
    yield
    left = sandbox.descendants() - before
    assert not left, f"processes left behind: {sorted(left)}"


def test_a_rank_that_raises_is_named_and_the_others_are_stopped():
    right = _ring_forward()

    def ring_forward(q, k, v, causal=False, layout="contiguous"):
        if dist.get_rank() == 1:
            raise ValueError("boom on this rank")
        return right(q, k, v, causal, layout)   # rank 0 waits for rank 1's shard, which never comes

    start = time.monotonic()
    result = run_check("ring-group", LocalLearner({"ring_forward": ring_forward}, forbidden=[]))
    assert not result.passed and "rank 1 of 2" in result.message and "boom" in result.message, result.message
    assert time.monotonic() - start < 30


def test_a_group_whose_ranks_hang_is_stopped_within_the_timeout():
    def ring_forward(q, k, v, causal=False, layout="contiguous"):
        time.sleep(3600)

    start = time.monotonic()
    result = run_check("ring-group", LocalLearner({"ring_forward": ring_forward}, forbidden=[]))
    assert not result.passed and "ranks-hung" in result.diagnosis, result.message
    assert "ranks 0, 1 of 2 did not finish" in result.message, result.message
    assert time.monotonic() - start < 5.0 + 10


def test_call_on_ranks_gives_each_rank_its_arguments_and_refuses_a_wrong_case():
    outcomes = ranks.call_on_ranks(lambda x, y=0: (dist.get_rank(), dist.get_world_size(), x + y),
                                   [[[[10], {"y": 1}], [[20], {}], [[30], {"y": 2}]]], 3)[0]
    assert [o["ok"] for o in outcomes] == [(0, 3, 11), (1, 3, 20), (2, 3, 32)]
    with pytest.raises(ValueError, match="one \\[args, kwargs\\] per rank"):
        ranks.call_on_ranks(lambda: 0, [[[[], {}]]], 2)
    with pytest.raises(ValueError, match="ranks: expected a number of ranks"):
        ranks.call_on_ranks(lambda: 0, [], 0)


def test_a_rank_that_exits_is_reported_as_died():
    outcomes = ranks.call_on_ranks(lambda: os._exit(3) if dist.get_rank() == 0 else 1, [[[[], {}], [[], {}]]], 2)[0]
    assert outcomes[0].get("died") and "rank 0 of 2 died" in outcomes[0]["raised"], outcomes


# ---------------------------------------------------------------------------------------------
# right answers written another way, and shortcuts
# ---------------------------------------------------------------------------------------------

def test_right_answers_written_another_way_pass():
    for part, names in (("merge-partials", {"merge_two": _merge()}),
                        ("shard-positions", {"shard_positions": _positions()}),
                        ("ring-schedule", {"ring_schedule": _schedule()}),
                        ("ring-forward", {"ring_step": _ring_step()}),
                        ("ring-group", {"ring_forward": _ring_forward()}),
                        ("comm-bytes", {"comm_bytes": _measured()})):
        result = run_check(part, LocalLearner(names, forbidden=[]))
        assert result.passed, result.message


def test_the_ring_check_feeds_the_learner_s_own_state_back():
    # a step that is right only when handed the reference's running result, not its own: it keeps a hidden
    # counter and returns a wrong O from its second call on any rank; the check must see it at step 1
    calls = []
    right = _ring_step()

    def ring_step(o, lse, q, k, v, rank, step, world_size, causal=False, layout="contiguous"):
        calls.append((rank, step))
        o, lse, sent = right(o, lse, q, k, v, rank, step, world_size, causal, layout)
        return (o + 1.0 if step == 1 else o), lse, sent

    result = run_check("ring-forward", LocalLearner({"ring_step": ring_step}, forbidden=[]))
    assert not result.passed and "step 1" in result.message, result.message
    assert max(s for _, s in calls) == 1                  # it stopped at the first wrong step


def _refused(part, ns, name):
    result = run_check(part, ns)
    assert not result.passed and "shortcut" in result.diagnosis, result.message
    assert name in result.message, result.message


def test_the_library_s_distributed_functions_and_softmax_are_refused():
    from attnlab import distributed   # through the module, as a notebook's imports see it

    _refused("merge-partials", {"merge_two": lambda o1, l1, o2, l2: distributed.merge_partials(o1, l1, o2, l2)},
             "attnlab.distributed.")
    _refused("merge-partials", {"merge_two": lambda o1, l1, o2, l2: (
        torch.stack([o1, o2]).mul(torch.softmax(torch.stack([l1, l2]), 0)[..., None]).sum(0),
        torch.logsumexp(torch.stack([l1, l2]), 0))}, "torch.")
    _refused("shard-positions", {"shard_positions": lambda n, p, r, layout="contiguous":
                                 distributed.shard_indices(n, p, r, layout)}, "attnlab.distributed.")

    def by_sdpa(o, lse, q, k, v, rank, step, world_size, causal=False, layout="contiguous"):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out, lse, 0

    _refused("ring-forward", {"ring_step": by_sdpa}, "scaled_dot_product_attention")

    def by_all_gather(q, k, v, causal=False, layout="contiguous"):   # the same bytes as the ring, but no ring
        P = dist.get_world_size()
        ks, vs = [torch.empty_like(k) for _ in range(P)], [torch.empty_like(v) for _ in range(P)]
        dist.all_gather(ks, k.contiguous())
        dist.all_gather(vs, v.contiguous())
        return attention_lse(q, unshard(ks, layout), unshard(vs, layout), causal)

    _refused("ring-group", {"ring_forward": by_all_gather}, "torch.distributed.all_gather")


def test_the_io_model_is_refused_as_the_experiment():
    from attnlab import iomodel

    def by_formula(world_sizes, n=48, heads=12, d=8, kv_heads=None):
        return torch.tensor([[iomodel.ring_attention_bytes(1, heads, n, d, p, 4, kv_heads=kv_heads) for p in world_sizes],
                             [iomodel.ulysses_attention_bytes(1, heads, n, d, p, 4, kv_heads=kv_heads)
                              for p in world_sizes]])

    _refused("comm-bytes", {"comm_bytes": by_formula}, "attnlab.iomodel.")


def test_the_grader_s_own_answers_are_refused():
    _refused("ring-schedule", {"ring_schedule": spec.ring_schedule},
             "attnlab.grading.exercises.e11.spec.ring_schedule")


@pytest.mark.slow
def test_the_grader_counts_the_bytes_on_the_sandbox_s_loopback(tmp_path):
    # under `attnlab grade` the bytes are read from outside the learner's processes: a ring that also sends at the
    # last step (right O and L, and its ranks' own reports are not what is read) scores nothing there, with its
    # diagnosis; the rest of the notebook keeps its points
    import json
    import subprocess
    import sys

    import nbformat

    root = Path(__file__).resolve().parents[1]
    nb = nbformat.read(str(root / "solutions" / "11_across_devices.ipynb"), as_version=4)
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "ring-group-answer")
    assert cell.source.count("if step < P - 1:") == 2        # the transfer posted, and waited on
    cell.source = cell.source.replace("if step < P - 1:", "if True:")
    path = tmp_path / "11_sends_at_the_last_step.ipynb"
    nbformat.write(nb, str(path))
    env = dict(os.environ, PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, "-m", "attnlab", "grade", str(path), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())["notebooks"][0]
    parts = {p["name"]: p for p in report["parts"]}
    assert parts["ring-forward"]["points"] == parts["ring-forward"]["max_points"] == 3, parts["ring-forward"]
    group = parts["ring-group"]
    assert group["points"] == 0 and "sends-at-the-last-step" in group["diagnosis"], group
    text = json.dumps(group)
    assert "sends-at-the-last-step" in text, text
    if "bubblewrap" in report.get("isolation", ""):
        assert "ranks together sent" in text, text   # the sandbox's loopback, read from outside


def test_a_rank_cannot_reach_the_other_ranks_arguments_in_the_request():
    import gc

    def peek(mine):
        seen = [x for x in gc.get_objects() if type(x) is list and len(x) == 2 and x and
                isinstance(x[0], list) and x[0] and isinstance(x[0][0], str) and x[0][0].startswith("shard of rank")]
        return sorted({x[0][0] for x in seen} - {mine})

    case = [[[f"shard of rank {r}"], {}] for r in range(3)]
    outcomes = ranks.call_on_ranks(peek, [case], 3)[0]
    assert [o["ok"] for o in outcomes] == [[], [], []], outcomes


def test_the_byte_limit_takes_a_message_sent_twice_and_refuses_a_send_at_the_last_step():
    # under load one 8 KiB message in 5 to 10 groups travelled twice with TCP's RetransSegs unchanged, and correct
    # rings lost the part; the limit sits halfway between the right ring and one that also sends at the last step
    from attnlab import iomodel
    from attnlab.grading.exercises.e11.checks import GROUP_CONFIGS, bytes_slack

    for label, B, H, m, d, P, causal, layout in GROUP_CONFIGS:
        want = P * iomodel.ring_attention_bytes(B, H, P * m, d, P, 4)
        framing = 620 * P * (P - 1) // 2
        message = B * H * m * d * 4                     # one shard of K (or of V)
        if P == 1:
            assert want == 0 and bytes_slack(want, P) == 0, label
            continue
        assert framing + 2 * message <= bytes_slack(want, P), label                    # twice sent, twice: kept
        assert want / (P - 1) + framing >= bytes_slack(want, P) + 16 * 1024, label      # the last-step send: refused


def test_a_group_run_again_after_a_retransmission_gets_new_values(monkeypatch):
    # a rank of the first run could return its own shard as its answer, and the forking process keep it for the
    # ranks of the next run: the second run's shards are new values of the same shapes, and a right ring still passes
    from attnlab.grading.exercises.e11 import checks

    counters = iter([(0, 0, 0), (0, 0, 1)])   # the first group's first run: TCP retransmitted a segment
    monkeypatch.setattr(checks, "_lo_sent", lambda pid: next(counters, None))
    calls = []

    class Recording(LocalLearner):
        def call(self, name, cases, grad=None, ranks=None):
            calls.append([[t.clone() for t in args] for args, _ in cases[0]])
            return super().call(name, cases, grad, ranks)

    result = run_check("ring-group", Recording({"ring_forward": _ring_forward()}, forbidden=[]))
    assert result.passed, result.message
    first, again = calls[0], calls[1]
    assert len(calls) == len(checks.GROUP_CONFIGS) + 1                 # the first group ran twice, the others once
    assert [[t.shape for t in rank] for rank in first] == [[t.shape for t in rank] for rank in again]
    assert not any(torch.equal(a, b) for x, y in zip(first, again) for a, b in zip(x, y))
