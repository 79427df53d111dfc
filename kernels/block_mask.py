"""Block masks: which (query block, key block) tiles of the attention matrix are computed at all.

What you learn here:

* block-sparse attention decides sparsity per *tile*, not per element: a block of ``block_m``
  queries either visits a block of ``block_n`` keys (all its elements, plus the causal mask if asked)
  or skips it, and a skipped block costs neither time nor memory traffic;
* the object the kernel actually reads is not the boolean mask but, for each query block,
  the number of key blocks it visits and their indices, ``kv_num_blocks`` and
  ``kv_indices``, as in PyTorch's FlexAttention. The backward pass needs the transpose:
  for each key block, the query blocks that see it (``q_num_blocks``, ``q_indices``);
* the classic sparse patterns are a few lines each: local (sliding window), strided,
  global tokens, causal, random, and their union and intersection.

Example::

    m = local_mask(512, 512, window=64, block_size=(64, 64)) | global_mask(512, 512, block_size=(64, 64))
    print(m)            # the pattern, with its density
    o = block_sparse_attention(q, k, v, m)
"""

from __future__ import annotations

import math

import torch

from attnlab import validate

__all__ = [
    "BlockMask", "local_mask", "strided_mask", "global_mask", "causal_block_mask", "random_mask",
    "full_mask", "union", "intersection", "SUPPORTED_BLOCK_SIZES",
]

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)


def _check_block_size(block_size, name="block_size"):
    return validate.block_pair(block_size, name, allowed=SUPPORTED_BLOCK_SIZES, single_int=False)


def _check_len(n, name):
    return validate.integer(n, name)


