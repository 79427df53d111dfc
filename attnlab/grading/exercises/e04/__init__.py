"""Exercise 04_multi_head: its parts, what each may not call, and its hints.

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "04_multi_head"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("split-heads", "splitting into heads", 1, ("split_heads",)),
    Part("merge-heads", "merging the heads", 1, ("merge_heads",)),
    Part("mha-forward", "a MultiHeadAttention module with masks", 3, ("MultiHeadAttention", "mha_forward")),
    Part("mha-cost", "parameters and FLOPs of a layer", 2, ("mha_parameters", "mha_flops")),
    Part("head-specialisation", "the head-specialisation experiment", 2, ("head_specialisation",), "experiment"),
    Part("mha-explain", "what more heads cost", 2, (), "manual"),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "mha-forward": ATTENTION,
    "mha-cost": ["torch.utils.flop_counter.FlopCounterMode"],   # it would count the FLOPs for you
    "head-specialisation": ATTENTION,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "split-heads": [
        "Start from the shapes: x is (B, N, d_model) and d_model = h * d_head. Which axis has to be cut in two, "
        "and which two axes then trade places?",
        "Head i owns the contiguous features [i*d_head, (i+1)*d_head) of each position: cutting the last axis "
        "into (h, d_head), in that order, keeps those features together. (d_head, h) would interleave them.",
        "Two steps: a view/reshape (B, N, d_model) -> (B, N, h, d_head), then swap axes 1 and 2 to get "
        "(B, h, N, d_head). A reshape straight to (B, h, N, d_head) has the right shape and the wrong numbers.",
    ],
    "merge-heads": [
        "merge_heads undoes split_heads: run the two steps of split_heads backwards, in reverse order.",
        "First bring the sequence axis back in front of the head axis: (B, h, N, d_head) -> (B, N, h, d_head). "
        "Only then are each position's h * d_head features next to each other.",
        "transpose(1, 2), then reshape to (B, N, h * d_head). A transposed tensor is not contiguous, so use "
        "reshape (or .contiguous().view). Do not sum or average the heads: they are concatenated.",
    ],
    "mha-forward": [
        "Write it as the formula reads: project (q_proj, k_proj, v_proj), split into heads, scaled dot-product "
        "attention in every head at once, merge, project (out_proj). key defaults to query and value to key.",
        "The scale is 1/sqrt(d_head), not 1/sqrt(d_model): each head works in d_head dimensions. Combine the "
        "user's mask (True = attend, broadcast to (B, h, Nq, Nk)) with the causal mask (key j <= query i) by AND.",
        "Set the scores where the combined mask is False to -inf, softmax over the keys, then replace the NaN of "
        "a row with no key left by 0 (torch.nan_to_num, or torch.where on the row's mask) before multiplying by V.",
    ],
    "mha-cost": [
        "Parameters: what are the shapes of q_proj, k_proj, v_proj and out_proj's weights and biases? Does "
        "num_heads appear in any of them?",
        "FLOPs: a (m, k) @ (k, n) matmul is 2*m*n*k FLOPs. There are four projections (the query's rows n_q, "
        "the key's and the value's n_k, the output's n_q) and two attention matmuls per head (QK^T and PV).",
        "Per head, QK^T and PV cost 2*n_q*n_k*d_head each; over h heads that is 4*n_q*n_k*d_model. Add "
        "2*d_model^2 per projected row (2 n_q + 2 n_k rows) and multiply everything by the batch.",
    ],
    "head-specialisation": [
        "First build and train the model with the given code (TwoRelations and train_previous_two), from the seed. "
        "Then you need each head's attention weights on test sequences: (n, h, N, N), causal, as the model used "
        "them.",
        "Recompute the weights from your trained module: x = model.embed(tokens) normalised by model.ln_attn, "
        "q and k from model.attn.q_proj / k_proj, split into heads, scores / sqrt(d_head), causal mask, softmax.",
        "Weight on i-1 for head h: w[:, h].diagonal(-1, dim1=-2, dim2=-1) for the queries i >= 2 (drop the first "
        "entry); on i-2: diagonal(-2). 'other' is 1 minus both. Build (h, 3) and sort the rows by column 0, largest "
        "first.",
    ],
}
