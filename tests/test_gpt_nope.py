"""GPT(positions="none"): no position embedding (NoPE). A causal mask still leaks order (Haviv et al. 2022), but
with one layer the last position sees its prefix as a set; the model trains and decodes with its cache."""

import torch

from attnlab.data.stdlib_text import load_corpus
from attnlab.models.gpt import GPT, POSITIONS
from attnlab.train import deterministic, train_lm


def test_nope_has_no_position_parameters_and_adds_nothing_to_the_embedding():
    assert "none" in POSITIONS
    nope, learned = GPT(96, 32, d_model=32, n_heads=2, positions="none", seed=0), GPT(96, 32, d_model=32, n_heads=2,
                                                                                           seed=0)
    assert set(learned.state_dict()) - set(nope.state_dict()) == {"pos_emb.weight"}
    assert nope.config["positions"] == "none"
    idx = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(nope.embed(idx), nope.tok_emb(idx))


def test_one_layer_sees_its_prefix_as_a_set_a_second_layer_and_positions_see_order():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 96, (1, 17), generator=g)
    perm = torch.cat([torch.randperm(16, generator=g), torch.tensor([16])])      # the prefix shuffled, last kept
    assert not torch.equal(perm, torch.arange(17))

    def last_gap(model):
        with torch.no_grad():
            a, _ = model(idx)
            b, _ = model(idx[:, perm])
        return (a[0, -1] - b[0, -1]).abs().max().item()

    one = GPT(96, 32, d_model=32, n_heads=2, n_layers=1, positions="none", seed=3)
    assert last_gap(one) < 1e-5                                                    # a weighted average over a set
    assert last_gap(GPT(96, 32, d_model=32, n_heads=2, n_layers=2, positions="none", seed=3)) > 1e-4   # order leaks
    for pos in ("learned", "rope"):
        assert last_gap(GPT(96, 32, d_model=32, n_heads=2, n_layers=1, positions=pos, seed=3)) > 1e-4


def test_nope_trains_and_its_cached_decoding_equals_the_full_forward():
    corpus = load_corpus()
    with deterministic(0, threads=1):                  # tiny matrices: one thread (several only thrash)
        model = GPT(96, 32, d_model=32, n_heads=4, n_layers=2, positions="none", n_kv_heads=2, seed=0)
        log = train_lm(model, corpus, 30, batch_size=8, seq_len=32, lr=3e-3, seed=0, progress=False)
    assert sum(log["loss"][-5:]) / 5 < log["loss"][0] - 0.5
    model.eval()
    idx = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    full, _ = model(idx)
    _, caches = model.prefill(idx[:, :12])
    steps = [model.decode_step(idx[:, t:t + 1], caches) for t in range(12, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 12:], atol=1e-5, rtol=1e-5)
