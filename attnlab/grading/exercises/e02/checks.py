"""The checks of exercise 02_queries_keys_values: one table per graded part (attnlab.grading.engine), in TABLES."""

import itertools
import math

import torch

from attnlab.grading.core import Fail, Mistake, each_result, gen as _gen, mismatch, randn as _randn, salted_ints
from attnlab.grading.engine import Function, Measured, run
from attnlab.grading.exercises.e02 import spec as specs


def _tril(n_q, n_k, diagonal=0):
    return torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal)


def _qkv(g, b, h, nq, nk, d, dv, scale=1.0):
    """q (B, H, Nq, d), k (B, H, Nk, d) (both times ``scale``) and v (B, H, Nk, dv), drawn from ``g`` in order."""
    return _randn(g, b, h, nq, d, scale=scale), _randn(g, b, h, nk, d, scale=scale), _randn(g, b, h, nk, dv)


def _mistakes(make, table):
    """core.mistakes, each row also with NaN weights zeroed (a row with no key) unless it ends in "once"."""
    return [Mistake(key, message, make(**change, **fix)) for key, message, change, *once in table
            for fix in ([{}] if once else [{}, {"fix": lambda p: torch.nan_to_num(p, nan=0.0)}])]


# ----------------------------------------------------------------------------- padding-mask

def _padding_cases():
    lengths = torch.randint(0, 8, (5,), generator=_gen(300))
    return [(f"lengths {x.tolist()}, max_len {n}{note}", (x, n), {}) for x, n, note in [
        (torch.tensor([3, 1, 4]), 4, ""), (torch.tensor([3, 1, 4]), 6, " (longer than the longest sequence)"),
        (torch.tensor([0, 5]), 6, " (an empty sequence)"), (torch.tensor([2]), 2, " (one sequence, no padding)"),
        (lengths, 7, " (random lengths)")]]


_PADDING_MISTAKES = [Mistake(*row) for row in [
    ("off-by-one", "off by one: position j is real when j < length (j = 0 .. length-1), not j <= length",
     lambda lengths, n: torch.arange(n)[None, :] <= lengths[:, None]),
    ("inverted", "the mask is inverted: True marks real tokens, False padding",
     lambda lengths, n: torch.arange(n)[None, :] >= lengths[:, None]),
    *[("not-bool", "the mask should be a bool tensor (True = real token), not numbers", lambda lengths, n,
       dtype=dtype: specs.padding_mask(lengths, n).to(dtype)) for dtype in (torch.float, torch.long)],
    ("max-len-ignored", "the mask has max(lengths) columns: it must have max_len, which can be longer",
     lambda lengths, n: specs.padding_mask(lengths, int(lengths.max()))),
    ("left-padded", "pad on the right: sequence b's real tokens are positions 0 .. lengths[b]-1",
     lambda lengths, n: torch.arange(n)[None, :] >= n - lengths[:, None]),
    ("transposed", "one row per sequence: (B, max_len)", lambda lengths, n: specs.padding_mask(lengths, n).T)]]


# ----------------------------------------------------------------------------- causal-mask

def _causal_cases():
    a, b = (int(x) for x in torch.randint(1, 8, (2,), generator=_gen(310)))
    return [(f"n_q={n_q}, n_k={n_k}" + note, (n_q, n_k), {}) for n_q, n_k, note in
            [(4, 4, ""), (1, 1, ""), (3, 5, " (fewer queries than keys)"), (5, 3, " (more queries than keys)"),
             (a, b, " (random sizes)")]]


_CAUSAL_MISTAKES = [Mistake(key, message, lambda n_q, n_k, device=None, mask=mask: mask(n_q, n_k))
                    for key, message, mask in [
    ("off-by-one-diagonal", "the diagonal is masked: keep j <= i", lambda n_q, n_k: _tril(n_q, n_k, -1)),
    ("transposed", "the mask is transposed: query i may see keys j <= i, not j >= i",
     lambda n_q, n_k: torch.ones(n_q, n_k, dtype=torch.bool).triu()),
    ("bottom-right", "align the mask top-left, as PyTorch's is_causal: key j <= query i, whatever n_q and n_k",
     lambda n_q, n_k: _tril(n_q, n_k, n_k - n_q)),
    ("square-only", "the mask must be (n_q, n_k), one column per key", lambda n_q, n_k: _tril(n_q, n_q)),
    ("not-bool", "the mask should be bool (True = attend), not 1.0/0.0", lambda n_q, n_k: _tril(n_q, n_k).float()),
    ("additive-mask", "this is an additive mask (0 and -inf): the course's masks are bool, True = attend",
     lambda n_q, n_k: torch.zeros(n_q, n_k).masked_fill(~_tril(n_q, n_k), float("-inf")))]]


