"""The GPT of lesson 09 (attnlab/models/gpt.py): shapes, causality, every attention backend, weight tying, errors,
and the shipped checkpoint with the command that makes it (attnlab/capstone.py)."""

import os

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention import block_sparse_reference
from attnlab.capstone import NAME, RECIPE, gpt_checkpoint_path, load_gpt, load_gpt_checkpoint, make_gpt_checkpoint
from attnlab.data.stdlib_text import decode, encode
from attnlab.kernels import BlockMask, full_mask, global_mask, local_mask
from attnlab.models.gpt import BACKENDS, GPT, attention_backend, sinusoidal_positions

V, T = 96, 32


def tiny(attention="sdpa", block_mask=None, positions="learned", seed=0):
    # head size 16: the smallest the Triton kernels take; one layer keeps the interpreter quick
    return GPT(V, block_size=T, d_model=32, n_heads=2, n_layers=1, positions=positions, attention=attention,
               block_mask=block_mask, seed=seed)


def batch(b=2, t=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (b, t), generator=g)
    y = torch.randint(0, V, (b, t), generator=g)
    return x, y


def loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y)
    loss.backward()
    return logits.detach(), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_shapes_loss_and_generation(positions):
    model = tiny(positions=positions)
    x, y = batch()
    logits, loss = model(x, y)
    assert logits.shape == (2, T, V) and loss.shape == ()
    assert abs(loss.item() - torch.log(torch.tensor(float(V))).item()) < 0.1   # small init: near uniform
    assert model(x[:, :5])[0].shape == (2, 5, V) and model(x)[1] is None
    out = model.generate(x[:1, :3], 40, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 43) and torch.equal(out[:, :3], x[:1, :3]) and int(out.max()) < V
    again = model.generate(x[:1, :3], 40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)                 # seeded sampling repeats
    maps = model.attention_maps(x)
    assert maps.shape == (1, 2, 2, T, T)
    assert torch.allclose(maps.sum(-1), torch.ones(1, 2, 2, T))
    assert torch.all(maps.triu(1) == 0)           # causal: no weight on later positions


def test_sinusoidal_positions_follow_vaswani():
    pe = sinusoidal_positions(50, 8)
    assert pe.shape == (50, 8)
    assert torch.allclose(pe[:, 0], torch.sin(torch.arange(50.0)))
    assert torch.allclose(pe[:, 1], torch.cos(torch.arange(50.0)))
    assert torch.allclose(pe[3, 2], torch.sin(torch.tensor(3.0) / 10000 ** (2 / 8)))
    model = tiny(positions="sinusoidal")
    assert "pos_table" not in model.state_dict() and not hasattr(model, "pos_emb")


