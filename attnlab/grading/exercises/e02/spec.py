"""The references of exercise 02_queries_keys_values (empty in the grading sandbox): ``attnlab.attention`` with the
exercise's signatures, and ``timing_table``, the grader's own timing shown (never scored) beside the loop."""

import itertools
import math
import timeit

import torch

from attnlab import attention as _attention


def padding_mask(lengths, max_len):
    """Bool (B, max_len), True where position j < lengths[b] (a real token). lengths: int (B,)."""
    return _attention.padding_mask(lengths, max_len)


def causal_mask(n_q, n_k, device=None):
    """Bool (n_q, n_k), True where key j <= query i (top-left aligned, like PyTorch's is_causal)."""
    return _attention.causal_mask(n_q, n_k, device=device)


def masked_attention(q, k, v, mask=None, causal=False):
    """q (B, H, Nq, d), k (B, H, Nk, d), v (B, H, Nk, dv); mask bool broadcastable to (B, H, Nq, Nk), True = attend;
    causal ANDs the top-left causal mask; a row with no key outputs zeros. Returns (B, H, Nq, dv)."""
    return _attention.scaled_dot_product_attention(q, k, v, mask=mask, causal=causal)


def attention_row(q, k, v, keep=None):
    """q (d,), k (Nk, d), v (Nk, dv), keep bool (Nk,) or None -> (weights (Nk,), out (dv,)), zeros if none kept."""
    out, weights = _attention.scaled_dot_product_attention(
        q[None, None, None], k[None, None], v[None, None], mask=keep, return_weights=True)  # (1,1,1,dv), (1,1,1,Nk)
    return weights[0, 0, 0], out[0, 0, 0]


def loop_attention(q, k, v):
    """out[b, h, i] = attention_row(q[b, h, i], k[b, h], v[b, h])[1]: (B, H, Nq, dv)."""
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)  # (B, H, Nq, dv)
    for b, h, i in itertools.product(*map(range, q.shape[:-1])):
        out[b, h, i] = attention_row(q[b, h, i], k[b, h], v[b, h])[1]
    return out


def _plain_loop(q, k, v):
    """(1, 1, N, d) attention one query at a time, without attention_row's argument checks: about a learner's cost."""
    k0, v0, scale = k[0, 0], v[0, 0], 1.0 / math.sqrt(q.shape[-1])
    return torch.stack([_attention.softmax(k0 @ row * scale) @ v0 for row in q[0, 0]])[None, None]  # (1, 1, N, dv)


def timing_table(sizes, d=32, seed=0, repeat=5):
    """For each N, the fastest of ``repeat`` runs (seconds, one thread) of the loop and of the batched attention on
    (1, 1, N, d) inputs: {"loop", "batched"}, float64 (len(sizes),) each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same conditions as the exercise's setup cell
    try:
        g, loop, batched = torch.Generator().manual_seed(seed), [], []
        for n in sizes:
            q, k, v = (torch.randn(1, 1, n, d, generator=g) for _ in range(3))
            loop.append(min(timeit.repeat(lambda: _plain_loop(q, k, v), number=1, repeat=repeat)))
            batched.append(min(timeit.repeat(lambda: masked_attention(q, k, v), number=1, repeat=repeat)))
    finally:
        torch.set_num_threads(threads)
    return {"loop": torch.tensor(loop, dtype=torch.float64), "batched": torch.tensor(batched, dtype=torch.float64)}
