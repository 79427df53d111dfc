"""Selected-block attention (attnlab.kernels.selected_attention) against attnlab.sparse's reference, in the CPU
interpreter; the lightning indexer and the top-k selection; the traced bytes against attnlab.iomodel."""

import importlib
import importlib.util

import pytest
import torch

from attnlab import iomodel as io
from attnlab.kernels import flash_attention, selected_attention
from attnlab.memory import trace
from attnlab.sparse import (
    attention_mass_kept, indexer_block_scores, indexer_scores, select_blocks, selected_attention_reference,
    selected_mask, selected_tiles,
)

sel_mod = importlib.import_module("attnlab.kernels.selected_attention")


def _qkv(b, h, h_kv, nq, nk, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g)
    k, v = (torch.randn(b, h_kv, nk, d, generator=g) for _ in range(2))
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _random_selection(b, h_kv, nqb, nkb, topk, seed, causal=True):
    scores = torch.randn(b, h_kv, nqb, nkb, generator=torch.Generator().manual_seed(seed))
    return select_blocks(scores, topk, causal=causal)


def _reference_lse(q, k, block_indices, block_size, causal, scale):
    """The log-sum-exp of each row's visible scores (a test-side check of the kernel's L output)."""
    h, h_kv = q.shape[1], k.shape[1]
    mask = selected_mask(block_indices, q.shape[2], k.shape[2], block_size, causal)
    mask = mask.repeat_interleave(h // h_kv, 1) if mask.shape[1] > 1 else mask
    s = (q @ k.repeat_interleave(h // h_kv, 1).transpose(-1, -2)) * scale
    return torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1)


CASES = {
    # name: (B, H, H_kv, Nq, Nk, block_size, topk, causal, scale)
    "causal-gqa-ragged": (2, 4, 2, 70, 70, 16, 3, True, 0.3),
    "not-causal-nq<nk": (1, 2, 1, 50, 83, 32, 2, False, 0.7),
    "causal-nq>nk": (1, 2, 2, 83, 50, 16, 2, True, None),
    "not-causal-nq>nk-mqa": (2, 3, 1, 64, 40, 16, 2, False, 1.3),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_backward_and_lse_match_the_reference(name):
    B, H, H_kv, nq, nk, bs, topk, causal, scale = CASES[name]
    q, k, v = _qkv(B, H, H_kv, nq, nk, seed=len(name))
    bi = _random_selection(B, H_kv, -(-nq // bs), -(-nk // bs), topk, seed=len(name), causal=causal)
    o, lse = selected_attention(q, k, v, bi, block_size=bs, causal=causal, scale=scale, return_lse=True)
    ref = selected_attention_reference(q, k, v, bi, block_size=bs, causal=causal, scale=scale)
    ref_lse = _reference_lse(q, k, bi, bs, causal, q.shape[-1] ** -0.5 if scale is None else scale)
    assert o.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(o, ref, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-4)
    gen = torch.Generator().manual_seed(5)
    go, gl = torch.randn(o.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    # o and lse both carry gradient (every row sees a key here: the selection keeps the diagonal,
    # or has topk blocks without causal)
    grads = torch.autograd.grad((o * go).sum() + (lse * gl).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * go).sum() + (ref_lse * gl).sum(), (q, k, v))
    for n, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(a, b, atol=3e-5, rtol=3e-4, msg=lambda m: f"{n}: {m}")


def test_float16_matches_the_float32_reference():
    q, k, v = _qkv(1, 2, 2, 70, 70, d=32, dtype=torch.float16, seed=3)
    bi = _random_selection(1, 2, 5, 5, 2, seed=3)
    o = selected_attention(q, k, v, bi, block_size=16, scale=0.2)
    assert o.dtype == torch.float16
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = selected_attention_reference(qf, kf, vf, bi, block_size=16, scale=0.2)
    torch.testing.assert_close(o.float(), ref, atol=2e-3, rtol=2e-3)
    g = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    for n, a, b in zip(("dq", "dk", "dv"), torch.autograd.grad(o.float(), (q, k, v), g),
                       torch.autograd.grad(ref, (qf, kf, vf), g)):
        assert a.dtype == torch.float16
        torch.testing.assert_close(a.float(), b, atol=5e-3, rtol=5e-3, msg=lambda m: f"{n}: {m}")


def test_unused_slots_any_order_and_a_query_block_with_nothing():
    q, k, v = _qkv(1, 2, 1, 64, 64, seed=7)
    # query block 1 selects nothing; the others list ids in any order with -1 anywhere
    bi = torch.tensor([[[[-1, 0, -1], [-1, -1, -1], [2, -1, 0], [-1, 3, 1]]]], dtype=torch.int32)
    for causal in (True, False):
        o, lse = selected_attention(q, k, v, bi, block_size=16, causal=causal, return_lse=True)
        ref = selected_attention_reference(q, k, v, bi, block_size=16, causal=causal)
        torch.testing.assert_close(o, ref, atol=2e-5, rtol=2e-4)
        assert torch.equal(o[..., 16:32, :], torch.zeros_like(o[..., 16:32, :]))
        assert torch.isneginf(lse[..., 16:32]).all() and torch.isfinite(lse[..., :16]).all()
        g = torch.randn(o.shape, generator=torch.Generator().manual_seed(2))
        grads = torch.autograd.grad(o, (q, k, v), g)
        assert torch.equal(grads[0][..., 16:32, :], torch.zeros_like(grads[0][..., 16:32, :]))
        for n, a, b in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, (q, k, v), g)):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-4, msg=lambda m: f"{n}: {m}")
    # no slot at all: every output row is zero
    q0, k0, v0 = _qkv(1, 1, 1, 40, 40, seed=1)
    o = selected_attention(q0, k0, v0, torch.zeros(1, 1, 3, 0, dtype=torch.int32), block_size=16)
    assert torch.equal(o, torch.zeros_like(o))
    dk, = torch.autograd.grad(o.sum(), (k0,))
    assert torch.equal(dk, torch.zeros_like(dk))


def test_a_future_block_is_masked_and_never_read():
    q, k, v = _qkv(1, 1, 1, 64, 64, seed=4)
    with_future = torch.tensor([[[[0, 3], [1, 2], [2, -1], [3, 0]]]], dtype=torch.int32)   # 3 > 0 and 2 > 1: future
    without = torch.tensor([[[[0, -1], [1, -1], [2, -1], [3, 0]]]], dtype=torch.int32)
    o = selected_attention(q, k, v, with_future, block_size=16)
    torch.testing.assert_close(o, selected_attention_reference(q, k, v, with_future, block_size=16), atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(o, selected_attention(q, k, v, without, block_size=16), atol=0, rtol=0)
    t_with = trace(selected_attention, q, k, v, with_future, block_size=16)
    t_without = trace(selected_attention, q, k, v, without, block_size=16)
    assert t_with.by_tensor["K"]["read"] == t_without.by_tensor["K"]["read"] == 5 * 16 * 16 * 4
    # without causal the same blocks are real keys, and they are read
    t_nc = trace(selected_attention, q, k, v, with_future, block_size=16, causal=False)
    assert t_nc.by_tensor["K"]["read"] == 7 * 16 * 16 * 4


def test_every_block_selected_is_flash_attention():
    q, k, v = _qkv(1, 2, 2, 100, 100, seed=8)
    every = torch.arange(4, dtype=torch.int32).expand(1, 1, 4, 4)      # broadcast over batch and KV heads
    for causal in (True, False):
        torch.testing.assert_close(selected_attention(q, k, v, every, block_size=32, causal=causal),
                                   flash_attention(q, k, v, causal=causal, block_m=32, block_n=32), atol=1e-6, rtol=1e-5)


def test_transposed_lists_are_the_forward_lists_the_other_way_round():
    bi = _random_selection(2, 3, 9, 7, 3, seed=1)
    bi[0, 0, 4] = -1                                                   # an empty query block
    kv_num, kv_idx = sel_mod._forward_lists(bi, 7, causal=True)
    q_num, q_idx = sel_mod._transposed_lists(kv_idx, 7)
    table = selected_tiles(bi, 9 * 16, 7 * 16, 16)                     # (2, 3, 9, 7)
    assert torch.equal(kv_num, table.sum(-1).int()) and torch.equal(q_num, table.sum(-2).int())
    for b in range(2):
        for h in range(3):
            for i in range(9):
                assert kv_idx[b, h, i, :kv_num[b, h, i]].tolist() == table[b, h, i].nonzero().flatten().tolist()
                assert (kv_idx[b, h, i, kv_num[b, h, i]:] == -1).all()
            for j in range(7):
                assert q_idx[b, h, j, :q_num[b, h, j]].tolist() == table[b, h, :, j].nonzero().flatten().tolist()
                assert (q_idx[b, h, j, q_num[b, h, j]:] == -1).all()


# --- selection --------------------------------------------------------------------------------------


def test_select_blocks_causal_rules():
    scores = torch.randn(2, 3, 9, 7, generator=torch.Generator().manual_seed(0))
    scores[0, 0, 5, 5] = -1e9                                          # the diagonal is kept however low
    bi = select_blocks(scores, 3)
    assert bi.dtype == torch.int32 and bi.shape == (2, 3, 9, 3)
    i = torch.arange(9)[:, None]
    valid = bi >= 0
    assert not (valid & (bi > i)).any()                                # never a future block
    diag = (bi == torch.arange(9)[:, None]).any(-1)
    assert diag[..., :7].all()                                         # the diagonal block, where there is one
    assert torch.equal(valid.sum(-1), torch.clamp(i.flatten() + 1, max=3).expand(2, 3, 9))  # -1 where too few
    padded = torch.where(valid, bi, 100)
    assert torch.equal(padded, padded.sort(-1).values)                 # ascending, -1s last
    # the rest are the best-scored available blocks
    row = scores[1, 2, 6].clone()
    row[6] = float("inf")
    row[7:] = float("-inf")
    assert bi[1, 2, 6].tolist() == sorted(row.topk(3).indices.tolist())
    # without causal: the topk best, anywhere; -inf scores never; topk above the blocks: -1 padded
    nc = select_blocks(scores[:, 0], 3, causal=False)
    assert nc.shape == (2, 9, 3) and torch.equal(nc, scores[:, 0].topk(3).indices.sort(-1).values.int())
    masked = torch.full((1, 2, 4), float("-inf"))
    masked[0, 0, 1] = 0.0
    assert select_blocks(masked, 3, causal=False).tolist() == [[[1, -1, -1], [-1, -1, -1]]]
    assert select_blocks(torch.tensor([[[0., 0, 0], [5, 1, 0], [1, 9, 3]]]), 2).tolist() == [[[0, -1], [0, 1], [1, 2]]]


def test_indexer_scores_are_dsa_and_blocks_reduce_by_max_then_mean():
    g = torch.Generator().manual_seed(3)
    q_idx, k_idx, w = torch.randn(2, 3, 37, 8, generator=g), torch.randn(2, 37, 8, generator=g), torch.rand(2, 3, 37, generator=g)
    s = indexer_scores(q_idx, k_idx, w)
    t, j = 20, 11
    expected = sum(w[1, h, t] * torch.relu(q_idx[1, h, t] @ k_idx[1, j]) for h in range(3))
    torch.testing.assert_close(s[1, t, j], expected)
    assert torch.isneginf(s[0, 3, 4]) and torch.isfinite(s[0, 4, 3])   # causal: future pairs -inf
    bs = indexer_block_scores(q_idx, k_idx, w, block_size=16)
    assert bs.shape == (2, 3, 3)
    # query block 2 (rows 32..36), key block 1 (keys 16..31): mean over its 5 rows of the max over the keys
    torch.testing.assert_close(bs[0, 2, 1], s[0, 32:37, 16:32].amax(-1).mean())
    # the diagonal block: each row's max over the keys it may see
    torch.testing.assert_close(bs[0, 1, 1], torch.stack([s[0, r, 16:r + 1].max() for r in range(16, 32)]).mean())
    assert torch.isneginf(bs[:, 0, 1:]).all() and torch.isneginf(bs[:, 1, 2]).all()
    nc = indexer_block_scores(q_idx, k_idx, block_size=16, causal=False)   # weights None: all 1
    torch.testing.assert_close(nc[1, 0, 2], indexer_scores(q_idx, k_idx, causal=False)[1, :16, 32:].amax(-1).mean())


def test_attention_mass_kept():
    q, k, _ = _qkv(1, 4, 2, 64, 64, seed=2)
    nqb = 4
    every = torch.arange(4, dtype=torch.int32).expand(1, 2, 4, 4)
    torch.testing.assert_close(attention_mass_kept(q, k, every, block_size=16), torch.ones(1, 4, 64))
    # selections of growing topk from one score table are nested: the mass kept never falls
    scores = torch.randn(1, 2, nqb, 4, generator=torch.Generator().manual_seed(0))
    masses = [attention_mass_kept(q, k, select_blocks(scores, t), block_size=16, scale=0.5) for t in (1, 2, 3, 4)]
    for a, b in zip(masses, masses[1:]):
        assert (b >= a - 1e-6).all()
    torch.testing.assert_close(masses[-1], torch.ones(1, 4, 64))
    # by hand for one row: query 40 (block 2) of head 3 (KV head 1) selected key blocks 0 and 2
    bi = select_blocks(scores, 2)
    qf, kf = q.detach(), k.detach()
    p = torch.softmax((qf[0, 3, 40] @ kf[0, 1, :41].T) * 0.5, -1)
    keep = torch.cat([torch.arange(16 * int(b), min(16 * int(b) + 16, 41)) for b in bi[0, 1, 2] if b >= 0])
    torch.testing.assert_close(masses[1][0, 3, 40], p[keep].sum())


# --- traffic ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_traced_bytes_equal_the_model_with_gqa_and_float16(causal):
    nq, nk, d, bs = 70, 50, 16, 16
    q, k, v = _qkv(1, 4, 2, nq, nk, d, dtype=torch.float16, seed=6)
    bi = _random_selection(1, 2, 5, 4, 3, seed=6, causal=causal)
    bi[0, 0, 1, 2] = 3                                                 # a future block: dropped under causal
    fwd = trace(lambda: selected_attention(q, k, v, bi, block_size=bs, causal=causal))
    bwd = trace(fwd.result.backward, torch.ones_like(fwd.result))
    kw = dict(block_indices=bi, block_size=bs, causal=causal, kv_heads=2)
    mf = io.selected_attention_forward_io(1, 4, nq, nk, d, 2, grad=True, **kw)
    mb = io.selected_attention_backward_io(1, 4, nq, nk, d, 2, **kw)
    assert (fwd.bytes_read, fwd.bytes_written) == (mf.bytes_read, mf.bytes_written)
    assert [(p["read"], p["written"]) for p in bwd.by_launch()] == \
        [(mb.parts[n].bytes_read, mb.parts[n].bytes_written) for n in ("bwd_preprocess", "bwd_dkdv", "bwd_dq")]
    visits = int(selected_tiles(bi, nq, nk, bs, causal).sum())
    assert fwd.by_tensor["KV_IDX"]["read"] == 4 * 2 * visits           # one id per visit, for both heads of a group
    assert bwd.by_tensor["Q_NUM"]["read"] == 4 * 2 * 4                 # one count per key block and KV head


def test_traffic_falls_with_topk():
    n, d, bs = 128, 16, 16
    q, k, v = _qkv(1, 1, 1, n, n, d, seed=0)
    scores = torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    model = [io.selected_attention_forward_io(1, 1, n, d=d, bytes_per_element=4, block_indices=select_blocks(scores, t),
                                              block_size=bs) for t in (1, 2, 4, 8)]
    reads = [m.bytes_read for m in model]
    assert reads == sorted(reads) and len(set(reads)) == 4
    # topk 1 keeps only the diagonal: Q once, each query block's own K and V block, 8 counts and 8 ids
    assert reads[0] == n * d * 4 + 8 * 2 * bs * d * 4 + 4 * (8 + 8)
    # topk 8 under causal is flash attention's causal traffic plus the lists (36 visited tiles)
    flash = io.flash_forward_io(1, 1, n, d=d, bytes_per_element=4, block_m=bs, block_n=bs, causal=True)
    assert reads[-1] == flash.bytes_read + 4 * (8 + 36)
    t = trace(selected_attention, q, k, v, select_blocks(scores, 2), block_size=bs)
    assert t.bytes_read == reads[1]


# --- bad input ----------------------------------------------------------------------------------------


def test_every_bad_argument_is_named():
    q, k, v = _qkv(1, 2, 1, 40, 40, seed=0)
    bi = select_blocks(torch.zeros(1, 1, 3, 3), 2)

    def sel(**kw):
        args = dict(q=q, k=k, v=v, block_indices=bi, block_size=16)
        args.update(kw)
        return selected_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("block_indices"), **args)

    bad = [
        (TypeError, "block_indices: expected dtype int32", dict(block_indices=bi.long())),
        (TypeError, "block_indices: expected a torch.Tensor", dict(block_indices=[[0]])),
        (ValueError, "block_indices: expected a 4-D", dict(block_indices=bi[0])),
        (ValueError, r"block_indices: expected shape \(1, 1, 3, topk\)", dict(block_indices=bi[:, :, :2])),
        (ValueError, "block_indices: expected shape", dict(block_indices=bi.expand(1, 2, 3, 2))),   # 2 KV heads, k has 1
        (ValueError, r"block_indices: expected ids in \[-1, 2\]", dict(block_indices=bi + 1)),
        (ValueError, r"block_indices: expected ids in \[-1, 2\]", dict(block_indices=bi - 2)),
        (ValueError, "block_indices: expected each key block at most once", dict(block_indices=torch.zeros_like(bi))),
        (ValueError, "block_size: expected a power of two >= 16", dict(block_size=24)),
        (ValueError, "block_size: expected a power of two >= 16", dict(block_size=8, block_indices=torch.zeros(1, 1, 5, 1, dtype=torch.int32))),
        (TypeError, "block_size: expected an int power of two", dict(block_size=16.0)),
        (TypeError, "block_size: expected an int power of two", dict(block_size=True)),
        (TypeError, "causal: expected a bool", dict(causal=1)),
        (TypeError, "return_lse: expected a bool", dict(return_lse=None)),
        (TypeError, "scale: expected a real number", dict(scale="0.1")),
        (ValueError, "q: expected head_dim in", dict(q=q[..., :8], k=k[..., :8], v=v[..., :8])),
        (ValueError, "k: expected a number of heads that divides", dict(k=k.expand(1, 3, 40, 16), v=v.expand(1, 3, 40, 16))),
        (TypeError, "bfloat16", dict(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16())),
        (TypeError, "k: expected dtype torch.float32", dict(k=k.half())),
    ]
    for exc, pattern, kw in bad:
        with pytest.raises(exc, match=pattern):
            sel(**kw)
    with pytest.raises(TypeError, match="block_size"):
        selected_attention(q, k, v, bi)                                # block_size is required, keyword-only


def test_bad_arguments_of_the_reference_side_are_named():
    q_idx, k_idx = torch.randn(1, 2, 40, 8), torch.randn(1, 40, 8)
    with pytest.raises(ValueError, match="k_idx: expected shape"):
        indexer_scores(q_idx, torch.randn(1, 40, 4))
    with pytest.raises(ValueError, match="k_idx: expected a 3-D"):
        indexer_scores(q_idx, torch.randn(1, 1, 40, 8))
    with pytest.raises(ValueError, match="weights: expected a shape broadcastable"):
        indexer_scores(q_idx, k_idx, torch.ones(2))
    with pytest.raises(TypeError, match="q_idx: expected a floating-point"):
        indexer_scores(q_idx.int(), k_idx)
    with pytest.raises(ValueError, match="block_size: expected a positive int"):
        indexer_block_scores(q_idx, k_idx, block_size=0)
    with pytest.raises(ValueError, match="topk: expected a positive int"):
        select_blocks(torch.zeros(1, 3, 3), 0)
    with pytest.raises(TypeError, match="topk: expected an int"):
        select_blocks(torch.zeros(1, 3, 3), 2.0)
    with pytest.raises(ValueError, match="block_scores: expected no NaN"):
        select_blocks(torch.full((1, 3, 3), float("nan")), 1)
    with pytest.raises(ValueError, match="block_scores: expected a 3-D"):
        select_blocks(torch.zeros(3, 3), 1)
    q, k, v = _qkv(1, 2, 1, 40, 40, seed=0)
    bi = select_blocks(torch.zeros(1, 1, 3, 3), 2)
    with pytest.raises(ValueError, match="block_indices: expected shape"):
        selected_attention_reference(q, k, v, bi, block_size=32)
    with pytest.raises(ValueError, match="block_indices: expected ids"):
        attention_mass_kept(q, k, bi + 1, block_size=16)
    with pytest.raises(ValueError, match="block_indices: expected shape"):
        io.selected_attention_forward_io(1, 2, 40, d=16, block_indices=bi.expand(1, 2, 3, 2), block_size=16, kv_heads=1)


# --- the compiled path, without a GPU ----------------------------------------------------------------


def test_native_gpu_path_compiles_without_a_gpu():
    """The three kernels (fp16, ragged lengths, causal, a GQA group of 2) lowered for sm_90 (H100, H200)
    with Triton's bundled toolchain, as benchmarks/gpu_compile_check.py does: the compiled path
    builds, with pipelined loads and tensor cores, on a CPU machine."""
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_compile_check.py")
    spec = importlib.util.spec_from_file_location("gpu_compile_check", path)
    check = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(check)
    except ImportError as e:  # pragma: no cover - a triton build without its GPU backend
        pytest.skip(f"no Triton GPU backend: {e}")
    c = dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, DOT_PRECISION="tf32", EVEN_N=False)
    for kernel, consts in [(sel_mod._sel_fwd_kernel, dict(c, KEEP_F32_O=True)),
                           (sel_mod._sel_bwd_dkdv_kernel, dict(c, EVEN_M=False, GROUP=2)),
                           (sel_mod._sel_bwd_dq_kernel, c)]:
        sig, cx, attrs = check.signature(kernel, torch.float16, consts)
        try:
            compiled = check.compile_one(check.GPUTarget("cuda", 90, 32), kernel, sig, cx, 4, 2, attrs)
        except (RuntimeError, FileNotFoundError) as e:  # pragma: no cover - toolchain missing from this triton build
            if "ptxas" in str(e) or "not found" in str(e).lower():
                pytest.skip(f"Triton's CUDA toolchain is not available: {e}")
            raise
        ptx = compiled.asm["ptx"]
        assert compiled.metadata.shared <= 227 * 1024 and "cp.async" in ptx and "wgmma" in ptx, kernel.__name__


# --- on a CUDA GPU (skipped here; ATTNLAB_GPU_TESTS_ON_CPU=1 dry-runs it in the interpreter, as tests/test_gpu.py) ---
_GPU_DEV = "cpu" if __import__("os").environ.get("ATTNLAB_GPU_TESTS_ON_CPU") == "1" else "cuda"


@pytest.mark.skipif(_GPU_DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_selected_attention_on_gpu(dtype, causal):
    if _GPU_DEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bfloat16 runs on a GPU only")
    n, nk, bs, d = 1000, 1000 if causal else 777, 64, 64
    g = torch.Generator(device=_GPU_DEV).manual_seed(3)
    q = torch.randn(2, 4, n, d, device=_GPU_DEV, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, nk, d, device=_GPU_DEV, generator=g).to(dtype).requires_grad_() for _ in range(2))
    scores = torch.randn(2, 2, -(-n // bs), -(-nk // bs), device=_GPU_DEV, generator=g)
    bi = select_blocks(scores, 4, causal=causal)
    o, lse = selected_attention(q, k, v, bi, block_size=bs, causal=causal, return_lse=True)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = selected_attention_reference(qf, kf, vf, bi, block_size=bs, causal=causal)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    assert o.dtype == dtype and o.device.type == _GPU_DEV
    torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, _reference_lse(qf.detach(), kf.detach(), bi, bs, causal, d ** -0.5), atol=tol, rtol=tol)
    do = torch.randn(o.shape, device=_GPU_DEV, generator=g)
    for n_, a, b in zip(("dq", "dk", "dv"), torch.autograd.grad(o, (q, k, v), do.to(dtype)),
                        torch.autograd.grad(ref, (qf, kf, vf), do)):
        torch.testing.assert_close(a.float(), b, atol=5 * tol, rtol=5 * tol, msg=lambda m: f"{n_}: {m}")
