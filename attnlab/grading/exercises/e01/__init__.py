"""Exercise 01_soft_alignment: its parts and what each may not call (its hints: attnlab/course/hints/)."""

from attnlab.grading.exercises import ATTENTION, SOFTMAX, Part

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

# part id -> patterns of what its answer may not call (besides the library, always forbidden, and the references);
# the score method is named too, for an answer that calls it on a module
_SCORE = ["attnlab.attention.AdditiveAttention.score"]
FORBIDDEN = {
    "additive-score": ATTENTION + _SCORE,
    "context-vector": SOFTMAX + ATTENTION,
    "decode-step": SOFTMAX + ATTENTION + _SCORE,
    "alignment-crossing": SOFTMAX + ATTENTION + _SCORE,
}

# part id -> library patterns the part may call after all: the experiment trains the course's RNNsearch, built with
# your attention functions (the library's stay forbidden in the answer's own code)
ALLOWED = {"alignment-crossing": ["attnlab.models.*"]}
