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
from attnlab.widgets._base import png_size

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
    bundle, metadata = widget._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    png = base64.b64decode(bundle["image/png"])
    assert png.startswith(PNG)
    # rendered at twice the pixels, shown at CSS size: sharp on a 2x display, no bigger on a 1x one
    w, h = png_size(png)
    assert metadata["image/png"] == {"width": w // 2, "height": h // 2}
    assert widget._image.layout.width == f"{png_size(widget.png)[0] // 2}px"
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
    from attnlab.attention import AdditiveAttention

    # one head: 4 decoder steps over 5 source words, the weights of Bahdanau's additive attention
    torch.manual_seed(1)
    attn = AdditiveAttention(query_dim=8, key_dim=8, hidden_dim=16)
    keys = torch.randn(1, 5, 8).expand(4, 5, 8)
    _, align = attn(torch.randn(4, 8), keys)  # (4 decoder steps, 5 source words)
    m = AttentionMap(align, query_tokens=["le", "chat", "est", "noir"], key_tokens=["the", "cat", "is", "black", "<eos>"])
    assert m.n_heads == 1 and m.head.value == 0 and m.current_weights.shape == (4, 5)
    m.query.value = 1
    assert m.top_keys()[0][1] == ["the", "cat", "is", "black", "<eos>"][int(align[1].argmax())]
    _assert_shows(m)


def test_attention_map_batch_from_multihead_attention_and_from_a_list():
    from attnlab.attention import MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4)
    x = torch.randn(3, 6, 16)  # (B, N, d_model)
    _, w = mha(x, return_weights=True)  # (B, heads, N, N)
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


# ------------------------------------------------------------------------------ MemoryTraffic
@pytest.fixture(scope="module")
def traces():
    """Real traces of the real kernels (Triton's interpreter on the CPU), one small shape."""
    from attnlab.kernels import block_sparse_attention, flash_attention, local_mask, standard_attention
    from attnlab.memory import trace

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 16, generator=g) for _ in range(3))
    return {
        "standard": trace(standard_attention, q, k, v, block_m=16, block_n=16),
        "flash": trace(flash_attention, q, k, v, block_m=16, block_n=16),
        "block-sparse": trace(block_sparse_attention, q, k, v, local_mask(64, 64, 16, (16, 16))),
    }


def test_memory_traffic_counters_reach_the_trace_totals(traces):
    w = MemoryTraffic(*traces.values(), labels=list(traces), sram_study=False)
    _assert_shows(w)
    n = {name: len(t.events) for name, t in traces.items()}
    assert w.step.max == max(n.values()) == w.play.max and w.step.value == w.step.max
    for c, (name, t) in zip(w.counters, traces.items()):  # at the end: exactly the trace's totals
        assert c["label"] == name and c["step"] == n[name]
        assert (c["bytes_read"], c["bytes_written"]) == (t.bytes_read, t.bytes_written) == (c["total_read"], c["total_written"])
    w.step.value = 0
    assert all(c["bytes_read"] == c["bytes_written"] == 0 for c in w.counters)
    assert w.sram_contents(0) == (None, [])
    # halfway: every trace is at its own prefix of events, clipped to its length
    w.step.value = n["flash"] + 3
    flash = w.counters[1]
    assert flash["step"] == n["flash"] and flash["bytes_read"] == traces["flash"].bytes_read
    std_events = traces["standard"].events[: n["flash"] + 3]
    assert w.counters[0]["bytes_read"] == sum(e.nbytes for e in std_events if e.op == "load")
    assert w.counters[0]["bytes_written"] == sum(e.nbytes for e in std_events if e.op == "store")
    _assert_shows(w)


