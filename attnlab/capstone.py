"""The GPT of lesson 09, trained on the standard library's source, and the ``attnlab gpt-checkpoint`` command.

Lesson 09 loads a small GPT (``attnlab/models/gpt.py``) trained on the character corpus of
``attnlab/data/stdlib_text.py`` instead of training it for minutes. The checkpoint records the
recipe it was made with, the corpus files' SHA-256 and the loss at every step, so anyone can
check that the command reproduces it::

    attnlab gpt-checkpoint                          # retrain into attnlab/checkpoints/ (minutes)
    attnlab gpt-checkpoint --steps 5 --out /tmp/c   # a short run: its losses match the first 5 shipped ones

Training uses torch's SDPA backend (the fastest on a CPU; every backend computes the same
function, which lesson 09 shows), a fixed seed, ``torch.use_deterministic_algorithms`` and one
thread: the same machine gives the same weights bit for bit; another CPU or PyTorch build may
round differently and drift slowly.

A second, smaller checkpoint ships beside it for lesson 10's streaming section (C28):
``ROTARY_NAME`` (``gpt_stdlib_rope``), a GPT with rotary positions and one KV head, trained on
64-character windows by ``ROTARY_RECIPE`` (about 20 s on a CPU). It is what
``attnlab.streaming.streaming_losses`` runs far past its trained length; its weights are stored
in float16 (``store_dtype``) to keep the file at tens of KB, and load as float32::

    attnlab gpt-checkpoint --name gpt_stdlib_rope                       # retrain it (about 20 s)
    attnlab gpt-checkpoint --name gpt_stdlib_rope --steps 3 --out /tmp/c

Example::

    model = load_gpt()                       # eval mode, attention="sdpa"
    model = load_gpt(attention="flash")      # the same weights, attending with the Triton kernel
    rotary = load_gpt(name=ROTARY_NAME)      # lesson 10's small rotary GPT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

__all__ = ["NAME", "RECIPE", "ROTARY_NAME", "ROTARY_RECIPE", "RECIPES", "make_gpt_checkpoint", "load_gpt_checkpoint",
           "load_gpt", "gpt_checkpoint_path"]

NAME = "gpt_stdlib"
RECIPE = dict(
    model=dict(vocab_size=96, block_size=128, d_model=64, n_heads=4, n_layers=2, d_mlp=256, positions="learned"),
    steps=3000, batch_size=32, seq_len=128, lr=3e-3, warmup=100, decay_to=0.1, seed=0, clip=1.0, eval_every=100,
    eval_batches=8,
    attention="sdpa",
)
# lesson 10's rotary GPT: small (26k parameters), trained on windows of 64 so that streaming past 64 is out of range
ROTARY_NAME = "gpt_stdlib_rope"
ROTARY_RECIPE = dict(
    model=dict(vocab_size=96, block_size=64, d_model=32, n_heads=2, n_kv_heads=1, n_layers=2, d_mlp=128,
               positions="rope"),
    steps=600, batch_size=16, seq_len=64, lr=3e-3, warmup=50, decay_to=0.1, seed=0, clip=1.0, eval_every=100,
    eval_batches=4,
    attention="sdpa", store_dtype="float16",
)
RECIPES = {NAME: RECIPE, ROTARY_NAME: ROTARY_RECIPE}


def _check_name(name):
    if name not in RECIPES:
        raise ValueError(f"name: expected one of {sorted(RECIPES)}, got {name!r}")


def gpt_checkpoint_path(directory=None, name=NAME) -> Path:
    """Where the checkpoint ``name`` lives (``attnlab/checkpoints/gpt_stdlib.pt`` by default)."""
    from attnlab.pretrained import CHECKPOINT_DIR

    _check_name(name)
    return Path(directory or CHECKPOINT_DIR) / f"{name}.pt"


def make_gpt_checkpoint(steps: int | None = None, out_dir=None, corpus=None, progress: bool = True,
                        name: str = NAME) -> Path:
    """Train the GPT ``name`` by its recipe (``RECIPES[name]``; ``steps`` overrides its count) on the
    stdlib corpus and save it. Returns the path written. ``corpus`` may pass an already loaded
    ``load_corpus()``. A recipe's ``store_dtype`` stores the weights in that dtype (float16: half the file).

    Example: ``make_gpt_checkpoint(steps=5, out_dir="/tmp/c")``
    """
    from attnlab.data.stdlib_text import REFERENCE_PYTHON, load_corpus
    from attnlab.models.gpt import GPT
    from attnlab.train import deterministic, train_lm

    _check_name(name)
    recipe = dict(RECIPES[name])
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps: expected a positive int, got {steps!r}")
        recipe["steps"] = steps
    corpus = load_corpus() if corpus is None else corpus
    path = gpt_checkpoint_path(out_dir, name)
    extra = {"name": name, "recipe": recipe, "corpus_sha256": dict(corpus.sha256),
             "corpus_matches_reference": corpus.matches_reference, "reference_python": REFERENCE_PYTHON,
             "python_version": sys.version.split()[0]}
    with deterministic(recipe["seed"], threads=1):
        model = GPT(**recipe["model"], attention=recipe["attention"], seed=recipe["seed"])   # (float32)
        train_lm(model, corpus, recipe["steps"], batch_size=recipe["batch_size"], seq_len=recipe["seq_len"],
                 lr=recipe["lr"], seed=recipe["seed"], clip=recipe["clip"], eval_every=recipe["eval_every"],
                 eval_batches=recipe["eval_batches"], warmup=recipe["warmup"], decay_to=recipe["decay_to"],
                 decay_steps=RECIPES[name]["steps"],
                 checkpoint=path, extra=extra, progress=progress,
                 desc=name)
    if "store_dtype" in recipe:                                           # rewrite the weights, smaller
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        dtype = getattr(torch, recipe["store_dtype"])
        ckpt["state_dict"] = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ckpt["state_dict"].items()}
        torch.save(ckpt, path)
    return path


def load_gpt_checkpoint(directory=None, name=NAME) -> dict:
    """The raw checkpoint dictionary (``state_dict``, ``config``, ``recipe``, ``loss`` per step, ``eval``, ...)."""
    path = gpt_checkpoint_path(directory, name)
    if not path.exists():
        how = "" if name == NAME else f" --name {name}"
        raise FileNotFoundError(f"{path}: no checkpoint here; make it with: attnlab gpt-checkpoint{how}")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_gpt(attention="sdpa", block_mask=None, directory=None, device=None, name=NAME):
    """The trained GPT ``name`` (default lesson 09's; ``ROTARY_NAME`` lesson 10's rotary one) in eval
    mode and float32, attending with ``attention`` (any backend of ``attnlab.models.gpt``).

    Example: ``model = load_gpt(attention="flash", device="cuda")``
    """
    from attnlab.models.gpt import GPT

    ckpt = load_gpt_checkpoint(directory, name)
    model = GPT(**ckpt["config"], attention=attention, block_mask=block_mask)
    model.load_state_dict(ckpt["state_dict"])                            # copied into float32 parameters
    model.eval()
    return model if device is None else model.to(device)


def add_arguments(parser):
    parser.add_argument("--name", choices=sorted(RECIPES), default=NAME,
                        help=f"which GPT (default: {NAME}, lesson 09's; {ROTARY_NAME}: lesson 10's rotary one)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps (default: the recipe's, {RECIPE['steps']} for {NAME}; "
                             "fewer for a quick check)")
    parser.add_argument("--out", default=None, help="folder to write into (default: attnlab/checkpoints/)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    if args.steps is not None and args.steps < 1:
        print(f"error: --steps: expected a positive number, got {args.steps}", file=sys.stderr)
        return 2
    name = getattr(args, "name", NAME)
    path = make_gpt_checkpoint(steps=args.steps, out_dir=args.out, progress=not args.quiet, name=name)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    size = path.stat().st_size / 2**20
    valid = ckpt["eval"][-1][1] if ckpt["eval"] else float("nan")
    print(f"{name}: {ckpt['step']} steps in {ckpt['train_seconds']:.0f} s, final training loss {ckpt['loss'][-1]:.4f}, "
          f"validation loss {valid:.4f} -> {path} ({size:.2f} MiB)")
    return 0


if __name__ == "__main__":  # python -m attnlab.capstone
    p = argparse.ArgumentParser(prog="attnlab gpt-checkpoint")
    add_arguments(p)
    sys.exit(run(p.parse_args()))
