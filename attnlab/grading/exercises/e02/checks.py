"""The checks of exercise 02_queries_keys_values (one ``@CHECKS(part id)`` per graded part)."""

import math

import torch

from attnlab.grading.core import (Fail, Mistake, Registry, check_function, gen as _gen, learner_of, present,
                                  randn as _randn, value_of)
from attnlab.grading.exercises.e02 import spec as specs

CHECKS = Registry()


def _naive_softmax(s, dim=-1):
    e = torch.exp(s)
    return e / e.sum(dim=dim, keepdim=True)


def _zero_nan(p):
    return torch.nan_to_num(p, nan=0.0)


# ---------------------------------------------------------------------------------------------
# padding-mask
# ---------------------------------------------------------------------------------------------

def _padding_cases():
    g = _gen(300)
    lengths = torch.randint(0, 8, (5,), generator=g)
    return [
        ("lengths [3, 1, 4], max_len 4", (torch.tensor([3, 1, 4]), 4), {}),
        ("lengths [3, 1, 4], max_len 6 (longer than the longest sequence)", (torch.tensor([3, 1, 4]), 6), {}),
        ("lengths [0, 5], max_len 6 (an empty sequence)", (torch.tensor([0, 5]), 6), {}),
        ("lengths [2], max_len 2 (one sequence, no padding)", (torch.tensor([2]), 2), {}),
        (f"random lengths {lengths.tolist()}, max_len 7", (lengths, 7), {}),
    ]


_PADDING_MISTAKES = [
    Mistake("off-by-one", "off by one: position j is real when j < length (j = 0 .. length-1), not j <= length",
            lambda lengths, max_len: torch.arange(max_len)[None, :] <= lengths[:, None]),
    Mistake("inverted", "the mask is inverted: True must mark real tokens (attend), False padding",
            lambda lengths, max_len: torch.arange(max_len)[None, :] >= lengths[:, None]),
    Mistake("not-bool", "the mask should be a bool tensor (True = real token), not numbers",
            lambda lengths, max_len: specs.padding_mask(lengths, max_len).float()),
    Mistake("not-bool", "the mask should be a bool tensor (True = real token), not numbers",
            lambda lengths, max_len: specs.padding_mask(lengths, max_len).long()),
    Mistake("max-len-ignored", "the mask has max(lengths) columns; it must have max_len (the padded length "
            "of the batch, which can be longer than every sequence)",
            lambda lengths, max_len: specs.padding_mask(lengths, int(lengths.max()))),
    Mistake("left-padded", "the real tokens are at the end: this course pads on the right, so the real tokens "
            "of sequence b are positions 0 .. lengths[b]-1",
            lambda lengths, max_len: torch.arange(max_len)[None, :] >= max_len - lengths[:, None]),
    Mistake("transposed", "the mask is transposed: one row per sequence, shape (B, max_len)",
            lambda lengths, max_len: specs.padding_mask(lengths, max_len).T),
]


@CHECKS("padding-mask")
def _check_padding(ns):
    n = check_function(ns, "padding_mask", specs.padding_mask, _padding_cases(), _PADDING_MISTAKES)
    return f"{n} cases match the spec, including an empty sequence and max_len beyond every length"


# ---------------------------------------------------------------------------------------------
# causal-mask
# ---------------------------------------------------------------------------------------------

def _causal_cases():
    g = _gen(310)
    a, b = (int(x) for x in torch.randint(1, 8, (2,), generator=g))
    return [(f"n_q={n_q}, n_k={n_k}" + note, (n_q, n_k), {}) for n_q, n_k, note in
            [(4, 4, ""), (1, 1, ""), (3, 5, " (fewer queries than keys)"), (5, 3, " (more queries than keys)"),
             (a, b, " (random sizes)")]]


def _tril(n_q, n_k, diagonal=0):
    return torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal)


