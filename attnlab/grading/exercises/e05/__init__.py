"""Exercise 05_quadratic_cost: its graded parts, what each may not call, and its hints.

Imports nothing heavy: the grader and ``attnlab generate`` read it without torch. The checks are in
``checks.py``, the references in ``spec.py``.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "05_quadratic_cost"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("attention-flops", "counting FLOPs", 1, ('attention_flops',)),
    Part("attention-bytes", "counting HBM bytes", 1, ('attention_bytes',)),
    Part("arithmetic-intensity", "arithmetic intensity and the roofline", 2, ('arithmetic_intensity', 'is_memory_bound')),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {}
