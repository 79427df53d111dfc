"""Exercise 11_across_devices: its parts, what each may not call, and its hints.

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.

The ring-forward part drives the learner's ``ring_step`` round a ring simulated in one process (the grader hands
each rank, step by step and in ring order, the key/value shard that rank holds then, and the running result that
rank's previous step returned): the step-by-step check that names a mistake. The ring-group part runs the learner's
``ring_forward`` on every rank of a real gloo group that the functions process forks
(:mod:`attnlab.grading.sandbox.ranks`), and counts the bytes on the sandbox's loopback from outside it.
"""

from attnlab.grading.exercises import ATTENTION, SOFTMAX, Part

EXERCISE = "11_across_devices"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("merge-partials", "merging two partial (O, L) results over disjoint keys: the log-sum-exp rescaling", 2,
         ("merge_two",)),
    Part("shard-positions", "the positions a rank holds, contiguous and zigzag", 2, ("shard_positions",)),
    Part("ring-schedule", "the ring's schedule: the shard a rank holds at step t and which causal blocks it computes",
         2, ("ring_schedule",)),
    Part("ring-forward", "one ring step of a rank, driven round a simulated ring: O, L and the bytes sent", 3,
         ("ring_step",)),
    Part("ring-group", "the ring forward on every rank of a gloo group the grader runs: O, L and the bytes sent", 3,
         ("ring_forward",)),
    Part("comm-bytes", "experiment: bytes each rank sends against the world size, ring and all-to-all", 1,
         ("comm_bytes",), "experiment"),
    Part("ring-or-all-to-all", "explain: when all-to-all beats the ring, and when it cannot be used", 1, (),
         "manual"),
]

_DISTRIBUTED = ["attnlab.distributed.*"]
# the ring is what the part asks for: collectives that hand every rank every shard at once are not it (they send
# the same bytes as the ring, 2 (P - 1) shards a rank, so the bytes alone could not tell). Every collective of
# torch.distributed (by any module's name for it: shortcuts resolves re-exports), its object and functional forms
_GATHER = [f"torch.distributed.{name}" for name in (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "_all_gather_base",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "gather", "gather_object", "scatter",
    "scatter_object_list", "reduce", "all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base")] + ["torch.distributed._functional_collectives.*", "torch.distributed.nn.*",
                                "torch.distributed.tensor.*", "torch.distributed._tensor.*",
                                # a process group's own methods (group.allgather(...)): the ways to hold one
                                "torch.distributed.group", "torch.distributed.GroupMember",
                                "torch.distributed.new_group", "torch.distributed.new_subgroups",
                                "torch.distributed.ProcessGroup",
                                "torch.distributed.distributed_c10d._get_default_group",
                                "torch.distributed.distributed_c10d._world"]
_LSE = ["torch.logsumexp", "torch.Tensor.logsumexp", "torch.logaddexp", "torch.Tensor.logaddexp"]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "merge-partials": SOFTMAX + _LSE + _DISTRIBUTED,
    "shard-positions": _DISTRIBUTED,
    "ring-schedule": _DISTRIBUTED,
    "ring-forward": SOFTMAX + ATTENTION + _LSE + _DISTRIBUTED,
    "ring-group": SOFTMAX + ATTENTION + _LSE + _DISTRIBUTED + _GATHER,
    "comm-bytes": _DISTRIBUTED + ["attnlab.iomodel.*"],
}