_CAUSAL_MISTAKES = [
    Mistake("off-by-one-diagonal", "the diagonal is masked: a query may attend to its own position (j <= i)",
            lambda n_q, n_k, device=None: _tril(n_q, n_k, -1)),
    Mistake("transposed", "the mask is transposed: query i may see keys j <= i, not j >= i",
            lambda n_q, n_k, device=None: torch.ones(n_q, n_k, dtype=torch.bool).triu()),
    Mistake("bottom-right", "the mask is aligned bottom-right; this course (like PyTorch's is_causal) aligns it "
            "top-left: key j <= query i, whatever n_q and n_k", lambda n_q, n_k, device=None: _tril(n_q, n_k, n_k - n_q)),
    Mistake("square-only", "the mask is (n_q, n_q): it must have one column per key, shape (n_q, n_k)",
            lambda n_q, n_k, device=None: _tril(n_q, n_q)),
    Mistake("not-bool", "the mask should be a bool tensor (True = attend), not 1.0/0.0",
            lambda n_q, n_k, device=None: _tril(n_q, n_k).float()),
    Mistake("additive-mask", "this is an additive mask (0 and -inf, added to the scores); the course's masks are "
            "bool, True = attend", lambda n_q, n_k, device=None: torch.zeros(n_q, n_k).masked_fill(
                ~_tril(n_q, n_k), float("-inf"))),
]


@CHECKS("causal-mask")
def _check_causal(ns):
    n = check_function(ns, "causal_mask", specs.causal_mask, _causal_cases(), _CAUSAL_MISTAKES)
    return f"{n} cases match the spec, square and rectangular"


# ---------------------------------------------------------------------------------------------
# attention-masks
# ---------------------------------------------------------------------------------------------

def _attention_cases():
    cases = []
    g = _gen(400)
    b, h, nq, nk, d, dv = 2, 3, 5, 7, 4, 6
    q, k, v = _randn(g, b, h, nq, d), _randn(g, b, h, nk, d), _randn(g, b, h, nk, dv)
    shape = f"B={b}, H={h}, Nq={nq}, Nk={nk}, d={d}, dv={dv}"
    cases.append((f"{shape}, no mask", (q, k, v), {}))
    lengths = torch.randint(1, nk + 1, (b,), generator=g)
    pad = specs.padding_mask(lengths, nk)[:, None, None, :]  # (B, 1, 1, Nk)
    cases.append((f"{shape}, padding mask (B, 1, 1, Nk) of lengths {lengths.tolist()}", (q, k, v), {"mask": pad}))
    g = _gen(401)
    q6, k6, v6 = _randn(g, 1, 2, 6, 8), _randn(g, 1, 2, 6, 8), _randn(g, 1, 2, 6, 8)
    cases.append(("B=1, H=2, Nq=Nk=6, d=8, causal=True", (q6, k6, v6), {"causal": True}))
    cases.append((f"{shape}, causal=True with Nq < Nk (query i sees keys 0..i)", (q, k, v), {"causal": True}))
    g = _gen(402)
    q9, k9, v9 = _randn(g, 2, 1, 9, 4), _randn(g, 2, 1, 3, 4), _randn(g, 2, 1, 3, 4)
    cases.append(("B=2, H=1, Nq=9, Nk=3, d=4, causal=True with Nq > Nk (the last rows see every key)",
                  (q9, k9, v9), {"causal": True}))
    cases.append((f"{shape}, padding mask of lengths {lengths.tolist()} AND causal=True", (q, k, v),
                  {"mask": pad, "causal": True}))
    g = _gen(403)
    big = (_randn(g, 1, 2, 4, 16, scale=30.0), _randn(g, 1, 2, 6, 16, scale=30.0), _randn(g, 1, 2, 6, 16))
    cases.append(("large logits (scores in the hundreds), causal=True", big, {"causal": True}))
    g = _gen(404)
    q3, k3, v3 = _randn(g, 3, 1, 4, 4), _randn(g, 3, 1, 4, 4), _randn(g, 3, 1, 4, 4)
    empty = specs.padding_mask(torch.tensor([4, 0, 2]), 4)[:, None, None, :]
    cases.append(("lengths [4, 0, 2] (sequence 1 is empty: every row of it has no key) and causal=True",
                  (q3, k3, v3), {"mask": empty, "causal": True}))
    g = _gen(405)
    q4, k4, v4 = _randn(g, 1, 2, 4, 4), _randn(g, 1, 2, 5, 4), _randn(g, 1, 2, 5, 4)
    mask = torch.rand(4, 5, generator=g) < 0.6
    mask[:, 0] = True
    mask[2] = False  # query 2 has nothing to attend to
    cases.append(("an explicit (Nq, Nk) mask whose row 2 is all False (must output zeros)", (q4, k4, v4),
                  {"mask": mask}))
    return cases


