"""Positions: what attention alone cannot see, and three ways to give it (lesson 10).

Attention is a weighted average over a *set* of keys: permute the tokens of a sequence and
(without a causal mask) the outputs are permuted the same way, nothing else changes. It is
permutation-equivariant, so word order must be added (:func:`permutation_equivariance`
shows it numerically). Three ways:

* sinusoidal (Vaswani et al. 2017, Section 3.5): a fixed table added to the token embedding,
  :func:`sinusoidal_positions`;
* learned: a trained table of ``block_size`` vectors added the same way (GPT-2), an
  ``nn.Embedding``, :func:`learned_positions`; neither extends past the positions it has;
* rotary (RoPE, Su et al. 2021, RoFormer): no table in the residual stream; the query and
  the key of position ``p`` are *rotated* by angles ``p * theta_i``, one per pair of
  dimensions ``(2i, 2i + 1)``, with ``theta_i = base^(-2i / d)``. Because rotations compose,
  ``<R_m q, R_n k> = <q, R_(n - m) k>``: the score depends only on the offset ``n - m``
  (:func:`relative_offset_gap` checks it). A decoder rotates each key once, when it is written
  to the KV cache, and never again.

Shapes: x (B, H, T, D) with D even; positions (T,) long.

Example::

    rope = Rotary(head_dim=16, max_positions=128)
    q, k = rope(q, positions), rope(k, positions)      # before the attention kernel
"""

from __future__ import annotations

import torch
from torch import nn

from attnlab import validate

__all__ = ["sinusoidal_positions", "learned_positions", "rope_angles", "apply_rope", "Rotary",
           "permutation_equivariance", "relative_offset_gap"]


def sinusoidal_positions(n, d_model):
    """Vaswani et al. (2017), Section 3.5: ``PE[p, 2i] = sin(p / 10000^(2i/d))``, ``PE[p, 2i+1] = cos(...)``.

    Returns (n, d_model) float32. Example: ``sinusoidal_positions(128, 64).shape  # (128, 64)``
    """
    p = torch.arange(n, dtype=torch.float32)[:, None]                     # (n, 1) positions
    i = torch.arange(0, d_model, 2, dtype=torch.float32)[None, :]         # (1, ceil(d/2)) even dims
    angle = p / 10000.0 ** (i / d_model)                                  # (n, ceil(d/2))
    pe = torch.zeros(n, d_model)                                          # (n, d_model)
    pe[:, 0::2] = torch.sin(angle)                                        # even dims
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])                     # odd dims
    return pe


def learned_positions(block_size, d_model):
    """A trained position table (GPT-2's ``wpe``): ``nn.Embedding(block_size, d_model)``; it has no
    vector for a position ``>= block_size``. Example: ``learned_positions(128, 64)(torch.arange(10))``"""
    validate.integer(block_size, "block_size")
    validate.integer(d_model, "d_model")
    return nn.Embedding(block_size, d_model)


def rope_angles(n, head_dim, base=10000.0):
    """(cos, sin), each (n, head_dim // 2): the rotation of each position ``p < n`` for each
    pair of dimensions ``i``, angle ``p * base^(-2i / head_dim)`` (Su et al. 2021, Eq. 15).

    Example: ``cos, sin = rope_angles(128, 16)``
    """
    validate.integer(n, "n")
    validate.integer(head_dim, "head_dim")
    if head_dim % 2:
        raise ValueError(f"head_dim: expected an even number (dims rotate in pairs), got {head_dim}")
    theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)   # (D/2,)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * theta[None, :]            # (n, D/2)
    return torch.cos(angle).float(), torch.sin(angle).float()


def apply_rope(x, cos, sin):
    """Rotate each pair ``(x[..., 2i], x[..., 2i + 1])`` of x (B, H, T, D) by the angles of its
    position: cos, sin (T, D/2) (rows of :func:`rope_angles` for x's positions). Returns x's shape.

    Example: ``apply_rope(q, cos[positions], sin[positions])``
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]                                   # (B, H, T, D/2) each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)   # (B, H, T, D/2, 2)
    return out.flatten(-2)                                                # (B, H, T, D)


class Rotary(nn.Module):
    """Rotary positions with the rotation of every position computed once and cached (buffers
    ``cos``, ``sin`` of (max_positions, head_dim // 2), not saved in a state dict).

    forward(x (B, H, T, D), positions (T,) long) -> rotated x. Example: ``Rotary(16, 128)(q, torch.arange(T))``
    """

    def __init__(self, head_dim, max_positions, base=10000.0):
        super().__init__()
        cos, sin = rope_angles(max_positions, head_dim, base)
        self.register_buffer("cos", cos, persistent=False)                # (max_positions, D/2)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, positions):
        if int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"positions: expected positions < {self.cos.shape[0]} (max_positions), "
                             f"got {int(positions.max())}")
        return apply_rope(x, self.cos[positions], self.sin[positions])


def permutation_equivariance(attend, q, k, v, generator=None):
    """How far ``attend(q, k, v)`` (no positions, no causal mask) is from permutation-equivariant:
    the largest ``|attend(Pq, Pk, Pv) - P attend(q, k, v)|`` for a random permutation P of the
    sequence. Float rounding only (about 1e-7 in fp32): the order is invisible to attention.

    Example: ``permutation_equivariance(scaled_dot_product_attention, q, k, v)``
    """
    perm = torch.randperm(q.shape[-2], generator=generator)
    out = attend(q, k, v)                                                 # (B, H, T, D)
    out_perm = attend(q[..., perm, :], k[..., perm, :], v[..., perm, :])
    return float((out_perm - out[..., perm, :]).abs().max())


def relative_offset_gap(head_dim=16, shift=37, n=64, base=10000.0, generator=None):
    """RoPE's relative-offset property, checked: the scores of rotated q at positions m and k at n
    against the same vectors moved to m + shift and n + shift. Returns the largest difference of
    the two (n, n) score matrices (float rounding: the scores depend on n - m only).

    Example: ``relative_offset_gap() < 1e-4``
    """
    q = torch.randn(1, 1, n, head_dim, generator=generator)
    k = torch.randn(1, 1, n, head_dim, generator=generator)
    cos, sin = rope_angles(n + shift, head_dim, base)
    near = apply_rope(q, cos[:n], sin[:n]) @ apply_rope(k, cos[:n], sin[:n]).transpose(-1, -2)
    far = apply_rope(q, cos[shift:], sin[shift:]) @ apply_rope(k, cos[shift:], sin[shift:]).transpose(-1, -2)
    return float((near - far).abs().max())
