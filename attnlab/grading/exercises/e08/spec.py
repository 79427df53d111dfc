"""The references of exercise 08_block_sparse: what the grader compares the learner's answers with.

Never shown in the exercise; an empty file in the sandbox where ``attnlab grade`` runs a notebook.
The masks are ``attnlab.mask_mods``; the checks compare with PyTorch's own FlexAttention
(``torch.nn.attention.flex_attention``: ``create_block_mask`` and ``flex_attention``, run eagerly
on the CPU) and with ``attnlab.attention.block_sparse_reference``. What is here is specific to
the exercise: its ``create_block_mask`` contract, and the adapter the grader calls it through.
"""

import torch

from attnlab import mask_mods
from attnlab.mask_mods import MASK_MODS


def block_sizes(block_size):
    """(BQ, BK) from an int or a pair."""
    return (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)


def block_lists(kind):
    """(count, indices) int32 of a bool (..., n_qb, n_kb): per query block, how many key blocks are
    True and their indices in increasing order, first in the row (the rest of the row is padding).
    The library's own (``attnlab.kernels.block_mask``, as FlexAttention's ``_dense_to_ordered``)."""
    from attnlab.kernels.block_mask import _lists   # imported late: attnlab.kernels imports triton

    return _lists(kind)


def create_block_mask(mask_mod, B, H, Nq, Nk, block_size):
    """Sort the (BQ, BK) tiles of the attention matrix into full, partial and empty blocks.

    mask_mod(b, h, q_idx, kv_idx) -> bool; block_size: int or (BQ, BK). Positions past Nq or Nk
    count as masked out, so a ragged last block is never full. Returns, as FlexAttention's
    BlockMask holds them, (kv_num_blocks (B, H, n_qb), kv_indices (B, H, n_qb, n_kb),
    full_kv_num_blocks, full_kv_indices), int32: the partial blocks, then the full ones.

    ``attnlab.kernels.create_block_mask`` gives the same lists for the kernels' tile sizes (16 to
    128); the exercise also asks for tiles of 8, so the sort is written here over the library's
    element mask (``mask_mods.create_mask``) and lists (:func:`block_lists`).
    """
    bq, bk = block_sizes(block_size)
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    allowed = torch.zeros(B, H, nqb * bq, nkb * bk, dtype=torch.bool)          # padded with False
    allowed[..., :Nq, :Nk] = mask_mods.create_mask(mask_mod, B, H, Nq, Nk)
    count = allowed.view(B, H, nqb, bq, nkb, bk).sum((3, 5))                   # (B, H, n_qb, n_kb)
    full = count == bq * bk
    partial = (count > 0) & ~full
    return (*block_lists(partial), *block_lists(full))


def block_mask_for(kind, arg, B, H, Nq, Nk, block_size):
    """What the grader calls: a mask_mod is a function and cannot be sent to the learner's kernel, so the
    grader sends its name in ``attnlab.mask_mods.MASK_MODS`` and its argument."""
    return create_block_mask(MASK_MODS[kind](arg), B, H, Nq, Nk, block_size)


def block_to_element_mask(block_mask, block_size, n_q, n_k):
    """Expand a bool block mask (..., nqb, nkb) to an element mask (..., n_q, n_k).

    block_size = (BQ, BK); element (i, j) is kept when block (i // BQ, j // BK) is: the library's
    :func:`attnlab.mask_mods.tiles`, evaluated.
    """
    lead = block_mask.shape[:-2]
    table = block_mask.reshape(-1, 1, *block_mask.shape[-2:])                   # (L, 1, nqb, nkb)
    out = mask_mods.create_mask(mask_mods.tiles(table, block_sizes(block_size)), table.shape[0], 1, n_q, n_k,
                                device=block_mask.device)
    return out.reshape(*lead, n_q, n_k)
