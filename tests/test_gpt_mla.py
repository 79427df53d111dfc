"""The capstone GPT with multi-head latent attention layers (layout kind "mla", attnlab.mla.MLA):
training, the latent cache and its absorbed decode against the full forward, mixed layouts, the
attention maps, and the bytes attnlab.hybrids counts against the cache's real bytes."""

import pytest
import torch

from attnlab.hybrids import layer_bytes, layout_bytes, model_bytes
from attnlab.iomodel import kv_cache_bytes, mla_cache_bytes
from attnlab.kvcache import KVCache
from attnlab.mla import MLA
from attnlab.models.gpt import GPT, LatentCache, LatentSelfAttention, layout_from_ratio

V = 96


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def tokens(B, T, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def count_absorbed(monkeypatch):
    """Counts the calls of MLA.decode_absorbed and fails any call of decode_unabsorbed."""
    calls = []
    absorbed = MLA.decode_absorbed

    def spy(self, *args, **kwargs):
        calls.append(args[0].shape[1])                                    # the new tokens of the step
        return absorbed(self, *args, **kwargs)

    def forbidden(self, *args, **kwargs):
        raise AssertionError("the GPT's mla layers must decode through the absorbed path")

    monkeypatch.setattr(MLA, "decode_absorbed", spy)
    monkeypatch.setattr(MLA, "decode_unabsorbed", forbidden)
    return calls


def decode_in_pieces(model, x, cuts=(13, 20)):
    """Prefill x[:, :cuts[0]], one chunk up to cuts[1], then one token at a time: logits (B, T, V)."""
    caches = model.new_caches(x.shape[0])
    parts = [model.decode_step(x[:, :cuts[0]], caches), model.decode_step(x[:, cuts[0]:cuts[1]], caches)]
    parts += [model.decode_step(x[:, t:t + 1], caches) for t in range(cuts[1], x.shape[1])]
    return torch.cat(parts, dim=1), caches


# ---------------------------------------------------------------------------------------------
# the layer kind and its model
# ---------------------------------------------------------------------------------------------

def test_mla_layers_are_mla_and_the_config_rebuilds_them():
    model = GPT(V, 48, 32, 2, 3, layout=["mla", "dense", "mla"], d_latent=24, d_rope=6, seed=3)
    kinds = [type(b.attn).__name__ for b in model.blocks]
    assert kinds == ["LatentSelfAttention", "CausalSelfAttention", "LatentSelfAttention"]
    mla = model.blocks[0].attn.mla
    assert (mla.n_heads, mla.d_head, mla.d_latent, mla.d_rope) == (2, 16, 24, 6)
    assert mla.rotary.cos.shape[0] == 48                                 # angles for block_size positions
    assert model.config["d_latent"] == 24 and model.config["d_rope"] == 6
    rebuilt = GPT(**model.config, seed=3)
    sa, sb = model.state_dict(), rebuilt.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    # the residual projection w_o gets GPT-2's scaled init, not MLA's 1/sqrt(fan_in)
    assert mla.w_o.std() < 0.02 and mla.w_dkv.std() > 0.1
    # defaults: DeepSeek-V2's d_c = 4 d_h and d_h^R = d_h / 2 (hs = 16 here)
    d = GPT(V, 48, 32, 2, 1, layout=["mla"], seed=0).config
    assert (d["d_latent"], d["d_rope"]) == (64, 8)
    assert layout_from_ratio("mla", 1, "dense", 1, 4) == ["mla", "dense"] * 2
    assert "d_latent" not in GPT(V, 48, 32, 2, 2, layout=["dense", "local"]).config   # other layouts unchanged


def test_a_gpt_of_mla_layers_trains():
    model = GPT(V, 32, 32, 2, 2, layout=["mla", "mla"], d_latent=24, d_rope=8, positions="rope", seed=0)
    x = tokens(4, 32, seed=1)
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        assert model.blocks[0].attn.mla.w_uk.grad.abs().sum() > 0        # the up-projections learn
        assert model.blocks[1].attn.mla.w_kr.grad.abs().sum() > 0        # and the rotary key's
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


# ---------------------------------------------------------------------------------------------
# decoding: a latent cache, the absorbed path, equal to the full forward
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,positions,n_kv_heads", [
    (["mla", "mla"], "rope", None),
    (["mla", "dense"], "learned", None),
    (["dense", "mla", "local"], "sinusoidal", 1),
    (["selected", "mla", "local"], "rope", 2),   # (a delta layer keeps a float32 state: not float64-exact)
])
def test_absorbed_decoding_equals_the_full_forward_float64(layout, positions, n_kv_heads, count_absorbed):
    T = 40
    model = GPT(V, 48, 32, 4, len(layout), layout=layout, positions=positions, n_kv_heads=n_kv_heads,
                d_latent=20, d_rope=6, window=8, sinks=2, topk=1, select_block=16, seed=1).double().eval()
    x = tokens(2, T)
    with torch.no_grad():
        full, _ = model(x)                                                # (2, T, V)
    got, caches = decode_in_pieces(model, x)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-10)
    n_mla = layout.count("mla")
    assert count_absorbed == [7] * n_mla + [1] * n_mla * (T - 20)        # every step after the prefill absorbed
    for block, cache in zip(model.blocks, caches):
        if isinstance(block.attn, LatentSelfAttention):
            assert type(cache) is LatentCache and cache.c.shape == (2, 1, 48, 26) and cache.c.dtype == torch.float64
            assert cache.length == cache.writes == T                      # each token's latent written once
            assert cache.c[:, :, T:].abs().max() == 0                      # nothing written past the tokens