def _attn_with(*, scale=None, dim=-1, mask_mode="fill", causal_mode="and", softmax=torch.softmax, fix=None):
    """A version of the spec with one thing changed (a known mistake); ``fix`` post-processes the weights."""
    def impl(q, k, v, mask=None, causal=False):
        d = q.shape[-1]
        sc = 1.0 / math.sqrt(d) if scale is None else scale(d)
        s = q @ k.transpose(-2, -1) * sc  # (B, H, Nq, Nk)
        nq, nk = q.shape[-2], k.shape[-2]
        if mask_mode == "ignored":  # the mask argument never read: causal alone, if asked for
            mask = None
        if causal and causal_mode != "ignored":
            tri = _tril(nq, nk, nk - nq if causal_mode == "bottom-right" else 0)
            if causal_mode == "replaces" or mask is None:
                mask = tri
            else:
                mask = mask & tri
        if mask is not None and mask_mode == "fill":
            s = s.masked_fill(~mask, float("-inf"))
        elif mask is not None and mask_mode == "finite":
            s = s.masked_fill(~mask, -1e9)
        elif mask is not None and mask_mode == "inverted":
            s = s.masked_fill(mask, float("-inf"))
        elif mask is not None and mask_mode == "zero":
            s = s * mask
        p = softmax(s, dim=dim)
        if mask is not None and mask_mode == "after":
            p = p * mask
        if fix is not None:
            p = fix(p)
        return p @ v
    return impl


def _both(key, message, **kwargs):
    """The mistake with a softmax that gives NaN on empty rows and with one that gives zeros."""
    return [Mistake(key, message, _attn_with(**kwargs)), Mistake(key, message, _attn_with(fix=_zero_nan, **kwargs))]


_MASKED_ATTENTION_MISTAKES = [
    # the most natural one: the scores and the causal mask done, the mask argument never used
    Mistake("mask-ignored", "the mask argument is ignored, so padded keys still get weight: where mask is False "
            "set the scores to -inf before the softmax (mask broadcasts to (B, H, Nq, Nk)), and AND it with the "
            "causal mask when causal=True", _attn_with(mask_mode="ignored")),
    *_both("mask-after-softmax", "the mask is applied after the softmax, so the kept weights no longer sum to 1: "
           "set masked scores to -inf before the softmax", mask_mode="after"),
    *_both("inverted-mask", "the mask is inverted: True means attend, so fill the scores where mask is False",
           mask_mode="inverted"),
    *_both("scale-forgotten", "the 1/sqrt(d) scale is forgotten", scale=lambda d: 1.0),
    *_both("scale-one-over-d", "the scores are divided by d; the scale is 1/sqrt(d)", scale=lambda d: 1.0 / d),
    *_both("wrong-axis", "the softmax runs over the wrong axis: normalise over the keys (dim=-1)", dim=-2),
    Mistake("mask-zero-fill", "masked scores are set to 0, which still gets weight exp(0): set them to -inf",
            _attn_with(mask_mode="zero")),
    *_both("causal-ignored", "causal=True is ignored: AND the causal mask (key j <= query i) into the mask",
           causal_mode="ignored"),
    *_both("causal-bottom-right", "the causal mask is aligned bottom-right; the course aligns it top-left (key "
           "j <= query i, whatever Nq and Nk), as PyTorch's is_causal does", causal_mode="bottom-right"),
    *_both("causal-replaces-mask", "with causal=True the padding mask is dropped: combine both masks with &",
           causal_mode="replaces"),
    Mistake("fully-masked-row", "a query with no key to attend to gives NaN (0/0): it should output zeros",
            _attn_with()),
    Mistake("finite-fill", "masked scores are set to a large finite number (like -1e9): a row whose keys are all "
            "masked then averages every value instead of giving zeros; use -inf and turn empty rows into zeros",
            _attn_with(mask_mode="finite")),
    *_both("no-max-subtraction", "exp overflows on large scores: use a softmax that subtracts each row's max",
           softmax=_naive_softmax),
]


