"""Tests of attnlab.approx (local window, Linformer-style, Performer-style) and attnlab.measure."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.approx import (
    linformer_attention,
    linformer_io,
    linformer_projection,
    local_window_attention,
    local_window_block_mask,
    local_window_io,
    local_window_mask,
    local_window_path_length,
    path_length,
    performer_attention,
    performer_features,
    performer_io,
    relative_error,
)
from attnlab.measure import longest_sequence, peak_memory, random_qkv, scaling_sweep, time_call


def _qkv(n=64, d=16, b=1, h=2, seed=0, norm=1.0):
    q, k, v = random_qkv(n, d, b, h, seed=seed)
    return q * norm, k * norm, v


def _smooth(n=128, d=16, seed=0):
    """Keys and queries that vary slowly along the sequence (what low rank can exploit)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, n, d, generator=g).cumsum(-2) / 8
    return x - x.mean(-2, keepdim=True)


# ----------------------------------------------------------------------------- local window
def test_local_window_mask_small():
    m = local_window_mask(5, 5, 1)
    expected = torch.tensor(
        [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(m, expected)
    assert torch.equal(local_window_mask(5, 5, 1, causal=True), expected & torch.ones(5, 5, dtype=torch.bool).tril())
    assert torch.equal(local_window_mask(4, 4, 0), torch.eye(4, dtype=torch.bool))
    assert torch.equal(local_window_mask(3, 6, 10), torch.ones(3, 6, dtype=torch.bool))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,n_k,window,bs", [(256, 256, 32, (64, 64)), (100, 70, 5, (16, 32)), (33, 33, 0, (16, 16)),
                                               (70, 100, 40, (32, 16))])
def test_block_mask_is_the_element_mask_exactly(n_q, n_k, window, bs, causal):
    elem = local_window_mask(n_q, n_k, window, causal=causal)
    blocks = local_window_block_mask(n_q, n_k, window, block_size=bs, causal=causal)
    assert blocks.shape == (1, 1, math.ceil(n_q / bs[0]), math.ceil(n_k / bs[1]))
    assert torch.equal(blocks.to_element_mask()[0, 0], elem)     # exact: not a block-aligned window
    # the tiles computed are those holding a kept element; full ones hold nothing else
    padded = torch.zeros(blocks.shape[2] * bs[0], blocks.shape[3] * bs[1], dtype=torch.bool)
    padded[:n_q, :n_k] = elem
    tiles = padded.view(blocks.shape[2], bs[0], blocks.shape[3], bs[1]).permute(0, 2, 1, 3)
    assert torch.equal(tiles.any(-1).any(-1), blocks.mask[0, 0])
    assert torch.equal(tiles.all(-1).all(-1), blocks.full_blocks[0, 0])


