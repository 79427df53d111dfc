"""The capstone GPT with a layer layout (lesson 12): dense, local, selected and delta layers, their
decoding caches, the bytes each kind keeps, and attnlab.hybrids.compare_layouts."""

import pytest
import torch
import torch.nn.functional as F

from attnlab.hybrids import compare_layouts, format_rows, layer_bytes, layout_bytes, model_bytes, train_layout
from attnlab.iomodel import kv_cache_bytes
from attnlab.kvcache import RollingCache
from attnlab.linear_attention import delta_rule_recurrent, recurrent_state_bytes
from attnlab.models.gpt import (GPT, DeltaState, GatedDeltaNet, LayerInputs, LocalSelfAttention,
                                SelectedSelfAttention, layout_from_ratio)
from attnlab.sparse import indexer_block_scores, select_blocks, selected_attention_reference

V = 96


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def tokens(B, T, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# layout=None is the old model; a layout of dense layers is the same model
# ---------------------------------------------------------------------------------------------

def test_dense_layout_is_the_default_model():
    a = GPT(V, 48, 32, 2, 3, seed=5)
    b = GPT(V, 48, 32, 2, 3, seed=5, layout=["dense"] * 3)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    x = tokens(2, 40)
    assert torch.equal(a(x, x)[1], b(x, x)[1])
    assert "layout" not in a.config and b.config["layout"] == ["dense"] * 3
    rebuilt = GPT(**b.config)                        # the config rebuilds a layout model
    assert rebuilt.config == b.config


def test_layout_from_ratio_and_errors():
    assert layout_from_ratio("local", 5, "dense", 1, 12) == (["local"] * 5 + ["dense"]) * 2
    assert layout_from_ratio("delta", 3, "dense", 1, 4) == ["delta", "delta", "delta", "dense"]
    assert layout_from_ratio("local", 5, "dense", 1, 4) == ["local"] * 4   # no global layer: say 3:1 at 4 layers
    with pytest.raises(ValueError, match="kind_b"):
        layout_from_ratio("local", 5, "global", 1, 6)
    with pytest.raises(ValueError, match="layout: expected n_layers=3"):
        GPT(V, 32, 32, 2, 3, layout=["dense", "local"])
    with pytest.raises(ValueError, match="layout: expected kinds"):
        GPT(V, 32, 32, 2, 2, layout=["dense", "mamba"])
    with pytest.raises(TypeError, match="layout"):
        GPT(V, 32, 32, 2, 1, layout="dense")
    with pytest.raises(ValueError, match="select_block"):
        GPT(V, 32, 32, 2, 1, layout=["selected"], select_block=24)
    with pytest.raises(ValueError, match="window"):
        GPT(V, 32, 32, 2, 1, layout=["local"], window=0)
    with pytest.raises(ValueError, match="window"):
        GPT(V, 32, 32, 2, 1, layout=["local"]).new_caches(1, window=8)


# ---------------------------------------------------------------------------------------------
# every kind trains
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [["local", "local"], ["selected", "selected"], ["delta", "delta"],
                                    ["delta", "local", "selected", "dense"]])
def test_each_layout_trains(layout):
    model = GPT(V, 48, 32, 2, len(layout), layout=layout, window=8, sinks=2, topk=1, seed=0)
    x = tokens(4, 48, seed=1)
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses


def test_same_seed_same_model_and_loss():
    layout = ["selected", "delta", "local"]
    x = tokens(2, 40)
    a = GPT(V, 40, 32, 2, 3, layout=layout, seed=7)
    b = GPT(V, 40, 32, 2, 3, layout=layout, seed=7)
    c = GPT(V, 40, 32, 2, 3, layout=layout, seed=8)
    assert torch.equal(a(x, x)[1], b(x, x)[1])
    assert not torch.equal(a(x, x)[1], c(x, x)[1])


# ---------------------------------------------------------------------------------------------
# local: nothing outside the window and the sinks
# ---------------------------------------------------------------------------------------------

