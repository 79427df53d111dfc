"""Exercise 02_queries_keys_values: its parts and what each may not call (read without torch by parts.py)."""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, Part

EXERCISE = "02_queries_keys_values"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("padding-mask", "the padding mask", 1, ('padding_mask',)),
    Part("causal-mask", "the causal mask", 1, ('causal_mask',)),
    Part("attention-masks", "attention with padding and causal masks", 3, ('masked_attention',)),
    Part("attention-row", "one query: a row of the attention matrix", 2, ('attention_row',)),
    Part("loop-timing", "the experiment: one query at a time against all at once", 2, ('loop_attention',),
         "experiment"),
    Part("speedup-explained", "why all queries at once are faster", 1, (), "manual"),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "padding-mask": BLOCK_MASKS,
    "causal-mask": BLOCK_MASKS,
    "attention-masks": ATTENTION + BLOCK_MASKS,
    "attention-row": ATTENTION,
    "loop-timing": ATTENTION,
}

# part id -> {name: why}: what its answer must read (attnlab/grading/shortcuts.py:missing)
REQUIRED = {
    "loop-timing": {"attention_row": "the loop computes each query's row with your attention_row from part 4, one "
                                     "call per query: that is the loop being timed"},
}
