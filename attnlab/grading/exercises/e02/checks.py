"""The checks of exercise 02_queries_keys_values (one ``@CHECKS(part id)`` per graded part)."""

import math

import torch

from attnlab.grading.core import Mistake, Registry, check_function, gen as _gen, randn as _randn
from attnlab.grading.exercises.e02 import spec as specs

CHECKS = Registry()


def _padding_cases():
    return [
        ("lengths [3, 1, 4], max_len 4", (torch.tensor([3, 1, 4]), 4), {}),
        ("lengths [0, 5], max_len 6", (torch.tensor([0, 5]), 6), {}),
        ("lengths [2], max_len 2", (torch.tensor([2]), 2), {}),
    ]


_PADDING_MISTAKES = [
    Mistake("off-by-one", "off by one: position j is real when j < length (not j <= length)",
            lambda lengths, max_len: torch.arange(max_len)[None, :] <= lengths[:, None]),
    Mistake("inverted", "the mask is inverted: True must mark real tokens, False padding",
            lambda lengths, max_len: torch.arange(max_len)[None, :] >= lengths[:, None]),
    Mistake("not-bool", "the mask should be a bool tensor (True = real token), not numbers",
            lambda lengths, max_len: specs.padding_mask(lengths, max_len).float()),
    Mistake("not-bool", "the mask should be a bool tensor (True = real token), not numbers",
            lambda lengths, max_len: specs.padding_mask(lengths, max_len).long()),
]


@CHECKS("padding-mask")
def _check_padding(ns):
    n = check_function(ns, "padding_mask", specs.padding_mask, _padding_cases(), _PADDING_MISTAKES)
    return f"{n} cases match the spec, including an empty sequence"


def _causal_cases():
    return [(f"n_q={a}, n_k={b}", (a, b), {}) for a, b in [(4, 4), (1, 1), (3, 5), (5, 3)]]


_CAUSAL_MISTAKES = [
    Mistake("off-by-one-diagonal", "the diagonal is masked: a query may attend to its own position (j <= i)",
            lambda n_q, n_k, device=None: torch.arange(n_k)[None, :] < torch.arange(n_q)[:, None]),
    Mistake("transposed", "the mask is transposed: query i may see keys j <= i, not j >= i",
            lambda n_q, n_k, device=None: torch.arange(n_k)[None, :] >= torch.arange(n_q)[:, None]),
    Mistake("bottom-right", "the mask is aligned bottom-right; this course (like PyTorch's is_causal) aligns it "
            "top-left: key j <= query i, whatever n_q and n_k",
            lambda n_q, n_k, device=None: torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)),
]


@CHECKS("causal-mask")
def _check_causal(ns):
    n = check_function(ns, "causal_mask", specs.causal_mask, _causal_cases(), _CAUSAL_MISTAKES)
    return f"{n} cases match the spec, square and rectangular"


def _attention_cases(with_masks=True):
    cases = []
    for seed, (b, h, nq, nk, d) in enumerate([(2, 3, 5, 7, 4), (1, 2, 6, 6, 8), (2, 1, 3, 9, 16)]):
        g = _gen(400 + seed)
        q, k, v = _randn(g, b, h, nq, d), _randn(g, b, h, nk, d), _randn(g, b, h, nk, d)
        cases.append((f"B={b}, H={h}, Nq={nq}, Nk={nk}, d={d}, no mask", (q, k, v), {}))
        if with_masks:
            pad = specs.padding_mask(torch.randint(1, nk + 1, (b,), generator=g), nk)[:, None, None, :]
            cases.append((f"B={b}, H={h}, Nq={nq}, Nk={nk}, d={d}, padding mask", (q, k, v), {"mask": pad}))
            cases.append((f"B={b}, H={h}, Nq={nq}, Nk={nk}, d={d}, causal mask", (q, k, v),
                          {"mask": specs.causal_mask(nq, nk)}))
    if with_masks:
        g = _gen(410)
        q, k, v = _randn(g, 1, 2, 4, 4), _randn(g, 1, 2, 4, 4), _randn(g, 1, 2, 4, 4)
        mask = torch.ones(1, 2, 4, 4, dtype=torch.bool)
        mask[0, 1, 2] = False  # one query with nothing to attend to
        cases.append(("a query row whose keys are all masked (must output zeros)", (q, k, v), {"mask": mask}))
    return cases


def _attn_with(*, scale=None, dim=-1, mask_mode="fill", softmax=None):
    def impl(q, k, v, mask=None):
        d = q.shape[-1]
        sc = 1.0 / math.sqrt(d) if scale is None else scale(d)
        s = q @ k.transpose(-2, -1) * sc
        if mask is not None and mask_mode == "fill":
            s = s.masked_fill(~mask, float("-inf"))
        elif mask is not None and mask_mode == "inverted":
            s = s.masked_fill(mask, float("-inf"))
        elif mask is not None and mask_mode == "zero":
            s = s * mask
        p = (softmax or torch.softmax)(s, dim=dim)
        if mask is not None and mask_mode == "after":
            p = p * mask
        return p @ v
    return impl


def _safe_softmax(s, dim=-1):
    return torch.nan_to_num(torch.softmax(s, dim=dim), nan=0.0)


def _both(key, message, **kwargs):
    """The mistake with a softmax that gives NaN on empty rows and with one that gives zeros."""
    return [Mistake(key, message, _attn_with(**kwargs)), Mistake(key, message, _attn_with(softmax=_safe_softmax, **kwargs))]


_MASKED_ATTENTION_MISTAKES = [
    *_both("mask-after-softmax", "the mask is applied after the softmax, so the kept weights no longer sum to 1: "
           "set masked scores to -inf before the softmax", mask_mode="after"),
    *_both("inverted-mask", "the mask is inverted: True means attend, so fill the scores where mask is False",
           mask_mode="inverted"),
    *_both("scale-forgotten", "the 1/sqrt(d) scale is forgotten", scale=lambda d: 1.0),
    *_both("wrong-axis", "the softmax runs over the wrong axis: normalise over the keys (dim=-1)", dim=-2),
    Mistake("mask-zero-fill", "masked scores are set to 0, which still gets weight exp(0): set them to -inf",
            _attn_with(mask_mode="zero")),
    Mistake("fully-masked-row", "a query with no key to attend to gives NaN (0/0): it should output zeros",
            _attn_with()),
]


@CHECKS("attention-masks")
def _check_masked_attention(ns):
    n = check_function(ns, "masked_attention", specs.masked_attention, _attention_cases(), _MASKED_ATTENTION_MISTAKES)
    return f"{n} cases match the spec (no mask, padding, causal, a fully masked row)"
