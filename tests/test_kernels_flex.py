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