def test_local_layer_never_sees_outside_window_and_sinks():
    window, sinks, T, t = 6, 2, 40, 30
    model = GPT(V, T, 32, 2, 1, layout=["local"], window=window, sinks=sinks, seed=0).eval()
    x = tokens(1, T)
    base, _ = model(x)
    for p in range(T):
        x2 = x.clone()
        x2[0, p] = (x[0, p] + 1) % V
        out, _ = model(x2)
        changed = not torch.allclose(out[0, t], base[0, t], atol=0, rtol=0)
        visible = p <= t and (p < sinks or t - p < window)
        assert changed == visible, (p, changed, visible)


def test_local_layer_gradient_is_the_sink_window():
    torch.manual_seed(0)
    layer = LocalSelfAttention(32, 2, window=5, sinks=3, n_kv_heads=1)
    x = torch.randn(1, 37, 32, requires_grad=True)
    layer(x)[0, 25].sum().backward()
    touched = (x.grad[0].abs().sum(-1) > 0).nonzero().flatten().tolist()
    assert touched == [0, 1, 2, 21, 22, 23, 24, 25]


# ---------------------------------------------------------------------------------------------
# selected: dense when every block is kept, causal, and the indexer's own loss
# ---------------------------------------------------------------------------------------------

def test_selected_with_every_block_is_dense():
    T = 40   # ragged: 3 blocks of 16, the last one of 8
    sel = GPT(V, T, 32, 2, 2, layout=["selected", "selected"], topk=3, select_block=16, seed=3).eval()
    dense = GPT(V, T, 32, 2, 2, layout=["dense", "dense"], seed=4).eval()
    missing, unexpected = dense.load_state_dict(sel.state_dict(), strict=False)
    assert not missing and all(".index_" in k for k in unexpected)
    x = tokens(2, T)
    torch.testing.assert_close(sel(x)[0], dense(x)[0], atol=1e-5, rtol=1e-5)
    few = GPT(V, T, 32, 2, 2, layout=["selected", "selected"], topk=1, select_block=16, seed=3).eval()
    assert (few(x)[0] - dense(x)[0]).abs().max() > 1e-3     # a real selection changes the output


def test_selected_layer_is_the_reference_on_its_selection():
    torch.manual_seed(1)
    layer = SelectedSelfAttention(32, 2, topk=2, select_block=16, n_kv_heads=1).eval()
    x = torch.randn(2, 70, 32)
    q, k, v = layer.qkv(x)
    block_indices = layer.select(*layer.indexer(x))                       # (2, 1, 5, 2)
    assert block_indices.shape == (2, 1, 5, 2)
    want = layer.out_proj(layer.merge_heads(selected_attention_reference(q, k, v, block_indices, block_size=16)))
    torch.testing.assert_close(layer(x), want)


