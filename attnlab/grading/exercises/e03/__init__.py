"""Exercise 03_scaled_dot_product: its graded parts, what each may not call, and its hints.

Imports nothing heavy: the grader and ``attnlab generate`` read it without torch. The checks are in
``checks.py``, the references in ``spec.py``.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "03_scaled_dot_product"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("stable-softmax", "a numerically stable softmax", 2, ('softmax',)),
    Part("scaled-attention", "scaled dot-product attention", 2, ('scaled_dot_product_attention',)),
    Part("variance-experiment", "the variance experiment", 1, ('score_variance',)),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "stable-softmax": SOFTMAX,
    "scaled-attention": SOFTMAX + ATTENTION,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {}
