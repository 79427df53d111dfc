"""Masks as FlexAttention has them: attnlab.mask_mods -> create_block_mask -> BlockMask, and the
block-sparse kernel against torch.nn.attention.flex_attention (eager, on the CPU)."""

import pytest
import torch
from torch.nn.attention import flex_attention as flex

from attnlab import mask_mods as mm
from attnlab.kernels import BlockMask, create_block_mask, full_mask

DOCS = torch.tensor([[0] * 10 + [1] * 23 + [2] * 40 + [-1] * 7, [0] * 50 + [1] * 30])   # ragged documents, padding

# (label, mask_mod, B, H, Nq, Nk, block_size)
CASES = [
    ("sliding window 37, non-square blocks", mm.sliding_window(37), None, None, 100, 100, (32, 16)),
    ("prefix LM", mm.prefix_lm(20), 2, None, 77, 77, (16, 32)),
    ("ragged documents", mm.document(DOCS), 2, 3, 80, 80, (16, 16)),
    ("causal, Nq != Nk", mm.causal, None, 2, 50, 90, 16),
    ("causal AND strided", mm.and_masks(mm.causal, mm.strided(3)), 1, 1, 64, 64, 32),
    ("local OR global tokens", mm.or_masks(mm.local(5), mm.global_tokens(3)), None, None, 70, 70, (16, 16)),
    ("prefix LM AND sliding window", mm.and_masks(mm.prefix_lm(9), mm.sliding_window(21)), None, None, 45, 45, (16, 32)),
]
LISTS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
         "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]


@pytest.mark.parametrize("label, mod, B, H, nq, nk, bs", CASES, ids=[c[0] for c in CASES])
def test_create_block_mask_equals_torch_s(label, mod, B, H, nq, nk, bs):
    ours = create_block_mask(mod, B, H, nq, nk, block_size=bs)
    ref = flex.create_block_mask(mod, B, H, nq, nk, device="cpu", BLOCK_SIZE=bs)
    for name in LISTS:
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert ours.mask_mod is mod and ours.seq_lengths == (nq, nk)
    assert torch.equal(ours.to_element_mask(), flex.create_mask(mod, B, H, nq, nk, device="cpu").expand_as(ours.to_element_mask()))


def test_lists_are_state_of_the_mask_not_recomputed():
    m = create_block_mask(mm.sliding_window(20), None, None, 64, 64, 16)
    assert m.kv_indices is m.kv_indices and m.full_q_indices is m.full_q_indices
    # partial tiles hold the element mask of their tile
    b, h, i, j = (m.tile_ids >= 0).nonzero()[0].tolist()
    tile = m.mask_tiles[m.tile_ids[b, h, i, j]].bool()
    assert torch.equal(tile, m.to_element_mask()[b, h, i * 16:(i + 1) * 16, j * 16:(j + 1) * 16])
    assert int(m.tile_ids.ge(0).sum()) == int(m.partial_blocks.sum()) == m.mask_tiles.shape[0]


def test_combining_masks_goes_through_their_mask_mods():
    a = create_block_mask(mm.sliding_window(10), None, None, 40, 40, 16)
    b = create_block_mask(mm.prefix_lm(5), None, None, 40, 40, 16)
    both = a | b
    assert torch.equal(both.to_element_mask(), a.to_element_mask() | b.to_element_mask())
    assert torch.equal((a & b).to_element_mask(), a.to_element_mask() & b.to_element_mask())
    assert torch.equal((~a).to_element_mask(), ~a.to_element_mask())
    with pytest.raises(ValueError, match="lengths"):
        a | create_block_mask(mm.causal, None, None, 40, 33, 16)
    # a tile pattern: every kept tile is full
    t = BlockMask(torch.tensor([[True, False], [True, True]]), (16, 16))
    assert t.seq_lengths is None and int(t.kv_num_blocks.sum()) == 0 and t.full_kv_num_blocks.tolist() == [[[1, 2]]]
    assert "██" in repr(t) and "▒▒" in repr(a)