def test_selected_layer_through_the_triton_kernel():
    """attention="flash": the selected layers run attnlab.kernels.selected_attention (interpreted on a CPU)."""
    x = tokens(2, 40)
    ref = GPT(V, 48, 32, 2, 1, layout=["selected"], topk=2, select_block=16, seed=0)
    kern = GPT(V, 48, 32, 2, 1, layout=["selected"], topk=2, select_block=16, seed=0, attention="flash")
    assert kern.blocks[0].attn.use_kernel and not ref.blocks[0].attn.use_kernel
    assert ref.set_attention("flash").blocks[0].attn.use_kernel
    assert not ref.set_attention("sdpa").blocks[0].attn.use_kernel
    (la, loss_a), (lb, loss_b) = ref(x, x), kern(x, x)
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
    loss_a.backward()
    loss_b.backward()
    for (name, pa), pb in zip(ref.named_parameters(), kern.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_selection_never_looks_ahead():
    """A query block's choice is its first query's: changing a later position of the block leaves
    every earlier output alone. The block's mean over its queries would not."""
    torch.manual_seed(0)
    layer = SelectedSelfAttention(32, 2, topk=2, select_block=16, index_heads=4).eval()
    for p in layer.parameters():
        p.data.normal_(0, 0.5)                                            # sharp, varied indexer scores
    x = torch.randn(1, 64, 32)
    base = layer(x)
    leaked = 0
    for t in range(49, 64):                                               # inside the last block (48..63)
        x2 = x.clone()
        x2[0, t] = 3 * torch.randn(32)
        torch.testing.assert_close(layer(x2)[0, :t], base[0, :t], atol=0, rtol=0)
        # the mean over the block's queries (the whole block scored at once) would change the choice
        naive = [select_blocks(indexer_block_scores(*layer.indexer(z), block_size=16), 2) for z in (x, x2)]
        leaked += not torch.equal(naive[0][0, 3], naive[1][0, 3])
    assert leaked > 0


def test_indexer_loss_trains_only_the_indexer_and_adds_no_value():
    model = GPT(V, 48, 32, 2, 2, layout=["selected", "dense"], topk=1, seed=0)
    layer = model.blocks[0].attn
    with torch.no_grad():                                                 # a peaked dense attention to learn
        layer.q_proj.weight.normal_(0, 0.5)
        layer.k_proj.weight.normal_(0, 0.5)
    x = tokens(2, 48)
    y = torch.roll(x, -1, dims=1)
    logits, loss = model(x, y)
    ce = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    assert loss.item() == ce.item()                                       # the value is the cross-entropy
    assert layer.indexer_loss is not None and layer.indexer_loss.item() > 0
    loss.backward(retain_graph=True)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ce.backward()                                                         # the cross-entropy alone
    for n, p in model.named_parameters():
        if ".index_" in n:
            assert p.grad is None or p.grad.abs().max() == 0              # top-k: no LM gradient reaches it
            assert grads[n].abs().max() > 0                               # the KL does
        else:
            torch.testing.assert_close(grads[n], p.grad, atol=0, rtol=0)   # the KL touches nothing else
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if ".index_" in n], lr=1e-2)
    first = None
    for _ in range(30):
        model(x, y)
        kl = layer.indexer_loss
        first = kl.item() if first is None else first
        opt.zero_grad()
        kl.backward()
        opt.step()
    assert kl.item() < 0.8 * first                                        # the indexer learns the dense attention
    model.eval()
    model(x, y)
    assert layer.indexer_loss is None                                     # no KL in eval mode


# ---------------------------------------------------------------------------------------------
# delta: chunked (training) and recurrent (decoding) agree
# ---------------------------------------------------------------------------------------------

def test_delta_layer_chunked_equals_recurrent():
    torch.manual_seed(2)
    layer = GatedDeltaNet(32, 4, chunk_size=7)                            # 45 = 6 chunks of 7 and one of 3
    x = torch.randn(2, 45, 32)
    beta, g = layer.gates(x)
    assert bool((beta > 0).all() and (beta < 1).all() and (g <= 0).all() and (g < 0).any())
    chunked = layer(x)
    layer.chunk_size = 64
    torch.testing.assert_close(layer(x), chunked, atol=1e-5, rtol=1e-5)
    # the recurrence token by token, through the layer's own projections
    q = F.normalize(layer.split_heads(layer.q_proj(x)), dim=-1)
    k = F.normalize(layer.split_heads(layer.k_proj(x)), dim=-1)
    o = delta_rule_recurrent(q, k, layer.split_heads(layer.v_proj(x)), beta, g)
    gate = F.silu(layer.split_heads(layer.g_proj(x)))
    torch.testing.assert_close(layer.out_proj(layer.merge_heads(layer.o_norm(o) * gate)), chunked,
                               atol=1e-5, rtol=1e-5)
    # and one token at a time through a DeltaState
    state = DeltaState(2, 4, 8, 8)
    steps = torch.cat([layer(x[:, t:t + 1], cache=state) for t in range(45)], dim=1)
    torch.testing.assert_close(steps, chunked, atol=1e-5, rtol=1e-5)
    assert state.length == 45 and state.nbytes == 2 * 4 * 8 * 8 * 4


