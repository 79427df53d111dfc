"""Exercise 10_inference: its parts, what each may not call, and its hints.

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.
"""

from attnlab.grading.exercises import ATTENTION, SOFTMAX, Part

EXERCISE = "10_inference"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("decode-cost", "what a decoding step reads: the weights once, each sequence's cache; where the two cross", 2,
         ("decode_step_bytes", "crossover_tokens")),
    Part("decode-attention", "decoding attention over a cache: ragged lengths, new queries, shared KV heads", 3,
         ("decode_attention",)),
    Part("split-partials", "split-K: one chunk of keys, its partial output and log-sum-exp", 2, ("split_partials",)),
    Part("split-merge", "merging the splits: lesson 07's rescaling", 2, ("merge_splits",)),
    Part("paged-gather", "a sequence out of a paged cache through its block table", 2, ("gather_sequence",)),
    Part("latent-decode", "multi-head latent attention decoded absorbed: exact, reading only the latent cache", 3,
         ("latent_decode",)),
    Part("decode-bytes", "experiment: traced bytes per token against context length for MHA, GQA, MQA", 1,
         ("decode_bytes",), "experiment"),
    Part("decode-explain", "explain: why decoding is bound by bandwidth, and what GQA changes", 1, (), "manual"),
]

# the library's cache and kernels; a copy of the cache per query head (repeat_interleave of the cache, torch.cat, an
# index) is not read from the syntax but measured (the peak-memory check of decode-attention), so that
# torch.arange(H_kv).repeat_interleave(G), a map of heads, is fine
_REFERENCES = ["attnlab.kvcache.*", "attnlab.kernels.*"]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    # the library's cost model is the reference: decode_step_bytes, decode_crossover_tokens, kv_cache_bytes
    "decode-cost": ["attnlab.iomodel.*"],
    "decode-attention": SOFTMAX + ATTENTION + _REFERENCES,
    "split-partials": SOFTMAX + ATTENTION + ["torch.logsumexp", "torch.Tensor.logsumexp"],
    "split-merge": SOFTMAX + ATTENTION + ["torch.logsumexp", "torch.Tensor.logsumexp"],
    "paged-gather": ["attnlab.kvcache.*"],
    # the library's MLA decodes absorbed and unabsorbed; the decoding attention it calls is the kvcache's
    "latent-decode": SOFTMAX + ATTENTION + _REFERENCES + ["attnlab.mla.*"],
    "decode-bytes": ["attnlab.iomodel.*"],
}

# part id -> library patterns it may use after all: the experiment traces the course's own decode kernel
ALLOWED = {
    "decode-bytes": ["attnlab.memory.*", "attnlab.kernels.*"],
}

