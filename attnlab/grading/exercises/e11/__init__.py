"""Exercise 11_across_devices: its parts and what each may not call (its hints: attnlab/course/hints/)."""

from attnlab.grading.exercises import ATTENTION, SOFTMAX, Part

EXERCISE = "11_across_devices"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("merge-partials", "merging two partial (O, L) results: the log-sum-exp rescaling", 2, ("merge_two",)),
    Part("shard-positions", "the positions a rank holds, contiguous and zigzag", 2, ("shard_positions",)),
    Part("ring-schedule", "the shard a rank holds at step t and the causal blocks it computes", 2, ("ring_schedule",)),
    Part("ring-forward", "one ring step of a rank, round a simulated ring: O, L and bytes sent", 3, ("ring_step",)),
    Part("ring-group", "the ring forward on every rank of a gloo group: O, L and bytes sent", 3, ("ring_forward",)),
    Part("comm-bytes", "experiment: the bytes a rank sends, ring and all-to-all", 1, ("comm_bytes",), "experiment"),
    Part("ring-or-all-to-all", "explain: when all-to-all beats the ring, and when it cannot be used", 1, (), "manual"),
]

_DISTRIBUTED = ["attnlab.distributed.*"]
# the ring is what the part asks for: collectives that hand every rank every shard at once send the same bytes, so
# the bytes alone could not tell. Every collective of torch.distributed, its object and functional forms
_GATHER = [f"torch.distributed.{name}" for name in (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "_all_gather_base",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "gather", "gather_object", "scatter",
    "scatter_object_list", "reduce", "all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "_functional_collectives.*", "nn.*", "tensor.*", "_tensor.*",
    # a process group's own methods (group.allgather(...)): the ways to hold one
    "group", "GroupMember", "new_group", "new_subgroups", "ProcessGroup", "distributed_c10d._get_default_group",
    "distributed_c10d._world")]
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
REQUIRED = {"comm-bytes": {"ring_step": "the ring's row is the sum of your ring_step's sends, rank 0 driven "
                                        "through its P steps, not the formula written out"}}