# ---------------------------------------------------------------------------------------------
# decoding with caches equals the full forward
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,positions,n_kv_heads", [
    (["dense", "dense"], "learned", None),
    (["local", "local"], "learned", None),
    (["delta", "delta"], "learned", None),
    (["delta", "local", "selected", "dense"], "rope", 1),
    (["local", "dense", "delta"], "sinusoidal", 2),
])
def test_decoding_equals_the_full_forward(layout, positions, n_kv_heads):
    T = 44   # past window + sinks = 11: the rolling caches evict
    model = GPT(V, 48, 32, 4, len(layout), layout=layout, positions=positions, n_kv_heads=n_kv_heads,
                window=8, sinks=3, topk=1, select_block=16, seed=1).eval()
    x = tokens(2, T)
    full, _ = model(x)
    caches = model.new_caches(2)
    parts = [model.decode_step(x[:, :13], caches), model.decode_step(x[:, 13:20], caches)]   # prefill, then a chunk
    parts += [model.decode_step(x[:, t:t + 1], caches) for t in range(20, T)]               # then one at a time
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-5, rtol=2e-5)
    for block, cache in zip(model.blocks, caches):
        if isinstance(block.attn, LocalSelfAttention):
            assert isinstance(cache, RollingCache) and cache.length == 8 + 3 and cache.seen == T
        if isinstance(block.attn, GatedDeltaNet):
            assert isinstance(cache, DeltaState) and cache.state.shape == (2, 4, 8, 8)
        if isinstance(block.attn, SelectedSelfAttention):
            assert isinstance(cache, LayerInputs) and cache.length == T


def test_generate_with_and_without_cache():
    model = GPT(V, 48, 32, 2, 3, layout=["delta", "local", "dense"], window=6, sinks=2, seed=0).eval()
    prompt = tokens(1, 5)
    a = model.generate(prompt, 30, generator=torch.Generator().manual_seed(0))
    b = model.generate(prompt, 30, generator=torch.Generator().manual_seed(0), kv_cache=False)
    assert torch.equal(a, b)


def test_set_attention_leaves_other_kinds_alone():
    model = GPT(V, 32, 32, 2, 2, layout=["local", "dense"], window=6, sinks=2, seed=0).eval()
    x = tokens(1, 32)
    before, _ = model(x)
    model.set_attention("reference")
    torch.testing.assert_close(model(x)[0], before, atol=1e-5, rtol=1e-5)
    assert type(model.blocks[0].attn) is LocalSelfAttention and model.blocks[0].attn.use_reference
    maps = model.attention_maps(x)                                        # (2, 1, 2, 32, 32)
    assert maps.shape == (2, 1, 2, 32, 32)
    torch.testing.assert_close(maps.sum(-1), torch.ones(2, 1, 2, 32))
    assert maps[0, 0, :, 31, 2:26].abs().max() == 0 and maps[0, 0, :, 31, 26:].min() > 0   # local: sinks + window
    assert maps[1, 0, :, 31].min() > 0                                    # dense: every key
    with pytest.raises(ValueError, match="return_weights"):
        GPT(V, 32, 32, 2, 1, layout=["delta"]).attention_maps(x)


# ---------------------------------------------------------------------------------------------
# bytes per layout
# ---------------------------------------------------------------------------------------------

