"""The references of exercise 09_capstone: what the grader compares the learner's answers with.

Never shown in the exercise; an empty file in the sandbox where ``attnlab grade`` runs a notebook.
The attention itself comes from the library (``attnlab.attention``) and the model from
``attnlab.models.gpt``; what is specific to the exercise is the tiny training recipe, the
local-plus-global element mask and the experiment.
"""

import torch

from attnlab import mask_mods
from attnlab.attention import scaled_dot_product_attention
from attnlab.models.gpt import GPT

# the recipe the notebook states (its setup cell holds the same numbers; a test compares them)
TINY = dict(vocab_size=96, block_size=32, d_model=32, n_heads=2, n_layers=2)   # head size 16
BATCH, SEQ, LR, CLIP = 4, 32, 3e-3, 1.0

_CORPUS = []


def _corpus():
    if not _CORPUS:
        from attnlab.data.stdlib_text import load_corpus

        _CORPUS.append(load_corpus())
    return _CORPUS[0]


def my_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """SDPA's signature on attnlab's plain PyTorch attention (bool mask, True = attend; causal top-left).

    q: (B, H, Nq, D); k, v: (B, H, Nk, D). Returns (B, H, Nq, D).
    """
    return scaled_dot_product_attention(q, k, v, mask=attn_mask, causal=is_causal, scale=scale)


def train_gpt(seed, steps, attention="sdpa"):
    """``steps`` Adam steps of the tiny GPT from ``seed``; the loss of every step (before its update).

    The model: ``GPT(**TINY, attention=attention, seed=seed)``; the batches: one generator seeded with
    ``seed``, ``corpus.batch("train", BATCH, SEQ, g)`` per step; Adam at ``LR``; gradients clipped to ``CLIP``.
    Returns a float32 tensor of ``steps`` losses.
    """
    corpus = _corpus()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matrices: one thread is faster, and rounds the same way every run
    try:
        return _train(corpus, seed, steps, attention)
    finally:
        torch.set_num_threads(threads)


def _train(corpus, seed, steps, attention):
    with torch.enable_grad():                                               # also when called under no_grad
        model = GPT(**TINY, attention=attention, seed=seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        g = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(steps):
            x, y = corpus.batch("train", BATCH, SEQ, g)                    # (B, T), (B, T)
            _, loss = model(x, y)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            losses.append(loss.item())
    return torch.tensor(losses)


def local_global_mask(n, window, n_global):
    """(n, n) bool: query i sees key j when j <= i and (i - j < window or j < n_global).

    From attnlab.mask_mods: causal AND (a sliding window of ``window - 1`` keys before the query, OR
    global tokens); under causal, global queries add nothing, so the global tokens are the keys."""
    near = [mask_mods.sliding_window(window - 1)] if window > 0 else []
    mod = mask_mods.and_masks(mask_mods.causal, mask_mods.or_masks(*near, mask_mods.global_tokens(n_global)))
    return mask_mods.create_mask(mod, None, None, n, n)[0, 0]              # (n, n)


def local_vs_dense(seed, steps, window, n_global):
    """The experiment: the loss curves (dense causal, local plus global) of two runs from ``seed``."""
    mask = local_global_mask(SEQ, window, n_global)

    def dense(q, k, v, is_causal=True):
        return scaled_dot_product_attention(q, k, v, causal=True)

    def local(q, k, v, is_causal=True):
        return scaled_dot_product_attention(q, k, v, mask=mask, causal=True)

    return train_gpt(seed, steps, dense), train_gpt(seed, steps, local)
