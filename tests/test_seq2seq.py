"""RNNencdec and RNNsearch (lesson 01), the training loop, and the checkpoints that ship with the course."""

import os

import pytest
import torch

from attnlab.bleu import corpus_bleu
from attnlab.data.translation import encode, load_task
from attnlab.models.seq2seq import RNNencdec, RNNsearch, translate
from attnlab.pretrained import (
    RECIPES, SEEDS, TASK, checkpoint_path, load_checkpoint, load_pretrained, make_checkpoint, validation_loss,
)
from attnlab.train import deterministic, train

SMALL = dict(emb_dim=8, hidden_dim=12, maxout_dim=6)


@pytest.fixture(scope="module")
def task():
    """The exact data the checkpoints were trained on (about two seconds to generate)."""
    return load_task(**TASK)


@pytest.fixture(scope="module")
def batch(task):
    src, src_len = encode([e for e, _ in task.pairs["train"][:6]], task.src_vocab)
    tgt, _ = encode([f for _, f in task.pairs["train"][:6]], task.tgt_vocab)
    return src, src_len, tgt


def _model(cls, task, seed=0):
    with deterministic(seed):
        return cls(len(task.src_vocab), len(task.tgt_vocab), **SMALL)


@pytest.mark.parametrize("cls", [RNNencdec, RNNsearch])
def test_shapes(cls, task, batch):
    src, src_len, tgt = batch
    model = _model(cls, task)
    logits = model(src, src_len, tgt)
    assert logits.shape == (6, tgt.shape[1], len(task.tgt_vocab))
    ids, weights = model.greedy_decode(src, src_len, max_len=7)
    assert ids.shape[0] == 6 and ids.shape[1] <= 7 and ids.dtype == torch.long
    if cls is RNNencdec:
        assert weights is None
    else:
        assert weights.shape == (6, ids.shape[1], src.shape[1])


def test_search_with_hoisted_keys_is_the_additive_attention(task, batch):
    """RNNsearch.search (U h_j computed once per sentence) is AdditiveAttention's function, not a second one."""
    src, src_len, _ = batch
    model = _model(RNNsearch, task)
    h, mask, s = model.encode(src, src_len)
    q = torch.randn(s.shape, generator=torch.Generator().manual_seed(1))
    c1, w1 = model.search(q, h, model.attention.U(h), mask)
    c2, w2 = model.attention(q, h, mask)
    assert torch.allclose(c1, c2, atol=1e-6) and torch.allclose(w1, w2, atol=1e-6)


def test_alignment_weights_are_distributions_over_real_words(task, batch):
    src, src_len, _ = batch
    _, weights = _model(RNNsearch, task).greedy_decode(src, src_len, max_len=5)  # nothing ends early: untrained
    pad = torch.arange(src.shape[1])[None, :] >= src_len[:, None]  # (B, S)
    assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:2]), atol=1e-5)
    assert (weights.masked_select(pad[:, None, :].expand_as(weights)) == 0).all()


@pytest.mark.parametrize("cls", [RNNencdec, RNNsearch])
def test_padding_does_not_change_a_translation(cls, task, batch):
    """A sentence decodes the same alone and batched beside a longer one (masks and packing work)."""
    src, src_len, tgt = batch
    model = _model(cls, task)
    short = int(src_len.argmin())
    alone = model(src[short:short + 1, : src_len[short]], src_len[short:short + 1], tgt[short:short + 1])
    together = model(src, src_len, tgt)[short:short + 1]
    assert torch.allclose(alone, together, atol=1e-5)


@pytest.mark.parametrize("cls", [RNNencdec, RNNsearch])
def test_one_training_step_reduces_the_loss(cls, task, batch):
    src, src_len, tgt = batch
    model = _model(cls, task)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = model.loss(src, src_len, tgt)
    opt.zero_grad()
    before.backward()
    opt.step()
    assert model.loss(src, src_len, tgt).item() < before.item() - 1e-3


def test_training_loop_is_seeded(task):
    runs = []
    for _ in range(2):
        with deterministic(0):
            model = RNNsearch(len(task.src_vocab), len(task.tgt_vocab), **SMALL)
            runs.append(train(model, task, steps=3, batch_size=8, progress=False)["loss"])
    assert runs[0] == runs[1] and len(runs[0]) == 3


