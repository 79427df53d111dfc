"""Training loop for the course's small models, seeded so that every run is the same.

Example::

    history = train(model, data, steps=300, seed=0)   # shows a progress bar
    history["loss"][-1]
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

__all__ = ["train", "deterministic"]


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


def train(model, data, steps: int, batch_size: int = 64, lr: float = 2e-3, seed: int = 0, clip: float = 1.0,
          log_every: int = 25, progress: bool = True, desc: str | None = None):
    """Train a seq2seq model with Adam on ``data.src["train"] -> data.tgt["train"]`` for ``steps`` batches.

    The batch order comes from a generator seeded with ``seed``, so two runs from the same
    initial weights see the same batches. Gradients are clipped to norm ``clip``.
    Returns ``{"loss": [loss at every step], "seconds": wall time, "steps": steps}``.

    Example: ``train(RNNsearch(67, 95), load_task(), steps=100)``
    """
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps: expected a non-negative int, got {steps!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    batches = _epochs(data, batch_size, generator)
    losses = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=desc or type(model).__name__, unit="step")
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        src, src_len, tgt, _ = next(batches)
        loss = model.loss(src, src_len, tgt)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            if step % log_every == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if bar is not None:
        bar.close()
    model.eval()
    return {"loss": losses, "seconds": time.perf_counter() - start, "steps": steps}
