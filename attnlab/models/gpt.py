"""A small GPT: a decoder-only transformer in the style of nanoGPT, with pluggable attention (lesson 09).

Read top to bottom:

1. ``attention_backend(attention, block_mask)``: the one function the model calls to attend.
   ``"sdpa"`` is torch's fused ``F.scaled_dot_product_attention``; ``"reference"`` is attnlab's
   plain PyTorch (``attnlab.attention``); ``"flash"`` is attnlab's FlashAttention-2 Triton kernel
   and ``"standard"`` its unfused Triton kernels (``attnlab.kernels``: native on a GPU, in
   Triton's interpreter on CPU tensors, chosen per call); ``"block_sparse"`` is block-sparse
   FlashAttention under a ``BlockMask`` (for example local plus global). Any callable with
   SDPA's signature, ``fn(q, k, v, is_causal=True) -> o`` on ``(B, nh, T, hs)`` tensors, plugs in
   the same way (a learner's own kernel). All of them are causal and have a backward pass.
2. ``CausalSelfAttention``: attnlab's ``MultiHeadAttention`` (its projections and head
   split/merge) with the attention call swapped for the backend; ``n_kv_heads`` fewer key/value
   heads than query heads (grouped-query attention; 1 is multi-query), rotary positions applied
   to q and k (``positions="rope"``), and a KV cache for decoding (lesson 10).
3. ``Block``: pre-LayerNorm, ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.
4. ``GPT``: token embedding plus positions (learned, or Vaswani et al.'s sinusoids; or rotary,
   inside attention; or none, NoPE), the blocks, a final LayerNorm and a read-out that shares its weights with
   the token embedding (weight tying, Press and Wolf 2017), cross-entropy on the next token.
   ``generate`` decodes with a KV cache per layer by default (``prefill`` then ``decode_step``):
   each token's K and V are computed and written once, and only the newest query attends;
   with ``attention="flash"`` that step runs ``attnlab.kernels.flash_decode``.
5. Layer layouts (lesson 12): ``GPT(..., layout=[...])`` gives each layer a kind, ``"dense"``
   (the layer above), ``"local"`` (:class:`LocalSelfAttention`: a window plus sinks),
   ``"selected"`` (:class:`SelectedSelfAttention`: a lightning indexer picks key blocks) or
   ``"delta"`` (:class:`GatedDeltaNet`: a constant-size state instead of a cache), so hybrids
   such as Gemma 3's local:global or Qwen3-Next's delta:attention are one list
   (:func:`layout_from_ratio`). ``layout=None`` is the model above, unchanged. ``"mla"``
   (:class:`LatentSelfAttention`: DeepSeek-V2's multi-head latent attention, ``attnlab.mla``)
   caches one latent per token and decodes with its up-projections absorbed.

Shapes: B batch, T positions, C = d_model, nh heads, hs = C // nh head size, V vocabulary.

Example::

    model = GPT(vocab_size=96, block_size=64, d_model=64, n_heads=4, n_layers=2, attention="flash", seed=0)
    logits, loss = model(x, y)                 # x, y: (B, T) long
    text_ids = model.generate(x[:1, :8], 100)  # (1, 108)
    hybrid = GPT(96, 64, 32, 2, 4, layout=["delta", "delta", "delta", "dense"], seed=0)   # Qwen3-Next's 3:1
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlab import mask_mods
from attnlab.attention import MultiHeadAttention, scaled_dot_product_attention
from attnlab.kvcache import KVCache, RollingCache, decode_reference
from attnlab.mla import MLA
from attnlab.positions import Rotary, sinusoidal_positions

__all__ = ["BACKENDS", "POSITIONS", "attention_backend", "sinusoidal_positions", "CausalSelfAttention", "Block",
           "GPT", "LAYER_KINDS", "LocalSelfAttention", "SelectedSelfAttention", "GatedDeltaNet", "DeltaState",
           "LayerInputs", "LatentSelfAttention", "LatentCache", "layout_from_ratio"]

BACKENDS = ("sdpa", "reference", "flash", "standard", "block_sparse")
POSITIONS = ("learned", "sinusoidal", "rope", "none")
KERNEL_HEAD_DIMS = (16, 32, 64, 128)   # head sizes attnlab's Triton kernels support


# ---------------------------------------------------------------------------------------------
# 1. the attention call
# ---------------------------------------------------------------------------------------------

def _crop_block_mask(block_mask, n):
    """``block_mask`` for ``n`` queries and keys (a shorter sequence than the mask was built for:
    sampling grows the sequence one position at a time): the mask's own ``for_lengths``, which
    evaluates its mask_mod again (partial tiles stay exact) or, for a tile pattern, keeps its
    top-left tiles; made once per length and kept by the mask."""
    if block_mask.seq_lengths is None:
        bq, bk = block_mask.block_size
        if block_mask.num_blocks == (math.ceil(n / bq), math.ceil(n / bk)):
            return block_mask
    elif tuple(block_mask.seq_lengths) == (n, n):
        return block_mask
    return block_mask.for_lengths(n, n)


def attention_backend(attention="sdpa", block_mask=None):
    """The causal attention ``fn(q, k, v) -> o`` of a backend name or a callable.

    q, k, v, o: (B, nh, T, hs). ``attention`` is one of ``BACKENDS`` or a callable with SDPA's
    signature, called as ``attention(q, k, v, is_causal=True)``. ``block_mask`` (an
    ``attnlab.kernels.BlockMask`` built for the longest sequence) is for ``"block_sparse"`` only;
    a shorter sequence uses its top-left corner.

    Example: ``attend = attention_backend("flash"); o = attend(q, k, v)``
    """
    if callable(attention):
        if block_mask is not None:
            raise ValueError("block_mask: only the 'block_sparse' backend takes a block mask")

        def attend(q, k, v):
            o = attention(q, k, v, is_causal=True)                       # (B, nh, T, hs)
            if not isinstance(o, torch.Tensor) or o.shape != q.shape:
                got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
                raise ValueError(f"attention: your callable must return a tensor of shape {tuple(q.shape)} "
                                 f"(B, nh, T, hs) like q, got {got}")
            return o

        return attend
    if not isinstance(attention, str) or attention not in BACKENDS:
        raise ValueError(f"attention: expected one of {BACKENDS} or a callable fn(q, k, v, is_causal=True), "
                         f"got {attention!r}")
    if (attention == "block_sparse") != (block_mask is not None):
        raise ValueError("block_mask: the 'block_sparse' backend needs a BlockMask, and only it takes one"
                         f" (attention={attention!r}, block_mask={type(block_mask).__name__})")
    if attention == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)   # (B, nh, T, hs)
    if attention == "reference":
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, causal=True)        # (B, nh, T, hs)
    from attnlab.kernels import BlockMask, block_sparse_attention, flash_attention, standard_attention

    if attention == "flash":
        return lambda q, k, v: flash_attention(q, k, v, causal=True)                     # (B, nh, T, hs)
    if attention == "standard":
        return lambda q, k, v: standard_attention(q, k, v, causal=True)                  # (B, nh, T, hs)
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected an attnlab.kernels.BlockMask, got {type(block_mask).__name__}")
    return lambda q, k, v: block_sparse_attention(q, k, v, _crop_block_mask(block_mask, q.shape[-2]),
                                                  causal=True)                            # (B, nh, T, hs)


# sinusoidal_positions lives in attnlab.positions (imported above), with the learned and rotary ones


# ---------------------------------------------------------------------------------------------
# 2. causal self-attention: attnlab's MultiHeadAttention with a pluggable attention call
# ---------------------------------------------------------------------------------------------

def _decode_attend(attention):
    """The attention of a decoding step: q (B, nh, Tn, hs), the first ``n`` positions of a cache
    k, v (B, nkv, capacity, hs) -> (B, nh, Tn, hs); query i sits at position n - Tn + i.
    ``"flash"`` runs ``flash_decode`` on the cache in place; ``"reference"`` attnlab's
    reference; every other backend torch's SDPA (a learner's callable is for whole sequences)."""
    def attend(q, k, v, n):
        Tn = q.shape[2]
        if attention == "flash":
            from attnlab.kernels import flash_decode

            lens = torch.full((q.shape[0],), n, dtype=torch.int32, device=q.device)
            return flash_decode(q, k, v, lens)                            # (B, nh, Tn, hs)
        if attention == "reference":
            lens = torch.full((q.shape[0],), n, dtype=torch.int32)
            return decode_reference(q, k, v, lens)                        # (B, nh, Tn, hs)
        k, v = k[:, :, :n], v[:, :, :n]                                   # (B, nkv, n, hs)
        mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - Tn, n, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    return attend


class CausalSelfAttention(MultiHeadAttention):
    """Multi-head causal self-attention whose ``q k^T -> softmax -> v`` step is a backend.

    forward(x (B, T, C)) -> (B, T, C). ``forward(x, return_weights=True)`` returns also the
    weights (B, nh, T, T), computed by the reference (the fused backends never form them).
    ``n_kv_heads`` (a divisor of ``n_heads``; default ``n_heads``) key/value heads, each shared
    by ``n_heads // n_kv_heads`` query heads. ``rotary``: an ``attnlab.positions.Rotary`` that
    rotates q and k by their positions before attention. ``forward(x, cache=c)`` appends the K
    and V of the new positions of x to the ``KVCache`` c (written once) and attends the new
    queries to everything cached.

    Example: ``CausalSelfAttention(64, 4, attention="flash")(torch.randn(2, 16, 64))``
    """

    def __init__(self, d_model, n_heads, attention="sdpa", block_mask=None, n_kv_heads=None, rotary=None):
        super().__init__(d_model, n_heads, bias=True)
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if self.n_kv_heads != n_heads:   # grouped-query: narrower K and V projections
            self.k_proj = nn.Linear(d_model, self.n_kv_heads * self.d_head)
            self.v_proj = nn.Linear(d_model, self.n_kv_heads * self.d_head)
        self.attend = attention_backend(attention, block_mask)
        self.decode_attend = _decode_attend(attention)
        self.block_mask = block_mask
        self.rotary = rotary

    def split_kv(self, x):
        """(B, T, nkv * hs) -> (B, nkv, T, hs)."""
        B, T, _ = x.shape
        return x.view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)

    def qkv(self, x, start=0):
        """The new positions' q (B, nh, T, hs), k and v (B, nkv, T, hs), rotated when rotary."""
        q = self.split_heads(self.q_proj(x))                              # (B, nh, T, hs)
        k = self.split_kv(self.k_proj(x))                                 # (B, nkv, T, hs)
        v = self.split_kv(self.v_proj(x))                                 # (B, nkv, T, hs)
        if self.rotary is not None:   # rotate once, here: a cached key is never rotated again
            pos = torch.arange(start, start + x.shape[1], device=x.device)   # (T,)
            q, k = self.rotary(q, pos), self.rotary(k, pos)
        return q, k, v

    def expand_kv(self, k):
        """(B, nkv, T, hs) -> (B, nh, T, hs): each KV head repeated for its group (for backends that
        take equal head counts; the decoding kernel reads the unexpanded cache)."""
        g = self.num_heads // self.n_kv_heads
        return k if g == 1 else k.repeat_interleave(g, dim=1)

    def forward(self, x, return_weights=False, cache=None):
        if cache is not None:
            start = cache.seen if isinstance(cache, RollingCache) else cache.length   # the new tokens' position
            q, k, v = self.qkv(x, start)                                  # (B, nh|nkv, Tn, hs)
            if start == 0 and not isinstance(cache, RollingCache):        # prefill: the usual causal kernel
                cache.append(k, v)
                y = self.attend(q, self.expand_kv(k), self.expand_kv(v))  # (B, nh, Tn, hs)
            else:
                cache.append(k, v)                                        # K and V written once
                y = self.decode_attend(q, cache.k, cache.v, cache.length)   # (B, nh, Tn, hs)
            return self.out_proj(self.merge_heads(y))                     # (B, Tn, C)
        q, k, v = self.qkv(x)                                             # (B, nh|nkv, T, hs)
        k, v = self.expand_kv(k), self.expand_kv(v)                       # (B, nh, T, hs)
        if not return_weights:
            y = self.attend(q, k, v)                                      # (B, nh, T, hs)
            return self.out_proj(self.merge_heads(y))                     # (B, T, C)
        T = x.shape[1]
        mask = None
        if self.block_mask is not None:                                   # the element mask of the block mask
            mask = _crop_block_mask(self.block_mask, T).to_element_mask(T, T).to(x.device)   # (1|B, 1|nh, T, T)
        y, w = scaled_dot_product_attention(q, k, v, mask=mask, causal=True, return_weights=True)  # (B, nh, T, hs)
        return self.out_proj(self.merge_heads(y)), w                      # (B, T, C), (B, nh, T, T)


