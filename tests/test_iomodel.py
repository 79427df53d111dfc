"""attnlab.iomodel: hand counts on small cases and the asymptotics of Dao et al. 2022, Theorem 2."""

import pytest
import torch

from attnlab import iomodel as io
from attnlab.kernels import BlockMask, local_mask


def test_standard_forward_hand_count():
    # N = 4, d = 2, 1 byte per element, ideal (each operand read once):
    # S = QK^T: read 8 + 8, write 16; softmax: read 16, write 16; O = PV: read 16 + 8, write 8
    m = io.standard_forward_io(1, 1, 4, 4, d=2, bytes_per_element=1)
    assert (m.bytes_read, m.bytes_written) == (56, 40)
    assert m.flops == 2 * (2 * 4 * 4 * 2)
    assert m.parts["softmax"].bytes_read == 16
    # tiled with 2-row query blocks: K and V are read twice
    t = io.standard_forward_io(1, 1, 4, 4, d=2, bytes_per_element=1, block_m=2)
    assert t.bytes_read == 56 + 8 + 8
    assert io.standard_forward_io(3, 5, 4, 4, d=2, bytes_per_element=1).bytes_read == 15 * 56
    # S kept in 4-byte elements (standard_attention's float32 S): S's write and its softmax read
    # cost 16 * 4 instead of 16; P's write and read stay 1 byte each
    f = io.standard_forward_io(1, 1, 4, 4, d=2, bytes_per_element=1, score_bytes=4)
    assert (f.bytes_read, f.bytes_written) == (56 + 3 * 16, 40 + 3 * 16)
    assert f.parts["scores"].bytes_written == 64 and f.parts["softmax"].bytes_read == 64


def test_standard_backward_hand_count():
    # ideal: dV (read P 16 + dO 8, write 8), dP (read dO 8 + V 8, write 16), dS (read 32, write 16),
    # dQ (read dS 16 + K 8, write 8), dK (read dS 16 + Q 8, write 8)
    m = io.standard_backward_io(1, 1, 4, 4, d=2, bytes_per_element=1)
    assert (m.bytes_read, m.bytes_written) == (24 + 16 + 32 + 24 + 24, 8 + 16 + 16 + 8 + 8)
    assert m.flops == 4 * 2 * 4 * 4 * 2


def test_flash_forward_hand_count():
    # N = 8, d = 2, blocks 4 x 4, 1 byte per element, L in fp32:
    # read Q 16 + 2 query blocks x (K 16 + V 16) = 80; write O 16 + L 8 x 4 = 48
    m = io.flash_forward_io(1, 1, 8, 8, d=2, bytes_per_element=1, block_m=4, block_n=4)
    assert (m.bytes_read, m.bytes_written) == (80, 48)
    # causal: tiles (0,0), (1,0), (1,1) only: K and V read for 3 blocks of 4 keys
    c = io.flash_forward_io(1, 1, 8, 8, d=2, bytes_per_element=1, block_m=4, block_n=4, causal=True)
    assert c.bytes_read == 16 + 3 * 4 * 2 * 2
    assert c.flops == 4 * 3 * 16 * 2
    # ragged: N = 6 with blocks of 4: the last blocks hold 2 rows / 2 keys
    r = io.flash_forward_io(1, 1, 6, 6, d=2, bytes_per_element=1, block_m=4, block_n=4)
    assert r.bytes_read == 12 + 2 * (2 * 6 * 2)


def test_flash_backward_hand_count():
    m = io.flash_backward_io(1, 1, 8, 8, d=2, bytes_per_element=1, block_m=4, block_n=4)
    pre = (16 * 4 + 16, 8 * 4)   # O in float32 (D's precision) and dO; write D (8 x 4 B)
    # dK/dV: K, V (32) + per visited tile (4) Q, dO (2 x 8) and L, D (2 x 4 x 4 B); write dK, dV (32)
    dkdv = (32 + 4 * (16 + 32), 32)
    # dQ: Q, dO (32) and L, D (64) + per visited tile (4) K, V (16); write dQ (16)
    dq = (32 + 64 + 4 * 16, 16)
    assert (m.bytes_read, m.bytes_written) == (pre[0] + dkdv[0] + dq[0], pre[1] + dkdv[1] + dq[1])