# ----------------------------------------------------------------------------- attention-masks

def _attention_cases():
    g = _gen(400)
    qkv, shape = _qkv(g, 2, 3, 5, 7, 4, 6), "B=2, H=3, Nq=5, Nk=7, d=4, dv=6"
    lengths = torch.randint(1, 8, (2,), generator=g)
    pad, empty = (specs.padding_mask(x, n)[:, None, None, :] for x, n in ((lengths, 7), (torch.tensor([4, 0, 2]), 4)))
    g = _gen(405)
    explicit, mask = _qkv(g, 1, 2, 4, 5, 4, 4), torch.rand(4, 5, generator=g) < 0.6
    mask[:, 0], mask[2] = True, False  # query 2 has nothing to attend to
    return [
        (f"{shape}, no mask", qkv, {}),
        (f"{shape}, padding mask (B, 1, 1, Nk) of lengths {lengths.tolist()}", qkv, {"mask": pad}),
        ("B=1, H=2, Nq=Nk=6, d=8, causal=True", _qkv(_gen(401), 1, 2, 6, 6, 8, 8), {"causal": True}),
        (f"{shape}, causal=True with Nq < Nk (query i sees keys 0..i)", qkv, {"causal": True}),
        ("B=2, H=1, Nq=9, Nk=3, d=4, causal=True with Nq > Nk (the last rows see every key)",
         _qkv(_gen(402), 2, 1, 9, 3, 4, 4), {"causal": True}),
        (f"{shape}, padding mask of lengths {lengths.tolist()} AND causal=True", qkv, {"mask": pad, "causal": True}),
        ("large logits (scores in the hundreds), causal=True", _qkv(_gen(403), 1, 2, 4, 6, 16, 16, scale=30.0),
         {"causal": True}),
        ("lengths [4, 0, 2] (sequence 1 is empty: every row of it has no key) and causal=True",
         _qkv(_gen(404), 3, 1, 4, 4, 4, 4), {"mask": empty, "causal": True}),
        ("an explicit (Nq, Nk) mask whose row 2 is all False (must output zeros)", explicit, {"mask": mask})]


# how a mask (True = attend) reaches the scores, right ("fill") and wrong
_FILLS = {"fill": lambda s, m: s.masked_fill(~m, float("-inf")), "finite": lambda s, m: s.masked_fill(~m, -1e9),
          "inverted": lambda s, m: s.masked_fill(m, float("-inf")), "zero": lambda s, m: s * m}


def _attn_with(*, scale=None, dim=-1, mask_mode="fill", causal_mode="and", softmax=torch.softmax, fix=None,
               swap=False, normalise=True, weights=False):
    """The spec with one thing changed; ``fix`` post-processes the weights, returned too when ``weights``."""
    def impl(q, k, v, mask=None, causal=False):
        k, v = (v, k) if swap else (k, v)
        d, nq, nk = q.shape[-1], q.shape[-2], k.shape[-2]
        s = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d) if scale is None else scale(d))  # (B, H, Nq, Nk)
        mask = None if mask_mode == "ignored" else mask  # the mask argument never read: causal alone, if asked for
        if causal and causal_mode != "ignored":
            tri = _tril(nq, nk, nk - nq if causal_mode == "bottom-right" else 0)
            mask = tri if causal_mode == "replaces" or mask is None else mask & tri
        if mask is not None and mask_mode in _FILLS:
            s = _FILLS[mask_mode](s, mask)
        p = softmax(s, dim=dim) if normalise else torch.exp(s)
        p = p * mask if mask is not None and mask_mode == "after" else p
        p = p if fix is None else fix(p)
        return (p, p @ v) if weights else p @ v
    return impl


def _naive_softmax(s, dim=-1):
    return torch.exp(s) / torch.exp(s).sum(dim=dim, keepdim=True)


_MASKED_ATTENTION_MISTAKES = _mistakes(_attn_with, [
    # the most natural one: the scores and the causal mask done, the mask argument never used
    ("mask-ignored", "the mask argument is ignored: where it is False set the scores to -inf, AND-ed with the causal "
     "mask", {"mask_mode": "ignored"}, "once"),
    ("mask-after-softmax", "masking after the softmax leaves weights that do not sum to 1: set masked scores to -inf "
     "before it", {"mask_mode": "after"}),
    ("inverted-mask", "the mask is inverted: fill the scores where it is False", {"mask_mode": "inverted"}),
    ("scale-forgotten", "the 1/sqrt(d) scale is forgotten", {"scale": lambda d: 1.0}),
    ("scale-one-over-d", "the scores are divided by d; the scale is 1/sqrt(d)", {"scale": lambda d: 1.0 / d}),
    ("wrong-axis", "the softmax runs over the wrong axis: normalise over the keys (dim=-1)", {"dim": -2}),
    ("mask-zero-fill", "masked scores of 0 still get weight exp(0): set them to -inf", {"mask_mode": "zero"}, "once"),
    ("causal-ignored", "causal=True is ignored: AND in the causal mask, key j <= query i", {"causal_mode": "ignored"}),
    ("causal-bottom-right", "align the causal mask top-left, as is_causal: j <= i", {"causal_mode": "bottom-right"}),
    ("causal-replaces-mask", "causal=True drops the padding mask: AND the two", {"causal_mode": "replaces"}),
    ("fully-masked-row", "a query with no key to attend to gives NaN (0/0): it should output zeros", {}, "once"),
    ("finite-fill", "with a finite fill (-1e9) a fully masked row averages the values: use -inf, empty rows to zeros",
     {"mask_mode": "finite"}, "once"),
    ("no-max-subtraction", "exp overflows on large scores: subtract each row's max", {"softmax": _naive_softmax})])


