"""The small rotary GPT that ships for lesson 10's streaming section (attnlab.capstone.ROTARY_NAME): made by
`attnlab gpt-checkpoint --name gpt_stdlib_rope`, its training's start reproduced, small, and showing what the lesson
reads off it (StreamingLLM's re-rotated cache against a dense one and original positions past the trained length)."""

import pytest
import torch

from attnlab.capstone import (NAME, ROTARY_NAME, ROTARY_RECIPE, gpt_checkpoint_path, load_gpt, load_gpt_checkpoint,
                              make_gpt_checkpoint)
from attnlab.data.stdlib_text import encode, load_corpus
from attnlab.streaming import streaming_losses


def test_shipped_rotary_checkpoint_is_small_matches_its_recipe_and_learnt():
    path = gpt_checkpoint_path(name=ROTARY_NAME)
    assert path.exists(), f"missing {path}: run `attnlab gpt-checkpoint --name {ROTARY_NAME}`"
    assert path.stat().st_size < 128 * 1024                            # tens of KB
    ckpt = load_gpt_checkpoint(name=ROTARY_NAME)
    assert ckpt["recipe"] == ROTARY_RECIPE and ckpt["name"] == ROTARY_NAME and ckpt["step"] == ROTARY_RECIPE["steps"]
    assert len(ckpt["loss"]) == ROTARY_RECIPE["steps"]
    assert all(v.dtype == torch.float16 for v in ckpt["state_dict"].values() if v.is_floating_point())
    assert ckpt["eval"][-1][1] < 2.4 < ckpt["eval"][0][1]              # nats per character, from ln 96 = 4.56
    model = load_gpt(name=ROTARY_NAME)
    assert model.config["positions"] == "rope" and model.n_kv_heads == 1 and model.block_size == 64
    assert all(p.dtype == torch.float32 for p in model.parameters()) and not model.training
    # float16 storage: the weights are the stored ones, widened
    assert torch.equal(model.tok_emb.weight, ckpt["state_dict"]["tok_emb.weight"].float())


def test_short_run_reproduces_the_first_losses_of_the_shipped_rotary_checkpoint(tmp_path):
    shipped = load_gpt_checkpoint(name=ROTARY_NAME)
    paths = [make_gpt_checkpoint(steps=3, out_dir=tmp_path / str(i), progress=False, name=ROTARY_NAME)
             for i in range(2)]
    a, b = (torch.load(p, weights_only=True) for p in paths)
    assert a["loss"] == pytest.approx(shipped["loss"][:3], rel=1e-4)
    assert a["loss"] == b["loss"] and a["config"] == shipped["config"]
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert a["recipe"]["steps"] == 3 and a["recipe"]["store_dtype"] == "float16"


def test_cli_names_the_rotary_checkpoint(tmp_path, capsys):
    from attnlab.cli import main

    assert main(["gpt-checkpoint", "--name", ROTARY_NAME, "--steps", "2", "--out", str(tmp_path), "--quiet"]) == 0
    assert (tmp_path / f"{ROTARY_NAME}.pt").exists() and f"{ROTARY_NAME}: 2 steps" in capsys.readouterr().out
    assert not (tmp_path / f"{NAME}.pt").exists()
    assert load_gpt(directory=tmp_path, name=ROTARY_NAME).config == load_gpt(name=ROTARY_NAME).config
    with pytest.raises(FileNotFoundError, match=f"--name {ROTARY_NAME}"):
        load_gpt_checkpoint(tmp_path / "empty", name=ROTARY_NAME)
    with pytest.raises(ValueError, match="^name: expected one of"):
        load_gpt(name="gpt_stdlib_nope")


def test_past_its_trained_length_re_rotating_beats_a_dense_cache_and_original_positions():
    """What lesson 10 reads off this checkpoint (C28): trained on 64 positions, the dense cache breaks past them;
    sinks kept at their original positions hurt far from them; StreamingLLM's re-rotation removes that harm."""
    model = load_gpt(name=ROTARY_NAME)
    text = load_corpus().text["valid"]
    idx = torch.stack([encode(text[i * 4000:i * 4000 + 192]) for i in range(4)])    # (4, 192)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                      # tiny matrices, token by token: several threads only thrash
    try:
        losses = {k: v.mean(0) for k, v in streaming_losses(model, idx, sinks=4, window=28).items()}   # (191,) each
    finally:
        torch.set_num_threads(threads)
    inside, far = slice(0, 60), slice(128, None)
    for v in losses.values():                                           # while all fits, every cache is the same
        assert torch.allclose(v[:28], losses["dense"][:28], atol=1e-4)
    rerot = losses["sinks + window, re-rotated"][far].mean()
    orig = losses["sinks + window, original positions"][far].mean()
    assert losses["dense"][far].mean() > rerot + 0.3
    assert orig > rerot + 0.05
    assert rerot < losses["dense"][inside].mean() + 0.15                # stays near its in-range loss
