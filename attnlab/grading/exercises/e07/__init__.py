"""Exercise 07_flash_attention: its parts and what each may not call (layout: attnlab/grading/exercises/)."""

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
