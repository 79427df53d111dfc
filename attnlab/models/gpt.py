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
   inside attention), the blocks, a final LayerNorm and a read-out that shares its weights with
   the token embedding (weight tying, Press and Wolf 2017), cross-entropy on the next token.
   ``generate`` decodes with a KV cache per layer by default (``prefill`` then ``decode_step``):
   each token's K and V are computed and written once, and only the newest query attends;
   with ``attention="flash"`` that step runs ``attnlab.kernels.flash_decode``.

Shapes: B batch, T positions, C = d_model, nh heads, hs = C // nh head size, V vocabulary.

Example::

    model = GPT(vocab_size=96, block_size=64, d_model=64, n_heads=4, n_layers=2, attention="flash", seed=0)
    logits, loss = model(x, y)                 # x, y: (B, T) long
    text_ids = model.generate(x[:1, :8], 100)  # (1, 108)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.attention import MultiHeadAttention, scaled_dot_product_attention
from attnlab.kvcache import KVCache, RollingCache, decode_reference
from attnlab.positions import Rotary, sinusoidal_positions

__all__ = ["BACKENDS", "POSITIONS", "attention_backend", "sinusoidal_positions", "CausalSelfAttention", "Block",
           "GPT"]

BACKENDS = ("sdpa", "reference", "flash", "standard", "block_sparse")
POSITIONS = ("learned", "sinusoidal", "rope")
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

    forward(x (B, T, C)) -> (B, T, C); with ``return_weights`` also (B, nh, T, T).
    """

    def __init__(self, d_model, n_heads, d_mlp, attention="sdpa", block_mask=None, n_kv_heads=None, rotary=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, attention, block_mask, n_kv_heads, rotary)
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
    ``positions`` "learned", "sinusoidal" or "rope" (rotary, applied to q and k in every layer);
    ``n_kv_heads`` key/value heads (default ``n_heads``; fewer is grouped-query attention, 1 is
    multi-query); ``attention`` one of ``BACKENDS`` or a callable
    ``fn(q, k, v, is_causal=True)``; ``block_mask`` for "block_sparse" (built for
    ``block_size`` positions); ``seed`` (optional) makes the initial weights the same every run.
    The Triton backends need a head size ``d_model // n_heads`` in 16, 32, 64 or 128.

    forward(idx (B, T) long, targets=None (B, T) long) -> (logits (B, T, V), loss or None).
    ``attention_maps(idx)`` -> (n_layers, B, nh, T, T); ``generate(idx, n)`` samples ``n`` more
    (with a KV cache: ``prefill(idx)`` then ``decode_step(token, caches)``).
    ``config`` holds the constructor's arguments (without the backend), to rebuild the model.

    Example: ``logits, loss = GPT(96, 64, seed=0)(x, y)``
    """

    def __init__(self, vocab_size, block_size=128, d_model=64, n_heads=4, n_layers=2, d_mlp=None,
                 positions="learned", attention="sdpa", block_mask=None, seed=None, n_kv_heads=None):
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
        if seed is not None:
            _check_int("seed", seed, 0)
            rng_state = torch.random.get_rng_state()
            torch.manual_seed(seed)
        self.config = dict(vocab_size=vocab_size, block_size=block_size, d_model=d_model, n_heads=n_heads,
                           n_layers=n_layers, d_mlp=d_mlp, positions=positions)
        if n_kv_heads is not None and n_kv_heads != n_heads:   # absent by default: lesson 09's config unchanged
            self.config["n_kv_heads"] = n_kv_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.vocab_size, self.block_size, self.n_layers, self.n_heads = vocab_size, block_size, n_layers, n_heads
        self.attention = attention
        self.tok_emb = nn.Embedding(vocab_size, d_model)                  # (V, C)
        if positions == "learned":
            self.pos_emb = nn.Embedding(block_size, d_model)              # (block_size, C)
        elif positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_positions(block_size, d_model), persistent=False)
        rotary = Rotary(hs, block_size) if positions == "rope" else None   # one rotation table, shared by the layers
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_mlp, attention, block_mask, n_kv_heads, rotary)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)         # (V, C) weight
        self.lm_head.weight = self.tok_emb.weight                         # weight tying: one (V, C) matrix
        self.apply(self._init_weights)
        for block in self.blocks:   # GPT-2: residual projections scaled by 1/sqrt(2 n_layers)
            for proj in (block.attn.out_proj, block.mlp[2]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))
        if seed is not None:
            torch.random.set_rng_state(rng_state)   # seeding the model leaves the caller's stream alone

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

        Example: ``model.set_attention("flash")``
        """
        hs = self.config["d_model"] // self.n_heads
        if attention in ("flash", "standard", "block_sparse") and hs not in KERNEL_HEAD_DIMS:
            raise ValueError(f"attention: the {attention!r} kernel needs a head size in {KERNEL_HEAD_DIMS}, got {hs}")
        for block in self.blocks:
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
        if self.config["positions"] == "rope":
            return tok                                                    # (B, T, C)
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

        Example: ``caches = model.new_caches(1)``
        """
        p = self.tok_emb.weight
        hs = self.config["d_model"] // self.n_heads
        if window is not None:
            return [RollingCache(batch, self.n_kv_heads, hs, sinks=sinks or 0, window=window, dtype=p.dtype,
                                 device=p.device) for _ in self.blocks]
        return [KVCache(batch, self.n_kv_heads, self.block_size, hs, dtype=p.dtype, device=p.device)
                for _ in self.blocks]

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
