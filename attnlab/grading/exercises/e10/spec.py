"""The references of exercise 10_inference (empty in the grading sandbox): the library's (``attnlab.iomodel``,
``attnlab.kvcache``) where it has them; the split-K partials and merge, and MLA's decode on plain tensors (absorbed
here, checked against the unabsorbed form in tests/test_exercise_10.py) are the exercise's own."""

import math

import torch

from attnlab import iomodel
from attnlab.kvcache import decode_reference, gather_cache


def decode_step_bytes(batch, context, params, layers, kv_heads, d, bytes_per_element=2):
    """Bytes a model's decoding step reads (lesson 10 section 1: P e + B L c): the weights once for the batch, and
    each sequence's K and V cache, 2 x layers x kv_heads x d x e bytes per token (not the new token's, written)."""
    return iomodel.decode_step_bytes(batch, context, params=params, layers=layers, heads=kv_heads, d=d,
                                     kv_heads=kv_heads, bytes_per_element=bytes_per_element).bytes_read


def crossover_tokens(params, layers, kv_heads, d, bytes_per_element=2):
    """batch x context at which the caches' read equals the weights': P e / c, a float."""
    return iomodel.decode_crossover_tokens(params=params, layers=layers, d=d, kv_heads=kv_heads,
                                           bytes_per_element=bytes_per_element)


def decode_attention(q, k_cache, v_cache, cache_seqlens, scale=None):
    """q (B, H_q, Nq, D), caches (B, H_kv, S, D), lengths (B,) -> (B, H_q, Nq, D): query i sees keys 0 .. L_b - Nq
    + i; query head h reads KV head h // (H_q // H_kv)."""
    return decode_reference(q, k_cache, v_cache, cache_seqlens, scale=scale)


def split_partials(q, k, v, num_splits, scale=None):
    """q (B, H, Nq, D), k, v (B, H, N, D), keys in chunks of ceil(N / S) -> each chunk's normalised output (B, H, S,
    Nq, D) and natural log-sum-exp (B, H, S, Nq); an empty chunk gives 0 and -inf."""
    B, H, n_q, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    chunk = -(-k.shape[2] // num_splits)
    o = q.new_zeros(B, H, num_splits, n_q, D)
    lse = q.new_full((B, H, num_splits, n_q), float("-inf"))
    for s, (k_s, v_s) in enumerate(zip(k.split(chunk, dim=2), v.split(chunk, dim=2))):  # splits past N stay empty
        scores = q @ k_s.transpose(-1, -2) * scale                           # (B, H, Nq, n_s)
        lse[:, :, s] = torch.logsumexp(scores, dim=-1)
        o[:, :, s] = torch.softmax(scores, dim=-1) @ v_s
    return o, lse


def merge_splits(o_parts, lse):
    """o_parts (B, H, S, Nq, D), lse (B, H, S, Nq) -> o (B, H, Nq, D): each split weighed by its softmax mass."""
    w = torch.softmax(lse, dim=2)                                           # exp(lse_s - M) / sum, stable
    return (w[..., None] * o_parts).sum(dim=2).to(o_parts.dtype)


def gather_sequence(pool, block_table, b, length):
    """pool (pages, H_kv, page_size, D), block_table (B, max_pages) -> sequence b's first entries (H_kv, length, D)."""
    return gather_cache(pool, b, length, block_table)


def latent_decode(q_nope, q_rope, w_uk, w_uv, c, k_rope, scale=None):
    """One query per sequence against an MLA latent cache (DeepSeek-V2 section 2.1): q_nope (B, H, d_h), q_rope (B,
    H, d_rope), w_uk, w_uv (H, d_h, d_latent), c (B, L, d_latent), k_rope (B, L, d_rope) -> (B, H, d_h), equal to
    attention with per-head K = [W_UK c, k_rope], V = W_UV c; scale 1/sqrt(d_h + d_rope) unless given."""
    scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5 if scale is None else scale
    q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)                       # (B, H, d_latent): W_UK absorbed
    s = (torch.einsum("bhc,blc->bhl", q_lat, c) + torch.einsum("bhr,blr->bhl", q_rope, k_rope)) * scale  # (B, H, L)
    p = torch.softmax(s, dim=-1)                                              # (B, H, L)
    return torch.einsum("bhc,hdc->bhd", torch.einsum("bhl,blc->bhc", p, c), w_uv)  # (B, H, d_h): W_UV applied last


def decode_bytes(contexts, kv_heads_list, heads=8, d=16):
    """Bytes one decoding step moves (read + written; batch 1, one query, fp16, num_splits=1): int64, a row per
    kv_heads, a column per context length."""
    return torch.tensor([[iomodel.decode_io(1, heads, L, d, 2, kv_heads=h, num_splits=1).total_bytes
                          for L in contexts] for h in kv_heads_list], dtype=torch.int64)
