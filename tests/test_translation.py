"""The synthetic translation task of lesson 01 and the BLEU that scores it."""

import math
import random

import pytest
import torch
from hypothesis import given, strategies as st

from attnlab.bleu import alignment_accuracy, bleu_by_length, corpus_bleu, exact_match, ngram_matches
from attnlab.data.translation import (
    ADJECTIVES, MAX_LEN, MIN_LEN, NOUNS, batches, detokenize, encode, generate_pair, generate_pairs, load_task, make_splits,
    pad_batch, source_vocab, target_vocab, translate_rule_based,
)

FR_NOUNS = {fr: (num, g) for *_, sg, pl, g in NOUNS for fr, num in ((sg, "sg"), (pl, "pl"))}
FR_DETS = {"le": ("sg", "m"), "la": ("sg", "f"), "un": ("sg", "m"), "une": ("sg", "f"), "ce": ("sg", "m"),
           "cet": ("sg", "m"), "cette": ("sg", "f"), "du": ("sg", "m")}
VOWELS = tuple("aeiouyàâéèêîôû")
FR_ADJ = {w: key for a in ADJECTIVES for w, key in zip(a[1:], [("sg", "m"), ("sg", "f"), ("pl", "m"), ("pl", "f")])}


@pytest.fixture(scope="module")
def small_task():
    return load_task(n_train=600, n_valid=50, n_test=100, seed=3)


# ----------------------------------------------------------------------------- the grammar


@given(seed=st.integers(0, 10_000), length=st.integers(MIN_LEN, MAX_LEN))
def test_exact_length_and_consistent_translation(seed, length):
    en, fr = generate_pair(random.Random(seed), length)
    assert len(en.split()) == length
    assert en.endswith(" .") and fr.endswith(" .")
    assert translate_rule_based(en) == fr


@given(seed=st.integers(0, 10_000))
def test_agreement_and_adjective_after_noun(seed):
    en, fr = generate_pair(random.Random(seed), 50)
    words = fr.split()
    for i, w in enumerate(words):
        if w in FR_NOUNS:
            num, gender = FR_NOUNS[w]
            det = words[i - 1]  # the determiner comes right before the noun in French
            if det in FR_DETS:
                assert FR_DETS[det] == (num, gender), (det, w)
                assert w.startswith(VOWELS) == (det == "cet") or det not in ("le", "la", "ce", "cet"), (det, w)
            elif det == "l'":  # elided le / la: singular, before a vowel
                assert num == "sg" and w.startswith(VOWELS), (det, w)
            elif det == "d'":  # "près d' oiseaux" (de + des before a vowel)
                assert num == "pl" and w.startswith(VOWELS) and words[i - 2] == "près", (det, w)
            elif det == "de":  # "près de chiens" (de + des)
                assert num == "pl" and words[i - 2] == "près", (det, w)
            else:
                assert det in ("les", "des", "ces") and num == "pl", (det, w)
            if i + 1 < len(words) and words[i + 1] in FR_ADJ:  # the adjective follows and agrees
                adj = words[i + 1]
                assert FR_ADJ[adj] == (num, gender) or adj in ("rouge", "rouges") and FR_ADJ[adj][0] == num


@given(seed=st.integers(0, 10_000))
def test_elision_and_contraction_everywhere(seed):
    """No "le oiseau", "ce arbre", "que une", "de un", "de le", "de les" or "de des" survives (Bahdanau et al.'s
    French is real French; ours should be too)."""
    words = generate_pair(random.Random(seed), 50)[1].split()
    for a, b in zip(words, words[1:]):
        if b.startswith(VOWELS):
            assert a not in ("le", "la", "ce", "que", "de"), (a, b)
        if a in ("l'", "qu'", "d'", "cet"):
            assert b.startswith(VOWELS), (a, b)
        assert not (a == "de" and b in ("le", "les", "des")), (a, b)