@CHECKS("attention-masks")
def _check_masked_attention(ns):
    n = check_function(ns, "masked_attention", specs.masked_attention, _attention_cases(), _MASKED_ATTENTION_MISTAKES)
    return f"{n} cases match the spec (padding, causal with Nq != Nk, both together, empty rows, large scores)"


# ---------------------------------------------------------------------------------------------
# attention-row
# ---------------------------------------------------------------------------------------------

def _row_cases():
    cases = []
    g = _gen(450)
    cases.append(("q (4,), k (5, 4), v (5, 4), keep=None", (_randn(g, 4), _randn(g, 5, 4), _randn(g, 5, 4)), {}))
    q, k, v = _randn(g, 8), _randn(g, 6, 8), _randn(g, 6, 3)
    keep = torch.rand(6, generator=g) < 0.5
    keep[int(torch.randint(0, 6, (1,), generator=g))] = True
    cases.append((f"q (8,), k (6, 8), v (6, 3), keep={keep.tolist()}", (q, k, v), {"keep": keep}))
    cases.append(("a single key: q (4,), k (1, 4), v (1, 2)", (_randn(g, 4), _randn(g, 1, 4), _randn(g, 1, 2)), {}))
    cases.append(("keep all False: nothing to attend to (zeros)", (_randn(g, 4), _randn(g, 3, 4), _randn(g, 3, 5)),
                  {"keep": torch.zeros(3, dtype=torch.bool)}))
    cases.append(("large logits: q (16,) of size ~50, scores in the hundreds",
                  (_randn(g, 16, scale=50.0), _randn(g, 7, 16), _randn(g, 7, 4)), {}))
    return cases


def _row_with(*, scale=None, mode="fill", softmax=torch.softmax, swap=False, fix=None, normalise=True):
    def impl(q, k, v, keep=None):
        if swap:
            k, v = v, k
        sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale(q.shape[-1])
        s = k @ q * sc  # (Nk,)
        if keep is not None and mode == "fill":
            s = s.masked_fill(~keep, float("-inf"))
        elif keep is not None and mode == "finite":
            s = s.masked_fill(~keep, -1e9)
        w = softmax(s, dim=-1) if normalise else torch.exp(s)
        if keep is not None and mode == "after":
            w = w * keep
        if fix is not None:
            w = fix(w)
        return w, w @ v
    return impl


def _row_both(key, message, **kwargs):
    return [Mistake(key, message, _row_with(**kwargs)), Mistake(key, message, _row_with(fix=_zero_nan, **kwargs))]


_ROW_MISTAKES = [
    *_row_both("scale-forgotten", "the 1/sqrt(d) scale is forgotten", scale=lambda d: 1.0),
    *_row_both("keys-values-swapped", "keys and values are swapped: the scores compare the query with the keys "
               "(k), and the weights average the values (v)", swap=True),
    *_row_both("not-normalised", "the weights are exp(scores) without dividing by their sum: the softmax "
               "normalises them to sum to 1", normalise=False),
    *_row_both("mask-after-softmax", "the keys are dropped after the softmax, so the kept weights no longer sum "
               "to 1: set the scores of dropped keys to -inf before the softmax", mode="after"),
    Mistake("fully-masked-row", "with no key kept the weights are NaN (0/0): return zeros (weights and output)",
            _row_with()),
    Mistake("finite-fill", "dropped keys get a large finite score (like -1e9): with every key dropped the "
            "weights become uniform instead of zeros", _row_with(mode="finite")),
    *_row_both("no-max-subtraction", "exp overflows on large scores: subtract the max score before exp",
               softmax=_naive_softmax),
]


@CHECKS("attention-row")
def _check_attention_row(ns):
    n = check_function(ns, "attention_row", specs.attention_row, _row_cases(), _ROW_MISTAKES)
    return f"{n} cases match the spec (weights and output), including no key kept and large logits"


