"""A small transformer for the CPU, built on attnlab's own ``MultiHeadAttention`` (lessons 03 and 04).

Pre-LayerNorm blocks (attention, then an optional MLP, each added to a residual stream), learned
positional embeddings and a linear read-out at every position. Two switches matter for the
lessons:

- ``scaled=False`` drops the ``1/sqrt(d_head)`` of scaled dot-product attention (lesson 03's
  experiment: scores ``q.k`` instead of ``q.k / sqrt(d_k)``);
- ``forward(tokens, return_weights=True)`` also returns every layer's attention weights,
  ``(B, heads, N, N)`` per layer, so each head can be looked at (lesson 04).

``train`` is the training loop (Adam, seeded batches from an ``attnlab.data.toy`` task) and
``accuracy`` the evaluation on fresh seeded samples.

Example::

    from attnlab.data.toy import PreviousTwo
    task = PreviousTwo()
    model = TinyTransformer(task.vocab_size, task.n_classes, d_model=32, num_heads=2, seed=0)
    history = train(model, task, steps=200)
    accuracy(model, task)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.attention import MultiHeadAttention, scaled_dot_product_attention
from attnlab.data.toy import IGNORE, batches
from attnlab.train import fit

__all__ = ["SelfAttention", "Block", "TinyTransformer", "loss_fn", "train", "evaluate", "accuracy", "SCHEDULES"]


class SelfAttention(MultiHeadAttention):
    """``MultiHeadAttention`` with the scale as a switch: ``scaled=True`` divides the scores by
    ``sqrt(d_head)`` (Vaswani et al., 2017), ``scaled=False`` uses raw dot products ``q.k``.

    forward(x (B, N, d_model), causal=True) -> (out (B, N, d_model), weights (B, h, N, N)).

    Example: ``out, w = SelfAttention(64, 4, scaled=False)(torch.randn(2, 10, 64))``
    """

    def __init__(self, d_model, num_heads, scaled=True, bias=True):
        super().__init__(d_model, num_heads, bias=bias)
        if not isinstance(scaled, bool):
            raise TypeError(f"scaled: expected True or False, got {type(scaled).__name__}")
        self.scaled = scaled

    def forward(self, x, causal=True):
        q = self.split_heads(self.q_proj(x))                     # (B, h, N, d_head)
        k = self.split_heads(self.k_proj(x))                     # (B, h, N, d_head)
        v = self.split_heads(self.v_proj(x))                     # (B, h, N, d_head)
        scale = None if self.scaled else 1.0                     # None: 1/sqrt(d_head)
        out, weights = scaled_dot_product_attention(q, k, v, causal=causal, scale=scale,
                                                    return_weights=True)   # (B, h, N, d_head)
        return self.out_proj(self.merge_heads(out)), weights    # (B, N, d_model), (B, h, N, N)


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` if ``d_mlp > 0``.

    forward(x (B, N, d_model), causal=True) -> (x (B, N, d_model), weights (B, h, N, N)).
    """

    def __init__(self, d_model, num_heads, d_mlp, scaled=True):
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, num_heads, scaled=scaled)
        self.mlp = None
        if d_mlp > 0:
            self.ln_mlp = nn.LayerNorm(d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, d_mlp), nn.GELU(), nn.Linear(d_mlp, d_model))

    def forward(self, x, causal=True):
        a, weights = self.attn(self.ln_attn(x), causal=causal)   # (B, N, d_model), (B, h, N, N)
        x = x + a
        if self.mlp is not None:
            x = x + self.mlp(self.ln_mlp(x))                     # (B, N, d_model)
        return x, weights


class TinyTransformer(nn.Module):
    """A small decoder-style transformer: embeddings, ``num_layers`` blocks, LayerNorm, linear read-out.

    ``vocab_size`` input tokens, ``n_classes`` outputs per position (default ``vocab_size``),
    ``d_model`` split over ``num_heads`` heads of ``d_model // num_heads``, learned positions up to
    ``max_len``, an MLP of width ``d_mlp`` per block (default ``4 * d_model``; 0 for none),
    ``scaled`` as in ``SelfAttention``, ``causal`` attention (default) or full. ``seed`` (optional)
    seeds the initial weights so that a model is the same on every run.

    forward(tokens (B, N) long, return_weights=False) -> logits (B, N, n_classes), or
    ``(logits, [weights (B, h, N, N) for each layer])``.

    Example: ``logits, ws = TinyTransformer(10, d_model=32, num_heads=4)(torch.zeros(2, 5, dtype=torch.long), True)``
    """

    def __init__(self, vocab_size, n_classes=None, d_model=64, num_heads=4, num_layers=1, max_len=64,
                 d_mlp=None, scaled=True, causal=True, seed=None):
        super().__init__()
        n_classes = vocab_size if n_classes is None else n_classes
        d_mlp = 4 * d_model if d_mlp is None else d_mlp
        for name, value, least in (("vocab_size", vocab_size, 1), ("n_classes", n_classes, 1), ("d_model", d_model, 1),
                                   ("num_heads", num_heads, 1), ("num_layers", num_layers, 1),
                                   ("max_len", max_len, 1), ("d_mlp", d_mlp, 0)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {value}")
        if d_model % num_heads:
            raise ValueError(f"num_heads: expected a divisor of d_model={d_model}, got {num_heads}")
        for name, value in (("scaled", scaled), ("causal", causal)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected True or False, got {type(value).__name__}")
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
            rng_state = torch.random.get_rng_state()
            torch.manual_seed(seed)
        self.vocab_size, self.n_classes, self.max_len = vocab_size, n_classes, max_len
        self.d_model, self.num_heads, self.num_layers = d_model, num_heads, num_layers
        self.scaled, self.causal = scaled, causal
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, num_heads, d_mlp, scaled) for _ in range(num_layers))
        self.ln_out = nn.LayerNorm(d_model)
        self.readout = nn.Linear(d_model, n_classes)
        if seed is not None:
            torch.random.set_rng_state(rng_state)   # seeding the model leaves the caller's stream alone

    def forward(self, tokens, return_weights=False):
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long or tokens.ndim != 2:
            what = f"{tokens.dtype} tensor of shape {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) \
                else type(tokens).__name__
            raise TypeError(f"tokens: expected a (batch, seq) long tensor, got {what}")
        B, N = tokens.shape
        if N > self.max_len:
            raise ValueError(f"tokens: expected at most max_len={self.max_len} positions, got {N}")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"tokens: expected ids in [0, {self.vocab_size}), got [{tokens.min()}, {tokens.max()}]")
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(N, device=tokens.device))   # (B, N, d_model)
        weights = []
        for block in self.blocks:
            x, w = block(x, causal=self.causal)                  # (B, N, d_model), (B, h, N, N)
            weights.append(w)
        logits = self.readout(self.ln_out(x))                    # (B, N, n_classes)
        return (logits, weights) if return_weights else logits

    def num_parameters(self):
        """Number of trainable parameters."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def loss_fn(logits, targets):
    """Mean cross-entropy over the positions whose target is not ``IGNORE``.

    logits (B, N, C), targets (B, N) long -> scalar.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


