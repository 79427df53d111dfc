"""The references of exercise 07_flash_attention (never shown in the exercise; empty in the grader's sandbox):
:mod:`attnlab.tiled` and :func:`attnlab.kernels.flash_attention` in the shape the exercise asks for."""

import torch

from attnlab.tiled import tiled_attention


def online_softmax_update(m, l, acc, s_block, v_block):
    """Fold scores s_block (M, Nb) of values v_block (Nb, dv) into the running max m (M,), sum l (M,) of exp(s - m)
    and unnormalised output acc (M, dv): (m_new, l_new, acc_new); at the end, out = acc / l[:, None]."""
    m_new = torch.maximum(m, s_block.amax(dim=-1))
    alpha = torch.exp(m - m_new)  # rescales what was accumulated so far
    p = torch.exp(s_block - m_new[:, None])
    return m_new, alpha * l + p.sum(dim=-1), alpha[:, None] * acc + p @ v_block


def tiled_attention_forward(q, k, v, causal=False, block_m=16, block_n=16, scale=None):
    """O (B, Nq, dv) and L (B, Nq), the log-sum-exp of each row of scaled scores, of q (B, Nq, d), k (B, Nk, d),
    v (B, Nk, dv); causal: query i sees keys j <= i; scale (the kernels'): 1/sqrt(d) if None."""
    o, lse = tiled_attention(q[:, None], k[:, None], v[:, None], causal=causal, block_m=block_m, block_n=block_n,
                             scale=scale, return_lse=True)
    return o[:, 0], lse[:, 0]


def flash_attention_pytorch(q, k, v, causal=False, block_m=16, block_n=16):
    """The same O, differentiable (an autograd.Function inside)."""
    return tiled_attention(q[:, None], k[:, None], v[:, None], causal=causal, block_m=block_m, block_n=block_n)[:, 0]


def tiled_attention_backward(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    """dq, dk, dv for the upstream gradient ``do``, by autograd (``o`` and ``L``: what the learner's starts from)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    with torch.enable_grad():
        return torch.autograd.grad(flash_attention_pytorch(q, k, v, causal, block_m, block_n), (q, k, v), do)


def forward_trace(n, causal=False, block_m=16, block_n=16, seed=0):
    """:func:`attnlab.memory.trace` of the shipped forward kernel on q, k, v (1, n, 16) float32 drawn from ``seed``."""
    from attnlab.kernels import flash_attention
    from attnlab.memory import trace

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g) for _ in range(3))
    return trace(flash_attention, q, k, v, causal=causal, block_m=block_m, block_n=block_n)


def forward_traffic(n, causal=False, block_m=16, block_n=16, seed=0):
    """Bytes read plus bytes written by that kernel (K and V read once per query block, only those it needs)."""
    return forward_trace(n, causal, block_m, block_n, seed).total_bytes