def test_memory_traffic_shows_flash_rereading_k_and_v(traces):
    w = MemoryTraffic(traces["flash"], traces["standard"], labels=["flash", "standard"], sram_study=False)
    flash, std = w.replays
    reads, writes = flash.counts("K", flash.n)
    assert (reads == 64 // 16).all() and (writes == 0).all()  # every K element read once per query block
    reads, writes = flash.counts("Q", flash.n)
    assert (reads == 1).all()
    reads, writes = std.counts("S", std.n)
    assert (writes == 1).all() and (reads == 1).all()  # S written by one kernel, read by the next
    # the SRAM panel: a flash program holds its Q tile and the K, V tiles of the current step
    w.step.value = 5
    program, held = w.sram_contents(0)
    last = traces["flash"].events[4]
    assert program == (last.launch, tuple(last.program))
    names = [h[0] for h in held]
    assert "Q" in names and names[-1] == last.tensor
    assert held[-1][2] == tuple(last.rows) and held[-1][4] == last.nbytes
    assert all(h[2][1] - h[2][0] <= 16 for h in held)  # tiles, not whole tensors


def test_memory_traffic_several_heads_and_sram_study():
    from attnlab.iomodel import flash_forward_io
    from attnlab.kernels import standard_attention
    from attnlab.memory import trace

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))
    w = MemoryTraffic(trace(standard_attention, q, k, v, block_m=16, block_n=16), sram_shape=(64, 32))
    r = w.replays[0]
    # both heads stacked: every element of S and P of both heads written once and read once, although
    # the softmax kernel sees P as (B*H*N, N) and the PV kernel as (B, H, N, N)
    for name in ("S", "P"):
        reads, writes = r.counts(name, r.n)
        assert reads.shape == (2 * 32, 32) and (reads == 1).all() and (writes == 1).all(), name
    reads, _ = r.counts("Q", r.n)
    assert reads.shape == (64, 16) and (reads == 1).all()
    study = w.sram_study
    for m in (1, 16, 256):
        w.sram_kib.value = m
        s = study.summary()
        # what the traced kernel moved equals what the IO model predicts for the same blocks
        bm, bn = s["live_blocks"]
        assert s["live_bytes"] == flash_forward_io(1, 1, 64, 64, 32, 4, block_m=bm, block_n=bn).total_bytes
    assert study.summary()["large_bytes"] < flash_forward_io(1, 1, 4096, 4096, 64, 2, sram_bytes=1024).total_bytes
    assert study.image.value and isinstance(study.to_figure(), Figure)
    # the static picture holds the replay (one tensor panel each + SRAM panel) and the SRAM plot's two axes
    panels = len(w.replays[0].names) + 1
    assert len(w.to_figure().axes) == panels + 2 and len(w._make_figure()["fig"].axes) == panels


def test_memory_traffic_rejects_bad_input(traces):
    from attnlab.memory import MemoryTrace

    with pytest.raises(ValueError, match="traces: expected at least one"):
        MemoryTraffic()
    with pytest.raises(ValueError, match=r"traces\[0\]: the trace has no events"):
        MemoryTraffic(MemoryTrace(), sram_study=False)
    with pytest.raises(TypeError, match=r"traces\[1\]: expected a MemoryTrace"):
        MemoryTraffic(traces["flash"], "not a trace", sram_study=False)
    with pytest.raises(ValueError, match="labels: expected one label per trace"):
        MemoryTraffic(traces["flash"], labels=["a", "b"], sram_study=False)
    with pytest.raises(ValueError, match="sram_shape"):
        MemoryTraffic(traces["flash"], sram_shape=(64, 48))
    with pytest.raises(TypeError, match="sram_shape"):
        MemoryTraffic(traces["flash"], sram_shape=64)


