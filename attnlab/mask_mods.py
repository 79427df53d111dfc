"""Every attention mask of the course, written once, as a FlexAttention ``mask_mod``.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether query ``q_idx`` of batch ``b`` and head
``h`` may attend to key ``kv_idx`` (PyTorch's ``torch.nn.attention.flex_attention``). This module
is the one home of mask patterns: the reference attention, the kernels' block masks
(``attnlab.kernels.create_block_mask``), ``attnlab.approx``, the widgets, the lessons and the
grader all take their masks from here.

The functions use only broadcasting operations and indexing, so the same function works on
scalar indices (under ``torch.vmap``, as FlexAttention's ``create_mask`` calls it) and on index
grids that broadcast: ``b`` (B, 1, 1, 1), ``h`` (1, H, 1, 1), ``q_idx`` (1, 1, Nq, 1) and
``kv_idx`` (1, 1, 1, Nk) give the whole (B, H, Nq, Nk) mask in one call (:func:`create_mask`).

Masks (causal means top-left aligned, key ``kv_idx <= q_idx``, as SDPA's ``is_causal`` and
FlexAttention's examples, also when Nq != Nk):

- :func:`causal`, :func:`full`: mask_mods themselves (no parameter);
- :func:`sliding_window`: causal, each query sees itself and the ``window`` keys before it
  (Mistral; Longformer's local attention, one-sided);
- :func:`local`: the two-sided band ``|q_idx - kv_idx| <= window`` (Longformer, not causal);
- :func:`prefix_lm`: every query sees the first ``prefix_len`` keys (the prompt, bidirectional),
  and causally after that (T5's prefix LM, PaLM's UL2);
- :func:`document`: several sequences packed into one row; a query sees the keys of its own
  document, causally. ``doc_ids`` is an int tensor (B, N); id -1 marks padding, which sees no key
  and which no query sees (its rows of the output are zeros);
- :func:`strided`: dilated attention, ``(q_idx - kv_idx) % stride == 0`` (the strided pattern
  of Child et al. 2019's Sparse Transformer; AND it with :func:`causal` for their causal form);
- :func:`global_tokens`: the first ``num_tokens`` positions see every key and are seen by every
  query (Longformer's and BigBird's global tokens);
- :func:`padding`: keys at or past ``lengths[b]`` are masked (a padded batch);
- :func:`tiles`: a table of (query block, key block) tiles, every element of a kept tile kept
  (what a hand-drawn or random block pattern means element by element);
- :func:`and_masks`, :func:`or_masks`, :func:`not_mask`: combinations, as FlexAttention's.

Example::

    mm = and_masks(sliding_window(2), prefix_lm(1))
    create_mask(mm, None, None, 5, 5).int()[0, 0]   # 5 x 5: the band and the first column
"""

import torch

from attnlab import validate

__all__ = [
    "causal", "full", "sliding_window", "local", "prefix_lm", "document", "strided", "global_tokens",
    "padding", "sink_window", "tiles", "and_masks", "or_masks", "not_mask", "create_mask", "MASK_MODS",
]


def causal(b, h, q_idx, kv_idx):
    """mask_mod: key ``kv_idx`` visible from ``q_idx`` when ``kv_idx <= q_idx`` (top-left aligned).

    Example: ``causal(0, 0, torch.tensor(3), torch.tensor(4))  # tensor(False)``
    """
    return q_idx >= kv_idx


def full(b, h, q_idx, kv_idx):
    """mask_mod: every key visible (dense attention; FlexAttention's ``noop_mask``).

    Example: ``full(0, 0, torch.tensor(3), torch.tensor(4))  # tensor(True)``
    """
    return (q_idx >= 0) & (kv_idx >= 0)


