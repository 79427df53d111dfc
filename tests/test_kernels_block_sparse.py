"""Block-sparse FlashAttention and BlockMask, in the CPU interpreter."""

import warnings

import matplotlib
import pytest
import torch

from attnlab.kernels import (
    BlockMask, block_sparse_attention, causal_block_mask, flash_attention, full_mask, global_mask,
    intersection, local_mask, random_mask, strided_mask, union,
)

matplotlib.use("Agg")

NQ, NK, BS = 100, 130, (32, 16)


def _qkv(b=2, h=1, nq=NQ, nk=NK, d=16, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).requires_grad_(grad) for n in (nq, nk, nk)]


def _dense_reference(q, k, v, element_mask, causal):
    """Dense attention under an element mask; rows with no key give zeros."""
    if causal:
        element_mask = element_mask & torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~element_mask, float("-inf")), -1).nan_to_num(0.0)
    return p @ v


PATTERNS = {
    "local": lambda: local_mask(NQ, NK, 20, BS),
    "strided": lambda: strided_mask(NQ, NK, 3, BS),
    "global": lambda: global_mask(NQ, NK, 1, BS),
    "causal": lambda: causal_block_mask(NQ, NK, BS),
    "random": lambda: random_mask(NQ, NK, 0.3, BS, seed=4, batch=2, heads=1),  # has empty query blocks
    "union": lambda: local_mask(NQ, NK, 10, BS) | global_mask(NQ, NK, 1, BS),
    "intersection": lambda: intersection(local_mask(NQ, NK, 60, BS), strided_mask(NQ, NK, 2, BS)),
    "full": lambda: full_mask(NQ, NK, BS),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("causal", [False, True])
def test_pattern_matches_dense_masked_attention(name, causal):
    mask = PATTERNS[name]()
    q, k, v = _qkv(seed=len(name))
    o = block_sparse_attention(q, k, v, mask, causal=causal)
    ref = _dense_reference(q, k, v, mask.to_element_mask(NQ, NK), causal)
    torch.testing.assert_close(o, ref, atol=2e-5, rtol=2e-4)
    g = torch.randn(o.shape, generator=torch.Generator().manual_seed(9))
    for a, b in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-4)


def test_full_mask_equals_flash_and_bool_tensor_input():
    q, k, v = _qkv(1, 1)
    full = block_sparse_attention(q, k, v, full_mask(NQ, NK, (64, 64)))
    torch.testing.assert_close(full, flash_attention(q, k, v, block_m=64, block_n=64))
    t = torch.ones(1, 1, 4, 9, dtype=torch.bool)
    torch.testing.assert_close(block_sparse_attention(q, k, v, t, block_size=(32, 16)), full)


def test_empty_rows_give_zeros():
    q, k, v = _qkv(1, 1, 64, 64)
    m = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    m[0, 0, 1] = False  # the second query block sees nothing
    o = block_sparse_attention(q, k, v, BlockMask(m, (32, 32)))
    assert torch.equal(o[..., 32:, :], torch.zeros_like(o[..., 32:, :]))
    dq, = torch.autograd.grad(o.sum(), (q,))
    assert torch.equal(dq[..., 32:, :], torch.zeros_like(dq[..., 32:, :]))


def test_block_lists_like_flex_attention():
    # a tile pattern: every kept tile is a full block (no element mask), as FlexAttention lists them
    m = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 1, 1]], dtype=torch.bool)
    bm = BlockMask(m, (16, 16))
    assert bm.full_kv_num_blocks.tolist() == [[[2, 0, 2]]] and bm.kv_num_blocks.tolist() == [[[0, 0, 0]]]
    assert bm.full_kv_indices[0, 0, 0, :2].tolist() == [0, 2] and bm.full_kv_indices[0, 0, 2, :2].tolist() == [1, 2]
    assert bm.full_q_num_blocks.tolist() == [[[1, 1, 2]]]
    assert bm.full_q_indices[0, 0, 2, :2].tolist() == [0, 2]
    assert bm.kv_indices.dtype == torch.int32


def test_flex_attention_agrees_with_same_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n, bs = 96, (32, 32)
    mask = random_mask(n, n, 0.5, bs, seed=2) | local_mask(n, n, 0, bs)  # diagonal kept: no empty row
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fb = create_block_mask(mask.mask_mod, 1, 1, n, n, device="cpu", BLOCK_SIZE=bs)
        q, k, v = _qkv(1, 1, n, n, grad=False)  # FlexAttention has no CPU backward
        ref = flex_attention(q, k, v, block_mask=fb)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(fb, name), getattr(mask, name)), name
    o = block_sparse_attention(q, k, v, mask)
    torch.testing.assert_close(o, ref, atol=2e-5, rtol=2e-4)


