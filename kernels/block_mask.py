"""Block masks: which (query block, key block) tiles of the attention matrix are computed, and how.

What you learn here (PyTorch FlexAttention's design, built from ``attnlab.mask_mods``):

* a mask is a function ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (:mod:`attnlab.mask_mods`, the
  one home of mask patterns); :func:`create_block_mask` evaluates it once and sorts the tiles of
  ``block_m`` queries by ``block_n`` keys into three kinds:

  - **empty**: no element kept; the kernel never loads it (zero time, zero traffic);
  - **full**: every element kept; the kernel computes it with no element mask at all;
  - **partial**: some elements kept; the kernel computes it and masks it element by element;

  a ragged last block (past Nq or Nk) counts its missing positions as masked, so it is never full;
* the object the kernels read is not the boolean mask but, for each query block, how many key
  blocks it visits and their indices: ``kv_num_blocks``/``kv_indices`` for the partial blocks,
  ``full_kv_num_blocks``/``full_kv_indices`` for the full ones, as in FlexAttention's
  ``BlockMask``. The backward's dK/dV kernel loops over query blocks, so it needs the transposes
  ``q_num_blocks``/``q_indices`` and ``full_q_num_blocks``/``full_q_indices``;
* for the partial blocks the kernel needs the element mask inside the tile: this module stores
  each partial tile once, as ``block_m x block_n`` int8 values (``mask_tiles``), with ``tile_ids``
  saying which tile belongs to which (batch, head, query block, key block). Why a tile read from
  memory and not the ``mask_mod`` compiled into the kernel: any Python ``mask_mod`` works as it
  is (a document mask closes over a tensor of ids, a random pattern over a table), the kernel
  and :func:`create_block_mask` can never disagree, and it runs the same in Triton's CPU
  interpreter and on a GPU. The price is ``block_m * block_n`` bytes per partial tile visited,
  which :mod:`attnlab.iomodel` counts (for a band mask the partial tiles are a thin diagonal,
  and K and V cost ``2 * block_n * d`` elements per tile beside it).

All lists are computed once, when the mask is made, and kept on the object; a mask knows the
lengths it was made for (``seq_lengths``) and the kernels refuse other lengths.

Example::

    from attnlab import mask_mods
    m = create_block_mask(mask_mods.sliding_window(100), None, None, 512, 512, block_size=(64, 64))
    print(m)            # full tiles ██, partial ▒▒, empty ░░, with the density
    o = block_sparse_attention(q, k, v, m)
"""

from __future__ import annotations

import math

import torch

from attnlab import mask_mods as mm
from attnlab import validate

__all__ = [
    "BlockMask", "create_block_mask", "local_mask", "strided_mask", "global_mask", "causal_block_mask",
    "random_mask", "full_mask", "union", "intersection", "SUPPORTED_BLOCK_SIZES",
]

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)


def _check_block_size(block_size, name="block_size"):
    return validate.block_pair(block_size, name, allowed=SUPPORTED_BLOCK_SIZES, single_int=True)


def _check_len(n, name):
    return validate.integer(n, name)


