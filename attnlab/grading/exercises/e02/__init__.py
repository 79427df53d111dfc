"""Exercise 02_queries_keys_values: its graded parts, what each may not call, and its hints.

Imports nothing heavy: the grader and ``attnlab generate`` read it without torch. The checks are in
``checks.py``, the references in ``spec.py``.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "02_queries_keys_values"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("padding-mask", "the padding mask", 1, ('padding_mask',)),
    Part("causal-mask", "the causal mask", 1, ('causal_mask',)),
    Part("attention-masks", "attention with padding and causal masks", 3, ('masked_attention',)),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "attention-masks": ATTENTION,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {}
