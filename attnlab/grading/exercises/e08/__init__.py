"""Exercise 08_block_sparse: its parts, what each may not call, and its hints.

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "08_block_sparse"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("flex-block-mask", "create_block_mask: full, partial and empty blocks", 2,
         ("create_block_mask", "block_mask_for")),
    Part("block-sparse-loop", "the block-skipping loop over a list of key blocks", 3, ("block_sparse_fwd_kernel",)),
    Part("partial-blocks", "partial blocks with the element mask, checked against flex_attention", 3,
         ("flex_fwd_kernel",)),
    Part("bytes-vs-density", "experiment: bytes moved against density", 2,
         ("bytes_against_density", "flex_fwd_kernel"), "experiment"),
    Part("why-full-blocks", "explain: why full blocks need no mask", 1, (), "manual"),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "flex-block-mask": BLOCK_MASKS,
    "block-sparse-loop": SOFTMAX + ATTENTION + BLOCK_MASKS,
    "partial-blocks": SOFTMAX + ATTENTION + BLOCK_MASKS,
    "bytes-vs-density": SOFTMAX + ATTENTION + BLOCK_MASKS,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "flex-block-mask": [
        "Start from the element mask: call mask_mod once on index grids that broadcast, b (B,1,1,1), h (1,H,1,1), "
        "q_idx (1,1,Nq,1) and kv_idx (1,1,1,Nk), and expand the result to (B, H, Nq, Nk).",
        "Pad the element mask with False up to whole blocks (positions past the end are masked out), view it as "
        "(B, H, n_qb, BQ, n_kb, BK) and count the allowed elements of each tile: BQ * BK of them is a full block, "
        "0 an empty one, anything in between a partial one.",
        "From a bool (B, H, n_qb, n_kb) tensor of one kind: the count is .sum(-1) and the indices in increasing "
        "order come first in a stable sort that puts True before False (sort ~kind as int8, stable=True); "
        "return (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) as int32.",
    ],
    "block-sparse-loop": [
        "Lesson 07's loop body stays as it is; only where j comes from changes. Row (pid_h, pid_m) of the lists "
        "starts at kv_num_blocks + pid_h * n_qb + pid_m and kv_indices + (pid_h * n_qb + pid_m) * n_kb.",
        "Load the count once, then `for i in range(0, num):` load the i-th index j and load K and V at rows "
        "j * BLOCK_N + tl.arange(0, BLOCK_N), masked at n_ctx. Nothing outside the list is loaded at all.",
        "Keep m_i, l_i and acc across the blocks (acc = acc * alpha[:, None] + tl.dot(p, v)), and divide by "
        "tl.where(l_i > 0, l_i, 1.0) at the end so that a query block with an empty list stores zeros.",
    ],
    "partial-blocks": [
        "Two lists to walk: the partial blocks (kv_num_blocks, kv_indices) and the full ones (full_kv_num_blocks, "
        "full_kv_indices). One loop over i in range(0, n_partial + n_full), taking j from the partial list while "
        "i < n_partial and from the full list after it, keeps part 2's body written once.",
        "For a partial block only, load the (BLOCK_M, BLOCK_N) tile of MASK at rows offs_m and columns offs_n "
        "(mask=both < n_ctx, other=0) and set the scores it forbids to -inf before the max and the exp.",
        "A row can be fully masked inside a partial block, so m_new may still be -inf: use "
        "m_safe = tl.where(m_new == float('-inf'), 0.0, m_new) in both exps, and keep m_i = m_new.",
    ],
    "bytes-vs-density": [
        "For each window: build the lists with your create_block_mask(sliding_window(w), 1, 1, n, n, block_size), "
        "the element mask by calling the mask_mod on index grids, and run your flex_fwd_kernel through the given "
        "flex_forward under attnlab.memory.trace.",
        "The density is the fraction of tiles your kernel visits, (partial + full) / (n_qb * n_kb); the bytes are "
        "trace.by_tensor['K']['read'] + trace.by_tensor['V']['read'].",
        "Return two 1-D float64 tensors of len(windows): (densities, kv_bytes), in the order of windows.",
    ],
}