def test_layer_bytes_by_kind():
    kw = dict(d_model=64, n_heads=4, n_kv_heads=2, window=100, sinks=4, topk=3, select_block=32, index_dim=8)
    per = 2 * 2 * 16 * 2                                                  # K and V, 2 KV heads of 16, fp16
    assert layer_bytes("dense", 1000, **kw) == (1000 * per, 1000 * per)
    assert layer_bytes("dense", 1000, **kw)[0] == kv_cache_bytes(1000, 1, 2, 16, 2)
    assert layer_bytes("local", 1000, **kw) == (104 * per, 104 * per)
    assert layer_bytes("local", 50, **kw) == (50 * per, 50 * per)       # shorter than the window
    assert layer_bytes("selected", 1000, **kw) == (1000 * per + 1000 * 8 * 2, 96 * per + 1000 * 8 * 2)
    state = 4 * 16 * 16 * 4                                               # 4 heads of 16 x 16, float32
    assert layer_bytes("delta", 1000, **kw) == (state, state) == layer_bytes("delta", 10 ** 6, **kw)
    assert state == recurrent_state_bytes(1, 4, 16, 16, 4)
    with pytest.raises(ValueError, match="kind"):
        layer_bytes("global", 10, **kw)
    with pytest.raises(ValueError, match="context"):
        layer_bytes("dense", -1, **kw)


def test_layout_bytes_match_the_decoding_caches():
    layout = ["dense", "local", "delta", "selected"]
    model = GPT(V, 64, 32, 2, 4, layout=layout, window=10, sinks=2, topk=2, select_block=16, seed=0).eval()
    x = tokens(1, 64)
    caches = model.new_caches(1)
    model.decode_step(x, caches)
    nb = model_bytes(model, 64, bytes_per_element=4)                      # fp32 caches here
    held = [h for _, h, _ in nb["per_layer"]]
    assert held[0] == caches[0].k.nbytes + caches[0].v.nbytes            # dense: capacity = block_size = 64 tokens
    assert held[1] == caches[1].k.nbytes + caches[1].v.nbytes            # local: sinks + window slots, all full
    assert held[2] == caches[2].nbytes                                    # delta: the state
    assert held[3] == 64 * 2 * 32 * 4 + 64 * 16 * 4                       # selected: whole cache + indexer keys
    total = layout_bytes(layout, 64, d_model=32, n_heads=2, window=10, sinks=2, topk=2, select_block=16,
                         bytes_per_element=4)
    assert total["held"] == sum(held) and total["held_per_token"] == sum(held) / 64
    dense_long = model_bytes(GPT(V, 64, 32, 2, 4, seed=0), 4096)
    hybrid_long = model_bytes(model, 4096)
    assert dense_long["held"] == 4 * kv_cache_bytes(4096, 1, 2, 16, 2) and hybrid_long["held"] < dense_long["held"]


# ---------------------------------------------------------------------------------------------
# compare_layouts
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus():
    from attnlab.data.stdlib_text import load_corpus

    return load_corpus()


def test_compare_layouts_tiny(corpus):
    layouts = {"dense": ["dense", "dense"], "delta 1:1": ["delta", "dense"]}
    kw = dict(n_layers=2, block_size=32, eval_batches=1, eval_batch_size=4, batch_size=4)
    rows = compare_layouts(layouts, seeds=(0, 1), steps=3, corpus=corpus, context=1000, **kw)
    assert [r["name"] for r in rows] == ["dense", "delta 1:1"]
    for r in rows:
        assert len(r["val_loss"]) == 2 and r["mean"] == sum(r["val_loss"]) / 2
        assert r["spread"] == max(r["val_loss"]) - min(r["val_loss"]) and 3.0 < r["mean"] < 5.0
        nb = layout_bytes(r["layout"], 1000, d_model=32, n_heads=2)
        assert (r["held_bytes"], r["decode_bytes_per_token"]) == (nb["held"], nb["read"])
    again = compare_layouts({"dense": ["dense", "dense"]}, seeds=(1,), steps=3, corpus=corpus, context=1000, **kw)
    assert again[0]["val_loss"] == rows[0]["val_loss"][1:]                 # seeded: the same run again
    assert "dense" in format_rows(rows) and "delta 1:1" in format_rows(rows)
    _, valid, history = train_layout(["dense", "dense"], seed=1, steps=3, corpus=corpus, **kw)
    assert valid == rows[0]["val_loss"][1] and len(history["loss"]) == 3
    with pytest.raises(TypeError, match="layouts"):
        compare_layouts(["dense"], corpus=corpus)