# ------------------------------------------------------------------------------ BlockMaskEditor
def test_block_mask_editor_presets_match_the_kernels_helpers():
    from attnlab import kernels

    e = BlockMaskEditor(6, 6, block_size=(32, 32), preset="causal")
    _assert_shows(e)
    n = 6 * 32
    expected = {
        "causal": kernels.causal_block_mask(n, n, (32, 32)),
        "local": kernels.local_mask(n, n, window=32, block_size=(32, 32)),  # param 2: one block either side
        "strided": kernels.strided_mask(n, n, stride=2, block_size=(32, 32)),
        "global": kernels.global_mask(n, n, num_blocks=2, block_size=(32, 32)),
        "random": kernels.random_mask(n, n, density=0.3, block_size=(32, 32), seed=0),
    }
    for name, bm in expected.items():
        e.preset.value = name
        np.testing.assert_array_equal(e.mask, bm.mask[0, 0].numpy(), err_msg=name)
        assert math.isclose(e.density, bm.density, rel_tol=1e-6)
        assert math.isclose(e.block_mask.density, e.density, rel_tol=1e-6)
    e.preset.value = "dense"
    assert e.density == 1.0
    e.preset.value = "empty"
    assert e.density == 0.0


def test_block_mask_editor_clicks_costs_and_kernel_mask():
    from attnlab.kernels import block_sparse_attention

    e = BlockMaskEditor(4, 4, block_size=(16, 16), head_dim=16, dtype="float32", preset="local")
    start = e.mask.copy()
    e.buttons[0][3].value = True  # a learner clicks the top-right tile
    assert e.preset.value == "custom" and e.mask[0, 3] and e.mask.sum() == start.sum() + 1
    assert math.isclose(e.density, e.mask.mean())
    np.testing.assert_array_equal(e.element_mask(), np.kron(e.mask, np.ones((16, 16), bool)))
    # FLOPs scale with the tiles kept; block-sparse moves fewer bytes than dense flash
    c = e.costs
    assert math.isclose(c["sparse"]["flops"] / c["dense"]["flops"], e.density)
    assert c["sparse"]["bytes"] < c["dense"]["bytes"] < c["standard"]["bytes"]
    assert "density 0.688" in e.stats_html.value
    # the BlockMask runs in the kernels and means what the element mask says
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 16, generator=g) for _ in range(3))
    out = block_sparse_attention(q, k, v, e.block_mask)
    keep = torch.from_numpy(e.element_mask())
    s = (q @ k.transpose(-2, -1) / 4.0).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=1e-4, atol=1e-4)
    e.set_mask(np.eye(4, dtype=bool))
    assert e.density == 0.25 and e.preset.value == "custom"
    _assert_shows(e)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((0, 4), {}, ValueError, "n_q_blocks"),
        ((4, 64), {}, ValueError, "n_k_blocks"),
        ((4.5, 4), {}, TypeError, "n_q_blocks"),
        ((4, 4), {"block_size": (48, 64)}, ValueError, "block_size"),
        ((4, 4), {"block_size": 64}, TypeError, "block_size"),
        ((4, 4), {"dtype": "int8"}, ValueError, "dtype"),
        ((4, 4), {"preset": "diagonal"}, ValueError, "preset"),
    ],
)
def test_block_mask_editor_rejects_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        BlockMaskEditor(*args, **kwargs)


