"""The references of exercise 08_block_sparse: the exercise's ``create_block_mask`` contract, and the adapter the
grader calls it through (never shown in the exercise; an empty file in the sandbox where ``attnlab grade`` runs a
notebook). The checks compare with PyTorch's own FlexAttention and ``attnlab.attention.block_sparse_reference``.
"""

import torch

from attnlab import mask_mods
from attnlab.mask_mods import MASK_MODS


def block_sizes(block_size):
    """(BQ, BK) from an int or a pair."""
    return (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)


def block_lists(kind):
    """(count, indices) int32 of a bool (..., n_qb, n_kb): per query block, how many key blocks are True and their
    indices in increasing order, first in the row (the rest is padding): the library's, as FlexAttention's."""
    from attnlab.kernels.block_mask import _lists   # imported late: attnlab.kernels imports triton

    return _lists(kind)


def create_block_mask(mask_mod, B, H, Nq, Nk, block_size):
    """Sort the (BQ, BK) tiles of the attention matrix into full, partial and empty blocks.

    Positions past Nq or Nk count as masked out, so a ragged last block is never full. Returns, as FlexAttention's
    BlockMask holds them, (kv_num_blocks (B, H, n_qb), kv_indices (B, H, n_qb, n_kb), full_kv_num_blocks,
    full_kv_indices), int32: the partial blocks, then the full ones (``attnlab.kernels.create_block_mask`` takes
    the kernels' tile sizes only, 16 to 128; the exercise also asks for 8).
    """
    bq, bk = block_sizes(block_size)
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    allowed = torch.zeros(B, H, nqb * bq, nkb * bk, dtype=torch.bool)          # padded with False
    allowed[..., :Nq, :Nk] = mask_mods.create_mask(mask_mod, B, H, Nq, Nk)
    count = allowed.view(B, H, nqb, bq, nkb, bk).sum((3, 5))                   # (B, H, n_qb, n_kb)
    full = count == bq * bk
    return (*block_lists((count > 0) & ~full), *block_lists(full))


def block_mask_for(kind, arg, B, H, Nq, Nk, block_size):
    """What the grader calls: a mask_mod is a function and cannot be sent to the learner's kernel, so the grader
    sends its name in ``attnlab.mask_mods.MASK_MODS`` and its argument."""
    return create_block_mask(MASK_MODS[kind](arg), B, H, Nq, Nk, block_size)
