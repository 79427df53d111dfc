"""Exercise 04 (multi-head attention): wrong implementations fail their check with the matching diagnosis."""

import math

import torch

from attnlab.grading.exercises.e04 import spec as specs
from mistakes import Wrong

WRONG = Wrong()


WRONG.add("split-heads", "heads-order", split_heads=lambda x, h: x.view(x.shape[0], h, x.shape[1], -1))
WRONG.add("split-heads", "interleaved-heads",
      split_heads=lambda x, h: x.view(x.shape[0], x.shape[1], -1, h).permute(0, 3, 1, 2))
WRONG.add("split-heads", "no-transpose", split_heads=lambda x, h: x.view(x.shape[0], x.shape[1], h, -1))

WRONG.add("merge-heads", "heads-order", merge_heads=lambda x: x.reshape(x.shape[0], x.shape[2], -1))
WRONG.add("merge-heads", "interleaved-heads",
      merge_heads=lambda x: x.permute(0, 2, 3, 1).reshape(x.shape[0], x.shape[2], -1))
WRONG.add("merge-heads", "summed-heads", merge_heads=lambda x: x.sum(1))


def _mha(scale_dim="head", merge_ok=True, out_proj=True, causal_ok=True):
    def multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads, causal=False):
        b, n, d = x.shape
        q, k, v = (specs.split_heads(x @ w.T, num_heads) for w in (w_q, w_k, w_v))
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1] if scale_dim == "head" else d)
        if causal and causal_ok:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.softmax(s, -1) @ v
        o = o.transpose(1, 2).reshape(b, n, d) if merge_ok else o.reshape(b, n, d)
        return o @ w_o.T if out_proj else o
    return multi_head_attention


WRONG.add("mha-forward", "scale-d-model", multi_head_attention=_mha(scale_dim="model"))
WRONG.add("mha-forward", "heads-order", multi_head_attention=_mha(merge_ok=False))
WRONG.add("mha-forward", "no-output-projection", multi_head_attention=_mha(out_proj=False))
WRONG.add("mha-forward", "causal-ignored", multi_head_attention=_mha(causal_ok=False))


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()
