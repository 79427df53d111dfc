"""Triton kernels of the course, shipped as ``attnlab.kernels``.

Each file reads like one of Triton's tutorials: what you learn, the naive version with its
memory traffic counted, the kernel with its traffic counted, the launching wrapper.

* ``vector_add.py``: the first kernel (programs, blocks, pointers, masks).
* ``tutorial_softmax.py``: fused row softmax at the size of Triton's tutorial, one row per program.
* ``softmax.py``: the fused row softmax the course ships (rows per program, two passes for long rows).
* ``standard_attention.py``: unfused attention (S, softmax, PV) and its backward.
* ``flash_steps.py``: FlashAttention built in steps: (a) the loop, (b) boundary masks, (c) causal
  block skipping, and a minimal backward (dK/dV and dQ kernels).
* ``flash_attention.py``: FlashAttention-2 forward and backward, as shipped.
* ``block_mask.py`` (``create_block_mask`` from ``attnlab.mask_mods``) and ``block_sparse_attention.py``:
  block-sparse FlashAttention with full and partial blocks, as FlexAttention.
* ``selected_attention.py``: attention over the key blocks a learned selector chose per query block
  (NSA's selection, DeepSeek Sparse Attention), with ``attnlab.sparse`` as its reference side.
* ``flash_decode.py``: decoding against a KV cache, split over the keys (Flash-Decoding), GQA, paged.
* ``delta_rule.py``: the gated delta rule (linear attention's state, corrected and decayed), chunkwise.

On CUDA tensors the kernels run compiled; on CPU tensors they run in Triton's interpreter
from the same source, with nothing to set (see ``_runtime.py``).

Example::

    from attnlab.kernels import flash_attention
    o = flash_attention(q, k, v, causal=True)
"""

from .block_mask import (
    BlockMask,
    causal_block_mask,
    create_block_mask,
    full_mask,
    global_mask,
    intersection,
    local_mask,
    random_mask,
    strided_mask,
    union,
)
from .block_sparse_attention import block_sparse_attention
from .delta_rule import chunked_delta_rule
from .flash_attention import flash_attention
from .flash_decode import flash_decode
from .selected_attention import selected_attention
from .softmax import softmax
from .standard_attention import standard_attention
from .vector_add import vector_add

__all__ = [
    "softmax", "standard_attention", "flash_attention", "flash_decode", "block_sparse_attention", "selected_attention", "BlockMask",
    "create_block_mask",
    "local_mask", "strided_mask", "global_mask", "causal_block_mask", "random_mask", "full_mask",
    "union", "intersection", "vector_add", "chunked_delta_rule",
]
