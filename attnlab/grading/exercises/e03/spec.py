"""The references of exercise 03_scaled_dot_product (never shown in the exercise; empty in the grader's sandbox): the
softmax and attention are ``attnlab.attention``'s, the softmax's backward is autograd through its softmax."""

import math

import torch

from attnlab import attention as _attention


def softmax(x, dim=-1):
    return _attention.softmax(x, dim=dim)


def softmax_backward(p, dp, dim=-1):
    """dS from P = softmax(S, dim) and dP: autograd at S = log(P), scores whose softmax is P (a constant shift
    along ``dim`` changes neither the softmax nor its backward)."""
    with torch.enable_grad():
        s = p.detach().log().requires_grad_(True)
        (ds,) = torch.autograd.grad(_attention.softmax(s, dim=dim), s, dp)
    return ds


def scaled_dot_product_attention(q, k, v, scale=None):
    return _attention.scaled_dot_product_attention(q, k, v, scale=scale)


def score_variance(dims, n_pairs=8192, seed=0):
    """One Generator seeded once; for each d in order, q then k drawn as torch.randn(n_pairs, d, generator=g), the
    scores q_i . k_i. Returns (len(dims), 2): [torch.var(raw), torch.var(raw / sqrt(d))] per d (unbiased)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for d in dims:
        q, k = (torch.randn(n_pairs, d, generator=g) for _ in "qk")   # q drawn first
        raw = (q * k).sum(dim=-1)                  # (n_pairs,) one dot product per pair
        rows.append(torch.stack([raw.var(), (raw / math.sqrt(d)).var()]))
    return torch.stack(rows)