# ---------------------------------------------------------------------------------------------
# loop-timing (experiment)
# ---------------------------------------------------------------------------------------------

SIZES = (16, 64, 256)
D, REPEAT = 32, 5
# what the part accepts (stated in the notebook): the grader times its own loop and batched attention
SLOPE_TOL = 0.7     # the exponent of the loop's time in N: within +-0.7 of the grader's
RATIO_FACTOR = 10   # the speed-up at the largest N: within a factor 10 of the grader's
LOOP_FACTOR = 10    # the loop's time at the largest N: within a factor 10 of the grader's loop
TIME_FACTOR = 100   # both times at the largest N (geometric mean): within a factor 100 of the grader's (seconds, not ms)
DIFF_TOL = 1e-4     # the loop and the batched outputs agree
RUNS = 2            # yours and the grader's measurement, in turn; each time's minimum over the runs is kept

M_SHAPE = Mistake("wrong-structure", "return a dict {'loop': tensor (len(sizes),), 'batched': tensor (len(sizes),), "
                  "'max_abs_diff': float}: one time per size, in the order of `sizes`", None)
M_DISAGREE = Mistake("outputs-disagree", "your loop and your batched attention give different outputs (or "
                     "max_abs_diff was not measured): compare them on the same q, k, v", None)
M_UNIT = Mistake("wrong-unit", "the times are not in seconds: return time.perf_counter() differences as they are "
                 "(not milliseconds)", None)
M_SWAPPED = Mistake("swapped", "'loop' and 'batched' are swapped: the one-query-at-a-time loop is the slow one", None)
M_FLAT = Mistake("flat-loop", "your loop's time does not grow with N like the grader's: build new q, k, v of size N "
                 "for each N, loop over all N queries, and return the total time of one run (not per query)", None)
M_STEEP = Mistake("steep-loop", "your loop's time grows much faster with N than the grader's: each step should do "
                  "one query's work with tensor operations (one matrix-vector product over the N keys), not the "
                  "whole attention nor a Python loop over the keys", None)


def _slope(sizes, times):
    """Least-squares slope of log(time) against log(N): the exponent of time ~ N^slope."""
    x = torch.log(torch.tensor(sizes, dtype=torch.float64))
    y = torch.log(times)
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())


def _seconds(got, key, n):
    value = got.get(key) if isinstance(got, dict) else None
    try:
        t = torch.as_tensor(value, dtype=torch.float64).flatten()
    except (TypeError, ValueError, RuntimeError):
        raise Fail(f"`loop_vs_batched` returned {key!r} = {type(value).__name__}: expected {n} times in seconds",
                   [M_SHAPE]) from None
    if t.numel() != n:
        raise Fail(f"`loop_vs_batched` returned {t.numel()} {key!r} times for {n} sizes {list(SIZES)}", [M_SHAPE])
    if not torch.isfinite(t).all() or (t <= 0).any():
        raise Fail(f"`loop_vs_batched` returned {key!r} = {t.tolist()}: times must be positive and finite", [M_SHAPE])
    return t


def _measured(got, n):
    if not isinstance(got, dict) or not {"loop", "batched", "max_abs_diff"} <= set(got):
        keys = sorted(got) if isinstance(got, dict) else type(got).__name__
        raise Fail(f"`loop_vs_batched` returned {keys}: expected a dict with 'loop', 'batched' and 'max_abs_diff'",
                   [M_SHAPE])
    loop, batched = _seconds(got, "loop", n), _seconds(got, "batched", n)
    try:
        diff = float(got["max_abs_diff"])
    except (TypeError, ValueError, RuntimeError):
        raise Fail("`loop_vs_batched` returned a 'max_abs_diff' that is not a number", [M_SHAPE]) from None
    return loop, batched, diff


def _describe(loop, batched):
    return ", ".join(f"N={n}: loop {1e3 * a:.3g} ms, batched {1e3 * b:.3g} ms" for n, a, b in zip(SIZES, loop, batched))