def test_bad_input(task, batch):
    src, src_len, tgt = batch
    model = _model(RNNsearch, task)
    with pytest.raises(TypeError, match="src"):
        model(src.float(), src_len, tgt)
    with pytest.raises(ValueError, match="src_len"):
        model(src, src_len[:3], tgt)
    with pytest.raises(ValueError, match="steps"):
        train(model, task, steps=-1)
    with pytest.raises(TypeError, match="sentences"):
        translate(model, "the cat sleeps .", task.src_vocab, task.tgt_vocab)
    with pytest.raises(ValueError, match="name"):
        load_pretrained("Transformer")


# ----------------------------------------------------------------------------- shipped checkpoints

SHIPPED = [(name, seed) for name in sorted(RECIPES) for seed in SEEDS]


@pytest.mark.parametrize("name, seed", SHIPPED)
def test_checkpoints_are_small_and_followed_the_budget_rule(name, seed):
    """Each shipped run ended by the budget rule (validation stalled) or at the common step cap, and kept its best weights."""
    path = checkpoint_path(name, seed=seed)
    assert path.exists(), f"missing {path}: run `attnlab checkpoints`"
    assert path.stat().st_size < 2 * 2**20
    ckpt = load_checkpoint(name, seed=seed)
    recipe = RECIPES[name]
    assert ckpt["recipe"] == recipe and ckpt["task"] == TASK and ckpt["seed"] == seed
    steps, valid = len(ckpt["loss"]), ckpt["valid"]
    assert [s for s, _ in valid] == list(range(0, steps + 1, recipe["eval_every"]))
    assert dict(valid)[ckpt["best_step"]] == min(v for _, v in valid)
    assert _rule_stops_at(valid, recipe) == steps


def _rule_stops_at(valid, recipe):
    """Replay the budget rule on a validation history: the step at which training stops.

    An evaluation that does not beat the best so far by min_delta counts towards the patience (a
    smaller gain still moves the best); a real improvement resets it; the cap ends training anyway.
    """
    best, stale = valid[0][1], 0
    for step, v in valid[1:]:
        if v < best - recipe["min_delta"]:
            best, stale = v, 0
        else:
            best, stale = min(best, v), stale + 1
            if stale >= recipe["patience"]:
                return step
    return recipe["max_steps"]


def test_rule_replay_on_a_made_up_history():
    recipe = dict(patience=2, min_delta=0.1, max_steps=900)
    assert _rule_stops_at([(0, 3.0), (100, 2.0), (200, 1.95), (300, 1.0), (400, 0.95), (500, 0.99)], recipe) == 500
    assert _rule_stops_at([(0, 3.0), (100, 2.0), (200, 1.95), (300, 1.0)], recipe) == 900


@pytest.mark.parametrize("name, seed", SHIPPED)
def test_every_shipped_run_converged_before_the_cap(name, seed):
    """Both models trained to convergence: every shipped run was stopped by its stalled validation loss, not by the cap."""
    ckpt = load_checkpoint(name, seed=seed)
    assert len(ckpt["loss"]) < RECIPES[name]["max_steps"]


def test_shipped_weights_are_the_best_evaluation(task):
    """The checkpoint keeps the weights of its best evaluation: recomputing its validation loss gives the stored one."""
    ckpt = load_checkpoint("RNNencdec", seed=SEEDS[0])
    model = load_pretrained("RNNencdec", seed=SEEDS[0])
    assert validation_loss(model, task) == pytest.approx(dict(ckpt["valid"])[ckpt["best_step"]], rel=1e-4)


