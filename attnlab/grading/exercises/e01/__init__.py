"""Exercise 01_soft_alignment: its parts and what each may not call (its hints: attnlab/course/hints/).

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "01_soft_alignment"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("additive-score", "the additive alignment score", 2, ("additive_scores",)),
    Part("context-vector", "attention weights and the context vector", 2, ("context_vector",)),
    Part("decode-step", "one decoding step", 2, ("decode_step",)),
    Part("alignment-crossing", "experiment: your attention in RNNsearch, and the crossing it learns", 3,
         ("alignment_crossing",), "experiment"),
    Part("explain-crossing", "explain: why the alignment crosses, and what a fixed vector cannot do", 2, (), "manual"),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
# (the library is always forbidden; the score method is named too, for an answer that calls it on a module)
_SCORE = ["attnlab.attention.AdditiveAttention.score"]
FORBIDDEN = {
    "additive-score": ATTENTION + _SCORE,
    "context-vector": SOFTMAX + ATTENTION,
    "decode-step": SOFTMAX + ATTENTION + _SCORE,
    "alignment-crossing": SOFTMAX + ATTENTION + _SCORE,
}

# part id -> library patterns the part may call after all: the experiment trains the course's RNNsearch
# (the attention functions stay forbidden in the answer's own code; the model is built with yours)
ALLOWED = {
    "alignment-crossing": ["attnlab.models.*"],
}