class BlockMask:
    """A boolean mask over (query block, key block) tiles, with the index lists the kernels read.

    mask: bool tensor (B or 1, H or 1, ceil(Nq / block_m), ceil(Nk / block_n)); True = compute
    the tile. block_size: (block_m, block_n), query rows and key columns per tile (the kernels'
    BLOCK_M and BLOCK_N), each 16, 32, 64 or 128.

    Attributes: ``mask``, ``block_size``, ``density`` (fraction of tiles kept),
    ``kv_num_blocks`` (B|1, H|1, nqb) and ``kv_indices`` (B|1, H|1, nqb, nkb) int32
    (the kept key blocks of each query block first, in increasing order, then padding), and the
    transposes ``q_num_blocks``/``q_indices``. ``to_element_mask(n_q, n_k)`` gives the element
    mask the block mask implies; ``to_figure()`` draws it; ``|`` and ``&`` combine masks.

    Example: ``BlockMask(torch.ones(1, 1, 4, 4, dtype=torch.bool), (64, 64)).density  # 1.0``
    """

    def __init__(self, mask: torch.Tensor, block_size=(64, 64)):
        validate.tensor(mask, "mask", dtypes=(torch.bool,))
        if mask.dim() == 2:
            mask = mask[None, None]
        if mask.dim() != 4 or mask.shape[-1] == 0 or mask.shape[-2] == 0:
            raise ValueError(f"mask: expected shape (B or 1, H or 1, query blocks, key blocks), got {tuple(mask.shape)}")
        self.mask = mask
        self.block_size = _check_block_size(block_size)

    # -- the index lists the kernels walk ---------------------------------------------
    @staticmethod
    def _lists(mask):
        # stable sort puts kept blocks first, in increasing index order
        num = mask.sum(-1, dtype=torch.int32)
        order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return num.contiguous(), order.contiguous()

    @property
    def kv_num_blocks(self):
        return self._lists(self.mask)[0]

    @property
    def kv_indices(self):
        return self._lists(self.mask)[1]

    @property
    def q_num_blocks(self):
        return self._lists(self.mask.transpose(-1, -2))[0]

    @property
    def q_indices(self):
        return self._lists(self.mask.transpose(-1, -2))[1]

    # -- inspection -------------------------------------------------------------------
    @property
    def shape(self):
        return tuple(self.mask.shape)

    @property
    def num_blocks(self):
        """(query blocks, key blocks)."""
        return tuple(self.mask.shape[-2:])

    @property
    def density(self) -> float:
        """Fraction of tiles computed (1.0 = dense)."""
        return float(self.mask.float().mean())

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density

    def seq_lengths_ok(self, n_q: int, n_k: int) -> bool:
        bq, bk = self.block_size
        return self.num_blocks == (math.ceil(n_q / bq), math.ceil(n_k / bk))

    def to_element_mask(self, n_q: int, n_k: int) -> torch.Tensor:
        """Bool (B|1, H|1, n_q, n_k): True where a query may attend to a key (its tile is kept)."""
        _check_len(n_q, "n_q")
        _check_len(n_k, "n_k")
        if not self.seq_lengths_ok(n_q, n_k):
            raise ValueError(
                f"n_q, n_k: expected lengths that fit the mask's {self.num_blocks} blocks of {self.block_size}, "
                f"got n_q={n_q}, n_k={n_k} (they need {math.ceil(n_q / self.block_size[0])} x "
                f"{math.ceil(n_k / self.block_size[1])})"
            )
        bq, bk = self.block_size
        m = self.mask.repeat_interleave(bq, dim=-2).repeat_interleave(bk, dim=-1)
        return m[..., :n_q, :n_k]

    def __or__(self, other):
        return union(self, other)

    def __and__(self, other):
        return intersection(self, other)

    def __invert__(self):
        return BlockMask(~self.mask, self.block_size)

    def __eq__(self, other):
        return isinstance(other, BlockMask) and self.block_size == other.block_size and torch.equal(self.mask, other.mask)

    __hash__ = None

    def __repr__(self):
        b, h, nq, nk = self.shape
        lines = [f"BlockMask(shape={self.shape}, block_size={self.block_size}, density={self.density:.1%})"]
        if nq <= 32 and nk <= 32:
            for bi in range(min(b, 2)):
                for hi in range(min(h, 2)):
                    if b > 1 or h > 1:
                        lines.append(f"  batch {bi}, head {hi}:")
                    for row in self.mask[bi, hi].tolist():
                        lines.append("  " + "".join("██" if x else "░░" for x in row))
        else:
            lines.append(f"  ({nq} x {nk} blocks: too many to print; use .to_figure())")
        return "\n".join(lines)

    def to_figure(self, batch: int = 0, head: int = 0, ax=None, title=None):
        """A matplotlib Figure of the mask of one (batch, head): kept tiles dark."""
        import matplotlib.pyplot as plt

        if ax is None:
            fig, ax = plt.subplots(figsize=(4, 4))
        else:
            fig = ax.figure
        m = self.mask[min(batch, self.shape[0] - 1), min(head, self.shape[1] - 1)].float().cpu().numpy()
        ax.imshow(m, cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xlabel(f"key block (block_n={self.block_size[1]})")
        ax.set_ylabel(f"query block (block_m={self.block_size[0]})")
        ax.set_title(title or f"density {self.density:.0%}")
        return fig


# ---------------------------------------------------------------------------------------
# Patterns. Each takes the sequence lengths and the block size and returns a BlockMask of
# shape (1, 1, ceil(n_q / block_m), ceil(n_k / block_n)).
# ---------------------------------------------------------------------------------------
def _block_ranges(n_q, n_k, block_size):
    _check_len(n_q, "n_q")
    _check_len(n_k, "n_k")
    bq, bk = _check_block_size(block_size)
    nqb, nkb = math.ceil(n_q / bq), math.ceil(n_k / bk)
    i = torch.arange(nqb)[:, None]
    j = torch.arange(nkb)[None, :]
    q_lo, q_hi = i * bq, torch.clamp((i + 1) * bq, max=n_q) - 1   # first and last query of each block
    k_lo, k_hi = j * bk, torch.clamp((j + 1) * bk, max=n_k) - 1
    return (bq, bk), i, j, q_lo, q_hi, k_lo, k_hi


def full_mask(n_q, n_k, block_size=(64, 64)) -> BlockMask:
    """Every tile kept (dense attention, density 1). Example: ``full_mask(256, 256).density  # 1.0``"""
    bs, i, j, *_ = _block_ranges(n_q, n_k, block_size)
    return BlockMask((i >= 0) & (j >= 0), bs)


def causal_block_mask(n_q, n_k, block_size=(64, 64)) -> BlockMask:
    """Tiles with at least one pair key <= query (top-left aligned, like SDPA is_causal).

    Example: ``causal_block_mask(256, 256, (64, 64)).density  # 0.625``
    """
    bs, i, j, q_lo, q_hi, k_lo, k_hi = _block_ranges(n_q, n_k, block_size)
    return BlockMask(k_lo <= q_hi, bs)


def local_mask(n_q, n_k, window, block_size=(64, 64)) -> BlockMask:
    """Sliding window: tiles holding a pair with ``|query - key| <= window`` (in tokens).

    Example: ``local_mask(512, 512, window=64, block_size=(64, 64))``
    """
    validate.integer(window, "window", minimum=0)
    bs, i, j, q_lo, q_hi, k_lo, k_hi = _block_ranges(n_q, n_k, block_size)
    return BlockMask((k_lo <= q_hi + window) & (k_hi >= q_lo - window), bs)


def strided_mask(n_q, n_k, stride, block_size=(64, 64)) -> BlockMask:
    """Strided (Child et al. 2019): query block i sees key blocks j with (i - j) % stride == 0.

    Example: ``strided_mask(512, 512, stride=4)``
    """
    validate.integer(stride, "stride")
    bs, i, j, *_ = _block_ranges(n_q, n_k, block_size)
    return BlockMask((i - j) % stride == 0, bs)


def global_mask(n_q, n_k, num_blocks=1, block_size=(64, 64)) -> BlockMask:
    """Global tokens: the first ``num_blocks`` key blocks are seen by every query block, and
    the first ``num_blocks`` query blocks see every key block (Longformer/BigBird style).

    Example: ``local_mask(512, 512, 64) | global_mask(512, 512, num_blocks=1)``
    """
    validate.integer(num_blocks, "num_blocks", minimum=0)
    bs, i, j, *_ = _block_ranges(n_q, n_k, block_size)
    return BlockMask((i < num_blocks) | (j < num_blocks), bs)


def random_mask(n_q, n_k, density, block_size=(64, 64), seed=0, batch=1, heads=1) -> BlockMask:
    """Each tile kept independently with probability ``density`` (seeded, reproducible).

    A query block may end up with no key block: its rows then output zeros.
    ``batch``/``heads`` > 1 draw a different pattern per (batch, head).

    Example: ``random_mask(1024, 1024, density=0.25, seed=0)``
    """
    validate.number_in(density, "density", 0, 1)
    bs, i, j, *_ = _block_ranges(n_q, n_k, block_size)
    g = torch.Generator().manual_seed(int(seed))
    return BlockMask(torch.rand(batch, heads, i.shape[0], j.shape[1], generator=g) < density, bs)


def _combine(masks, op, name):
    if not masks:
        raise ValueError(f"masks: expected at least one BlockMask for {name}, got none")
    for m in masks:
        if not isinstance(m, BlockMask):
            raise TypeError(f"masks: expected BlockMask objects for {name}, got {type(m).__name__}")
        if m.block_size != masks[0].block_size:
            raise ValueError(f"masks: expected one block size for {name}, got {masks[0].block_size} and {m.block_size}")
        if m.num_blocks != masks[0].num_blocks:
            raise ValueError(f"masks: expected one number of blocks for {name}, got {masks[0].num_blocks} and {m.num_blocks}")
    out = masks[0].mask
    for m in masks[1:]:
        out = op(out, m.mask)
    return BlockMask(out.contiguous(), masks[0].block_size)


def union(*masks: BlockMask) -> BlockMask:
    """Tiles kept by any of the masks (also ``a | b``). Example: ``union(local_mask(256, 256, 32), global_mask(256, 256))``"""
    return _combine(masks, torch.logical_or, "union")


def intersection(*masks: BlockMask) -> BlockMask:
    """Tiles kept by all of the masks (also ``a & b``). Example: ``intersection(local_mask(256, 256, 64), causal_block_mask(256, 256))``"""
    return _combine(masks, torch.logical_and, "intersection")
