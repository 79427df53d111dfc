"""attnlab/positions.py (sinusoidal, learned, rotary; permutation equivariance without positions), the
sink+window mask_mod of attnlab/mask_mods.py and attnlab.kvcache's caches (KVCache, RollingCache)."""

import pytest
import torch

from attnlab.attention import scaled_dot_product_attention
from attnlab.kvcache import KVCache, RollingCache
from attnlab.mask_mods import MASK_MODS, sink_window
from attnlab.positions import (Rotary, apply_rope, learned_positions, permutation_equivariance, relative_offset_gap,
                               rope_angles, sinusoidal_positions)


def test_attention_without_positions_is_permutation_equivariant():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 16, generator=g) for _ in range(3))
    assert permutation_equivariance(scaled_dot_product_attention, q, k, v, generator=g) < 1e-5
    # with rotary positions it is not any more: order becomes visible
    cos, sin = rope_angles(20, 16)

    def rotated(q, k, v):
        return scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)

    assert permutation_equivariance(rotated, q, k, v, generator=g) > 1e-2
    # a causal mask breaks it too
    assert permutation_equivariance(lambda q, k, v: scaled_dot_product_attention(q, k, v, causal=True),
                                    q, k, v, generator=g) > 1e-2


def test_rope_scores_depend_only_on_the_offset():
    g = torch.Generator().manual_seed(0)
    assert relative_offset_gap(16, shift=37, generator=g) < 1e-4
    assert relative_offset_gap(64, shift=500, generator=g) < 1e-3
    # and rotation keeps lengths: it is a rotation
    x = torch.randn(1, 2, 10, 16, generator=g)
    cos, sin = rope_angles(10, 16)
    assert torch.allclose(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(apply_rope(x[:, :, :1], cos[:1], sin[:1]), x[:, :, :1])   # position 0: identity


def test_rope_pairs_rotate_by_position_times_theta():
    cos, sin = rope_angles(5, 4, base=100.0)
    assert torch.allclose(cos[3, 0], torch.cos(torch.tensor(3.0)))
    assert torch.allclose(sin[2, 1], torch.sin(torch.tensor(2.0 / 10.0)))
    x = torch.zeros(1, 1, 5, 4)
    x[..., 0] = 1.0                                                 # the unit vector of pair 0
    y = apply_rope(x, cos, sin)
    assert torch.allclose(y[0, 0, 3, :2], torch.tensor([cos[3, 0], sin[3, 0]]))
    rope = Rotary(4, 5, base=100.0)
    assert torch.equal(rope(x, torch.arange(5)), y) and "cos" not in rope.state_dict()
    with pytest.raises(ValueError, match="positions"):
        rope(x, torch.arange(1, 6))
    with pytest.raises(ValueError, match="head_dim"):
        rope_angles(4, 5)


def test_sinusoidal_and_learned_tables():
    pe = sinusoidal_positions(50, 8)
    assert torch.allclose(pe[:, 1], torch.cos(torch.arange(50.0)))
    assert learned_positions(12, 8).weight.shape == (12, 8)


def test_sink_window_mask():
    mm = sink_window(2, 3)
    q, kv = torch.arange(8)[:, None], torch.arange(8)[None, :]
    m = mm(0, 0, q, kv)
    assert m[7].tolist() == [True, True, False, False, False, True, True, True]
    assert m[3].tolist() == [True, True, True, True, False, False, False, False]
    assert not (m & ~torch.ones(8, 8, dtype=torch.bool).tril()).any()   # causal
    assert MASK_MODS["sink_window"] is sink_window
    with pytest.raises(ValueError, match="window"):
        sink_window(2, 0)


def test_kv_cache_writes_each_token_once():
    cache = KVCache(1, 2, 10, 4)
    k1 = torch.randn(1, 2, 3, 4)
    k, v = cache.append(k1, -k1)
    assert k.shape == (1, 2, 3, 4) and torch.equal(k, k1) and torch.equal(v, -k1)
    k2 = torch.randn(1, 2, 1, 4)
    k, _ = cache.append(k2, k2)
    assert torch.equal(k[:, :, :3], k1) and torch.equal(k[:, :, 3:], k2)
    assert cache.writes == 4 and cache.seqlens().tolist() == [4]
    with pytest.raises(ValueError, match="do not fit"):
        cache.append(torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4))


def test_rolling_cache_keeps_the_sinks_and_the_window():
    cache = RollingCache(1, 1, 1, sinks=2, window=3)
    for t in range(10):
        x = torch.full((1, 1, 1, 1), float(t))
        k, v = cache.append(x, x)
    assert cache.positions == [0, 1, 7, 8, 9]
    assert k.flatten().tolist() == [0.0, 1.0, 7.0, 8.0, 9.0]
    # the keys the cache kept are the keys the mask lets the last query see
    keep = sink_window(2, 3)(0, 0, torch.tensor(9), torch.arange(10))
    assert torch.nonzero(keep).flatten().tolist() == cache.positions
