"""The references of exercise 02_queries_keys_values: what the grader compares the learner's answers with.

Never shown in the exercise; hidden (stand-ins that raise) in a kernel that ``attnlab grade`` runs.
"""

import math

import torch

def padding_mask(lengths, max_len):
    """Bool (B, max_len), True where position j < lengths[b] (a real token).

    lengths: int (B,).
    """
    positions = torch.arange(max_len, device=lengths.device)  # (max_len,)
    return positions[None, :] < lengths[:, None]  # (B, max_len)


def causal_mask(n_q, n_k, device=None):
    """Bool (n_q, n_k), True where key j <= query i (top-left aligned, like PyTorch's is_causal)."""
    i = torch.arange(n_q, device=device)[:, None]  # (n_q, 1)
    j = torch.arange(n_k, device=device)[None, :]  # (1, n_k)
    return j <= i


def masked_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d) with masked scores removed) v.

    q: (B, H, Nq, d); k: (B, H, Nk, d); v: (B, H, Nk, dv);
    mask: bool broadcastable to (B, H, Nq, Nk), True = attend, or None.
    A query row with no key to attend to outputs zeros. Returns (B, H, Nq, dv).
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Nq, Nk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)  # (B, H, Nq, Nk)
    total = e.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, e / total.clamp_min(1e-30), torch.zeros_like(e))
    return p @ v  # (B, H, Nq, dv)


__import__("attnlab.grading.hiding", fromlist=["hide"]).hide(globals())