SCHEDULES = ("constant", "cosine")


def train(model, task, steps, batch_size=64, lr=3e-3, seed=0, clip=1.0, progress=False, desc=None,
          schedule="constant", eval_every=None, eval_n=500):
    """Train ``model`` on fresh batches of ``task`` with Adam for ``steps`` steps.

    The batches come from a generator seeded with ``seed`` (``attnlab.data.toy.batches``), so a
    model built with the same ``seed`` trains the same way every run. Gradients are clipped to
    norm ``clip`` (``None``: no clipping). ``schedule="cosine"`` decays the learning rate from
    ``lr`` to 0 along half a cosine over the ``steps`` (so the run ends settled); ``"constant"``
    keeps it. ``eval_every=k`` also evaluates on ``eval_n`` held-out sequences (``evaluate``)
    after every ``k`` steps and after the last. The loop is :func:`attnlab.train.fit`, the course's one loop. ``progress=True`` shows a tqdm bar.
    Returns ``{"loss": [loss at every step], "seconds": wall time, "steps": steps,
    "eval": [(step, test loss, test accuracy), ...]}`` (``"eval"`` empty without ``eval_every``).

    Example: ``history = train(model, PreviousTwo(), steps=400, schedule="cosine", eval_every=50)``
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps: expected a non-negative int, got {steps!r}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr: expected a positive number, got {lr!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if eval_every is not None and (isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1):
        raise ValueError(f"eval_every: expected a positive int or None, got {eval_every!r}")
    decay = None
    if schedule == "cosine":   # lr * (1 + cos(pi * step / steps)) / 2: from lr down to 0 at the last step
        def decay(step):
            return 0.5 * (1 + math.cos(math.pi * step / steps))
    accuracies = []

    def held_out():                                              # the loss fit records, and the accuracy
        r = evaluate(model, task, n=eval_n)
        accuracies.append(r["accuracy"])
        return r["loss"]

    data = batches(task, batch_size, seed=seed)                  # (B, N) tokens, (B, N) targets
    history = fit(model, data, lambda batch: loss_fn(model(batch[0]), batch[1]), steps, lr=lr, clip=clip,
                  progress=progress, desc=desc, evaluate=held_out if eval_every else None, eval_every=eval_every,
                  schedule=decay)
    model.eval()
    evals = [(step, loss, acc) for (step, loss), acc in zip(history["eval"], accuracies)]
    return {"loss": history["loss"], "seconds": history["seconds"], "steps": steps, "eval": evals}


@torch.no_grad()
def evaluate(model, task, n=1000, seed=12345):
    """Loss and accuracy of ``model`` on ``n`` fresh sequences of ``task`` (seeded, so every call sees the same).

    Accuracy is the fraction of targeted positions predicted right.
    Example: ``evaluate(model, PreviousTwo(), n=500)`` -> ``{"loss": 0.03, "accuracy": 1.0}``
    """
    tokens, targets = task.sample(n, torch.Generator().manual_seed(seed))   # (n, N), (n, N)
    was_training = model.training
    model.eval()
    logits = model(tokens)                                       # (n, N, C)
    model.train(was_training)
    keep = targets != IGNORE
    correct = (logits.argmax(-1)[keep] == targets[keep]).float().mean().item()
    return {"loss": loss_fn(logits, targets).item(), "accuracy": correct}


def accuracy(model, task, n=1000, seed=12345):
    """Fraction of the targeted positions of ``n`` fresh sequences (seeded) that ``model`` gets right.

    Example: ``accuracy(model, PreviousTwo(), n=500)`` -> a float in [0, 1]
    """
    return evaluate(model, task, n=n, seed=seed)["accuracy"]
