"""Exercise 09_capstone: its parts and what each may not call (its hints: attnlab/course/hints/).

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
