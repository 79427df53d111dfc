"""The checks of exercise 03_scaled_dot_product: one table per graded part (:mod:`attnlab.grading.engine`), in
``TABLES``."""

import math

import torch

from attnlab.grading.core import (Fail, Mistake, diagnose, gen as _gen, learner_of, mismatch, present,
                                  randn as _randn, salted_ints, value_of)
from attnlab.grading.engine import Function, InTurn, Measured
from attnlab.grading.exercises.e03 import spec as specs


def _naive_softmax(x, dim=-1):
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def _float32_then_float16(name, reference, cases, fp16_cases, mistakes, rtol, atol, says):
    """A part of one function whose float16 cases need a looser tolerance (``rtol``/``atol``): two tables in turn."""
    return InTurn(says, (Function(name, reference, cases, mistakes),
                         Function(name, reference, fp16_cases, mistakes, rtol=rtol, atol=atol)))


# ----------------------------------------------------------------------------- stable-softmax

def _softmax_cases():
    g = _gen(500)
    rows = _randn(g, 3, 5)
    rows[1] -= 1000.0  # a row far below the others: a global max would underflow it
    masked = _randn(g, 3, 6)
    masked[0, 2:] = float("-inf")
    masked[2, 0] = float("-inf")
    return [
        ("x of shape (5, 5), dim=-1 (square)", (_randn(g, 5, 5),), {}),
        ("x of shape (4, 6), dim=-1", (_randn(g, 4, 6),), {}),
        ("x of shape (2, 3, 5), dim=1", (_randn(g, 2, 3, 5),), {"dim": 1}),
        ("x of shape (5, 3), dim=0", (_randn(g, 5, 3),), {"dim": 0}),
        ("large logits (~1000): exp overflows without the max subtracted", (_randn(g, 3, 4, scale=1000.0),), {}),
        ("rows with very different offsets (one ~ -1000): subtract each row's own max", (rows,), {}),
        ("rows with -inf entries (masked scores): their weights are 0", (masked,), {}),
    ]


def _fp16_cases():
    g = _gen(501)
    x = _randn(g, 4, 8, scale=4.0)
    x[:, 0] = 15.0  # exp(15) = 3.3e6 > 65504, the largest float16
    return [("float16 x of shape (4, 8) with logits up to 15 (exp(15) overflows float16)", (x.half(),), {})]


def _keepdim_lost(sum_too):
    def impl(x, dim=-1):
        e = torch.exp(x - x.amax(dim=dim))  # (.., no dim ..) broadcasts against the wrong axis
        return e / (e.sum(dim=dim) if sum_too else e.sum(dim=dim, keepdim=True))
    return impl


_SOFTMAX_MISTAKES = [
    Mistake("no-max-subtraction", "exp overflows on large logits: subtract each row's max before exp", _naive_softmax),
    Mistake("wrong-axis", "the softmax ignores `dim` (it always normalises the last axis)",
            lambda x, dim=-1: specs.softmax(x, dim=-1)),
    Mistake("wrong-axis", "the softmax normalises over the wrong axis", lambda x, dim=-1: specs.softmax(x, dim=0)),
    Mistake("global-max", "the max is taken over the whole tensor, not each row: rows far below it underflow to 0/0",
            lambda x, dim=-1: torch.exp(x - x.max()) / torch.exp(x - x.max()).sum(dim=dim, keepdim=True)),
    *[Mistake("missing-keepdim", "a reduction lost its axis: use keepdim=True in amax and sum so that the result "
              "broadcasts along `dim`", _keepdim_lost(sum_too)) for sum_too in (False, True)],
    Mistake("mean-not-max", "the mean is subtracted: exp still overflows when one logit is far above the mean; "
            "subtract the max", lambda x, dim=-1: _naive_softmax(x - x.mean(dim=dim, keepdim=True), dim)),
    Mistake("max-wrong-axis", "the max is taken along the last axis but the sum along `dim`: take both along `dim`",
            lambda x, dim=-1: _naive_softmax(x - x.amax(dim=-1, keepdim=True), dim)),
]


# ----------------------------------------------------------------------------- softmax-backward

def _backward_cases():
    cases = []
    g = _gen(550)
    for label, shape, dim, spread in [
            ("(5, 5), dim=-1 (square)", (5, 5), -1, 1.0),
            ("(4, 6), dim=-1", (4, 6), -1, 1.0),
            ("(2, 3, 5), dim=1", (2, 3, 5), 1, 1.0),
            ("(2, 2, 3, 7), dim=-1: attention weights (B, H, Nq, Nk)", (2, 2, 3, 7), -1, 2.0),
            ("(5, 3), dim=0", (5, 3), 0, 1.0),
            ("(3, 8), dim=-1, saturated rows (scores ~30: p nearly one-hot)", (3, 8), -1, 30.0)]:
        p = specs.softmax(_randn(g, *shape, scale=spread), dim=dim)
        dp = _randn(g, *shape)
        cases.append((f"p and dp of shape {label}", (p, dp), {} if dim == -1 else {"dim": dim}))
    return cases


