"""Exercise 06_triton_primer: its graded parts, what each may not call, and its hints.

Imports nothing heavy: the grader and ``attnlab generate`` read it without torch. The checks are in
``checks.py``, the references in ``spec.py``.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "06_triton_primer"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("softmax-traffic", "counting the bytes a fused kernel saves", 1, ('softmax_traffic',)),
    Part("masked-scale", "a masked load/store warm-up", 1, ('scale_kernel',)),
    Part("softmax-kernel", "a fused softmax kernel", 3, ('softmax_kernel',)),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "softmax-kernel": SOFTMAX + ATTENTION,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {}
