"""The training loop of attnlab/train.py: fit (the loop), train_lm (language models), evaluation and checkpoints."""

import math

import pytest
import torch

from attnlab.data.stdlib_text import load_corpus
from attnlab.models.gpt import GPT
from attnlab.train import deterministic, evaluate_lm, fit, train_lm


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def small(seed=0):
    return GPT(96, block_size=16, d_model=16, n_heads=1, n_layers=1, seed=seed)


def test_fit_runs_evaluates_saves_and_schedules():
    model = torch.nn.Linear(3, 1)
    g = torch.Generator().manual_seed(0)
    data = iter(lambda: torch.randn(8, 3, generator=g), None)
    saved, lrs = [], []

    def loss_of(x):
        return ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()

    def save(step, history):
        saved.append((step, len(history["loss"])))

    history = fit(model, data, loss_of, 10, lr=0.05, progress=False, evaluate=lambda: 1.5, eval_every=4,
                  save=save, save_every=5, schedule=lambda s: lrs.append(s) or 1.0)
    assert len(history["loss"]) == 10 == len(history["step_seconds"]) and history["steps"] == 10
    assert history["eval"] == [(4, 1.5), (8, 1.5), (10, 1.5)]
    assert saved == [(5, 5), (10, 10)]
    assert history["loss"][-1] < history["loss"][0]
    assert not model.training
    for bad in ({"steps": -1}, {"lr": 0}, {"eval_every": 0}):
        kwargs = dict(steps=1, lr=0.1) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            fit(model, data, loss_of, kwargs.pop("steps"), progress=False, **kwargs)


def test_train_lm_is_seeded_evaluates_and_checkpoints(corpus, tmp_path):
    runs = []
    for i in range(2):
        with deterministic(0):
            model = small()
            runs.append(train_lm(model, corpus, 6, batch_size=4, seq_len=16, seed=3, eval_every=3, eval_batches=2,
                                 checkpoint=tmp_path / f"{i}.pt", extra={"note": "x"}, progress=False))
    a, b = runs
    assert a["loss"] == b["loss"] and a["eval"] == b["eval"]
    assert [s for s, _ in a["eval"]] == [3, 6]
    ckpt = torch.load(tmp_path / "0.pt", weights_only=True)
    assert ckpt["step"] == 6 and ckpt["loss"] == a["loss"] and ckpt["note"] == "x"
    assert ckpt["config"] == small().config
    fresh = small(seed=1)
    fresh.load_state_dict(ckpt["state_dict"])
    assert evaluate_lm(fresh, corpus, batches=2, batch_size=4, seq_len=16) == pytest.approx(a["eval"][-1][1])
    # another batch seed gives other batches
    with deterministic(0):
        other = train_lm(small(), corpus, 6, batch_size=4, seq_len=16, seed=4, progress=False)
    assert other["loss"][1:] != a["loss"][1:]


def test_untrained_model_scores_near_uniform(corpus):
    loss = evaluate_lm(small(), corpus, batches=2, batch_size=4)
    assert abs(loss - math.log(96)) < 0.1


def test_warmup_and_cosine_make_a_prefix_of_the_longer_run(corpus):
    def run(steps):
        with deterministic(0):
            return train_lm(small(), corpus, steps, batch_size=4, seq_len=16, lr=1e-2, warmup=3, decay_to=0.1,
                            decay_steps=8, progress=False)["loss"]

    long, short = run(8), run(4)
    assert short == long[:4]


def test_train_lm_names_bad_arguments(corpus):
    model = small()
    for kwargs, name in (({"seq_len": 17}, "seq_len"), ({"batch_size": 0}, "batch_size"),
                         ({"warmup": -1}, "warmup"), ({"decay_to": 2}, "decay_to"), ({"eval_batches": 0}, "eval_batches")):
        with pytest.raises(ValueError, match=name):
            train_lm(model, corpus, 1, progress=False, **kwargs)
    with pytest.raises(TypeError, match="seed"):
        train_lm(model, corpus, 1, seed=1.5, progress=False)
