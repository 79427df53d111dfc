"""Exercise 12_beyond_dense: its parts and what each may not call (its hints: attnlab/course/hints/)."""

from attnlab.grading.exercises import ATTENTION, SOFTMAX, Part

EXERCISE = "12_beyond_dense"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("causal-topk", "the indexer's causal top-k block selection", 2, ("select_blocks",)),
    Part("selected-kernel", "selected-block attention in Triton: only the chosen key blocks are read", 3,
         ("selected_attn_kernel",)),
    Part("delta-recurrence", "the gated delta rule, token by token", 2, ("delta_recurrence",)),
    Part("delta-chunked", "the gated delta rule chunk by chunk (WY / UT form), never N x N", 3,
         ("delta_chunkwise",)),
    Part("state-vs-cache", "experiment: a delta layer's state against a KV cache, per decoded token", 1,
         ("state_vs_cache",), "experiment"),
    Part("beyond-explain", "explain: what selection and a recurrent state buy, and what they give up", 1, (),
         "manual"),
]

# the library's answers: the selection and its attention, the delta rule (both forms) and its kernel
_SPARSE = ["attnlab.sparse.*"]
_DELTA = ["attnlab.linear_attention.*", "attnlab.hybrids.*", "attnlab.models.*"]

# part id -> patterns of what its answer may not call (besides the library and the references). torch.topk and
# torch.sort are allowed in causal-topk: ranking is not what the part teaches; the causal rules around it are
FORBIDDEN = {
    "causal-topk": _SPARSE,
    "selected-kernel": SOFTMAX + ATTENTION + _SPARSE,
    "delta-recurrence": _DELTA,
    "delta-chunked": _DELTA,
    "state-vs-cache": _DELTA + ["attnlab.iomodel.*", "attnlab.kvcache.*"],
}

# part id -> {name: why}: what the answer must read (the syntax of its code, attnlab/grading/shortcuts.py)
REQUIRED = {
    "state-vs-cache": {"delta_chunkwise|delta_recurrence": "measure the state your own delta rule returns after L "
                                                           "tokens: the formula written out is not a measurement"},
}