def _lists(kind):
    """(count, indices) int32 of a bool (..., rows, cols): per row, how many entries are True and
    their column indices in increasing order, first in the row (the rest of the row is padding),
    as FlexAttention's ``_dense_to_ordered``."""
    num = kind.sum(-1, dtype=torch.int32)
    order = torch.sort((~kind).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num.contiguous(), order.contiguous()


class BlockMask:
    """Tiles sorted into empty, partial and full, with the index lists the kernels read.

    Made by :func:`create_block_mask` (from a ``mask_mod``), or directly from a tile pattern:
    ``BlockMask(mask, block_size)`` with ``mask`` a bool tensor (B or 1, H or 1, query blocks,
    key blocks), True = every element of the tile is kept (the tiles are then full, the mask's
    ``mask_mod`` is :func:`attnlab.mask_mods.tiles` and ``seq_lengths`` is None: any lengths with
    that many blocks fit). block_size: (block_m, block_n), query rows and key columns per tile
    (the kernels' BLOCK_M and BLOCK_N), each 16, 32, 64 or 128.

    State, computed once when the mask is made (B and H are 1 where broadcast):

    - ``mask``: bool (B, H, nqb, nkb), tiles computed at all (partial or full);
      ``partial_blocks``, ``full_blocks``: the two kinds;
    - ``kv_num_blocks`` (B, H, nqb), ``kv_indices`` (B, H, nqb, nkb) int32: per query block the
      partial key blocks, in increasing order, then padding; ``full_kv_num_blocks``,
      ``full_kv_indices``: the full ones;
    - ``q_num_blocks`` (B, H, nkb), ``q_indices`` (B, H, nkb, nqb), ``full_q_num_blocks``,
      ``full_q_indices``: the transposes, per key block the query blocks (the backward's dK/dV);
    - ``mask_tiles`` int8 (T, block_m, block_n): the element mask of each partial tile (T >= 1:
      a placeholder tile when there is none); ``tile_ids`` int32 (B, H, nqb, nkb): which of them
      belongs to each tile, -1 for a tile that is not partial;
    - ``mask_mod``, ``block_size``, ``seq_lengths`` ((Nq, Nk) or None), ``density``.

    ``to_element_mask()`` gives the element mask; ``print(m)`` and ``to_figure()`` show the tiles;
    ``|``, ``&`` and ``~`` combine masks (through their mask_mods).

    Example: ``BlockMask(torch.ones(1, 1, 4, 4, dtype=torch.bool), (64, 64)).density  # 1.0``
    """

    def __init__(self, mask: torch.Tensor, block_size=(64, 64)):
        validate.tensor(mask, "mask", dtypes=(torch.bool,))
        if mask.dim() == 2:
            mask = mask[None, None]
        if mask.dim() != 4 or mask.shape[-1] == 0 or mask.shape[-2] == 0 or 0 in mask.shape[:2]:
            raise ValueError(f"mask: expected shape (B or 1, H or 1, query blocks, key blocks), got {tuple(mask.shape)}")
        bs = _check_block_size(block_size)
        mask = mask.contiguous()
        self._build(torch.zeros_like(mask), mask, bs, mm.tiles(mask, bs), None, None)

    @classmethod
    def _from_kinds(cls, partial, full, block_size, mask_mod, seq_lengths, tiles):
        self = cls.__new__(cls)
        self._build(partial, full, block_size, mask_mod, seq_lengths, tiles)
        return self

    def _build(self, partial, full, block_size, mask_mod, seq_lengths, tiles):
        """Set every list once. partial, full: bool (B, H, nqb, nkb); tiles: int8 (T, bm, bn), the
        element masks of the partial tiles in the order of ``partial.nonzero()`` (None: no partial)."""
        bm, bn = block_size
        self.block_size = (bm, bn)
        self.seq_lengths = seq_lengths
        self.mask_mod = mask_mod
        self.partial_blocks = partial.contiguous()
        self.full_blocks = full.contiguous()
        self.mask = (partial | full).contiguous()
        self.kv_num_blocks, self.kv_indices = _lists(partial)
        self.full_kv_num_blocks, self.full_kv_indices = _lists(full)
        self.q_num_blocks, self.q_indices = _lists(partial.transpose(-1, -2))
        self.full_q_num_blocks, self.full_q_indices = _lists(full.transpose(-1, -2))
        n_tiles = int(partial.sum())
        ids = torch.full(partial.shape, -1, dtype=torch.int32, device=partial.device)
        ids[partial] = torch.arange(n_tiles, dtype=torch.int32, device=partial.device)
        self.tile_ids = ids.contiguous()
        if tiles is None or n_tiles == 0:
            tiles = torch.zeros(1, bm, bn, dtype=torch.int8, device=partial.device)   # placeholder
        self.mask_tiles = tiles.to(torch.int8).contiguous()
        self._derived = {}          # masks derived from this one (on a device, AND causal), made once

    # -- what the kernels ask for -------------------------------------------------------
    def check_lengths(self, n_q: int, n_k: int, name="block_mask"):
        """ValueError unless the mask was made for ``n_q`` queries and ``n_k`` keys (a mask with
        ``seq_lengths`` None fits any lengths with its numbers of blocks)."""
        bq, bk = self.block_size
        if self.seq_lengths is not None and tuple(self.seq_lengths) != (n_q, n_k):
            raise ValueError(f"{name}: expected q with {self.seq_lengths[0]} positions and k with {self.seq_lengths[1]} "
                             f"(the lengths the mask was made for; make a new one with create_block_mask for other "
                             f"lengths), got {n_q} and {n_k}")
        want = (math.ceil(n_q / bq), math.ceil(n_k / bk))
        if self.num_blocks != want:
            raise ValueError(f"{name}: expected {want[0]} x {want[1]} blocks of {self.block_size} for q with {n_q} "
                             f"positions and k with {n_k}, got a mask of shape {self.shape}")

    def to(self, device) -> "BlockMask":
        """The same mask with its lists on ``device`` (made once per device and kept)."""
        device = torch.device(device)
        if self.mask.device == device:
            return self
        key = ("device", str(device))
        if key not in self._derived:
            moved = BlockMask.__new__(BlockMask)
            moved.__dict__.update({k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                   for k, v in self.__dict__.items() if k != "_derived"})
            moved._derived = {}
            self._derived[key] = moved
        return self._derived[key]

    def and_causal(self, n_q: int | None = None, n_k: int | None = None) -> "BlockMask":
        """This mask AND :func:`attnlab.mask_mods.causal` (made once and kept). A mask without
        ``seq_lengths`` needs the lengths. Example: ``m.and_causal(100, 100)``"""
        n_q, n_k = self._lengths(n_q, n_k)
        key = ("causal", n_q, n_k)
        if key not in self._derived:
            b, h = self.shape[:2]
            self._derived[key] = create_block_mask(mm.and_masks(self.mask_mod, mm.causal), b, h, n_q, n_k,
                                                   self.block_size, device=self.mask.device)
        return self._derived[key]

    def for_lengths(self, n_q: int, n_k: int) -> "BlockMask":
        """The same mask for other sequence lengths (made once per lengths and kept): the
        mask_mod evaluated again, or for a tile pattern (no ``seq_lengths``) its top-left tiles.
        Example: ``m.for_lengths(37, 37)`` (a model sampling a shorter sequence than it was built for)"""
        _check_len(n_q, "n_q")
        _check_len(n_k, "n_k")
        if self.seq_lengths is not None and tuple(self.seq_lengths) == (n_q, n_k):
            return self
        key = ("lengths", n_q, n_k)
        if key not in self._derived:
            bq, bk = self.block_size
            if self.seq_lengths is None:
                nqb, nkb = math.ceil(n_q / bq), math.ceil(n_k / bk)
                if nqb > self.num_blocks[0] or nkb > self.num_blocks[1]:
                    raise ValueError(f"n_q, n_k: expected at most {self.num_blocks[0] * bq} and {self.num_blocks[1] * bk} "
                                     f"for this tile pattern of {self.num_blocks} blocks, got {n_q} and {n_k}")
                self._derived[key] = BlockMask(self.full_blocks[..., :nqb, :nkb], self.block_size)
            else:
                self._derived[key] = create_block_mask(self.mask_mod, *self.shape[:2], n_q, n_k, self.block_size,
                                                       device=self.mask.device)
        return self._derived[key]

    def _lengths(self, n_q, n_k):
        if n_q is None and n_k is None and self.seq_lengths is not None:
            return tuple(self.seq_lengths)
        if n_q is None or n_k is None:
            raise TypeError("n_q, n_k: expected the sequence lengths (this mask was made from tiles, without them)")
        _check_len(n_q, "n_q")
        _check_len(n_k, "n_k")
        self.check_lengths(n_q, n_k, name="n_q, n_k")
        return n_q, n_k

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
        """Fraction of tiles computed, partial or full (1.0 = dense)."""
        return float(self.mask.float().mean())

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density

    def seq_lengths_ok(self, n_q: int, n_k: int) -> bool:
        try:
            self.check_lengths(n_q, n_k)
        except ValueError:
            return False
        return True

    def to_element_mask(self, n_q: int | None = None, n_k: int | None = None) -> torch.Tensor:
        """Bool (B, H, n_q, n_k): True where a query attends to a key (the mask_mod, evaluated).
        Lengths default to ``seq_lengths``."""
        n_q, n_k = self._lengths(n_q, n_k)
        b, h = self.shape[:2]
        return mm.create_mask(self.mask_mod, b, h, n_q, n_k, device=self.mask.device)

    def _combine(self, other, op, mod_op, name):
        if not isinstance(other, BlockMask):
            raise TypeError(f"masks: expected BlockMask objects for {name}, got {type(other).__name__}")
        if other.block_size != self.block_size:
            raise ValueError(f"masks: expected one block size for {name}, got {self.block_size} and {other.block_size}")
        if other.num_blocks != self.num_blocks:
            raise ValueError(f"masks: expected one number of blocks for {name}, got {self.num_blocks} and {other.num_blocks}")
        lengths = {tuple(m.seq_lengths) for m in (self, other) if m.seq_lengths is not None}
        if len(lengths) > 1:
            raise ValueError(f"masks: expected one pair of sequence lengths for {name}, got {sorted(lengths)}")
        if not lengths:   # two tile patterns: combine the tiles
            return BlockMask(op(self.mask, other.mask), self.block_size)
        b = max(self.shape[0], other.shape[0])
        h = max(self.shape[1], other.shape[1])
        return create_block_mask(mod_op(self.mask_mod, other.mask_mod), b, h, *lengths.pop(), self.block_size,
                                 device=self.mask.device)

    def __or__(self, other):
        return self._combine(other, torch.logical_or, mm.or_masks, "union")

    def __and__(self, other):
        return self._combine(other, torch.logical_and, mm.and_masks, "intersection")

    def __invert__(self):
        if self.seq_lengths is None:
            return BlockMask(~self.mask, self.block_size)
        return create_block_mask(mm.not_mask(self.mask_mod), *self.shape[:2], *self.seq_lengths, self.block_size,
                                 device=self.mask.device)

    def __eq__(self, other):
        return (isinstance(other, BlockMask) and self.block_size == other.block_size
                and self.seq_lengths == other.seq_lengths
                and torch.equal(self.partial_blocks, other.partial_blocks)
                and torch.equal(self.full_blocks, other.full_blocks)
                and torch.equal(self.mask_tiles, other.mask_tiles))

    __hash__ = None

    def __repr__(self):
        b, h, nq, nk = self.shape
        full = float(self.full_blocks.float().mean())
        lines = [f"BlockMask(shape={self.shape}, block_size={self.block_size}, seq_lengths={self.seq_lengths}, "
                 f"density={self.density:.1%}: full {full:.1%}, partial {self.density - full:.1%})"]
        if nq <= 32 and nk <= 32:
            for bi in range(min(b, 2)):
                for hi in range(min(h, 2)):
                    if b > 1 or h > 1:
                        lines.append(f"  batch {bi}, head {hi}:")
                    for f_row, p_row in zip(self.full_blocks[bi, hi].tolist(), self.partial_blocks[bi, hi].tolist()):
                        lines.append("  " + "".join("██" if f else ("▒▒" if p else "░░") for f, p in zip(f_row, p_row)))
        else:
            lines.append(f"  ({nq} x {nk} blocks: too many to print; use .to_figure())")
        return "\n".join(lines)

    def to_figure(self, batch: int = 0, head: int = 0, ax=None, title=None):
        """A matplotlib Figure of the tiles of one (batch, head): full black, partial grey, empty white."""
        import matplotlib.pyplot as plt

        if ax is None:
            fig, ax = plt.subplots(figsize=(4, 4))
        else:
            fig = ax.figure
        bi, hi = min(batch, self.shape[0] - 1), min(head, self.shape[1] - 1)
        m = (self.full_blocks[bi, hi].float() + 0.5 * self.partial_blocks[bi, hi].float()).cpu().numpy()
        ax.imshow(m, cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xlabel(f"key block (block_n={self.block_size[1]})")
        ax.set_ylabel(f"query block (block_m={self.block_size[0]})")
        ax.set_title(title or f"density {self.density:.0%} (grey: partial)")
        return fig


def create_block_mask(mask_mod, B, H, Nq, Nk, block_size=(64, 64), device="cpu") -> BlockMask:
    """Evaluate ``mask_mod`` and sort the (block_m, block_n) tiles into empty, partial and full.

    mask_mod(b, h, q_idx, kv_idx) -> bool (:mod:`attnlab.mask_mods`); B, H: batch and (query)
    heads, or None for a mask the same across them (a dim of 1, broadcast), as in FlexAttention;
    Nq, Nk: the lengths (positions past them count as masked, so a ragged last block is never
    full); block_size: an int or (block_m, block_n), each 16, 32, 64 or 128. Equal to
    ``torch.nn.attention.flex_attention.create_block_mask(mask_mod, B, H, Nq, Nk, BLOCK_SIZE=block_size)``
    in ``kv_num_blocks``, ``kv_indices``, ``full_kv_num_blocks``, ``full_kv_indices`` and their transposes.

    Example: ``m = create_block_mask(mask_mods.causal, None, None, 100, 100, block_size=(32, 16))``
    """
    bm, bn = _check_block_size(block_size)
    allowed = mm.create_mask(mask_mod, B, H, Nq, Nk, device=device)             # (B, H, Nq, Nk) bool
    b, h = allowed.shape[:2]
    nqb, nkb = math.ceil(Nq / bm), math.ceil(Nk / bn)
    padded = torch.zeros(b, h, nqb * bm, nkb * bn, dtype=torch.bool, device=device)   # padding: masked
    padded[..., :Nq, :Nk] = allowed
    blocks = padded.view(b, h, nqb, bm, nkb, bn).permute(0, 1, 2, 4, 3, 5)         # (B, H, nqb, nkb, bm, bn)
    count = blocks.sum((-2, -1))                                                 # kept elements per tile
    full = count == bm * bn
    partial = (count > 0) & ~full
    tiles = blocks[partial].to(torch.int8)                                       # (T, bm, bn), nonzero() order
    return BlockMask._from_kinds(partial, full, (bm, bn), mask_mod, (Nq, Nk), tiles)


# ---------------------------------------------------------------------------------------
# Shortcuts: a mask_mod of attnlab.mask_mods made into a BlockMask of shape
# (1, 1, ceil(n_q / block_m), ceil(n_k / block_n)) for lengths n_q, n_k.
# ---------------------------------------------------------------------------------------
def full_mask(n_q, n_k, block_size=(64, 64)) -> BlockMask:
    """Every element kept (dense attention, density 1). Example: ``full_mask(256, 256).density  # 1.0``"""
    return create_block_mask(mm.full, None, None, n_q, n_k, block_size)


def causal_block_mask(n_q, n_k, block_size=(64, 64)) -> BlockMask:
    """:func:`attnlab.mask_mods.causal` (key <= query, top-left aligned, like SDPA's is_causal).

    Example: ``causal_block_mask(256, 256, (64, 64)).density  # 0.625``
    """
    return create_block_mask(mm.causal, None, None, n_q, n_k, block_size)


def local_mask(n_q, n_k, window, block_size=(64, 64)) -> BlockMask:
    """:func:`attnlab.mask_mods.local`: the band ``|query - key| <= window`` (in tokens), exact.

    Example: ``local_mask(512, 512, window=64, block_size=(64, 64))``
    """
    return create_block_mask(mm.local(window), None, None, n_q, n_k, block_size)


def strided_mask(n_q, n_k, stride, block_size=(64, 64)) -> BlockMask:
    """:func:`attnlab.mask_mods.strided`: key visible when ``(query - key) % stride == 0``.

    Example: ``strided_mask(512, 512, stride=4)``
    """
    return create_block_mask(mm.strided(stride), None, None, n_q, n_k, block_size)


def global_mask(n_q, n_k, num_blocks=1, block_size=(64, 64)) -> BlockMask:
    """:func:`attnlab.mask_mods.global_tokens` with ``num_blocks * block_n`` global tokens: they see
    every key and every query sees them (Longformer/BigBird style).

    Example: ``local_mask(512, 512, 64) | global_mask(512, 512, num_blocks=1)``
    """
    validate.integer(num_blocks, "num_blocks", minimum=0)
    bs = _check_block_size(block_size)
    return create_block_mask(mm.global_tokens(num_blocks * bs[1]), None, None, n_q, n_k, bs)


def random_mask(n_q, n_k, density, block_size=(64, 64), seed=0, batch=1, heads=1) -> BlockMask:
    """Each tile kept independently with probability ``density`` (seeded, reproducible):
    :func:`attnlab.mask_mods.tiles` of a random table.

    A query block may end up with no key block: its rows then output zeros.
    ``batch``/``heads`` > 1 draw a different pattern per (batch, head).

    Example: ``random_mask(1024, 1024, density=0.25, seed=0)``
    """
    validate.number_in(density, "density", 0, 1)
    bs = _check_block_size(block_size)
    _check_len(n_q, "n_q")
    _check_len(n_k, "n_k")
    validate.integer(batch, "batch")
    validate.integer(heads, "heads")
    g = torch.Generator().manual_seed(int(seed))
    table = torch.rand(batch, heads, math.ceil(n_q / bs[0]), math.ceil(n_k / bs[1]), generator=g) < density
    return create_block_mask(mm.tiles(table, bs), batch, heads, n_q, n_k, bs)


def _reduce(masks, name, method):
    if not masks:
        raise ValueError(f"masks: expected at least one BlockMask for {name}, got none")
    for m in masks:
        if not isinstance(m, BlockMask):
            raise TypeError(f"masks: expected BlockMask objects for {name}, got {type(m).__name__}")
    out = masks[0]
    for m in masks[1:]:
        out = method(out, m)
    return out


def union(*masks: BlockMask) -> BlockMask:
    """Elements kept by any of the masks (also ``a | b``). Example: ``union(local_mask(256, 256, 32), global_mask(256, 256))``"""
    return _reduce(masks, "union", BlockMask.__or__)


def intersection(*masks: BlockMask) -> BlockMask:
    """Elements kept by all of the masks (also ``a & b``). Example: ``intersection(local_mask(256, 256, 64), causal_block_mask(256, 256))``"""
    return _reduce(masks, "intersection", BlockMask.__and__)
