"""SelectionExplorer without a browser: every control driven through ``.value``, every number checked
against the library (attnlab.sparse, attnlab.iomodel, attnlab.kernels' local_mask)."""

import base64

import pytest
import torch
from matplotlib.figure import Figure

from attnlab import iomodel
from attnlab.kernels import local_mask
from attnlab.sparse import attention_mass_kept, indexer_block_scores, select_blocks
from attnlab.widgets import SelectionExplorer
from attnlab.widgets.selection import own_qk_block_scores, window_block_indices

PNG = b"\x89PNG\r\n\x1a\n"
BS = 16


def _far_match_qk(heads=2, n=100, d=16, seed=0):
    """Keys at random, and each query block's queries pointing at one random *earlier* key block, so the
    keys a query needs are far away and depend on content (a window misses them). n = 100: ragged blocks."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(heads, n, d, generator=g)
    q = 0.3 * torch.randn(heads, n, d, generator=g)
    nqb = -(-n // BS)
    for h in range(heads):
        for i in range(2, nqb):
            j = int(torch.randint(0, i - 1, (1,), generator=g))                   # a block at least 2 back
            target = k[h, j * BS:(j + 1) * BS].mean(0)
            q[h, i * BS:min((i + 1) * BS, n)] += 3.0 * target
    return q, k


def _mass(q, k, head, block_indices):
    return attention_mass_kept(q[None, head:head + 1], k[None, head:head + 1], block_indices, block_size=BS)[0, 0]


def test_numbers_follow_k_and_equal_the_library():
    q, k = _far_match_qk()
    w = SelectionExplorer(q, k, block_size=BS, topk=1, query_block=5, head=1)
    assert w.png.startswith(PNG)
    before = w.stats
    w.topk.value = 2
    after = w.stats
    assert after["selected"]["bytes"] > before["selected"]["bytes"]                # more blocks, more bytes
    assert after["selected"]["mass"] > before["selected"]["mass"]
    assert after["selected"]["blocks"] != before["selected"]["blocks"]
    # the selection is the library's: the indexer on head 1's own q, k, then select_blocks
    scores = indexer_block_scores(q[None, 1:2], k[None, 1], block_size=BS)           # (1, nqb, nkb)
    want = select_blocks(scores, 2)[:, None]
    assert torch.equal(w.selected, want)
    assert after["selected"]["blocks"] == [b for b in want[0, 0, 5].tolist() if b >= 0]
    mass = _mass(q, k, 1, want)
    assert after["selected"]["mass"] == pytest.approx(float(mass.mean()), abs=1e-6)
    assert after["selected"]["mass_block"] == pytest.approx(float(mass[5 * BS:6 * BS].mean()), abs=1e-6)
    io = iomodel.selected_attention_forward_io(1, 1, 100, d=16, bytes_per_element=4, block_indices=want, block_size=BS)
    assert after["selected"]["bytes"] == io.total_bytes
    assert after["dense_bytes"] == iomodel.flash_forward_io(1, 1, 100, d=16, bytes_per_element=4, block_m=BS,
                                                            block_n=BS, causal=True).total_bytes
    # the window at the same k: key blocks 4, 5 of query block 5, the same bytes, less mass on this input
    assert after["window"]["blocks"] == [4, 5]
    assert after["window"]["bytes"] == after["selected"]["bytes"]
    assert after["window"]["mass"] == pytest.approx(float(_mass(q, k, 1, w.window).mean()), abs=1e-6)
    assert after["selected"]["mass"] > after["window"]["mass"] + 0.1
    # the text panel prints those numbers
    assert f"{after['selected']['mass']:.3f}" in w.stats_html.value
    assert f"{after['window']['mass']:.3f}" in w.stats_html.value


def test_query_block_head_and_curves():
    q, k = _far_match_qk(seed=1)
    w = SelectionExplorer(q, k, block_size=BS, topk=3)
    assert w.query_block.value == 6                                                 # the last block by default
    w.query_block.value = 1                                                         # only blocks 0, 1 exist
    assert w.stats["selected"]["blocks"] == [0, 1] and w.stats["window"]["blocks"] == [0, 1]
    curves = w.mass_curves
    assert len(curves["selected"]) == 7
    assert curves["selected"][-1] == pytest.approx(1.0, abs=1e-5)                  # every block: everything kept
    assert curves["window"][-1] == pytest.approx(1.0, abs=1e-5)
    assert curves["selected"][2] == pytest.approx(w.stats["selected"]["mass"], abs=1e-6)
    w.head.value = 1
    assert w.mass_curves is not curves and w.mass_curves["selected"] != curves["selected"]
    fig = w.to_figure()
    assert isinstance(fig, Figure) and len(fig.axes) == 3
    bundle, _ = w._repr_mimebundle_()
    assert base64.b64decode(bundle["image/png"]).startswith(PNG)


def test_given_block_scores_and_own_qk_default():
    q, k = _far_match_qk(heads=2, n=64)
    own = own_qk_block_scores(q[None], k[None], BS)
    assert own.shape == (1, 2, 4, 4)
    assert torch.equal(own[0, 1], indexer_block_scores(q[None, 1:2], k[None, 1], block_size=BS)[0])
    # scores that prefer the oldest blocks: the explorer selects by what it is given
    oldest = -torch.arange(4.0).expand(2, 4, 4).clone()
    w = SelectionExplorer(q, k, block_size=BS, block_scores=oldest, topk=2, query_block=3)
    assert w.stats["selected"]["blocks"] == [0, 3]                                  # block 0, and the diagonal always


def test_window_is_lesson_08s_local_mask_tiles():
    for n, topk in ((128, 3), (100, 2), (64, 1)):
        bi = window_block_indices(n, topk, BS, heads=2)
        assert bi.shape == (1, 2, -(-n // BS), topk) and bi.dtype == torch.int32
        tiles = local_mask(n, n, window=(topk - 1) * BS, block_size=(BS, BS)).mask[0, 0]
        for i in range(bi.shape[2]):
            want = [j for j in range(i + 1) if tiles[i, j]]
            assert [b for b in bi[0, 0, i].tolist() if b >= 0] == want == list(range(max(0, i - topk + 1), i + 1))


@pytest.mark.parametrize("args, kwargs, error, match", [
    (([1.0], torch.randn(2, 64, 16)), {}, TypeError, "q:"),
    ((torch.randn(2, 64, 16), torch.randn(2, 48, 16)), {}, ValueError, "k:"),
    ((torch.randn(2, 64, 16), torch.randn(2, 64, 16)), {"block_size": 24}, ValueError, "block_size"),
    ((torch.randn(2, 64, 16), torch.randn(2, 64, 16)), {"topk": 9}, ValueError, "topk"),
    ((torch.randn(2, 64, 16), torch.randn(2, 64, 16)), {"head": 2}, ValueError, "head"),
    ((torch.randn(2, 64, 16), torch.randn(2, 64, 16)), {"block_scores": torch.zeros(2, 3, 4)}, ValueError,
     "block_scores"),
    ((torch.randn(2, 64, 16), torch.randn(2, 64, 16)), {"dtype": "int8"}, ValueError, "dtype"),
    ((torch.randn(2, 16, 16), torch.randn(2, 16, 16)), {}, ValueError, "at least 2 blocks"),
])
def test_rejects_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        SelectionExplorer(*args, **kwargs)
