"""Multi-head latent attention (MLA, DeepSeek-V2, arXiv:2405.04434, section 2.1): cache one latent per token.

Multi-head attention caches every head's key and value, ``2 x heads x d_head`` numbers per token and
layer. MLA caches instead one low-rank **latent** ``c = W_DKV h`` of ``d_latent`` numbers per token,
from which every head's key and value are *up-projected*, ``k_i = W_UK_i c`` and ``v_i = W_UV_i c``,
plus one small rotary key ``k_R`` of ``d_rope`` numbers shared by all heads (a rotation cannot pass
through ``W_UK``, so position lives in this "decoupled" part; DeepSeek-V2 section 2.1.3). Head ``i``'s
query is ``[q_C_i ; R q_R_i]`` and its key ``[W_UK_i c ; R k_R]``, of width ``d_head + d_rope``.

Two ways to decode with that cache, exactly equal:

* **unabsorbed** (:meth:`MLA.decode_unabsorbed`): up-project the cached latents to per-head K and V,
  then ordinary multi-head attention: ``heads x L x (2 d_head + d_rope)`` numbers made per step;
* **absorbed** (:meth:`MLA.decode_absorbed`): ``q_C_i . (W_UK_i c_j) = (W_UK_i^T q_C_i) . c_j``, so
  fold ``W_UK_i`` into the query, and ``sum_j p_ij W_UV_i c_j = W_UV_i (sum_j p_ij c_j)``, so fold
  ``W_UV_i`` into the output projection. Attention then runs over the cache **as it is**: multi-query
  attention with one "KV head" ``[c ; R k_R]`` of width ``d_latent + d_rope``, read as the keys *and*
  the values (the first ``d_latent`` columns of the output are the attended latent). Any decoding
  attention serves: ``attnlab.kvcache.decode_reference`` or the Triton kernel
  ``attnlab.kernels.flash_decode`` (its head sizes: 16, 32, 64, 128).

Not modelled: DeepSeek-V2 also compresses the queries (``d_c' = 1536``) to save activation memory
in training; here the query projection is a plain ``nn.Linear``. The bias-free projections follow
the paper. The cache's bytes: ``attnlab.iomodel.mla_cache_bytes`` (against ``kv_cache_bytes``).

Shapes: x (B, T, C); q heads (B, H, T, d_head [+ d_rope]); the cache (B, 1, S, d_latent + d_rope),
positions ``0 .. S-1`` valid up to ``cache_seqlens`` (B,) int32.

Example::

    mla = MLA(64, 4, d_head=16, d_latent=48, d_rope=16, max_positions=128, seed=0)
    y = mla(x)                                             # (B, T, 64), causal, training form
    cache = mla.latent(x)                                  # (B, 1, T, 64): what decoding keeps
    lens = torch.full((B,), T, dtype=torch.int32)
    y_last = mla.decode_absorbed(x[:, -1:], cache, lens)   # == y[:, -1:]
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab import validate
from attnlab.attention import scaled_dot_product_attention
from attnlab.iomodel import mla_cache_bytes
from attnlab.kvcache import decode_reference
from attnlab.positions import Rotary

__all__ = ["MLA"]


class MLA(nn.Module):
    """Multi-head latent attention with a decoupled rotary key (DeepSeek-V2, arXiv:2405.04434, section 2.1).

    ``d_model`` inputs; ``n_heads`` heads of ``d_head``; latent ``d_latent`` (the paper's d_c) and
    rotary width ``d_rope`` (d_h^R, even) per token; rotary angles for ``max_positions`` positions.
    Weights: ``w_dkv`` (C -> d_latent), ``w_kr`` (C -> d_rope), ``w_q`` (C -> H (d_head + d_rope)),
    ``w_uk`` and ``w_uv`` (H, d_head, d_latent), ``w_o`` (H d_head -> C). Scale
    ``(d_head + d_rope) ** -0.5`` unless given.

    forward(x (B, T, C)) -> (B, T, C), causal, K and V up-projected (training and prefill).
    ``latent(x, start)`` -> (B, 1, T, d_latent + d_rope): the cache entries of x's positions.
    ``decode_unabsorbed`` / ``decode_absorbed(x_new, cache, cache_seqlens)`` -> (B, Tn, C).

    Example: ``MLA(64, 4, d_head=16, d_latent=48, d_rope=16, max_positions=128)(torch.randn(2, 10, 64))``
    """

    def __init__(self, d_model, n_heads, *, d_head, d_latent, d_rope, max_positions, scale=None, seed=None):
        super().__init__()
        for name, val in (("d_model", d_model), ("n_heads", n_heads), ("d_head", d_head), ("d_latent", d_latent),
                          ("d_rope", d_rope), ("max_positions", max_positions)):
            validate.integer(val, name)
        if d_rope % 2:
            raise ValueError(f"d_rope: expected an even number (rotary dims turn in pairs), got {d_rope}")
        self.n_heads, self.d_head, self.d_latent, self.d_rope = n_heads, d_head, d_latent, d_rope
        self.scale = validate.scale(scale, d_head + d_rope)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None

        def weight(*shape, fan_in):                                       # N(0, 1/fan_in)
            return nn.Parameter(torch.randn(*shape, generator=gen) * fan_in ** -0.5)

        self.w_dkv = weight(d_latent, d_model, fan_in=d_model)            # c = W_DKV h
        self.w_kr = weight(d_rope, d_model, fan_in=d_model)               # k_R = R W_KR h, shared by heads
        self.w_q = weight(n_heads * (d_head + d_rope), d_model, fan_in=d_model)   # [q_C ; q_R] per head
        self.w_uk = weight(n_heads, d_head, d_latent, fan_in=d_latent)    # k_C,i = W_UK,i c
        self.w_uv = weight(n_heads, d_head, d_latent, fan_in=d_latent)    # v_i = W_UV,i c
        self.w_o = weight(d_model, n_heads * d_head, fan_in=n_heads * d_head)
        self.rotary = Rotary(d_rope, max_positions)

    # -- the pieces ------------------------------------------------------------------------
    def _positions(self, start, T, device):
        validate.integer(start, "start", minimum=0)
        return torch.arange(start, start + T, device=device)             # (T,)

    def latent(self, x, start=0):
        """The cache entries of x's positions ``start ..``: (B, 1, T, d_latent + d_rope), the latent
        ``c`` and the rotated shared key ``R k_R`` side by side (one "KV head")."""
        validate.tensor(x, "x", 3, "(batch, tokens, d_model)", floating=True)
        c = x @ self.w_dkv.T                                              # (B, T, d_latent)
        k_r = (x @ self.w_kr.T)[:, None]                                  # (B, 1, T, d_rope)
        k_r = self.rotary(k_r, self._positions(start, x.shape[1], x.device))   # rotated once, as cached
        return torch.cat([c[:, None], k_r], dim=-1)                       # (B, 1, T, d_latent + d_rope)

    def queries(self, x, start=0):
        """q_C (B, H, T, d_head) and the rotated q_R (B, H, T, d_rope) of x's positions ``start ..``."""
        validate.tensor(x, "x", 3, "(batch, tokens, d_model)", floating=True)
        if x.shape[-1] != self.w_q.shape[1]:
            raise ValueError(f"x: expected d_model={self.w_q.shape[1]} features (last dim), got shape {tuple(x.shape)}")
        B, T, _ = x.shape
        q = (x @ self.w_q.T).view(B, T, self.n_heads, self.d_head + self.d_rope).transpose(1, 2)
        q_c, q_r = q.split([self.d_head, self.d_rope], dim=-1)            # (B, H, T, d_head), (B, H, T, d_rope)
        return q_c, self.rotary(q_r, self._positions(start, T, x.device))

    def expand(self, cache):
        """Unabsorbed keys (B, H, S, d_head + d_rope) and values (B, H, S, d_head) of a cache
        (B, 1, S, d_latent + d_rope): every head's ``[W_UK_i c ; R k_R]`` and ``W_UV_i c``."""
        c, k_r = cache[:, 0].split([self.d_latent, self.d_rope], dim=-1)  # (B, S, d_latent), (B, S, d_rope)
        k_c = torch.einsum("hdc,bsc->bhsd", self.w_uk, c)                 # (B, H, S, d_head)
        v = torch.einsum("hdc,bsc->bhsd", self.w_uv, c)                   # (B, H, S, d_head)
        k = torch.cat([k_c, k_r[:, None].expand(-1, self.n_heads, -1, -1)], dim=-1)   # (B, H, S, d_head + d_rope)
        return k, v

    def output(self, o):
        """Heads' outputs (B, H, T, d_head) -> (B, T, C) through ``w_o``."""
        B, H, T, _ = o.shape
        return o.transpose(1, 2).reshape(B, T, H * self.d_head) @ self.w_o.T    # (B, T, C)

    def absorbed_weights(self):
        """W_UK and W_O W_UV, ready to absorb: the query-side (H, d_head, d_latent) ``w_uk`` and the
        output-side (H, C, d_latent) ``W_O,i W_UV,i`` (head i's block of ``w_o`` times ``w_uv``)."""
        w_o = self.w_o.view(self.w_o.shape[0], self.n_heads, self.d_head)       # (C, H, d_head)
        return self.w_uk, torch.einsum("chd,hdk->hck", w_o, self.w_uv)           # (H, C, d_latent)

    # -- training form ---------------------------------------------------------------------
    def forward(self, x, return_weights=False):
        """x (B, T, C) -> (B, T, C); with ``return_weights`` also the weights (B, H, T, T)."""
        q_c, q_r = self.queries(x)                                        # (B, H, T, d_head), (B, H, T, d_rope)
        k, v = self.expand(self.latent(x))                                # (B, H, T, d_head + d_rope), (B, H, T, d_head)
        if return_weights:
            o, w = scaled_dot_product_attention(torch.cat([q_c, q_r], -1), k, v, causal=True, scale=self.scale,
                                                return_weights=True)      # (B, H, T, d_head), (B, H, T, T)
            return self.output(o), w
        o = scaled_dot_product_attention(torch.cat([q_c, q_r], -1), k, v, causal=True, scale=self.scale)
        return self.output(o)                                             # (B, T, C)

    # -- decoding against a latent cache ---------------------------------------------------
    def _check_cache(self, x_new, cache, cache_seqlens):
        validate.tensor(x_new, "x_new", 3, "(batch, new tokens, d_model)", floating=True)
        validate.tensor(cache, "cache", 4, "(batch, 1, positions, d_latent + d_rope)", floating=True)
        width = self.d_latent + self.d_rope
        if cache.shape[1] != 1 or cache.shape[3] != width or cache.shape[0] != x_new.shape[0]:
            raise ValueError(f"cache: expected ({x_new.shape[0]}, 1, positions, {width}) (one latent head of "
                             f"d_latent + d_rope), got {tuple(cache.shape)}")
        validate.tensor(cache_seqlens, "cache_seqlens", 1, "(batch,)")
        if cache_seqlens.shape[0] != x_new.shape[0]:
            raise ValueError(f"cache_seqlens: expected {x_new.shape[0]} lengths, got {cache_seqlens.shape[0]}")
        lens = [int(n) for n in cache_seqlens]
        if min(lens) < x_new.shape[1] or max(lens) > cache.shape[2]:
            raise ValueError(f"cache_seqlens: expected lengths in [{x_new.shape[1]}, {cache.shape[2]}] (the new "
                             f"tokens included, within the cache), got {lens}")
        return lens

    def _new_queries(self, x_new, lens):
        """q_C, q_R of each sequence's new tokens at positions ``len - Tn ..`` (ragged batches)."""
        Tn = x_new.shape[1]
        parts = [self.queries(x_new[b:b + 1], n - Tn) for b, n in enumerate(lens)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])   # (B, H, Tn, .)

    def decode_unabsorbed(self, x_new, cache, cache_seqlens):
        """x_new (B, Tn, C), whose entries are already in ``cache`` (B, 1, S, d_latent + d_rope) at
        positions ``len - Tn .. len - 1``: the cache up-projected to per-head K and V, then multi-head
        attention (``decode_reference``). Returns (B, Tn, C)."""
        lens = self._check_cache(x_new, cache, cache_seqlens)
        q_c, q_r = self._new_queries(x_new, lens)
        k, v = self.expand(cache)                                         # (B, H, S, d_head + d_rope), (B, H, S, d_head)
        # decode_reference returns q's head size: pad V with d_rope zero columns, and drop them after
        v = torch.nn.functional.pad(v, (0, self.d_rope))                  # (B, H, S, d_head + d_rope)
        o = decode_reference(torch.cat([q_c, q_r], -1), k, v, cache_seqlens, scale=self.scale)
        return self.output(o[..., :self.d_head])                          # (B, Tn, C)

    def decode_absorbed(self, x_new, cache, cache_seqlens, attend=None):
        """The same as :meth:`decode_unabsorbed`, with W_UK absorbed into the query and W_UV into the
        output: multi-query attention over the cache as stored, keys and values both the cache.
        ``attend(q, k_cache, v_cache, cache_seqlens, scale=...)``: ``decode_reference`` (default) or
        ``attnlab.kernels.flash_decode`` (``d_latent + d_rope`` in 16, 32, 64, 128). Returns (B, Tn, C)."""
        lens = self._check_cache(x_new, cache, cache_seqlens)
        attend = decode_reference if attend is None else attend
        q_c, q_r = self._new_queries(x_new, lens)                         # (B, H, Tn, d_head), (B, H, Tn, d_rope)
        w_uk, w_ouv = self.absorbed_weights()
        q_lat = torch.einsum("bhtd,hdc->bhtc", q_c, w_uk)                 # (B, H, Tn, d_latent): W_UK_i^T q_C_i
        q = torch.cat([q_lat, q_r], dim=-1)                               # (B, H, Tn, d_latent + d_rope)
        o = attend(q.to(cache.dtype), cache, cache, cache_seqlens, scale=self.scale)   # (B, H, Tn, d_latent + d_rope)
        o_lat = o[..., :self.d_latent].to(q_c.dtype)                      # (B, H, Tn, d_latent): sum_j p_ij c_j
        return torch.einsum("hck,bhtk->btc", w_ouv, o_lat)                # (B, Tn, C): sum_i W_O,i W_UV,i o_i

    def cache_bytes_per_token(self, bytes_per_element=2):
        """This layer's cache per token: ``(d_latent + d_rope) x bytes_per_element``."""
        return mla_cache_bytes(1, 1, self.d_latent, self.d_rope, bytes_per_element)
