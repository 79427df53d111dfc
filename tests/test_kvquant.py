"""attnlab/kvquant.py: 8-bit KV caches (int8 per-block absmax, fp8 e4m3) within their error bounds, their bytes,
decoding on the capstone GPT's real cache, and the cache a model decodes through."""

import pytest
import torch

from attnlab.capstone import load_gpt
from attnlab.data.stdlib_text import encode, load_corpus
from attnlab.iomodel import kv_cache_bytes
from attnlab.kvcache import decode_reference, to_paged
from attnlab.kvquant import (QuantizedKVCache, bytes_per_token, decode_losses, decode_quantized, dequantize,
                             error_bound, quantize_cache)


def cache(B=2, H=3, S=37, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, S, D, generator=g) * torch.rand(B, H, S, 1, generator=g) * 5   # rows of different size
    x[0, 1, :, 3] *= 20                                                                  # an outlier channel
    return x.to(dtype)


@pytest.fixture(scope="module")
def capstone():
    """The capstone GPT, 3 windows of validation text, and layer 0's q, k, v on them (1, 4, 128, 16)."""
    model = load_gpt()
    text = load_corpus().text["valid"]
    idx = torch.stack([encode(text[i * 2000:i * 2000 + 128]) for i in range(3)])         # (3, 128)
    with torch.no_grad():
        attn = model.blocks[0].attn
        q, k, v = attn.qkv(model.blocks[0].ln_1(model.embed(idx)))                         # (3, 4, 128, 16) each
    return model, idx, q, k, v