def test_flash_gqa_hand_count():
    # 4 query heads on 2 KV heads, N = 8, d = 2, blocks 4 x 4, 1 byte per element: the dK/dV kernel's
    # programs belong to KV heads, so K, V (32) are read and dK, dV (32) written 2 times, not 4;
    # everything else is per query head (the forward, the preprocess, Q/dO/L/D per tile, the dQ kernel)
    mha = io.flash_backward_io(1, 4, 8, 8, d=2, bytes_per_element=1, block_m=4, block_n=4)
    gqa = io.flash_backward_io(1, 4, 8, 8, d=2, bytes_per_element=1, block_m=4, block_n=4, kv_heads=2)
    assert mha.bytes_read - gqa.bytes_read == 2 * 32 and mha.bytes_written - gqa.bytes_written == 2 * 32
    assert gqa.parts["bwd_dkdv"].bytes_written == 2 * 32
    assert gqa.parts["bwd_dq"] == mha.parts["bwd_dq"] and gqa.parts["bwd_preprocess"] == mha.parts["bwd_preprocess"]
    assert io.flash_forward_io(1, 4, 8, 8, d=2, bytes_per_element=1, block_m=4, block_n=4, kv_heads=1) == \
        io.flash_forward_io(1, 4, 8, 8, d=2, bytes_per_element=1, block_m=4, block_n=4)
    with pytest.raises(ValueError, match="kv_heads: expected a divisor of heads=4, got 3"):
        io.flash_backward_io(1, 4, 8, 8, d=2, block_m=4, block_n=4, kv_heads=3)


def test_flash_forward_of_a_training_step_keeps_a_float32_o():
    # 2-byte elements with grad=True: O is written a second time in float32 (8 x 2 x 4 B); 4-byte: O is float32 already
    half = dict(d=2, bytes_per_element=2, block_m=4, block_n=4)
    assert io.flash_forward_io(1, 1, 8, 8, grad=True, **half).bytes_written == \
        io.flash_forward_io(1, 1, 8, 8, **half).bytes_written + 8 * 2 * 4
    full = dict(half, bytes_per_element=4)
    assert io.flash_forward_io(1, 1, 8, 8, grad=True, **full) == io.flash_forward_io(1, 1, 8, 8, **full)
    with pytest.raises(TypeError, match="grad: expected a bool"):
        io.flash_forward_io(1, 1, 8, 8, grad=1, **half)


def test_algorithm1_loop_order():
    # K, V read once (32); for each of 2 key blocks: read Q, O (32) and l, m (2 x 8 x 4); write O (16), l, m (64)
    m = io.flash_forward_io(1, 1, 8, 8, d=2, bytes_per_element=1, block_m=4, block_n=4, loop_order="kv_outer")
    assert (m.bytes_read, m.bytes_written) == (32 + 2 * (32 + 64), 2 * (16 + 64))


def test_paper_block_sizes():
    assert io.flash_block_sizes(100 * 1024, 64, 2) == (64, 200)   # B_c = ceil(51200 / 256), B_r = min(B_c, d)
    assert io.flash_block_sizes(8 * 1024, 64, 2) == (16, 16)
    by_sram = io.flash_forward_io(1, 1, 1024, d=64, sram_bytes=100 * 1024)
    assert by_sram == io.flash_forward_io(1, 1, 1024, d=64, block_m=64, block_n=200)


