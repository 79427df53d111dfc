"""The toy tasks of lessons 02-04: shapes, targets that follow the rule, determinism, bad input."""

import pytest
import torch

from attnlab.data.toy import IGNORE, InductionCopy, KeyValueLookup, PreviousK, PreviousTwo, batches


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


TASKS = [KeyValueLookup(n_pairs=5, n_keys=7, n_values=6), PreviousTwo(vocab=5, seq_len=9), PreviousK(k=3, vocab=4, seq_len=7),
         InductionCopy(vocab=9, half=6)]


@pytest.mark.parametrize("task", TASKS, ids=lambda t: type(t).__name__)
def test_shapes_ranges_and_determinism(task):
    tokens, targets = task.sample(17, gen(3))
    assert tokens.shape == targets.shape == (17, task.seq_len)
    assert tokens.dtype == targets.dtype == torch.long
    assert 0 <= tokens.min() and tokens.max() < task.vocab_size
    real = targets[targets != IGNORE]
    assert real.numel() > 0 and 0 <= real.min() and real.max() < task.n_classes
    again = task.sample(17, gen(3))
    assert torch.equal(tokens, again[0]) and torch.equal(targets, again[1])
    other = task.sample(17, gen(4))
    assert not torch.equal(tokens, other[0])
    assert len(task.token_names(tokens[0])) == task.seq_len


def test_key_value_lookup_answers_the_query():
    task = KeyValueLookup(n_pairs=6, n_keys=8, n_values=5)
    tokens, targets = task.sample(200, gen())
    pairs, query = tokens[:, :-1], tokens[:, -1]
    keys, values = pairs // task.n_values, pairs % task.n_values
    qkey = query - task.n_keys * task.n_values
    assert (targets[:, :-1] == IGNORE).all()
    for b in range(200):
        assert len(set(keys[b].tolist())) == task.n_pairs          # keys distinct
        (hit,) = (keys[b] == qkey[b]).nonzero()[0].tolist()        # exactly one pair matches
        assert targets[b, -1] == values[b, hit]
    assert task.token_names(tokens[0])[-1].endswith("?")


def test_previous_two_targets_are_the_ordered_pair():
    task = PreviousTwo(vocab=6, seq_len=10)
    tokens, targets = task.sample(50, gen())
    assert (targets[:, :2] == IGNORE).all()
    i = 5
    assert torch.equal(targets[:, i], tokens[:, i - 1] * 6 + tokens[:, i - 2])


def test_previous_k_targets_are_the_ordered_tuple_and_previous_two_is_k_2():
    task = PreviousK(k=3, vocab=5, seq_len=9)
    tokens, targets = task.sample(50, gen())
    assert task.n_classes == 125 and (targets[:, :3] == IGNORE).all()
    for i in range(3, 9):                                          # decode the class back into the three tokens
        cls = targets[:, i]
        assert torch.equal(cls // 25, tokens[:, i - 1])
        assert torch.equal(cls // 5 % 5, tokens[:, i - 2])
        assert torch.equal(cls % 5, tokens[:, i - 3])
    two, k2 = PreviousTwo(5, 9), PreviousK(k=2, vocab=5, seq_len=9)   # same positional arguments as before
    assert two.k == 2 and two.n_classes == 25
    a, b = two.sample(20, gen(2)), k2.sample(20, gen(2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_induction_copy_repeats_a_segment_of_varying_length_and_predicts_next():
    task = InductionCopy(vocab=10, half=6, min_len=3)
    tokens, targets = task.sample(200, gen())
    assert (tokens[:, 0] == 0).all() and (tokens[:, 1:] > 0).all()
    lengths = set()
    for b in range(200):
        keep = (targets[b] != IGNORE).nonzero()[:, 0]
        L = int(keep[0]) - 1                                       # targets start at the repeat's first token
        lengths.add(L)
        assert 3 <= L <= 6
        assert torch.equal(tokens[b, 1:L + 1], tokens[b, L + 1:2 * L + 1])   # the segment, then again
        assert keep.tolist() == list(range(L + 1, 2 * L))            # every repeat token but the last
        assert torch.equal(targets[b, keep], tokens[b, keep + 1])    # the next token
    assert lengths == {3, 4, 5, 6}                                 # the offset varies


def test_batches_are_seeded():
    a = next(batches(PreviousTwo(), 4, seed=1))
    b = next(batches(PreviousTwo(), 4, seed=1))
    assert torch.equal(a[0], b[0])


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="n_pairs"):
        KeyValueLookup(n_pairs=9, n_keys=8)
    with pytest.raises(TypeError, match="vocab"):
        PreviousTwo(vocab=2.5)
    with pytest.raises(ValueError, match="seq_len"):
        PreviousTwo(seq_len=2)
    with pytest.raises(ValueError, match="seq_len"):
        PreviousK(k=4, seq_len=4)
    with pytest.raises(ValueError, match="k"):
        PreviousK(k=0)
    with pytest.raises(ValueError, match="batch_size"):
        KeyValueLookup().sample(0)
    with pytest.raises(ValueError, match="min_len"):
        InductionCopy(half=4, min_len=5)
    with pytest.raises(TypeError, match="generator"):
        InductionCopy().sample(2, generator=0)
