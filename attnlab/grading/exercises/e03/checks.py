"""The checks of exercise 03_scaled_dot_product: one table per graded part (:mod:`attnlab.grading.engine`)."""

import math

import torch

from attnlab.grading.core import Fail, Mistake, diagnose, each_result, gen, mismatch, mistakes, randn, salted_ints
from attnlab.grading.engine import Function, InTurn, Measured
from attnlab.grading.exercises.e03 import spec as specs

RTOL = 1e-5   # variance-experiment: the grader's run of the same recipe on the same draws, only round-off may differ


def _softmax_cases():
    g = gen(500)
    rows, masked = randn(g, 3, 5), randn(g, 3, 6)
    rows[1] -= 1000.0  # a row far below the others: a global max would underflow it
    masked[0, 2:] = masked[2, 0] = float("-inf")
    return [("x of shape (5, 5), dim=-1 (square)", (randn(g, 5, 5),), {}),
            ("x of shape (4, 6), dim=-1", (randn(g, 4, 6),), {}),
            ("x of shape (2, 3, 5), dim=1", (randn(g, 2, 3, 5),), {"dim": 1}),
            ("x of shape (5, 3), dim=0", (randn(g, 5, 3),), {"dim": 0}),
            ("large logits (~1000): exp overflows without the max subtracted", (randn(g, 3, 4, scale=1000.0),), {}),
            ("rows with very different offsets (one ~ -1000): subtract each row's own max", (rows,), {}),
            ("rows with -inf entries (masked scores): their weights are 0", (masked,), {})]


def _softmax_with(shift=lambda x, dim: x.amax(dim=dim, keepdim=True), axis=None, keepdim=True):
    def impl(x, dim=-1):
        dim = dim if axis is None else axis
        e = torch.exp(x - shift(x, dim))
        return e / e.sum(dim=dim, keepdim=keepdim)
    return impl


def _backward_cases():
    g = gen(550)   # one generator: p, then dp, case after case
    return [(f"p and dp of shape {shape}, dim={dim}{note}", (specs.softmax(randn(g, *shape, scale=spread), dim=dim),
                                                             randn(g, *shape)), {} if dim == -1 else {"dim": dim})
            for shape, dim, spread, note in [
                ((5, 5), -1, 1.0, " (square)"), ((4, 6), -1, 1.0, ""), ((2, 3, 5), 1, 1.0, ""),
                ((2, 2, 3, 7), -1, 2.0, ": attention weights (B, H, Nq, Nk)"), ((5, 3), 0, 1.0, ""),
                ((3, 8), -1, 30.0, ", saturated rows (scores ~30: p nearly one-hot)")]]


def _qkv(seed, b, h, nq, nk, d, dv, scale=1.0):
    """q (B, H, Nq, d), k (B, H, Nk, d), v (B, H, Nk, dv), drawn in that order; ``scale`` multiplies q and k."""
    g = gen(seed)
    return randn(g, b, h, nq, d, scale=scale), randn(g, b, h, nk, d, scale=scale), randn(g, b, h, nk, dv)


def _sdpa_cases():
    shapes = [(2, 2, 4, 6, 16, 8), (1, 3, 5, 5, 64, 64), (2, 1, 7, 3, 4, 4)]
    return [(f"B={b}, H={h}, Nq={nq}, Nk={nk}, d={d}, dv={dv}", _qkv(600 + seed, b, h, nq, nk, d, dv), {})
            for seed, (b, h, nq, nk, d, dv) in enumerate(shapes)] + [
        ("an explicit scale=0.3", _qkv(610, 1, 2, 4, 5, 8, 8), {"scale": 0.3}),
        ("large logits (scores ~ 1000s)", _qkv(611, 1, 1, 3, 4, 16, 16, scale=40.0), {})]


