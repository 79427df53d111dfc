"""The references of exercise 07_flash_attention: what the grader compares the learner's answers with.

Never shown in the exercise; an empty file in the sandbox where ``attnlab grade`` runs a notebook. FlashAttention
itself has one home, :mod:`attnlab.tiled`, and the shipped Triton kernel :func:`attnlab.kernels.flash_attention`;
what is here is only the shape the exercise asks for (one leading batch dim, the log-sum-exp returned, one
measurement). The Triton parts have no reference kernel: ``checks.py`` compares them with :mod:`attnlab.tiled`.
"""

import torch

from attnlab.tiled import tiled_attention


def online_softmax_update(m, l, acc, s_block, v_block):
    """Fold scores s_block (M, Nb) of values v_block (Nb, dv) into the running max m (M,), sum l (M,) of exp(s - m)
    and unnormalised output acc (M, dv): (m_new, l_new, acc_new); at the end, out = acc / l[:, None]."""
    m_new = torch.maximum(m, s_block.amax(dim=-1))
    alpha = torch.exp(m - m_new)  # rescales what was accumulated so far
    p = torch.exp(s_block - m_new[:, None])
    return m_new, alpha * l + p.sum(dim=-1), alpha[:, None] * acc + p @ v_block


def tiled_attention_forward(q, k, v, causal=False, block_m=16, block_n=16):
    """O (B, Nq, dv) and L (B, Nq), L_i = log sum_j exp(S_ij) of the scaled scores, of q (B, Nq, d), k (B, Nk, d),
    v (B, Nk, dv); causal: query i sees keys j <= i."""
    o, lse = tiled_attention(q[:, None], k[:, None], v[:, None], causal=causal, block_m=block_m, block_n=block_n,
                             return_lse=True)
    return o[:, 0], lse[:, 0]


def flash_attention_pytorch(q, k, v, causal=False, block_m=16, block_n=16):
    """The same attention, differentiable (an autograd.Function inside): O (B, Nq, dv)."""
    return tiled_attention(q[:, None], k[:, None], v[:, None], causal=causal, block_m=block_m, block_n=block_n)[:, 0]


def tiled_attention_backward(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    """dq, dk, dv of ``flash_attention_pytorch`` for the upstream gradient ``do``, by autograd (``o`` and ``L``
    unused: they are what the learner's hand-written backward starts from)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    with torch.enable_grad():
        return torch.autograd.grad(flash_attention_pytorch(q, k, v, causal, block_m, block_n), (q, k, v), do)


def forward_trace(n, causal=False, block_m=16, block_n=16, seed=0):
    """:func:`attnlab.memory.trace` of attnlab's shipped FlashAttention-2 forward kernel (K and V read once per query
    block, only the blocks it needs when causal) on q, k, v of shape (1, n, 16) float32 drawn from ``seed``."""
    from attnlab.kernels import flash_attention
    from attnlab.memory import trace

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g) for _ in range(3))
    return trace(flash_attention, q, k, v, causal=causal, block_m=block_m, block_n=block_n)


def forward_traffic(n, causal=False, block_m=16, block_n=16, seed=0):
    """Bytes read plus bytes written by that kernel."""
    return forward_trace(n, causal, block_m, block_n, seed).total_bytes