def test_absorbed_decoding_float32_and_generate_with_and_without_cache():
    model = GPT(V, 48, 32, 2, 2, layout=["mla", "dense"], d_latent=24, d_rope=8, seed=4).eval()
    x = tokens(1, 48, seed=2)
    with torch.no_grad():
        full, _ = model(x)
    got, _ = decode_in_pieces(model, x, cuts=(5, 9))
    torch.testing.assert_close(got, full, rtol=1e-5, atol=2e-5)
    prompt = tokens(1, 4)
    a = model.generate(prompt, 24, generator=torch.Generator().manual_seed(0))
    b = model.generate(prompt, 24, generator=torch.Generator().manual_seed(0), kv_cache=False)
    assert torch.equal(a, b)


def test_the_latent_cache_is_what_decoding_reads():
    """Corrupt the cached latent of one past token: the absorbed decode reads the cache, so the next logits move."""
    model = GPT(V, 32, 32, 2, 1, layout=["mla"], d_latent=24, d_rope=8, seed=0).double().eval()
    x = tokens(1, 12)
    caches = model.new_caches(1)
    model.decode_step(x[:, :11], caches)
    clean = [LatentCache(1, 32, 32, dtype=torch.float64)]
    clean[0].append(caches[0].c[:, :, :11].clone())
    caches[0].c[:, :, 3, :24] += 1.0                                      # token 3's latent, not its rotary key
    a = model.decode_step(x[:, 11:], clean)
    b = model.decode_step(x[:, 11:], caches)
    assert (a - b).abs().max() > 1e-3


def test_flash_decode_runs_the_absorbed_step(monkeypatch):
    import attnlab.kernels

    model = GPT(V, 32, 32, 2, 2, layout=["mla", "dense"], d_latent=24, d_rope=8, seed=2).eval()
    x = tokens(1, 20, seed=3)
    with torch.no_grad():
        full, _ = model(x)
    model.set_attention("flash")
    assert model.blocks[0].attn.use_kernel
    widths, kernel = [], attnlab.kernels.flash_decode

    def spy(q, k_cache, v_cache, *args, **kwargs):
        widths.append((q.shape[1], k_cache.shape[1], q.shape[-1]))
        return kernel(q, k_cache, v_cache, *args, **kwargs)

    monkeypatch.setattr(attnlab.kernels, "flash_decode", spy)
    got, _ = decode_in_pieces(model, x, cuts=(15, 18))
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    assert (2, 1, 32) in widths                                           # 2 query heads on the one latent head of 24 + 8
    model.set_attention("sdpa")
    assert not model.blocks[0].attn.use_kernel


# ---------------------------------------------------------------------------------------------
# attention maps
# ---------------------------------------------------------------------------------------------

