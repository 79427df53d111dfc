"""The references of exercise 03_scaled_dot_product: what the grader compares the learner's answers with.

Never shown in the exercise; an empty file in the sandbox where ``attnlab grade`` runs a notebook.
The maths has one home, the library (``attnlab.attention``): the softmax and attention delegate to it,
and the softmax's backward is autograd through the library's softmax. ``score_variance`` is the
experiment the learner runs, as the grader runs it.
"""

import math

import torch

from attnlab import attention as _attention


def softmax(x, dim=-1):
    """Numerically stable softmax along ``dim`` (each row's max subtracted before exp)."""
    return _attention.softmax(x, dim=dim)


def softmax_backward(p, dp, dim=-1):
    """dS, the gradient on the scores S, from P = softmax(S, dim) and dP, the gradient on P.

    Computed by autograd through the library's softmax: log(P) are scores whose softmax is P (any
    constant shift along ``dim`` leaves the softmax and its backward unchanged).
    p: float, sums to 1 along dim; dp: float like p. Returns float like p.
    """
    with torch.enable_grad():
        s = p.detach().log().requires_grad_(True)   # scores whose softmax is p
        (ds,) = torch.autograd.grad(_attention.softmax(s, dim=dim), s, dp)
    return ds


def scaled_dot_product_attention(q, k, v, scale=None):
    """softmax(q k^T * scale) v with scale = 1/sqrt(d) by default.

    q: (B, H, Nq, d); k: (B, H, Nk, d); v: (B, H, Nk, dv). Returns (B, H, Nq, dv).
    """
    return _attention.scaled_dot_product_attention(q, k, v, scale=scale)


def score_variance(dims, n_pairs=8192, seed=0):
    """The variance experiment: Var(q . k) and Var(q . k / sqrt(d)) for each d in ``dims``.

    g = torch.Generator().manual_seed(seed) once; for each d in order, q then k drawn as
    torch.randn(n_pairs, d, generator=g); the n_pairs scores are q_i . k_i (row i with row i).
    Returns float (len(dims), 2): [torch.var(raw), torch.var(scaled)] per d (unbiased).
    """
    g = torch.Generator().manual_seed(seed)
    rows = []
    for d in dims:
        q = torch.randn(n_pairs, d, generator=g)   # (n, d)
        k = torch.randn(n_pairs, d, generator=g)   # (n, d)
        raw = (q * k).sum(dim=-1)                  # (n,) one dot product per pair
        rows.append(torch.stack([raw.var(), (raw / math.sqrt(d)).var()]))
    return torch.stack(rows)                       # (len(dims), 2)
