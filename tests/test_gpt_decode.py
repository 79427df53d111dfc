"""GPT.generate with a KV cache (attnlab/models/gpt.py): the same tokens as the cache-free path for every
decoding backend, with grouped-query/multi-query heads and rotary positions; each token's K and V written
once; a rolling cache (sinks + window) equal to the sink_window mask; lesson 09's checkpoint unchanged."""

import pytest
import torch

from attnlab.attention import scaled_dot_product_attention
from attnlab.capstone import RECIPE, load_gpt, load_gpt_checkpoint
from attnlab.kvcache import RollingCache
from attnlab.mask_mods import sink_window
from attnlab.models.gpt import GPT

V = 96


def tiny(attention="sdpa", block_size=32, **kw):
    return GPT(V, block_size=block_size, d_model=32, n_heads=4, n_layers=2, attention=attention, seed=0, **kw).eval()


def prompt(b=2, t=5, seed=0):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ["sdpa", "reference", "flash"])
@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2}, {"n_kv_heads": 1}, {"positions": "rope", "n_kv_heads": 2}],
                         ids=["mha", "gqa", "mqa", "gqa-rope"])
def test_cached_generation_gives_the_tokens_of_the_cache_free_path(attention, kw):
    model = GPT(V, block_size=32, d_model=64, n_heads=4, n_layers=2, attention=attention, seed=0, **kw).eval()
    x = prompt()
    a = model.generate(x, 20, generator=torch.Generator().manual_seed(3))
    b = model.generate(x, 20, generator=torch.Generator().manual_seed(3), kv_cache=False)
    assert a.shape == (2, 25) and torch.equal(a, b)


def test_past_block_size_both_paths_slide_the_same_window():
    model = tiny(block_size=16)
    x = prompt(1, 4)
    a = model.generate(x, 30, generator=torch.Generator().manual_seed(0))
    b = model.generate(x, 30, generator=torch.Generator().manual_seed(0), kv_cache=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 1, "positions": "rope"}])
def test_each_token_is_written_once_and_decoding_matches_the_full_pass(kw):
    model = tiny(**kw)
    idx = prompt(2, 12)
    logits, caches = model.prefill(idx[:, :7])
    for t in range(7, 12):
        step = model.decode_step(idx[:, t:t + 1], caches)                 # (B, 1, V)
    full, _ = model(idx)
    torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, full[:, :7], atol=1e-5, rtol=1e-5)
    assert all(c.writes == 12 and c.length == 12 for c in caches)        # 12 positions, 12 writes per layer
    attn = model.blocks[0].attn
    _, k, v = attn.qkv(model.blocks[0].ln_1(model.embed(idx)))            # layer 0's K of the whole sequence
    assert k.shape[1] == model.n_kv_heads
    torch.testing.assert_close(caches[0].k[:, :, :12], k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(caches[0].v[:, :, :12], v, atol=1e-6, rtol=1e-6)


def test_rolling_cache_is_the_sink_window_mask():
    model = tiny(block_size=64)
    idx = prompt(1, 40)
    full, rolling = model.new_caches(1), model.new_caches(1, sinks=2, window=12)
    assert isinstance(rolling[0], RollingCache)
    a = [model.decode_step(idx[:, t:t + 1], full)[:, -1] for t in range(40)]
    b = [model.decode_step(idx[:, t:t + 1], rolling)[:, -1] for t in range(40)]
    for t in range(14):                                                   # inside the window: the same
        torch.testing.assert_close(a[t], b[t], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[39], b[39], atol=1e-3)                   # past it: evicted keys are missing
    mm = sink_window(2, 12)
    mask = mm(0, 0, torch.arange(40)[:, None], torch.arange(40)[None, :])

    def sink_attention(q, k, v, is_causal=True):
        return scaled_dot_product_attention(q, k, v, mask=mask[: q.shape[2], : q.shape[2]])

    masked = tiny(attention=sink_attention, block_size=64)
    masked.load_state_dict(model.state_dict())
    ref, _ = masked(idx)
    torch.testing.assert_close(torch.stack(b, 1), ref, atol=1e-5, rtol=1e-5)
    assert rolling[0].positions == [0, 1] + list(range(28, 40))


def test_options_are_checked_and_the_default_keeps_lesson_09s_checkpoint():
    with pytest.raises(ValueError, match="n_kv_heads"):
        tiny(n_kv_heads=3)
    with pytest.raises(ValueError, match="positions"):
        tiny(positions="alibi")
    with pytest.raises(TypeError, match="kv_cache"):
        tiny().generate(prompt(), 2, kv_cache="yes")
    assert "n_kv_heads" not in tiny().config and tiny(n_kv_heads=2).config["n_kv_heads"] == 2
    assert tiny(n_kv_heads=2).blocks[0].attn.k_proj.weight.shape == (16, 32)
    ckpt = load_gpt_checkpoint()
    assert ckpt["config"] == RECIPE["model"]
    model = load_gpt()
    assert model.config == RECIPE["model"] and set(model.state_dict()) == set(ckpt["state_dict"])
    with pytest.raises(ValueError, match="block_size"):
        model.decode_step(prompt(1, 5), model.prefill(prompt(1, 125))[1])