def test_hand_examples_of_elision_and_contraction():
    fr, align = translate_rule_based("the bird sleeps near the dog while a girl sees this tree near some birds .",
                                     return_alignment=True)
    assert fr == "l' oiseau dort près du chien pendant qu' une fille voit cet arbre près d' oiseaux ."
    # "du" and the "d'" of "de des" keep the article's alignment; "qu'" keeps the conjunction's
    assert align == [0, 1, 2, 3, 4, 5, 6, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert translate_rule_based("the cat sleeps near a house .") == "le chat dort près d' une maison ."
    assert translate_rule_based("the cat sleeps near the tree .") == "le chat dort près de l' arbre ."
    assert translate_rule_based("the cat sleeps near the trees .") == "le chat dort près des arbres ."
    assert detokenize("l' oiseau dort pendant qu' une fille court .") == "l'oiseau dort pendant qu'une fille court ."


def test_gold_alignment_crosses_where_the_words_swap():
    fr, align = translate_rule_based("the boy often sees a small dog because the girls sleep .", return_alignment=True)
    assert fr == "le garçon voit souvent un chien petit parce que les filles dorment ."
    assert align == [0, 1, 3, 2, 4, 6, 5, 7, 7, 8, 9, 10, 11]


@given(seed=st.integers(0, 10_000))
def test_gold_alignment_is_complete(seed):
    en, fr = generate_pair(random.Random(seed), 40)
    _, align = translate_rule_based(en, return_alignment=True)
    assert len(align) == len(fr.split())
    assert sorted(set(align)) == list(range(len(en.split())))  # every English word is translated


def test_alignment_accuracy():
    assert alignment_accuracy([torch.eye(3)], [[0, 1, 2]]) == 100.0
    w = torch.tensor([[0.6, 0.4, 0.0], [0.7, 0.3, 0.0], [0.0, 0.0, 1.0], [0.5, 0.5, 0.0]])  # extra row: <eos>
    assert alignment_accuracy([w], [[0, 1, 2]]) == pytest.approx(200 / 3)
    with pytest.raises(ValueError, match="alignments"):
        alignment_accuracy([torch.eye(2)], [[0, 1, 1]])


def test_hand_examples_of_the_grammar():
    assert translate_rule_based("the red car sleeps .") == "la voiture rouge dort ."
    assert translate_rule_based("these small dogs often see a white house .") == \
        "ces chiens petits voient souvent une maison blanche ."
    assert translate_rule_based("the boy runs because the girls sleep .") == \
        "le garçon court parce que les filles dorment ."
    with pytest.raises(ValueError, match="english"):
        translate_rule_based("the red spaceship sleeps .")


def test_lengths_cover_5_to_50():
    lengths = [len(e.split()) for e, _ in generate_pairs(2000, seed=1)]
    assert min(lengths) == MIN_LEN and max(lengths) == MAX_LEN
    # roughly uniform: every bin of five lengths holds at least half its share
    for lo in range(MIN_LEN, MAX_LEN, 5):
        assert sum(lo <= n < lo + 5 for n in lengths) > 0.5 * 2000 * 5 / 46


def test_reordering_really_crosses():
    """Some adjective-noun pair is swapped in most long sentences: the alignment is not diagonal."""
    pairs = generate_pairs(200, seed=2, min_len=30)
    adjs = {a[0] for a in ADJECTIVES}
    swapped = sum(any(w in adjs for w in e.split()) for e, _ in pairs)
    assert swapped > 190


def test_bad_lengths_rejected():
    with pytest.raises(ValueError, match="length"):
        generate_pair(random.Random(0), 4)
    with pytest.raises(ValueError, match="length"):
        generate_pair(random.Random(0), 51)
    with pytest.raises(ValueError, match="min_len"):
        generate_pairs(3, seed=0, min_len=20, max_len=10)


# ----------------------------------------------------------------------------- splits, vocabularies, batches


def test_splits_are_seeded_and_disjoint():
    a, b, c = make_splits(300, 30, 30, seed=5), make_splits(300, 30, 30, seed=5), make_splits(300, 30, 30, seed=6)
    assert a == b and a != c
    sets = {k: {e for e, _ in v} for k, v in a.items()}
    assert not (sets["train"] & sets["test"]) and not (sets["train"] & sets["valid"]) and not (sets["valid"] & sets["test"])
    assert [len(a[k]) for k in ("train", "valid", "test")] == [300, 30, 30]
    # the test split is drawn first: it does not depend on how much training data is asked for
    assert make_splits(0, 0, 30, seed=5)["test"] == a["test"]


def test_vocab_round_trip_and_no_unknown_words(small_task):
    sv, tv = small_task.src_vocab, small_task.tgt_vocab
    assert sv.itos[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    for e, f in small_task.pairs["train"][:100]:
        assert sv.decode(sv.encode(e)) == e and tv.decode(tv.encode(f)) == f
    assert all(3 not in ids for ids in small_task.src["train"] + small_task.tgt["train"])
    assert sv.encode("the zebra .") == [sv.stoi["the"], sv.unk_id, sv.stoi["."], sv.eos_id]
    assert len(source_vocab()) == len(sv) and len(target_vocab()) == len(tv)


def test_pad_batch_and_encode():
    ids, lengths = pad_batch([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and lengths.tolist() == [3, 1]
    src, src_len = encode(["the red car .", "the cat sleeps ."], source_vocab())
    assert src.shape == (2, 5) and src_len.tolist() == [5, 5]
    with pytest.raises(ValueError, match="seqs"):
        pad_batch([])


def test_batches_cover_each_example_once_with_little_padding(small_task):
    src, tgt = small_task.src["train"], small_task.tgt["train"]
    g = torch.Generator().manual_seed(0)
    seen, padded, real = [], 0, 0
    for s, sl, t, tl in batches(src, tgt, 32, generator=g):
        assert s.shape[0] == t.shape[0] == sl.shape[0] <= 32
        assert int(sl.max()) == s.shape[1] and int(tl.max()) == t.shape[1]
        for row, n in zip(s, sl):
            seen.append(tuple(row[:n].tolist()))
            assert row[n - 1] == small_task.src_vocab.eos_id and (row[n:] == 0).all()
        padded += s.numel()
        real += int(sl.sum())
    assert sorted(seen) == sorted(tuple(x) for x in src)
    assert real / padded > 0.9  # sorting inside pools keeps batches of similar lengths
    first = next(batches(src, tgt, 32, generator=torch.Generator().manual_seed(0)))[0]
    again = next(batches(src, tgt, 32, generator=torch.Generator().manual_seed(0)))[0]
    assert torch.equal(first, again)


# ----------------------------------------------------------------------------- BLEU


def test_bleu_hand_cases():
    assert corpus_bleu(["le chat dort ."], ["le chat dort ."]) == pytest.approx(100.0)
    # p1..p4 = 4/5, 3/4, 2/3, 1/2 and equal lengths (no brevity penalty)
    assert corpus_bleu(["a b c d e"], ["a b c d f"]) == pytest.approx(100 * (4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25)
    # every n-gram right but 4 words for 6: brevity penalty exp(1 - 6/4)
    assert corpus_bleu(["a b c d"], ["a b c d e f"]) == pytest.approx(100 * math.exp(-0.5))
    # longer than the reference: no bonus, precision pays
    assert corpus_bleu(["a b c d e f"], ["a b c d"]) == pytest.approx(100 * (4 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25)
    assert corpus_bleu(["x y z w"], ["a b c d"]) == 0.0
    assert corpus_bleu(["a b c"], ["a b c"]) == 0.0  # no 4-gram at all, no smoothing


def test_bleu_is_corpus_level_not_a_mean_of_sentences():
    hyps, refs = ["a b c d", "a b c d e"], ["a b c d", "a b c d f"]
    expected = 100 * (8 / 9 * 6 / 7 * 4 / 5 * 2 / 3) ** 0.25
    assert corpus_bleu(hyps, refs) == pytest.approx(expected)
    mean_of_sentences = (corpus_bleu(hyps[:1], refs[:1]) + corpus_bleu(hyps[1:], refs[1:])) / 2
    assert abs(corpus_bleu(hyps, refs) - mean_of_sentences) > 1


def test_clipped_counts_and_exact_match():
    assert ngram_matches("the the the", "the cat", 1) == (1, 3)
    assert ngram_matches("a b", "a b", 3) == (0, 0)
    assert exact_match(["a b", "a c", "d"], ["a b", "a b", "d"]) == pytest.approx(200 / 3)
    with pytest.raises(ValueError, match="hypotheses"):
        corpus_bleu(["a"], ["a", "b"])
    with pytest.raises(TypeError, match="hypotheses"):
        corpus_bleu("a b", "a b")


def test_bleu_by_length_bins():
    hyps = ["a b c d", "a b c d e", "x y z w v u"]
    refs = ["a b c d", "a b c d f", "a b c d e f"]
    rows = bleu_by_length(hyps, refs, [4, 5, 11], bins=[0, 5, 10, 15])
    assert [(r["lo"], r["count"]) for r in rows] == [(0, 1), (5, 1), (10, 1)]
    assert [r["exact"] for r in rows] == [100.0, 0.0, 0.0]
    assert rows[1]["bleu"] == pytest.approx(corpus_bleu(hyps[1:2], refs[1:2]))
    with pytest.raises(ValueError, match="bins"):
        bleu_by_length(hyps, refs, [1, 2, 3], bins=[5])
