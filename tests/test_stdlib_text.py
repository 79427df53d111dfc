"""The character corpus built from the standard library's own source (lesson 09)."""

import shutil

import pytest
import torch

from attnlab.data.stdlib_text import (
    REFERENCE_SHA256, TRAIN_FILES, VALID_FILES, VOCAB, decode, encode, load_corpus, stdlib_dir,
)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_file_list_is_fixed_and_the_splits_are_disjoint_whole_files():
    assert not set(TRAIN_FILES) & set(VALID_FILES)
    assert set(REFERENCE_SHA256) == set(TRAIN_FILES) | set(VALID_FILES)
    for name in (*TRAIN_FILES, *VALID_FILES):
        assert (stdlib_dir() / name).is_file(), name


def test_corpus_is_the_listed_files_in_order(corpus):
    for split, names in (("train", TRAIN_FILES), ("valid", VALID_FILES)):
        text = corpus.text[split]
        positions = [text.index(f"# ==== {name} ====\n") for name in names]
        assert positions == sorted(positions) and positions[0] == 0
        assert corpus.files[split] == list(names)
        assert corpus.tokens[split].dtype == torch.long and corpus.tokens[split].numel() == len(text)
    # no text of a validation file appears in training: its header is absent
    for name in VALID_FILES:
        assert f"# ==== {name} ====" not in corpus.text["train"]
    assert len(corpus.text["train"]) > 100_000 and len(corpus.text["valid"]) > 10_000


def test_reading_twice_gives_the_same_corpus(corpus):
    again = load_corpus()
    assert again.text == corpus.text and again.sha256 == corpus.sha256
    assert torch.equal(again.tokens["train"], corpus.tokens["train"])


def test_vocabulary_is_fixed_and_round_trips(corpus):
    assert len(VOCAB) == 96 and VOCAB[0] == "\n" and VOCAB[1] == " " and VOCAB[-1] == "~"
    sample = corpus.text["train"][:2000]
    assert decode(encode(sample)) == sample
    assert encode("def f():").tolist() == [69, 70, 71, 1, 71, 9, 10, 27]
    with pytest.raises(ValueError, match="text"):
        encode("café")
    with pytest.raises(ValueError, match="ids"):
        decode([0, 96])
    with pytest.raises(TypeError, match="text"):
        encode(b"bytes")


def test_batches_are_next_character_windows_and_seeded(corpus):
    x, y = corpus.batch("train", 4, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])          # y is x shifted by one character
    text = corpus.text["train"]
    window = decode(x[0]) + decode(y[0])[-1]
    assert window in text
    x2, y2 = corpus.batch("train", 4, 32, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    xv, _ = corpus.batch("valid", 2, 16, torch.Generator().manual_seed(0))
    assert decode(xv[0]) in corpus.text["valid"]


def test_bad_arguments_name_themselves(corpus, tmp_path):
    with pytest.raises(ValueError, match="split"):
        corpus.batch("test", 2, 8)
    with pytest.raises(ValueError, match="batch_size"):
        corpus.batch("train", 0, 8)
    with pytest.raises(ValueError, match="seq_len"):
        corpus.batch("valid", 1, 10**7)
    with pytest.raises(TypeError, match="generator"):
        corpus.batch("train", 1, 8, generator=0)
    with pytest.raises(FileNotFoundError, match="bisect.py"):
        load_corpus(tmp_path)
    with pytest.raises(FileNotFoundError, match="root"):
        load_corpus(tmp_path / "nowhere")


def test_a_changed_file_is_reported_and_odd_characters_are_mapped(tmp_path):
    for name in (*TRAIN_FILES, *VALID_FILES):
        shutil.copy(stdlib_dir() / name, tmp_path / name)
    same = load_corpus(tmp_path)
    assert same.differs == [n for n in (*TRAIN_FILES, *VALID_FILES) if same.sha256[n] != REFERENCE_SHA256[n]]
    with open(tmp_path / "colorsys.py", "a", encoding="utf-8") as f:
        f.write("\n# caf\u00e9\tend\n")
    changed = load_corpus(tmp_path)
    assert "colorsys.py" in changed.differs and not changed.matches_reference
    assert changed.replaced == same.replaced + 1
    assert "# caf?    end\n" in changed.text["train"]
    assert "differs from the reference" in repr(changed)
