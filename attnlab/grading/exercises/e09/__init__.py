"""Exercise 09_capstone: its parts and what each may not call (read without torch by attnlab/grading/parts.py)."""

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

# part id -> library patterns it may use after all: the model, built around the learner's attention (what
# attnlab.models imported, such as its F.scaled_dot_product_attention, is read as what it is)
ALLOWED = {"capstone-train": ["attnlab.models.*"], "capstone-local-global": ["attnlab.models.*"]}

# part id -> {name ("a|b": either): why}: what the answer's code must read (attnlab/grading/shortcuts.py)
REQUIRED = {"capstone-train": {
    "kernel_attention|KernelAttention|kernel_forward|causal_attn_kernel": "with attention=None the model trains "
    "through your Triton kernel (kernel_attention wraps causal_attn_kernel), not my_sdpa or a library attention"}}
