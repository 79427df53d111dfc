"""The references of exercise 12_beyond_dense: what the grader compares the learner's answers with.

Never shown in the exercise; an empty file in the sandbox where ``attnlab grade`` runs a notebook. The maths is the
library's (``attnlab.sparse``, ``attnlab.linear_attention``, ``attnlab.iomodel``); what is here is the exercise's
calling convention: ``(o, final state)``, the kernel's ``(BH, N, D)`` rows, the experiment's two rows of bytes.
"""

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
    """What the kernel computes: q, k, v (BH, N, D), block_indices (BH, n_qb, topk) int32 -> o (BH, N, D):
    each query block attends, causally, to its selected key blocks only."""
    return selected_attention_reference(q[None], k[None], v[None], block_indices[None].to(torch.int32).contiguous(),
                                        block_size=block_size, scale=scale)[0]


def delta_recurrence(q, k, v, beta, g=None, scale=None, initial_state=None):
    """The gated delta rule token by token: (o (B, H, N, d_v), final state (B, H, d_k, d_v) float32)."""
    return delta_rule_recurrent(q, k, v, beta, g, scale=scale, initial_state=initial_state, output_final_state=True)


def delta_chunkwise(q, k, v, beta, g, chunk_size, scale=None, initial_state=None):
    """The same numbers as :func:`delta_recurrence` (its definition), whatever ``chunk_size``."""
    return delta_recurrence(q, k, v, beta, g, scale=scale, initial_state=initial_state)


def delta_chunkwise_fast(q, k, v, beta, g, chunk_size, scale=None, initial_state=None):
    """The library's chunked form: the reference at lengths where a loop over tokens in the grader would be slow."""
    return delta_rule_chunked(q, k, v, beta, g, scale=scale, initial_state=initial_state, output_final_state=True,
                              chunk_size=chunk_size)


def state_vs_cache(contexts, heads, kv_heads, d):
    """The experiment: per context L, the bytes a decoding step of one layer reads from what it keeps
    (batch 1): a dense layer's fp16 KV cache of L tokens on ``kv_heads`` heads, and a gated delta layer's
    float32 state of ``heads`` d x d matrices. Returns int64 (cache_bytes (len(contexts),),
    state_bytes (len(contexts),))."""
    cache = [kv_cache_bytes(L, 1, kv_heads, d, 2) for L in contexts]
    state = [recurrent_state_bytes(1, heads, d, d, 4) for _ in contexts]
    return torch.tensor(cache, dtype=torch.int64), torch.tensor(state, dtype=torch.int64)
