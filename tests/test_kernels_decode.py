"""kernels/flash_decode.py: split-K decoding against the reference over the gathered cache (ragged lengths,
several split counts, MHA/GQA/MQA, paged and not), its checks before launch, and its traced bytes against
attnlab.iomodel.decode_io to the byte. attnlab/kvcache.py's reference, pages and allocation too."""

import pytest
import torch
import torch.nn.functional as F

from attnlab.iomodel import decode_io, kv_cache_bytes
from attnlab.kernels.flash_decode import choose_num_splits, flash_decode
from attnlab.kvcache import allocation_bytes, decode_reference, gather_cache, to_paged
from attnlab.memory import trace


def make(B=3, H_q=4, H_kv=2, n_q=1, d=16, S=300, lens=(300, 37, 5), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, n_q, d, generator=g).to(dtype)
    k = torch.randn(B, H_kv, S, d, generator=g).to(dtype)
    v = torch.randn(B, H_kv, S, d, generator=g).to(dtype)
    return q, k, v, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("H_q,H_kv", [(4, 4), (4, 2), (4, 1)])     # MHA, GQA, MQA
@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("num_splits", [1, 2, 5, None])
def test_exact_against_the_reference_over_the_cache(H_q, H_kv, n_q, num_splits):
    q, k, v, lens = make(H_q=H_q, H_kv=H_kv, n_q=n_q)
    ref = decode_reference(q, k, v, lens)
    o = flash_decode(q, k, v, lens, num_splits=num_splits)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_cache_equals_the_contiguous_one(num_splits, page_size):
    q, k, v, lens = make(n_q=2, lens=(300, 37, 17))
    kp, vp, table = to_paged(k, v, lens, page_size, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(table[0, :3], torch.arange(3, dtype=torch.int32))   # shuffled: the table matters
    for b, L in enumerate(lens.tolist()):
        assert torch.equal(gather_cache(kp, b, L, table), k[b, :, :L])
    o = flash_decode(q, kp, vp, lens, num_splits=num_splits, block_table=table)
    torch.testing.assert_close(o, decode_reference(q, k, v, lens), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o, decode_reference(q, kp, vp, lens, block_table=table), atol=1e-5, rtol=1e-5)


def test_sixteen_queries_head_dim_64_and_float16():
    q, k, v, lens = make(B=2, H_q=2, H_kv=1, n_q=16, d=64, S=80, lens=(80, 16), dtype=torch.float16)
    o = flash_decode(q, k, v, lens, num_splits=3)
    ref = decode_reference(q.float(), k.float(), v.float(), lens)
    torch.testing.assert_close(o.float(), ref, atol=2e-3, rtol=2e-3)


def test_one_query_equals_sdpa_with_enable_gqa():
    q, k, v, lens = make(B=2, H_q=8, H_kv=2, lens=(300, 300))
    o = flash_decode(q, k, v, lens, num_splits=4)
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), atol=1e-5, rtol=1e-5)


def test_the_merge_is_the_online_softmax_rescaling():
    q, k, v, lens = make(lens=(256, 130, 9))
    o, parts, lse = flash_decode(q, k, v, lens, num_splits=4, return_splits=True)
    assert parts.shape == (3, 4, 4, 1, 16) and lse.shape == (3, 4, 4, 1)
    w = torch.softmax(lse, dim=2)                                   # exp(lse_s - M) / sum_s exp(lse_s - M)
    merged = (w[..., None] * parts).sum(dim=2)                      # (B, H, Nq, d)
    torch.testing.assert_close(merged, o, atol=1e-6, rtol=1e-6)
    assert torch.isinf(lse[2, :, 1:]).all() and torch.isfinite(lse[0]).all()   # 9 keys: one split; 256: four
    # each split's partial is attention over its own chunk of 64 keys alone
    for s in range(4):
        ks, vs = k[:1, :, 64 * s:64 * (s + 1)], v[:1, :, 64 * s:64 * (s + 1)]
        part = F.scaled_dot_product_attention(q[:1], ks, vs, enable_gqa=True)
        torch.testing.assert_close(parts[:1, :, s], part, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:1, :, s], torch.logsumexp(
            q[:1] @ ks.repeat_interleave(2, dim=1).transpose(-1, -2) / 4, dim=-1), atol=1e-5, rtol=1e-5)


