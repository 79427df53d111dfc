"""The small models that ship with the course, and the ``attnlab checkpoints`` command that makes them.

Lesson 01 loads two trained translation models instead of training them for minutes:
``RNNencdec`` and ``RNNsearch`` (``attnlab/models/seq2seq.py``), trained on the synthetic task of
``attnlab/data/translation.py``. Each checkpoint records the recipe it was made with and the loss
at every training step, so anyone can check that ``attnlab checkpoints`` reproduces it::

    attnlab checkpoints                          # retrain both into attnlab/checkpoints/ (minutes)
    attnlab checkpoints --steps 20 --out /tmp/c  # a short run: its losses match the first 20 shipped ones

Training is deterministic on a CPU: a fixed seed, ``torch.use_deterministic_algorithms`` and one
thread. The same machine therefore gives the same weights bit for bit; another CPU or PyTorch
build may round differently and drift slowly.

Example::

    model = load_pretrained("RNNsearch")
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

__all__ = ["RECIPES", "TASK", "CHECKPOINT_DIR", "make_checkpoint", "load_pretrained", "load_checkpoint",
           "checkpoint_path"]

CHECKPOINT_DIR = Path(__file__).resolve().with_name("checkpoints")

# the data every checkpoint is trained on: load_task(**TASK) (the test split is drawn first, so
# load_task(n_train=0, n_valid=0, n_test=TASK["n_test"], seed=TASK["seed"]) gives the same test set)
TASK = dict(n_train=20000, n_valid=500, n_test=900, seed=0)
# the same sizes, data, batches and number of updates for both models: only the architecture differs
_COMMON = dict(model=dict(emb_dim=48, hidden_dim=96, maxout_dim=64), steps=600, batch_size=64, lr=3e-3, seed=0)
RECIPES = {
    "RNNencdec": dict(_COMMON),
    "RNNsearch": dict(_COMMON),
}


def checkpoint_path(name: str, directory=None) -> Path:
    """Where the checkpoint ``name`` lives (``attnlab/checkpoints/<name>.pt`` by default)."""
    if name not in RECIPES:
        raise ValueError(f"name: expected one of {sorted(RECIPES)}, got {name!r}")
    return Path(directory or CHECKPOINT_DIR) / f"{name}.pt"


def make_checkpoint(name: str, steps: int | None = None, out_dir=None, data=None, progress: bool = True) -> Path:
    """Train model ``name`` by its recipe (``steps`` overrides the recipe's count) and save it.

    Returns the path written. ``data`` may pass an already loaded ``load_task(**TASK)`` to save
    the two seconds of generating it.

    Example: ``make_checkpoint("RNNsearch", steps=20, out_dir="/tmp/c")``
    """
    from attnlab.data.translation import load_task
    from attnlab.models.seq2seq import MODELS
    from attnlab.train import deterministic, train

    recipe = dict(RECIPES[name]) if name in RECIPES else None
    if recipe is None:
        raise ValueError(f"name: expected one of {sorted(RECIPES)}, got {name!r}")
    if steps is not None:
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps: expected a non-negative int, got {steps!r}")
        recipe["steps"] = steps
    if data is None:
        data = load_task(**TASK)
    with deterministic(recipe["seed"], threads=1):
        model = MODELS[name](len(data.src_vocab), len(data.tgt_vocab), **recipe["model"])
        history = train(model, data, recipe["steps"], batch_size=recipe["batch_size"], lr=recipe["lr"],
                        seed=recipe["seed"], progress=progress, desc=name)
    path = checkpoint_path(name, out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({
        "name": name,
        "config": model.config,
        "recipe": recipe,
        "task": TASK,
        "state_dict": model.state_dict(),
        "loss": history["loss"],
        "train_seconds": history["seconds"],
        "torch_version": str(torch.__version__),
    }, path)
    return path


def load_checkpoint(name: str, directory=None) -> dict:
    """The raw checkpoint dictionary (``state_dict``, ``config``, ``recipe``, ``loss`` per step, ...)."""
    path = checkpoint_path(name, directory)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no checkpoint here; make it with: attnlab checkpoints --models {name}")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_pretrained(name: str, directory=None):
    """The trained model ``name`` ("RNNencdec" or "RNNsearch"), in eval mode.

    Example: ``model = load_pretrained("RNNsearch"); model.greedy_decode(src, src_len)``
    """
    from attnlab.models.seq2seq import MODELS

    ckpt = load_checkpoint(name, directory)
    model = MODELS[name](**ckpt["config"])
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    return model


def add_arguments(parser):
    parser.add_argument("--models", nargs="+", choices=sorted(RECIPES), default=sorted(RECIPES),
                        help="which models to train (default: all)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default: each recipe's; fewer for a quick check)")
    parser.add_argument("--out", default=None, help=f"folder to write into (default: {CHECKPOINT_DIR})")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    from attnlab.data.translation import load_task

    if args.steps is not None and args.steps < 0:
        print(f"error: --steps: expected a non-negative number, got {args.steps}", file=sys.stderr)
        return 2
    data = load_task(**TASK)
    for name in args.models:
        path = make_checkpoint(name, steps=args.steps, out_dir=args.out, data=data, progress=not args.quiet)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        size = path.stat().st_size / 2**20
        print(f"{name}: {ckpt['recipe']['steps']} steps in {ckpt['train_seconds']:.0f} s, "
              f"final loss {ckpt['loss'][-1] if ckpt['loss'] else float('nan'):.4f} -> {path} ({size:.2f} MiB)")
    return 0


if __name__ == "__main__":  # python -m attnlab.pretrained
    p = argparse.ArgumentParser(prog="attnlab checkpoints")
    add_arguments(p)
    sys.exit(run(p.parse_args()))
