"""Block-sparse FlashAttention: the FlashAttention kernels, walking a list of blocks.

What you learn here:

* the only change from ``flash_attention.py`` is the loop over key blocks: instead of
  ``for start_n in range(0, Nk, BLOCK_N)``, each query block reads how many key blocks it
  visits (``kv_num_blocks``, one int) and then their indices one by one (``kv_indices``), and
  does pointer arithmetic with them. A tile left out of the list is never loaded and never
  computed: its cost in time *and* in memory traffic is zero (compare a dense kernel that
  masks the tile with ``-inf``: it still loads K and V);
* the backward pass needs the list the other way round: for each key block, the query
  blocks that see it (``q_num_blocks``, ``q_indices``), because the dK/dV kernel loops over
  query blocks;
* the traffic therefore scales with the density: per (batch, head), about
  ``Nq d + density * ceil(Nq / block_m) * 2 Nk d`` elements read for the forward
  (``attnlab.iomodel.block_sparse_forward_io`` gives the exact count for a given mask).

The naive version is dense attention under the element mask the block mask implies
(``attnlab.attention.block_sparse_reference``): it does all the work and throws most away.
Loading an integer index from a tensor and adding it to a pointer is an ordinary load, so
this kernel runs in Triton's CPU interpreter too (which cannot load *pointers* from tensors).
"""

import math

import torch

from attnlab import validate

from ._runtime import use_interpreter
from .block_mask import BlockMask, _check_block_size, _lists, causal_block_mask
from .flash_attention import _FlashAttention

__all__ = ["block_sparse_attention", "prepare_block_mask"]


def prepare_block_mask(block_mask, block_size, n_q, n_k, batch, heads, causal=False, device="cpu"):
    """Check ``block_mask`` against the shapes and return (BlockMask, (kv_num, kv_idx, q_num, q_idx)).

    The lists are expanded to (batch, heads, ...) int32 and, with ``causal``, tiles wholly
    above the diagonal are dropped from them (so causal masking skips whole tiles here too).
    """
    if isinstance(block_mask, BlockMask):
        if block_size is not None and tuple(block_size) != block_mask.block_size:
            raise ValueError(f"block_size: expected {block_mask.block_size} (the block_mask's block_size), "
                             f"got {tuple(block_size)}")
        bm = block_mask
    elif isinstance(block_mask, torch.Tensor):
        if block_mask.dtype != torch.bool:
            raise TypeError(f"block_mask: expected a BlockMask or a bool tensor, got a tensor of dtype {block_mask.dtype}")
        bm = BlockMask(block_mask, _check_block_size((64, 64) if block_size is None else block_size))
    else:
        raise TypeError(f"block_mask: expected a BlockMask or a bool tensor, got {type(block_mask).__name__}")
    bq, bk = bm.block_size
    want = (math.ceil(n_q / bq), math.ceil(n_k / bk))
    b, h = bm.shape[:2]
    if bm.num_blocks != want or b not in (1, batch) or h not in (1, heads):
        raise ValueError(
            f"block_mask: expected shape ({batch} or 1, {heads} or 1, {want[0]}, {want[1]}) for q with {n_q} positions, "
            f"k with {n_k}, batch {batch}, heads {heads} and block_size {bm.block_size}, got {bm.shape}"
        )
    # the lists are built on the host once per (mask version, causal, batch, heads, device) and
    # cached on the BlockMask, so repeated calls (a training loop, a benchmark) pay nothing
    key = (bm.mask._version, bm.mask.data_ptr(), bool(causal), batch, heads, str(device))
    cache = bm.__dict__.setdefault("_lists_cache", {})
    if key not in cache:
        mask = bm.mask.cpu()
        if causal:
            mask = mask & causal_block_mask(n_q, n_k, bm.block_size).mask
        mask = mask.expand(batch, heads, *want)
        kv_num, kv_idx = _lists(mask)
        q_num, q_idx = _lists(mask.transpose(-1, -2))
        cache.clear()
        cache[key] = tuple(t.to(device) for t in (kv_num, kv_idx, q_num, q_idx))
    return bm, cache[key]


def block_sparse_attention(q, k, v, block_mask, block_size=None, causal=False, scale=None):
    """Attention computed only on the tiles a block mask keeps; differentiable.

    q: (B, H, Nq, d), k and v: (B, H, Nk, d), d in 16, 32, 64, 128.
    block_mask: a :class:`BlockMask`, or a bool tensor (B or 1, H or 1, ceil(Nq/block_m),
    ceil(Nk/block_n)) with ``block_size=(block_m, block_n)`` (default (64, 64)), query rows and key
    columns per tile, each 16, 32, 64 or 128.
    ``causal`` additionally masks key > query inside the kept tiles (top-left aligned).
    Query rows that see no key output zeros. Returns o (B, H, Nq, d).

    Example: ``o = block_sparse_attention(q, k, v, local_mask(512, 512, 64, (64, 64)))``
    """
    scale = validate.kernel_qkv(q, k, v, scale, causal, interpreted=use_interpreter)   # 1/sqrt(d) for None
    if block_size is not None:
        _check_block_size(block_size)
    B, H, n_q, d = q.shape
    n_k = k.shape[-2]
    bm, lists = prepare_block_mask(block_mask, block_size, n_q, n_k, B, H, causal, q.device)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    blocks = bm.block_size
    o, _ = _FlashAttention.apply(q, k, v, causal, scale, blocks, blocks, lists)
    return o

