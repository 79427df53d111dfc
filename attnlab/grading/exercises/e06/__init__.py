"""Exercise 06_triton_primer: a Triton puzzle set, its graded parts, what each may not call, and its hints.

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.
"""

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

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "masked-scale": [
        "Program pid owns the elements pid * BLOCK_SIZE + [0, BLOCK_SIZE): build that vector of offsets with "
        "tl.program_id(0) and tl.arange.",
        "The last program runs past n_elements: compare the offsets with n_elements to get a mask, and give the "
        "same mask to tl.load and to tl.store.",
        "offsets -> mask = offsets < n_elements -> x = tl.load(x_ptr + offsets, mask=...) -> "
        "tl.store(y_ptr + offsets, <alpha times x>, mask=...).",
    ],
    "tile-transpose": [
        "Axis 0 of the grid walks blocks of x's rows, axis 1 blocks of x's columns: two vectors of offsets, "
        "one per axis.",
        "Element (i, j) of x is at x_ptr + i * stride_xm + j * stride_xn; broadcast a column of row offsets "
        "against a row of column offsets ([:, None] and [None, :]) to address a whole tile, and mask both edges.",
        "Load the (BLOCK_M, BLOCK_N) tile of x once, then store it at y's addresses of the same elements: "
        "x[i, j] goes to y[j, i] = y_ptr + j * stride_ym + i * stride_yn (the same mask).",
    ],
    "outer-product": [
        "Each program owns a (BLOCK_M, BLOCK_N) tile of out; it needs BLOCK_M values of x and BLOCK_N of y.",
        "Load x and y as 1-D blocks (masked), and let broadcasting make the tile: x[:, None] * y[None, :]. Do not "
        "load x as a 2-D tile: that reads each value BLOCK_N times.",
        "rows, cols = offsets of the two axes -> x = tl.load(x_ptr + rows, mask=rows < M) (same for y) -> "
        "tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], <the product>, mask=<both edges>).",
    ],
    "row-sum": [
        "One program per row; the row is longer than BLOCK_N, so walk it in a loop: "
        "for start in range(0, n_cols, BLOCK_N).",
        "Keep a running total in registers across the loop (a (BLOCK_N,) vector of zeros or a scalar), and mask "
        "the last, partial block with other=0.0 so masked lanes add nothing.",
        "acc = tl.zeros((BLOCK_N,), tl.float32); in the loop acc += tl.load(x_ptr + row * stride_xm + cols, "
        "mask=..., other=0.0); after it store tl.sum(acc, axis=0) to out_ptr + row.",
    ],
    "softmax-kernel": [
        "One program per row: the row starts at input_ptr + row * input_row_stride (the stride is not n_cols).",
        "Load the row once with mask=cols < n_cols and other=-float('inf') (exp(-inf) = 0 adds nothing), then "
        "do everything else in registers: the max, the exponentials, their sum, the division.",
        "x = tl.load(...) -> x - tl.max(x, axis=0) -> tl.exp -> divide by tl.sum(..., axis=0) -> one masked "
        "tl.store at output_ptr + row * output_row_stride + cols.",
    ],
    "online-softmax-kernel": [
        "The row does not fit in one block: pass 1 walks it block by block keeping a running max m and a "
        "running sum l of exp(x - m); pass 2 walks it again and stores exp(x - m) / l.",
        "When a block raises the max from m to m_new, the sum so far was computed against the old max: multiply "
        "it by exp(m - m_new) before adding the block's exp(x - m_new). Start from m = -inf, l = 0.",
        "Pass 1: x = tl.load(..., other=-inf); m_new = tl.maximum(m, tl.max(x, axis=0)); "
        "l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0); m = m_new. Pass 2: load again, store.",
    ],
    "tiled-matmul": [
        "Program (pid_m, pid_n) owns the (BLOCK_M, BLOCK_N) tile of C; it walks K in steps of BLOCK_K, "
        "accumulating in a float32 tile of zeros.",
        "At each step load a (BLOCK_M, BLOCK_K) tile of A and a (BLOCK_K, BLOCK_N) tile of B through their "
        "strides, masked at M, N and K with other=0.0 (a zero adds nothing to a dot product).",
        "acc += tl.dot(a, b, input_precision=\"ieee\") in the loop; after it one masked tl.store of acc at "
        "c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn.",
    ],
    "causal-tile": [
        "Program (pid_m, pid_n) owns a tile of query rows i and key columns j; the kept entries are j <= i.",
        "Build the keep mask from the two offset vectors (cols[None, :] <= rows[:, None], and inside the tensor). "
        "Use it as the load mask too: an entry that will be -inf need not be read.",
        "Two masks, two jobs: the load's mask decides what is read (nothing of a tile wholly above the diagonal), "
        "the store's mask decides what is written (every entry inside the tensor, the -inf ones included). "
        "tl.where turns the loaded tile into the output. Which program ids own a tile that keeps nothing depends "
        "on BLOCK_M and BLOCK_N: reason with positions, not ids.",
    ],
    "matmul-traffic-experiment": [
        "Write a small wrapper that launches your matmul_kernel with BLOCK_M = BLOCK_N = block on random A, B "
        "made from the seed, and run it under attnlab.memory.trace.",
        "trace(fn, *args) returns a MemoryTrace; its bytes_read counts every load of every program (a tile read "
        "twice counts twice): that is the quantity asked for.",
        "g = torch.Generator().manual_seed(seed); a, b = torch.randn(M, K, generator=g), ...; "
        "return trace(your_wrapper, a, b, block).bytes_read (check the result against a @ b while you are at it).",
    ],
}
