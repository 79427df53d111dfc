"""Exercise 03_scaled_dot_product: its parts, what each may not call, and its hints.

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.
"""

from attnlab.grading.exercises import ATTENTION, AUTOGRAD, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "03_scaled_dot_product"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("stable-softmax", "a numerically stable softmax", 2, ('softmax',)),
    Part("softmax-backward", "the softmax's backward pass by hand", 3, ('softmax_backward',)),
    Part("scaled-attention", "scaled dot-product attention", 2, ('scaled_dot_product_attention',)),
    Part("variance-experiment", "the experiment: the variance of q . k", 1, ('score_variance',), "experiment"),
    Part("saturation-explained", "why unscaled scores stop learning", 1, (), "manual"),
]

# what would compute a gradient for the learner: autograd in any of its forms, and PyTorch's own softmax backward
GRADIENTS = AUTOGRAD + ["torch.autograd.functional.*", "torch.func.vjp", "torch.func.grad", "torch.func.jacrev",
                        "torch.func.jacfwd", "torch.func.grad_and_value", "torch._softmax_backward_data"]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "stable-softmax": SOFTMAX,
    "softmax-backward": SOFTMAX + GRADIENTS,
    "scaled-attention": SOFTMAX + ATTENTION,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "stable-softmax": [
        "softmax(x) = softmax(x - c) for any c that is constant along `dim`: the c cancels between the "
        "numerator and the denominator. Pick c so that exp never sees a large positive number.",
        "Take c as each row's own maximum along `dim`: x.amax(dim=dim, keepdim=True). keepdim=True keeps the "
        "reduced axis (size 1) so the subtraction broadcasts along `dim`, whatever dim is.",
        "e = exp(x - row max); then divide e by its sum along the same `dim`, again with keepdim=True. Never take "
        "the max or the sum over the whole tensor, or over another axis than `dim`.",
    ],
    "softmax-backward": [
        "Start from one row: p_i = exp(s_i) / sum_j exp(s_j). Its Jacobian is dp_i/ds_j = p_i (delta_ij - p_j), "
        "so ds_j = sum_i dp_i p_i (delta_ij - p_j).",
        "The sum splits in two: the delta term gives p_j dp_j; the other gives p_j times one number per row, "
        "sum_i dp_i p_i. Compute that number along `dim` with keepdim=True.",
        "ds = p * (dp - (row sum along dim of dp * p)): elementwise products and one reduction, no matrix. "
        "Check a row by hand: if dp is the same number in every entry, ds is zero.",
    ],
    "scaled-attention": [
        "The scores are q @ k.transpose(-2, -1): (B, H, Nq, d) @ (B, H, d, Nk) -> (B, H, Nq, Nk). Multiply them "
        "by the scale before the softmax.",
        "scale=None means 1 / sqrt(d) with d = q.shape[-1], the queries' and keys' dimension (not v's). An "
        "explicit scale replaces it. Use your own softmax from part 1.",
        "The softmax runs over the keys (dim=-1): each query's weights sum to 1. Then multiply the weights "
        "(B, H, Nq, Nk) by v (B, H, Nk, dv).",
    ],
    "variance-experiment": [
        "Make one generator: g = torch.Generator().manual_seed(seed), and draw everything from it with "
        "torch.randn(..., generator=g), in the order the docstring gives: for each d, q first, then k.",
        "One score per pair: row i of q with row i of k, summed over the d features: (q * k).sum(dim=-1) has "
        "shape (n_pairs,). Do not use q @ k.T (that pairs every q with every k) nor sum over the pairs.",
        "For each d: the variance of the raw scores and of the scores divided by sqrt(d), with tensor.var() "
        "(the unbiased default). Stack the pairs into a (len(dims), 2) tensor.",
    ],
}