@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
def test_int8_error_is_at_most_half_a_scale_per_element(block_size):
    x = cache()
    xq = quantize_cache(x, dtype="int8", block_size=block_size)
    n_blocks = -(-37 // block_size)
    assert xq.codes.dtype == torch.int8 and xq.codes.shape == x.shape
    assert xq.scales.shape == (2, 3, n_blocks) and xq.scales.dtype == torch.float32
    err = (xq.dequantize() - x).abs()
    scale = xq.scale_per_token()                                                  # (2, 3, 37, 1)
    assert (err <= scale / 2 * (1 + 1e-5)).all()
    assert torch.equal(error_bound(xq, x), (scale / 2).expand(x.shape))
    assert int(xq.codes.abs().max()) == 127                                      # every block's absmax fills the range
    # the bound is reached about: rounding errors of up to half a step do occur
    assert (err / scale).max() > 0.45
    # each block's scale is its own absmax / 127
    b = min(block_size, 37)
    torch.testing.assert_close(xq.scales[..., 0], x[:, :, :b].abs().amax(dim=(-2, -1)) / 127)


@pytest.mark.parametrize("block_size", [1, 16])
def test_fp8_relative_error_is_at_most_2_to_the_minus_4_for_normal_values(block_size):
    x = cache(seed=1)
    x[1, 2, 4, :] = torch.tensor([1e-6, -3e-5, 0.0] + [1.0] * 13)              # subnormal after scaling
    xq = quantize_cache(x, dtype="fp8", block_size=block_size)
    assert xq.codes.dtype == torch.float8_e4m3fn and xq.codes.element_size() == 1
    deq = dequantize(xq)
    err = (deq - x).abs()
    scale = xq.scale_per_token()
    normal = x.abs() >= 2.0 ** -6 * scale
    assert normal.float().mean() > 0.9 and (~normal).any()
    assert (err[normal] <= 2.0 ** -4 * x.abs()[normal] * (1 + 1e-5)).all()
    assert (err[~normal] <= 2.0 ** -10 * scale.expand(x.shape)[~normal] * (1 + 1e-5)).all()
    assert (err <= error_bound(xq, x) * (1 + 1e-5) + 1e-12).all()
    assert (err / x.abs().clamp(min=1e-30))[normal].max() > 2.0 ** -5              # 3 mantissa bits do round
    assert float(xq.codes.float().abs().max()) == 448.0


def test_fp8_codes_are_those_of_torchs_cast():
    x = cache(seed=2)
    xq = quantize_cache(x, dtype="fp8", block_size=8)
    scaled = x / xq.scale_per_token()
    assert torch.equal(xq.codes.view(torch.uint8), scaled.to(torch.float8_e4m3fn).view(torch.uint8))


def test_zero_blocks_half_precision_input_and_ragged_last_block():
    x = cache(S=20).half()
    x[:, :, 16:] = 0                                                           # the last block (4 tokens) is all zeros
    xq = quantize_cache(x, dtype="int8", block_size=16)
    assert (xq.scales[..., 1] == 0).all() and (xq.codes[:, :, 16:] == 0).all()
    deq = xq.dequantize()
    assert deq.dtype == torch.float16 and torch.isfinite(deq).all()
    assert dequantize(xq, torch.float32).dtype == torch.float32
    assert (deq.float() - x.float()).abs().max() <= xq.scales.max() / 2 + 1e-3  # fp16 output rounding


def test_bytes_codes_and_scales():
    x = cache(B=1, H=4, S=128, D=16)
    for block_size, scales in ((1, 128), (16, 8), (128, 1)):
        xq = quantize_cache(x, dtype="fp8", block_size=block_size)
        assert xq.code_bytes == 4 * 128 * 16 and xq.scale_bytes == 4 * 4 * scales
        assert xq.nbytes == xq.code_bytes + xq.scale_bytes
    # per token, both K and V: 16-bit against 8-bit plus a float32 scale per block
    assert bytes_per_token(2, 4, 16) == kv_cache_bytes(1, 2, 4, 16, 2) == 512
    assert bytes_per_token(2, 4, 16, dtype="int8", block_size=16) == 256 + 2 * 2 * 4 * 4 / 16
    assert bytes_per_token(2, 4, 16, dtype="int8", block_size=1) == 256 + 64           # 25% more at head_dim 16
    assert bytes_per_token(32, 8, 128, dtype="fp8", block_size=16) / bytes_per_token(32, 8, 128) < 0.501
    assert bytes_per_token(2, 4, 16, dtype="fp32") == 1024


def test_errors_name_the_argument():
    x = cache()
    with pytest.raises(ValueError, match="dtype: expected one of"):
        quantize_cache(x, dtype="int4")
    with pytest.raises(ValueError, match="block_size"):
        quantize_cache(x, block_size=0)
    with pytest.raises(ValueError, match="x: expected a 4-D tensor"):
        quantize_cache(x[0])
    with pytest.raises(TypeError, match="x: expected a floating-point"):
        quantize_cache(x.long())
    with pytest.raises(TypeError, match="cache: expected a QuantizedCache"):
        dequantize(x)
    with pytest.raises(TypeError, match="v_cache: expected a QuantizedCache"):
        decode_quantized(x[:, :, :1], quantize_cache(x), x, torch.tensor([37, 37], dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        bytes_per_token(dtype="int4")
    with pytest.raises(ValueError, match="quant"):
        QuantizedKVCache(1, 1, 8, 16, quant="nf4")


@pytest.mark.parametrize("dtype,tol", [("int8", 0.03), ("fp8", 0.15)])   # measured 1.1%, 6.8%
def test_decoding_the_capstones_cache_in_8_bits(capstone, dtype, tol):
    _, _, q, k, v = capstone
    lens = torch.tensor([128, 100, 37], dtype=torch.int32)
    qn = q[:, :, 127:]                                                      # one query per sequence, (3, 4, 1, 16)
    ref = decode_reference(qn, k, v, lens, scale=0.2)
    kq, vq = quantize_cache(k, dtype=dtype), quantize_cache(v, dtype=dtype)
    out = decode_quantized(qn, kq, vq, lens, scale=0.2)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 1e-5 < rel < tol                                                  # changed, and only a little
    # the same on a paged pool of the dequantized cache
    kp, vp, table = to_paged(kq.dequantize(), vq.dequantize(), lens, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(decode_reference(qn, kp, vp, lens, block_table=table, scale=0.2), out)
    # int8 beats fp8 on this cache (8 bits of mantissa against 3)
    if dtype == "fp8":
        out8 = decode_quantized(qn, quantize_cache(k), quantize_cache(v), lens, scale=0.2)
        assert (out8 - ref).norm() < (out - ref).norm()


def test_a_model_decoding_through_an_8_bit_cache(capstone):
    model, idx, *_ = capstone
    idx = idx[:2, :40]
    ref = decode_losses(model, idx, model.new_caches(2))
    _, full = model(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(ref.mean(), full, atol=1e-5, rtol=1e-5)       # the float cache is exact
    caches = [QuantizedKVCache(2, 4, 128, 16, quant="int8", block_size=8) for _ in model.blocks]
    q8 = decode_losses(model, idx, caches)
    assert caches[0].quantized == 32 and caches[0].length == 39               # 4 full blocks; 7 tokens in float
    assert not torch.equal(q8, ref) and (q8 - ref).abs().max() < 0.1
    assert abs(q8.mean() - ref.mean()) < 0.01
    # what the cache holds: the full blocks dequantized, the tail as written
    x = caches[0].k[:, :, :32].clone()
    assert torch.equal(quantize_cache(x, dtype="int8", block_size=8).dequantize(), x)   # already on the grid