def test_block_mask_inspection():
    m = local_mask(256, 256, 32, (64, 64))
    assert m.shape == (1, 1, 4, 4) and m.block_size == (64, 64)
    assert m.density == pytest.approx(10 / 16)
    text = repr(m)
    assert "density=62.5%" in text and "▒▒" in text and "░░" in text      # all partial: a band of 32 in tiles of 64
    assert "██" in repr(local_mask(256, 256, 100, (64, 64)))               # a band of 100 holds full tiles
    em = m.to_element_mask(256, 256)
    assert em.shape == (1, 1, 256, 256) and em[0, 0, 0, 32] and not em[0, 0, 0, 33]   # exact: not tile-aligned
    fig = m.to_figure()
    assert fig.axes and fig.axes[0].get_xlabel().startswith("key block")
    assert (~m).density == 1.0   # every tile holds a pair farther apart than 32
    assert union(m, ~m).density == 1.0 and intersection(m, ~m).density == 0.0
    assert causal_block_mask(100, 50, (32, 32)).mask[0, 0].tolist() == [[True, False], [True, True], [True, True], [True, True]]
    assert global_mask(128, 128, 1, (64, 64)).mask.sum() == 3
    assert strided_mask(128, 128, 2, (32, 32)).density == 1.0   # every tile holds even differences
    assert int(strided_mask(128, 128, 2, (32, 32)).full_blocks.sum()) == 0
    r1, r2 = random_mask(500, 500, 0.25, (32, 32), seed=7), random_mask(500, 500, 0.25, (32, 32), seed=7)
    assert r1 == r2 and 0.15 < r1.density < 0.35


def test_bad_masks_and_inputs():
    q, k, v = _qkv(1, 1)
    with pytest.raises(ValueError, match="block_mask: expected shape"):
        block_sparse_attention(q, k, v, torch.ones(1, 1, 3, 9, dtype=torch.bool), block_size=(32, 16))
    with pytest.raises(ValueError, match="block_mask: expected shape"):
        m = local_mask(NQ, NK, 1, BS)
        block_sparse_attention(q, k, v, BlockMask(m.mask.expand(3, 1, *m.num_blocks).contiguous(), m.block_size))
    with pytest.raises(TypeError, match="block_mask"):
        block_sparse_attention(q, k, v, torch.ones(1, 1, 4, 9), block_size=(32, 16))
    with pytest.raises(TypeError, match="block_mask"):
        block_sparse_attention(q, k, v, [[True]])
    with pytest.raises(ValueError, match="block_size"):
        block_sparse_attention(q, k, v, torch.ones(1, 1, 4, 9, dtype=torch.bool), block_size=(32, 24))
    with pytest.raises(ValueError, match="the block_mask's block_size"):
        block_sparse_attention(q, k, v, local_mask(NQ, NK, 1, BS), block_size=(64, 64))
    with pytest.raises(TypeError, match="bfloat16"):
        block_sparse_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), local_mask(NQ, NK, 1, BS))
    with pytest.raises(ValueError, match="head_dim"):
        block_sparse_attention(q[..., :8], k[..., :8], v[..., :8], local_mask(NQ, NK, 1, BS))
    with pytest.raises(ValueError, match="window"):
        local_mask(10, 10, -1)
    with pytest.raises(ValueError, match="density"):
        random_mask(10, 10, 1.5)
    with pytest.raises(ValueError, match="masks: expected one block size"):
        union(local_mask(64, 64, 1, (32, 32)), local_mask(64, 64, 1, (16, 16)))
    with pytest.raises(TypeError, match="mask: expected dtype bool"):
        BlockMask(torch.ones(1, 1, 2, 2), (16, 16))
    with pytest.raises(ValueError, match="expected q with 64 positions"):
        local_mask(64, 64, 1, (32, 32)).to_element_mask(10, 64)


def test_a_mask_made_for_other_lengths_is_refused():
    # issue 24, 5(a): full_mask(100, 130) reused at n_q = 120 with causal gave wrong output; now it refuses
    q, k, v = _qkv(1, 1, 120, NK, grad=False)
    with pytest.raises(ValueError, match="block_mask: expected q with 100 positions and k with 130"):
        block_sparse_attention(q, k, v, full_mask(NQ, NK, BS), causal=True)
    # a tile pattern (no lengths) fits any lengths with its numbers of blocks
    block_sparse_attention(q[..., :97, :], k, v, BlockMask(torch.ones(1, 1, 4, 9, dtype=torch.bool), BS))


@pytest.mark.parametrize("causal", [False, True])
def test_matches_the_reference_library(causal):
    from attnlab.attention import block_sparse_reference

    mask = random_mask(NQ, NK, 0.4, BS, seed=3)   # a tile pattern: the reference takes tiles
    q, k, v = _qkv(grad=False, seed=11)
    torch.testing.assert_close(block_sparse_attention(q, k, v, mask, causal=causal),
                               block_sparse_reference(q, k, v, mask, causal=causal), atol=2e-5, rtol=2e-4)
