"""attnlab/streaming.py: StreamingLLM's rolling cache with keys kept before rotation and numbered within the cache
(Xiao et al. 2023, section 3.2), exact against attention run from scratch on the renumbered kept tokens; the GPT
run past its window under four caches."""

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention import scaled_dot_product_attention
from attnlab.models.gpt import GPT
from attnlab.positions import apply_rope, rope_angles
from attnlab.streaming import VARIANTS, StreamingCache, streaming_attend, streaming_losses


def raw(B=2, H_q=4, H_kv=2, T=45, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, T, D, generator=g) * 2
    k = torch.randn(B, H_kv, T, D, generator=g) * 2
    v = torch.randn(B, H_kv, T, D, generator=g)
    return q, k, v


def from_scratch(q, k, v, kept, scale):
    """The newest query's output when the kept tokens are a fresh sequence at positions 0 .. L - 1."""
    L = len(kept)
    cos, sin = rope_angles(L, q.shape[-1])
    qk = apply_rope(q[:, :, kept], cos, sin)                                   # (B, H_q, L, D)
    kk = apply_rope(k[:, :, kept], cos, sin).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    vk = v[:, :, kept].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return scaled_dot_product_attention(qk, kk, vk, causal=True, scale=scale)[:, :, -1:]   # (B, H_q, 1, D)


def kept_positions(t, sinks, window):
    return list(range(min(sinks, t + 1))) + list(range(max(sinks, t - window + 1), t + 1))


@pytest.mark.parametrize("sinks,window", [(3, 10), (0, 7), (4, 1)])
def test_rerotated_cache_equals_attention_from_scratch_on_the_renumbered_window(sinks, window):
    q, k, v = raw()
    cache = StreamingCache(2, 2, 16, sinks=sinks, window=window)
    for t in range(q.shape[2]):
        cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        kept = kept_positions(t, sinks, window)
        assert cache.positions == kept
        assert torch.equal(cache.cache_positions(), torch.arange(len(kept)))
        o = streaming_attend(q[:, :, t:t + 1], cache, renumber=True, scale=0.3)
        torch.testing.assert_close(o, from_scratch(q, k, v, kept, 0.3), atol=1e-5, rtol=1e-5)


def test_original_positions_are_the_rolling_caches_numbering_and_differ_only_with_sinks():
    q, k, v = raw(T=60)
    T = q.shape[2]
    cos, sin = rope_angles(T, 16)
    sink_c, win_c = StreamingCache(2, 2, 16, sinks=4, window=8), StreamingCache(2, 2, 16, sinks=0, window=8)
    gap_sinks = gap_window = 0.0
    for t in range(T):
        for c in (sink_c, win_c):
            c.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        # original positions: keys rotated once at their place in the text, as GPT + RollingCache does
        kept = sink_c.positions
        qo = apply_rope(q[:, :, t:t + 1], cos[t:t + 1], sin[t:t + 1])
        ko = apply_rope(k[:, :, kept], cos[kept], sin[kept]).repeat_interleave(2, dim=1)
        ref = scaled_dot_product_attention(qo, ko, v[:, :, kept].repeat_interleave(2, dim=1))
        torch.testing.assert_close(streaming_attend(q[:, :, t:t + 1], sink_c, renumber=False), ref,
                                   atol=1e-5, rtol=1e-5)
        gap_sinks = max(gap_sinks, (streaming_attend(q[:, :, t:t + 1], sink_c, renumber=False)
                                    - streaming_attend(q[:, :, t:t + 1], sink_c, renumber=True)).abs().max().item())
        gap_window = max(gap_window, (streaming_attend(q[:, :, t:t + 1], win_c, renumber=False)
                                      - streaming_attend(q[:, :, t:t + 1], win_c, renumber=True)).abs().max().item())
    assert gap_window < 1e-4          # a window alone: a common shift of every position changes no score
    assert gap_sinks > 1e-2           # with sinks the offsets to them differ: the numbering matters