# ----------------------------------------------------------------------------- attention-row

def _row_cases():
    g = _gen(450)
    first, (q, k, v) = [(_randn(g, n), _randn(g, m, n), _randn(g, m, dv)) for n, m, dv in ((4, 5, 4), (8, 6, 3))]
    keep = torch.rand(6, generator=g) < 0.5
    keep[int(torch.randint(0, 6, (1,), generator=g))] = True
    return [("q (4,), k (5, 4), v (5, 4), keep=None", first, {}),
            (f"q (8,), k (6, 8), v (6, 3), keep={keep.tolist()}", (q, k, v), {"keep": keep}),
            ("a single key: q (4,), k (1, 4), v (1, 2)", (_randn(g, 4), _randn(g, 1, 4), _randn(g, 1, 2)), {}),
            ("keep all False: nothing to attend to (zeros)", (_randn(g, 4), _randn(g, 3, 4), _randn(g, 3, 5)),
             {"keep": torch.zeros(3, dtype=torch.bool)}),
            ("large logits: q (16,) of size ~50, scores in the hundreds",
             (_randn(g, 16, scale=50.0), _randn(g, 7, 16), _randn(g, 7, 4)), {})]


def _row_with(**change):
    """The spec's row with one thing changed: the attention above, on the one query, ``keep`` its mask."""
    attend = _attn_with(weights=True, **change)
    return lambda q, k, v, keep=None: tuple(x[0] for x in attend(q[None], k, v, keep))


_ROW_MISTAKES = _mistakes(_row_with, [
    ("scale-forgotten", "the 1/sqrt(d) scale is forgotten", {"scale": lambda d: 1.0}),
    ("keys-values-swapped", "keys and values are swapped: score the query against k, average v", {"swap": True}),
    ("not-normalised", "the weights exp(scores) are not divided by their sum", {"normalise": False}),
    ("mask-after-softmax", "dropping keys after the softmax leaves weights that do not sum to 1: set their scores to "
     "-inf before it", {"mask_mode": "after"}),
    ("fully-masked-row", "with no key kept the weights are NaN (0/0): return zeros (weights and output)", {}, "once"),
    ("finite-fill", "with a finite score (-1e9) for dropped keys, dropping all gives uniform weights, not zeros",
     {"mask_mode": "finite"}, "once"),
    ("no-max-subtraction", "exp overflows on large scores: subtract the max first", {"softmax": _naive_softmax})])


# ----------------------------------------------------------------------------- loop-timing (experiment)
# Timings are never scored (a notebook could return any number): the table beside a pass is the grader's own.

TIMING_SIZES, TIMING_D = (16, 64, 256), 32


def _loop_cases():
    g = _gen(500)
    b, h, nq, nk, d, dv = salted_ints(501, (1, 3), (1, 4), (1, 40), (1, 40), (1, 48), (1, 48))
    return [("B=1, H=1, Nq=5, Nk=5, d=8, dv=8", _qkv(g, 1, 1, 5, 5, 8, 8), {}),
            ("B=2, H=3, Nq=4, Nk=7, d=6, dv=5", _qkv(g, 2, 3, 4, 7, 6, 5), {}),
            (f"B={b}, H={h}, Nq={nq}, Nk={nk}, d={d}, dv={dv} (sizes from the grader's secret seed)",
             _qkv(g, b, h, nq, nk, d, dv), {})]


def _loop_with(pick=lambda b, h, i: (b, h, i), fill=lambda b, h: True, output=1):
    """The spec's loop with one thing changed: the query each step reads, which (b, h) it fills, what it keeps."""
    def impl(q, k, v):
        out = torch.zeros(*q.shape[:-1], k.shape[-2] if output == 0 else v.shape[-1])  # (B, H, Nq, dv)
        for b, h, i in itertools.product(*map(range, q.shape[:-1])):
            out[b, h, i] = specs.attention_row(q[pick(b, h, i)], k[b, h], v[b, h])[output] if fill(b, h) else 0.0
        return out
    return impl


