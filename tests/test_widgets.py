"""The four widgets without a browser: built from real data, every control driven through `.value`.

What a learner's click does in the browser is set a control's ``value`` in the
kernel; these tests do the same and check the state (and picture) that follows.
"""

import base64
import math

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from attnlab.widgets import AttentionMap, BlockMaskEditor, MemoryTraffic, ScalingExplorer

PNG = b"\x89PNG\r\n\x1a\n"


def _attention_weights(layers, heads, n_q, n_k, seed=0):
    """Real softmax(q k^T / sqrt(d)) weights of random projections: (layers, heads, n_q, n_k)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(layers, heads, n_q, 16, generator=g)
    k = torch.randn(layers, heads, n_k, 16, generator=g)
    return torch.softmax(q @ k.transpose(-2, -1) / 4.0, dim=-1)


def _assert_shows(widget):
    """The live picture is a PNG, the static fallback is in the mimebundle, to_figure() is a Figure."""
    assert widget.png.startswith(PNG)
    bundle = widget._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]).startswith(PNG)
    fig = widget.to_figure()
    assert isinstance(fig, Figure) and fig.axes


# ------------------------------------------------------------------------------ AttentionMap
TOKENS = "the cat sat on the mat".split()


def test_attention_map_layers_heads_and_query():
    w = _attention_weights(2, 3, 6, 6)
    m = AttentionMap(w, query_tokens=TOKENS)
    _assert_shows(m)
    assert m.key_tokens == TOKENS  # self-attention: keys default to the queries' tokens
    assert m.head.value == "all" and m.current_weights.shape == (3, 6, 6)
    m.layer.value = 1
    m.head.value = 2
    np.testing.assert_allclose(m.current_weights, w[1, 2].numpy(), rtol=1e-6)
    assert m.top_keys() == [] and m.selected_query is None
    m.query.value = 3
    top = m.top_keys()
    row = w[1, 2, 3].numpy()
    assert [j for j, _, _ in top] == list(np.argsort(-row, kind="stable")[:5])
    assert top[0][1] == TOKENS[top[0][0]] and math.isclose(top[0][2], row.max(), rel_tol=1e-6)
    assert "top 5 keys of query 3" in m.top_keys_html.value
    # the overview with a query picked lists the top keys of every head
    m.head.value = "all"
    assert m.top_keys_html.value.count("head ") == 3
    _assert_shows(m)
    assert m.last_redraw_ms is not None and len(m.redraw_ms) >= 5


def test_attention_map_bahdanau_alignment_and_cross_attention_tokens():
    # one head, 4 target words over 5 source words (cross-attention: key tokens differ)
    align = torch.softmax(torch.randn(4, 5, generator=torch.Generator().manual_seed(1)), dim=-1)
    m = AttentionMap(align, query_tokens=["le", "chat", "est", "noir"], key_tokens=["the", "cat", "is", "black", "<eos>"])
    assert m.n_heads == 1 and m.head.value == 0 and m.current_weights.shape == (4, 5)
    m.query.value = 1
    assert m.top_keys()[0][1] == ["the", "cat", "is", "black", "<eos>"][int(align[1].argmax())]
    _assert_shows(m)


def test_attention_map_batch_from_multihead_attention_and_from_a_list():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(embed_dim=16, num_heads=4, batch_first=True)
    x = torch.randn(3, 6, 16)  # (B, N, d_model)
    _, w = mha(x, x, x, need_weights=True, average_attn_weights=False)  # (B, heads, N, N)
    m = AttentionMap(w, query_tokens=TOKENS, batched=True)
    assert (m.n_examples, m.n_layers, m.n_heads) == (3, 1, 4)
    m.example.value = 2
    m.head.value = 1
    np.testing.assert_allclose(m.current_weights, w[2, 1].detach().numpy(), rtol=1e-6)
    # examples of different lengths, one token list each
    a, b = _attention_weights(1, 2, 3, 3)[0], _attention_weights(1, 2, 5, 5, seed=1)[0]
    m = AttentionMap([a, b], query_tokens=[["a", "b", "c"], ["v", "w", "x", "y", "z"]])
    m.query.value = 2
    m.example.value = 1  # the query selector follows the example's tokens
    assert [label for label, _ in m.query.options][-1] == "4: z" and m.selected_query == 2
    m.query.value = 4
    m.example.value = 0  # row 4 does not exist in example 0: back to none
    assert m.selected_query is None
    _assert_shows(m)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((np.ones(5),), {}, ValueError, "weights: expected shape"),
        ((np.ones((1, 1, 1, 2, 2, 2)),), {}, ValueError, "weights: expected shape"),
        ((np.ones((3, 3)), ["a", "b"]), {}, ValueError, "query_tokens: expected 3 tokens"),
        ((np.ones((3, 4)), ["a", "b", "c"], ["k"] * 3), {}, ValueError, "key_tokens: expected 4 tokens"),
        ((np.full((2, 2), np.nan),), {}, ValueError, "weights: contains NaN"),
        ((np.ones((0, 3)),), {}, ValueError, "weights: is empty"),
        (("not numbers",), {}, TypeError, "weights: expected a tensor"),
        ((np.ones((3, 3)), "abc"), {}, TypeError, "query_tokens: expected a list"),
        ((np.ones((2, 2)),), {"batched": True}, ValueError, "with batched=True"),
        (([np.ones((2, 3, 3)), np.ones((1, 3, 3))],), {}, ValueError, r"weights\[1\]: every example"),
        ((np.ones((2, 2)),), {"top_k": 0}, ValueError, "top_k"),
    ],
)
def test_attention_map_rejects_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        AttentionMap(*args, **kwargs)


# ------------------------------------------------------------------------------ ScalingExplorer
def test_scaling_explorer_shows_why_scaling_keeps_gradients():
    s = ScalingExplorer(d_k=4, n_samples=2000)
    _assert_shows(s)
    small = s.stats
    s.d_k.value = 512
    big = s.stats
    # q.k of N(0,1) vectors has std sqrt(d_k); divided by sqrt(d_k) it stays about 1
    assert abs(big["unscaled"]["score_std"] / math.sqrt(512) - 1) < 0.1
    assert abs(big["scaled"]["score_std"] - 1) < 0.1 and abs(small["scaled"]["score_std"] - 1) < 0.1
    # unscaled: the softmax saturates, its entropy and Jacobian collapse; scaled: they do not move
    assert big["unscaled"]["mean_entropy"] < 0.3 * small["unscaled"]["mean_entropy"]
    assert big["unscaled"]["mean_jacobian_norm"] < 0.5 * big["scaled"]["mean_jacobian_norm"]
    assert abs(big["scaled"]["mean_entropy"] - small["scaled"]["mean_entropy"]) < 0.2
    # a higher temperature flattens the scaled softmax
    before = s.stats["scaled"]["mean_entropy"]
    s.temperature.value = 5.0
    assert s.stats["scaled"]["mean_entropy"] > before
    # seeded: the same seed gives the same numbers; another seed other numbers
    again = ScalingExplorer(d_k=512, temperature=5.0, n_samples=2000).stats
    assert again["unscaled"]["score_std"] == s.stats["unscaled"]["score_std"]
    s.seed.value = 1
    assert s.stats["unscaled"]["score_std"] != again["unscaled"]["score_std"]
    _assert_shows(s)


def test_softmax_stats_match_autograd():
    from attnlab.widgets.scaling import softmax_stats

    x = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    jac = torch.autograd.functional.jacobian(lambda z: torch.softmax(z, -1), x)
    p = torch.softmax(x, -1)
    entropy, norm = softmax_stats(x.numpy())
    assert math.isclose(norm, torch.linalg.matrix_norm(jac).item(), rel_tol=1e-9)
    assert math.isclose(entropy, -(p * p.log()).sum().item(), rel_tol=1e-9)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"d_k": 3}, "d_k"), ({"temperature": 0}, "temperature"), ({"n_keys": 1}, "n_keys"), ({"seed": -1}, "seed")],
)
def test_scaling_explorer_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScalingExplorer(**kwargs)