def sharp_gpt(n_layers, block_size=32, seed=0):
    """A small rotary GPT whose attention is far from uniform (q and k projections scaled up)."""
    model = GPT(96, block_size=block_size, d_model=32, n_heads=2, n_layers=n_layers, positions="rope", n_kv_heads=1,
                seed=seed).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q_proj.weight.mul_(25)
            block.attn.k_proj.weight.mul_(25)
    return model


def test_one_layer_model_rerotated_equals_the_model_from_scratch_on_the_kept_tokens():
    model = sharp_gpt(1)
    idx = torch.randint(0, 96, (2, 22), generator=torch.Generator().manual_seed(1))
    sinks, window = 2, 6
    losses = streaming_losses(model, idx, sinks=sinks, window=window,
                              variants=("sinks + window, re-rotated", "sinks + window, original positions"))
    ours = losses["sinks + window, re-rotated"]
    assert ours.shape == (2, 21)
    for t in range(21):
        kept = kept_positions(t, sinks, window)
        logits, _ = model(idx[:, kept])                                            # a fresh run at positions 0..L-1
        torch.testing.assert_close(ours[:, t], F.cross_entropy(logits[:, -1], idx[:, t + 1], reduction="none"),
                                   atol=1e-4, rtol=1e-4)
    assert (ours - losses["sinks + window, original positions"]).abs().max() > 1e-3


def test_original_positions_and_dense_match_the_gpts_own_caches_inside_block_size():
    model = sharp_gpt(2)
    idx = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    losses = streaming_losses(model, idx, sinks=3, window=6)
    assert set(losses) == set(VARIANTS)
    _, full = model(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(losses["dense"].mean(), full, atol=1e-5, rtol=1e-5)
    caches = model.new_caches(2, sinks=3, window=6)                             # attnlab.kvcache.RollingCache
    rolling = torch.stack([F.cross_entropy(model.decode_step(idx[:, t:t + 1], caches)[:, -1], idx[:, t + 1],
                                           reduction="none") for t in range(19)], dim=1)
    torch.testing.assert_close(losses["sinks + window, original positions"], rolling, atol=1e-4, rtol=1e-4)
    # nothing evicted for the first 6 steps, then the window loses what dense keeps
    torch.testing.assert_close(losses["window"][:, :6], losses["dense"][:, :6], atol=1e-5, rtol=1e-5)
    assert (losses["window"][:, 6:] - losses["dense"][:, 6:]).abs().max() > 1e-3


def test_runs_past_block_size():
    model = sharp_gpt(1, block_size=16)
    idx = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="positions"):                         # the model's own rotary table stops
        model.decode_step(idx, model.new_caches(1, sinks=2, window=6))
    losses = streaming_losses(model, idx, sinks=2, window=6)
    assert all(torch.isfinite(x).all() and x.shape == (1, 23) for x in losses.values())


def test_errors_name_the_argument():
    q, k, v = raw()
    cache = StreamingCache(2, 2, 16, sinks=1, window=4)
    with pytest.raises(ValueError, match="cache: expected the new token"):
        streaming_attend(q[:, :, :1], cache)
    cache.append(k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="q: expected one new query"):
        streaming_attend(q[:, :, :2], cache)
    with pytest.raises(TypeError, match="renumber"):
        streaming_attend(q[:, :, :1], cache, renumber=1)
    with pytest.raises(ValueError, match="angles"):
        streaming_attend(q[:, :, :1], cache, angles=(torch.zeros(0, 8), torch.zeros(0, 8)))
    learned = GPT(96, block_size=16, d_model=32, n_heads=2, n_layers=1, seed=0)
    idx = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="model: expected rotary positions"):
        streaming_losses(learned, idx)
    with pytest.raises(ValueError, match="variants"):
        streaming_losses(sharp_gpt(1), idx, variants=("window", "sinks"))
    with pytest.raises(TypeError, match="idx"):
        streaming_losses(sharp_gpt(1), idx[0])