def _sdpa_with(scale_fn=lambda d, dv: d ** -0.5, dim=-1, softmax=torch.softmax, honour_scale=True, outside=False):
    def impl(q, k, v, scale=None):
        sc = scale if (scale is not None and honour_scale) else scale_fn(q.shape[-1], v.shape[-1])
        if outside:
            return softmax(q @ k.transpose(-2, -1), dim=dim) @ v * sc
        return softmax(q @ k.transpose(-2, -1) * sc, dim=dim) @ v
    return impl


def _sizes():
    """dims and n_pairs from the grader's secret salt: numbers written in advance cannot match a run never seen."""
    *dims, n_pairs = salted_ints(700, (2, 12), (13, 60), (61, 250), (251, 700), (3000, 12000))
    return dims, n_pairs


def _experiment_with(score=lambda q, k: (q * k).sum(dim=-1), stat=torch.var, divide=math.sqrt, same_draw=False):
    def impl(dims, n_pairs=8192, seed=0):
        g = torch.Generator().manual_seed(seed)
        rows = []
        for d in dims:
            q = torch.randn(n_pairs, d, generator=g)
            raw = score(q, q if same_draw else torch.randn(n_pairs, d, generator=g))
            rows.append(torch.stack([stat(raw), stat(raw / divide(d))]))
        return torch.stack(rows)
    return impl


def _table(got, seed, dims):
    try:
        t = torch.as_tensor(got, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        t = None
    what = (type(got).__name__ if t is None else f"shape {tuple(t.shape)}" if tuple(t.shape) != (len(dims), 2)
            else None if torch.isfinite(t).all() else f"{t.tolist()}: NaN or inf")
    if what:
        raise Fail(f"`score_variance` (seed={seed}) returned {what}, expected a finite table of shape "
                   f"({len(dims)}, 2) for dims={dims}", [M_STRUCTURE])
    return t


def _rows(t, dims):
    return "; ".join(f"d={d}: {a:.6g}, {b:.6g}" for d, (a, b) in zip(dims, t.tolist()))


def _measure_variance(learner):
    """Three calls (a seed, the same again, another); each table must be the grader's run on the same draws."""
    name = "score_variance"
    dims, n_pairs = _sizes()
    seed, other = (int(s) for s in torch.randint(0, 2**31 - 1, (2,), generator=gen(701)))
    cases = [(f"dims={dims}, n_pairs={n_pairs}, seed={s} ({what})", (dims,), {"n_pairs": n_pairs, "seed": s})
             for s, what in [(seed, "seed"), (seed, "the same seed again"), (other, "another seed")]]
    tables = [_table(got, kwargs["seed"], dims) for _, _, kwargs, got in each_result(learner, name, cases)]
    same_seed_differs = mismatch(tables[1], tables[0], rtol=RTOL, atol=0.0)
    for t, (_, args, kwargs) in ((tables[0], cases[0]), (tables[2], cases[2])):
        want = specs.score_variance(*args, **kwargs).double()  # the grader's run of the recipe on the same draws
        why = mismatch(t, want, rtol=RTOL, atol=0.0)
        if why:  # no known mistake: is it the seed, or reproducible draws that are not the recipe's?
            found = diagnose(t.float(), _VARIANCE_MISTAKES, args, kwargs, rtol=RTOL, atol=0.0) or (
                [M_SEED_IGNORED] if same_seed_differs else
                [M_SEED_FIXED] if mismatch(tables[2], tables[0], rtol=1e-9, atol=0.0) is None else [M_DRAWS])
            raise Fail(f"`{name}` (dims={dims}, n_pairs={n_pairs}, seed={kwargs['seed']}) is not the grader's run of "
                       f"the recipe on the same draws (only round-off is accepted): {why}\n    yours [Var(raw), "
                       f"Var(scaled)]: {_rows(t, dims)}\n    the grader's: {_rows(want, dims)}", found)
    if same_seed_differs:
        raise Fail(f"`{name}`: two calls with seed={seed} gave different numbers\n    first:  {_rows(tables[0], dims)}"
                   f"\n    second: {_rows(tables[1], dims)}", [M_SEED_IGNORED])
    x, y = torch.log(torch.tensor(dims, dtype=torch.float64)), torch.log(tables[0][:, 0])
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())  # least squares, log-log
    lo, hi = tables[0][:, 1].min().item(), tables[0][:, 1].max().item()
    return (f"your run reproduces the grader's on the same draws (dims={dims}, n_pairs={n_pairs}, two seeds, "
            f"within {RTOL:g}): Var(q.k) grows as d^{slope:.2f}, Var(q.k/sqrt(d)) stays in [{lo:.3f}, {hi:.3f}]")