def test_attention_maps_of_an_mla_layer():
    model = GPT(V, 32, 32, 2, 2, layout=["mla", "dense"], d_latent=24, d_rope=8, seed=0).eval()
    x = tokens(2, 20)
    maps = model.attention_maps(x)                                        # (2, 2, 2, 20, 20)
    assert maps.shape == (2, 2, 2, 20, 20)
    torch.testing.assert_close(maps.sum(-1), torch.ones(2, 2, 2, 20))
    assert torch.triu(maps[0], diagonal=1).abs().max() == 0                # causal
    # the weights are those of the layer's own forward: the output with them equals the output without
    layer = model.blocks[0].attn
    h = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(0))
    y, w = layer(h, return_weights=True)
    torch.testing.assert_close(y, layer(h), rtol=0, atol=0)
    # and they are the up-projected scores: softmax(scale [q_C ; R q_R] . [W_UK c ; R k_R])
    q_c, q_r = layer.mla.queries(h)
    k, _ = layer.mla.expand(layer.mla.latent(h))
    s = torch.cat([q_c, q_r], -1) @ k.transpose(-1, -2) * (16 + 8) ** -0.5
    s = s.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(w, torch.softmax(s, -1), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# bytes
# ---------------------------------------------------------------------------------------------

def test_mla_bytes_equal_the_latent_caches_real_bytes():
    layout = ["mla", "dense", "mla"]
    model = GPT(V, 64, 32, 2, 3, layout=layout, d_latent=20, d_rope=4, seed=0).eval()
    caches = model.new_caches(1)
    model.decode_step(tokens(1, 64), caches)                              # full: capacity = block_size = 64
    nb = model_bytes(model, 64, bytes_per_element=4)                      # fp32 caches here
    held = [h for _, h, _ in nb["per_layer"]]
    assert held[0] == caches[0].nbytes == 64 * (20 + 4) * 4 == caches[2].nbytes == held[2]
    assert held[1] == caches[1].k.nbytes + caches[1].v.nbytes            # dense, as before
    assert nb["per_layer"][0][2] == held[0]                               # a step reads the whole latent cache
    assert held[0] == 64 * model.blocks[0].attn.mla.cache_bytes_per_token(4)
    kw = dict(d_model=32, n_heads=2, d_latent=20, d_rope=4)
    assert layer_bytes("mla", 1000, **kw) == (mla_cache_bytes(1000, 1, 20, 4, 2),) * 2 == (1000 * 24 * 2,) * 2
    assert layer_bytes("mla", 1000, **kw)[0] < kv_cache_bytes(1000, 1, 2, 16, 2)   # 24 elements, not 64
    total = layout_bytes(layout, 4096, **kw)
    assert total["held"] == 2 * mla_cache_bytes(4096, 1, 20, 4) + kv_cache_bytes(4096, 1, 2, 16, 2)
    with pytest.raises(ValueError, match="d_latent"):
        layer_bytes("mla", 10, d_model=32, n_heads=2)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

def test_mla_options_are_checked():
    with pytest.raises(ValueError, match="positions"):
        GPT(V, 32, 32, 2, 1, layout=["mla"], positions="none")
    with pytest.raises(ValueError, match="d_rope"):
        GPT(V, 32, 32, 2, 1, layout=["mla"], d_rope=5)
    with pytest.raises(TypeError, match="d_latent"):
        GPT(V, 32, 32, 2, 1, layout=["mla"], d_latent=2.5)
    with pytest.raises(ValueError, match="d_latent"):
        GPT(V, 32, 32, 2, 1, layout=["mla"], attention="flash", d_latent=20, d_rope=8)   # 28: no kernel size
    model = GPT(V, 32, 32, 2, 1, layout=["mla"], d_latent=20, d_rope=8)
    with pytest.raises(ValueError, match="attention"):
        model.set_attention("flash")
    assert not model.blocks[0].attn.use_kernel
    with pytest.raises(ValueError, match="cache"):
        model.blocks[0].attn(torch.randn(1, 3, 32), cache=KVCache(1, 2, 32, 16))
    cache = LatentCache(1, 4, 28)
    with pytest.raises(ValueError, match="entries"):
        cache.append(torch.zeros(1, 1, 5, 28))                            # past the capacity
    with pytest.raises(ValueError, match="entries"):
        cache.append(torch.zeros(1, 2, 1, 28))                            # two heads: not a latent
