"""The references of exercise 08_block_sparse: what the grader compares the learner's answers with.

Never shown in the exercise; hidden (stand-ins that raise) in a kernel that ``attnlab grade`` runs.
"""


import torch

def sliding_window_block_mask(n_blocks, window, causal=False):
    """Bool (n_blocks, n_blocks): query block i sees key block j when |i - j| <= window,
    and, if causal, only j <= i."""
    i = torch.arange(n_blocks)[:, None]
    j = torch.arange(n_blocks)[None, :]
    keep = (i - j).abs() <= window
    if causal:
        keep = keep & (j <= i)
    return keep


def block_to_element_mask(block_mask, block_size, n_q, n_k):
    """Expand a bool block mask (..., nqb, nkb) to an element mask (..., n_q, n_k).

    block_size = (BQ, BK); element (i, j) is kept when block (i // BQ, j // BK) is.
    """
    bq, bk = block_size
    full = block_mask.repeat_interleave(bq, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :n_q, :n_k]


__import__("attnlab.grading.hiding", fromlist=["hide"]).hide(globals())