def test_theorem2_quadratic_in_n():
    d, e = 64, 2
    for n in (2048, 4096):
        std = io.standard_forward_io(1, 1, n, d=d, bytes_per_element=e).total_bytes
        std2 = io.standard_forward_io(1, 1, 2 * n, d=d, bytes_per_element=e).total_bytes
        assert 3.9 < std2 / std <= 4.0            # N d + N^2: the N^2 term dominates
        fa = io.flash_forward_io(1, 1, n, d=d, bytes_per_element=e, sram_bytes=16 * 1024).total_bytes
        fa2 = io.flash_forward_io(1, 1, 2 * n, d=d, bytes_per_element=e, sram_bytes=16 * 1024).total_bytes
        assert 3.8 < fa2 / fa <= 4.0              # N^2 d^2 / M
        assert fa < std


def test_theorem2_inverse_in_sram():
    # while B_r = M / 4d < d, doubling the SRAM halves the N^2 part of FlashAttention's traffic
    n, d, e = 4096, 64, 2
    linear = (n * d * e) + (n * d * e + n * 4)  # Q read once, O and L written once
    parts = []
    for sram in (4 * 1024, 8 * 1024, 16 * 1024):
        parts.append(io.flash_forward_io(1, 1, n, d=d, bytes_per_element=e, sram_bytes=sram).total_bytes - linear)
    assert parts[0] == 2 * parts[1] == 4 * parts[2]
    # and the model tracks the theorem's order N^2 d^2 / M up to a constant
    ratios = []
    for n_, sram in ((2048, 4096), (4096, 4096), (4096, 16384)):
        fa = io.flash_forward_io(1, 1, n_, d=d, bytes_per_element=e, sram_bytes=sram).total_bytes
        ratios.append(fa / io.theorem2(n_, d, sram // e)["flash"])
    assert max(ratios) / min(ratios) < 1.3


def test_block_sparse_density_and_mask():
    n, d, e, bs = 1024, 64, 2, (64, 64)
    full = io.block_sparse_forward_io(1, 1, n, d=d, bytes_per_element=e, density=1.0, block_size=bs)
    none = io.block_sparse_forward_io(1, 1, n, d=d, bytes_per_element=e, density=0.0, block_size=bs)
    quarter = io.block_sparse_forward_io(1, 1, n, d=d, bytes_per_element=e, density=0.25, block_size=bs)
    assert quarter.bytes_read == round(none.bytes_read + 0.25 * (full.bytes_read - none.bytes_read))
    dense = io.flash_forward_io(1, 1, n, d=d, bytes_per_element=e, block_m=64, block_n=64)
    assert full.bytes_read == dense.bytes_read + 4 * (2 * 16 + 16 * 16)  # + the int32 block lists (2 counts a row)
    ones = BlockMask(torch.ones(1, 1, 16, 16, dtype=torch.bool), bs)
    assert io.block_sparse_forward_io(1, 1, n, d=d, bytes_per_element=e, block_mask=ones) == full
    loc = local_mask(n, n, 0, bs)  # the 16 diagonal tiles, each partial: + its id and 64 x 64 int8 mask tile
    m = io.block_sparse_forward_io(1, 1, n, d=d, bytes_per_element=e, block_mask=loc)
    assert m.bytes_read == n * d * e + 16 * 2 * 64 * d * e + 4 * (2 * 16 + 16) + 16 * (4 + 64 * 64)
    b = io.block_sparse_backward_io(2, 3, n, d=d, bytes_per_element=e, block_mask=loc)
    assert b == io.block_sparse_backward_io(1, 1, n, d=d, bytes_per_element=e, block_mask=loc).scaled(6)


def test_roofline_and_machines():
    assert {"A100", "H100", "H200", "T4", "this machine"} <= set(io.MACHINES)
    a100 = io.MACHINES["A100"]
    assert a100.ridge_point == pytest.approx(312e12 / 1.555e12)
    mem = io.roofline(1e9, 1e9, "A100")
    assert mem.bound == "memory" and mem.time_s == pytest.approx(1e9 / 1.555e12)
    assert io.roofline(1e12, 1e6, "A100").bound == "compute"
    std = io.standard_forward_io(16, 16, 1024, d=64)
    fa = io.flash_forward_io(16, 16, 1024, d=64, block_m=128, block_n=64)
    assert fa.arithmetic_intensity > 3 * std.arithmetic_intensity  # same FLOPs, ~4x fewer bytes
    assert io.roofline(std, machine="A100").bound == "memory"
    assert io.roofline(fa, machine="H100").arithmetic_intensity == fa.arithmetic_intensity
    here = io.MACHINES["this machine"]
    assert here.peak_flops > 0 and here.hbm_bandwidth > 0 and "rough" in here.note


def test_attention_flops():
    assert io.attention_flops(1, 1, 4, 4, 2) == 4 * 16 * 2
    assert io.attention_flops(1, 1, 4, 4, 2, causal=True) == 4 * 10 * 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_q"):
        io.standard_forward_io(1, 1, 0)
    with pytest.raises(ValueError, match="bytes_per_element"):
        io.flash_forward_io(1, 1, 8, bytes_per_element=0, block_m=4, block_n=4)
    with pytest.raises(ValueError, match="sram_bytes"):
        io.flash_forward_io(1, 1, 8)
    with pytest.raises(ValueError, match="block_m"):
        io.flash_forward_io(1, 1, 8, block_m=-1, block_n=4)
    with pytest.raises(ValueError, match="kv_outer"):
        io.flash_forward_io(1, 1, 8, block_m=4, block_n=4, causal=True, loop_order="kv_outer")
    with pytest.raises(ValueError, match="machine"):
        io.roofline(1, 1, "Z80")
    with pytest.raises(ValueError, match="block_mask"):
        io.block_sparse_forward_io(1, 1, 128, block_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="density"):
        io.block_sparse_forward_io(1, 1, 128, density=2.0)


# --- Dao et al. 2022 as the paper ran it: Fig. 2 (left) -------------------------------
def test_paper_flash_hand_count():
    # N = 8, d = 2, 1 byte per element, B_c = 4 (T_c = 2 key blocks), l and m of 4 bytes:
    # init O (16) + l, m (2 x 8 x 4); K, V once (32); per key block read Q, O (32) + l, m (64), write O (16) + l, m (64)
    f = io.paper_flash_forward_io(1, 1, 8, d=2, bytes_per_element=1, block_m=2, block_n=4)
    assert (f.bytes_read, f.bytes_written) == (32 + 2 * (32 + 64), 16 + 64 + 2 * (16 + 64))
    assert f.parts["init O, l, m"].bytes_written == 80
    # Algorithm 1's loop alone is flash_forward_io's kv_outer count
    alg1 = io.flash_forward_io(1, 1, 8, 8, d=2, bytes_per_element=1, block_m=2, block_n=4, loop_order="kv_outer")
    assert alg1.total_bytes == f.total_bytes - 80
    # backward: init dQ, dK, dV (48); K, V (32); per key block read Q, O, dO, dQ (64) + l, m (64), write dQ (16);
    # write dK, dV (32)
    b = io.paper_flash_backward_io(1, 1, 8, d=2, bytes_per_element=1, block_m=2, block_n=4)
    assert (b.bytes_read, b.bytes_written) == (32 + 2 * (64 + 64), 48 + 2 * 16 + 32)
    assert b.scaled(6) == io.paper_flash_backward_io(2, 3, 8, d=2, bytes_per_element=1, block_m=2, block_n=4)


def test_paper_standard_hand_count():
    # N = 4, d = 2, 1 byte per element, 1-byte dropout mask: N^2 = 16, Nd = 8
    f = io.paper_standard_forward_io(1, 1, 4, d=2, bytes_per_element=1)
    parts = {k: (v.bytes_read, v.bytes_written) for k, v in f.parts.items()}
    assert parts == {"S = QK^T": (16, 16), "mask": (16, 16), "softmax": (16, 16), "dropout": (16, 32),
                     "O = PV": (24, 8), "mask tensor (read once, broadcast)": (16, 0)}
    b = io.paper_standard_backward_io(1, 1, 4, d=2, bytes_per_element=1)
    parts = {k: (v.bytes_read, v.bytes_written) for k, v in b.parts.items()}
    assert parts == {"dV = P^T dO": (24, 8), "dP = dO V^T": (16, 16), "dropout backward": (32, 16),
                     "softmax backward": (32, 16), "dQ = dS K": (24, 8), "dK = dS^T Q": (24, 8)}
    # a masked_fill-style mask adds one N x N pass to the backward; no mask, no dropout: Algorithm 0
    fill = io.paper_standard_backward_io(1, 1, 4, d=2, bytes_per_element=1, mask="fill")
    assert fill.total_bytes == b.total_bytes + 32
    plain = io.paper_standard_forward_io(1, 1, 4, d=2, bytes_per_element=1, mask=None, dropout=False)
    assert plain == io.standard_forward_io(1, 1, 4, d=2, bytes_per_element=1)
    with pytest.raises(ValueError, match="mask: expected one of"):
        io.paper_standard_forward_io(1, 1, 4, mask="causal")


def test_fig2_both_bars_within_15_percent():
    r = io.fig2()
    assert r["blocks"] == (64, 384)                       # B_r = min(ceil(M / 4d), d), B_c = ceil(M / 4d), M = 96K halves
    assert r["paper_gb"] == {"standard": 40.3, "flash": 4.4}
    for bar in ("standard", "flash"):
        model = r[bar].total_bytes / 1e9
        assert abs(model / r["paper_gb"][bar] - 1) < 0.15, (bar, model)
        assert r["model_gb"][bar] == model
    assert r["standard"] == r["standard_forward"] + r["standard_backward"]
    # every N x N pass is 2 N^2 bytes per head: 18 of them, plus 12 Nd, for the standard bar
    per_head = 2 * (18 * 1024 * 1024 + 12 * 1024 * 64)
    assert r["standard"].total_bytes == 1024 * per_head + 2 * 1024 * 1024   # + the broadcast mask, once
    # the ratio is the paper's order: several times fewer bytes
    assert 7 < r["standard"].total_bytes / r["flash"].total_bytes < 11
    # a masked_fill mask, or no dropout, moves the standard bar by one or more N x N passes
    assert io.fig2(mask="fill")["model_gb"]["standard"] > r["model_gb"]["standard"] > io.fig2(dropout=False)["model_gb"]["standard"]


def test_model_equals_traced_bytes_of_attnlab_kernels():
    from attnlab.kernels import flash_attention, standard_attention
    from attnlab.memory import trace

    n, d, bm, bn = 80, 16, 32, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, d, generator=g).half().requires_grad_() for _ in range(3))

    def fwd_bwd(fn):
        def run():
            o = fn(q, k, v)
            o.backward(torch.ones_like(o))
        return run

    fa = trace(fwd_bwd(lambda a, b, c: flash_attention(a, b, c, causal=True, block_m=bm, block_n=bn)))
    model = (io.flash_forward_io(1, 2, n, d=d, bytes_per_element=2, block_m=bm, block_n=bn, causal=True, grad=True)
             + io.flash_backward_io(1, 2, n, d=d, bytes_per_element=2, block_m=bm, block_n=bn, causal=True))
    assert (fa.bytes_read, fa.bytes_written) == (model.bytes_read, model.bytes_written)
    assert fa.by_tensor["O_F32"] == {"read": 0, "written": 2 * n * d * 4}   # the float32 O of a float16 training step
    assert fa.by_tensor["O"]["read"] == 2 * n * d * 4   # what the backward's preprocess reads (O_F32, as O)
    std = trace(fwd_bwd(lambda a, b, c: standard_attention(a, b, c, block_m=bm, block_n=bn, block_k=16)))
    model = (io.standard_forward_io(1, 2, n, d=d, bytes_per_element=2, block_m=bm, score_bytes=4)  # S in float32
             + io.standard_backward_io(1, 2, n, d=d, bytes_per_element=2, blocks=(bm, bn, 16)))
    assert (std.bytes_read, std.bytes_written) == (model.bytes_read, model.bytes_written)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_model_equals_traced_bytes_of_the_kernels_with_gqa(kv_heads, causal):
    """Grouped-query attention (4 query heads on 2 or 1 KV heads), ragged lengths, float16 training:
    the traced bytes of each kernel equal iomodel's, and K/V are read once per KV head in dK/dV."""
    from attnlab.kernels import flash_attention
    from attnlab.memory import trace

    nq, nk, d, bm, bn = 40, 56, 16, 16, 32
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, nq, d, generator=g).half().requires_grad_()
    k, v = (torch.randn(2, kv_heads, nk, d, generator=g).half().requires_grad_() for _ in range(2))
    fwd = trace(lambda: flash_attention(q, k, v, causal=causal, block_m=bm, block_n=bn))
    bwd = trace(fwd.result.backward, torch.ones_like(fwd.result))
    kw = dict(d=d, bytes_per_element=2, block_m=bm, block_n=bn, causal=causal, kv_heads=kv_heads)
    mf, mb = io.flash_forward_io(2, 4, nq, nk, grad=True, **kw), io.flash_backward_io(2, 4, nq, nk, **kw)
    assert (fwd.bytes_read, fwd.bytes_written) == (mf.bytes_read, mf.bytes_written)
    per_kernel = [(p["read"], p["written"]) for p in bwd.by_launch()]
    assert per_kernel == [(mb.parts[n].bytes_read, mb.parts[n].bytes_written) for n in ("bwd_preprocess", "bwd_dkdv", "bwd_dq")]
    assert bwd.by_tensor["DK"]["written"] == 2 * kv_heads * nk * d * 2   # dK once per KV head
    assert mb != io.flash_backward_io(2, 4, nq, nk, **dict(kw, kv_heads=None))   # the GQA term matters here


