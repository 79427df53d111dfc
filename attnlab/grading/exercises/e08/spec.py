"""The references of exercise 08_block_sparse: its ``create_block_mask`` contract, and the adapter the grader calls
it through. The checks compare with PyTorch's FlexAttention and ``attnlab.attention.block_sparse_reference``."""

import torch

from attnlab import mask_mods


def block_sizes(block_size):
    return (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)


def block_lists(kind):
    """Per query block of a bool (..., n_qb, n_kb): how many key blocks are True, and their indices, increasing."""
    from attnlab.kernels.block_mask import _lists   # imported late: attnlab.kernels imports triton

    return _lists(kind)


def create_block_mask(mask_mod, B, H, Nq, Nk, block_size):
    """FlexAttention's lists of the partial, then the full (BQ, BK) tiles, int32; positions past Nq or Nk count as
    masked out (``attnlab.kernels.create_block_mask`` takes the kernels' tile sizes only, 16 to 128, not 8)."""
    bq, bk = block_sizes(block_size)
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    allowed = torch.zeros(B, H, nqb * bq, nkb * bk, dtype=torch.bool)          # padded with False
    allowed[..., :Nq, :Nk] = mask_mods.create_mask(mask_mod, B, H, Nq, Nk)
    count = allowed.view(B, H, nqb, bq, nkb, bk).sum((3, 5))                   # (B, H, n_qb, n_kb)
    full = count == bq * bk
    return (*block_lists((count > 0) & ~full), *block_lists(full))


def block_mask_for(kind, arg, B, H, Nq, Nk, block_size):
    """What the grader calls: a mask_mod cannot be sent to the learner, its name in MASK_MODS and argument can."""
    return create_block_mask(mask_mods.MASK_MODS[kind](arg), B, H, Nq, Nk, block_size)