def test_local_window_attention_matches_masked_sdpa():
    pytest.importorskip("attnlab.attention")
    q, k, v = _qkv(48, 8)
    for causal in (False, True):
        mask = local_window_mask(48, 48, 5, causal=causal)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(local_window_attention(q, k, v, 5, causal=causal), expected, atol=1e-5, rtol=1e-5)
    # a window wider than the sequence is exact attention
    torch.testing.assert_close(local_window_attention(q, k, v, 100), F.scaled_dot_product_attention(q, k, v),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,window", [(64, 4), (50, 7), (32, 31), (17, 1)])
def test_path_length_matches_formula(n, window):
    assert path_length(local_window_mask(n, n, window)) == local_window_path_length(n, window)
    assert path_length(local_window_mask(n, n, window, causal=True)) == local_window_path_length(n, window)


def test_path_length_full_attention_is_one_and_disconnected_is_none():
    assert path_length(torch.ones(10, 10, dtype=torch.bool)) == 1
    assert path_length(torch.ones(10, 10, dtype=torch.bool).tril()) == 1
    assert path_length(torch.eye(10, dtype=torch.bool)) is None


def test_local_window_bad_input():
    with pytest.raises(ValueError, match="window"):
        local_window_mask(4, 4, -1)
    with pytest.raises(TypeError, match="window"):
        local_window_mask(4, 4, 1.5)
    with pytest.raises(ValueError, match="n_q"):
        local_window_mask(0, 4, 1)
    with pytest.raises(TypeError, match="block_size"):
        local_window_block_mask(8, 8, 1, block_size=4)
    with pytest.raises(ValueError, match="mask"):
        path_length(torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        path_length(torch.ones(3, 3))


# ----------------------------------------------------------------------------- Linformer
def test_linformer_shapes_and_exact_limit():
    q, k, v = _qkv(64, 16)
    out = linformer_attention(q, k, v, rank=8)
    assert out.shape == q.shape
    # pooling with rank == n is the identity projection: exact attention
    torch.testing.assert_close(linformer_attention(q, k, v, rank=64), F.scaled_dot_product_attention(q, k, v),
                               atol=1e-5, rtol=1e-5)
    # different q length and value width
    out = linformer_attention(q[:, :, :10], k, torch.randn(1, 2, 64, 5), rank=16)
    assert out.shape == (1, 2, 10, 5)


def test_linformer_pool_is_exact_on_repeated_segments_even_when_uneven():
    # n = 10, rank = 3: segments of 3, 3, 4 positions; within a segment keys and values repeat,
    # so a pooled key with its log(segment length) bias stands exactly for its segment
    g = torch.Generator().manual_seed(1)
    seg_k, seg_v = torch.randn(1, 1, 3, 8, generator=g), torch.randn(1, 1, 3, 4, generator=g)
    counts = torch.tensor([3, 3, 4])
    k = seg_k.repeat_interleave(counts, dim=2)
    v = seg_v.repeat_interleave(counts, dim=2)
    q = torch.randn(1, 1, 7, 8, generator=g)
    torch.testing.assert_close(linformer_attention(q, k, v, rank=3), F.scaled_dot_product_attention(q, k, v),
                               atol=1e-5, rtol=1e-5)


def test_linformer_error_decreases_with_rank():
    x = _smooth(128, 16)
    exact = F.scaled_dot_product_attention(x, x, x)
    errors = [relative_error(linformer_attention(x, x, x, rank=r), exact) for r in (4, 16, 64, 128)]
    assert errors[0] > errors[1] > errors[2] > errors[3]
    assert errors[3] < 1e-5


def test_linformer_gaussian_projection_is_seeded():
    e1, f1 = linformer_projection(32, 8, projection="gaussian", seed=3)
    e2, f2 = linformer_projection(32, 8, projection="gaussian", seed=3)
    e3, _ = linformer_projection(32, 8, projection="gaussian", seed=4)
    assert torch.equal(e1, e2) and torch.equal(f1, f2) and not torch.equal(e1, e3) and not torch.equal(e1, f1)
    e, f = linformer_projection(10, 3)
    torch.testing.assert_close(e.sum(1), torch.ones(3))  # segment means
    assert torch.equal(e, f)
    q, k, v = _qkv(32, 8)
    out = linformer_attention(q, k, v, rank=8, projection="gaussian", seed=3)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_linformer_bad_input():
    q, k, v = _qkv(16, 8)
    with pytest.raises(ValueError, match="rank"):
        linformer_attention(q, k, v, rank=32)  # pooling cannot go above n
    with pytest.raises(ValueError, match="rank"):
        linformer_attention(q, k, v, rank=0)
    with pytest.raises(ValueError, match="projection"):
        linformer_attention(q, k, v, rank=4, projection="learned")
    with pytest.raises(ValueError, match="q"):
        linformer_attention(q[0], k, v, rank=4)
    with pytest.raises(ValueError, match="v"):
        linformer_attention(q, k, v[:, :, :8], rank=4)
    with pytest.raises(TypeError, match="k"):
        linformer_attention(q, k.tolist(), v, rank=4)


# ----------------------------------------------------------------------------- Performer
def test_performer_shapes_seeded_and_finite():
    q, k, v = _qkv(32, 16, norm=0.5)
    a = performer_attention(q, k, v, num_features=64, seed=1)
    b = performer_attention(q, k, v, num_features=64, seed=1)
    c = performer_attention(q, k, v, num_features=64, seed=2)
    assert a.shape == q.shape and torch.equal(a, b) and not torch.equal(a, c)
    # large inputs: the stabiliser keeps it finite
    big = performer_attention(q * 30, k * 30, v, num_features=32)
    assert torch.isfinite(big).all()


@pytest.mark.parametrize("causal", [False, True])
def test_performer_error_decreases_with_features(causal):
    q, k, v = _qkv(64, 16, norm=0.5)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def mean_error(m):
        return sum(relative_error(performer_attention(q, k, v, m, seed=s, causal=causal), exact) for s in range(4)) / 4

    e16, e256, e4096 = mean_error(16), mean_error(256), mean_error(4096)
    assert e16 > e256 > e4096
    assert e4096 < 0.1


def test_performer_features_orthogonal_blocks():
    w = performer_features(8, 20, seed=0)
    assert w.shape == (20, 8)
    unit = w / w.norm(dim=1, keepdim=True)
    gram = unit[:8] @ unit[:8].T
    torch.testing.assert_close(gram, torch.eye(8), atol=1e-5, rtol=0)
    plain = performer_features(8, 20, seed=0, orthogonal=False)
    assert not torch.allclose(plain[:8] @ plain[:8].T / 8, torch.eye(8), atol=0.05)


def test_performer_bad_input():
    q, k, v = _qkv(16, 8)
    with pytest.raises(ValueError, match="num_features"):
        performer_attention(q, k, v, num_features=0)
    with pytest.raises(ValueError, match="causal"):
        performer_attention(q[:, :, :4], k, v, causal=True)
    with pytest.raises(ValueError, match="scale"):
        performer_attention(q, k, v, scale=-1.0)
    with pytest.raises(TypeError, match="q"):
        performer_attention(q.to(torch.int64), k, v)
    with pytest.raises(TypeError, match="k: expected dtype"):
        performer_attention(q.double(), k, v)


def test_relative_error_checks_shapes():
    assert relative_error(torch.ones(3), torch.ones(3)) == 0.0
    with pytest.raises(ValueError, match="approx"):
        relative_error(torch.ones(3), torch.ones(4))


# ----------------------------------------------------------------------------- costs
def test_costs_follow_iomodel_conventions():
    from attnlab.iomodel import IO, standard_forward_io

    n, d, k, m = 1024, 64, 128, 256
    lin = linformer_io(1, 1, n, d, rank=k, bytes_per_element=4)
    assert isinstance(lin, IO)
    assert lin.flops == 4 * k * n * d + 4 * n * k * d  # E K, F V, Q K'^T, P V'
    assert lin.parts["S = Q K'^T"].bytes_written == 4 * n * k  # the n x rank score matrix, float32
    assert set(lin.parts) == {"K' = E K", "V' = F V", "S = Q K'^T", "P = softmax(S)", "O = P V'"}
    perf = performer_io(2, 3, n, d, num_features=m)
    assert perf.flops == 6 * (4 * n * d * m + 4 * n * m * d + 2 * n * m)
    assert perf.total_bytes == 6 * performer_io(1, 1, n, d, num_features=m).total_bytes
    # a window that covers everything is the dense block-sparse kernel: as many FLOPs as standard attention
    full = local_window_io(1, 1, 512, d, window=512, block_size=(64, 64))
    assert full.flops == standard_forward_io(1, 1, 512, d=d).flops


def test_approximate_costs_scale_linearly_and_standard_quadratically():
    from attnlab.iomodel import standard_forward_io

    for cost in (lambda n: linformer_io(1, 1, n, 64, rank=128), lambda n: performer_io(1, 1, n, 64, num_features=128),
                 lambda n: local_window_io(1, 1, n, 64, window=128)):
        a, b = cost(2048), cost(4096)
        assert 1.9 < b.flops / a.flops <= 2.05 and 1.9 < b.total_bytes / a.total_bytes <= 2.05  # edges
    a, b = standard_forward_io(1, 1, 2048, d=64), standard_forward_io(1, 1, 4096, d=64)
    assert 3.9 < b.total_bytes / a.total_bytes <= 4
    assert local_window_io(1, 1, 4096, 64, window=128).flops < standard_forward_io(1, 1, 4096, d=64).flops / 8


def test_cost_bad_input():
    with pytest.raises(ValueError, match="rank"):
        linformer_io(1, 1, 128, 64, rank=0)
    with pytest.raises(TypeError, match="n"):
        performer_io(1, 1, 128.0, 64)
    with pytest.raises(ValueError, match="window"):
        local_window_io(1, 1, 128, 64, window=-2)


# ----------------------------------------------------------------------------- measurement
def test_peak_memory_sees_a_known_allocation():
    def make():
        a = torch.ones(1024, 1024)  # 4 MiB
        b = a * 2  # 4 MiB more, both alive
        del a
        return b.sum()

    _, peak = peak_memory(make)
    assert 8 * 2**20 <= peak < 8 * 2**20 + 64 * 1024


def test_peak_memory_of_unfused_attention_holds_the_n_by_n_matrices():
    q, k, v = random_qkv(512, 32)

    def unfused(q, k, v):
        s = q @ k.transpose(-2, -1)  # (1, 1, 512, 512)
        p = s.softmax(-1)
        return p @ v

    _, peak = peak_memory(unfused, q, k, v)
    assert peak >= 2 * 512 * 512 * 4  # S and P alive together


def test_longest_sequence_finds_the_boundary():
    def square(q, k, v):  # allocates n^2 floats beyond its inputs
        return torch.ones(q.shape[-2], q.shape[-2]).sum()

    budget = 4 * 2**20
    res = longest_sequence(square, budget, d=8, step=32, n_start=64, n_max=4096)
    n = res["n"]
    assert res["peak_bytes"] <= budget < res["peak_over"]
    assert res["n_over"] == n + 32
    inputs = lambda n: 3 * n * 8 * 4  # noqa: E731
    assert n * n * 4 + inputs(n) <= budget < (n + 32) ** 2 * 4 + inputs(n + 32)
    # a budget nothing fits, and one that everything fits
    assert longest_sequence(square, 1024, d=8, step=32, n_start=64)["n"] is None
    assert longest_sequence(square, 2**30, d=8, step=32, n_start=64, n_max=256)["n"] == 256


def test_sweep_and_timer():
    rows = scaling_sweep({"sdpa": F.scaled_dot_product_attention}, [32, 64], d=8, repeats=1)
    assert [(r["method"], r["n"]) for r in rows] == [("sdpa", 32), ("sdpa", 64)]
    assert all(r["seconds"] > 0 and r["peak_bytes"] >= 0 for r in rows)
    assert time_call(torch.ones, 10, repeats=2) > 0
    assert time_call(torch.ones, 10, repeats=2, reduce="min") > 0
    with pytest.raises(ValueError, match="reduce"):
        time_call(torch.ones, 10, reduce="mean")
    with pytest.raises(ValueError, match="repeats"):
        time_call(torch.ones, 10, repeats=0)
    with pytest.raises(TypeError, match="fn"):
        peak_memory(3)
    with pytest.raises(ValueError, match="budget_bytes"):
        longest_sequence(torch.ones, 0)
