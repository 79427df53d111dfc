"""attnlab.memory: traced bytes against hand counts and against attnlab.iomodel, for every kernel; trace_ops for PyTorch ops."""

import math

import pytest
import torch

from attnlab import iomodel
from attnlab.kernels import (
    block_sparse_attention, flash_attention, local_mask, random_mask, softmax, standard_attention,
)
from attnlab.memory import MemoryEvent, MemoryTrace, TensorInfo, trace, trace_ops


def _qkv(b, h, nq, nk, d, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(dtype).requires_grad_(grad) for n in (nq, nk, nk)]


def test_softmax_hand_count_and_masked_elements_do_not_count():
    x = torch.randn(3, 100)  # BLOCK = 128: 28 padding lanes per row are masked off
    t = trace(softmax, x)
    assert t.launches == ["_softmax_kernel"]
    assert t.bytes_read == 3 * 100 * 4 and t.bytes_written == 3 * 100 * 4
    assert t.by_tensor == {"S": {"read": 1200, "written": 0}, "P": {"read": 0, "written": 1200}}
    assert t.bytes_read == iomodel.softmax_io(3, 100, 4).bytes_read
    assert t.unique_bytes_read == 1200 and t.unique_bytes_written == 1200
    assert torch.allclose(t.result, torch.softmax(x, -1))


def test_flash_forward_hand_count_and_events():
    B, H, nq, nk, d, bm, bn = 1, 2, 100, 77, 32, 32, 16
    q, k, v = _qkv(B, H, nq, nk, d)
    t = trace(flash_attention, q, k, v, block_m=bm, block_n=bn)
    assert isinstance(t, MemoryTrace)
    # by hand: Q once, K and V once per query block (4 blocks), O written once, L (fp32) once
    assert t.bytes_read == B * H * (nq * d + math.ceil(nq / bm) * 2 * nk * d) * 4
    assert t.bytes_written == B * H * (nq * d + nq) * 4
    assert t.by_tensor["K"] == {"read": B * H * 4 * nk * d * 4, "written": 0}
    assert t.unique_bytes_read == B * H * (nq + 2 * nk) * d * 4  # each byte of Q, K, V once
    assert t.total_bytes == t.bytes_read + t.bytes_written
    assert t.tensors["Q"] == TensorInfo((1, 2, 100, 32), torch.float32, 4)
    assert t.tensors["L"].shape == (1, 2, 100, 1)  # L is a column so its rows line up with Q's
    # 4 query blocks x 2 heads, in launch order
    assert t.programs() == [(m, bh, 0) for m in range(4) for bh in range(2)]
    ev = t.events_for((3, 1))  # the last query block (rows 96..99) of head 1
    assert all(isinstance(e, MemoryEvent) and e.program == (3, 1, 0) for e in ev)
    assert (ev[0].op, ev[0].tensor, ev[0].lead, ev[0].rows, ev[0].cols) == ("load", "Q", 1, (96, 100), (0, 32))
    assert ev[0].nbytes == 4 * 32 * 4  # 4 real rows, not 32
    assert [e.tensor for e in ev[1:3]] == ["K", "V"] and ev[1].rows == (0, 16)
    assert ev[-2].tensor == "O" and ev[-2].op == "store" and ev[-1].tensor == "L"
    assert ev[-1].rows == (96, 100) and ev[-1].cols == (0, 1)
    last_k = [e for e in ev if e.tensor == "K"][-1]
    assert last_k.rows == (64, 77) and last_k.nbytes == 13 * 32 * 4  # ragged last key block


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 100, 77, 32, 32, 16), (2, 1, 40, 100, 16, 64, 16), (1, 1, 1, 1, 16, 16, 16)])
def test_flash_forward_and_backward_equal_iomodel(shape, causal):
    B, H, nq, nk, d, bm, bn = shape
    q, k, v = _qkv(B, H, nq, nk, d, grad=True)
    t = trace(flash_attention, q, k, v, causal=causal, block_m=bm, block_n=bn)
    m = iomodel.flash_forward_io(B, H, nq, nk, d, 4, block_m=bm, block_n=bn, causal=causal)
    assert (t.bytes_read, t.bytes_written) == (m.bytes_read, m.bytes_written)
    o = t.result
    tb = trace(o.backward, torch.ones_like(o))
    mb = iomodel.flash_backward_io(B, H, nq, nk, d, 4, block_m=bm, block_n=bn, causal=causal)
    assert tb.launches == ["_attn_bwd_preprocess_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"]
    assert (tb.bytes_read, tb.bytes_written) == (mb.bytes_read, mb.bytes_written)
    per_kernel = [(p["read"], p["written"]) for p in tb.by_launch()]
    assert per_kernel == [(mb.parts[n].bytes_read, mb.parts[n].bytes_written) for n in ("bwd_preprocess", "bwd_dkdv", "bwd_dq")]


def test_flash_fp16_bytes_and_causal_skips_blocks():
    q, k, v = _qkv(1, 1, 128, 128, 16, dtype=torch.float16)
    dense = trace(flash_attention, q, k, v, block_m=32, block_n=32)
    causal = trace(flash_attention, q, k, v, causal=True, block_m=32, block_n=32)
    assert dense.tensors["K"].element_size == 2
    assert dense.by_tensor["K"]["read"] == 4 * 128 * 16 * 2
    assert causal.by_tensor["K"]["read"] == (1 + 2 + 3 + 4) * 32 * 16 * 2  # blocks above the diagonal skipped
    assert causal.bytes_read == iomodel.flash_forward_io(1, 1, 128, 128, 16, 2, block_m=32, block_n=32, causal=True).bytes_read


