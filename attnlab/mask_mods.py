"""Three attention masks written as FlexAttention ``mask_mod`` functions.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether query ``q_idx`` of batch ``b`` and head
``h`` may attend to key ``kv_idx`` (PyTorch's ``torch.nn.attention.flex_attention``). Each factory
here returns one. They use only broadcasting operations and indexing, so the same function works
on scalar indices (under ``torch.vmap``, as ``flex_attention.create_mask`` calls it) and on index
grids that broadcast, e.g. ``b`` (B, 1, 1, 1), ``h`` (1, H, 1, 1), ``q_idx`` (1, 1, Nq, 1) and
``kv_idx`` (1, 1, 1, Nk) give the whole (B, H, Nq, Nk) mask in one call.

- :func:`sliding_window`: causal, each query sees itself and the ``window`` keys before it
  (Mistral, Longformer's local attention);
- :func:`prefix_lm`: every query sees the first ``prefix_len`` keys (the prompt, bidirectional),
  and causally after that (T5's prefix LM, PaLM's UL2);
- :func:`document`: several sequences packed into one row; a query sees the keys of its own
  document, causally. ``doc_ids`` is an int tensor (B, N); id -1 marks padding, which sees no key
  and which no query sees (its rows of the output are zeros).

Example::

    mm = sliding_window(2)
    q, kv = torch.arange(5)[:, None], torch.arange(5)[None, :]
    mm(0, 0, q, kv).int()   # 5 x 5: ones on the diagonal and the two sub-diagonals
"""


from attnlab import validate

__all__ = ["sliding_window", "prefix_lm", "document", "MASK_MODS"]


def sliding_window(window):
    """mask_mod: key ``kv_idx`` is visible from ``q_idx`` when ``0 <= q_idx - kv_idx <= window``.

    Example: ``sliding_window(2)(0, 0, torch.tensor(5), torch.tensor(3))  # tensor(True)``
    """
    validate.integer(window, "window", minimum=0)

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    return sliding_window_mask


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

    Example: ``document(torch.tensor([[0, 0, 1, -1]]))(0, 0, torch.tensor(2), torch.tensor(1))  # tensor(False)``
    """
    validate.tensor(doc_ids, "doc_ids", 2, "(batch, positions)")

    def document_mask(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx) & (doc_ids[b, kv_idx] >= 0)

    return document_mask


# name -> factory
MASK_MODS = {"sliding_window": sliding_window, "prefix_lm": prefix_lm, "document": document}


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


MASK_MODS["sink_window"] = sink_window
__all__ += ["sink_window"]