def test_a_mask_knows_its_lengths():
    m = full_mask(100, 130, (32, 16))
    m.check_lengths(100, 130)
    with pytest.raises(ValueError, match="block_mask: expected q with 100 positions and k with 130"):
        m.check_lengths(120, 130)


def test_mask_mods_refuse_bad_input():
    with pytest.raises(TypeError, match="mask_mods"):
        mm.and_masks(mm.causal, "x")
    with pytest.raises(ValueError, match="mask_mods"):
        mm.or_masks()
    with pytest.raises(TypeError, match="doc_ids"):
        mm.document(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="window"):
        mm.sliding_window(-1)
    with pytest.raises(TypeError, match="mask_mod"):
        mm.create_mask(lambda b, h, q, kv: q - kv, None, None, 4, 4)


# ---------------------------------------------------------------------------------------
# The kernel against FlexAttention: forward against flex_attention itself, gradients against its
# eager implementation (math_attention: flex_attention has no backward on the CPU)
# ---------------------------------------------------------------------------------------
import math  # noqa: E402
import warnings  # noqa: E402

import torch.nn.functional as F  # noqa: E402
from torch._higher_order_ops.flex_attention import math_attention  # noqa: E402

from attnlab import iomodel  # noqa: E402
from attnlab._interp_hooks import memory_hooks  # noqa: E402
from attnlab.kernels import block_sparse_attention, flash_attention  # noqa: E402
from attnlab.memory import trace  # noqa: E402


