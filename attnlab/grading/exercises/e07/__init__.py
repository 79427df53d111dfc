"""Exercise 07_flash_attention: its parts, what each may not call, and its hints.

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.
"""

from attnlab.grading.exercises import ATTENTION, AUTOGRAD, SOFTMAX, Part

EXERCISE = "07_flash_attention"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("online-softmax-update", "the online-softmax update", 1, ("online_softmax_update",)),
    Part("tiled-forward", "the FlashAttention-2 forward in PyTorch, as an autograd.Function", 3,
         ("tiled_attention_forward", "flash_attention_pytorch")),
    Part("flash-kernel-loop", "the whole Triton forward kernel", 4, ("flash_fwd_kernel",)),
    Part("traffic-experiment", "measuring the bytes your kernel moves", 2, ("forward_traffic",), "experiment"),
    Part("tiled-backward", "the backward from L, with recomputation", 3,
         ("tiled_attention_backward", "flash_attention_pytorch")),
    Part("dkdv-kernel", "(bonus) the dK/dV kernel in Triton", 1, ("flash_bwd_dkdv_kernel",)),
    Part("recompute-why", "why P is recomputed from L", 1, (), "manual"),
]

# the log-sum-exp of a whole row of scores is what the tiles replace
LOGSUMEXP = ["torch.logsumexp", "torch.Tensor.logsumexp", "torch.special.logsumexp"]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "online-softmax-update": SOFTMAX,
    "tiled-forward": SOFTMAX + ATTENTION + LOGSUMEXP,
    "flash-kernel-loop": SOFTMAX + ATTENTION,
    "traffic-experiment": SOFTMAX + ATTENTION,
    "tiled-backward": SOFTMAX + ATTENTION + LOGSUMEXP + AUTOGRAD,
    "dkdv-kernel": SOFTMAX + ATTENTION,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "online-softmax-update": [
        "Start with the new running max: the larger of the old max m and each row's max over s_block.",
        "Everything accumulated so far is relative to the old max; alpha = exp(m - m_new) moves it to the new one. "
        "On the first block m = -inf and exp(-inf) = 0, so alpha needs no special case.",
        "Three lines after m_new and alpha: P = exp(s_block - m_new[:, None]); l_new = alpha * l + rowsum(P); "
        "acc_new = alpha[:, None] * acc + P @ v_block.",
    ],
    "tiled-forward": [
        "Two loops: the outer one over blocks of block_m query rows, the inner one over blocks of block_n keys "
        "(range(0, N, block) with slicing, so the last block may be shorter). Each query block starts with "
        "m = -inf, l = 0, acc = 0 and is finished (O and L written) before the next one starts.",
        "Inside the inner loop it is part 1's update on the tile S = Q_i K_j^T * scale, of shape (B, bq, bk). Part "
        "1's function is unbatched (m of shape (M,)): call it once per batch entry, or write its lines here with "
        "the batch dim in front (m and l of shape (B, bq), acc (B, bq, dv), [..., None] where part 1 has "
        "[:, None]). With causal, set S to -inf where key j > query i (compare absolute positions, not "
        "positions inside the tile), and stop the inner loop once the key block starts after the query block's "
        "last row.",
        "At the end of a query block: O_i = acc / l[..., None] and L_i = m + log(l). In the Function's forward, "
        "call tiled_attention_forward, ctx.save_for_backward(q, k, v, O, L), keep causal and the block sizes on "
        "ctx, and return O.",
    ],
    "flash-kernel-loop": [
        "Program (pid_m, pid_b) owns rows offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M) of batch entry pid_b. "
        "Build every pointer from the base pointer plus pid_b * stride_xb + rows * stride_xn + offs_d; load the "
        "Q tile once, masked with offs_m < N.",
        "Loop start_n over range(0, hi, BLOCK_N), hi = N, or with CAUSAL min((pid_m + 1) * BLOCK_M, N). Load K and "
        "V tiles masked at N (other=0.0), S = tl.dot(q, tl.trans(k), input_precision=\"ieee\") * scale, then "
        "tl.where(offs_n < N, S, -inf) and with CAUSAL tl.where(offs_n[None, :] <= offs_m[:, None], S, -inf).",
        "The online update as in part 1 with tl.maximum, tl.max(s, axis=1), tl.exp and tl.sum; "
        "acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=\"ieee\"). After the loop store acc / l_i[:, None] "
        "to O and m_i + tl.log(l_i) to L, both masked with offs_m < N.",
    ],
    "traffic-experiment": [
        "attnlab.memory.trace(fn, *args) runs fn with its kernels in Triton's interpreter and counts every load "
        "and store; here fn is flash_forward, which launches your kernel.",
        "Draw q, k, v of shape (1, n, 16) from torch.Generator().manual_seed(seed), and pass causal, block_m and "
        "block_n on to flash_forward.",
        "The trace's total_bytes is bytes_read + bytes_written, each access counted (a K tile read by two query "
        "blocks counts twice); return it as an int.",
    ],
    "tiled-backward": [
        "Compute D = rowsum(dO * O) once, for all rows, before any loop. Then loop over tiles (key blocks outside "
        "and query blocks inside, as FlashAttention-2's dK/dV kernel, is natural) and recompute the scores of "
        "each tile: S = Q_i K_j^T * scale.",
        "P_ij = exp(S_ij - L_i), with the causal mask applied as in the forward (P = 0 where j > i). Then "
        "dV_j += P^T dO_i and dP = dO_i V_j^T.",
        "dS = P * (dP - D_i[:, None]); dQ_i += dS K_j * scale; dK_j += dS^T Q_i * scale. Return exactly "
        "(dq, dk, dv), shaped like q, k, v: the grader calls tiled_attention_backward itself, with its own O and L.",
    ],
    "dkdv-kernel": [
        "One program per key block: load its K and V tiles once (masked at N), keep dk and dv accumulators of "
        "shape (BLOCK_N, HEAD_DIM) in float32, and loop over query blocks.",
        "Per query block load Q, dO (masked rows), L and D (masked, other=0.0); S = tl.dot(q, tl.trans(k)) * scale "
        "and P = tl.exp(S - L[:, None]), zeroed where the row or the key is past N, and with CAUSAL where "
        "key > query. With CAUSAL start the loop at (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M.",
        "dv += tl.dot(tl.trans(p), do); dP = tl.dot(do, tl.trans(v)); dS = P * (dP - D[:, None]); "
        "dk += tl.dot(tl.trans(ds), q). After the loop store dk * scale and dv, masked at N, with K's and V's "
        "strides.",
    ],
}
