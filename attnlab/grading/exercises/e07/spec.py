"""The references of exercise 07_flash_attention: what the grader compares the learner's answers with.

Never shown in the exercise; hidden (stand-ins that raise) in a kernel that ``attnlab grade`` runs.
"""

import math

import torch

def online_softmax_update(m, l, acc, s_block, v_block):
    """Fold one block of scores into running softmax statistics.

    m: (M,) running max; l: (M,) running sum of exp(s - m); acc: (M, dv) running
    unnormalised output; s_block: (M, Nb) scores of the new keys; v_block: (Nb, dv).
    Returns (m_new, l_new, acc_new). At the end, out = acc / l[:, None].
    """
    m_new = torch.maximum(m, s_block.amax(dim=-1))  # (M,)
    alpha = torch.exp(m - m_new)  # (M,) rescales what was accumulated so far
    p = torch.exp(s_block - m_new[:, None])  # (M, Nb)
    l_new = alpha * l + p.sum(dim=-1)
    acc_new = alpha[:, None] * acc + p @ v_block  # (M, dv)
    return m_new, l_new, acc_new


def tiled_attention_forward(q, k, v, block_k=16, scale=None):
    """Attention computed one block of keys at a time (FlashAttention's outer loop in PyTorch).

    q: (M, d); k: (N, d); v: (N, dv); any N (the last block may be partial).
    Returns (M, dv), equal to softmax(q k^T * scale) v.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    m = torch.full((q.shape[0],), float("-inf"), dtype=q.dtype)
    l = torch.zeros(q.shape[0], dtype=q.dtype)
    acc = torch.zeros(q.shape[0], v.shape[-1], dtype=q.dtype)
    for start in range(0, k.shape[0], block_k):
        s = q @ k[start : start + block_k].T * scale  # (M, <= block_k)
        m, l, acc = online_softmax_update(m, l, acc, s, v[start : start + block_k])
    return acc / l[:, None]


def attention(q, k, v, scale=None, mask=None):
    """Reference for the Triton kernels: attention over the last two dims, any leading dims.

    q: (..., Nq, d); k, v: (..., Nk, d); mask: bool broadcastable to (..., Nq, Nk) or None.
    Rows with nothing to attend to are zeros.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.transpose(-2, -1) * scale  # (..., Nq, Nk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, e / total.clamp_min(1e-30), torch.zeros_like(e))
    return p @ v  # (..., Nq, dv)


__import__("attnlab.grading.hiding", fromlist=["hide"]).hide(globals())