@CHECKS("loop-timing")
def _check_loop_timing(ns):
    name = "loop_vs_batched"
    learner = learner_of(ns)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=_gen(500)))
    label = f"sizes={list(SIZES)}, d={D}, seed={seed}, repeat={REPEAT}"
    # yours and the grader's in turn, twice, keeping each time's minimum: other programs only ever add time,
    # and a burst of load during one run then disturbs neither side's result
    mine, theirs = [], []
    for _ in range(RUNS):
        reply = learner.call(name, [[(list(SIZES),), {"d": D, "seed": seed, "repeat": REPEAT}]])
        present(reply, name)
        results = reply.get("results", [])
        if not results:
            raise Fail(f"`{name}`: the grader got no result for {label}")
        loop, batched, diff = _measured(value_of(results[0], name, label), len(SIZES))
        if not diff <= DIFF_TOL:  # also NaN
            raise Fail(f"`{name}` ({label}): max_abs_diff = {diff:.3g}; your loop and batched outputs must agree "
                       f"within {DIFF_TOL:g}", [M_DISAGREE])
        mine.append((loop, batched, diff))
        want = specs.loop_vs_batched(SIZES, d=D, seed=seed, repeat=REPEAT)  # the grader's own run, here and now
        theirs.append((want["loop"], want["batched"]))
    loop, batched = (torch.stack([m[i] for m in mine]).amin(0) for i in (0, 1))
    diff = max(m[2] for m in mine)
    g_loop, g_batched = (torch.stack([t[i] for t in theirs]).amin(0) for i in (0, 1))
    slope, g_slope = _slope(SIZES, loop), _slope(SIZES, g_loop)
    ratio, g_ratio = float(loop[-1] / batched[-1]), float(g_loop[-1] / g_batched[-1])
    # how many times the grader's each column is, at the largest N: both ~1000 for milliseconds
    loop_scale = float(loop[-1] / g_loop[-1])
    scale = math.sqrt(loop_scale * float(batched[-1] / g_batched[-1]))
    seen = (f"yours: {_describe(loop, batched)}; the grader's: {_describe(g_loop, g_batched)}")
    # swapped: your 'batched' times are nearer the grader's loop than its batched attention
    if ratio < 1 < g_ratio and float(batched[-1] / g_batched[-1]) > math.sqrt(g_ratio):
        raise Fail(f"`{name}` ({label}): your loop is faster than your batched attention at N={SIZES[-1]} "
                   f"(speed-up {ratio:.3g}; the grader measured {g_ratio:.3g})\n    {seen}", [M_SWAPPED])
    if not 1 / TIME_FACTOR <= scale <= TIME_FACTOR:
        raise Fail(f"`{name}` ({label}): your times are {scale:.3g} times the grader's at N={SIZES[-1]} "
                   f"(accepted: within a factor {TIME_FACTOR})\n    {seen}", [M_UNIT])
    if not 1 / LOOP_FACTOR <= loop_scale <= LOOP_FACTOR:
        raise Fail(f"`{name}` ({label}): your loop took {loop_scale:.3g} times the grader's at N={SIZES[-1]} "
                   f"(accepted: within a factor {LOOP_FACTOR})\n    {seen}", [M_FLAT if loop_scale < 1 else M_STEEP])
    if not abs(slope - g_slope) <= SLOPE_TOL:    # NaN is never within it
        raise Fail(f"`{name}` ({label}): your loop's time grows as N^{slope:.2f}, the grader's as N^{g_slope:.2f} "
                   f"(accepted: within +-{SLOPE_TOL})\n    {seen}", [M_FLAT if slope < g_slope else M_STEEP])
    if not 1 / RATIO_FACTOR <= ratio / g_ratio <= RATIO_FACTOR:
        raise Fail(f"`{name}` ({label}): your speed-up at N={SIZES[-1]} is {ratio:.3g}, the grader's {g_ratio:.3g} "
                   f"(accepted: within a factor {RATIO_FACTOR})\n    {seen}", [M_STEEP] if ratio > g_ratio else [])
    return (f"your loop's time grows as N^{slope:.2f} (the grader's: N^{g_slope:.2f}); all at once is {ratio:.0f}x "
            f"faster at N={SIZES[-1]} (the grader's: {g_ratio:.0f}x); the outputs agree within {diff:.1g}")
