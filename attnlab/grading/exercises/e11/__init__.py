"""Exercise 11_across_devices: its parts and what each may not call (its hints: attnlab/course/hints/).

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