def _rowsum(x, dim):
    return x.sum(dim=dim, keepdim=True)


_BACKWARD_MISTAKES = [
    Mistake("missing-rowsum", "only the diagonal term p * dp: the softmax couples every entry of a row, subtract "
            "each row's sum of dp * p (ds = p * (dp - rowsum(dp * p)))", lambda p, dp, dim=-1: p * dp),
    Mistake("diagonal-only", "this is p (1 - p) dp, the Jacobian's diagonal alone: the off-diagonal entries "
            "-p_i p_j also carry gradient", lambda p, dp, dim=-1: p * (1 - p) * dp),
    Mistake("unweighted-rowsum", "the row sum must weight dp by p: rowsum(dp * p), not rowsum(dp)",
            lambda p, dp, dim=-1: p * (dp - _rowsum(dp, dim))),
    Mistake("missing-p-factor", "the whole bracket is multiplied by p: ds = p * (dp - rowsum(dp * p))",
            lambda p, dp, dim=-1: dp - _rowsum(dp * p, dim)),
    Mistake("wrong-sign", "the sign is flipped: ds = p * (dp - rowsum(dp * p))",
            lambda p, dp, dim=-1: p * (_rowsum(dp * p, dim) - dp)),
    Mistake("wrong-axis", "the row sum ignores `dim` (it always sums the last axis)",
            lambda p, dp, dim=-1: p * (dp - _rowsum(dp * p, -1))),
    Mistake("missing-keepdim", "the row sum lost its axis: use keepdim=True so that it broadcasts along `dim`",
            lambda p, dp, dim=-1: p * (dp - (dp * p).sum(dim=dim))),
]


# ----------------------------------------------------------------------------- scaled-attention

def _qkv(g, b, h, nq, nk, d, dv, scale=1.0):
    """q (B, H, Nq, d), k (B, H, Nk, d), v (B, H, Nk, dv), drawn from ``g`` in that order; ``scale`` multiplies q
    and k."""
    return _randn(g, b, h, nq, d, scale=scale), _randn(g, b, h, nk, d, scale=scale), _randn(g, b, h, nk, dv)


def _sdpa_cases():
    shapes = [(2, 2, 4, 6, 16, 8), (1, 3, 5, 5, 64, 64), (2, 1, 7, 3, 4, 4)]
    return [(f"B={b}, H={h}, Nq={nq}, Nk={nk}, d={d}, dv={dv}", _qkv(_gen(600 + seed), b, h, nq, nk, d, dv), {})
            for seed, (b, h, nq, nk, d, dv) in enumerate(shapes)] + [
        ("an explicit scale=0.3", _qkv(_gen(610), 1, 2, 4, 5, 8, 8), {"scale": 0.3}),
        ("large logits (scores ~ 1000s)", _qkv(_gen(611), 1, 1, 3, 4, 16, 16, scale=40.0), {})]


def _fp16_sdpa_cases():
    return [("float16 q, k, v (B=1, H=2, Nq=4, Nk=6, d=16, dv=8), scores up to ~30: exp overflows float16 above 11",
             tuple(a.half() for a in _qkv(_gen(612), 1, 2, 4, 6, 16, 8, scale=3.0)), {})]


def _sdpa_with(scale_fn=lambda d, dv: d ** -0.5, dim=-1, softmax=torch.softmax, honour_scale=True, outside=False):
    """The spec with one thing changed (a known mistake); ``scale_fn(d, dv)``: the scale when none is given."""
    def impl(q, k, v, scale=None):
        sc = scale if (scale is not None and honour_scale) else scale_fn(q.shape[-1], v.shape[-1])
        if outside:
            return softmax(q @ k.transpose(-2, -1), dim=dim) @ v * sc
        return softmax(q @ k.transpose(-2, -1) * sc, dim=dim) @ v
    return impl


