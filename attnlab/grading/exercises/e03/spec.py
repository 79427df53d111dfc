"""The references of exercise 03_scaled_dot_product: what the grader compares the learner's answers with.

Never shown in the exercise; hidden (stand-ins that raise) in a kernel that ``attnlab grade`` runs.
"""

import math

import torch

def softmax(x, dim=-1):
    """Numerically stable softmax: subtract each row's max before exp."""
    m = x.amax(dim=dim, keepdim=True)
    e = torch.exp(x - m)
    return e / e.sum(dim=dim, keepdim=True)


def scaled_dot_product_attention(q, k, v, scale=None):
    """softmax(q k^T * scale) v with scale = 1/sqrt(d) by default.

    q: (B, H, Nq, d); k: (B, H, Nk, d); v: (B, H, Nk, dv). Returns (B, H, Nq, dv).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, Nq, Nk)
    return softmax(scores, dim=-1) @ v  # (B, H, Nq, dv)


def score_variance(q, k):
    """Variance of raw and scaled dot products of matching rows.

    q, k: (n, d) with independent N(0, 1) entries. The raw scores are
    q_i . k_i (n of them); the scaled ones are divided by sqrt(d).
    Returns a tensor [var(raw), var(scaled)] (torch.var, unbiased).
    """
    raw = (q * k).sum(dim=-1)  # (n,)
    scaled = raw / math.sqrt(q.shape[-1])
    return torch.stack([raw.var(), scaled.var()])


__import__("attnlab.grading.hiding", fromlist=["hide"]).hide(globals())
