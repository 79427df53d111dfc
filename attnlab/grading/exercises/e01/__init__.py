"""Exercise 01_soft_alignment: its parts, what each may not call, and its hints.

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

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "additive-score": [
        "Start from the shapes. W s is one vector of size A per sentence, (B, A); U h_j is one per source "
        "position, (B, N, A). The score needs them added for every j, so one of them needs a new axis.",
        "s @ w.T gives (B, A) and h @ u.T gives (B, N, A). Insert the position axis into the first "
        "((B, 1, A)) so that broadcasting adds it to every h_j; then the tanh, elementwise.",
        "The last step reads one number out of each A-vector: a product with v over the last axis, "
        "(B, N, A) @ (A,) -> (B, N). No softmax here: these are raw scores.",
    ],
    "context-vector": [
        "Three steps: mask, normalise over the N source positions (the last axis), then average h with "
        "the weights. Write the softmax yourself from exp: e_j / sum_k e_k.",
        "Masked positions must end with weight exactly 0: set their scores to -inf *before* exp. Subtract "
        "each row's max (keepdim=True) before exp so that scores of a few hundred do not overflow.",
        "A row whose positions are all masked has max -inf and sum 0: replace a non-finite max by 0 and "
        "divide only where the sum is positive (torch.where), so the row gets zeros, not NaN. The "
        "context is then (weights[:, :, None] * h).sum(1), shape (B, Dk).",
    ],
    "decode-step": [
        "Reuse your two functions: the scores come from the current state s, the weights and context "
        "from context_vector (pass the mask on).",
        "The new state mixes the old state and the context: W_s is (Dq, Dq) and acts on s, W_c is "
        "(Dq, Dk) and acts on c; with row vectors that is s @ w_s.T and c @ w_c.T.",
        "Return a tuple: (tanh of the sum of those two products, the weights from context_vector). "
        "Attend with the *old* state: the update comes after.",
    ],
    "alignment-crossing": [
        "Follow the recipe cell: build RNNsearch(..., score_fn=additive_scores, context_fn=context_vector) "
        "inside `with deterministic(seed, threads=1):`, then train it with fit on batches drawn from a "
        "torch.Generator seeded with the same seed.",
        "To read the alignment, run the trained model once on PROBE_SRC, PROBE_LEN, PROBE_TGT (teacher "
        "forcing) with a context_fn that calls your context_vector and appends its weights to a list: "
        "the model calls it once per French word, so torch.stack(list, dim=1) is (P, T, S).",
        "For each probe sentence k and each (i, j) in SWAPS[k]: crossed += (A[k, i, j] + A[k, i + 1, j - 1]) / 2 "
        "and straight += (A[k, i, j - 1] + A[k, i + 1, j]) / 2; return the two means over all pairs, as floats.",
    ],
}
