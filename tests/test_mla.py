"""attnlab.mla: multi-head latent attention (DeepSeek-V2). The absorbed decode (multi-query attention
over the latent cache, through decode_reference or the flash_decode kernel) is exact against the
unabsorbed one (per-head K and V up-projected) and against the causal training form (C34)."""

import pytest
import torch

from attnlab import iomodel
from attnlab.kernels import flash_decode
from attnlab.mla import MLA

SHAPE = dict(d_head=16, d_latent=48, d_rope=16, max_positions=64)   # latent + rope = 64: a flash_decode head size


def _model(dtype=torch.float32, **kw):
    return MLA(40, 4, **{**SHAPE, **kw}, seed=3).to(dtype)


def _ragged_cache(m, x, lens, capacity):
    """Each sequence's latents at its own positions 0..len-1, the rest of the cache garbage."""
    B = x.shape[0]
    cache = torch.randn(B, 1, capacity, m.d_latent + m.d_rope, dtype=x.dtype) * 100   # never read
    for b, n in enumerate(lens):
        cache[b:b + 1, :, :n] = m.latent(x[b:b + 1, :n])
    return cache


@pytest.mark.parametrize("n_new", [1, 3])
def test_absorbed_equals_unabsorbed_float64(n_new):
    torch.manual_seed(0)
    m = _model(torch.float64)
    lens = [23, 9, 17]                                   # ragged; capacity 30
    x = torch.randn(3, 23, 40, dtype=torch.float64)
    cache = _ragged_cache(m, x, lens, 30)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    x_new = torch.stack([x[b, n - n_new:n] for b, n in enumerate(lens)])   # (3, n_new, 40)
    with torch.no_grad():
        a = m.decode_unabsorbed(x_new, cache, seqlens)
        b = m.decode_absorbed(x_new, cache, seqlens)
        # and both equal the causal training form on each sequence alone
        for i, n in enumerate(lens):
            full = m(x[i:i + 1, :n])[0, n - n_new:]
            torch.testing.assert_close(a[i], full, rtol=0, atol=1e-12)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert a.abs().mean() > 0.05                         # not trivially zero


def test_absorbed_through_flash_decode_float32():
    torch.manual_seed(1)
    lens = [70, 33]                                      # more than one 64-key block; not multiples of it
    x = torch.randn(2, 70, 40)
    m_long = MLA(40, 4, **{**SHAPE, "max_positions": 80}, seed=3)
    cache = _ragged_cache(m_long, x, lens, 80)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    x_new = torch.stack([x[b, n - 1:n] for b, n in enumerate(lens)])
    with torch.no_grad():
        ref = m_long.decode_unabsorbed(x_new, cache, seqlens)
        for splits in (1, 2):
            out = m_long.decode_absorbed(x_new, cache, seqlens,
                                         attend=lambda *a, **k: flash_decode(*a, num_splits=splits, **k))
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        ref_abs = m_long.decode_absorbed(x_new, cache, seqlens)
    torch.testing.assert_close(ref_abs, ref, rtol=1e-5, atol=1e-6)


def test_scale_is_used():
    torch.manual_seed(2)
    x = torch.randn(1, 12, 40, dtype=torch.float64)
    m = _model(torch.float64, scale=0.05)
    d = _model(torch.float64)
    assert m.scale == 0.05 and d.scale == pytest.approx((16 + 16) ** -0.5)
    cache = m.latent(x)
    lens = torch.tensor([12], dtype=torch.int32)
    with torch.no_grad():
        a, b = m.decode_absorbed(x[:, -1:], cache, lens), m.decode_unabsorbed(x[:, -1:], cache, lens)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        torch.testing.assert_close(a, m(x)[:, -1:], rtol=0, atol=1e-12)
        assert (a - d.decode_absorbed(x[:, -1:], cache, lens)).abs().max() > 1e-3   # a different scale differs


def test_positions_matter_and_rope_key_is_shared():
    torch.manual_seed(4)
    m = _model(torch.float64)
    x = torch.randn(1, 10, 40, dtype=torch.float64)
    lat0, lat5 = m.latent(x), m.latent(x, start=5)
    assert lat0.shape == (1, 1, 10, 48 + 16)
    torch.testing.assert_close(lat0[..., :48], lat5[..., :48], rtol=0, atol=0)   # the latent has no position
    assert (lat0[..., 48:] - lat5[..., 48:]).abs().max() > 1e-3                  # the rotary key does
    # the rotary part is what makes order visible: reversed keys change the causal output
    y = m(x)
    assert (m(x.flip(1)).flip(1) - y).abs().max() > 1e-3


def test_cache_bytes():
    m = _model()
    assert m.cache_bytes_per_token(2) == (48 + 16) * 2 == iomodel.mla_cache_bytes(1, 1, 48, 16, 2)
    # MHA of the same heads caches 2 x 4 x 16 per token; MLA 48 + 16
    assert iomodel.kv_cache_bytes(1, 1, 4, 16, 2) == 256 > m.cache_bytes_per_token(2) == 128
    # DeepSeek-V2's shape: 576 elements per token and layer, as GQA with 2.25 groups of d_h = 128
    assert iomodel.mla_cache_bytes(1, 1, 512, 64, 1) == 576 == iomodel.kv_cache_bytes(1, 1, 1, 128, 1) * 2.25


def test_bad_arguments():
    with pytest.raises(ValueError, match="d_rope"):
        MLA(40, 4, d_head=16, d_latent=48, d_rope=15, max_positions=8)
    with pytest.raises(TypeError, match="d_latent"):
        MLA(40, 4, d_head=16, d_latent=48.0, d_rope=16, max_positions=8)
    m = _model()
    x = torch.randn(2, 5, 40)
    cache = m.latent(x)
    with pytest.raises(ValueError, match="cache"):
        m.decode_absorbed(x[:, -1:], torch.cat([cache, cache], 1), torch.tensor([5, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens"):
        m.decode_absorbed(x[:, -1:], cache, torch.tensor([5, 6], dtype=torch.int32))   # past the cache
    with pytest.raises(ValueError, match="cache_seqlens"):
        m.decode_unabsorbed(x[:, -2:], cache, torch.tensor([5, 1], dtype=torch.int32))  # shorter than the new tokens
    with pytest.raises(ValueError, match="cache_seqlens"):
        m.decode_unabsorbed(x[:, -1:], cache, torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match="positions"):
        m.latent(torch.randn(1, 65, 40))                                             # beyond max_positions
