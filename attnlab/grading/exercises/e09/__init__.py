"""Exercise 09_capstone: its parts, what each may not call, and its hints.

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part

EXERCISE = "09_capstone"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("capstone-sdpa", "your attention with SDPA's signature", 2, ("my_sdpa",)),
    Part("capstone-kernel", "a causal Triton forward kernel at the model's shape", 3, ("causal_attn_kernel",)),
    Part("capstone-train", "your kernel trains the GPT: the loss curve of SDPA's run", 2, ("train_gpt",)),
    Part("capstone-local-global", "experiment: local plus global against dense at equal steps", 2,
         ("local_vs_dense",), "experiment"),
    Part("capstone-explain", "explain: what the experiment says, and what it does not", 2, (), "manual"),
]

_TRAINING = ["attnlab.train.*"]   # the training loop is the learner's to write
# the model's attention backends by name (attnlab.models.gpt.BACKENDS): GPT(attention="sdpa") is torch's SDPA
_BACKENDS = [f'"{name}"' for name in ("sdpa", "reference", "flash", "standard", "block_sparse")]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "capstone-sdpa": SOFTMAX + ATTENTION,
    "capstone-kernel": SOFTMAX + ATTENTION,
    "capstone-train": SOFTMAX + ATTENTION + _TRAINING + _BACKENDS,
    "capstone-local-global": SOFTMAX + ATTENTION + BLOCK_MASKS + _TRAINING + _BACKENDS,
}

# part id -> library patterns it may use after all: the model is attnlab.models.gpt.GPT, built around the
# learner's attention (its backends by name are forbidden above; what attnlab.models imported, such as its
# F.scaled_dot_product_attention, is read as what it is)
ALLOWED = {
    "capstone-train": ["attnlab.models.*"],
    "capstone-local-global": ["attnlab.models.*"],
}

# part id -> {name: why}: what the answer must read (the syntax of its code, attnlab/grading/shortcuts.py)
REQUIRED = {  # "a|b": either name
    "capstone-train": {"kernel_attention|KernelAttention|kernel_forward|causal_attn_kernel":
                       "with attention=None the model trains through your Triton kernel (the given kernel_attention "
                       "wraps causal_attn_kernel): my_sdpa or a library attention there is not the part"},
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "capstone-sdpa": [
        "Start from the scores q @ k.transpose(-2, -1) * scale, shape (B, H, Nq, Nk); scale defaults to "
        "1 / sqrt(D), and a scale that is passed in replaces it.",
        "Build one bool `keep` mask (True = attend): the causal part is 'key j <= query i' (torch.ones(Nq, Nk)"
        ".tril(), top-left aligned even when Nq != Nk), ANDed with attn_mask when one is given. Masked scores "
        "become -inf before the softmax, never after it.",
        "The softmax by hand, stable: m = s.amax(-1, keepdim=True); e = torch.exp(s - m); "
        "w = e / e.sum(-1, keepdim=True); return w @ v. Autograd differentiates all of it; nothing else is needed "
        "for the gradients.",
    ],
    "capstone-kernel": [
        "One program owns BLOCK_M queries of one (batch x head) slice: pid_m = tl.program_id(0), "
        "pid_h = tl.program_id(1), base = pid_h * stride_h. Load its Q tile once, keep m_i, l_i and acc on chip, "
        "and store O once at the end (exercise 07's kernel is the starting point).",
        "Causal, two levels: the loop over key blocks stops at the diagonal (range(0, (pid_m + 1) * BLOCK_M, "
        "BLOCK_N): a key block entirely above it is never loaded, which is what the traffic budget checks), and "
        "inside the last blocks the element mask offs_n[None, :] <= offs_m[:, None] sets future scores to -inf.",
        "Inside the loop: load K and V tiles with mask=offs_n[:, None] < n_ctx, other=0.0; s = tl.dot(q, "
        "tl.trans(k)) * scale; s = tl.where(causal & in range, s, float('-inf')); then the online softmax: "
        "m_new = max(m_i, rowmax s), alpha = exp(m_i - m_new), p = exp(s - m_new), l_i = alpha * l_i + rowsum p, "
        "acc = alpha * acc + tl.dot(p, v). After the loop, acc / l_i[:, None], stored with the row mask.",
    ],
    "capstone-train": [
        "Build everything from `seed`: model = GPT(**TINY, attention=..., seed=seed) and one generator "
        "g = torch.Generator().manual_seed(seed) made once, before the loop, then corpus.batch('train', BATCH, "
        "SEQ, g) at each step.",
        "One step, in this order: forward (the model returns (logits, loss)), optimizer.zero_grad(), "
        "loss.backward(), torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP), optimizer.step(); record "
        "loss.item() of that forward.",
        "The optimizer is torch.optim.Adam(model.parameters(), lr=LR), made once. When `attention` is None, "
        "pass your kernel_attention; the function returns the list of `steps` losses.",
    ],
    "capstone-local-global": [
        "Two calls of your train_gpt from the same seed, the same steps: one with dense causal attention, one "
        "with the local-plus-global mask; both through your my_sdpa, so both run in PyTorch and fast.",
        "The mask, (SEQ, SEQ) bool, True = attend: key j is seen by query i when j <= i and (i - j < window or "
        "j < n_global). With window = 1 and n_global = 0 a query sees only itself.",
        "Wrap my_sdpa into the model's signature, e.g. def local(q, k, v, attn_mask=None, dropout_p=0.0, "
        "is_causal=False, scale=None): return my_sdpa(q, k, v, attn_mask=mask, is_causal=True); return "
        "(dense losses, local losses) in that order.",
    ],
}
