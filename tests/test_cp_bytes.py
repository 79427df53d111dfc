"""Context parallelism's bytes with grouped KV heads (iomodel's ring, all-to-all and all-gather formulas), and
all-gather context parallelism (attnlab.distributed.allgather_attention) exact against one device on real gloo
groups, its bytes equal to the formula and its causal work balanced by the zigzag layout. Sizes are tiny."""

import pytest
import torch

from attnlab import iomodel
from attnlab.distributed import allgather_attention, experiments, launch
from attnlab.distributed.allgather import allgather_exactness

TOL = 1e-5   # float32: a different order of additions


def test_kv_heads_default_is_multi_head_and_scales_only_k_and_v():
    B, H, n, d, e = 2, 12, 96, 8, 2
    for P in (1, 2, 3, 4, 6):
        assert iomodel.ring_attention_bytes(B, H, n, d, P, e, kv_heads=H) == iomodel.ring_attention_bytes(B, H, n, d, P, e)
        assert iomodel.ulysses_attention_bytes(B, H, n, d, P, e, kv_heads=H) == \
            iomodel.ulysses_attention_bytes(B, H, n, d, P, e)
    # the ring sends K and V only: 3 KV heads of 12 send a quarter, forward and backward (grads in float32)
    assert iomodel.ring_attention_bytes(B, H, n, d, 4, e, kv_heads=3) == 2 * 3 * B * 3 * 24 * d * e
    assert iomodel.ring_attention_bytes(B, H, n, d, 4, e, backward=True, kv_heads=3) == \
        2 * 3 * B * 3 * 24 * d * e + 2 * 4 * B * 3 * 24 * d * 4
    # all-to-all: q and O keep all query heads; K and V move 6 / 3 = 2 heads to each rank (kv_heads >= P) ...
    assert iomodel.ulysses_attention_bytes(B, H, n, d, 3, e, kv_heads=6) == 2 * 2 * B * (4 + 2) * 32 * d * e
    # ... or, with fewer KV heads than ranks, one replicated KV head per rank (kv_heads = 2 < P = 4)
    assert iomodel.ulysses_attention_bytes(B, H, n, d, 4, e, kv_heads=2) == 2 * 3 * B * (3 + 1) * 24 * d * e


def test_with_grouped_kv_heads_ring_and_all_to_all_change_order_as_p_grows():
    # 32 query heads, 8 KV heads of 128, bf16, 32K positions per device: the lesson's numbers
    def both(P):
        args = (1, 32, 32_768 * P, 128, P, 2)
        return iomodel.ring_attention_bytes(*args, kv_heads=8), iomodel.ulysses_attention_bytes(*args, kv_heads=8)

    ring4, a2a4 = both(4)
    ring8, a2a8 = both(8)
    assert ring4 < a2a4 and ring8 > a2a8
    # with multi-head attention all-to-all sends fewer bytes at both P
    for P in (4, 8):
        args = (1, 32, 32_768 * P, 128, P, 2)
        assert iomodel.ulysses_attention_bytes(*args) < iomodel.ring_attention_bytes(*args)
    # the all-gather's forward bytes are the ring's: the same 2 (P - 1) K, V shards, all at once
    for P in (2, 4, 8):
        args = (1, 32, 4096 * P, 128, P, 2)
        assert iomodel.allgather_attention_bytes(*args, kv_heads=8) == iomodel.ring_attention_bytes(*args, kv_heads=8)
        assert iomodel.allgather_attention_bytes(*args, kv_heads=8, backward=True) == 2 * (P - 1) * 8 * 4096 * 128 * 4


def test_bad_kv_heads_are_refused():
    with pytest.raises(ValueError, match="kv_heads"):
        iomodel.ring_attention_bytes(1, 12, 48, 8, 4, kv_heads=5)              # not a divisor of the heads
    with pytest.raises(ValueError, match="kv_heads"):
        iomodel.ulysses_attention_bytes(1, 24, 48, 8, 4, kv_heads=6)           # 6 KV heads on 4 ranks
    with pytest.raises(ValueError, match="kv_heads"):
        iomodel.allgather_attention_bytes(1, 12, 48, 8, 4, kv_heads=0)
    with pytest.raises(ValueError, match="heads"):
        iomodel.ulysses_attention_bytes(1, 8, 64, 8, 16, kv_heads=8)           # 8 query heads on 16 ranks


@pytest.mark.parametrize("world", [2, 3])
def test_allgather_attention_is_exact_and_sends_what_the_formula_says(world):
    n, heads, kv_heads, d = 24, 4, 2, 8           # grouped-query: 2 query heads per KV head; 2P chunks of 24
    results = launch(allgather_exactness, world, n, heads, kv_heads, d, 1, ("contiguous", "zigzag"), (False, True),
                     0.3)                         # a scale other than 1/sqrt(d)
    fwd = iomodel.allgather_attention_bytes(1, heads, n, d, world, 4, kv_heads=kv_heads)
    bwd = iomodel.allgather_attention_bytes(1, heads, n, d, world, 4, kv_heads=kv_heads, backward=True)
    for rank, res in enumerate(results):
        assert set(res) == {(layout, c) for layout in ("contiguous", "zigzag") for c in (False, True)}
        for key, got in res.items():
            for name in ("O", "dQ", "dK", "dV"):
                assert got[name] < TOL, (rank, key, name, got[name])
            assert (got["sent_forward"], got["received_forward"]) == (fwd, fwd), (rank, key)
            assert (got["sent_backward"], got["received_backward"]) == (bwd, bwd), (rank, key)
    # causal work per rank: zigzag equal on every rank, contiguous growing with the rank
    zig = [r["zigzag", True]["flops"] for r in results]
    cont = [r["contiguous", True]["flops"] for r in results]
    assert len(set(zig)) == 1 and cont == sorted(cont) and cont[0] < cont[-1]
    assert sum(zig) == sum(cont)


def test_the_ring_and_all_to_all_measured_bytes_with_kv_heads_given():
    heads, n, d = 2, 8, 4
    res = launch(experiments.exactness, 2, n, heads, d, 1, "plain", ("ring-contiguous", "ulysses"), (False,))
    for r in res:
        assert r["ring-contiguous", False]["sent_forward"] == iomodel.ring_attention_bytes(1, heads, n, d, 2, 4,
                                                                                             kv_heads=heads)
        assert r["ulysses", False]["sent_forward"] == iomodel.ulysses_attention_bytes(1, heads, n, d, 2, 4,
                                                                                        kv_heads=heads)


def test_allgather_attention_checks_its_arguments_before_any_collective():
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="k"):
        allgather_attention(q, torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8))   # 3 KV heads for 4 query heads
    with pytest.raises(ValueError, match="layout"):
        allgather_attention(q, q, q, layout="striped")
    with pytest.raises(TypeError, match="scale"):
        allgather_attention(q, q, q, scale="0.1")
    with pytest.raises(RuntimeError, match="launch"):
        allgather_attention(q, q[:, :2], q[:, :2], causal=True)                    # no process group
