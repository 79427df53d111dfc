"""Exercise 03_scaled_dot_product: its parts and what each may not call (layout: attnlab/grading/exercises/)."""

from attnlab.grading.exercises import ATTENTION, AUTOGRAD, SOFTMAX, Part

EXERCISE = "03_scaled_dot_product"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("stable-softmax", "a numerically stable softmax", 2, ('softmax',)),
    Part("softmax-backward", "the softmax's backward pass by hand", 3, ('softmax_backward',)),
    Part("scaled-attention", "scaled dot-product attention", 2, ('scaled_dot_product_attention',)),
    Part("variance-experiment", "the experiment: the variance of q . k", 1, ('score_variance',), "experiment"),
    Part("saturation-explained", "why unscaled scores stop learning", 1, (), "manual"),
]

# what would compute a gradient for the learner: autograd in any of its forms, and PyTorch's own softmax backward
GRADIENTS = AUTOGRAD + ["torch.autograd.functional.*", "torch.func.vjp", "torch.func.grad", "torch.func.jacrev",
                        "torch.func.jacfwd", "torch.func.grad_and_value", "torch._softmax_backward_data"]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "stable-softmax": SOFTMAX,
    "softmax-backward": SOFTMAX + GRADIENTS,
    "scaled-attention": SOFTMAX + ATTENTION,
}
