"""Exercise 04_multi_head: its parts and what each may not call (read without torch by attnlab/grading/parts.py)."""

from attnlab.grading.exercises import ATTENTION, Part

EXERCISE = "04_multi_head"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("split-heads", "splitting into heads", 1, ("split_heads",)),
    Part("merge-heads", "merging the heads", 1, ("merge_heads",)),
    Part("mha-forward", "a MultiHeadAttention module with masks", 3, ("MultiHeadAttention", "mha_forward")),
    Part("mha-cost", "parameters and FLOPs of a layer", 2, ("mha_parameters", "mha_flops")),
    Part("head-specialisation", "the head-specialisation experiment", 2, ("head_specialisation",), "experiment"),
    Part("mha-explain", "what more heads cost", 2, (), "manual"),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "mha-forward": ATTENTION,
    "mha-cost": ["torch.utils.flop_counter.FlopCounterMode"],   # it would count the FLOPs for you
    "head-specialisation": ATTENTION,
}