def test_scale_is_used():
    q, k, v, lens = make()
    torch.testing.assert_close(flash_decode(q, k, v, lens, scale=0.3), decode_reference(q, k, v, lens, scale=0.3),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("H_kv", [4, 2, 1])
def test_traced_bytes_equal_iomodel(paged, num_splits, H_kv):
    q, k, v, lens = make(H_q=4, H_kv=H_kv, n_q=2, dtype=torch.float16, lens=(300, 37, 5))
    table = None
    if paged:
        k, v, table = to_paged(k, v, lens, 16, generator=torch.Generator().manual_seed(0))
    t = trace(flash_decode, q, k, v, lens, num_splits=num_splits, block_table=table)
    io = decode_io(3, 4, lens.tolist(), 16, 2, kv_heads=H_kv, n_q=2, num_splits=num_splits,
                   page_size=16 if paged else None)
    assert (t.bytes_read, t.bytes_written) == (io.bytes_read, io.bytes_written)
    assert t.by_tensor["K"]["read"] == sum(lens.tolist()) * H_kv * 16 * 2      # every cached key read once
    assert t.launches == ["_decode_split_kernel", "_decode_merge_kernel"]


def test_iomodel_decode_intensity_and_cache_size():
    mha = decode_io(1, 32, 4096, d=128)
    gqa = decode_io(1, 32, 4096, d=128, kv_heads=8)
    mqa = decode_io(1, 32, 4096, d=128, kv_heads=1)
    assert 0.9 < mha.arithmetic_intensity < 1.0                    # about one FLOP per byte
    assert mha.flops == gqa.flops == mqa.flops
    assert mha.total_bytes > 3.9 * gqa.total_bytes and gqa.total_bytes > 7 * mqa.total_bytes
    assert kv_cache_bytes(1, layers=32, kv_heads=32, d=128) == 2 ** 19
    assert decode_io(2, 4, [10, 20], d=16, page_size=16).parts["decode_split"].bytes_read == \
        decode_io(2, 4, [10, 20], d=16).parts["decode_split"].bytes_read + 4 * 4 * 3
    with pytest.raises(ValueError, match="kv_heads"):
        decode_io(1, 6, 10, kv_heads=4)
    with pytest.raises(ValueError, match="seqlens"):
        decode_io(2, 4, [10], d=16)


def test_choose_num_splits_fills_the_machine():
    assert choose_num_splits(1, 8, 4096, 64, units=132) == 17
    assert choose_num_splits(64, 8, 4096, 64, units=132) == 1       # a big batch fills it already
    assert choose_num_splits(1, 1, 100, 64, units=132) == 2         # no more splits than key blocks
    assert choose_num_splits(1, 1, 300, 64, units=2) == 2
    q, k, v, lens = make()
    torch.testing.assert_close(flash_decode(q, k, v, lens), decode_reference(q, k, v, lens), atol=1e-5, rtol=1e-5)


def test_allocation_bytes_paged_wastes_less():
    a = allocation_bytes([100, 7, 900], max_len=2048, page_size=16)
    assert a["used"] == 1007 * a["per_token"]
    assert a["paged"] == (112 + 16 + 912) * a["per_token"]
    assert a["contiguous_waste"] > 0.8 and a["paged_waste"] < 0.04


def test_errors_name_the_argument_before_launch():
    q, k, v, lens = make()
    with pytest.raises(ValueError, match="k_cache: expected a number of KV heads that divides"):
        flash_decode(q[:, :3], k, v, lens)
    with pytest.raises(TypeError, match="cache_seqlens"):
        flash_decode(q, k, v, lens.long())
    with pytest.raises(ValueError, match="cache_seqlens: expected every length >= 3"):
        flash_decode(torch.randn(3, 4, 3, 16), k, v, torch.tensor([100, 2, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens: expected lengths <= 300"):
        flash_decode(q, k, v, torch.tensor([301, 2, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens: expected shape"):
        flash_decode(q, k, v, lens[:2])
    with pytest.raises(ValueError, match="q: expected 1 to 16"):
        flash_decode(torch.randn(3, 4, 17, 16), k, v, lens)
    with pytest.raises(ValueError, match="q: expected head_dim"):
        flash_decode(torch.randn(3, 4, 1, 24), k, v, lens)
    with pytest.raises(TypeError, match="v_cache: expected dtype"):
        flash_decode(q, k, v.half(), lens)
    with pytest.raises(ValueError, match="num_splits"):
        flash_decode(q, k, v, lens, num_splits=0)
    with pytest.raises(TypeError, match="q: expected float32 or float16 in Triton's CPU interpreter"):
        flash_decode(q.bfloat16(), k.bfloat16(), v.bfloat16(), lens)
    kp, vp, table = to_paged(k, v, lens, 16)
    with pytest.raises(ValueError, match="block_table: expected page numbers"):
        flash_decode(q, kp, vp, lens, block_table=table + 100)
    with pytest.raises(ValueError, match="k_cache: expected a page size"):
        flash_decode(q, kp[:, :, :12], vp[:, :, :12], torch.tensor([5, 5, 5], dtype=torch.int32),
                     block_table=table)
    with pytest.raises(ValueError, match="k_cache: expected batch 3"):
        flash_decode(q, k[:2], v[:2], lens)
