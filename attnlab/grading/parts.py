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


# Parts graded by a person, not by `attnlab grade` (an nbgrader manually graded cell, e.g. a short written
# explanation): reported as "manual" with no points, and left out of the score. None yet.
MANUAL = set()


def exercises():
    """{exercise: [part id, ...]}"""
    return {ex: [p[0] for p in parts] for ex, parts in TABLE.items()}


def points():
    """{part id: points}"""
    return {p[0]: p[2] for parts in TABLE.values() for p in parts}


# What a part's answer may not call: the grader checks the answer cells' syntax for these names
# (attnlab/grading/shortcuts.py) and, while it calls the learner's functions, makes them raise in
# the kernel (attnlab/grading/agent.py). "pkg.*" covers every function and module class of pkg and
# of its submodules; "Class.method" one method. Every part forbids the grader's own references.
REFERENCES = ["attnlab.grading.specs.*"]
LIBRARY = ["attnlab.attention.*", "attnlab.tiled.*", "attnlab.iomodel.*", "attnlab.traffic.*", "attnlab.approx.*",
           "attnlab.kernels.*", "attnlab.models.*"]
SOFTMAX = ["torch.softmax", "torch.Tensor.softmax", "torch.nn.functional.softmax", "torch.special.softmax",
           "torch.nn.Softmax.forward", "torch.log_softmax", "torch.Tensor.log_softmax",
           "torch.nn.functional.log_softmax"]
ATTENTION = ["torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.multi_head_attention_forward",
             "torch.nn.MultiheadAttention.forward", "torch.nn.attention.flex_attention.flex_attention"]
BLOCK_MASKS = ["torch.nn.attention.flex_attention.create_block_mask", "torch.nn.attention.flex_attention.create_mask"]

FORBIDDEN = {
    "context-vector": SOFTMAX,
    "attention-masks": ATTENTION,
    "stable-softmax": SOFTMAX,
    "scaled-attention": SOFTMAX + ATTENTION,
    "mha-forward": ATTENTION,
    "softmax-kernel": SOFTMAX + ATTENTION,
    "online-softmax-update": SOFTMAX,
    "tiled-forward": SOFTMAX + ATTENTION,
    "flash-kernel-loop": SOFTMAX + ATTENTION,
    "block-mask-builder": BLOCK_MASKS,
    "block-mask-to-elements": BLOCK_MASKS,
    "block-sparse-loop": SOFTMAX + ATTENTION + BLOCK_MASKS,
}


def forbidden(part_id):
    """The patterns of what ``part_id``'s answer may not call (see FORBIDDEN)."""
    return REFERENCES + LIBRARY + FORBIDDEN.get(part_id, [])


def all_forbidden():
    """Every pattern of every part (what the grader wires up in the kernel before the notebook runs)."""
    out = []
    for rows in TABLE.values():
        for row in rows:
            out.extend(p for p in forbidden(row[0]) if p not in out)
    return out