def test_block_sparse_model_equals_traced_bytes_with_gqa():
    """The block-sparse kernels with 4 query heads on 2 KV heads, a sliding window of ragged width at
    ragged lengths, float16 training: traced bytes equal the model's with kv_heads, per kernel."""
    from attnlab import mask_mods
    from attnlab.kernels import block_sparse_attention, create_block_mask
    from attnlab.memory import trace

    nq, nk, d = 50, 70, 16
    mask = create_block_mask(mask_mods.sliding_window(20), None, None, nq, nk, block_size=(16, 16))
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, nq, d, generator=g).half().requires_grad_()
    k, v = (torch.randn(1, 2, nk, d, generator=g).half().requires_grad_() for _ in range(2))
    fwd = trace(lambda: block_sparse_attention(q, k, v, mask))
    bwd = trace(fwd.result.backward, torch.ones_like(fwd.result))
    mf = io.block_sparse_forward_io(1, 4, nq, nk, d, 2, block_mask=mask, kv_heads=2, grad=True)
    mb = io.block_sparse_backward_io(1, 4, nq, nk, d, 2, block_mask=mask, kv_heads=2)
    assert (fwd.bytes_read, fwd.bytes_written) == (mf.bytes_read, mf.bytes_written)
    assert [(p["read"], p["written"]) for p in bwd.by_launch()] == \
        [(mb.parts[n].bytes_read, mb.parts[n].bytes_written) for n in ("bwd_preprocess", "bwd_dkdv", "bwd_dq")]
    # with a density instead of a mask, GQA takes the same K/V term off: density 1 is the all-ones mask
    ones = BlockMask(torch.ones(1, 1, 4, 5, dtype=torch.bool), (16, 16))
    for kv in (1, 2, 4):
        assert io.block_sparse_backward_io(1, 4, nq, nk, d, 2, density=1.0, block_size=(16, 16), kv_heads=kv) == \
            io.block_sparse_backward_io(1, 4, nq, nk, d, 2, block_mask=ones, kv_heads=kv)
