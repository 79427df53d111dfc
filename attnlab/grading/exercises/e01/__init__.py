"""Exercise 01_soft_alignment: its graded parts, what each may not call, and its hints.

Imports nothing heavy: the grader and ``attnlab generate`` read it without torch. The checks are in
``checks.py``, the references in ``spec.py``.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "01_soft_alignment"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("additive-score", "the additive alignment score", 2, ('additive_scores',)),
    Part("context-vector", "attention weights and the context vector", 2, ('context_vector',)),
    Part("decode-step", "one decoding step", 2, ('decode_step',)),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "context-vector": SOFTMAX,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {}
