"""Exercise 10_inference: its parts and what each may not call (read without torch by parts.py)."""

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

# a copy of the cache per query head is measured (decode-attention's peak memory), not read from the syntax, so
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
ALLOWED = {"decode-bytes": ["attnlab.memory.*", "attnlab.kernels.*"]}

# part id -> {name: why}: what the answer must read (the syntax of its code, attnlab/grading/shortcuts.py)
REQUIRED = {
    "decode-bytes": {"attnlab.memory.trace": "the part asks for the bytes traced from the decode kernel, trace("
                                             "flash_decode, ...), not the IO model's formula written out"},
}
