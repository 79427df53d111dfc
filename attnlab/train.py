"""Training loops for the course's small models, seeded so that every run is the same.

- ``fit``: the loop itself (Adam, gradient clipping, a progress bar, optional evaluation and
  checkpoints), for any model and any stream of batches;
- ``train``: ``fit`` on a seq2seq model and the translation task (lesson 01);
- ``train_lm``: ``fit`` on a language model and a character corpus (lesson 09), with the
  validation loss every ``eval_every`` steps and checkpoints.

Example::

    history = train(model, data, steps=300, seed=0)   # shows a progress bar
    history["loss"][-1]
    history = train_lm(gpt, corpus, steps=200, eval_every=50, checkpoint="run.pt")
    history["eval"]                                   # [(step, validation loss), ...]
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch

__all__ = ["fit", "train", "train_lm", "evaluate_lm", "deterministic"]


@contextmanager
def deterministic(seed: int, threads: int = 1):
    """Within the block: torch seeded with ``seed``, deterministic algorithms, ``threads`` CPU threads.

    One thread matters for reproducing a run bit for bit: PyTorch may split a matrix product
    differently over more threads, which changes the rounding of its sums. The previous settings
    (and the global random state) are restored on exit.

    Example: ``with deterministic(0): model = RNNsearch(67, 95)``
    """
    if not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected a positive int, got {threads!r}")
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    old_rng = torch.get_rng_state()
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)
        torch.set_rng_state(old_rng)


def _epochs(data, batch_size, generator):
    from attnlab.data.translation import batches

    while True:
        yield from batches(data.src["train"], data.tgt["train"], batch_size, generator=generator)


def _check_steps(steps):
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps: expected a non-negative int, got {steps!r}")


def fit(model, batches, loss_of, steps: int, lr: float = 2e-3, clip: float | None = 1.0, log_every: int = 25,
        progress: bool = True, desc: str | None = None, evaluate=None, eval_every: int | None = None,
        save=None, save_every: int | None = None, schedule=None, stop=None):
    """The training loop: ``steps`` Adam updates of ``model`` on ``loss_of(next(batches))``.

    ``batches`` is an iterator of batches (seeded by the caller, so that a run repeats);
    ``loss_of(batch)`` returns the scalar loss. Gradients are clipped to norm ``clip`` (None: not
    clipped). ``progress`` shows a tqdm bar with the latest loss every ``log_every`` steps.
    ``evaluate()`` (optional) returns a number, run after every ``eval_every`` steps and after the
    last; ``save(step, history)`` (optional) is called after every ``save_every`` steps and after
    the last (a checkpoint). ``schedule(step) -> factor`` (optional) multiplies ``lr`` at each step.
    ``stop(history) -> bool`` (optional) is asked after each evaluation: True ends training there
    (early stopping).
    Returns ``{"loss": [loss at every step], "eval": [(step, evaluate())], "seconds": wall time,
    "step_seconds": [time of every step], "steps": steps}``.

    Example: ``fit(model, iter(my_batches), lambda b: model(*b)[1], steps=100)``
    """
    _check_steps(steps)
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0):
        raise ValueError(f"lr: expected a positive number, got {lr!r}")
    for name, every in (("log_every", log_every), ("eval_every", eval_every), ("save_every", save_every)):
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"{name}: expected a positive int or None, got {every!r}")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    history = {"loss": [], "eval": [], "seconds": 0.0, "step_seconds": [], "steps": steps}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=desc or type(model).__name__, unit="step")
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        loss = loss_of(next(batches))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        history["loss"].append(loss.item())
        history["step_seconds"].append(time.perf_counter() - t0)
        done = step + 1
        stopping = False
        if evaluate is not None and eval_every is not None and (done % eval_every == 0 or done == steps):
            model.eval()
            history["eval"].append((done, float(evaluate())))
            model.train()
            stopping = stop is not None and bool(stop(history))
        if bar is not None:
            bar.update(1)
            if step % log_every == 0 or done == steps or stopping:
                post = {"loss": f"{history['loss'][-1]:.3f}"}
                if history["eval"]:
                    post["eval"] = f"{history['eval'][-1][1]:.3f}"
                bar.set_postfix(post)
        if save is not None and save_every is not None and (done % save_every == 0 or done == steps or stopping):
            history["seconds"] = time.perf_counter() - start
            save(done, history)
        if stopping:
            break
    if bar is not None:
        bar.close()
    model.eval()
    history["seconds"] = time.perf_counter() - start
    return history


def train(model, data, steps: int, batch_size: int = 64, lr: float = 2e-3, seed: int = 0, clip: float = 1.0,
          log_every: int = 25, progress: bool = True, desc: str | None = None):
    """Train a seq2seq model with Adam on ``data.src["train"] -> data.tgt["train"]`` for ``steps`` batches.

    The batch order comes from a generator seeded with ``seed``, so two runs from the same
    initial weights see the same batches. Gradients are clipped to norm ``clip``.
    Returns ``{"loss": [loss at every step], "seconds": wall time, "steps": steps}`` (and what
    ``fit`` adds).

    Example: ``train(RNNsearch(67, 95), load_task(), steps=100)``
    """
    _check_steps(steps)
    if batch_size < 1:
        raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
    generator = torch.Generator().manual_seed(seed)
    batches = _epochs(data, batch_size, generator)

    def loss_of(batch):
        src, src_len, tgt, _ = batch
        return model.loss(src, src_len, tgt)

    return fit(model, batches, loss_of, steps, lr=lr, clip=clip, log_every=log_every, progress=progress,
               desc=desc or type(model).__name__)


def _model_device(model):
    return next(model.parameters()).device


def _lm_batches(corpus, split, batch_size, seq_len, generator, device):
    while True:
        x, y = corpus.batch(split, batch_size, seq_len, generator)       # (B, T), (B, T) on the CPU
        yield x.to(device), y.to(device)


@torch.no_grad()
def evaluate_lm(model, corpus, split: str = "valid", batches: int = 8, batch_size: int = 32,
                seq_len: int | None = None, seed: int = 1234) -> float:
    """Mean next-character loss of ``model`` on ``batches`` seeded batches of ``split``.

    The same ``seed`` gives the same windows every call, so evaluations along a run compare.
    ``seq_len`` defaults to the model's ``block_size``.

    Example: ``evaluate_lm(model, corpus)`` -> about 4.56 (ln 96) for an untrained model
    """
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches: expected a positive int, got {batches!r}")
    seq_len = model.block_size if seq_len is None else seq_len
    generator = torch.Generator().manual_seed(seed)
    device = _model_device(model)
    was_training = model.training
    model.eval()
    total = 0.0
    for _ in range(batches):
        x, y = corpus.batch(split, batch_size, seq_len, generator)       # (B, T), (B, T)
        total += model(x.to(device), y.to(device))[1].item()
    model.train(was_training)
    return total / batches


def train_lm(model, corpus, steps: int, batch_size: int = 32, seq_len: int | None = None, lr: float = 2e-3,
             seed: int = 0, clip: float | None = 1.0, eval_every: int | None = None, eval_batches: int = 8,
             checkpoint=None, checkpoint_every: int | None = None, extra: dict | None = None,
             warmup: int = 0, decay_to: float | None = None, decay_steps: int | None = None,
             progress: bool = True, desc: str | None = None, log_every: int = 25):
    """Train a language model (``model(x, y) -> (logits, loss)``, like ``attnlab.models.gpt.GPT``)
    on random windows of ``corpus`` (an ``attnlab.data.stdlib_text.Corpus``).

    Batches: ``batch_size`` windows of ``seq_len`` characters (default: the model's
    ``block_size``) from the training split, drawn by a generator seeded with ``seed``, on the
    model's device. ``eval_every``: the validation loss (``evaluate_lm`` on ``eval_batches``
    fixed batches) after every that many steps and after the last. ``checkpoint``: a path, written
    after every ``checkpoint_every`` steps (default: only at the end) with ``{"config",
    "state_dict", "step", "loss", "eval", "train_seconds", "torch_version"}`` plus ``extra``.
    ``warmup``: the learning rate rises linearly over that many steps; ``decay_to``: it then
    falls along a cosine to ``decay_to * lr`` at step ``decay_steps`` (default ``steps``; None:
    stays at ``lr``). A shorter run with the same ``decay_steps`` is a prefix of the longer one.
    Returns ``fit``'s history.

    Example: ``train_lm(GPT(96, 64, seed=0), load_corpus(), steps=50, eval_every=25)``
    """
    _check_steps(steps)
    for name, value in (("batch_size", batch_size), ("eval_batches", eval_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    seq_len = model.block_size if seq_len is None else seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= model.block_size:
        raise ValueError(f"seq_len: expected an int in [1, block_size={model.block_size}], got {seq_len!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup: expected a non-negative int, got {warmup!r}")
    if decay_to is not None and not (isinstance(decay_to, (int, float)) and 0 <= decay_to <= 1):
        raise ValueError(f"decay_to: expected a number in [0, 1] or None, got {decay_to!r}")
    horizon = steps if decay_steps is None else decay_steps
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 0:
        raise ValueError(f"decay_steps: expected a non-negative int or None, got {decay_steps!r}")
    schedule = None
    if warmup or decay_to is not None:
        def schedule(step):
            if step < warmup:
                return (step + 1) / warmup
            if decay_to is None:
                return 1.0
            progress_ = (step - warmup) / max(1, horizon - warmup)
            return decay_to + (1 - decay_to) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_)))
    generator = torch.Generator().manual_seed(seed)
    batches = _lm_batches(corpus, "train", batch_size, seq_len, generator, _model_device(model))

    def evaluate():
        return evaluate_lm(model, corpus, "valid", eval_batches, batch_size, seq_len)

    save = None
    if checkpoint is not None:
        from pathlib import Path

        path = Path(checkpoint)

        def save(step, history):
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({
                **(extra or {}),
                "config": dict(model.config),
                "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "step": step,
                "loss": list(history["loss"]),
                "eval": list(history["eval"]),
                "train_seconds": history["seconds"],
                "torch_version": str(torch.__version__),
            }, path)

    return fit(model, batches, lambda b: model(*b)[1], steps, lr=lr, clip=clip, log_every=log_every,
               progress=progress, desc=desc or type(model).__name__, evaluate=evaluate if eval_every else None,
               eval_every=eval_every, save=save, save_every=checkpoint_every or steps or None,
               schedule=schedule)
