"""Exercise 02_queries_keys_values: its parts, what each may not call, and its hints.

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "02_queries_keys_values"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("padding-mask", "the padding mask", 1, ('padding_mask',)),
    Part("causal-mask", "the causal mask", 1, ('causal_mask',)),
    Part("attention-masks", "attention with padding and causal masks", 3, ('masked_attention',)),
    Part("attention-row", "one query: a row of the attention matrix", 2, ('attention_row',)),
    Part("loop-timing", "the experiment: one query at a time against all at once", 2, ('loop_attention',),
         "experiment"),
    Part("speedup-explained", "why all queries at once are faster", 1, (), "manual"),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "padding-mask": BLOCK_MASKS,
    "causal-mask": BLOCK_MASKS,
    "attention-masks": ATTENTION + BLOCK_MASKS,
    "attention-row": ATTENTION,
    "loop-timing": ATTENTION,
}

# part id -> {name: why}: what its answer must read (attnlab/grading/shortcuts.py:missing)
REQUIRED = {
    "loop-timing": {"attention_row": "the loop computes each query's row with your attention_row from part 4, one "
                                     "call per query: that is the loop being timed"},
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "padding-mask": [
        "Compare every position j = 0 .. max_len-1 with every sequence's length: torch.arange(max_len) gives "
        "the positions, and comparing two tensors gives a bool tensor.",
        "Give the positions the shape (1, max_len) and the lengths the shape (B, 1): broadcasting then "
        "compares each pair and gives (B, max_len). Put the positions on lengths.device.",
        "Position j is a real token when it comes before the length (j = 0 .. length-1): one strict comparison "
        "of the form positions[None, :] ? lengths[:, None].",
    ],
    "causal-mask": [
        "Query i may look at key j when j is not in its future. Build the query positions and the key "
        "positions with torch.arange (on `device`).",
        "Shape the query positions (n_q, 1) and the key positions (1, n_k): one comparison broadcasts to "
        "(n_q, n_k). Check n_q = 2, n_k = 4 by hand: row 0 keeps key 0 only, row 1 keys 0 and 1.",
        "The mask is True where j <= i, also when n_q != n_k: the diagonal starts at (0, 0) whatever the "
        "shapes (top-left, as PyTorch's is_causal). Return the comparison itself: a bool tensor.",
    ],
    "attention-masks": [
        "Write the unmasked version first: scores = q @ k.transpose(-2, -1) / sqrt(d) of shape (B, H, Nq, Nk), "
        "weights = softmax over the keys (the last axis), out = weights @ v.",
        "Masks act on the scores, before the softmax: combine `mask` and, if `causal`, the (Nq, Nk) causal mask "
        "(part 2's comparison, built here) with &, then scores.masked_fill(~keep, float('-inf')). A finite 'very negative' number is not enough: "
        "a row with every key masked would then average all the values.",
        "A row whose keys are all masked has only -inf scores, and its softmax is 0/0 = NaN. Replace those "
        "rows' weights by zeros (torch.nan_to_num, or torch.where on keep.any(-1, keepdim=True)) before "
        "multiplying by v.",
    ],
    "attention-row": [
        "One query against every key: the scores are a vector of Nk numbers, k @ q / sqrt(d) (a matrix-vector "
        "product), with d = q.shape[-1].",
        "Set the scores of keys that `keep` excludes to -inf, turn the scores into weights with a softmax over "
        "the Nk keys, and the output is the weighted sum of the rows of v: weights @ v, shape (dv,).",
        "When keep is all False there is nothing to attend to: return zeros for both (the softmax of only "
        "-inf is NaN). Return the pair (weights, out), weights first.",
    ],
    "loop-timing": [
        "Start from an empty output of shape (B, H, Nq, dv): torch.empty(*q.shape[:-1], v.shape[-1]). Then fill "
        "it one query at a time.",
        "Three nested loops, over b < B, h < H and i < Nq: query i of head h sees all the keys and values of that "
        "head, k[b, h] of shape (Nk, d) and v[b, h] of shape (Nk, dv).",
        "attention_row returns (weights, out): out[b, h, i] = attention_row(q[b, h, i], k[b, h], v[b, h])[1]. "
        "Compare with masked_attention(q, k, v) on one small input before timing anything.",
    ],
}
