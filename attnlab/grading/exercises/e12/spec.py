"""The references of exercise 12_beyond_dense (empty in the sandbox): the library's maths in the exercise's calling
convention."""

import torch

from attnlab.iomodel import kv_cache_bytes
from attnlab.linear_attention import delta_rule_chunked, delta_rule_recurrent, recurrent_state_bytes
from attnlab.sparse import select_blocks as _select_blocks, selected_attention_reference


def select_blocks(block_scores, topk):
    """block_scores (..., n_q_blocks, n_k_blocks) float -> int32 (..., n_q_blocks, topk): the causal top-k,
    never a future block, the diagonal block always, -inf never, ids ascending, -1 after them."""
    scores = block_scores if block_scores.dim() == 4 else block_scores.reshape(-1, *block_scores.shape[-2:])
    return _select_blocks(scores, topk).reshape(*block_scores.shape[:-1], topk)


def selected_attention(q, k, v, block_indices, block_size, scale):
    """The kernel's output: each query block attends, causally, to its selected key blocks; q, k, v (BH, N, D)."""
    return selected_attention_reference(q[None], k[None], v[None], block_indices[None].to(torch.int32).contiguous(),
                                        block_size=block_size, scale=scale)[0]


def delta_recurrence(q, k, v, beta, g=None, scale=None, initial_state=None):
    """The gated delta rule token by token: (o (B, H, N, d_v), final state (B, H, d_k, d_v) float32)."""
    return delta_rule_recurrent(q, k, v, beta, g, scale=scale, initial_state=initial_state, output_final_state=True)


def delta_chunkwise(q, k, v, beta, g, chunk_size, scale=None, initial_state=None):
    """The same numbers as :func:`delta_recurrence` (its definition), whatever ``chunk_size``."""
    return delta_recurrence(q, k, v, beta, g, scale=scale, initial_state=initial_state)


def delta_chunkwise_fast(q, k, v, beta, g, chunk_size, scale=None, initial_state=None):
    """The library's chunked form, for lengths where a loop over tokens would be slow."""
    return delta_rule_chunked(q, k, v, beta, g, scale=scale, initial_state=initial_state, output_final_state=True,
                              chunk_size=chunk_size)


def state_vs_cache(contexts, heads, kv_heads, d):
    """Per context L, the bytes one decoding step reads: a dense layer's fp16 KV cache of L tokens on ``kv_heads``
    heads, and a gated delta layer's float32 state of ``heads`` d x d matrices (batch 1, int64)."""
    cache = [kv_cache_bytes(L, 1, kv_heads, d, 2) for L in contexts]
    state = [recurrent_state_bytes(1, heads, d, d, 4) for _ in contexts]
    return torch.tensor(cache, dtype=torch.int64), torch.tensor(state, dtype=torch.int64)