# part id -> {name: why}: what the answer must read (the syntax of its code, attnlab/grading/shortcuts.py)
REQUIRED = {
    "comm-bytes": {"ring_step": "the ring's row is the bytes your ring_step reports sending, rank 0 driven through "
                                "its P steps: the formula written out is not the count"},
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "merge-partials": [
        "Each side's softmax mass is exp(L_i): the merged L = log(exp(L1) + exp(L2)), and O weighs each O_i by its "
        "share, O = exp(L1 - L) O1 + exp(L2 - L) O2.",
        "Never take exp(L_i) directly (L can be in the hundreds): with M = torch.maximum(l1, l2), "
        "L = M + log(exp(l1 - M) + exp(l2 - M)), every exponent <= 0.",
        "A row with no keys on either side has l1 = l2 = -inf, so M = -inf and l - M is NaN: handle those rows "
        "apart (torch.where on torch.isneginf(M)): O = 0, L = -inf. Return float32, weights with [..., None].",
    ],
    "shard-positions": [
        "Contiguous: P chunks of c = n // P positions; rank r holds chunk r, positions r * c .. (r + 1) * c - 1.",
        "Zigzag: 2P chunks of c = n // (2P); rank r holds chunk r (early) and chunk 2P - 1 - r (late), in that "
        "order: rank 0 gets the first and the last chunk.",
        "Build each chunk with torch.arange(i * c, (i + 1) * c) and torch.cat the rank's chunks; return int64.",
    ],
    "ring-schedule": [
        "At step t rank r holds the shard that started at rank src = (r - t) % P: shards travel to the next rank "
        "(r + 1) each step, so what rank r holds came from its left.",
        "The chunk ids of a rank are [r] (contiguous) or [r, 2P - 1 - r] (zigzag); query chunk a against key chunk "
        "b: full (2) if not causal or a > b, diagonal (1) if a == b, skipped (0) if a < b.",
        "work[i, j] is query chunk i of `rank` (rows) against key chunk j of `src` (columns): a (1, 1) tensor for "
        "contiguous, (2, 2) for zigzag, torch.int64. Return (src, work).",
    ],
    "ring-forward": [
        "Work chunk by chunk: a shard holds n_c chunks (1 contiguous, 2 zigzag: your ring_schedule's work is "
        "(n_c, n_c)); the rank's queries are q.chunk(n_c, dim=2) with chunk ids of `rank`, the held k, v are "
        "k.chunk(n_c, dim=2) with chunk ids of src = (rank - step) % P; skip a block when a < b under causal.",
        "One block: s = q_a @ k_b^T / sqrt(d), top-left causal (j <= i) on a diagonal block; m = row max, "
        "p = exp(s - m), O_ab = (p @ v_b) / p.sum(-1), L_ab = m + log(p.sum(-1)); merge it into the running (O, L) "
        "of chunk a with your merge_two.",
        "sent: the bytes of k and v this rank forwards to the next one, k.numel() * k.element_size() + the same "
        "for v, at every step except the last (step P - 1: nobody needs it); 0 on one rank.",
    ],
    "ring-group": [
        "rank, P = dist.get_rank(), dist.get_world_size(). Start from o = zeros, lse = -inf and hold your own k, v; "
        "loop step = 0 .. P - 1 and call your ring_step(o, lse, q, k_held, v_held, rank, step, P, causal, layout).",
        "Before computing at a step t < P - 1, post the next shard's transfer: dist.batch_isend_irecv([P2POp(isend, "
        "k_held, (rank + 1) % P), P2POp(isend, v_held, ...), P2POp(irecv, k_next, (rank - 1) % P), P2POp(irecv, "
        "v_next, ...)]) with k_next = torch.empty_like(k_held): a buffer of its own, never the one being sent.",
        "After ring_step, wait on every request the batch returned, then k_held, v_held = k_next, v_next. At the "
        "last step post nothing (on every rank alike). Return (o, lse).",
    ],
    "comm-bytes": [
        "Ring: for world size P, shard q, k, v contiguously, drive rank 0 through its P steps with your ring_step (k, v "
        "of rank (0 - t) % P at step t) and sum the `sent` it returns. Only K and V travel: give them kv_heads heads "
        "(and the queries too, since ring_step attends head by head; they change nothing in `sent`).",
        "All-to-all: rank 0's local (1, heads, n/P, d) tensor is cut by heads into P pieces (.chunk(P, dim=1)); it "
        "keeps its own piece and sends the other P - 1. Sum their bytes (numel * element_size). K and V are cut the "
        "same way while kv_heads >= P; below that, .chunk gives too few pieces: each other rank r still needs one "
        "head, the KV head r * kv_heads // P its query heads share.",
        "Ulysses does four all-to-alls in the forward: q, k and v to head shards, and the output back (a head shard "
        "(1, heads/P, n, d) cut by positions). Return int64 (2, len(world_sizes)): ring row, then all-to-all.",
    ],
}
