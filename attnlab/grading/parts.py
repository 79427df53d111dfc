"""The exercises and their graded parts: names, titles, points and the functions each part checks.

This table is the single place an instructor sets points; it imports nothing heavy, so the grader
and ``attnlab generate`` can read it without torch. The checks themselves are in ``checks.py``
and ``checks_triton.py`` (one ``@part(id)`` per entry here).
"""

# exercise -> [(part id, title, points, names of the learner's functions the check calls), ...] in notebook order
TABLE = {
    "01_soft_alignment": [
        ("additive-score", "the additive alignment score", 2, ("additive_scores",)),
        ("context-vector", "attention weights and the context vector", 2, ("context_vector",)),
        ("decode-step", "one decoding step", 2, ("decode_step",)),
    ],
    "02_queries_keys_values": [
        ("padding-mask", "the padding mask", 1, ("padding_mask",)),
        ("causal-mask", "the causal mask", 1, ("causal_mask",)),
        ("attention-masks", "attention with padding and causal masks", 3, ("masked_attention",)),
    ],
    "03_scaled_dot_product": [
        ("stable-softmax", "a numerically stable softmax", 2, ("softmax",)),
        ("scaled-attention", "scaled dot-product attention", 2, ("scaled_dot_product_attention",)),
        ("variance-experiment", "the variance experiment", 1, ("score_variance",)),
    ],
    "04_multi_head": [
        ("split-heads", "splitting into heads", 1, ("split_heads",)),
        ("merge-heads", "merging the heads", 1, ("merge_heads",)),
        ("mha-forward", "a multi-head attention forward", 3, ("multi_head_attention",)),
    ],
    "05_quadratic_cost": [
        ("attention-flops", "counting FLOPs", 1, ("attention_flops",)),
        ("attention-bytes", "counting HBM bytes", 1, ("attention_bytes",)),
        ("arithmetic-intensity", "arithmetic intensity and the roofline", 2, ("arithmetic_intensity", "is_memory_bound")),
    ],
    "06_triton_primer": [
        ("softmax-traffic", "counting the bytes a fused kernel saves", 1, ("softmax_traffic",)),
        ("masked-scale", "a masked load/store warm-up", 1, ("scale_kernel",)),
        ("softmax-kernel", "a fused softmax kernel", 3, ("softmax_kernel",)),
    ],
    "07_flash_attention": [
        ("online-softmax-update", "the online-softmax update", 2, ("online_softmax_update",)),
        ("tiled-forward", "a tiled forward in PyTorch", 2, ("tiled_attention_forward",)),
        ("flash-kernel-loop", "the loop of the Triton FlashAttention forward", 3, ("flash_fwd_kernel",)),
    ],
    "08_block_sparse": [
        ("block-mask-builder", "a sliding-window block mask", 1, ("sliding_window_block_mask",)),
        ("block-mask-to-elements", "from a block mask to an element mask", 1, ("block_to_element_mask",)),
        ("block-sparse-loop", "the block-skipping loop of the block-sparse kernel", 3, ("block_sparse_fwd_kernel",)),
    ],
}


def exercises():
    """{exercise: [part id, ...]}"""
    return {ex: [p[0] for p in parts] for ex, parts in TABLE.items()}


def points():
    """{part id: points}"""
    return {p[0]: p[2] for parts in TABLE.values() for p in parts}
