"""The exercises, one package each: ``eNN/__init__.py`` (parts, forbidden calls; light), ``eNN/spec.py`` (the
references) and ``eNN/checks.py`` (the checks).

A part is one of three kinds:

- ``auto``: graded by ``attnlab grade`` against the references;
- ``experiment``: also graded automatically: the learner runs an experiment with their own code and the grader
  reproduces the measured quantity within a tolerance;
- ``manual``: a short written answer in an nbgrader manually graded cell (a markdown cell holding ``<!-- manual:
  PART-ID -->`` and a solution region), reported as ``manual`` and never auto-scored.

To add an exercise: a package here, its name in ``PACKAGES`` and in pyproject.toml's packages, and
``solutions/NN_name.ipynb``. The packages share one layout on purpose: their part tables and known-mistake tables
(``Mistake(key, message, wrong version of the reference)``) look alike from one exercise to the next, and each row
is that exercise's own.
"""

from collections import namedtuple

Part = namedtuple("Part", "id title points names kind", defaults=((), "auto"))
KINDS = ("auto", "experiment", "manual")

# in course order; each is attnlab.grading.exercises.<package>
PACKAGES = ["e01", "e02", "e03", "e04", "e05", "e06", "e07", "e08", "e09", "e10", "e11", "e12"]

# groups of what an answer may not call ("pkg.*": every function and class of pkg and its submodules;
# "Class.method": one method)
SOFTMAX = ["torch.softmax", "torch.Tensor.softmax", "torch.nn.functional.softmax", "torch.special.softmax",
           "torch.nn.Softmax.forward", "torch.log_softmax", "torch.Tensor.log_softmax",
           "torch.nn.functional.log_softmax", "torch.nn.functional.softmin", "torch.nn.Softmin.forward",
           "torch.nn.LogSoftmax.forward", "torch.nn.Softmax2d.forward", "torch.special.log_softmax",
           "torch.sparse.softmax", "torch.sparse.log_softmax", "torch._safe_softmax"]
ATTENTION = ["torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional.multi_head_attention_forward",
             "torch.nn.MultiheadAttention.forward", "torch.nn.attention.flex_attention.flex_attention",
             # the operators behind SDPA, and the modules that hold a MultiheadAttention
             "torch._scaled_dot_product_attention_math", "torch._scaled_dot_product_flash_attention",
             "torch._scaled_dot_product_flash_attention_for_cpu", "torch._scaled_dot_product_efficient_attention",
             "torch._scaled_dot_product_cudnn_attention", "torch._fused_sdp_choice",
             "torch.nn.Transformer.forward", "torch.nn.TransformerEncoderLayer.forward",
             "torch.nn.TransformerDecoderLayer.forward", "torch.nn.TransformerEncoder.forward",
             "torch.nn.TransformerDecoder.forward"]
BLOCK_MASKS = ["torch.nn.attention.flex_attention.create_block_mask", "torch.nn.attention.flex_attention.create_mask"]
AUTOGRAD = ["torch.autograd.grad", "torch.Tensor.backward", "torch.autograd.backward", "torch.func.*",
            "torch.autograd.functional.*", "torch._functorch.*"]