@pytest.mark.parametrize("causal", [False, True])
def test_standard_forward_and_backward_equal_iomodel(causal):
    q, k, v = _qkv(1, 2, 100, 77, 32, grad=True)
    t = trace(standard_attention, q, k, v, causal=causal, block_m=32, block_n=16, block_k=16)
    assert t.launches == ["_scores_kernel", "_softmax_kernel", "_pv_kernel"]
    m = iomodel.standard_forward_io(1, 2, 100, 77, 32, 4, block_m=32)
    assert (t.bytes_read, t.bytes_written) == (m.bytes_read, m.bytes_written)
    assert t.by_tensor["S"] == {"read": 2 * 100 * 77 * 4, "written": 2 * 100 * 77 * 4}  # by hand
    o = t.result
    tb = trace(o.backward, torch.ones_like(o))
    mb = iomodel.standard_backward_io(1, 2, 100, 77, 32, 4, blocks=(32, 16, 16))
    assert (tb.bytes_read, tb.bytes_written) == (mb.bytes_read, mb.bytes_written)


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_equal_iomodel(causal):
    q, k, v = _qkv(1, 2, 100, 77, 32, grad=True)
    mask = random_mask(100, 77, 0.5, (32, 16), seed=1, batch=1, heads=2)
    t = trace(block_sparse_attention, q, k, v, mask, causal=causal)
    m = iomodel.block_sparse_forward_io(1, 2, 100, 77, 32, 4, block_mask=mask, causal=causal)
    assert (t.bytes_read, t.bytes_written) == (m.bytes_read, m.bytes_written)
    # the index lists are read too: one count per query block and one index per visited tile
    assert t.by_tensor["KV_NUM"]["read"] == 2 * 4 * 4
    o = t.result
    tb = trace(o.backward, torch.ones_like(o))
    mb = iomodel.block_sparse_backward_io(1, 2, 100, 77, 32, 4, block_mask=mask, causal=causal)
    assert (tb.bytes_read, tb.bytes_written) == (mb.bytes_read, mb.bytes_written)


def test_sparsity_scales_traffic():
    q, k, v = _qkv(1, 1, 256, 256, 16)
    dense = trace(flash_attention, q, k, v, block_m=32, block_n=32)
    local = trace(block_sparse_attention, q, k, v, local_mask(256, 256, 0, (32, 32)))  # 8 of 64 tiles
    assert local.by_tensor["K"]["read"] * 8 == dense.by_tensor["K"]["read"]


def test_trace_of_plain_function_and_bad_fn():
    t = trace(lambda: 3)
    assert t.events == [] and t.bytes_read == 0 and t.launches == [] and t.result == 3
    with pytest.raises(TypeError, match="fn: expected a callable"):
        trace(5)


def test_gpt2_comparison_small_shape():
    from attnlab.traffic import format_comparison, gpt2_medium_comparison

    res = gpt2_medium_comparison(seq=128, head_dim=16, batch=2, heads=3, flash_blocks=(32, 32), standard_blocks=(32, 32, 32))
    assert res["batch_heads"] == 6 and len(res["rows"]) == 4
    for r in res["rows"]:
        assert r["traced_bytes"] == r["model_bytes"] > 0
        assert r["gb"] == pytest.approx(r["traced_bytes"] * 6 / 1e9)
    by = {(r["method"], r["pass"]): r["traced_bytes"] for r in res["rows"]}
    assert by[("flash", "forward")] < by[("standard", "forward")]
    assert "40.3 GB vs 4.4 GB" in format_comparison(res)
    assert res["fig2"]["model_gb"]["standard"] > 0 and len(res["loop_order"]) == 4


def test_trace_ops_counts_unfused_softmax_like_triton_tutorial():
    m, n = 7, 33

    def naive_softmax(x):
        x_max = x.amax(dim=1)  # read MN, write M
        z = x - x_max[:, None]  # read MN + M, write MN (the broadcast is not re-read)
        num = torch.exp(z)  # read MN, write MN
        den = num.sum(dim=1)  # read MN, write M
        return num / den[:, None]  # read MN + M, write MN

    x = torch.randn(m, n)
    out, rows = trace_ops(naive_softmax, x)
    torch.testing.assert_close(out, torch.softmax(x, 1))
    assert [r["op"] for r in rows] == ["amax", "sub", "exp", "sum", "div"]
    assert sum(r["elements_read"] for r in rows) == 5 * m * n + 2 * m
    assert sum(r["elements_written"] for r in rows) == 3 * m * n + 2 * m
    assert sum(r["bytes_read"] for r in rows) == 4 * (5 * m * n + 2 * m)
    _, fused = trace_ops(torch.softmax, torch.randn(m, n), 1)
    assert sum(r["elements_read"] for r in fused) == m * n and sum(r["elements_written"] for r in fused) == m * n


def test_measure_op_traffic_is_a_deprecated_alias_of_trace_ops():
    from attnlab import measure

    x = torch.randn(3, 5)
    with pytest.warns(DeprecationWarning, match="use attnlab.memory.trace_ops"):
        out, rows = measure.op_traffic(torch.exp, x)
    assert rows == trace_ops(torch.exp, x)[1] and torch.equal(out, torch.exp(x))