# ---------------------------------------------------------------------------------------------
# 3. the block
# ---------------------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    forward(x (B, T, C)) -> (B, T, C); with ``return_weights`` also (B, nh, T, T). ``mixer``: a
    module in attn's place (same ``forward(x, return_weights=False, cache=None)``), for layouts.
    """

    def __init__(self, d_model, n_heads, d_mlp, attention="sdpa", block_mask=None, n_kv_heads=None, rotary=None,
                 mixer=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        # mixer: another layer kind in attn's place (a layout's local, selected or delta layer)
        self.attn = CausalSelfAttention(d_model, n_heads, attention, block_mask, n_kv_heads, rotary) \
            if mixer is None else mixer
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_mlp), nn.GELU(), nn.Linear(d_mlp, d_model))

    def forward(self, x, return_weights=False, cache=None):
        if cache is not None:
            x = x + self.attn(self.ln_1(x), cache=cache)                  # (B, Tn, C)
            return x + self.mlp(self.ln_2(x))
        if return_weights:
            a, w = self.attn(self.ln_1(x), return_weights=True)           # (B, T, C), (B, nh, T, T)
        else:
            a, w = self.attn(self.ln_1(x)), None                          # (B, T, C)
        x = x + a                                                         # (B, T, C) residual stream
        x = x + self.mlp(self.ln_2(x))                                    # (B, T, C)
        return (x, w) if return_weights else x


# ---------------------------------------------------------------------------------------------
# 3b. the other layer kinds of a layout (lesson 12): local, selected, delta
# ---------------------------------------------------------------------------------------------

LAYER_KINDS = ("dense", "local", "selected", "delta", "mla")


def layout_from_ratio(kind_a, n_a, kind_b, n_b, n_layers):
    """``n_a`` layers of ``kind_a`` then ``n_b`` of ``kind_b``, repeated and cut to ``n_layers``.

    Gemma 3 interleaves 5 local layers per global one (arXiv:2503.19786, its architecture section);
    Qwen3-Next 3 Gated DeltaNet layers per attention layer. A model with fewer layers than one
    period keeps only the first kind: with 4 layers write the idea as 3:1.

    Example: ``layout_from_ratio("local", 5, "dense", 1, 12)  # 5 local, 1 dense, 5 local, 1 dense``
    """
    for name, kind in (("kind_a", kind_a), ("kind_b", kind_b)):
        if kind not in LAYER_KINDS:
            raise ValueError(f"{name}: expected one of {LAYER_KINDS}, got {kind!r}")
    _check_int("n_a", n_a, 0)
    _check_int("n_b", n_b, 0)
    _check_int("n_layers", n_layers, 1)
    if n_a + n_b == 0:
        raise ValueError("n_b: expected n_a + n_b >= 1, got 0 and 0")
    period = [kind_a] * n_a + [kind_b] * n_b
    return [period[i % len(period)] for i in range(n_layers)]


def _check_layout(layout, n_layers):
    if isinstance(layout, str) or not isinstance(layout, (list, tuple)):
        raise TypeError(f"layout: expected a list of layer kinds from {LAYER_KINDS}, one per layer, "
                        f"got {type(layout).__name__}")
    if len(layout) != n_layers:
        raise ValueError(f"layout: expected n_layers={n_layers} kinds, one per layer, got {len(layout)}")
    for kind in layout:
        if kind not in LAYER_KINDS:
            raise ValueError(f"layout: expected kinds from {LAYER_KINDS}, got {kind!r}")
    return list(layout)


class LocalSelfAttention(CausalSelfAttention):
    """Causal attention to the first ``sinks`` keys and the last ``window`` keys up to the query.

    Key j is visible from query i when ``j <= i`` and (``j < sinks`` or ``i - j < window``):
    ``attnlab.mask_mods.sink_window(sinks, window)``, the keys StreamingLLM keeps (Xiao et al.
    2023) and ``attnlab.kvcache.RollingCache`` holds, so a decoding cache stops growing at
    ``sinks + window`` tokens. Gemma 3's local layers are a window without sinks (``sinks=0``).
    Training runs torch's SDPA under the element mask (``attention="reference"``: attnlab's
    reference); the projections, heads and rotary are ``CausalSelfAttention``'s.
    ``forward(x, cache=c)`` needs a ``RollingCache`` with the same sinks and window: the new
    queries attend to what it keeps plus the new keys (exact for any number of new tokens), then
    the new keys are appended and the oldest evicted.

    forward(x (B, T, C)) -> (B, T, C); with ``return_weights`` also (B, nh, T, T).
    Example: ``LocalSelfAttention(64, 4, window=16, sinks=4)(torch.randn(2, 40, 64))``
    """

    def __init__(self, d_model, n_heads, window, sinks=0, n_kv_heads=None, rotary=None, attention="sdpa"):
        super().__init__(d_model, n_heads, "sdpa", None, n_kv_heads, rotary)
        _check_int("window", window, 1)
        _check_int("sinks", sinks, 0)
        self.window, self.sinks = window, sinks
        self.mask_mod = mask_mods.sink_window(sinks, window)
        self.use_reference = attention == "reference"

    def _attend(self, q, k, v, mask):
        """q (B, nh, Tq, hs), k and v (B, nkv, Tk, hs), mask bool broadcastable to (Tq, Tk) -> (B, nh, Tq, hs)."""
        k, v = self.expand_kv(k), self.expand_kv(v)                        # (B, nh, Tk, hs)
        if self.use_reference:
            return scaled_dot_product_attention(q, k, v, mask=mask)       # (B, nh, Tq, hs)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)    # (B, nh, Tq, hs)

    def forward(self, x, return_weights=False, cache=None):
        if cache is not None:
            if not isinstance(cache, RollingCache) or (cache.sinks, cache.window) != (self.sinks, self.window):
                raise ValueError(f"cache: a local layer needs a RollingCache with sinks={self.sinks}, "
                                 f"window={self.window}, got {type(cache).__name__}")
            start, Tn = cache.seen, x.shape[1]
            q, k, v = self.qkv(x, start)                                  # (B, nh|nkv, Tn, hs)
            pos_q = torch.arange(start, start + Tn, device=x.device)      # (Tn,) the new positions
            kept = torch.tensor(cache.positions, dtype=torch.long, device=x.device)   # (kept,) what the cache holds
            pos_k = torch.cat([kept, pos_q])                              # (kept + Tn,)
            k_all = torch.cat([cache.k[:, :, :cache.length], k], dim=2)   # (B, nkv, kept + Tn, hs)
            v_all = torch.cat([cache.v[:, :, :cache.length], v], dim=2)
            mask = self.mask_mod(0, 0, pos_q[:, None], pos_k[None, :])    # (Tn, kept + Tn)
            y = self._attend(q, k_all, v_all, mask)                       # (B, nh, Tn, hs)
            cache.append(k, v)                                            # written once; the oldest evicted
            return self.out_proj(self.merge_heads(y))                     # (B, Tn, C)
        T = x.shape[1]
        q, k, v = self.qkv(x)                                             # (B, nh|nkv, T, hs)
        mask = mask_mods.create_mask(self.mask_mod, None, None, T, T, device=x.device)   # (1, 1, T, T)
        if return_weights:
            y, w = scaled_dot_product_attention(q, self.expand_kv(k), self.expand_kv(v), mask=mask,
                                                return_weights=True)      # (B, nh, T, hs), (B, nh, T, T)
            return self.out_proj(self.merge_heads(y)), w
        return self.out_proj(self.merge_heads(self._attend(q, k, v, mask)))   # (B, T, C)


class LayerInputs:
    """What a ``"selected"`` layer keeps for decoding: its inputs so far, (B, length, C).

    A selected layer decodes by recomputing itself over all its inputs (selection included) and
    keeping the new rows: exact, and as costly as the full forward. A real DSA decode keeps the
    whole KV cache plus the indexer's keys and reads only the top-k blocks
    (``attnlab.hybrids.layout_bytes`` counts those bytes); this fallback keeps the code short.
    """

    def __init__(self, batch, d_model, *, dtype=torch.float32, device="cpu"):
        self.x = torch.zeros(batch, 0, d_model, dtype=dtype, device=device)   # (B, 0, C)
        self.length = 0

    def append(self, x_new):
        """x_new (B, Tn, C) -> all inputs (B, length, C)."""
        self.x = torch.cat([self.x, x_new], dim=1)
        self.length = self.x.shape[1]
        return self.x


class SelectedSelfAttention(CausalSelfAttention):
    """Causal attention to the ``topk`` key blocks a lightning indexer scores highest (DSA's idea, NSA's blocks).

    The indexer (DeepSeek-V3.2's, arXiv:2512.02556, eq. (1)): ``index_heads`` small heads of
    ``index_dim``, its own projections of the layer input: a query per head ``q_idx`` (B, Hi, T, di),
    one shared key per token ``k_idx`` (B, T, di) and a weight per head ``w`` (B, Hi, T);
    ``attnlab.sparse.indexer_scores`` gives I[t, s] = sum_j w[t, j] ReLU(q_idx[t, j] . k_idx[s]).
    Selection: ``attnlab.sparse.indexer_block_scores`` reduces I to (query block, key block) and
    ``attnlab.sparse.select_blocks`` keeps the ``topk`` best key blocks of ``select_block``
    positions (always the diagonal block, never a future one). **One choice per query block must
    not look ahead**: a block's mean over its queries would let query t's keys depend on queries
    t+1.. of its block (the next characters, the targets), so here each query block is scored by
    its *first* query (its row repeated over the block), the latest position every query of the
    block may see. The first query sees every key of the earlier blocks; keys of the diagonal
    block only decide the diagonal block's score, which is always kept anyway.
    Attention: ``attnlab.sparse.selected_attention_reference`` (``attention="flash"``: the Triton
    kernel ``attnlab.kernels.selected_attention``), one selection shared by every head (DSA's
    MQA form), GQA allowed.

    Training the indexer (our choice, DSA's dense warm-up loss): top-k is not differentiable, so
    the language-model loss never reaches the indexer. Instead, in training mode with gradients
    on, the layer computes ``indexer_loss``: for every query t, KL(p_t || softmax(I[t, :])), where
    p_t is the layer's *dense* causal attention of t averaged over heads (detached), and the
    indexer reads a detached copy of the input, so this loss trains only the indexer and the
    indexer only learns from it. ``GPT.forward`` adds it to the loss with zero value
    (``loss + aux - aux.detach()``): the loss printed is the cross-entropy, its gradient carries both.

    forward(x (B, T, C)) -> (B, T, C); with ``return_weights`` also (B, nh, T, T), zero outside
    the selection. ``forward(x, cache=c)`` with a :class:`LayerInputs` recomputes the layer over
    everything seen (decoding falls back to full recompute).
    Example: ``SelectedSelfAttention(64, 4, topk=2, select_block=16)(torch.randn(2, 64, 64))``
    """

    def __init__(self, d_model, n_heads, topk=2, select_block=16, index_heads=2, index_dim=16, n_kv_heads=None,
                 rotary=None, attention="sdpa"):
        super().__init__(d_model, n_heads, "sdpa", None, n_kv_heads, rotary)
        from attnlab import validate

        _check_int("topk", topk, 1)
        validate.power_of_two(select_block, "select_block")   # the kernels' tile: a power of two >= 16
        _check_int("index_heads", index_heads, 1)
        _check_int("index_dim", index_dim, 1)
        self.topk, self.select_block, self.index_heads, self.index_dim = topk, select_block, index_heads, index_dim
        self.index_q = nn.Linear(d_model, index_heads * index_dim, bias=False)   # a query per indexer head
        self.index_k = nn.Linear(d_model, index_dim, bias=False)                 # one key per token
        self.index_w = nn.Linear(d_model, index_heads, bias=False)               # a weight per indexer head
        self.use_kernel = attention == "flash"
        self.indexer_loss = None

    def indexer(self, x):
        """The indexer's q_idx (B, Hi, T, di), k_idx (B, T, di) and weights (B, Hi, T) of x (B, T, C)."""
        B, T, _ = x.shape
        q_idx = self.index_q(x).view(B, T, self.index_heads, self.index_dim).transpose(1, 2)   # (B, Hi, T, di)
        return q_idx, self.index_k(x), self.index_w(x).transpose(1, 2)   # (B, T, di), (B, Hi, T)

    def select(self, q_idx, k_idx, w):
        """block_indices (B, 1, n_blocks, topk) int32: each query block's key blocks, chosen by its first query."""
        from attnlab.sparse import indexer_block_scores, select_blocks

        T, bs = q_idx.shape[2], self.select_block
        first = torch.arange(T, device=q_idx.device) // bs * bs          # (T,) the first position of t's block
        scores = indexer_block_scores(q_idx[:, :, first], k_idx, w[:, :, first], block_size=bs)   # (B, nqb, nkb)
        return select_blocks(scores, self.topk)[:, None]                  # (B, 1, nqb, topk): one selection, all heads

    def _indexer_kl(self, q, k, q_idx, k_idx, w):
        """Mean over queries of KL(dense attention over heads || softmax of the indexer's scores)."""
        from attnlab.sparse import indexer_scores

        with torch.no_grad():
            _, p = scaled_dot_product_attention(q, self.expand_kv(k), self.expand_kv(k), causal=True,
                                                return_weights=True)     # (B, nh, T, T)
            target = p.mean(1)                                            # (B, T, T) rows sum to 1
        scores = indexer_scores(q_idx, k_idx, w, causal=True)             # (B, T, T), -inf in the future
        logp = torch.log_softmax(scores, dim=-1).masked_fill(scores == float("-inf"), 0.0)   # (B, T, T)
        return F.kl_div(logp, target, reduction="sum") / (target.shape[0] * target.shape[1])

    def forward(self, x, return_weights=False, cache=None):
        from attnlab.sparse import selected_attention_reference, selected_mask

        if cache is not None:
            if not isinstance(cache, LayerInputs):
                raise ValueError(f"cache: a selected layer decodes from LayerInputs, got {type(cache).__name__}")
            Tn = x.shape[1]
            return self(cache.append(x))[:, -Tn:]                         # (B, Tn, C): the whole layer again
        self.indexer_loss = None
        q, k, v = self.qkv(x)                                             # (B, nh|nkv, T, hs)
        q_idx, k_idx, w = self.indexer(x.detach())                        # the indexer learns only from its loss
        with torch.no_grad():
            block_indices = self.select(q_idx, k_idx, w)                  # (B, 1, nqb, topk) int32
        if self.training and torch.is_grad_enabled():
            self.indexer_loss = self._indexer_kl(q.detach(), k.detach(), q_idx, k_idx, w)
        if return_weights:
            T = x.shape[1]
            mask = selected_mask(block_indices, T, T, self.select_block)  # (B, 1, T, T)
            y, wts = scaled_dot_product_attention(q, self.expand_kv(k), self.expand_kv(v), mask=mask,
                                                  return_weights=True)    # (B, nh, T, hs), (B, nh, T, T)
            return self.out_proj(self.merge_heads(y)), wts
        if self.use_kernel:
            from attnlab.kernels import selected_attention

            y = selected_attention(q, k, v, block_indices, block_size=self.select_block)   # (B, nh, T, hs)
        else:
            y = selected_attention_reference(q, k, v, block_indices, block_size=self.select_block)
        return self.out_proj(self.merge_heads(y))                         # (B, T, C)


class DeltaState:
    """A delta layer's decoding state: S (B, H, d_k, d_v) float32, the same size after any number
    of tokens (``nbytes``); ``length`` counts the tokens it has absorbed."""

    def __init__(self, batch, heads, d_k, d_v, *, device="cpu"):
        self.state = torch.zeros(batch, heads, d_k, d_v, dtype=torch.float32, device=device)
        self.length = 0

    @property
    def nbytes(self):
        return self.state.numel() * self.state.element_size()


class GatedDeltaNet(MultiHeadAttention):
    """A Gated DeltaNet layer (Yang, Kautz and Hatamizadeh, arXiv:2412.06464, ICLR 2025) in attention's place.

    Per head, with ``attnlab.linear_attention``'s gated delta rule over a d_k x d_v state::

        q_t, k_t = L2-normalised W_q x_t, W_k x_t       # unit keys: the delta rule's write is stable
        v_t      = W_v x_t
        beta_t   = sigmoid(w_beta . x_t)                # the write strength, in (0, 1)
        g_t      = -exp(A_log) * softplus(w_a . x_t + dt_bias)   # log decay <= 0, alpha_t = exp(g_t)
        o_t      = delta rule (S_t = alpha_t S_{t-1} + k_t u_t^T ...) read with q_t
        out_t    = W_o (RMSNorm(o_t) * SiLU(W_gate x_t))   # per-head norm, then an output gate

    g is Mamba-2's decay parameterisation, which Gated DeltaNet takes for its gate alpha_t (the
    paper's section 3; its reference code in flash-linear-attention writes it as above, A drawn in
    [1, 16] and softplus(dt_bias) in [0.001, 0.1] at init). Left out: the short causal convolution
    Gated DeltaNet puts on q, k and v (with it, decoding would also carry the last few inputs) and
    the SiLU on q and k. Training: ``delta_rule_chunked`` (PyTorch, differentiable); decoding: a
    :class:`DeltaState`, ``delta_rule_recurrent`` for one new token, ``delta_rule_chunked`` from
    the state for several. No positions are needed: the recurrence is causal and ordered.

    forward(x (B, T, C)) -> (B, T, C). Example: ``GatedDeltaNet(64, 4)(torch.randn(2, 40, 64))``
    """

    def __init__(self, d_model, n_heads, chunk_size=32):
        super().__init__(d_model, n_heads, bias=False)
        _check_int("chunk_size", chunk_size, 1)
        self.chunk_size = chunk_size
        self.b_proj = nn.Linear(d_model, n_heads)                        # beta per head
        self.a_proj = nn.Linear(d_model, n_heads)                        # the decay's rate per head
        self.g_proj = nn.Linear(d_model, d_model)                        # the output gate
        A = torch.empty(n_heads).uniform_(1, 16)                         # (nh,)
        dt = torch.exp(torch.empty(n_heads).uniform_(math.log(1e-3), math.log(1e-1)))   # (nh,)
        self.A_log = nn.Parameter(A.log())
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))   # softplus(dt_bias) = dt
        self.o_norm = nn.RMSNorm(self.d_head, eps=1e-5)

    def gates(self, x):
        """beta (B, nh, T) in (0, 1) and g (B, nh, T) <= 0 of x (B, T, C)."""
        beta = torch.sigmoid(self.b_proj(x)).transpose(1, 2)             # (B, nh, T)
        g = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)   # (B, T, nh)
        return beta, g.transpose(1, 2)                                    # (B, nh, T) x2

    def forward(self, x, return_weights=False, cache=None):
        from attnlab.linear_attention import delta_rule_chunked, delta_rule_recurrent

        if return_weights:
            raise ValueError("return_weights: a delta layer has no attention weights (it keeps a state, not keys)")
        q = F.normalize(self.split_heads(self.q_proj(x)), dim=-1)        # (B, nh, T, hs) unit rows
        k = F.normalize(self.split_heads(self.k_proj(x)), dim=-1)        # (B, nh, T, hs)
        v = self.split_heads(self.v_proj(x))                              # (B, nh, T, hs)
        beta, g = self.gates(x)                                           # (B, nh, T) x2
        if cache is None:
            o = delta_rule_chunked(q, k, v, beta, g, chunk_size=self.chunk_size)   # (B, nh, T, hs)
        else:
            if not isinstance(cache, DeltaState):
                raise ValueError(f"cache: a delta layer decodes from a DeltaState, got {type(cache).__name__}")
            rule = delta_rule_recurrent if x.shape[1] == 1 else delta_rule_chunked
            kwargs = {} if x.shape[1] == 1 else {"chunk_size": self.chunk_size}
            o, cache.state = rule(q, k, v, beta, g, initial_state=cache.state, output_final_state=True, **kwargs)
            cache.length += x.shape[1]
        gate = F.silu(self.split_heads(self.g_proj(x)))                   # (B, nh, T, hs)
        return self.out_proj(self.merge_heads(self.o_norm(o) * gate))     # (B, T, C)