_SOFTMAX_MISTAKES = mistakes(_softmax_with, [
    ("no-max-subtraction", "exp overflows on large logits: subtract each row's max", {"shift": lambda x, dim: 0.0}),
    ("wrong-axis", "the softmax ignores `dim` (it always normalises the last axis)", {"axis": -1}),
    ("wrong-axis", "the softmax normalises over the wrong axis", {"axis": 0}),
    ("global-max", "the max is over the whole tensor: take each row's, or rows far below it give 0/0",
     {"shift": lambda x, dim: x.max()}),
    *[("missing-keepdim", "use keepdim=True in amax and sum, so that they broadcast along `dim`",
       {"shift": lambda x, dim: x.amax(dim=dim), "keepdim": keep}) for keep in (True, False)],
    ("mean-not-max", "subtract the max, not the mean: exp overflows when one logit is far above the mean",
     {"shift": lambda x, dim: x.mean(dim=dim, keepdim=True)}),
    ("max-wrong-axis", "the max is along the last axis, the sum along `dim`: take both along `dim`",
     {"shift": lambda x, dim: x.amax(dim=-1, keepdim=True)})])
_BACKWARD_MISTAKES = [
    Mistake("missing-rowsum", "p * dp misses the coupling within a row: ds = p * (dp - rowsum(dp * p))",
            lambda p, dp, dim=-1: p * dp),
    Mistake("diagonal-only", "p (1 - p) dp is the Jacobian's diagonal alone: the terms -p_i p_j carry gradient too",
            lambda p, dp, dim=-1: p * (1 - p) * dp),
    Mistake("unweighted-rowsum", "weight the row sum by p: rowsum(dp * p), not rowsum(dp)",
            lambda p, dp, dim=-1: p * (dp - dp.sum(dim, keepdim=True))),
    Mistake("missing-p-factor", "multiply the whole bracket by p: ds = p * (dp - rowsum(dp * p))",
            lambda p, dp, dim=-1: dp - (dp * p).sum(dim, keepdim=True)),
    Mistake("wrong-sign", "the sign is flipped: ds = p * (dp - rowsum(dp * p))",
            lambda p, dp, dim=-1: p * ((dp * p).sum(dim, keepdim=True) - dp)),
    Mistake("wrong-axis", "the row sum ignores `dim` (it always sums the last axis)",
            lambda p, dp, dim=-1: p * (dp - (dp * p).sum(-1, keepdim=True))),
    Mistake("missing-keepdim", "use keepdim=True in the row sum, so that it broadcasts along `dim`",
            lambda p, dp, dim=-1: p * (dp - (dp * p).sum(dim=dim)))]
_SDPA_MISTAKES = mistakes(_sdpa_with, [
    ("scale-forgotten", "the 1/sqrt(d) scale is forgotten", {"scale_fn": lambda d, dv: 1.0}),
    ("scale-one-over-d", "the scores are divided by d; the scale is 1/sqrt(d)", {"scale_fn": lambda d, dv: 1 / d}),
    ("scale-uses-dv", "the scale is 1/sqrt(q.shape[-1]), not v's dimension", {"scale_fn": lambda d, dv: dv ** -0.5}),
    ("scale-outside-softmax", "scale the scores inside the softmax, not the output", {"outside": True}),
    ("wrong-axis", "the softmax must run over the keys (dim=-1)", {"dim": -2}),
    ("scale-ignored", "an explicit `scale` argument is ignored", {"honour_scale": False}),
    ("no-max-subtraction", "exp overflows on large logits: use a softmax that subtracts the max",
     {"softmax": _softmax_with(shift=lambda x, dim: 0.0)})])