_SDPA_MISTAKES = [
    Mistake("scale-forgotten", "the 1/sqrt(d) scale is forgotten", _sdpa_with(lambda d, dv: 1.0)),
    Mistake("scale-one-over-d", "the scores are divided by d; the scale is 1/sqrt(d)", _sdpa_with(lambda d, dv: 1 / d)),
    Mistake("scale-uses-dv", "the scale uses v's dimension; it is 1/sqrt(d) with d the dimension of q and k "
            "(q.shape[-1])", _sdpa_with(lambda d, dv: dv ** -0.5)),
    Mistake("scale-outside-softmax", "the scale multiplies the output; it divides the scores, inside the softmax",
            _sdpa_with(outside=True)),
    Mistake("wrong-axis", "the softmax runs over the wrong axis: normalise over the keys (dim=-1)", _sdpa_with(dim=-2)),
    Mistake("scale-ignored", "an explicit `scale` argument is ignored", _sdpa_with(honour_scale=False)),
    Mistake("no-max-subtraction", "exp overflows on large logits: use a softmax that subtracts the max",
            _sdpa_with(softmax=_naive_softmax)),
]


# ----------------------------------------------------------------------------- variance-experiment

RTOL = 1e-5   # the grader's run of the same recipe on the same draws: only round-off may differ


def _sizes():
    """dims and n_pairs from the grader's secret salt: a table of numbers written in advance (the textbook's d
    and 1 included) cannot match a run the notebook never saw."""
    *dims, n_pairs = salted_ints(700, (2, 12), (13, 60), (61, 250), (251, 700), (3000, 12000))
    return dims, n_pairs


def _experiment_with(score=None, stat=torch.var, divide=math.sqrt, same_draw=False):
    """The experiment, by the recipe, with one thing changed (a known mistake)."""
    def impl(dims, n_pairs=8192, seed=0):
        g = torch.Generator().manual_seed(seed)
        rows = []
        for d in dims:
            q = torch.randn(n_pairs, d, generator=g)
            k = q if same_draw else torch.randn(n_pairs, d, generator=g)
            raw = (q * k).sum(dim=-1) if score is None else score(q, k)
            rows.append(torch.stack([stat(raw), stat(raw / divide(d))]))
        return torch.stack(rows)
    return impl


def _theory(dims, n_pairs=8192, seed=0):
    return torch.tensor([[float(d), 1.0] for d in dims])


_VARIANCE_MISTAKES = [
    Mistake("theory-not-measured", "these are the textbook's values (d and 1), not a measurement: run the "
            "recipe on the draws of the given seed; only the grader's run of the same draws is accepted", _theory),
    Mistake("biased-variance", "the variance divides by n_pairs; torch.var (the unbiased default) divides by "
            "n_pairs - 1", _experiment_with(stat=lambda x: x.var(correction=0))),
    Mistake("divided-by-d", "the scaled scores are divided by d; divide by sqrt(d)", _experiment_with(divide=float)),
    Mistake("scaled-wrong-way", "the scaled scores are multiplied by sqrt(d); divide by it",
            _experiment_with(divide=lambda d: d ** -0.5)),
    Mistake("std-not-var", "these are standard deviations; the experiment measures variances (torch.var)",
            _experiment_with(stat=torch.std)),
    Mistake("mean-not-var", "these are means (about 0); the experiment measures variances (torch.var)",
            _experiment_with(stat=torch.mean)),
    Mistake("summed-over-pairs", "the sum runs over the pairs (dim=0); a dot product sums the d features of one "
            "pair (dim=-1)", _experiment_with(score=lambda q, k: (q * k).sum(dim=0))),
    Mistake("no-sum", "the products q_i k_i are not summed: a score is the dot product, the sum over the d "
            "features", _experiment_with(score=lambda q, k: (q * k).flatten())),
    *[Mistake("same-draw", "k is q (or q . q): draw k independently of q; |q|^2 has variance 2d, not d", impl)
      for impl in (_experiment_with(same_draw=True), _experiment_with(score=lambda q, k: (q * q).sum(dim=-1)))],
]

M_STRUCTURE = Mistake("wrong-structure", "return a float tensor of shape (len(dims), 2): row i holds "
                      "[variance of the raw scores, variance of the scaled scores] at d = dims[i]", None)
M_SEED_IGNORED = Mistake("seed-ignored", "the same seed gives different numbers: draw q and k from "
                         "torch.Generator().manual_seed(seed) (generator=g), not from the global random state", None)
M_SEED_FIXED = Mistake("seed-fixed", "two different seeds give the same numbers: seed the Generator with the "
                       "`seed` argument, not a constant", None)
M_DRAWS = Mistake("other-draws", "your numbers are a measurement, but not of the draws the recipe makes from the "
                  "seed: one Generator seeded once, then for each d in order q before k, each "
                  "torch.randn(n_pairs, d, generator=g) (float32), and row i of q with row i of k", None)


