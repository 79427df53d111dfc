"""Exercise 12_beyond_dense: its parts, what each may not call, and its hints.

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.
"""

from attnlab.grading.exercises import ATTENTION, SOFTMAX, Part

EXERCISE = "12_beyond_dense"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("causal-topk", "the indexer's causal top-k block selection", 2, ("select_blocks",)),
    Part("selected-kernel", "selected-block attention in Triton: only the chosen key blocks are read", 3,
         ("selected_attn_kernel",)),
    Part("delta-recurrence", "the gated delta rule, token by token", 2, ("delta_recurrence",)),
    Part("delta-chunked", "the gated delta rule chunk by chunk (WY / UT form), never N x N", 3,
         ("delta_chunkwise",)),
    Part("state-vs-cache", "experiment: a delta layer's state against a KV cache, per decoded token", 1,
         ("state_vs_cache",), "experiment"),
    Part("beyond-explain", "explain: what selection and a recurrent state buy, and what they give up", 1, (),
         "manual"),
]

# the library's answers: the selection and its attention, the delta rule (both forms) and its kernel
_SPARSE = ["attnlab.sparse.*"]
_DELTA = ["attnlab.linear_attention.*", "attnlab.hybrids.*", "attnlab.models.*"]

# part id -> patterns of what its answer may not call (besides the library and the references). torch.topk and
# torch.sort are allowed in causal-topk: ranking is not what the part teaches; the causal rules around it are
FORBIDDEN = {
    "causal-topk": _SPARSE,
    "selected-kernel": SOFTMAX + ATTENTION + _SPARSE,
    "delta-recurrence": _DELTA,
    "delta-chunked": _DELTA,
    "state-vs-cache": _DELTA + ["attnlab.iomodel.*", "attnlab.kvcache.*"],
}

# part id -> {name: why}: what the answer must read (the syntax of its code, attnlab/grading/shortcuts.py)
REQUIRED = {
    "state-vs-cache": {"delta_chunkwise|delta_recurrence": "the state's bytes are measured on the state your own "
                                                           "delta rule returns after L tokens: the formula written "
                                                           "out is not the measurement"},
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "causal-topk": [
        "Work on a float32 copy of the scores. With i the query block (dim -2) and j the key block (dim -1), two "
        "masks decide everything before any ranking: j > i is the future, j == i the block a query must see.",
        "Give the future -inf and the diagonal +inf, then take the k = min(topk, n_k_blocks) largest per row "
        "(torch.topk is allowed). A chosen entry whose value is -inf was never selectable: it is a free slot.",
        "Replace the free slots by a number larger than any id (n_k_blocks) so that an ascending sort puts them "
        "last, sort, turn them into -1, and pad with -1 columns up to topk when n_k_blocks < topk; return int32.",
    ],
    "selected-kernel": [
        "Lesson 08's block-skipping loop with two changes: the list is block_indices + (pid_h * n_qb + pid_m) * "
        "topk, and its slots hold -1 where nothing was selected. Loop `for i in range(0, topk):`, load the id j, "
        "and do the work only when j >= 0.",
        "For a selected block: keys j * BLOCK + tl.arange(0, BLOCK), K and V loaded with mask=offs_n[:, None] < "
        "n_ctx. The scores need two masks before the running max: keys past n_ctx, and keys after the query "
        "(causal: offs_n[None, :] <= offs_m[:, None]), which only matters on the diagonal block.",
        "Keep m_i, l_i and acc across the selected blocks exactly as in lesson 07 (acc = acc * alpha[:, None] + "
        "tl.dot(p, v)); every row sees at least itself, so l_i > 0 at the end; store acc / l_i[:, None] once.",
    ],
    "delta-recurrence": [
        "Keep S as a float32 (B, H, d_k, d_v) tensor (zeros, or a copy of initial_state) and walk t = 0 .. N-1; "
        "each step works on k[:, :, t] (B, H, d_k), v[:, :, t] (B, H, d_v) and beta[:, :, t] (B, H).",
        "The order inside a step matters: first decay S by exp(g_t), then read S^T k_t (a sum over d_k), then "
        "write k_t u_t^T with u_t = beta_t (v_t - S^T k_t), then read the output with the updated S.",
        "S^T k_t for a batch of heads is (k_t[..., None] * S).sum(-2), or torch.einsum('bhk,bhkv->bhv', k_t, S); "
        "the output is the same read with scale * q_t. Stack the N outputs along dim 2; return (o, S).",
    ],
    "delta-chunked": [
        "Loop over chunk starts c0 = 0, C, 2C, ... (the last chunk may be shorter). Inside a chunk everything is a "
        "matmul of its C rows; only the state S (d_k x d_v) goes from one chunk to the next.",
        "In a chunk: G = cumsum of g (zeros when g is None); decay[i, j] = exp(G_i - G_j) for j <= i and 0 above "
        "(mask before the exp); A = strictly lower part of beta_i (k_i . k_j) decay[i, j]. Solve (I + A) X = R "
        "for X with torch.linalg.solve_triangular(..., upper=False, unitriangular=True) (or forward substitution).",
        "W solves for diag(beta exp(G)) K, U for diag(beta) V minus W S; the chunk's output is scale (exp(G) Q S "
        "+ ((Q K^T) * decay) U) with the diagonal included, and the new state exp(G_C) S + (K exp(G_C - G))^T U.",
    ],
    "state-vs-cache": [
        "For each L: a KV cache of L tokens is two float16 tensors k, v of shape (1, kv_heads, L, d); its bytes "
        "are what the tensors hold (numel times element_size).",
        "For the state: run your own delta rule (delta_chunkwise or delta_recurrence) on L random tokens, q, k, v "
        "(1, heads, L, d) float32 with unit-norm keys, beta in (0, 1), and take the bytes of the state it returns.",
        "A decoding step of the dense layer reads the whole cache; the delta layer reads its state. Return two "
        "int64 tensors of len(contexts): (cache_bytes, state_bytes), in the order of contexts.",
    ],
}
