"""The checks of exercise 04_multi_head (one ``@CHECKS(part id)`` per graded part)."""

import math

import torch

from attnlab.grading.core import Mistake, Registry, check_function, gen as _gen, randn as _randn
from attnlab.grading.exercises.e04 import spec as specs
from attnlab.grading.exercises.e02.spec import causal_mask

CHECKS = Registry()


def _split_cases():
    cases = []
    for seed, (b, n, d, h) in enumerate([(2, 5, 12, 3), (1, 4, 8, 2), (3, 6, 16, 4)]):
        g = _gen(800 + seed)
        cases.append((f"x of shape ({b}, {n}, {d}), {h} heads", (_randn(g, b, n, d), h), {}))
    return cases


_SPLIT_MISTAKES = [
    Mistake("heads-order", "reshaped straight to (B, h, N, dh): view as (B, N, h, dh) first, then swap N and h",
            lambda x, h: x.reshape(x.shape[0], h, x.shape[1], x.shape[2] // h)),
    Mistake("interleaved-heads", "the heads are interleaved: head i must hold the contiguous features "
            "[i*dh, (i+1)*dh), i.e. view as (B, N, h, dh), not (B, N, dh, h)",
            lambda x, h: x.reshape(x.shape[0], x.shape[1], x.shape[2] // h, h).permute(0, 3, 1, 2)),
    Mistake("transposed", "the last two dims are swapped: the result is (B, h, N, dh)",
            lambda x, h: x.reshape(x.shape[0], x.shape[1], h, x.shape[2] // h).permute(0, 2, 3, 1)),
    Mistake("no-transpose", "the heads axis must come second: (B, N, h, dh) -> (B, h, N, dh)",
            lambda x, h: x.reshape(x.shape[0], x.shape[1], h, x.shape[2] // h)),
]


@CHECKS("split-heads")
def _check_split(ns):
    n = check_function(ns, "split_heads", specs.split_heads, _split_cases(), _SPLIT_MISTAKES, rtol=0, atol=0)
    return f"{n} cases match the spec"


def _merge_cases():
    cases = []
    for seed, (b, h, n, dh) in enumerate([(2, 3, 5, 4), (1, 2, 4, 4), (3, 4, 6, 2)]):
        g = _gen(900 + seed)
        cases.append((f"x of shape ({b}, {h}, {n}, {dh})", (_randn(g, b, h, n, dh),), {}))
    return cases


_MERGE_MISTAKES = [
    Mistake("heads-order", "heads merged in the wrong order: swap h and N back before reshaping to (B, N, h*dh)",
            lambda x: x.reshape(x.shape[0], x.shape[2], x.shape[1] * x.shape[3])),
    Mistake("interleaved-heads", "the heads are interleaved: concatenate head 0's dh features, then head 1's, ...",
            lambda x: x.permute(0, 2, 3, 1).reshape(x.shape[0], x.shape[2], x.shape[1] * x.shape[3])),
    Mistake("summed-heads", "the heads are summed; they are concatenated",
            lambda x: x.sum(dim=1)),
    Mistake("heads-order", "heads merged in the wrong order", lambda x: x.flip(1).transpose(1, 2).reshape(
        x.shape[0], x.shape[2], x.shape[1] * x.shape[3])),
]


@CHECKS("merge-heads")
def _check_merge(ns):
    n = check_function(ns, "merge_heads", specs.merge_heads, _merge_cases(), _MERGE_MISTAKES, rtol=0, atol=0)
    return f"{n} cases match the spec"


def _mha_cases():
    cases = []
    for seed, (b, n, d, h, causal) in enumerate([(2, 5, 12, 3, False), (1, 6, 16, 4, True), (2, 4, 8, 2, True)]):
        g = _gen(1000 + seed)
        ws = [_randn(g, d, d, scale=d ** -0.5) for _ in range(4)]
        cases.append((f"x of shape ({b}, {n}, {d}), {h} heads, causal={causal}",
                      (_randn(g, b, n, d), *ws, h), {"causal": causal}))
    return cases


def _mha_with(*, scale_dim="head", merge=specs.merge_heads, out_proj=True, honour_causal=True):
    def impl(x, w_q, w_k, w_v, w_o, num_heads, causal=False):
        q, k, v = (specs.split_heads(x @ w.T, num_heads) for w in (w_q, w_k, w_v))
        d = q.shape[-1] if scale_dim == "head" else (x.shape[-1] if scale_dim == "model" else 1)
        s = q @ k.transpose(-2, -1) / math.sqrt(d)
        if causal and honour_causal:
            s = s.masked_fill(~causal_mask(x.shape[1], x.shape[1]), float("-inf"))
        o = merge(torch.softmax(s, dim=-1) @ v)
        return o @ w_o.T if out_proj else o
    return impl


_MHA_MISTAKES = [
    Mistake("scale-d-model", "the scale uses d_model; each head scales by 1/sqrt(d_head)", _mha_with(scale_dim="model")),
    Mistake("scale-forgotten", "the 1/sqrt(d_head) scale is forgotten", _mha_with(scale_dim="none")),
    Mistake("heads-order", "heads merged in the wrong order: (B, h, N, dh) -> transpose(1, 2) -> (B, N, h*dh)",
            _mha_with(merge=lambda o: o.reshape(o.shape[0], o.shape[2], -1))),
    Mistake("no-output-projection", "the output projection W_o is missing", _mha_with(out_proj=False)),
    Mistake("causal-ignored", "causal=True is ignored: mask out keys after the query", _mha_with(honour_causal=False)),
]


@CHECKS("mha-forward")
def _check_mha(ns):
    n = check_function(ns, "multi_head_attention", specs.multi_head_attention, _mha_cases(), _MHA_MISTAKES)
    return f"{n} cases match the spec, causal and not"
