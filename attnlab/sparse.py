"""Learned sparse attention in plain PyTorch: score key blocks cheaply, keep the best, attend to those.

Native Sparse Attention (Yuan et al. 2025, arXiv:2502.11089) and DeepSeek Sparse Attention
(DeepSeek-AI, DeepSeek-V3.2, arXiv:2512.02556) both let each query attend to a few key blocks
(NSA) or tokens (DSA) that a cheap scorer ranks highest, so attention costs O(N k) instead of
O(N^2). This module is the reference side; the kernel is ``attnlab.kernels.selected_attention``.

Read top to bottom:

1. :func:`indexer_scores` and :func:`indexer_block_scores`: DSA's "lightning indexer", a few
   small ReLU heads that score every (query, key) pair, reduced to (query block, key block).
2. :func:`select_blocks`: the top-k key blocks of each query block, as ``block_indices``
   (int32, ids ascending, -1 padded); under causal never a future block, always the diagonal one.
3. :func:`check_block_indices`: the one check of a ``block_indices`` tensor (the kernel, the
   references and ``attnlab.iomodel`` call it).
4. :func:`selected_tiles` and :func:`selected_mask`: the (query block, key block) table and the
   element mask a selection means.
5. :func:`selected_attention_reference`: dense attention under that mask, with
   ``attnlab.attention``'s reference (the spec the kernel matches).
6. :func:`attention_mass_kept`: how much of each query's dense softmax mass the selection keeps.

Conventions: ``block_size`` is one int, query blocks and key blocks alike (the kernel's tiles);
``n_q_blocks = ceil(N / block_size)``, ``n_k_blocks = ceil(N_k / block_size)``; causal is
top-left (key j <= query i). At block level, key block j holds a key that some query of query
block i may see iff j <= i, whatever N and N_k: that is the block causal rule used here.

Example::

    from attnlab.sparse import indexer_block_scores, select_blocks, selected_attention_reference
    scores = indexer_block_scores(q_idx, k_idx, w, block_size=64)          # (B, nqb, nkb)
    block_indices = select_blocks(scores, topk=4)[:, None]                 # (B, 1, nqb, 4): one KV head
    o = selected_attention_reference(q, k, v, block_indices, block_size=64)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab import mask_mods, validate
from attnlab.attention import causal_mask, scaled_dot_product_attention

__all__ = [
    "indexer_scores", "indexer_block_scores", "select_blocks", "check_block_indices", "n_blocks",
    "selected_tiles", "selected_mask", "selected_attention_reference", "attention_mass_kept",
]


def n_blocks(n, block_size):
    """How many blocks of ``block_size`` cover ``n`` positions: ceil(n / block_size)."""
    return -(-n // block_size)


# ---------------------------------------------------------------------------------------------
# 1. the lightning indexer
# ---------------------------------------------------------------------------------------------

def indexer_scores(q_idx, k_idx, weights=None, *, causal=True):
    """DSA's lightning indexer: I[t, s] = sum_j w[t, j] * ReLU(q_idx[t, j] . k_idx[s]).

    DeepSeek-V3.2 (arXiv:2512.02556; the DSA prototype, eq. (1)) scores every preceding token ``s``
    for query token ``t`` with H_idx small heads: each head has its own query vector q_{t,j} and a
    weight w_{t,j}, both computed from the query token, and all heads share one key k_s per token;
    ReLU rather than softmax, and FP8 there, keep it cheap. It is still O(N^2) pairs, but each costs
    H_idx * d_idx multiply-adds in FP8 (the released model: 64 indexer heads of 128, top 2048 tokens)
    against the main attention's full heads. DSA then attends, under MLA's multi-query form, to the
    top-k *tokens*; this course selects *blocks* (:func:`indexer_block_scores`), as NSA does.

    q_idx: (B, H_idx, N, d_idx); k_idx: (B, N_k, d_idx) (one key per token, shared by the heads);
    weights: None (all 1) or broadcastable to (B, H_idx, N) (for one constant per head pass
    ``w[None, :, None]``). causal: future pairs (s > t) get -inf. Returns (B, N, N_k), q_idx's dtype.

    Example: ``indexer_scores(torch.randn(1, 4, 8, 16), torch.randn(1, 8, 16)).shape  # (1, 8, 8)``
    """
    validate.tensor(q_idx, "q_idx", 4, "(batch, indexer_heads, seq, index_dim)", floating=True)
    validate.tensor(k_idx, "k_idx", 3, "(batch, seq_k, index_dim)", floating=True)
    validate.like(k_idx, "k_idx", q_idx, "q_idx")
    B, H_i, N, d_i = q_idx.shape
    if k_idx.shape[0] != B or k_idx.shape[2] != d_i:
        raise ValueError(f"k_idx: expected shape ({B}, seq_k, {d_i}) (q_idx's batch and index_dim), "
                         f"got {tuple(k_idx.shape)}")
    if weights is not None:
        validate.tensor(weights, "weights", floating=True)
        validate.like(weights, "weights", q_idx, "q_idx")
        try:
            torch.broadcast_shapes(weights.shape, (B, H_i, N))
        except RuntimeError:
            raise ValueError(f"weights: expected a shape broadcastable to ({B}, {H_i}, {N}) "
                             f"(batch, indexer_heads, seq), got {tuple(weights.shape)}") from None
    validate.flag(causal, "causal")
    per_head = torch.relu(torch.einsum("bhtd,bsd->bhts", q_idx, k_idx))   # (B, H_idx, N, N_k)
    if weights is not None:
        per_head = per_head * weights.expand(B, H_i, N)[..., None]        # w[t, j] per query and head
    scores = per_head.sum(1)                                              # (B, N, N_k)
    if causal:
        scores = scores.masked_fill(~causal_mask(N, k_idx.shape[1], device=q_idx.device), float("-inf"))
    return scores


def indexer_block_scores(q_idx, k_idx, weights=None, *, block_size, causal=True):
    """The indexer's scores per (query block, key block): (B, n_q_blocks, n_k_blocks).

    DSA selects top-k *tokens* per query; a block kernel (NSA's selection, FlashAttention tiles)
    needs one choice per block of ``block_size`` queries among blocks of ``block_size`` keys. The
    token scores of :func:`indexer_scores` are reduced by a **max over the keys** of a key block
    (a block is worth reading if one key in it matters: a mean would drown one sharp match in
    its block's noise, and token-level top-k keeps single keys too), then a **mean over the
    queries** of a query block (the choice serves all of them; a max would let one query decide
    for the block). Under ``causal`` a query only counts keys it may see, and future blocks
    (j > i) are -inf. Arguments as in :func:`indexer_scores`; block_size: an int >= 1.

    Example: ``indexer_block_scores(torch.randn(1, 4, 100, 16), torch.randn(1, 100, 16), block_size=32).shape  # (1, 4, 4)``
    """
    block_size = validate.integer(block_size, "block_size")
    scores = indexer_scores(q_idx, k_idx, weights, causal=causal)         # (B, N, N_k)
    B, N, N_k = scores.shape
    nqb, nkb = n_blocks(N, block_size), n_blocks(N_k, block_size)
    if N == 0 or N_k == 0:
        return scores.new_full((B, nqb, nkb), float("-inf"))
    s = F.pad(scores, (0, nkb * block_size - N_k), value=float("-inf"))  # (B, N, nkb * bs): padded keys never win
    per_query = s.view(B, N, nkb, block_size).amax(-1)                    # (B, N, nkb): best key of each key block
    rows = F.pad(per_query, (0, 0, 0, nqb * block_size - N))              # (B, nqb * bs, nkb): padded rows add 0
    counts = torch.clamp(N - torch.arange(nqb, device=s.device) * block_size, max=block_size)   # (nqb,) real rows
    block = rows.view(B, nqb, block_size, nkb).sum(2) / counts[:, None].to(s.dtype)           # (B, nqb, nkb)
    if causal:
        future = torch.arange(nkb, device=s.device)[None, :] > torch.arange(nqb, device=s.device)[:, None]
        block = block.masked_fill(future, float("-inf"))
    return block


# ---------------------------------------------------------------------------------------------
# 2. top-k selection
# ---------------------------------------------------------------------------------------------

def select_blocks(block_scores, topk, *, causal=True):
    """The ``topk`` highest-scoring key blocks of each query block, as int32 ``block_indices``.

    block_scores: floating (B, n_q_blocks, n_k_blocks) or (B, H_kv, n_q_blocks, n_k_blocks)
    (:func:`indexer_block_scores`; a head dim gives each KV head its own choice). topk: an int >= 1.
    A block scored -inf is never selected. Under ``causal``: a future block (j > i) is never
    selected and the diagonal block (j == i, where it exists) always is (a query must at least see
    itself; NSA's selection likewise always keeps the initial and the local blocks). Where fewer than ``topk`` blocks can be chosen
    the remaining slots are -1. Each row lists its ids in ascending order, -1s last.
    Returns int32 of block_scores' leading dims + (n_q_blocks, topk).

    Example: ``select_blocks(torch.tensor([[[0., 0, 0], [5, 1, 0], [1, 9, 3]]]), 2).tolist()  # [[[0, -1], [0, 1], [1, 2]]]``
    """
    validate.tensor(block_scores, "block_scores", floating=True)
    if block_scores.dim() not in (3, 4):
        raise ValueError(f"block_scores: expected a 3-D (batch, n_q_blocks, n_k_blocks) or 4-D "
                         f"(batch, kv_heads, n_q_blocks, n_k_blocks) tensor, got shape {tuple(block_scores.shape)}")
    topk = validate.integer(topk, "topk")
    validate.flag(causal, "causal")
    if torch.isnan(block_scores).any():
        raise ValueError("block_scores: expected no NaN (a NaN has no rank), got NaN")
    nqb, nkb = block_scores.shape[-2:]
    s = block_scores.float()                                               # (..., nqb, nkb)
    if causal:
        i = torch.arange(nqb, device=s.device)[:, None]
        j = torch.arange(nkb, device=s.device)[None, :]
        s = s.masked_fill(j > i, float("-inf")).masked_fill(j == i, float("inf"))   # never future, always diagonal
    k = min(topk, nkb)
    values, ids = s.topk(k, dim=-1)                                        # (..., nqb, k)
    ids = torch.where(values == float("-inf"), nkb, ids)                   # not selectable: sorts last
    ids = ids.sort(dim=-1).values
    ids = torch.where(ids == nkb, -1, ids)
    if k < topk:
        ids = F.pad(ids, (0, topk - k), value=-1)
    return ids.to(torch.int32).contiguous()


# ---------------------------------------------------------------------------------------------
# 3. checking block_indices (the one home of these rules)
# ---------------------------------------------------------------------------------------------

def check_block_indices(block_indices, block_size, n_q, n_k, *, batch=None, kv_heads=None, device=None):
    """Check a selection and its block size against the lengths; return ``block_size`` as an int.

    block_indices: a 4-D int32 tensor (batch or 1, kv_heads or 1, ceil(n_q / block_size), kk) of
    key-block ids in [-1, ceil(n_k / block_size) - 1] (-1 = unused), no id twice in a row, on
    ``device`` (when given). block_size: an int power of two >= 16 (the kernels' tile; ``tl.dot``
    needs 16). ``batch`` and ``kv_heads`` None: not checked. Errors name the argument
    (``TypeError`` for a type, ``ValueError`` for a value), before any kernel is launched.
    """
    block_size = validate.power_of_two(block_size, "block_size")
    validate.tensor(block_indices, "block_indices", 4, "(batch, kv_heads, n_q_blocks, topk)")
    if block_indices.dtype != torch.int32:
        raise TypeError(f"block_indices: expected dtype int32 (key-block ids, -1 = unused), got {block_indices.dtype}")
    nqb, nkb = n_blocks(n_q, block_size), n_blocks(n_k, block_size)
    b, h, rows, _ = block_indices.shape
    if rows != nqb or (batch is not None and b not in (1, batch)) or (kv_heads is not None and h not in (1, kv_heads)):
        want_b = "batch" if batch is None else (f"{batch} or 1" if batch > 1 else "1")
        want_h = "kv_heads" if kv_heads is None else (f"{kv_heads} or 1" if kv_heads > 1 else "1")
        raise ValueError(f"block_indices: expected shape ({want_b}, {want_h}, {nqb}, topk) for {n_q} queries in blocks "
                         f"of {block_size}, got {tuple(block_indices.shape)}")
    if device is not None and block_indices.device != torch.device(device):
        raise ValueError(f"block_indices: expected device {device} (the device of q), got {block_indices.device}")
    if block_indices.numel():
        lo, hi = int(block_indices.min()), int(block_indices.max())
        if lo < -1 or hi >= nkb:
            raise ValueError(f"block_indices: expected ids in [-1, {nkb - 1}] ({n_k} keys in blocks of {block_size}; "
                             f"-1 = unused), got ids in [{lo}, {hi}]")
        ids = block_indices.sort(dim=-1).values
        if bool(((ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] >= 0)).any()):
            raise ValueError("block_indices: expected each key block at most once per query block (a repeated id "
                             "would count its keys twice), got a repeated id")
    return block_size


# ---------------------------------------------------------------------------------------------
# 4. what a selection means: tiles and elements
# ---------------------------------------------------------------------------------------------

def selected_tiles(block_indices, n_q, n_k, block_size, causal=True):
    """The (query block, key block) table of a selection: bool (B', H', n_q_blocks, n_k_blocks),
    True where the query block selected the key block. Under ``causal`` a selected future block
    (j > i) is False: it holds no key its queries may see (the kernel never reads it).

    Example: ``selected_tiles(torch.tensor([[[[0, -1], [0, 1]]]], dtype=torch.int32), 64, 64, 32)``
    """
    block_size = check_block_indices(block_indices, block_size, n_q, n_k)
    validate.flag(causal, "causal")
    B, H, nqb, _ = block_indices.shape
    nkb = n_blocks(n_k, block_size)
    ids = block_indices.long()
    ids = torch.where(ids < 0, nkb, ids)                                   # unused slots: an extra column
    table = torch.zeros(B, H, nqb, nkb + 1, dtype=torch.bool, device=ids.device)
    table.scatter_(-1, ids, True)
    table = table[..., :nkb]                                               # (B', H', nqb, nkb)
    if causal:
        i = torch.arange(nqb, device=ids.device)[:, None]
        j = torch.arange(nkb, device=ids.device)[None, :]
        table = table & (j <= i)
    return table


def selected_mask(block_indices, n_q, n_k, block_size, causal=True):
    """The element mask of a selection: bool (B', H', n_q, n_k), True where query i attends to key j:
    j's block was selected by i's block (and j <= i under ``causal``). B', H': block_indices'.

    Example: ``selected_mask(torch.tensor([[[[0], [0]]]], dtype=torch.int32), 40, 40, 32).shape  # (1, 1, 40, 40)``
    """
    table = selected_tiles(block_indices, n_q, n_k, block_size, causal)
    mod = mask_mods.tiles(table, (block_size, block_size))
    if causal:
        mod = mask_mods.and_masks(mod, mask_mods.causal)
    B, H = table.shape[:2]
    return mask_mods.create_mask(mod, B, H, n_q, n_k, device=table.device) if n_q and n_k else \
        torch.zeros(B, H, n_q, n_k, dtype=torch.bool, device=table.device)


def _expand_heads(x, heads):
    """(B, H_kv, ...) -> (B, heads, ...): each KV head repeated for its GQA group (a view for one KV
    head, else a copy, as a reference may)."""
    if x.shape[1] == heads:
        return x
    if x.shape[1] == 1:
        return x.expand(x.shape[0], heads, *x.shape[2:])
    return x.repeat_interleave(heads // x.shape[1], dim=1)


# ---------------------------------------------------------------------------------------------
# 5. the reference: dense attention under the selection's mask
# ---------------------------------------------------------------------------------------------

def selected_attention_reference(q, k, v, block_indices, *, block_size, causal=True, scale=None):
    """Dense attention under :func:`selected_mask`: the spec ``attnlab.kernels.selected_attention`` matches.

    q: (B, H, N, d), k: (B, H_kv, N_k, d), v: (B, H_kv, N_k, d_v), H % H_kv == 0 (the query heads of
    a KV head share its selection). block_indices: int32 (B or 1, H_kv or 1, ceil(N / block_size), kk),
    -1 = unused (:func:`check_block_indices`). It computes all N x N_k scores and throws away the
    unselected ones, with ``attnlab.attention.scaled_dot_product_attention``. Rows with no visible key
    output zeros. Returns (B, H, N, d_v).

    Example: ``o = selected_attention_reference(q, k, v, select_blocks(scores, 4)[:, None], block_size=64)``
    """
    validate.qkv(q, k, v, gqa=True)
    B, H, N, _ = q.shape
    H_kv, N_k = k.shape[1], k.shape[2]
    block_size = check_block_indices(block_indices, block_size, N, N_k, batch=B, kv_heads=H_kv, device=q.device)
    mask = _expand_heads(selected_mask(block_indices, N, N_k, block_size, causal), H)   # (B', H or 1, N, N_k)
    return scaled_dot_product_attention(q, _expand_heads(k, H), _expand_heads(v, H), mask=mask, scale=scale)


# ---------------------------------------------------------------------------------------------
# 6. how good a selection is
# ---------------------------------------------------------------------------------------------

def attention_mass_kept(q, k, block_indices, *, block_size, causal=True, scale=None):
    """The fraction of each query's dense softmax attention that falls in its selected blocks.

    Dense attention (causal when ``causal``) gives query i weights P[i, :] summing to 1; this returns
    sum of P[i, j] over the keys j the selection lets i see: 1 means the selection lost nothing, and
    1 - mass bounds how far the selected output can move (||o - o_sel|| <= 2 (1 - mass) max ||v||).
    q: (B, H, N, d), k: (B, H_kv, N_k, d), block_indices as in :func:`selected_attention_reference`.
    Returns float (B, H, N) in [0, 1] (q's dtype); a row with no key at all gives 0.

    Example: ``attention_mass_kept(q, k, select_blocks(scores, 4)[:, None], block_size=64).mean()``
    """
    validate.qkv(q, k, k, gqa=True)                                     # (no v here)
    B, H, N, _ = q.shape
    H_kv, N_k = k.shape[1], k.shape[2]
    block_size = check_block_indices(block_indices, block_size, N, N_k, batch=B, kv_heads=H_kv, device=q.device)
    validate.flag(causal, "causal")
    kh = _expand_heads(k, H)                                              # (B, H, N_k, d)
    _, p = scaled_dot_product_attention(q, kh, kh, causal=causal, scale=scale, return_weights=True)   # (B, H, N, N_k)
    mask = _expand_heads(selected_mask(block_indices, N, N_k, block_size, causal), H)                # (B', H', N, N_k)
    return (p * mask).sum(-1)                                             # (B, H, N)

