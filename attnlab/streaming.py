"""StreamingLLM as the paper does it: a rolling cache of sinks and a window, with positions numbered within the cache.

Xiao et al. (2023, "Efficient Streaming Language Models with Attention Sinks", section 3.2)
keep the first ``sinks`` tokens and the last ``window`` ones, and evict the rest. What makes
it run far past the training length is how they number positions: "when determining the
relative distance and adding positional information to tokens, StreamingLLM focuses on
positions *within the cache* rather than those *in the original text*." With rotary positions
they cache the keys *before* the rotation and rotate the whole cache again at every decoding
step, with positions ``0 .. sinks + window - 1``, so every query-key offset stays below the
cache's size, inside the range the model was trained on.

``attnlab.kvcache.RollingCache`` (what ``GPT.new_caches(sinks=..., window=...)`` gives) keeps
the *original* positions instead: its keys were rotated once, when written, at their place in
the text. For the window's keys that makes no difference (a rotation by a common shift leaves
every offset, hence every score, unchanged: RoPE's relative property, lesson 10 section 7), but
a sink at position 0 seen from position ``t`` sits at offset ``t``, which grows without bound.

* :class:`StreamingCache`: a ``RollingCache`` that holds keys before rotation, with
  ``cache_positions(renumber)`` (within the cache, or original) and ``rotated_keys``;
* :func:`streaming_attend`: the newest query against such a cache, both rotated by
  positions within the cache (the paper) or in the text;
* :func:`streaming_losses`: a rotary ``attnlab.models.gpt.GPT`` run token by token past its
  window under four caches (dense, window, sinks + window with original positions, sinks +
  window re-rotated) -> the loss at every position, for lesson 10's plot.

Shapes: raw (unrotated) keys and values (B, H_kv, T, D); q (B, H_q, 1, D).

Example::

    cache = StreamingCache(1, 2, 16, sinks=4, window=28)
    cache.append(k_raw, v)                            # (1, 2, 1, 16) each, keys NOT rotated
    o = streaming_attend(q_raw, cache, renumber=True) # (1, H_q, 1, 16)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab import validate
from attnlab.kvcache import RollingCache, decode_reference
from attnlab.positions import apply_rope, rope_angles

__all__ = ["StreamingCache", "streaming_attend", "VARIANTS", "streaming_losses"]


class StreamingCache(RollingCache):
    """StreamingLLM's rolling cache (``sinks`` first tokens, the last ``window``) holding keys
    *before* rotary positions are applied, so they can be rotated by any numbering.

    ``append(k_raw, v)`` (B, H_kv, T, D) as ``RollingCache.append``; ``positions`` lists the
    original positions kept. ``cache_positions(renumber=True)`` -> (length,) long: ``0 .. length - 1``
    (within the cache, the paper's numbering) or, with ``renumber=False``, the original ones.

    Example: ``cache = StreamingCache(1, 2, 16, sinks=4, window=60)``
    """

    def cache_positions(self, renumber=True):
        validate.flag(renumber, "renumber")
        if renumber:
            return torch.arange(self.length, device=self.k.device)                  # (L,) 0 .. L - 1
        return torch.tensor(self.positions, dtype=torch.long, device=self.k.device)   # (L,) in the text

    def rotated_keys(self, renumber=True, angles=None):
        """The kept keys rotated by :meth:`cache_positions`: (B, H_kv, length, D). Computed again at
        every step (the paper's "apply position transformation to the keys in the rolling KV cache").
        ``angles``: (cos, sin) of ``attnlab.positions.rope_angles`` covering the positions (default:
        computed here, base 10000 as ``attnlab.positions.Rotary``)."""
        pos = self.cache_positions(renumber)                                  # (L,)
        cos, sin = _angles(angles, int(pos.max()) + 1, self.k.shape[-1])      # (>= max pos + 1, D/2)
        k = self.k[:, :, :self.length]                                        # (B, H_kv, L, D) unrotated
        return apply_rope(k, cos[pos].to(k.device), sin[pos].to(k.device))   # (B, H_kv, L, D)


def _angles(angles, n, head_dim):
    if angles is None:
        return rope_angles(n, head_dim)
    if angles[0].shape[0] < n:
        raise ValueError(f"angles: expected rotations for at least {n} positions, got {angles[0].shape[0]}")
    return angles


def streaming_attend(q, cache, *, renumber=True, scale=None, angles=None):
    """The newest token's attention over a :class:`StreamingCache` that already holds its key and value.

    q (B, H_q, 1, D), not rotated: it is rotated at the last of ``cache.cache_positions(renumber)``
    (``length - 1`` within the cache, or its original position), the keys by theirs, and every
    kept key is visible. Returns (B, H_q, 1, D), computed by ``attnlab.kvcache.decode_reference``
    (grouped-query heads: ``H_q`` a multiple of ``H_kv``). ``angles``: precomputed (cos, sin) of
    ``rope_angles`` covering the positions (default: computed at each call).

    Example: ``o = streaming_attend(q, cache, renumber=True)``
    """
    validate.tensor(q, "q", 4, "(batch, heads, 1, head_dim)", floating=True)
    if not isinstance(cache, StreamingCache):
        raise TypeError(f"cache: expected a StreamingCache (keys kept before rotation), got {type(cache).__name__}")
    if q.shape[2] != 1:
        raise ValueError(f"q: expected one new query (dim 2), got shape {tuple(q.shape)}")
    if cache.length == 0:
        raise ValueError("cache: expected the new token's key and value appended already, got an empty cache")
    pos = cache.cache_positions(renumber)                                     # (L,)
    cos, sin = _angles(angles, int(pos.max()) + 1, q.shape[-1])
    last = pos[-1:]                                                           # (1,) the newest token's position
    q_rot = apply_rope(q, cos[last].to(q.device), sin[last].to(q.device))    # (B, H_q, 1, D)
    k_rot = cache.rotated_keys(renumber, (cos, sin))                          # (B, H_kv, L, D)
    lens = torch.full((q.shape[0],), cache.length, dtype=torch.int32)
    return decode_reference(q_rot, k_rot, cache.v[:, :, :cache.length], lens, scale=scale)   # (B, H_q, 1, D)


# the caches streaming_losses compares (see its docstring)
VARIANTS = ("dense", "window", "sinks + window, original positions", "sinks + window, re-rotated")


def _variant(name, sinks, window, n):
    if name == "dense":
        return 0, n, False                    # nothing evicted; positions in the text, past the trained range
    if name == "window":
        return 0, window, True                # no sinks: the numbering cannot matter (every offset < window)
    return sinks, window, name.endswith("re-rotated")


def _rotary_step(model, tok, caches, renumber, angles):
    """One token (B, 1) through a rotary GPT whose layers attend over StreamingCaches: the GPT's
    own projections, LayerNorms and MLPs, with the rotation done by ``streaming_attend``."""
    x = model.embed(tok)                                                      # (B, 1, C): rotary adds nothing here
    for block, cache in zip(model.blocks, caches):
        attn = block.attn
        h = block.ln_1(x)                                                     # (B, 1, C)
        q = attn.split_heads(attn.q_proj(h))                                  # (B, nh, 1, hs), not rotated
        k = attn.split_kv(attn.k_proj(h))                                     # (B, nkv, 1, hs), not rotated
        v = attn.split_kv(attn.v_proj(h))
        cache.append(k, v)                                                    # evicts what left the window
        y = streaming_attend(q, cache, renumber=renumber, angles=angles)      # (B, nh, 1, hs)
        x = x + attn.out_proj(attn.merge_heads(y))                            # (B, 1, C)
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x))[:, -1]                               # (B, V)


@torch.no_grad()
def streaming_losses(model, idx, *, sinks=4, window=32, variants=VARIANTS):
    """Run a rotary GPT (``positions="rope"``) over ``idx`` (B, T) one token at a time, T possibly
    far past its ``block_size``, under each cache of ``variants`` (names from :data:`VARIANTS`):

    * ``"dense"``: every token kept, positions in the text (past the trained range after block_size);
    * ``"window"``: the last ``window`` tokens only;
    * ``"sinks + window, original positions"``: the first ``sinks`` and the last ``window``,
      rotated at their places in the text (``attnlab.kvcache.RollingCache``'s numbering);
    * ``"sinks + window, re-rotated"``: the same tokens numbered 0 .. sinks + window - 1 within
      the cache, keys rotated again at every step (Xiao et al. 2023, section 3.2).

    Returns {name: (B, T - 1) tensor}: the loss (nats) of predicting token t + 1 at position t.
    The model's own weights and layers; attention is ``attnlab.kvcache.decode_reference``.

    Example: ``losses = streaming_losses(model, idx, sinks=4, window=28); losses["window"].mean(0)``
    """
    from attnlab.models.gpt import GPT

    if not isinstance(model, GPT):
        raise TypeError(f"model: expected an attnlab.models.gpt.GPT, got {type(model).__name__}")
    if model.config["positions"] != "rope":
        raise ValueError(f"model: expected rotary positions (positions='rope'), which can be numbered anew; "
                         f"got positions={model.config['positions']!r}")
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.long or idx.dim() != 2 or idx.shape[1] < 2:
        what = (f"{idx.dtype} tensor of shape {tuple(idx.shape)}" if isinstance(idx, torch.Tensor)
                else type(idx).__name__)
        raise TypeError(f"idx: expected a (batch, seq >= 2) long tensor, got {what}")
    validate.integer(sinks, "sinks", minimum=0)
    validate.integer(window, "window")
    for name in variants:
        validate.one_of(name, "variants", VARIANTS)
    B, T = idx.shape
    hs = model.config["d_model"] // model.n_heads
    p = model.tok_emb.weight
    cos, sin = rope_angles(T, hs)                                             # every position's rotation, once
    angles = (cos.to(p.device), sin.to(p.device))
    out = {}
    for name in variants:
        s, w, renumber = _variant(name, sinks, window, T)
        caches = [StreamingCache(B, model.n_kv_heads, hs, sinks=s, window=w, dtype=p.dtype, device=p.device)
                  for _ in model.blocks]
        losses = []
        for t in range(T - 1):
            logits = _rotary_step(model, idx[:, t:t + 1], caches, renumber, angles)  # (B, V)
            losses.append(F.cross_entropy(logits.float(), idx[:, t + 1], reduction="none"))   # (B,)
        out[name] = torch.stack(losses, dim=1)                                # (B, T - 1)
    return out
