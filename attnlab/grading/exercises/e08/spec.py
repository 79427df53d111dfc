"""The references of exercise 08_block_sparse: what the grader compares the learner's answers with.

Never shown in the exercise; hidden (stand-ins that raise) in a kernel that ``attnlab grade`` runs.
The masks are ``attnlab.mask_mods``; the checks compare with PyTorch's own FlexAttention
(``torch.nn.attention.flex_attention``: ``create_block_mask`` and ``flex_attention``, run eagerly
on the CPU) and with ``attnlab.attention.block_sparse_reference``. What is here is specific to
the exercise: its ``create_block_mask`` contract, and the adapter the grader calls it through.
"""

import torch

from attnlab.grading.hiding import hide
from attnlab.mask_mods import MASK_MODS


def block_sizes(block_size):
    """(BQ, BK) from an int or a pair."""
    return (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)


def block_lists(kind):
    """(count, indices) int32 of a bool (..., n_qb, n_kb): per query block, how many key blocks are
    True and their indices in increasing order, first in the row (the rest of the row is padding)."""
    num = kind.sum(-1, dtype=torch.int32)
    idx = torch.sort((~kind).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num.contiguous(), idx.contiguous()


def create_block_mask(mask_mod, B, H, Nq, Nk, block_size):
    """Sort the (BQ, BK) tiles of the attention matrix into full, partial and empty blocks.

    mask_mod(b, h, q_idx, kv_idx) -> bool; block_size: int or (BQ, BK). Positions past Nq or Nk
    count as masked out, so a ragged last block is never full. Returns, as FlexAttention's
    BlockMask holds them, (kv_num_blocks (B, H, n_qb), kv_indices (B, H, n_qb, n_kb),
    full_kv_num_blocks, full_kv_indices), int32: the partial blocks, then the full ones.
    """
    bq, bk = block_sizes(block_size)
    nqb, nkb = -(-Nq // bq), -(-Nk // bk)
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    q_idx = torch.arange(Nq)[None, None, :, None]
    kv_idx = torch.arange(Nk)[None, None, None, :]
    allowed = torch.zeros(B, H, nqb * bq, nkb * bk, dtype=torch.bool)          # padded with False
    allowed[..., :Nq, :Nk] = torch.as_tensor(mask_mod(b, h, q_idx, kv_idx)).expand(B, H, Nq, Nk)
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

    block_size = (BQ, BK); element (i, j) is kept when block (i // BQ, j // BK) is.
    """
    bq, bk = block_size
    full = block_mask.repeat_interleave(bq, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :n_q, :n_k]


hide(globals())  # stand-ins that raise in a kernel `attnlab grade` runs
