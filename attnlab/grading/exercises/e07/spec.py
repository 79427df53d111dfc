"""The references of exercise 07_flash_attention: what the grader compares the learner's answers with.

Never shown in the exercise; an empty file in the sandbox where ``attnlab grade`` runs a notebook.
FlashAttention itself has one home, :mod:`attnlab.tiled` (forward, log-sum-exp and the recomputing
backward) and the shipped Triton kernel :func:`attnlab.kernels.flash_attention`; what is here is only
the shape the exercise asks for (one leading batch dim, the log-sum-exp returned, one measurement).
The Triton parts have no reference kernel: their checks compare with :func:`attnlab.tiled.tiled_attention`
and count the kernel's traffic against a budget (``checks.py``).
"""


import torch

from attnlab.tiled import tiled_attention


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


def tiled_attention_forward(q, k, v, causal=False, block_m=16, block_n=16):
    """FlashAttention-2's forward with its log-sum-exp, for one leading batch dim.

    q: (B, Nq, d), k: (B, Nk, d), v: (B, Nk, dv), float32; causal: query i sees keys j <= i.
    Returns O (B, Nq, dv) and L (B, Nq), L_i = log sum_j exp(S_ij) of the scaled scores.
    """
    o, lse = tiled_attention(q[:, None], k[:, None], v[:, None], causal=causal, block_m=block_m,
                             block_n=block_n, return_lse=True)  # (B, 1, Nq, dv), (B, 1, Nq)
    return o[:, 0], lse[:, 0]


def flash_attention_pytorch(q, k, v, causal=False, block_m=16, block_n=16):
    """The same attention as a differentiable function (autograd.Function inside): O (B, Nq, dv)."""
    return tiled_attention(q[:, None], k[:, None], v[:, None], causal=causal, block_m=block_m,
                           block_n=block_n)[:, 0]


def tiled_attention_backward(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    """dq, dk, dv (shaped like q, k, v) of ``flash_attention_pytorch`` for the upstream gradient ``do``
    (B, Nq, dv); ``o`` and ``L`` are the forward's and unused here: autograd through :mod:`attnlab.tiled`'s
    attention is the reference of the learner's hand-written backward."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    with torch.enable_grad():
        out = flash_attention_pytorch(q, k, v, causal, block_m, block_n)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    return dq, dk, dv


def forward_traffic(n, causal=False, block_m=16, block_n=16, seed=0):
    """Bytes read plus bytes written by a FlashAttention-2 forward kernel that reads K and V once per
    query block (only the blocks it needs when causal), on q, k, v of shape (1, n, 16) float32 drawn
    from ``seed``: attnlab's shipped kernel, traced by :func:`attnlab.memory.trace`."""
    from attnlab.kernels import flash_attention
    from attnlab.memory import trace

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g) for _ in range(3))
    return trace(flash_attention, q, k, v, causal=causal, block_m=block_m, block_n=block_n).total_bytes
