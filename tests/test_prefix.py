"""attnlab/prefix.py: sequences sharing a prompt's blocks through their block tables, copy-on-write of the shared
partly filled block (Kwon et al. 2023, section 4), decoding exact against each sequence's own contiguous cache,
and the blocks saved, by the pool and by formula."""

import pytest
import torch

from attnlab.kernels import flash_decode
from attnlab.kvcache import decode_reference
from attnlab.prefix import PagedKVPool, prefix_sharing_blocks


def kv(T, H=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, T, D, generator=g), torch.randn(H, T, D, generator=g)


def shared_prompt(pool, P, suffixes, seed=0):
    """One sequence prefilled with a P-token prompt, forked for the others; each then appends its suffix.
    Returns the ids and each sequence's own contiguous (k, v)."""
    kp, vp = kv(P, seed=seed)
    first = pool.new_sequence()
    pool.append(first, kp, vp)
    seqs = [first] + [pool.fork(first) for _ in suffixes[1:]]
    own = []
    for i, (s, n) in enumerate(zip(seqs, suffixes)):
        ks, vs = kv(n, seed=seed + 1 + i)
        if n:
            pool.append(s, ks[:, :3], vs[:, :3])                        # in two writes: the copy happens once
            pool.append(s, ks[:, 3:], vs[:, 3:])
        own.append((torch.cat([kp, ks], dim=1), torch.cat([vp, vs], dim=1)))
    return seqs, own


def contiguous(own):
    S = max(k.shape[1] for k, _ in own)
    kc = torch.zeros(len(own), 2, S, 16)
    vc = torch.zeros_like(kc)
    for b, (k, v) in enumerate(own):
        kc[b, :, :k.shape[1]], vc[b, :, :v.shape[1]] = k, v
    return kc, vc, torch.tensor([k.shape[1] for k, _ in own], dtype=torch.int32)


def test_fork_shares_blocks_and_appending_copies_the_shared_partial_block_once():
    pool = PagedKVPool(32, 2, 16, 16)
    kp, vp = kv(37)
    a = pool.new_sequence()
    pool.append(a, kp, vp)
    assert pool.tables[a] == [0, 1, 2] and pool.blocks_in_use == 3
    b = pool.fork(a)
    assert pool.tables[b] == pool.tables[a] and pool.refcount[:3].tolist() == [2, 2, 2] and pool.blocks_in_use == 3
    k1, v1 = kv(5, seed=7)
    pool.append(b, k1, v1)                                             # block 2 is shared and partly filled
    assert pool.copies == 1 and pool.tables[b][:2] == [0, 1] and pool.tables[b][2] != 2
    assert pool.refcount[2] == 1 and pool.refcount[pool.tables[b][2]] == 1
    ka, _ = pool.gather(a)
    kb, vb = pool.gather(b)
    assert torch.equal(ka, kp)                                         # a's prompt is untouched by b's write
    assert torch.equal(kb, torch.cat([kp, k1], dim=1)) and torch.equal(vb, torch.cat([vp, v1], dim=1))
    k2, v2 = kv(30, seed=8)
    pool.append(a, k2, v2)                                             # a is block 2's only user now: in place
    assert pool.copies == 1 and pool.tables[a][2] == 2 and len(pool.tables[a]) == 5
    assert torch.equal(pool.gather(a)[1], torch.cat([vp, v2], dim=1))
    pool.free_sequence(a)
    assert pool.refcount[:2].tolist() == [1, 1] and pool.refcount[2] == 0 and 2 in pool.free
    assert pool.blocks_in_use == 3                                     # b's: two shared prompt blocks and its copy


@pytest.mark.parametrize("P,suffixes", [(37, [5, 20, 0, 44]), (32, [9, 1, 16]), (50, [3, 3])])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decoding_through_shared_tables_equals_each_sequences_own_cache(P, suffixes, num_splits):
    pool = PagedKVPool(40, 2, 16, 16)
    seqs, own = shared_prompt(pool, P, suffixes)
    kc, vc, lens = contiguous(own)
    assert torch.equal(pool.seqlens(seqs), lens)
    table = pool.block_table(seqs)
    assert (table[:, 0] == table[0, 0]).all()                          # every row starts at the same physical block
    n_q = 2
    q = torch.randn(len(seqs), 4, n_q, 16, generator=torch.Generator().manual_seed(9))   # GQA: 4 query heads
    ref = decode_reference(q, kc, vc, lens, scale=0.2)
    o = flash_decode(q, pool.k, pool.v, lens, block_table=table, num_splits=num_splits, scale=0.2)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode_reference(q, pool.k, pool.v, lens, block_table=table, scale=0.2), ref)


def test_a_block_size_the_kernel_does_not_take_still_decodes_through_the_reference():
    pool = PagedKVPool(40, 2, 12, 16)                                   # 12-token blocks: decode_reference only
    seqs, own = shared_prompt(pool, 29, [7, 0, 13], seed=3)
    kc, vc, lens = contiguous(own)
    q = torch.randn(3, 2, 1, 16, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(decode_reference(q, pool.k, pool.v, lens, block_table=pool.block_table(seqs)),
                               decode_reference(q, kc, vc, lens))


@pytest.mark.parametrize("P,suffixes,bs", [(37, [5, 20, 0, 44], 16), (37, [5, 20, 1, 44], 16), (32, [9, 1, 16], 16),
                                           (29, [7, 0, 13], 12), (100, [0, 0], 16), (0, [4, 20], 16), (5, [1], 8)])
def test_blocks_saved_by_formula_equal_the_pools_count(P, suffixes, bs):
    pool = PagedKVPool(64, 2, bs, 16)
    shared_prompt(pool, P, suffixes)
    count = prefix_sharing_blocks(P, suffixes, bs)
    assert count["shared"] == pool.blocks_in_use and count["copies"] == pool.copies
    alone = PagedKVPool(64, 2, bs, 16)                                  # no sharing: every sequence its own blocks
    for n in suffixes:
        s = alone.new_sequence()
        alone.append(s, *kv(P + n))
    assert count["unshared"] == alone.blocks_in_use
    assert count["saved"] == alone.blocks_in_use - pool.blocks_in_use
    assert pool.bytes_in_use == pool.blocks_in_use * 2 * 2 * bs * 16 * 4


def test_a_long_shared_prompt_saves_most_blocks():
    c = prefix_sharing_blocks(1000, [50, 80, 20, 200], 16)
    assert c["unshared"] == 66 + 68 + 64 + 75 and c["shared"] == 63 + 3 + (3 + 5 + 1 + 12)
    assert c["saved"] / c["unshared"] > 0.65


def test_errors_name_the_argument():
    pool = PagedKVPool(2, 2, 16, 16)
    s = pool.new_sequence()
    with pytest.raises(ValueError, match="seq: expected a live sequence"):
        pool.append(7, *kv(3))
    with pytest.raises(ValueError, match="k_new: expected shape"):
        pool.append(s, torch.randn(3, 4, 16), torch.randn(3, 4, 16))
    with pytest.raises(ValueError, match="v_new: expected shape"):
        pool.append(s, torch.randn(2, 4, 16), torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="k_new: expected a 3-D"):
        pool.append(s, torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16))
    with pytest.raises(RuntimeError, match="all 2 blocks"):
        pool.append(s, *kv(40))
    with pytest.raises(ValueError, match="block_size"):
        PagedKVPool(4, 2, 0, 16)
    with pytest.raises(ValueError, match="prefix_len"):
        prefix_sharing_blocks(-1, [3], 16)
    with pytest.raises(ValueError, match="suffix_lens"):
        prefix_sharing_blocks(10, [], 16)