def _table(got, seed, dims):
    try:
        t = torch.as_tensor(got, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise Fail(f"`score_variance` (seed={seed}) returned {type(got).__name__}", [M_STRUCTURE]) from None
    if tuple(t.shape) != (len(dims), 2):
        raise Fail(f"`score_variance` (seed={seed}) returned shape {tuple(t.shape)}, expected ({len(dims)}, 2) for "
                   f"dims={list(dims)}", [M_STRUCTURE])
    if not torch.isfinite(t).all():
        raise Fail(f"`score_variance` (seed={seed}) returned {t.tolist()}: NaN or inf", [M_STRUCTURE])
    return t


def _slope(dims, values):
    x = torch.log(torch.tensor(dims, dtype=torch.float64))
    y = torch.log(values)
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())


def _rows(t, dims):
    return "; ".join(f"d={d}: {a:.6g}, {b:.6g}" for d, (a, b) in zip(dims, t.tolist()))


def _measure_variance(ns):
    """Three calls (a seed, the same seed again, another seed) on salted sizes; each seed's table must be the
    grader's run of the recipe on the same draws, to round-off."""
    name = "score_variance"
    dims, n_pairs = _sizes()
    seed, other = (int(s) for s in torch.randint(0, 2**31 - 1, (2,), generator=_gen(701)))
    calls = [(seed, "seed"), (seed, "the same seed again"), (other, "another seed")]
    reply = learner_of(ns).call(name, [[(list(dims),), {"n_pairs": n_pairs, "seed": s}] for s, _ in calls])
    present(reply, name)
    results = reply.get("results", [])
    tables = []
    for i, (s, what) in enumerate(calls):
        label = f"dims={list(dims)}, n_pairs={n_pairs}, seed={s} ({what})"
        if i >= len(results):
            raise Fail(f"`{name}`: the grader got no result for {label}")
        tables.append(_table(value_of(results[i], name, label), s, dims))
    same_seed_differs = mismatch(tables[1], tables[0], rtol=RTOL, atol=0.0)
    for t, s in ((tables[0], seed), (tables[2], other)):
        args, kwargs = (list(dims),), {"n_pairs": n_pairs, "seed": s}
        want = specs.score_variance(*args, **kwargs).double()  # the grader's run of the recipe on the same draws
        why = mismatch(t, want, rtol=RTOL, atol=0.0)
        if why:
            found = diagnose(t.float(), _VARIANCE_MISTAKES, args, kwargs, rtol=RTOL, atol=0.0)
            if not found:  # no known mistake: is it the seed, or reproducible draws that are not the recipe's?
                found = ([M_SEED_IGNORED] if same_seed_differs else
                         [M_SEED_FIXED] if mismatch(tables[2], tables[0], rtol=1e-9, atol=0.0) is None else [M_DRAWS])
            raise Fail(f"`{name}` (dims={list(dims)}, n_pairs={n_pairs}, seed={s}) is not the grader's run of the "
                       f"recipe on the same draws (only round-off is accepted): {why}"
                       f"\n    yours [Var(raw), Var(scaled)]: {_rows(t, dims)}\n    the grader's: {_rows(want, dims)}",
                       found)
    if same_seed_differs:
        raise Fail(f"`{name}`: two calls with seed={seed} gave different numbers\n    first:  {_rows(tables[0], dims)}"
                   f"\n    second: {_rows(tables[1], dims)}", [M_SEED_IGNORED])
    slope = _slope(dims, tables[0][:, 0])
    lo, hi = tables[0][:, 1].min().item(), tables[0][:, 1].max().item()
    return (f"your run reproduces the grader's on the same draws (dims={list(dims)}, n_pairs={n_pairs}, two seeds, "
            f"within {RTOL:g}): Var(q.k) grows as d^{slope:.2f}, Var(q.k/sqrt(d)) stays in [{lo:.3f}, {hi:.3f}]")


TABLES = {
    "stable-softmax": _float32_then_float16(
        "softmax", specs.softmax, _softmax_cases, _fp16_cases, _SOFTMAX_MISTAKES, rtol=1e-2, atol=1e-3,
        says="{n} cases match the spec, including large logits, far-apart rows, -inf entries and float16"),
    "softmax-backward": Function("softmax_backward", specs.softmax_backward, _backward_cases, _BACKWARD_MISTAKES,
                                 says="{n} cases match autograd through the softmax, including saturated rows and "
                                      "dim != -1"),
    "scaled-attention": _float32_then_float16(
        "scaled_dot_product_attention", specs.scaled_dot_product_attention, _sdpa_cases, _fp16_sdpa_cases,
        _SDPA_MISTAKES, rtol=2e-2, atol=2e-3,
        says="{n} cases match the spec, with dv != d, an explicit scale, large logits and float16"),
    "variance-experiment": Measured("experiment", _measure_variance, {"score_variance": _VARIANCE_MISTAKES}),
}
