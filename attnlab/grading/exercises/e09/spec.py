"""The references of exercise 09_capstone (never shown; an empty file in the sandbox where ``attnlab grade`` runs):
the library's attention and GPT, the tiny training recipe, the local-plus-global mask and the experiment."""

import functools

import torch

from attnlab import mask_mods
from attnlab.attention import causal_mask, scaled_dot_product_attention
from attnlab.data.stdlib_text import load_corpus
from attnlab.models.gpt import GPT

# the recipe the notebook states (its setup cell holds the same numbers; a test compares them)
TINY = dict(vocab_size=96, block_size=32, d_model=32, n_heads=2, n_layers=2)   # head size 16
BATCH, SEQ, LR, CLIP = 4, 32, 3e-3, 1.0
_corpus = functools.lru_cache(maxsize=1)(load_corpus)   # read once


def my_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """SDPA's signature on attnlab's attention (bool mask, True = attend; causal top-left): (B, H, Nq, D)."""
    return scaled_dot_product_attention(q, k, v, mask=attn_mask, causal=is_causal, scale=scale)


def train_gpt(seed, steps, attention="sdpa", *, lr=LR, optimizer=torch.optim.Adam, clip=True, zero_grad=True,
              reseed=None):
    """Every step's loss (before its update) of the tiny GPT trained from ``seed``. The keywords change one
    ingredient for the checks' mistakes (``reseed(step)``: a new generator each step, seeded seed + reseed(step))."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matrices: one thread is faster, and rounds the same way every run
    try:
        with torch.enable_grad():                                           # also when called under no_grad
            model = GPT(**TINY, attention=attention, seed=seed)
            opt = optimizer(model.parameters(), lr=lr)
            g = torch.Generator().manual_seed(seed)
            losses = []
            for step in range(steps):
                if reseed:
                    g = torch.Generator().manual_seed(seed + reseed(step))
                x, y = _corpus().batch("train", BATCH, SEQ, g)              # (B, T), (B, T)
                _, loss = model(x, y)
                if zero_grad:
                    opt.zero_grad()
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                losses.append(loss.item())
        return torch.tensor(losses)
    finally:
        torch.set_num_threads(threads)


def local_global_mask(n, window, n_global):
    """(n, n) bool: query i sees key j when j <= i and (i - j < window or j < n_global); under causal, the global
    tokens are keys only (global queries would add nothing)."""
    near = [mask_mods.sliding_window(window - 1)] if window > 0 else []
    mod = mask_mods.and_masks(mask_mods.causal, mask_mods.or_masks(*near, mask_mods.global_tokens(n_global)))
    return mask_mods.create_mask(mod, None, None, n, n)[0, 0]              # (n, n)


_RUNS = {}   # (seed, steps, element mask) -> loss curve, so that the checks' emulated mistakes share runs


def masked_run(seed, steps, keep):
    """train_gpt's loss curve with attention under the bool element mask ``keep`` (SEQ, SEQ), True = attend."""
    key = (seed, steps, keep.numpy().tobytes())
    if key not in _RUNS:
        _RUNS[key] = train_gpt(seed, steps, lambda q, k, v, is_causal=True: scaled_dot_product_attention(
            q, k, v, mask=keep))
    return _RUNS[key]


def local_vs_dense(seed, steps, window, n_global):
    """The experiment: the loss curves (dense causal, local plus global) of two runs from ``seed``."""
    return masked_run(seed, steps, causal_mask(SEQ)), masked_run(seed, steps, local_global_mask(SEQ, window, n_global))
