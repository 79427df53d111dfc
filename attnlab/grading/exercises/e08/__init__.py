"""Exercise 08_block_sparse: its graded parts, what each may not call, and its hints.

Imports nothing heavy: the grader and ``attnlab generate`` read it without torch. The checks are in
``checks.py``, the references in ``spec.py``.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "08_block_sparse"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("block-mask-builder", "a sliding-window block mask", 1, ('sliding_window_block_mask',)),
    Part("block-mask-to-elements", "from a block mask to an element mask", 1, ('block_to_element_mask',)),
    Part("block-sparse-loop", "the block-skipping loop of the block-sparse kernel", 3, ('block_sparse_fwd_kernel',)),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "block-mask-builder": BLOCK_MASKS,
    "block-mask-to-elements": BLOCK_MASKS,
    "block-sparse-loop": SOFTMAX + ATTENTION + BLOCK_MASKS,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {}
