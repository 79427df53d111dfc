"""Exercise 06_triton_primer: a Triton puzzle set, its graded parts, what each may not call."""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "06_triton_primer"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("masked-scale", "a masked 1-D load and store", 1, ("scale_kernel",)),
    Part("tile-transpose", "a 2-D tile load and store with strides", 1, ("transpose_kernel",)),
    Part("outer-product", "a broadcast outer product", 1, ("outer_kernel",)),
    Part("row-sum", "a row reduction over column blocks", 1, ("row_sum_kernel",)),
    Part("softmax-kernel", "the fused softmax, one row per program", 2, ("softmax_kernel",)),
    Part("online-softmax-kernel", "a long-row softmax with the online max and sum", 2, ("online_softmax_kernel",)),
    Part("tiled-matmul", "a tiled matmul with tl.dot", 2, ("matmul_kernel",)),
    Part("causal-tile", "a causal mask applied to a tile of scores", 2, ("causal_mask_kernel",)),
    Part("matmul-traffic-experiment", "measuring the bytes a tiled matmul reads against its tile size", 1,
         ("matmul_traffic",), "experiment"),
    Part("triton-traffic-explain", "explain: why tiles, and why two passes", 1, (), "manual"),
]

# part id -> patterns of what its answer may not call (besides the library and the references).
# Not torch.matmul for the matmul parts: the interpreter's tl.dot runs on it.
FORBIDDEN = {
    "softmax-kernel": SOFTMAX + ATTENTION,
    "online-softmax-kernel": SOFTMAX + ATTENTION,
    "causal-tile": ATTENTION + BLOCK_MASKS,
}
