"""More than one query per read of the cache (C35): iomodel.queries_per_read and mixed_batch_io against the traced
bytes of kernels/flash_decode.py with 1 to 16 queries, and the intensity growing about in proportion."""

import pytest
import torch

from attnlab.iomodel import decode_io, mixed_batch_io, queries_per_read, roofline
from attnlab.kernels import flash_decode
from attnlab.kvcache import decode_reference, to_paged
from attnlab.memory import trace


def cache(B, H_q, H_kv, n_q, lens, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = max(lens)
    q = torch.randn(B, H_q, n_q, d, generator=g).half()
    k = torch.randn(B, H_kv, S, d, generator=g).half()
    v = torch.randn(B, H_kv, S, d, generator=g).half()
    return q, k, v, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("n_q", [1, 2, 5, 16])
@pytest.mark.parametrize("H_kv,num_splits", [(2, 1), (1, 3)])
def test_traced_bytes_with_n_queries_equal_the_formula(n_q, H_kv, num_splits):
    q, k, v, lens = cache(1, 4, H_kv, n_q, [150])
    t = trace(flash_decode, q, k, v, lens, num_splits=num_splits)
    io = queries_per_read(4, 150, 16, 2, kv_heads=H_kv, n_q=(1, n_q), num_splits=num_splits)[n_q]
    assert (t.bytes_read, t.bytes_written) == (io.bytes_read, io.bytes_written)
    assert t.by_tensor["K"]["read"] == 150 * H_kv * 16 * 2                   # the cache read once, whatever n_q
    torch.testing.assert_close(t.result.float(), decode_reference(q.float(), k.float(), v.float(), lens),
                               atol=2e-3, rtol=2e-3)


def test_a_mixed_batch_is_the_sum_of_its_requests_traced():
    # two decodes, a speculative verification of 4 drafts (5 queries), a prefill chunk of 16: one launch per n_q
    requests = [(1, 200), (1, 37), (5, 90), (16, 64)]
    traced_read = traced_written = 0
    groups = {}
    for n, L in requests:
        groups.setdefault(n, []).append(L)
    for n, Ls in groups.items():
        q, k, v, lens = cache(len(Ls), 4, 2, n, Ls, seed=n)
        k, v, table = to_paged(k, v, lens, 16, generator=torch.Generator().manual_seed(n))
        t = trace(flash_decode, q, k, v, lens, num_splits=2, block_table=table)
        traced_read, traced_written = traced_read + t.bytes_read, traced_written + t.bytes_written
    io = mixed_batch_io(requests, 4, 16, 2, kv_heads=2, num_splits=2, page_size=16)
    assert (traced_read, traced_written) == (io.bytes_read, io.bytes_written)
    assert set(io.parts) == {"decode_split", "decode_merge"}
    assert io.flops == sum(4 * n * L * 16 * 4 for n, L in requests)


def test_intensity_grows_about_in_proportion_to_the_queries_per_read():
    rows = queries_per_read(32, 4096, 128, kv_heads=8)
    assert list(rows) == [1, 2, 4, 8, 16]
    base = rows[1]
    for n, io in rows.items():
        assert io.flops == n * base.flops
        assert 0.85 * n < io.arithmetic_intensity / base.arithmetic_intensity <= n      # Q and O grow a little too
        assert io.total_bytes < 1.05 * base.total_bytes          # about the same bytes: per query they fall as 1/n
    assert rows[16].total_bytes < 1.1 * rows[1].total_bytes                          # the cache dominates the bytes
    assert roofline(rows[1], machine="H100").bound == "memory"
    assert rows[16].arithmetic_intensity > 8 * rows[1].arithmetic_intensity
    # a mixed batch: the decodes keep their low intensity beside the chunk; the total sits in between
    mixed = mixed_batch_io([(1, 4096)] * 7 + [(16, 4096)], 32, 128, kv_heads=8)
    assert base.arithmetic_intensity < mixed.arithmetic_intensity < rows[16].arithmetic_intensity
    assert mixed == decode_io(7, 32, 4096, 128, kv_heads=8) + rows[16]
    assert queries_per_read(4, 100, 16, n_q=3)[3] == decode_io(1, 4, 100, 16, n_q=3)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="requests"):
        mixed_batch_io([], 4)
    with pytest.raises(ValueError, match="seqlens: expected every length >= n_q=5"):
        mixed_batch_io([(5, 3)], 4)
    with pytest.raises(ValueError, match="n_q"):
        queries_per_read(4, 100, n_q=(1, 0))
    with pytest.raises(ValueError, match="kv_heads"):
        queries_per_read(6, 100, kv_heads=4)