# part id -> {name: why}: what the answer must read (the syntax of its code, attnlab/grading/shortcuts.py)
REQUIRED = {
    "decode-bytes": {"attnlab.memory.trace": "the part asks for the bytes traced from the decode kernel, "
                                             "trace(flash_decode, ...): the IO model's formula written out is not the "
                                             "measurement"},
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "decode-cost": [
        "Two reads make a step. Which of them does the batch share, and which does every sequence bring with it? "
        "Write each as a count of numbers first, then turn numbers into bytes.",
        "One token's entry in the cache: every layer keeps something for it, in every KV head, d numbers wide; "
        "count everything that is stored per token and layer (what does attention read besides the keys?).",
        "The crossover is a number of cached tokens, summed over the batch: set the caches' read, written as "
        "(tokens) x (bytes per token), equal to the weights' read and solve for the tokens. Look at what happens "
        "to bytes_per_element.",
    ],
    "decode-attention": [
        "Work one sequence b at a time: L = int(cache_seqlens[b]); its keys are k_cache[b, :, :L] (H_kv, L, D). "
        "Positions past L are padding: never let a query see them.",
        "Query head h reads KV head h // G with G = H_q // H_kv (consecutive query heads share one KV head); "
        "index it, e.g. k_cache[b, h // G, :L], instead of copying the cache.",
        "Query i of the Nq new ones sits at position L - Nq + i and sees keys 0 .. L - Nq + i: the mask is "
        "torch.arange(L)[None, :] <= (L - Nq + torch.arange(Nq))[:, None]; masked scores become -inf before "
        "your own stable softmax (subtract each row's max, exp, divide by the sum).",
    ],
    "split-partials": [
        "chunk = ceil(N / num_splits) keys per split: split s covers keys [s * chunk, min((s + 1) * chunk, N)); "
        "the last splits may be shorter, or empty when num_splits * chunk - N >= chunk.",
        "For one split: s = q @ k_s^T * scale (B, H, 1, n_s); m = the row max; p = exp(s - m); the partial "
        "output is (p @ v_s) / p.sum(-1, keepdim=True), normalised over its own keys only.",
        "Its log-sum-exp is m + log(p.sum(-1)), computed from the shifted sum so that it never overflows. An "
        "empty split has output 0 and log-sum-exp -inf. Stack along a new dim 2: (B, H, S, Nq, D) and (B, H, S, Nq).",
    ],
    "split-merge": [
        "A split's softmax mass is exp(lse_s): the full output weighs each partial o_s by its share of the total "
        "mass, o = sum_s exp(lse_s) o_s / sum_s exp(lse_s).",
        "Never take exp(lse) directly (lse can be in the hundreds): subtract M = max over the splits (dim 2, "
        "keepdim=True) first; the factor exp(-M) cancels between the numerator and the denominator.",
        "An empty split has lse = -inf: exp(-inf - M) = 0, so it drops out by itself, as long as M is finite "
        "(at least one split is not empty). Sum over dim 2 and keep o's dtype.",
    ],
    "paged-gather": [
        "Key n of sequence b lives in page block_table[b, n // page_size], at row n % page_size of that page, "
        "with page_size = pool.shape[2].",
        "The sequence uses ceil(length / page_size) pages: pages = block_table[b, :n_pages].long(); pool[pages] "
        "has shape (n_pages, H_kv, page_size, D).",
        "The answer is heads first, (H_kv, length, D), while the gathered pages are pages first: reorder the "
        "dimensions so that one head's pages lie next to each other before merging the pages with their rows, "
        "then keep only the positions the sequence has (the last page may be partly empty).",
    ],
    "latent-decode": [
        "Head i's key is [W_UK_i c_j ; k_rope_j], so its nope score is q_nope_i . (W_UK_i c_j) = (W_UK_i^T q_nope_i) "
        ". c_j: one small product per head on the query side, q_lat = torch.einsum('bhd,hdc->bhc', q_nope, w_uk), "
        "(B, H, d_latent), and the cache c is never multiplied by W_UK.",
        "Scores (B, H, L): q_lat against c plus q_rope against k_rope (both shared by every head: multi-query "
        "attention with one 'KV head'), times scale, 1/sqrt(d_h + d_rope) when none is given (the width of the "
        "unabsorbed key, not of the absorbed query); your own stable softmax over the L positions.",
        "The values are the latents too: first the weighted sum of the cache, p @ c per head, (B, H, d_latent); "
        "then each head's W_UV_i on that one vector (an einsum over d_latent). Never form W_UV_i c_j for every "
        "position j: that is the per-head V the latent cache exists to avoid.",
    ],
    "decode-bytes": [
        "For each kv_heads and each L, build one step: q (1, heads, 1, d), k and v caches (1, kv_heads, L, d), "
        "float16, cache_seqlens = torch.tensor([L], dtype=torch.int32).",
        "Count what the decode kernel (attnlab.kernels.flash_decode) moves with attnlab.memory.trace, which "
        "takes a function and its arguments and records every load and store; fix the kernel's number of splits "
        "to one, so that the count does not depend on the machine's core count.",
        "A step's traffic is what it reads and what it writes; one row per kv_heads, one column per L: an int64 "
        "tensor of shape (len(kv_heads_list), len(contexts)).",
    ],
}