_LOOP_MISTAKES = [Mistake(*row) for row in [
    ("first-head-only", "only batch 0, head 0 is computed: loop over every b < B and h < H too",
     _loop_with(fill=lambda b, h: b == 0 and h == 0)),
    ("first-head-only", "only head 0 is computed: loop over every h < H too", _loop_with(fill=lambda b, h: h == 0)),
    ("one-query-repeated", "step i must use query i, q[b, h, i]", _loop_with(pick=lambda b, h, i: (b, h, 0))),
    ("weights-not-output", "keep the output, attention_row(...)[1], not the weights", _loop_with(output=0))]]
ROW_NEVER_CALLED = Mistake("row-never-called", "no call of your attention_row made the rows: call attention_row(q[b, "
                           "h, i], k[b, h], v[b, h]) by that name, once per query", None)
ONE_CALL_PER_QUERY = Mistake("not-one-call-per-query", "call attention_row once per (b, h, i), one row each", None)


_LOOP = Function("loop_attention", specs.loop_attention, _loop_cases, _LOOP_MISTAKES, says="{n} cases match masked "
                 "attention to round-off, one query at a time (sizes from the grader's secret seed, B and H > 1)")


def _measure_loop(learner):
    """The loop's values; then its calls, seen, not read: each case runs again with attention_row's k-th call
    shifted by k x a salted step (agent._tapped), so the B * H * Nq rows must move by 1 .. B * H * Nq steps, one
    each, in any order; then the grader's own timing, never scored."""
    checked = run(_LOOP, learner)
    step = 4.0 + float(torch.rand(1, generator=_gen(504)))
    cases = _loop_cases()
    for label, args, kwargs, got in each_result(learner, "loop_attention", cases, copy=True,
                                                tap={"name": "attention_row", "step": step}):
        want = specs.loop_attention(*args, **kwargs).double()
        if not torch.is_tensor(got) or got.shape != want.shape:
            raise Fail(f"`loop_attention` on {label}, with attention_row's calls counted: expected a tensor of shape "
                       f"{tuple(want.shape)}")
        shift = (got.double() - want) / step                          # (B, H, Nq, dv): k for each entry of row k
        calls = shift.round()
        rows = calls[..., 0].flatten()                                # every size is at least 1
        if mismatch(shift, calls, rtol=0, atol=1e-2) is None and bool((calls == calls[..., :1]).all()) and \
                sorted(rows.long().tolist()) == list(range(1, rows.numel() + 1)):
            continue
        never = not torch.isfinite(shift).all() or bool((calls == 0).all())
        seen = "no row moved: none came from a call of attention_row" if never else \
            f"the rows moved as {int(calls.max())} call(s) for {rows.numel()} queries would"
        raise Fail(f"`loop_attention` on {label}: with attention_row's k-th call shifted by k x {step:.3f}, the "
                   f"rows did not move as one call per query would move them ({seen})",
                   [ROW_NEVER_CALLED if never else ONE_CALL_PER_QUERY])
    t = specs.timing_table(TIMING_SIZES, d=TIMING_D, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=_gen(503))))
    timing = "; ".join(f"N={n}: {1e3 * a:.3g} ms one query at a time, {1e3 * b:.3g} ms all at once ({a / b:.0f}x)"
                       for n, a, b in zip(TIMING_SIZES, t["loop"].tolist(), t["batched"].tolist()))
    return f"{checked}; every row came from an attention_row call of its own ({len(cases)} cases seen)\n    " \
           f"the grader's own timing on this machine (shown, not scored): {timing}"


TABLES = {
    "padding-mask": Function("padding_mask", specs.padding_mask, _padding_cases, _PADDING_MISTAKES, says="{n} cases "
                             "match the spec, including an empty sequence and max_len beyond every length"),
    "causal-mask": Function("causal_mask", specs.causal_mask, _causal_cases, _CAUSAL_MISTAKES,
                            says="{n} cases match the spec, square and rectangular"),
    "attention-masks": Function("masked_attention", specs.masked_attention, _attention_cases,
                                _MASKED_ATTENTION_MISTAKES, says="{n} cases match the spec (padding, causal with "
                                "Nq != Nk, both together, empty rows, large scores)"),
    "attention-row": Function("attention_row", specs.attention_row, _row_cases, _ROW_MISTAKES, says="{n} cases "
                              "match the spec (weights and output), including no key kept and large logits"),
    "loop-timing": Measured("experiment", _measure_loop, {"loop_attention": _LOOP_MISTAKES, "(calls seen)": [
        ROW_NEVER_CALLED, ONE_CALL_PER_QUERY]}),
}