def _qkv(B, H, H_kv, nq, nk, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, nq, d), (B, H_kv, nk, d), (B, H_kv, nk, d))
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _flex(q, k, v, mod, B, H, bs):
    """torch's flex_attention output, and its eager implementation's (o, lse), differentiable."""
    fb = flex.create_block_mask(mod, B, H, q.shape[-2], k.shape[-2], device="cpu", BLOCK_SIZE=bs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o_flex = flex.flex_attention(q.detach(), k.detach(), v.detach(), block_mask=fb, enable_gqa=k.shape[1] != q.shape[1])
    o, lse2, _ = math_attention(q, k, v, lambda s, b, h, m, n: s, fb.as_tuple(), q.shape[-1] ** -0.5, {})
    return o_flex, o, lse2 * math.log(2)


KERNEL_CASES = [   # (label, mask_mod, B, H, H_kv, Nq, Nk, block_size, mask B, mask H)
    ("sliding window 37 (not a multiple of 32 or 16)", mm.sliding_window(37), 1, 2, 2, 100, 100, (32, 16), None, None),
    ("prefix LM, GQA", mm.prefix_lm(20), 2, 4, 2, 77, 77, (16, 32), None, None),
    ("ragged documents, MQA", mm.document(DOCS), 2, 2, 1, 80, 80, (16, 16), 2, None),
    ("causal, Nq < Nk", mm.causal, 1, 2, 2, 50, 90, (16, 32), None, None),
    ("causal, Nq > Nk", mm.causal, 1, 1, 1, 90, 45, (32, 16), None, None),
    ("documents AND sliding window", mm.and_masks(mm.document(DOCS), mm.sliding_window(9)), 2, 1, 1, 80, 80, (16, 16), 2, None),
    ("prefix LM OR a window, per head", mm.or_masks(mm.prefix_lm(5), mm.local(7)), 1, 2, 1, 61, 61, (16, 16), None, 2),
]


@pytest.mark.parametrize("label, mod, B, H, H_kv, nq, nk, bs, mB, mH", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_block_sparse_attention_equals_flex_attention(label, mod, B, H, H_kv, nq, nk, bs, mB, mH):
    q, k, v = _qkv(B, H, H_kv, nq, nk, seed=len(label))
    o, lse = block_sparse_attention(q, k, v, create_block_mask(mod, mB, mH, nq, nk, bs), return_lse=True)
    o_flex, o_ref, lse_ref = _flex(q, k, v, mod, mB, mH, bs)
    torch.testing.assert_close(o, o_flex, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, lse_ref, atol=2e-6, rtol=1e-5)   # -inf where a row sees no key
    g = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    for name, a, b in zip("qkv", torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(o_ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_rows_that_see_no_key_are_zero():
    q, k, v = _qkv(2, 1, 1, 80, 80)
    o = block_sparse_attention(q, k, v, create_block_mask(mm.document(DOCS), 2, None, 80, 80, 16))
    assert torch.equal(o[0, :, 73:], torch.zeros_like(o[0, :, 73:]))   # padding (-1): no key
    dq, = torch.autograd.grad(o.sum(), (q,))
    assert torch.equal(dq[0, :, 73:], torch.zeros_like(dq[0, :, 73:]))


def test_causal_flag_is_the_mask_and_causal():
    q, k, v = _qkv(1, 1, 1, 70, 70)
    m = create_block_mask(mm.prefix_lm(30), None, None, 70, 70, 16)
    a = block_sparse_attention(q, k, v, m, causal=True)
    b = block_sparse_attention(q, k, v, create_block_mask(mm.and_masks(mm.prefix_lm(30), mm.causal), None, None, 70, 70, 16))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert m.and_causal() is m.and_causal()   # made once, kept by the mask


@pytest.mark.parametrize("causal", [False, True])
def test_traced_bytes_equal_iomodel_with_full_and_partial_blocks(causal):
    mask = create_block_mask(mm.or_masks(mm.sliding_window(45), mm.global_tokens(16)), None, 2, 70, 90, (32, 16))
    assert int(mask.full_blocks.sum()) and int(mask.partial_blocks.sum())   # both kinds present
    q, k, v = _qkv(1, 2, 2, 70, 90)
    t = trace(block_sparse_attention, q, k, v, mask, causal=causal)
    m = iomodel.block_sparse_forward_io(1, 2, 70, 90, 16, 4, block_mask=mask, causal=causal)
    assert (t.bytes_read, t.bytes_written) == (m.bytes_read, m.bytes_written)
    walked = mask.and_causal() if causal else mask
    assert t.by_tensor["TILES"]["read"] == int(walked.partial_blocks.sum()) * 32 * 16   # one int8 tile per partial visit
    o = t.result
    tb = trace(o.backward, torch.ones_like(o))
    mb = iomodel.block_sparse_backward_io(1, 2, 70, 90, 16, 4, block_mask=mask, causal=causal)
    assert (tb.bytes_read, tb.bytes_written) == (mb.bytes_read, mb.bytes_written)


# ---------------------------------------------------------------------------------------
# Grouped-query attention in the dense kernel
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("H, H_kv, nq, nk, causal", [(4, 2, 70, 50, True), (3, 1, 33, 65, False), (2, 2, 40, 40, True)])
def test_flash_attention_gqa_equals_sdpa(H, H_kv, nq, nk, causal):
    q, k, v = _qkv(2, H, H_kv, nq, nk, seed=H + nq)
    o = flash_attention(q, k, v, causal=causal, block_m=32, block_n=16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(o, ref, atol=2e-6, rtol=1e-5)
    g = torch.randn(o.shape, generator=torch.Generator().manual_seed(2))
    for a, b in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5)


def test_gqa_head_counts_that_do_not_divide_are_refused():
    q, k, v = _qkv(1, 3, 2, 16, 16)
    for fn in (lambda: flash_attention(q, k, v), lambda: block_sparse_attention(q, k, v, full_mask(16, 16, 16))):
        with pytest.raises(ValueError, match="k: expected a number of heads that divides q's 3"):
            fn()


# ---------------------------------------------------------------------------------------
# The log-sum-exp is differentiable (issue 24, 5(b)); double backward is refused (5(c))
# ---------------------------------------------------------------------------------------
def test_merging_two_partial_attentions_through_their_lse_gives_right_gradients():
    # ring attention's step: attention over two halves of the keys, merged by their log-sum-exp
    q, k, v = _qkv(1, 2, 2, 48, 64, seed=3)
    o1, l1 = flash_attention(q, k[..., :32, :], v[..., :32, :], return_lse=True)
    o2, l2 = flash_attention(q, k[..., 32:, :], v[..., 32:, :], return_lse=True)
    lse = torch.logaddexp(l1, l2)
    o = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    ref = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(o, ref, atol=2e-6, rtol=1e-5)
    g = torch.randn(o.shape, generator=torch.Generator().manual_seed(4))
    for a, b in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5)


def test_lse_gradient_of_the_block_sparse_kernel():
    q, k, v = _qkv(1, 1, 1, 40, 40, seed=5)
    mod = mm.sliding_window(11)
    _, lse = block_sparse_attention(q, k, v, create_block_mask(mod, None, None, 40, 40, 16), return_lse=True)
    _, _, lse_ref = _flex(q, k, v, mod, None, None, 16)
    for a, b in zip(torch.autograd.grad(lse.sum(), (q, k)), torch.autograd.grad(lse_ref.sum(), (q, k))):
        torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("fn", [
    lambda q, k, v: flash_attention(q, k, v),
    lambda q, k, v: block_sparse_attention(q, k, v, full_mask(16, 16, 16)),
], ids=["flash_attention", "block_sparse_attention"])
def test_double_backward_raises(fn):
    q, k, v = _qkv(1, 1, 1, 16, 16)
    o = fn(q, k, v)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(o.sum(), q, create_graph=True)


# ---------------------------------------------------------------------------------------
# 64-bit offsets: a view whose batch stride times the batch index passes 2**31 elements
# ---------------------------------------------------------------------------------------
def test_offsets_past_2_to_the_31_on_a_view_with_huge_strides(tmp_path):
    """q, k, v are views into sparse files (tens of GB of address space, a few pages touched):
    q's batch b starts at b * 2**30 elements (b = 2 is at 2**31), and k's and v's row r at
    r * 2**26 (row 32 is at 2**31). Every address a kernel loads or stores is traced before it
    is touched and must lie in a tensor's storage: with 32-bit offsets a program id (or a
    block's first row) times a stride wraps around, and the trace stops the launch."""
    B, N, D = 3, 40, 16

    def views(name, sb, sn, count):
        span = (B - 1) * sb + (N - 1) * sn + count * 2**22 + D
        path = tmp_path / name
        with open(path, "wb") as f:
            f.truncate(span * 4)                   # a sparse file: no disk, no memory until touched
        store = torch.from_file(str(path), shared=True, size=span, dtype=torch.float32)
        return [torch.as_strided(store, (B, 1, N, D), (sb, sb, sn, 1), i * 2**22) for i in range(count)]

    (q,) = views("q.bin", 2**30, 2**24, 1)
    k, v = views("kv.bin", 2**32, 2**26, 2)
    g = torch.Generator().manual_seed(0)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=g))
    q.requires_grad_()
    gathered = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def on_access(info, program, op, ptrs, mask, element_size):
        p = ptrs[mask.astype(bool)]
        for _, t in info.tensors:
            lo = t.untyped_storage().data_ptr()
            if ((p >= lo) & (p + element_size <= lo + t.untyped_storage().nbytes())).all():
                return
        raise AssertionError(f"{info.name}: a {op} outside every tensor (a 32-bit offset wrapped around?)")

    ref = F.scaled_dot_product_attention(*gathered, is_causal=True)
    dq_ref, = torch.autograd.grad(ref.sum(), gathered[0])
    mask = create_block_mask(mm.causal, None, None, N, N, 16)
    with memory_hooks(lambda info: None, on_access):
        for o in (flash_attention(q, k, v, causal=True, block_m=16, block_n=16), block_sparse_attention(q, k, v, mask)):
            torch.testing.assert_close(o, ref, atol=2e-6, rtol=1e-5)
            dq, = torch.autograd.grad(o.sum(), q)
            torch.testing.assert_close(dq, dq_ref, atol=5e-6, rtol=1e-5)


def test_a_mask_for_other_lengths():
    m = create_block_mask(mm.sliding_window(5), None, None, 64, 64, 16)
    short = m.for_lengths(37, 37)
    assert short is m.for_lengths(37, 37) and short.seq_lengths == (37, 37)
    assert torch.equal(short.to_element_mask(), m.to_element_mask()[..., :37, :37])
    t = BlockMask(torch.ones(1, 1, 4, 4, dtype=torch.bool), (16, 16)).for_lengths(20, 40)
    assert t.num_blocks == (2, 3) and t.seq_lengths is None