def sliding_window(window):
    """mask_mod: key ``kv_idx`` is visible from ``q_idx`` when ``0 <= q_idx - kv_idx <= window``.

    Example: ``sliding_window(2)(0, 0, torch.tensor(5), torch.tensor(3))  # tensor(True)``
    """
    validate.integer(window, "window", minimum=0)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    return sliding_window_mask


def local(window):
    """mask_mod: the two-sided band, key visible when ``|q_idx - kv_idx| <= window``.

    Example: ``local(2)(0, 0, torch.tensor(3), torch.tensor(5))  # tensor(True)``
    """
    validate.integer(window, "window", minimum=0)

    def local_mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= window) & (kv_idx - q_idx <= window)

    return local_mask


def prefix_lm(prefix_len):
    """mask_mod: the first ``prefix_len`` keys are visible from every query; after them, causal.

    Example: ``prefix_lm(4)(0, 0, torch.tensor(1), torch.tensor(3))  # tensor(True): 3 is in the prefix``
    """
    validate.integer(prefix_len, "prefix_len", minimum=0)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (kv_idx <= q_idx)

    return prefix_lm_mask


def document(doc_ids):
    """mask_mod: same document (``doc_ids[b, q_idx] == doc_ids[b, kv_idx]``), causal, and not padding.

    doc_ids: int tensor (B, N), the document of each position of each row of the batch; -1 = padding.
    Use it with Nq, Nk <= N.

    Example: ``document(torch.tensor([[0, 0, 1, -1]]))(0, 0, torch.tensor(2), torch.tensor(1))  # tensor(False)``
    """
    validate.tensor(doc_ids, "doc_ids", 2, "(batch, positions)")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids: expected an integer tensor, got dtype {doc_ids.dtype}")

    def document_mask(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx) & (doc_ids[b, kv_idx] >= 0)

    return document_mask


def strided(stride):
    """mask_mod: dilated attention, key visible when ``(q_idx - kv_idx) % stride == 0``.

    Example: ``strided(3)(0, 0, torch.tensor(7), torch.tensor(1))  # tensor(True)``
    """
    validate.integer(stride, "stride")

    def strided_mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) % stride == 0

    return strided_mask


def global_tokens(num_tokens):
    """mask_mod: the first ``num_tokens`` keys are seen by every query, and the first ``num_tokens``
    queries see every key. OR it with a local pattern (Longformer, BigBird).

    Example: ``or_masks(local(64), global_tokens(16))``
    """
    validate.integer(num_tokens, "num_tokens", minimum=0)

    def global_tokens_mask(b, h, q_idx, kv_idx):
        return (q_idx < num_tokens) | (kv_idx < num_tokens)

    return global_tokens_mask


def padding(lengths):
    """mask_mod: key ``kv_idx`` of row ``b`` visible when ``kv_idx < lengths[b]`` (a padded batch).

    lengths: int tensor (B,). Example: ``padding(torch.tensor([3, 5]))(0, 0, torch.tensor(0), torch.tensor(4))  # tensor(False)``
    """
    validate.tensor(lengths, "lengths", 1, "(batch,)")
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise TypeError(f"lengths: expected an integer tensor, got dtype {lengths.dtype}")

    def padding_mask(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    return padding_mask


def sink_window(sinks, window):
    """mask_mod: StreamingLLM's attention (Xiao et al. 2023): causal, each query sees the first
    ``sinks`` keys (the attention sinks) and the last ``window`` keys up to itself
    (``0 <= q_idx - kv_idx < window``). ``attnlab.kvcache.RollingCache`` keeps exactly these keys.

    Example: ``sink_window(4, 8)(0, 0, torch.tensor(100), torch.tensor(2))  # tensor(True): a sink``
    """
    validate.integer(sinks, "sinks", minimum=0)
    validate.integer(window, "window")

    def sink_window_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < sinks) | (q_idx - kv_idx < window))

    return sink_window_mask