_VARIANCE_MISTAKES = [
    Mistake("theory-not-measured", "these are the textbook's values (d and 1): run the recipe on the seed's draws",
            lambda dims, n_pairs=8192, seed=0: torch.tensor([[float(d), 1.0] for d in dims])),
    *mistakes(_experiment_with, [
        ("biased-variance", "torch.var's default divides by n_pairs - 1", {"stat": lambda x: x.var(correction=0)}),
        ("divided-by-d", "the scaled scores are divided by d; divide by sqrt(d)", {"divide": float}),
        ("scaled-wrong-way", "divide the scaled scores by sqrt(d), not multiply", {"divide": lambda d: d ** -0.5}),
        ("std-not-var", "these are standard deviations; measure variances (torch.var)", {"stat": torch.std}),
        ("mean-not-var", "these are means (about 0); measure variances (torch.var)", {"stat": torch.mean}),
        ("summed-over-pairs", "a dot product sums the d features of one pair (dim=-1), not the pairs (dim=0)",
         {"score": lambda q, k: (q * k).sum(dim=0)}),
        ("no-sum", "a score sums q_i k_i over the d features", {"score": lambda q, k: (q * k).flatten()}),
        *[("same-draw", "draw k independently of q: |q|^2 has variance 2d, not d", change)
          for change in ({"same_draw": True}, {"score": lambda q, k: (q * q).sum(dim=-1)})]])]
# what only the three calls together show: the table's structure, its seed, its draws
M_STRUCTURE = Mistake("wrong-structure", "return a float (len(dims), 2) tensor, row i [Var(raw), Var(scaled)]", None)
M_SEED_IGNORED = Mistake("seed-ignored", "draw from torch.Generator().manual_seed(seed), not the global state", None)
M_SEED_FIXED = Mistake("seed-fixed", "seed the Generator with the `seed` argument, not a constant", None)
M_DRAWS = Mistake("other-draws", "not the recipe's draws: one Generator seeded once, then for each d in order q "
                  "before k, each torch.randn(n_pairs, d, generator=g) (float32), row i of q with row i of k", None)

TABLES = {
    "stable-softmax": InTurn(
        "{n} cases match the spec, including large logits, far-apart rows, -inf entries and float16",
        (Function("softmax", specs.softmax, _softmax_cases, _SOFTMAX_MISTAKES),
         Function("softmax", specs.softmax, lambda: [(
             "float16 x of shape (4, 8) with logits up to 15 (exp(15) overflows float16)",  # exp(15) > 65504
             (randn(gen(501), 4, 8, scale=4.0).index_fill(1, torch.tensor([0]), 15.0).half(),), {})],
             _SOFTMAX_MISTAKES, rtol=1e-2, atol=1e-3))),
    "softmax-backward": Function("softmax_backward", specs.softmax_backward, _backward_cases, _BACKWARD_MISTAKES,
                                 says="{n} cases match autograd through the softmax (saturated rows, dim != -1)"),
    "scaled-attention": InTurn(
        "{n} cases match the spec, with dv != d, an explicit scale, large logits and float16",
        (Function("scaled_dot_product_attention", specs.scaled_dot_product_attention, _sdpa_cases, _SDPA_MISTAKES),
         Function("scaled_dot_product_attention", specs.scaled_dot_product_attention, lambda: [(
             "float16 q, k, v (B=1, H=2, Nq=4, Nk=6, d=16, dv=8), scores up to ~30: exp overflows float16 above 11",
             tuple(a.half() for a in _qkv(612, 1, 2, 4, 6, 16, 8, scale=3.0)), {})],
             _SDPA_MISTAKES, rtol=2e-2, atol=2e-3))),
    "variance-experiment": Measured("experiment", _measure_variance, {"score_variance": _VARIANCE_MISTAKES}),
}
