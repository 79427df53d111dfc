"""Exercise 07_flash_attention: its graded parts, what each may not call, and its hints.

Imports nothing heavy: the grader and ``attnlab generate`` read it without torch. The checks are in
``checks.py``, the references in ``spec.py``.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "07_flash_attention"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("online-softmax-update", "the online-softmax update", 2, ('online_softmax_update',)),
    Part("tiled-forward", "a tiled forward in PyTorch", 2, ('tiled_attention_forward',)),
    Part("flash-kernel-loop", "the loop of the Triton FlashAttention forward", 3, ('flash_fwd_kernel',)),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "online-softmax-update": SOFTMAX,
    "tiled-forward": SOFTMAX + ATTENTION,
    "flash-kernel-loop": SOFTMAX + ATTENTION,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {}