def test_causality_a_later_token_never_changes_earlier_logits():
    model = tiny()
    x, _ = batch()
    changed = x.clone()
    changed[:, 20] = (changed[:, 20] + 1) % V
    a, b = model(x)[0], model(changed)[0]
    assert torch.equal(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_weight_tying_shares_one_matrix():
    model = tiny()
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names   # counted once
    x, y = batch()
    _, _, grads = loss_and_grads(model, x, y)
    assert grads["tok_emb.weight"].abs().sum() > 0
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


def test_seed_makes_the_same_model_and_leaves_the_global_stream_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = tiny(seed=7)
    assert torch.equal(torch.rand(1), before)
    b = tiny(seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("attention", ["reference", "flash", "standard"])
def test_every_backend_agrees_with_sdpa(attention):
    x, y = batch()
    ref_logits, ref_loss, ref_grads = loss_and_grads(tiny("sdpa"), x, y)
    logits, loss, grads = loss_and_grads(tiny(attention), x, y)
    assert torch.allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    for name, g in ref_grads.items():
        assert torch.allclose(grads[name], g, atol=1e-4, rtol=1e-3), name


def test_block_sparse_with_every_tile_is_dense_attention_and_a_local_mask_is_the_masked_reference():
    x, y = batch()
    dense = full_mask(T, T, (16, 16))
    ref_logits, ref_loss, ref_grads = loss_and_grads(tiny("sdpa"), x, y)
    logits, loss, grads = loss_and_grads(tiny("block_sparse", dense), x, y)
    assert torch.allclose(logits, ref_logits, atol=1e-4) and loss == pytest.approx(ref_loss, abs=1e-5)
    for name, g in ref_grads.items():
        assert torch.allclose(grads[name], g, atol=1e-4, rtol=1e-3), name

    # a sparse mask: the kernel equals the plain reference under the same mask
    sparse = BlockMask(torch.eye(-(-T // 16), dtype=torch.bool), (16, 16))   # diagonal tiles only, every element
    assert sparse.density < 1

    def reference(q, k, v, is_causal):
        return block_sparse_reference(q, k, v, sparse.mask, sparse.block_size, causal=is_causal)

    want, want_loss, want_grads = loss_and_grads(tiny(reference), x, y)
    got, got_loss, got_grads = loss_and_grads(tiny("block_sparse", sparse), x, y)
    assert torch.allclose(got, want, atol=1e-4) and got_loss == pytest.approx(want_loss, abs=1e-5)
    assert not torch.allclose(got, ref_logits, atol=1e-3)     # the mask does change the model
    for name, g in want_grads.items():
        assert torch.allclose(got_grads[name], g, atol=1e-4, rtol=1e-3), name
    # shorter sequences use the mask's top-left corner; the maps honour the mask
    model = tiny("block_sparse", sparse)
    assert model(x[:, :20])[0].shape == (2, 20, V)
    maps = model.attention_maps(x)
    assert torch.all(maps[..., 16:, :16] == 0)


def test_an_exact_mask_made_for_the_block_size_serves_shorter_sequences_exactly():
    # a mask_mod's block mask knows the lengths it was made for; sampling a shorter sequence uses
    # the same mask_mod at that length (partial tiles stay exact), never the cropped tile table
    from attnlab.kernels import create_block_mask
    from attnlab.mask_mods import create_mask, sliding_window

    window = 5                                                 # not a multiple of the 16-row tiles
    mask = create_block_mask(sliding_window(window), None, None, T, T, block_size=(16, 16))
    model = tiny("block_sparse", mask)

    def masked_sdpa(q, k, v, is_causal=True):                  # the element mask at the call's length
        n = q.shape[-2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=create_mask(sliding_window(window), None, None, n, n))

    reference = tiny(masked_sdpa)
    x = torch.randint(0, V, (1, 20))                           # shorter than T: a ragged last tile
    got, want = model(x)[0], reference(x)[0]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_a_callable_with_the_sdpa_signature_plugs_in():
    calls = []

    def mine(q, k, v, is_causal=False):
        calls.append(tuple(q.shape))
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    x, y = batch()
    assert tiny(mine)(x, y)[1].item() == pytest.approx(tiny("sdpa")(x, y)[1].item(), abs=1e-6)
    assert calls == [(2, 2, T, 16)]
    with pytest.raises(ValueError, match="attention"):
        tiny(lambda q, k, v, is_causal: q[..., :1])(x)
    model = tiny("sdpa").set_attention(mine)
    model(x)
    assert len(calls) == 2 and model.attention is mine


def test_bad_input_errors_name_the_argument():
    with pytest.raises(ValueError, match="attention"):
        tiny("fast")
    with pytest.raises(ValueError, match="block_mask"):
        tiny("block_sparse")
    with pytest.raises(ValueError, match="block_mask"):
        tiny("flash", block_mask=full_mask(T, T, (16, 16)))
    with pytest.raises(TypeError, match="block_mask"):
        attention_backend("block_sparse", block_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="n_heads"):
        GPT(V, T, d_model=32, n_heads=3)
    with pytest.raises(ValueError, match="n_heads"):
        GPT(V, T, d_model=24, n_heads=3, attention="flash")        # head size 8: not a kernel size
    with pytest.raises(ValueError, match="positions"):
        GPT(V, T, positions="rotary")
    with pytest.raises(TypeError, match="d_model"):
        GPT(V, T, d_model=32.0)
    with pytest.raises(ValueError, match="n_layers"):
        GPT(V, T, n_layers=0)
    model = tiny()
    x, y = batch()
    with pytest.raises(TypeError, match="idx"):
        model(x.float())
    with pytest.raises(TypeError, match="idx"):
        model(x[0])
    with pytest.raises(ValueError, match="idx"):
        model(torch.cat([x, x], dim=1))
    with pytest.raises(ValueError, match="idx"):
        model(x + V)
    with pytest.raises(ValueError, match="targets"):
        model(x, y[:, :3])
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(x[:, :2], -1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(x[:, :2], 2, temperature=0)
    assert set(BACKENDS) == {"sdpa", "reference", "flash", "standard", "block_sparse"}


def test_local_plus_global_trains_through_the_kernel():
    mask = local_mask(T, T, 8, (16, 16)) | global_mask(T, T, 1, (16, 16))
    model = tiny("block_sparse", mask)
    x, y = batch()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# ----------------------------------------------------------------------------- the shipped checkpoint

def test_shipped_checkpoint_is_small_matches_its_recipe_and_learnt_the_corpus():
    path = gpt_checkpoint_path()
    assert path.exists(), f"missing {path}: run `attnlab gpt-checkpoint`"
    assert path.stat().st_size < 2 * 2**20
    ckpt = load_gpt_checkpoint()
    assert ckpt["recipe"] == RECIPE and ckpt["name"] == NAME and ckpt["step"] == RECIPE["steps"]
    assert len(ckpt["loss"]) == RECIPE["steps"]
    assert ckpt["eval"][-1][1] < 2.0 < ckpt["eval"][0][1]          # nats per character, from ln 96 = 4.56
    model = load_gpt()
    out = model.generate(encode("def ")[None], 80, generator=torch.Generator().manual_seed(0))
    assert decode(out[0]).startswith("def ") and out.shape == (1, 84)


def test_short_run_reproduces_the_first_losses_of_the_shipped_checkpoint(tmp_path):
    """`attnlab gpt-checkpoint --steps 3` retraces the first 3 steps of the shipped run, deterministically.

    Equal on the machine that made it; a different CPU or torch build may round differently (tolerance).
    """
    shipped = load_gpt_checkpoint()
    paths = [make_gpt_checkpoint(steps=3, out_dir=tmp_path / str(i), progress=False) for i in range(2)]
    a, b = (torch.load(p, weights_only=True) for p in paths)
    assert a["loss"] == pytest.approx(shipped["loss"][:3], rel=1e-4)
    assert a["loss"] == b["loss"]
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])


def test_cli_route_writes_a_checkpoint(tmp_path, capsys):
    from attnlab.cli import main

    assert main(["gpt-checkpoint", "--steps", "2", "--out", str(tmp_path), "--quiet"]) == 0
    assert (tmp_path / f"{NAME}.pt").exists() and f"{NAME}: 2 steps" in capsys.readouterr().out
    assert load_gpt(directory=tmp_path).config == load_gpt().config
    assert main(["gpt-checkpoint", "--steps", "0", "--out", str(tmp_path), "--quiet"]) == 2
    with pytest.raises(FileNotFoundError, match="gpt-checkpoint"):
        load_gpt_checkpoint(tmp_path / "empty")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ATTNLAB_FULL_REPRO") != "1",
                    reason="retrains the GPT fully (minutes); set ATTNLAB_FULL_REPRO=1")
def test_full_retraining_reproduces_the_shipped_weights(tmp_path):
    path = make_gpt_checkpoint(out_dir=tmp_path, progress=False)
    new, shipped = torch.load(path, weights_only=True), load_gpt_checkpoint()
    for k, v in shipped["state_dict"].items():
        assert torch.allclose(new["state_dict"][k], v, rtol=1e-3, atol=1e-5), k
