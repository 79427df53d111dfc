"""The checks of exercise 03_scaled_dot_product (one ``@CHECKS(part id)`` per graded part)."""

import math

import torch

from attnlab.grading.core import Mistake, Registry, check_function, gen as _gen, randn as _randn
from attnlab.grading.exercises.e01.checks import _naive_softmax
from attnlab.grading.exercises.e03 import spec as specs

CHECKS = Registry()


def _softmax_cases():
    g = _gen(500)
    rows = _randn(g, 3, 5)
    rows[1] -= 1000.0  # a row far below the others: a global max would underflow it
    return [
        ("x of shape (4, 6), dim=-1", (_randn(g, 4, 6),), {}),
        ("x of shape (2, 3, 5), dim=1", (_randn(g, 2, 3, 5),), {"dim": 1}),
        ("x of shape (5, 3), dim=0", (_randn(g, 5, 3),), {"dim": 0}),
        ("large logits (~1000): exp overflows without the max subtracted", (_randn(g, 3, 4, scale=1000.0),), {}),
        ("rows with very different offsets (one ~ -1000): subtract each row's own max", (rows,), {}),
    ]


_SOFTMAX_MISTAKES = [
    Mistake("no-max-subtraction", "exp overflows on large logits: subtract each row's max before exp", _naive_softmax),
    Mistake("wrong-axis", "the softmax ignores `dim` (it always normalises the last axis)",
            lambda x, dim=-1: torch.softmax(x, dim=-1)),
    Mistake("wrong-axis", "the softmax normalises over the wrong axis", lambda x, dim=-1: torch.softmax(x, dim=0)),
    Mistake("global-max", "the max is taken over the whole tensor, not each row: rows far below it underflow to 0/0",
            lambda x, dim=-1: torch.exp(x - x.max()) / torch.exp(x - x.max()).sum(dim=dim, keepdim=True)),
]


@CHECKS("stable-softmax")
def _check_softmax(ns):
    n = check_function(ns, "softmax", specs.softmax, _softmax_cases(), _SOFTMAX_MISTAKES)
    return f"{n} cases match the spec, including large logits and far-apart rows"


def _sdpa_cases():
    cases = []
    for seed, (b, h, nq, nk, d) in enumerate([(2, 2, 4, 6, 16), (1, 3, 5, 5, 64), (2, 1, 7, 3, 4)]):
        g = _gen(600 + seed)
        args = (_randn(g, b, h, nq, d), _randn(g, b, h, nk, d), _randn(g, b, h, nk, d))
        cases.append((f"B={b}, H={h}, Nq={nq}, Nk={nk}, d={d}", args, {}))
    g = _gen(610)
    args = (_randn(g, 1, 2, 4, 8), _randn(g, 1, 2, 5, 8), _randn(g, 1, 2, 5, 8))
    cases.append(("an explicit scale=0.3", args, {"scale": 0.3}))
    g = _gen(611)
    args = (_randn(g, 1, 1, 3, 16, scale=40.0), _randn(g, 1, 1, 4, 16, scale=40.0), _randn(g, 1, 1, 4, 16))
    cases.append(("large logits (scores ~ 1000s)", args, {}))
    return cases


def _sdpa_with(scale_fn, dim=-1, softmax=None, honour_scale=True):
    def impl(q, k, v, scale=None):
        sc = scale if (scale is not None and honour_scale) else scale_fn(q.shape[-1])
        return (softmax or torch.softmax)(q @ k.transpose(-2, -1) * sc, dim=dim) @ v
    return impl


_SDPA_MISTAKES = [
    Mistake("scale-forgotten", "the 1/sqrt(d) scale is forgotten", _sdpa_with(lambda d: 1.0)),
    Mistake("scale-one-over-d", "the scores are divided by d; the scale is 1/sqrt(d)", _sdpa_with(lambda d: 1.0 / d)),
    Mistake("wrong-axis", "the softmax runs over the wrong axis: normalise over the keys (dim=-1)",
            _sdpa_with(lambda d: d ** -0.5, dim=-2)),
    Mistake("scale-ignored", "an explicit `scale` argument is ignored", _sdpa_with(lambda d: d ** -0.5, honour_scale=False)),
    Mistake("no-max-subtraction", "exp overflows on large logits: use a softmax that subtracts the max",
            _sdpa_with(lambda d: d ** -0.5, softmax=_naive_softmax)),
]


@CHECKS("scaled-attention")
def _check_sdpa(ns):
    n = check_function(ns, "scaled_dot_product_attention", specs.scaled_dot_product_attention, _sdpa_cases(),
                       _SDPA_MISTAKES)
    return f"{n} cases match the spec, with an explicit scale and large logits"


def _variance_cases():
    cases = []
    for seed, (n, d) in enumerate([(256, 64), (100, 16), (50, 512)]):
        g = _gen(700 + seed)
        cases.append((f"n={n} pairs, d={d}", (_randn(g, n, d), _randn(g, n, d)), {}))
    return cases


def _raw(q, k):
    return (q * k).sum(-1)


_VARIANCE_MISTAKES = [
    Mistake("divided-by-d", "the scaled scores are divided by d; divide by sqrt(d)",
            lambda q, k: torch.stack([_raw(q, k).var(), (_raw(q, k) / q.shape[-1]).var()])),
    Mistake("std-not-var", "these are standard deviations; the experiment measures variances",
            lambda q, k: torch.stack([_raw(q, k).std(), (_raw(q, k) / math.sqrt(q.shape[-1])).std()])),
    Mistake("all-pairs", "the scores of all pairs (q @ k.T) are used; pair row i of q with row i of k",
            lambda q, k: torch.stack([(q @ k.T).var(), (q @ k.T / math.sqrt(q.shape[-1])).var()])),
    Mistake("biased-variance", "use torch.var's default (unbiased) estimator",
            lambda q, k: torch.stack([_raw(q, k).var(unbiased=False),
                                      (_raw(q, k) / math.sqrt(q.shape[-1])).var(unbiased=False)])),
]


@CHECKS("variance-experiment")
def _check_variance(ns):
    n = check_function(ns, "score_variance", specs.score_variance, _variance_cases(), _VARIANCE_MISTAKES)
    return f"{n} cases match the spec"
