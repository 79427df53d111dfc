"""The editor's link to the kernels: presets from the kernels' mask helpers, BlockMask, costs from attnlab.iomodel."""

import numpy as np


def preset(name, n_q_blocks, n_k_blocks, block_size, param, density, seed):
    """A bool ``(n_q_blocks, n_k_blocks)`` block mask for a preset, built by ``attnlab.kernels``' helpers.

    ``param`` counts blocks: local keeps tiles within ``param - 1`` blocks of the diagonal
    (a window of ``(param - 1) * BK`` tokens), strided every ``param``-th block, global the first
    ``param`` query and key blocks; random keeps each tile with probability ``density`` (seeded);
    causal is top-left aligned; dense and empty keep all and none.
    """
    from attnlab import kernels

    bq, bk = block_size
    n_q, n_k = n_q_blocks * bq, n_k_blocks * bk
    if name == "local":
        m = kernels.local_mask(n_q, n_k, window=(param - 1) * min(bq, bk), block_size=block_size)
    elif name == "strided":
        m = kernels.strided_mask(n_q, n_k, stride=param, block_size=block_size)
    elif name == "global":
        m = kernels.global_mask(n_q, n_k, num_blocks=param, block_size=block_size)
    elif name == "causal":
        m = kernels.causal_block_mask(n_q, n_k, block_size=block_size)
    elif name == "random":
        m = kernels.random_mask(n_q, n_k, density=float(density), block_size=block_size, seed=int(seed))
    elif name == "dense":
        return np.ones((n_q_blocks, n_k_blocks), bool)
    elif name == "empty":
        return np.zeros((n_q_blocks, n_k_blocks), bool)
    else:
        raise ValueError(f"preset: unknown preset {name!r}")
    return m.mask[0, 0].numpy().astype(bool)


def to_block_mask(mask, block_size):
    """The kernels' ``BlockMask`` for a bool ``(n_q_blocks, n_k_blocks)`` numpy mask."""
    import torch

    from attnlab.kernels import BlockMask

    return BlockMask(torch.from_numpy(np.ascontiguousarray(mask, dtype=bool))[None, None], tuple(block_size))


def element_size(dtype):
    return 4 if dtype == "float32" else 2


def costs(mask, block_size, head_dim, dtype):
    """Forward FLOPs and HBM bytes from ``attnlab.iomodel`` for batch 1, one head.

    -> ``{"sparse": {"flops", "bytes"}, "dense": {...}, "standard": {...}, "source": str}``: block-sparse
    FlashAttention with this mask, dense FlashAttention with the same tiles, and unfused standard attention.
    """
    from attnlab.iomodel import block_sparse_forward_io, flash_forward_io, standard_forward_io

    bq, bk = block_size
    n_q, n_k = mask.shape[0] * bq, mask.shape[1] * bk
    e = element_size(dtype)
    sparse = block_sparse_forward_io(1, 1, n_q, n_k, head_dim, e, block_mask=to_block_mask(mask, block_size))
    dense = flash_forward_io(1, 1, n_q, n_k, head_dim, e, block_m=bq, block_n=bk)
    standard = standard_forward_io(1, 1, n_q, n_k, head_dim, e)
    out = {name: {"flops": io.flops, "bytes": io.total_bytes}
           for name, io in (("sparse", sparse), ("dense", dense), ("standard", standard))}
    out["source"] = "attnlab.iomodel: block_sparse_forward_io, flash_forward_io, standard_forward_io (B=1, H=1)"
    return out