def test_checkpoints_load_decode_and_rnnsearch_wins_on_long_sentences(task):
    """Every shipped seed learnt the task; attention wins clearly on long sentences (Bahdanau et al. 2014, Fig. 2)."""
    long = [(e, f) for e, f in task.pairs["test"] if len(e.split()) >= 35][:24]
    short = [(e, f) for e, f in task.pairs["test"] if len(e.split()) <= 10][:24]
    for seed in SEEDS:
        scores = {}
        for name in ("RNNencdec", "RNNsearch"):
            model = load_pretrained(name, seed=seed)
            for label, pairs in (("short", short), ("long", long)):
                hyps, aligns = translate(model, [e for e, _ in pairs], task.src_vocab, task.tgt_vocab)
                scores[name, label] = corpus_bleu(hyps, [f for _, f in pairs])
                if name == "RNNsearch":
                    assert aligns[0].shape[1] == len(pairs[0][0].split()) + 1  # source words + <eos>
        assert scores["RNNencdec", "short"] > 50, (seed, scores)  # the fixed vector is enough for short sentences
        assert scores["RNNsearch", "short"] > 90, (seed, scores)
        assert scores["RNNsearch", "long"] > 70, (seed, scores)
        assert scores["RNNsearch", "long"] > scores["RNNencdec", "long"] + 20, (seed, scores)


@pytest.mark.parametrize("name, seed", [(n, s) for n in sorted(RECIPES) for s in (SEEDS[0], SEEDS[-1])])
def test_command_reproduces_the_start_of_the_shipped_training(name, seed, task, tmp_path):
    """`make_checkpoint(..., steps=4)` retraces the first 4 steps of the shipped run, and is deterministic.

    The same recipe, data, initialisation and batch order give the same losses as the run that
    made the shipped checkpoint (equal on this machine; a different CPU may round differently,
    hence the tolerance). Two short runs give bit-identical weights; another seed starts elsewhere.
    """
    shipped = load_checkpoint(name, seed=seed)
    paths = [make_checkpoint(name, seed=seed, steps=4, out_dir=tmp_path / str(i), data=task, progress=False)
             for i in range(2)]
    a, b = (torch.load(p, weights_only=True) for p in paths)
    assert a["loss"] == pytest.approx(shipped["loss"][:4], rel=1e-4)
    assert a["valid"][0] == pytest.approx(shipped["valid"][0], rel=1e-4)  # the untrained model's validation loss
    assert a["loss"] == b["loss"]
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    other = load_checkpoint(name, seed=SEEDS[1])
    assert other["loss"][0] != shipped["loss"][0]


def test_cli_command_writes_checkpoints(tmp_path, capsys):
    from attnlab.cli import main

    out = str(tmp_path)
    assert main(["checkpoints", "--models", "RNNencdec", "--seeds", "1", "--steps", "2", "--out", out, "--quiet"]) == 0
    assert (tmp_path / "RNNencdec-seed1.pt").exists() and "RNNencdec seed 1: 2 steps" in capsys.readouterr().out
    assert load_pretrained("RNNencdec", tmp_path, seed=1).config == load_pretrained("RNNencdec").config
    assert main(["checkpoints", "--seeds", "-1", "--out", out]) == 2
    with pytest.raises(FileNotFoundError, match="--seeds 2"):
        load_pretrained("RNNencdec", tmp_path, seed=2)


def test_bad_checkpoint_arguments():
    with pytest.raises(ValueError, match="seed"):
        checkpoint_path("RNNsearch", seed=-1)
    with pytest.raises(ValueError, match="name"):
        make_checkpoint("Transformer")
    with pytest.raises(ValueError, match="steps"):
        make_checkpoint("RNNsearch", steps=-3)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ATTNLAB_FULL_REPRO") != "1",
                    reason="retrains the shipped models fully (tens of CPU minutes); set ATTNLAB_FULL_REPRO=1")
@pytest.mark.parametrize("name, seed", SHIPPED)
def test_full_retraining_reproduces_the_shipped_weights(name, seed, task, tmp_path):
    """`attnlab checkpoints` end to end: the same stopping step and the same weights as the shipped file."""
    from attnlab.cli import main

    assert main(["checkpoints", "--models", name, "--seeds", str(seed), "--out", str(tmp_path), "--quiet"]) == 0
    new, shipped = load_checkpoint(name, tmp_path, seed), load_checkpoint(name, seed=seed)
    assert new["best_step"] == shipped["best_step"] and len(new["loss"]) == len(shipped["loss"])
    for k, v in shipped["state_dict"].items():
        assert torch.allclose(new["state_dict"][k], v, rtol=1e-3, atol=1e-5), k