# ------------------------------------------------------------------------------ static fallback
def test_stored_notebook_output_carries_a_png_that_nbconvert_shows(tmp_path):
    """A notebook run without a frontend (nbclient, as nbval and CI do) stores the widget view and a PNG;
    nbconvert's HTML shows the PNG when the notebook holds no widget state (JupyterLab's default when
    saving; nbclient with store_widget_state=False), where it would otherwise show nothing offline."""
    import os

    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import numpy as np\nfrom attnlab.widgets import AttentionMap\n"
        "m = AttentionMap(np.eye(3), query_tokens=['a', 'b', 'c'])\nm"
    ), nbformat.v4.new_code_cell("m.query.value = 1\nm.to_figure()")]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([repo, env_path]) if env_path else repo
    try:
        NotebookClient(nb, timeout=120, kernel_name="python3", store_widget_state=False,
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
        if not env_path:
            del os.environ["PYTHONPATH"]
    # to_figure() at the end of a cell shows the picture of the state after the change
    assert [o["output_type"] for o in nb.cells[1].outputs] == ["execute_result"]
    assert base64.b64decode(nb.cells[1].outputs[0]["data"]["image/png"]).startswith(PNG)
    data = nb.cells[0].outputs[-1]["data"]
    assert {"application/vnd.jupyter.widget-view+json", "image/png", "text/plain"} <= set(data)
    assert base64.b64decode(data["image/png"]).startswith(PNG)
    assert nb.cells[0].outputs[-1]["metadata"]["image/png"]["width"] == png_size(base64.b64decode(data["image/png"]))[0] // 2
    assert "widgets" not in nb.metadata
    html, _ = HTMLExporter().from_notebook_node(nb)
    assert "data:image/png;base64," + data["image/png"][:40] in html


def test_all_heads_view_labels_each_head_above_its_map():
    """Lesson 04's overview: every "head i" label lies outside every map (was drawn half over them)."""
    w = AttentionMap(_attention_weights(1, 6, 12, 12), query_tokens=[str(10 + i) for i in range(12)])
    w.head.value = "all"
    fig = w.to_figure()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    maps = [ax for ax in fig.axes if ax.images and ax.get_title()]
    assert [ax.get_title() for ax in maps] == [f"head {h}" for h in range(6)]
    for ax in maps:
        label = ax.title.get_window_extent(renderer)
        for other in maps:
            assert not label.overlaps(other.get_window_extent(renderer)), (ax.get_title(), other.get_title())


def test_top_keys_name_query_and_key_positions():
    tokens = [str(10 + i) for i in range(6)]  # numeric tokens: the position tells them apart from the numbers
    w = AttentionMap(_attention_weights(1, 1, 6, 6)[0, 0], query_tokens=tokens)
    w.query.value = 3
    assert "keys of query 3 <code>13</code>" in w.top_keys_html.value
    j, tok, _ = w.top_keys()[0]
    assert f"{j}:&nbsp;{tok}" in w.top_keys_html.value
    assert [label for label, _ in w.query.options][4] == "3: 13"
    fig = w.to_figure()
    assert any(ax.get_title() == "top keys of query 3 '13'" for ax in fig.axes)


def test_block_mask_editor_greys_out_the_parameters_its_preset_ignores():
    e = BlockMaskEditor(8, 8, preset="local")
    assert not e.param.disabled and e.density_target.disabled and e.seed.disabled
    assert "random" in e.density_target.tooltip
    before = e.mask.copy()
    e.density_target.value = 0.9  # the local preset has no density: the mask stays, and the slider said so
    assert (e.mask == before).all()
    e.preset.value = "random"
    assert e.param.disabled and not e.density_target.disabled and not e.seed.disabled
    e.density_target.value = 0.2
    sparse = e.density
    e.density_target.value = 0.9
    assert e.density > sparse
    e.buttons[0][0].value = not e.buttons[0][0].value  # a click: "custom", where no parameter applies
    assert e.preset.value == "custom" and e.param.disabled and e.density_target.disabled


def test_memory_traffic_says_its_sram_slider_is_in_the_folded_panel(traces):
    t = MemoryTraffic(traces["standard"], labels=["standard"])
    assert t.sram_panel.selected_index is None  # folded away: the replay alone fits a laptop screen
    title = t.sram_panel.get_title(0)
    assert "slider" in title and "click to open" in title
    assert t.sram_kib in t.sram_study.box.children or any(
        t.sram_kib in getattr(c, "children", ()) for c in t.sram_study.box.children)


def test_every_widget_hides_the_broken_link_icons_of_a_saved_view(traces):
    from attnlab.widgets._base import DISCONNECTED_STYLE

    editor = BlockMaskEditor(8, 8)
    for w in (editor, MemoryTraffic(traces["standard"], labels=["standard"], sram_study=False), ScalingExplorer(d_k=16),
              AttentionMap(torch.softmax(torch.randn(4, 4), -1))):
        style = w.children[0]
        assert style.value == DISCONNECTED_STYLE and style.layout.display == "none"
        assert "attnlab-widget" in w._dom_classes
    assert ".attnlab-widget .jupyter-widgets-disconnected::before{display:none" in DISCONNECTED_STYLE
