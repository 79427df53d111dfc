"""The small models that ship with the course, and the ``attnlab checkpoints`` command that makes them.

Lesson 01 loads trained translation models instead of training them for minutes: ``RNNencdec``
and ``RNNsearch`` (``attnlab/models/seq2seq.py``), three seeds of each (``SEEDS``), trained on the
synthetic task of ``attnlab/data/translation.py``. Each checkpoint records the recipe it was made
with, the training loss at every step and the validation loss at every evaluation, so anyone can
check that ``attnlab checkpoints`` reproduces it::

    attnlab checkpoints                                   # retrain all six into attnlab/checkpoints/ (minutes each)
    attnlab checkpoints --models RNNsearch --seeds 1      # one of them
    attnlab checkpoints --steps 20 --out /tmp/c           # a short run: its losses match the first 20 shipped ones

**The budget rule, the same for both models** (``RECIPES``): train with Adam on batches of 64
sentence pairs; every ``eval_every`` steps measure the cross-entropy per word on the 500
validation pairs; stop once it has not improved by ``min_delta`` for ``patience`` evaluations in a
row, or after ``max_steps`` (the same generous cap for both), and keep the weights of the best
evaluation. Each model therefore trains until *it* stops improving or reaches the common cap: a
fixed short budget would flatter whichever model learns faster (RNNsearch, on this task). Each
checkpoint records which of the two ended its run.

Training is deterministic on a CPU: a fixed seed (weights and batch order), deterministic
algorithms and one thread (``attnlab.train.deterministic``). The same machine therefore gives the
same weights bit for bit; another CPU or PyTorch build may round differently and drift slowly.

Example::

    model = load_pretrained("RNNsearch", seed=1)
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

__all__ = ["RECIPES", "TASK", "SEEDS", "CHECKPOINT_DIR", "make_checkpoint", "load_pretrained", "load_checkpoint",
           "checkpoint_path", "train_until_converged", "validation_loss"]

CHECKPOINT_DIR = Path(__file__).resolve().with_name("checkpoints")

# the data every checkpoint is trained on: load_task(**TASK) (the test split is drawn first, so
# load_task(n_train=0, n_valid=0, n_test=TASK["n_test"], seed=TASK["seed"]) gives the same test set)
TASK = dict(n_train=20000, n_valid=500, n_test=900, seed=0)
SEEDS = (0, 1, 2)  # the seeds that ship: each sets the initial weights and the batch order
# the same sizes, data, optimiser and stopping rule for both models: only the architecture differs
_COMMON = dict(model=dict(emb_dim=48, hidden_dim=96, maxout_dim=64), batch_size=64, lr=3e-3,
               max_steps=4000, eval_every=100, patience=3, min_delta=0.02)
RECIPES = {
    "RNNencdec": dict(_COMMON),
    "RNNsearch": dict(_COMMON),
}


def _check_name_seed(name, seed):
    if name not in RECIPES:
        raise ValueError(f"name: expected one of {sorted(RECIPES)}, got {name!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: expected a non-negative int, got {seed!r}")


def checkpoint_path(name: str, directory=None, seed: int = 0) -> Path:
    """Where the checkpoint of ``name`` and ``seed`` lives (``attnlab/checkpoints/<name>-seed<seed>.pt`` by default)."""
    _check_name_seed(name, seed)
    return Path(directory or CHECKPOINT_DIR) / f"{name}-seed{seed}.pt"


@torch.no_grad()
def validation_loss(model, data, split: str = "valid", batch_size: int = 100) -> float:
    """Teacher-forced cross-entropy per real target word over a whole split (nats per word)."""
    from attnlab.data.translation import batches

    was_training = model.training
    model.eval()
    total, words = 0.0, 0
    for src, src_len, tgt, tgt_len in batches(data.src[split], data.tgt[split], batch_size, shuffle=False):
        n = int(tgt_len.sum())
        total += model.loss(src, src_len, tgt).item() * n  # loss is a mean over the batch's real words
        words += n
    model.train(was_training)
    return total / words


def train_until_converged(model, data, max_steps: int, eval_every: int, patience: int, min_delta: float,
                          batch_size: int = 64, lr: float = 3e-3, seed: int = 0, clip: float = 1.0,
                          progress: bool = True, desc: str | None = None) -> dict:
    """Train like ``attnlab.train.train`` (Adam, clipping, seeded batch order), stopping when validation stalls.

    Every ``eval_every`` steps (and after the last) the validation loss is measured; training stops
    once ``patience`` evaluations in a row have not beaten the best by ``min_delta``, or after
    ``max_steps``. The model ends with the weights of its best evaluation (early stopping).
    Returns ``{"loss": [training loss per step], "valid": [(step, validation loss), ...],
    "best_step": int, "steps": steps run, "seconds": wall time}``.

    Example: ``train_until_converged(model, load_task(), 2000, eval_every=100, patience=3, min_delta=0.01)``
    """
    from attnlab.data.translation import batches
    from attnlab.train import fit

    for arg, value in (("max_steps", max_steps), ("eval_every", eval_every), ("patience", patience)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if arg == "max_steps" else 1):
            raise ValueError(f"{arg}: expected a {'non-negative' if arg == 'max_steps' else 'positive'} int, "
                             f"got {value!r}")
    generator = torch.Generator().manual_seed(seed)

    def epochs():  # the same endless, seeded stream of batches as attnlab.train.train
        while True:
            yield from batches(data.src["train"], data.tgt["train"], batch_size, generator=generator)

    # early stopping around the course's one loop: fit evaluates, this keeps the best weights
    initial = validation_loss(model, data)
    best = {"loss": initial, "step": 0, "state": copy.deepcopy(model.state_dict()), "stale": 0}
    steps_run = [0]

    def loss_of(batch):
        steps_run[0] += 1
        src, src_len, tgt, _ = batch
        return model.loss(src, src_len, tgt)

    def evaluate():
        v = validation_loss(model, data)
        if v < best["loss"] - min_delta:
            best.update(loss=v, step=steps_run[0], state=copy.deepcopy(model.state_dict()), stale=0)
        else:
            best["stale"] += 1
            if v < best["loss"]:  # a small gain: keep the better weights, but it does not reset the patience
                best.update(loss=v, step=steps_run[0], state=copy.deepcopy(model.state_dict()))
        return v

    history = fit(model, epochs(), loss_of, max_steps, lr=lr, clip=clip, progress=progress,
                  desc=desc or type(model).__name__, evaluate=evaluate, eval_every=eval_every,
                  stop=lambda history: best["stale"] >= patience)
    model.load_state_dict(best["state"])
    model.eval()
    return {"loss": history["loss"], "valid": [(0, initial)] + history["eval"], "best_step": best["step"],
            "steps": len(history["loss"]), "seconds": history["seconds"]}


def make_checkpoint(name: str, seed: int = 0, steps: int | None = None, out_dir=None, data=None,
                    progress: bool = True) -> Path:
    """Train model ``name`` from ``seed`` by its recipe and save it; returns the path written.

    ``steps`` overrides the recipe's ``max_steps`` (a short run for a check). ``data`` may pass an
    already loaded ``load_task(**TASK)`` to save the two seconds of generating it.

    Example: ``make_checkpoint("RNNsearch", seed=1, steps=20, out_dir="/tmp/c")``
    """
    from attnlab.data.translation import load_task
    from attnlab.models.seq2seq import MODELS
    from attnlab.train import deterministic

    _check_name_seed(name, seed)
    recipe = dict(RECIPES[name])
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps: expected a non-negative int, got {steps!r}")
        recipe["max_steps"] = steps
    if data is None:
        data = load_task(**TASK)
    with deterministic(seed, threads=1):
        model = MODELS[name](len(data.src_vocab), len(data.tgt_vocab), **recipe["model"])
        history = train_until_converged(
            model, data, recipe["max_steps"], recipe["eval_every"], recipe["patience"], recipe["min_delta"],
            batch_size=recipe["batch_size"], lr=recipe["lr"], seed=seed, progress=progress,
            desc=f"{name} seed {seed}")
    path = checkpoint_path(name, out_dir, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({
        "name": name,
        "seed": seed,
        "config": model.config,
        "recipe": recipe,
        "task": TASK,
        "state_dict": model.state_dict(),
        "loss": history["loss"],
        "valid": history["valid"],
        "best_step": history["best_step"],
        "train_seconds": history["seconds"],
        "torch_version": str(torch.__version__),
    }, path)
    return path


def load_checkpoint(name: str, directory=None, seed: int = 0) -> dict:
    """The raw checkpoint dictionary (``state_dict``, ``config``, ``recipe``, ``loss`` per step, ``valid``, ...)."""
    path = checkpoint_path(name, directory, seed)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no checkpoint here; make it with: "
                                f"attnlab checkpoints --models {name} --seeds {seed}")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_pretrained(name: str, directory=None, seed: int = 0):
    """The trained model ``name`` ("RNNencdec" or "RNNsearch") of ``seed`` (one of ``SEEDS``), in eval mode.

    Example: ``model = load_pretrained("RNNsearch", seed=2); model.greedy_decode(src, src_len)``
    """
    from attnlab.models.seq2seq import MODELS

    ckpt = load_checkpoint(name, directory, seed)
    model = MODELS[name](**ckpt["config"])
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    return model


def add_arguments(parser):
    parser.add_argument("--models", nargs="+", choices=sorted(RECIPES), default=sorted(RECIPES),
                        help="which models to train (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS),
                        help=f"which seeds to train (default: {' '.join(map(str, SEEDS))})")
    parser.add_argument("--steps", type=int, default=None,
                        help="at most this many training steps (default: each recipe's max_steps; fewer for a quick check)")
    parser.add_argument("--out", default=None, help=f"folder to write into (default: {CHECKPOINT_DIR})")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    from attnlab.data.translation import load_task

    if args.steps is not None and args.steps < 0:
        print(f"error: --steps: expected a non-negative number, got {args.steps}", file=sys.stderr)
        return 2
    if any(s < 0 for s in args.seeds):
        print(f"error: --seeds: expected non-negative numbers, got {args.seeds}", file=sys.stderr)
        return 2
    data = load_task(**TASK)
    for name in args.models:
        for seed in args.seeds:
            path = make_checkpoint(name, seed=seed, steps=args.steps, out_dir=args.out, data=data,
                                   progress=not args.quiet)
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
            size = path.stat().st_size / 2**20
            valid = dict(ckpt["valid"])
            print(f"{name} seed {seed}: {len(ckpt['loss'])} steps in {ckpt['train_seconds']:.0f} s, "
                  f"best validation loss {valid[ckpt['best_step']]:.4f} at step {ckpt['best_step']} "
                  f"-> {path} ({size:.2f} MiB)", flush=True)
    return 0


if __name__ == "__main__":  # python -m attnlab.pretrained
    p = argparse.ArgumentParser(prog="attnlab checkpoints")
    add_arguments(p)
    sys.exit(run(p.parse_args()))
