"""TinyTransformer and its training loop: shapes, weights per layer and head, the scale switch,
causality, determinism, and that a few steps of training reduce the loss."""

import math

import pytest
import torch

from attnlab.attention import MultiHeadAttention
from attnlab.data.toy import KeyValueLookup, PreviousTwo
from attnlab.models.transformer import SelfAttention, TinyTransformer, accuracy, evaluate, loss_fn, train


def tokens_for(model, B=3, N=7, seed=0):
    return torch.randint(model.vocab_size, (B, N), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_weights_per_layer_and_head():
    model = TinyTransformer(11, n_classes=5, d_model=24, num_heads=3, num_layers=2, max_len=16, seed=0)
    x = tokens_for(model)
    logits, weights = model(x, return_weights=True)
    assert logits.shape == (3, 7, 5)
    assert len(weights) == 2 and all(w.shape == (3, 3, 7, 7) for w in weights)
    for w in weights:
        torch.testing.assert_close(w.sum(-1), torch.ones(3, 3, 7))
        assert (w.triu(1) == 0).all()                             # causal: nothing above the diagonal
    assert torch.equal(model(x), logits)


def test_causal_model_ignores_the_future_and_full_model_does_not():
    x = torch.tensor([[1, 2, 3, 4, 5]])
    y = x.clone()
    y[0, -1] = 7
    causal = TinyTransformer(8, d_model=16, num_heads=2, seed=1)
    torch.testing.assert_close(causal(x)[:, :-1], causal(y)[:, :-1])
    full = TinyTransformer(8, d_model=16, num_heads=2, causal=False, seed=1)
    assert not torch.allclose(full(x)[:, :-1], full(y)[:, :-1])


def test_seed_makes_the_model_and_leaves_global_rng_alone():
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    a = TinyTransformer(9, d_model=16, num_heads=4, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = TinyTransformer(9, d_model=16, num_heads=4, seed=3)
    c = TinyTransformer(9, d_model=16, num_heads=4, seed=4)
    x = tokens_for(a)
    assert torch.equal(a(x), b(x)) and not torch.equal(a(x), c(x))


def test_self_attention_matches_multi_head_attention():
    torch.manual_seed(0)
    mine = SelfAttention(16, 4)
    ref = MultiHeadAttention(16, 4)
    ref.load_state_dict(mine.state_dict())
    x = torch.randn(2, 6, 16)
    out, w = mine(x, causal=True)
    ref_out, ref_w = ref(x, causal=True, return_weights=True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(w, ref_w)


def test_unscaled_scores_are_sqrt_d_k_times_the_scaled_ones():
    d_model, h = 32, 2                                           # d_k = 16, sqrt(d_k) = 4
    scaled = SelfAttention(d_model, h, scaled=True)
    unscaled = SelfAttention(d_model, h, scaled=False)
    unscaled.load_state_dict(scaled.state_dict())
    x = torch.randn(1, 5, d_model, generator=torch.Generator().manual_seed(0))
    _, w_s = scaled(x, causal=False)
    _, w_u = unscaled(x, causal=False)
    # log-weights are scores minus a per-row constant; centre each row to compare the scores
    centre = lambda w: w.log() - w.log().mean(-1, keepdim=True)
    torch.testing.assert_close(centre(w_u), math.sqrt(d_model // h) * centre(w_s), rtol=1e-4, atol=1e-4)


def test_training_reduces_the_loss_and_is_deterministic():
    task = PreviousTwo(vocab=5, seq_len=8)
    runs = []
    for _ in range(2):
        model = TinyTransformer(task.vocab_size, task.n_classes, d_model=16, num_heads=2, d_mlp=0,
                                max_len=task.seq_len, seed=0)
        before = evaluate(model, task, n=200)["loss"]
        history = train(model, task, steps=40, batch_size=32, lr=1e-2, seed=0)
        runs.append((history["loss"], evaluate(model, task, n=200)))
        assert len(history["loss"]) == 40 and history["seconds"] > 0
        assert runs[-1][1]["loss"] < 0.8 * before
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == runs[1][1]
    assert 0.0 <= accuracy(model, task, n=100) <= 1.0


def test_cosine_schedule_and_evaluations_during_training():
    task = PreviousTwo(vocab=5, seq_len=8)
    model = TinyTransformer(task.vocab_size, task.n_classes, d_model=16, num_heads=2, d_mlp=0,
                            max_len=task.seq_len, seed=0)
    history = train(model, task, steps=30, batch_size=16, lr=1e-2, seed=0, schedule="cosine", eval_every=10, eval_n=50)
    assert [step for step, _, _ in history["eval"]] == [10, 20, 30]
    assert history["eval"][-1][1:] == tuple(evaluate(model, task, n=50).values())   # the last one is the final model
    assert not model.training
    # the schedule changes training (lr decays to 0), the constant one is the default
    same = TinyTransformer(task.vocab_size, task.n_classes, d_model=16, num_heads=2, d_mlp=0,
                           max_len=task.seq_len, seed=0)
    constant = train(same, task, steps=30, batch_size=16, lr=1e-2, seed=0)
    assert constant["loss"][0] == history["loss"][0] and constant["loss"][-1] != history["loss"][-1]
    assert constant["eval"] == []


def test_loss_fn_skips_ignored_positions():
    logits = torch.randn(2, 3, 4)
    targets = torch.tensor([[-100, 1, 2], [3, -100, -100]])
    expected = torch.nn.functional.cross_entropy(logits[targets != -100], targets[targets != -100])
    torch.testing.assert_close(loss_fn(logits, targets), expected)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="num_heads"):
        TinyTransformer(10, d_model=10, num_heads=3)
    with pytest.raises(TypeError, match="scaled"):
        TinyTransformer(10, scaled=1)
    with pytest.raises(TypeError, match="d_model"):
        TinyTransformer(10, d_model=16.0)
    model = TinyTransformer(10, d_model=8, num_heads=2, max_len=4)
    with pytest.raises(TypeError, match="tokens"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.full((1, 3), 10))
    with pytest.raises(ValueError, match="steps"):
        train(model, KeyValueLookup(), steps=-1)
    with pytest.raises(ValueError, match="schedule"):
        train(model, KeyValueLookup(), steps=1, schedule="linear")
    with pytest.raises(ValueError, match="eval_every"):
        train(model, KeyValueLookup(), steps=1, eval_every=0)
