"""iomodel.decode_step_bytes / decode_crossover_tokens / mla_cache_bytes: a whole model's decoding step,
the weights (read once, shared by the batch) against each sequence's KV cache (C23, C34)."""

import pytest

from attnlab import iomodel as io

LLAMA2_7B = dict(params=6.7e9, layers=32, heads=32, d=128)   # Llama-2-7B's shape, multi-head attention


def test_hand_count_small_model():
    # 1,000 parameters in 2 bytes; 2 layers x 2 KV heads x d 4: c = 2 * 2 * 2 * 4 * 2 = 64 bytes per token
    s = io.decode_step_bytes(3, 10, params=1000, layers=2, heads=4, kv_heads=2, d=4, bytes_per_element=2)
    w, c = s.parts["weights"], s.parts["kv_cache"]
    assert (w.bytes_read, w.bytes_written) == (2000, 0)                 # once, whatever the batch
    assert (c.bytes_read, c.bytes_written) == (3 * 10 * 64, 3 * 64)     # each sequence's cache, and its new entry
    assert w.flops == 2 * 1000 * 3
    assert c.flops == 4 * 10 * 4 * 4 * 2 * 3                            # 4 L d per query head, every layer
    assert s.total_bytes == 2000 + 1920 + 192


def test_weights_shared_cache_not():
    one = io.decode_step_bytes(1, 4096, **LLAMA2_7B)
    many = io.decode_step_bytes(16, 4096, **LLAMA2_7B)
    assert many.parts["weights"].total_bytes == one.parts["weights"].total_bytes
    assert many.parts["kv_cache"].total_bytes == 16 * one.parts["kv_cache"].total_bytes
    # per generated token the weights' share falls as 1/batch
    assert many.total_bytes / 16 < one.total_bytes


def test_batch_one_is_weight_bound():
    # the expert's numbers: about 13 GB of fp16 weights against a 2 GiB MHA cache at 4,096 tokens
    s = io.decode_step_bytes(1, 4096, **LLAMA2_7B)
    assert s.parts["weights"].bytes_read == pytest.approx(13.4e9)
    assert s.parts["kv_cache"].bytes_read == 2 * 2**30
    assert s.parts["weights"].bytes_read > 6 * s.parts["kv_cache"].bytes_read


def test_crossover_is_where_the_reads_are_equal():
    for kv_heads in (32, 8, 1):
        x = io.decode_crossover_tokens(params=6.7e9, layers=32, d=128, kv_heads=kv_heads)
        assert x == pytest.approx(6.7e9 * 2 / io.kv_cache_bytes(1, 32, kv_heads, 128, 2))
        batch, context = 4, round(x / 4)
        s = io.decode_step_bytes(batch, context, params=6.7e9, layers=32, heads=32, d=128, kv_heads=kv_heads)
        assert s.parts["kv_cache"].bytes_read == pytest.approx(s.parts["weights"].bytes_read, rel=1e-3)
        below = io.decode_step_bytes(batch, context // 2, params=6.7e9, layers=32, heads=32, d=128, kv_heads=kv_heads)
        assert below.parts["kv_cache"].bytes_read < below.parts["weights"].bytes_read
    mha = io.decode_crossover_tokens(params=6.7e9, layers=32, d=128, kv_heads=32)
    gqa = io.decode_crossover_tokens(params=6.7e9, layers=32, d=128, kv_heads=8)
    assert gqa == pytest.approx(4 * mha)                                # 4x smaller cache, 4x later
    assert 25_000 < mha < 26_000


def test_cache_bytes_per_token_override_and_mla():
    # DeepSeek-V2's MLA: d_c = 512 plus d_rope = 64 elements per token and layer
    assert io.mla_cache_bytes(1, 1, 512, 64, 2) == 576 * 2
    assert io.mla_cache_bytes(10, 60, 512, 64, 2) == 10 * 60 * 576 * 2
    assert io.mla_cache_bytes(0, 1, 512, 64) == 0
    c = io.mla_cache_bytes(1, 60, 512, 64)
    s = io.decode_step_bytes(2, 100, params=1e9, layers=60, heads=128, d=128, cache_bytes_per_token=c)
    assert s.parts["kv_cache"].bytes_read == 2 * 100 * c
    assert io.decode_crossover_tokens(params=1e9, layers=60, d=128, kv_heads=128, cache_bytes_per_token=c) == \
        pytest.approx(2e9 / c)


@pytest.mark.parametrize("kwargs, err", [
    (dict(params=0), ValueError), (dict(params=-1.0), ValueError), (dict(params="7B"), ValueError),
    (dict(kv_heads=5), ValueError), (dict(layers=0), ValueError), (dict(d=2.5), TypeError),
    (dict(cache_bytes_per_token=0), ValueError),
])
def test_bad_arguments_name_themselves(kwargs, err):
    args = dict(LLAMA2_7B, **kwargs)
    name = next(iter(kwargs))
    with pytest.raises(err, match=name):
        io.decode_step_bytes(1, 16, **args)


def test_bad_batch_context_and_mla_arguments():
    with pytest.raises(ValueError, match="batch"):
        io.decode_step_bytes(0, 16, **LLAMA2_7B)
    with pytest.raises(ValueError, match="context"):
        io.decode_step_bytes(1, -1, **LLAMA2_7B)
    with pytest.raises(ValueError, match="d_latent"):
        io.mla_cache_bytes(1, 1, 0, 64)
    with pytest.raises(TypeError, match="tokens"):
        io.mla_cache_bytes(1.5, 1, 512, 64)