class LatentCache:
    """An ``"mla"`` layer's decoding cache: one latent plus one rotary key per token, shared by the heads.

    ``c``: (B, 1, capacity, d_latent + d_rope), what ``attnlab.mla.MLA.latent`` makes, filled left
    to right (one buffer: the latent is the keys *and* the values of the absorbed decode, so
    ``KVCache``'s second buffer would be dead weight); ``length`` valid positions; ``writes``
    positions written (each token once); ``nbytes`` the buffer's bytes,
    ``attnlab.iomodel.mla_cache_bytes(capacity, 1, d_latent, d_rope, element size)`` per sequence.

    Example: ``cache = LatentCache(1, 128, 48 + 16); cache.append(mla.latent(x))``
    """

    def __init__(self, batch, capacity, width, *, dtype=torch.float32, device="cpu"):
        for name, val in (("batch", batch), ("capacity", capacity), ("width", width)):
            _check_int(name, val, 1)
        self.c = torch.zeros(batch, 1, capacity, width, dtype=dtype, device=device)   # (B, 1, capacity, W)
        self.length = 0
        self.writes = 0

    @property
    def capacity(self):
        return self.c.shape[2]

    @property
    def nbytes(self):
        return self.c.numel() * self.c.element_size()

    def append(self, entries):
        """entries (B, 1, Tn, W), written once at ``length ..``; returns the valid (B, 1, length, W)."""
        T = entries.shape[2]
        if entries.dim() != 4 or entries.shape[:2] != self.c.shape[:2] or entries.shape[3] != self.c.shape[3]:
            raise ValueError(f"entries: expected ({self.c.shape[0]}, 1, new tokens, {self.c.shape[3]}), "
                             f"got {tuple(entries.shape)}")
        if self.length + T > self.capacity:
            raise ValueError(f"entries: the cache holds {self.capacity} positions; {self.length} are used, "
                             f"{T} more do not fit")
        self.c[:, :, self.length:self.length + T] = entries               # written once, never again
        self.length += T
        self.writes += T
        return self.c[:, :, :self.length]                                 # (B, 1, length, W)

    def seqlens(self):
        """(B,) int32: every sequence's valid length, for ``MLA.decode_absorbed``."""
        return torch.full((self.c.shape[0],), self.length, dtype=torch.int32, device=self.c.device)


class LatentSelfAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1) as a layer kind: ``attnlab.mla.MLA``.

    ``n_heads`` heads of ``d_model // n_heads`` (plus ``d_rope`` rotary dims each); per token one
    latent of ``d_latent`` and one rotary key of ``d_rope`` shared by the heads, which is all
    decoding keeps (:class:`LatentCache`). Training, prefill (an empty cache) and
    ``return_weights`` run ``MLA.forward`` (K and V up-projected, causal); a step after the prefill
    writes the new tokens' latents once and runs ``MLA.decode_absorbed``: W_UK folded into the
    query, W_UV into the output, multi-query attention over the cache as stored
    (``attnlab.kvcache.decode_reference``; ``attention="flash"``: ``attnlab.kernels.flash_decode``,
    which needs ``d_latent + d_rope`` in 16, 32, 64, 128).

    Positions: the layer's position is its own decoupled rotary key (``MLA.rotary``, angles for
    ``max_positions``), applied whatever the model's ``positions=`` says; the model's rotary
    table (of the dense layers' head size) is not used here. The projections are bias-free (the
    paper's) and keep MLA's own initialisation, except ``w_o``, which ``GPT`` scales like every
    residual projection.

    forward(x (B, T, C)) -> (B, T, C); with ``return_weights`` also (B, nh, T, T).
    Example: ``LatentSelfAttention(64, 4, d_latent=48, d_rope=16, max_positions=128)(torch.randn(2, 40, 64))``
    """

    def __init__(self, d_model, n_heads, d_latent, d_rope, max_positions, attention="sdpa"):
        super().__init__()
        self.mla = MLA(d_model, n_heads, d_head=d_model // n_heads, d_latent=d_latent, d_rope=d_rope,
                       max_positions=max_positions)
        self.use_kernel = attention == "flash"

    @property
    def width(self):
        """Elements cached per token: d_latent + d_rope."""
        return self.mla.d_latent + self.mla.d_rope

    def forward(self, x, return_weights=False, cache=None):
        if cache is None:
            return self.mla(x, return_weights=return_weights)             # (B, T, C)[, (B, nh, T, T)]
        if not isinstance(cache, LatentCache):
            raise ValueError(f"cache: an mla layer decodes from a LatentCache, got {type(cache).__name__}")
        start = cache.length                                              # the new tokens' first position
        cache.append(self.mla.latent(x, start))                           # (B, 1, Tn, W): written once
        if start == 0:                                                    # prefill: the training form
            return self.mla(x)                                            # (B, Tn, C)
        attend = None
        if self.use_kernel:
            from attnlab.kernels import flash_decode as attend
        return self.mla.decode_absorbed(x, cache.c, cache.seqlens(), attend=attend)   # (B, Tn, C)


# ---------------------------------------------------------------------------------------------
# 4. the model
# ---------------------------------------------------------------------------------------------

def _check_int(name, value, least):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name}: expected an int >= {least}, got {value}")


class GPT(nn.Module):
    """A decoder-only transformer language model (GPT-2's layout, as in nanoGPT, without dropout).

    ``vocab_size`` tokens; at most ``block_size`` positions; ``d_model`` split over ``n_heads``
    heads; ``n_layers`` blocks with MLPs of width ``d_mlp`` (default ``4 * d_model``);
    ``positions`` "learned", "sinusoidal", "rope" (rotary, applied to q and k in every layer) or
    "none" (NoPE: no position at all; the causal mask still leaks order, Haviv et al. 2022);
    ``n_kv_heads`` key/value heads (default ``n_heads``; fewer is grouped-query attention, 1 is
    multi-query); ``attention`` one of ``BACKENDS`` or a callable
    ``fn(q, k, v, is_causal=True)``; ``block_mask`` for "block_sparse" (built for
    ``block_size`` positions); ``seed`` (optional) makes the initial weights the same every run.
    The Triton backends need a head size ``d_model // n_heads`` in 16, 32, 64 or 128.

    forward(idx (B, T) long, targets=None (B, T) long) -> (logits (B, T, V), loss or None).
    ``attention_maps(idx)`` -> (n_layers, B, nh, T, T); ``generate(idx, n)`` samples ``n`` more
    (with a KV cache: ``prefill(idx)`` then ``decode_step(token, caches)``).
    ``config`` holds the constructor's arguments (without the backend), to rebuild the model.

    ``layout`` (lesson 12): None (every layer dense, the model above exactly) or one kind per
    layer from ``LAYER_KINDS``: ``"dense"`` (causal softmax attention, this model's layer),
    ``"local"`` (:class:`LocalSelfAttention`: the last ``window`` keys plus the first ``sinks``),
    ``"selected"`` (:class:`SelectedSelfAttention`: ``topk`` key blocks of ``select_block``
    positions picked by an indexer of ``index_heads`` heads of ``index_dim``) or ``"delta"``
    (:class:`GatedDeltaNet`). ``attention`` is the dense layers' backend (``"flash"`` also runs
    the selected layers through the Triton kernel); local layers run SDPA under their mask. Every
    kind decodes with ``new_caches``/``decode_step``: a KV cache (dense), a ``RollingCache`` of
    ``sinks + window`` (local), a constant ``DeltaState`` (delta); a selected layer recomputes
    itself over its inputs (``LayerInputs``). ``attention_maps`` needs no delta layer.
    ``"mla"`` (:class:`LatentSelfAttention`, DeepSeek-V2's multi-head latent attention): a latent
    of ``d_latent`` (default ``4 * hs``, DeepSeek-V2's d_c = 4 d_h) and a rotary key of ``d_rope``
    (default ``hs // 2`` made even, its d_h^R = d_h / 2) per token, a :class:`LatentCache`, decoded
    with the up-projections absorbed. An mla layer always carries its own decoupled rotary key,
    so a model with mla layers takes ``positions`` "rope" (DeepSeek-V2's choice: rotary in every
    layer, nothing added to the embedding), "learned" or "sinusoidal" (added to the embedding as
    usual, on top of the mla layers' rotary key), but not "none" (it would not be position-free).
    Examples: ``layout=["local", "local", "local", "dense"]`` (Gemma 3's local:global, here 3:1),
    ``layout=["delta", "delta", "delta", "dense"]`` (Qwen3-Next's 3:1), ``layout_from_ratio``.

    Example: ``logits, loss = GPT(96, 64, seed=0)(x, y)``
    """

    def __init__(self, vocab_size, block_size=128, d_model=64, n_heads=4, n_layers=2, d_mlp=None,
                 positions="learned", attention="sdpa", block_mask=None, seed=None, n_kv_heads=None,
                 layout=None, window=32, sinks=4, topk=2, select_block=16, index_heads=2, index_dim=16,
                 d_latent=None, d_rope=None):
        super().__init__()
        d_mlp = 4 * d_model if d_mlp is None else d_mlp
        for name, value, least in (("vocab_size", vocab_size, 1), ("block_size", block_size, 1),
                                   ("d_model", d_model, 1), ("n_heads", n_heads, 1), ("n_layers", n_layers, 1),
                                   ("d_mlp", d_mlp, 1)):
            _check_int(name, value, least)
        if d_model % n_heads:
            raise ValueError(f"n_heads: expected a divisor of d_model={d_model}, got {n_heads}")
        if positions not in POSITIONS:
            raise ValueError(f"positions: expected one of {POSITIONS}, got {positions!r}")
        if n_kv_heads is not None:
            _check_int("n_kv_heads", n_kv_heads, 1)
            if n_heads % n_kv_heads:
                raise ValueError(f"n_kv_heads: expected a divisor of n_heads={n_heads}, got {n_kv_heads}")
        hs = d_model // n_heads
        if positions == "rope" and hs % 2:
            raise ValueError(f"positions: 'rope' rotates pairs of dims and needs an even head size, got {hs}")
        if attention in ("flash", "standard", "block_sparse") and hs not in KERNEL_HEAD_DIMS:
            raise ValueError(f"n_heads: the {attention!r} kernel needs a head size d_model // n_heads in "
                             f"{KERNEL_HEAD_DIMS}, got {d_model} // {n_heads} = {hs}")
        if layout is not None:
            layout = _check_layout(layout, n_layers)
            if block_mask is not None and any(kind != "dense" for kind in layout):
                raise ValueError("block_mask: only a layout of dense layers takes a block mask (local layers "
                                 "have their own window)")
        has_mla = layout is not None and "mla" in layout
        if has_mla:
            if positions == "none":
                raise ValueError("positions: mla layers carry their own rotary key, so a model with them is not "
                                 "position-free; use 'rope', 'learned' or 'sinusoidal', not 'none'")
            d_latent = 4 * hs if d_latent is None else d_latent
            d_rope = max(2, hs // 2 // 2 * 2) if d_rope is None else d_rope
            _check_int("d_latent", d_latent, 1)
            _check_int("d_rope", d_rope, 2)
            if d_rope % 2:
                raise ValueError(f"d_rope: expected an even number (rotary dims turn in pairs), got {d_rope}")
            if attention == "flash" and d_latent + d_rope not in KERNEL_HEAD_DIMS:
                raise ValueError(f"d_latent: the 'flash' decode of mla layers needs d_latent + d_rope in "
                                 f"{KERNEL_HEAD_DIMS}, got {d_latent} + {d_rope}")
        if seed is not None:
            _check_int("seed", seed, 0)
            rng_state = torch.random.get_rng_state()
            torch.manual_seed(seed)
        self.config = dict(vocab_size=vocab_size, block_size=block_size, d_model=d_model, n_heads=n_heads,
                           n_layers=n_layers, d_mlp=d_mlp, positions=positions)
        if n_kv_heads is not None and n_kv_heads != n_heads:   # absent by default: lesson 09's config unchanged
            self.config["n_kv_heads"] = n_kv_heads
        self.layout = layout
        if layout is not None:   # absent without a layout, like n_kv_heads
            self.config.update(layout=list(layout), window=window, sinks=sinks, topk=topk, select_block=select_block,
                               index_heads=index_heads, index_dim=index_dim)
            self.window, self.sinks = window, sinks
        if has_mla:   # absent without mla layers: the other layouts' configs unchanged
            self.config.update(d_latent=d_latent, d_rope=d_rope)
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.vocab_size, self.block_size, self.n_layers, self.n_heads = vocab_size, block_size, n_layers, n_heads
        self.attention = attention
        self.tok_emb = nn.Embedding(vocab_size, d_model)                  # (V, C)
        if positions == "learned":
            self.pos_emb = nn.Embedding(block_size, d_model)              # (block_size, C)
        elif positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_positions(block_size, d_model), persistent=False)
        rotary = Rotary(hs, block_size) if positions == "rope" else None   # one rotation table, shared by the layers
        if layout is None:
            self.blocks = nn.ModuleList(Block(d_model, n_heads, d_mlp, attention, block_mask, n_kv_heads, rotary)
                                        for _ in range(n_layers))
        else:
            self.blocks = nn.ModuleList(
                Block(d_model, n_heads, d_mlp, attention, block_mask, n_kv_heads, rotary,
                      mixer=self._mixer(kind, d_model, n_heads, n_kv_heads, rotary, attention))
                for kind in layout)
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)         # (V, C) weight
        self.lm_head.weight = self.tok_emb.weight                         # weight tying: one (V, C) matrix
        self.apply(self._init_weights)
        for block in self.blocks:   # GPT-2: residual projections scaled by 1/sqrt(2 n_layers)
            out = block.attn.mla.w_o if isinstance(block.attn, LatentSelfAttention) else block.attn.out_proj.weight
            for weight in (out, block.mlp[2].weight):
                nn.init.normal_(weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))
        if seed is not None:
            torch.random.set_rng_state(rng_state)   # seeding the model leaves the caller's stream alone

    def _mixer(self, kind, d_model, n_heads, n_kv_heads, rotary, attention):
        """The attention-like module of one layer of a layout (None: a dense layer, made by Block)."""
        c = self.config
        if kind == "local":
            return LocalSelfAttention(d_model, n_heads, c["window"], c["sinks"], n_kv_heads, rotary, attention)
        if kind == "selected":
            return SelectedSelfAttention(d_model, n_heads, c["topk"], c["select_block"], c["index_heads"],
                                         c["index_dim"], n_kv_heads, rotary, attention)
        if kind == "delta":
            return GatedDeltaNet(d_model, n_heads)
        if kind == "mla":
            return LatentSelfAttention(d_model, n_heads, c["d_latent"], c["d_rope"], self.block_size, attention)
        return None

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_attention(self, attention, block_mask=None):
        """Swap every layer's attention for another backend (the weights stay). Returns ``self``.
        In a layout: the dense layers'; "flash" also runs the selected layers through the Triton
        kernel, "reference" the local layers through attnlab's reference, "flash" the mla layers' absorbed
        decode through ``flash_decode``; delta layers stay as they are.

        Example: ``model.set_attention("flash")``
        """
        hs = self.config["d_model"] // self.n_heads
        if attention in ("flash", "standard", "block_sparse") and hs not in KERNEL_HEAD_DIMS:
            raise ValueError(f"attention: the {attention!r} kernel needs a head size in {KERNEL_HEAD_DIMS}, got {hs}")
        if attention == "flash" and any(isinstance(b.attn, LatentSelfAttention) and b.attn.width not in KERNEL_HEAD_DIMS
                                        for b in self.blocks):
            raise ValueError(f"attention: the 'flash' decode of mla layers needs d_latent + d_rope in "
                             f"{KERNEL_HEAD_DIMS}, got {self.config['d_latent']} + {self.config['d_rope']}")
        for block in self.blocks:
            if type(block.attn) is not CausalSelfAttention:   # a layout's local, selected or delta layer
                if isinstance(block.attn, SelectedSelfAttention):
                    block.attn.use_kernel = attention == "flash"
                elif isinstance(block.attn, LocalSelfAttention):
                    block.attn.use_reference = attention == "reference"
                elif isinstance(block.attn, LatentSelfAttention):
                    block.attn.use_kernel = attention == "flash"
                continue
            block.attn.attend = attention_backend(attention, block_mask)
            block.attn.decode_attend = _decode_attend(attention)
            block.attn.block_mask = block_mask
        self.attention = attention
        return self

    def _check_idx(self, idx, name="idx"):
        if not isinstance(idx, torch.Tensor) or idx.dtype != torch.long or idx.dim() != 2:
            what = f"{idx.dtype} tensor of shape {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) \
                else type(idx).__name__
            raise TypeError(f"{name}: expected a (batch, seq) long tensor, got {what}")
        if idx.shape[1] > self.block_size:
            raise ValueError(f"{name}: expected at most block_size={self.block_size} positions, got {idx.shape[1]}")
        if idx.shape[1] == 0:
            raise ValueError(f"{name}: expected at least one position, got shape {tuple(idx.shape)}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.vocab_size):
            raise ValueError(f"{name}: expected ids in [0, {self.vocab_size}), got [{int(idx.min())}, {int(idx.max())}]")

    def embed(self, idx, start=0):
        """Token embedding plus position: idx (B, T) long at positions start.. -> x (B, T, C).
        Rotary positions are not added here: every attention layer rotates q and k."""
        T = idx.shape[1]
        pos = torch.arange(start, start + T, device=idx.device)           # (T,)
        tok = self.tok_emb(idx)                                           # (B, T, C)
        if self.config["positions"] == "learned":
            return tok + self.pos_emb(pos)                                # (B, T, C)
        if self.config["positions"] in ("rope", "none"):
            return tok                                                    # (B, T, C): nothing added
        return tok + self.pos_table[start:start + T]                      # (B, T, C)

    def forward(self, idx, targets=None):
        self._check_idx(idx)
        x = self.embed(idx)                                               # (B, T, C)
        for block in self.blocks:
            x = block(x)                                                  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))                               # (B, T, V)
        if targets is None:
            return logits, None
        if not isinstance(targets, torch.Tensor) or targets.shape != idx.shape or targets.dtype != torch.long:
            got = f"{targets.dtype} {tuple(targets.shape)}" if isinstance(targets, torch.Tensor) else type(targets).__name__
            raise ValueError(f"targets: expected a long tensor of shape {tuple(idx.shape)} like idx, got {got}")
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))   # scalar
        if self.layout is not None:
            aux = [b.attn.indexer_loss for b in self.blocks
                   if isinstance(b.attn, SelectedSelfAttention) and b.attn.indexer_loss is not None]
            if aux:   # the selected layers' indexer losses: in the gradient, not in the value
                aux = torch.stack(aux).sum()
                loss = loss + (aux - aux.detach())
        return logits, loss

    @torch.no_grad()
    def attention_maps(self, idx):
        """Every head's attention weights on ``idx``: (n_layers, B, nh, T, T), from the reference.

        Example: ``maps = model.attention_maps(x[:1])  # AttentionMap(maps[:, 0])``
        """
        self._check_idx(idx)
        x = self.embed(idx)                                               # (B, T, C)
        maps = []
        for block in self.blocks:
            x, w = block(x, return_weights=True)                          # (B, T, C), (B, nh, T, T)
            maps.append(w)
        return torch.stack(maps)                                          # (L, B, nh, T, T)

    def new_caches(self, batch, *, sinks=None, window=None):
        """One empty KV cache per layer, room for ``block_size`` positions: ``KVCache`` of
        (batch, n_kv_heads, block_size, hs); with ``window``, StreamingLLM's ``RollingCache``
        that keeps the first ``sinks`` (default 0) tokens and the last ``window``.
        With a ``layout``, one per layer by its kind: ``KVCache`` (dense), ``RollingCache`` of the
        model's sinks and window (local), ``LayerInputs`` (selected), ``DeltaState`` (delta),
        ``LatentCache`` of (batch, 1, block_size, d_latent + d_rope) (mla).

        Example: ``caches = model.new_caches(1)``
        """
        p = self.tok_emb.weight
        hs = self.config["d_model"] // self.n_heads
        if self.layout is not None:
            if window is not None or sinks is not None:
                raise ValueError("window: a layout's local layers keep their own window and sinks (the model's "
                                 f"window={self.window}, sinks={self.sinks}); pass neither")
            return [self._layer_cache(block.attn, batch, hs, p) for block in self.blocks]
        if window is not None:
            return [RollingCache(batch, self.n_kv_heads, hs, sinks=sinks or 0, window=window, dtype=p.dtype,
                                 device=p.device) for _ in self.blocks]
        return [KVCache(batch, self.n_kv_heads, self.block_size, hs, dtype=p.dtype, device=p.device)
                for _ in self.blocks]

    def _layer_cache(self, layer, batch, hs, p):
        """One layer's decoding cache in a layout: by kind (see ``new_caches``)."""
        if isinstance(layer, LocalSelfAttention):
            return RollingCache(batch, self.n_kv_heads, hs, sinks=layer.sinks, window=layer.window, dtype=p.dtype,
                                device=p.device)
        if isinstance(layer, SelectedSelfAttention):
            return LayerInputs(batch, self.config["d_model"], dtype=p.dtype, device=p.device)
        if isinstance(layer, GatedDeltaNet):
            return DeltaState(batch, self.n_heads, hs, hs, device=p.device)
        if isinstance(layer, LatentSelfAttention):
            return LatentCache(batch, self.block_size, layer.width, dtype=p.dtype, device=p.device)
        return KVCache(batch, self.n_kv_heads, self.block_size, hs, dtype=p.dtype, device=p.device)

    @torch.no_grad()
    def decode_step(self, idx, caches):
        """The logits of the new tokens ``idx`` (B, Tn) after what ``caches`` hold: each layer writes
        the new tokens' K and V to its cache (once) and attends their queries to the whole cache.
        An empty cache makes this the prefill. Returns logits (B, Tn, V).

        Example: ``caches = model.new_caches(1); model.decode_step(prompt, caches); model.decode_step(nxt, caches)``
        """
        start = caches[0].seen if isinstance(caches[0], RollingCache) else caches[0].length
        if self.config["positions"] != "rope" and start + idx.shape[1] > self.block_size:
            raise ValueError(f"idx: {self.config['positions']} positions stop at block_size={self.block_size}; "
                             f"{start} cached + {idx.shape[1]} new do not fit")
        if self.layout is not None:   # every kind of layer takes several new tokens at once
            x = self.embed(idx, start)                                    # (B, Tn, C)
            for block, cache in zip(self.blocks, caches):
                x = block(x, cache=cache)                                  # (B, Tn, C)
            return self.lm_head(self.ln_f(x))                             # (B, Tn, V)
        if isinstance(caches[0], RollingCache) and idx.shape[1] > 1:    # a rolling cache evicts as it goes:
            for t in range(idx.shape[1]):                                 # feed it one token at a time
                logits = self.decode_step(idx[:, t:t + 1], caches)
            return logits                                                 # (B, 1, V): the last token's
        x = self.embed(idx, start)                                        # (B, Tn, C)
        for block, cache in zip(self.blocks, caches):
            x = block(x, cache=cache)                                     # (B, Tn, C)
        return self.lm_head(self.ln_f(x))                                 # (B, Tn, V)

    def prefill(self, idx):
        """New caches filled with the prompt ``idx`` (B, T0): returns (logits (B, T0, V), caches)."""
        self._check_idx(idx)
        caches = self.new_caches(idx.shape[0])
        return self.decode_step(idx, caches), caches

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None, kv_cache=True):
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T0), one at a time; returns (B, T0 + n).

        ``temperature`` scales the logits; ``top_k`` keeps the k likeliest; ``generator`` seeds the draws.
        ``kv_cache=True`` (default): the prompt is run once (``prefill``), then every step feeds only
        the newest token (``decode_step``), whose K and V are written once per layer; the tokens are
        those of ``kv_cache=False``, which recomputes the whole context at every step. Past
        ``block_size`` positions the context is a sliding window whose positions shift every step,
        so both paths recompute the window there.
        Example: ``model.generate(encode("def ")[None], 200, generator=torch.Generator().manual_seed(0))``
        """
        self._check_idx(idx)
        _check_int("max_new_tokens", max_new_tokens, 0)
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature <= 0:
            raise ValueError(f"temperature: expected a positive number, got {temperature!r}")
        if top_k is not None:
            _check_int("top_k", top_k, 1)
        if not isinstance(kv_cache, bool):
            raise TypeError(f"kv_cache: expected a bool, got {type(kv_cache).__name__}")
        caches = None
        for _ in range(max_new_tokens):
            if kv_cache and idx.shape[1] <= self.block_size:
                if caches is None:
                    logits, caches = self.prefill(idx)                    # (B, T0, V): the prompt, once
                else:
                    logits = self.decode_step(idx[:, -1:], caches)        # (B, 1, V): the newest token only
            else:
                context = idx[:, -self.block_size:]                       # (B, <= block_size)
                logits, _ = self(context)                                 # (B, T, V)
            logits = logits[:, -1, :] / temperature                       # (B, V) the next token's
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]   # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))  # (B, V)
            probs = torch.softmax(logits, dim=-1)                         # (B, V)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)   # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)                            # (B, T + 1)
        return idx

    def num_parameters(self):
        """Number of trainable parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
