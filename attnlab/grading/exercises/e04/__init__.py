"""Exercise 04_multi_head: its graded parts, what each may not call, and its hints.

Imports nothing heavy: the grader and ``attnlab generate`` read it without torch. The checks are in
``checks.py``, the references in ``spec.py``.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "04_multi_head"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("split-heads", "splitting into heads", 1, ('split_heads',)),
    Part("merge-heads", "merging the heads", 1, ('merge_heads',)),
    Part("mha-forward", "a multi-head attention forward", 3, ('multi_head_attention',)),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "mha-forward": ATTENTION,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {}
