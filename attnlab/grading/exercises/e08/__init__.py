"""Exercise 08_block_sparse: its parts and what each may not call (read without torch by attnlab/grading/parts.py)."""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part

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
FORBIDDEN = {"flex-block-mask": BLOCK_MASKS, **dict.fromkeys(("block-sparse-loop", "partial-blocks",
                                                              "bytes-vs-density"), SOFTMAX + ATTENTION + BLOCK_MASKS)}