def tiles(table, block_size):
    """mask_mod of a tile pattern: element (q, kv) kept when tile ``(q // block_m, kv // block_n)`` is.

    table: bool tensor (B or 1, H or 1, query blocks, key blocks); block_size: (block_m, block_n).
    A batch or head dim of 1 is broadcast. Example: ``tiles(torch.eye(4, dtype=torch.bool)[None, None], (16, 16))``
    """
    validate.tensor(table, "table", 4, "(batch or 1, heads or 1, query blocks, key blocks)", dtypes=(torch.bool,))
    bm, bn = validate.block_pair(block_size, "block_size", single_int=False)
    per_b, per_h = table.shape[0] > 1, table.shape[1] > 1

    def tiles_mask(b, h, q_idx, kv_idx):
        return table[b * per_b, h * per_h, q_idx // bm, kv_idx // bn]

    return tiles_mask


def _check_mods(mods, name):
    if not mods:
        raise ValueError(f"mask_mods: expected at least one mask_mod for {name}, got none")
    for m in mods:
        if not callable(m):
            raise TypeError(f"mask_mods: expected callables mask_mod(b, h, q_idx, kv_idx) for {name}, "
                            f"got {type(m).__name__}")


def and_masks(*mask_mods):
    """mask_mod: kept where every one of ``mask_mods`` keeps it (the intersection).

    Example: ``and_masks(causal, strided(4))``
    """
    _check_mods(mask_mods, "and_masks")

    def and_mask(b, h, q_idx, kv_idx):
        out = mask_mods[0](b, h, q_idx, kv_idx)
        for m in mask_mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    return and_mask


def or_masks(*mask_mods):
    """mask_mod: kept where any of ``mask_mods`` keeps it (the union).

    Example: ``or_masks(sliding_window(64), global_tokens(4))``
    """
    _check_mods(mask_mods, "or_masks")

    def or_mask(b, h, q_idx, kv_idx):
        out = mask_mods[0](b, h, q_idx, kv_idx)
        for m in mask_mods[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    return or_mask


def not_mask(mask_mod):
    """mask_mod: kept where ``mask_mod`` is not. Example: ``not_mask(causal)  # strictly above the diagonal``"""
    _check_mods((mask_mod,), "not_mask")

    def inverted_mask(b, h, q_idx, kv_idx):
        return ~torch.as_tensor(mask_mod(b, h, q_idx, kv_idx))

    return inverted_mask


def create_mask(mask_mod, B, H, Nq, Nk, device="cpu"):
    """The element mask of ``mask_mod``: bool (B, H, Nq, Nk), True = the query may attend to the key.

    ``B`` or ``H`` of None give a dim of 1 (broadcast), as in FlexAttention's ``create_mask``;
    ``mask_mod`` is called once, on broadcasting index grids.

    Example: ``create_mask(causal, None, None, 4, 6).shape  # torch.Size([1, 1, 4, 6])``
    """
    _check_mods((mask_mod,), "create_mask")
    B = 1 if B is None else validate.integer(B, "B")
    H = 1 if H is None else validate.integer(H, "H")
    validate.integer(Nq, "Nq")
    validate.integer(Nk, "Nk")
    b = torch.arange(B, device=device)[:, None, None, None]
    h = torch.arange(H, device=device)[None, :, None, None]
    q_idx = torch.arange(Nq, device=device)[None, None, :, None]
    kv_idx = torch.arange(Nk, device=device)[None, None, None, :]
    out = torch.as_tensor(mask_mod(b, h, q_idx, kv_idx), device=device)
    if out.dtype != torch.bool:
        raise TypeError(f"mask_mod: expected it to return bool, got dtype {out.dtype}")
    return out.expand(B, H, Nq, Nk)


# name -> factory (the grader sends a mask by its name and argument)
MASK_MODS = {"sliding_window": sliding_window, "prefix_lm": prefix_lm, "document": document,
             "local": local, "strided": strided, "global_tokens": global_tokens,
             "sink_window": sink_window}
