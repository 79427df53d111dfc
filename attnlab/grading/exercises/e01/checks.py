"""The checks of exercise 01_soft_alignment: one table per graded part (:mod:`attnlab.grading.engine`), in ``TABLES``."""


from functools import lru_cache

import torch

from attnlab.attention import padding_mask
from attnlab.grading.core import Fail, Mistake, diagnose, gen as _gen, learner_of, mismatch, present, randn as _randn, \
    value_of
from attnlab.grading.engine import Function, Measured
from attnlab.grading.exercises.e01 import spec as specs


# ----------------------------------------------------------------------------- additive-score

def _additive_params(g, dq, dk, a):
    return _randn(g, a, dq, scale=0.5), _randn(g, a, dk, scale=0.5), _randn(g, a)


def _additive_cases():
    cases = []
    # the first case is square (B = N, Dq = Dk = A) so that every known mistake runs on it and can be recognised
    shapes = [(5, 5, 4, 4, 4, "square: B = N, Dq = Dk = A"), (3, 7, 4, 6, 5, "Dq != Dk"),
              (1, 1, 3, 2, 8, "one source position"), (4, 9, 5, 5, 3, "A smaller than Dq")]
    for seed, (b, n, dq, dk, a, what) in enumerate(shapes):
        g = _gen(100 + seed)
        s, h = _randn(g, b, dq), _randn(g, b, n, dk)
        w, u, v = _additive_params(g, dq, dk, a)
        cases.append((f"B={b}, N={n}, Dq={dq}, Dk={dk}, A={a}, {what} (seed {100 + seed})", (s, h, w, u, v), {}))
    return cases


_ADDITIVE_MISTAKES = [
    Mistake("no-tanh", "the tanh is missing: e_j = v^T tanh(W s + U h_j)",
            lambda s, h, w, u, v: ((s @ w.T)[:, None, :] + h @ u.T) @ v),
    Mistake("swapped-projections", "W and U are swapped: W projects the decoder state s, U the encoder states h",
            lambda s, h, w, u, v: torch.tanh((s @ u.T)[:, None, :] + h @ w.T) @ v),
    Mistake("softmax-applied", "these should be raw scores; the softmax comes later, in `context_vector`",
            lambda s, h, w, u, v: torch.softmax(specs.additive_scores(s, h, w, u, v), dim=-1)),
    Mistake("tanh-after-v", "the tanh is applied after the dot product with v instead of before it",
            lambda s, h, w, u, v: torch.tanh(((s @ w.T)[:, None, :] + h @ u.T) @ v)),
    Mistake("query-not-broadcast", "W s (B, A) was added to U h (B, N, A) without a position axis, so broadcasting "
            "lined the batch up with the source positions: use (s @ w.T)[:, None, :]",
            lambda s, h, w, u, v: torch.tanh(s @ w.T + h @ u.T) @ v),
    Mistake("not-transposed", "W and U are (A, Dq) and (A, Dk): with row vectors the projections are s @ w.T and "
            "h @ u.T, not s @ w and h @ u",
            lambda s, h, w, u, v: torch.tanh((s @ w)[:, None, :] + h @ u) @ v),
    Mistake("v-ignored", "the A-vector was summed instead of read out with v: multiply by v over the last axis",
            lambda s, h, w, u, v: torch.tanh((s @ w.T)[:, None, :] + h @ u.T).sum(-1)),
]


# ----------------------------------------------------------------------------- context-vector

def _context_cases():
    cases = []
    for seed, (b, n, dk) in enumerate([(3, 6, 4), (2, 1, 5), (4, 9, 3)]):
        g = _gen(200 + seed)
        cases.append((f"B={b}, N={n}, Dk={dk}, no mask (seed {200 + seed})", (_randn(g, b, n), _randn(g, b, n, dk)), {}))
    g = _gen(210)
    lengths = torch.tensor([5, 2, 7])
    cases.append(("B=3, N=7 with padding (lengths 5, 2, 7)", (_randn(g, 3, 7), _randn(g, 3, 7, 4)),
                  {"mask": padding_mask(lengths, 7)}))
    g = _gen(211)
    cases.append(("B=2, N=6, large scores (up to ~400): needs the max subtracted",
                  (_randn(g, 2, 6, scale=200.0), _randn(g, 2, 6, 3)), {}))
    g = _gen(212)
    cases.append(("B=2, N=5 where row 1 has no real token (must give zero weights)",
                  (_randn(g, 2, 5), _randn(g, 2, 5, 3)), {"mask": padding_mask(torch.tensor([3, 0]), 5)}))
    return cases


def _naive_softmax(x, dim=-1):
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def _ctx_from_weights(weights, h):
    return (weights[:, :, None] * h).sum(dim=1), weights


def _masked_scores(scores, mask, fill=float("-inf")):
    return scores if mask is None else scores.masked_fill(~mask, fill)


_CONTEXT_MISTAKES = [
    Mistake("wrong-axis", "the softmax runs over the wrong axis: normalise over the N source positions (dim=-1)",
            lambda sc, h, mask=None: _ctx_from_weights(torch.softmax(_masked_scores(sc, mask), dim=0), h)),
    Mistake("mask-after-softmax", "the mask is applied after the softmax, so the kept weights no longer sum to 1: "
            "set masked scores to -inf before the softmax",
            lambda sc, h, mask=None: _ctx_from_weights(
                torch.softmax(sc, dim=-1) * (1.0 if mask is None else mask.float()), h)),
    Mistake("no-max-subtraction", "exp overflows on large scores: subtract each row's max before exp",
            lambda sc, h, mask=None: _ctx_from_weights(_naive_softmax(_masked_scores(sc, mask), -1), h)),
    Mistake("fully-masked-row", "a row with no real token gives NaN (0/0): it should give zero weights",
            lambda sc, h, mask=None: _ctx_from_weights(torch.softmax(_masked_scores(sc, mask), dim=-1), h)),
    Mistake("mask-inverted", "the mask is read the wrong way round: True marks a real token (keep it), False padding",
            lambda sc, h, mask=None: _ctx_from_weights(specs.context_vector(sc, h, None if mask is None else ~mask)[1], h)),
    Mistake("masked-to-zero", "masked scores were set to 0, and exp(0) = 1 still gives padding weight: set them to "
            "-inf so that exp gives exactly 0",
            lambda sc, h, mask=None: _ctx_from_weights(torch.softmax(_masked_scores(sc, mask, 0.0), dim=-1), h)),
    Mistake("context-from-scores", "the context is weighted by the raw scores: weight h by the softmax weights",
            lambda sc, h, mask=None: ((_masked_scores(sc, mask, 0.0)[:, :, None] * h).sum(1),
                                      specs.context_vector(sc, h, mask)[1])),
]


# ----------------------------------------------------------------------------- decode-step

def _decode_cases():
    # the first case is square (B = N, Dq = Dk = A) so that every known mistake of the scores runs on it
    # and can be recognised, with a sequence of no real token (its context is zero); the last has scores of ~100,
    # past float32's exp, which only a softmax that subtracts the maximum survives
    cases = []
    for seed, (b, n, dq, dk, a, lens, big) in enumerate([(4, 4, 4, 4, 4, [4, 0, 2, 3], 1.0),
                                                         (2, 5, 4, 4, 3, None, 1.0), (3, 6, 5, 3, 4, [6, 2, 4], 1.0),
                                                         (1, 3, 2, 6, 5, None, 1.0), (2, 5, 4, 4, 3, [5, 3], 80.0)]):
        g = _gen(300 + seed)
        s, h = _randn(g, b, dq), _randn(g, b, n, dk)
        w, u, v = _additive_params(g, dq, dk, a)
        v = v * big
        w_s, w_c = _randn(g, dq, dq, scale=0.5), _randn(g, dq, dk, scale=0.5)
        kwargs = {} if lens is None else {"mask": padding_mask(torch.tensor(lens), n)}
        cases.append((f"B={b}, N={n}, Dq={dq}, Dk={dk}, A={a}" + (f", lengths {lens}" if lens else ", no mask")
                      + (f", v x {big:g} (large scores)" if big != 1 else ""), (s, h, w, u, v, w_s, w_c), kwargs))
    return cases


def _decode_with(weights_fn, update_fn, second=None):
    def impl(s, h, w, u, v, w_s, w_c, mask=None):
        scores = specs.additive_scores(s, h, w, u, v)
        weights = weights_fn(scores, mask)
        c = (weights[:, :, None] * h).sum(dim=1)
        return update_fn(s, c, w_s, w_c), (weights if second is None else second(scores, weights))
    return impl


def _spec_weights(scores, mask):
    return specs.context_vector(scores, scores[:, :, None], mask)[1]


def _spec_update(s, c, w_s, w_c):
    return torch.tanh(s @ w_s.T + c @ w_c.T)


_DECODE_MISTAKES = [
    Mistake("no-tanh", "the state update lost its tanh: s' = tanh(W_s s + W_c c)",
            _decode_with(_spec_weights, lambda s, c, w_s, w_c: s @ w_s.T + c @ w_c.T)),
    Mistake("mask-ignored", "the padding mask is not passed on: padded positions get weight",
            _decode_with(lambda sc, mask: _spec_weights(sc, None), _spec_update)),
    Mistake("wrong-axis", "the softmax runs over the wrong axis: normalise over the N source positions",
            _decode_with(lambda sc, mask: torch.softmax(_masked_scores(sc, mask), dim=0), _spec_update)),
    Mistake("swapped-update-weights", "W_s and W_c are swapped: W_s multiplies the old state, W_c the context",
            _decode_with(_spec_weights, lambda s, c, w_s, w_c: torch.tanh(s @ w_c.T + c @ w_s.T))),
    Mistake("state-weights-transposed", "W_s is applied transposed: with row vectors the old state's term is "
            "s @ w_s.T", _decode_with(_spec_weights, lambda s, c, w_s, w_c: torch.tanh(s @ w_s + c @ w_c.T))),
    Mistake("scores-returned", "the second value should be the attention weights (after the softmax), not the raw "
            "scores", _decode_with(_spec_weights, _spec_update, second=lambda scores, weights: scores)),
    Mistake("context-not-used", "the new state ignores the context: s' = tanh(W_s s + W_c c)",
            _decode_with(_spec_weights, lambda s, c, w_s, w_c: torch.tanh(s @ w_s.T))),
]



def _decode_using(score_fn, ctx_fn):
    def impl(s, h, w, u, v, w_s, w_c, mask=None):
        c, weights = ctx_fn(score_fn(s, h, w, u, v), h, mask)
        return torch.tanh(s @ w_s.T + c @ w_c.T), weights
    return impl


# a right decode_step that calls a wrong part 1 or part 2 (the learner's own, as the notebook has it)
_DECODE_MISTAKES += [
    Mistake("additive-score-wrong", "decode_step itself looks right, but the additive_scores it calls is not: "
            "make check(\"additive-score\") pass first", _decode_using(m.impl, specs.context_vector))
    for m in _ADDITIVE_MISTAKES
] + [
    Mistake("context-vector-wrong", "decode_step itself looks right, but the context_vector it calls is not: "
            "make check(\"context-vector\") pass first", _decode_using(specs.additive_scores, m.impl))
    for m in _CONTEXT_MISTAKES
]


# ----------------------------------------------------------------------------- alignment-crossing

TOLERANCE = 0.05  # absolute, on each of the two masses (the notebook states it)
CHECK_STEPS = 150  # fewer than the default 250: a run that ignores `steps` shows


@lru_cache(maxsize=4)
def _trained(seed, steps):
    return specs.train_rnnsearch(seed, steps)


@lru_cache(maxsize=4)
def _alignments(seed, steps):
    return specs.probe_alignments(_trained(seed, steps))


def _masses(alignments, rows=(0, 1), weight=0.5):
    """(crossed, straight) as a tensor; ``rows``: which output rows hold the noun and the adjective
    relative to the swap's i (the spec: i and i + 1), ``weight``: 0.5 for the mean of the pair."""
    _, _, _, swaps, _ = specs._data()
    crossed, straight = [], []
    a0, a1 = rows
    for a, pairs in zip(alignments, swaps):
        for i, j in pairs:
            crossed.append(weight * (a[i + a0, j] + a[i + a1, j - 1]))
            straight.append(weight * (a[i + a0, j - 1] + a[i + a1, j]))
    return torch.stack([torch.stack(crossed).mean(), torch.stack(straight).mean()]).double()


def _reference(seed, steps=250):
    return _masses(_alignments(seed, steps))


_CROSSING_MISTAKES = [
    Mistake("masses-swapped", "the two numbers are the wrong way round: return (crossed, straight), the crossed "
            "mass first (noun row on the noun, adjective row on the adjective)",
            lambda seed, steps=250: _reference(seed, steps).flip(0)),
    Mistake("rows-off-by-one", "the rows are shifted by one: row i of the recorded weights is French word i "
            "(the step that *outputs* it), not the word the decoder has just read",
            lambda seed, steps=250: _masses(_alignments(seed, steps), rows=(-1, 0))),
    Mistake("sum-not-mean", "each pair's mass is the *mean* of its two rows' weights (so it lies in [0, 1]), "
            "not their sum", lambda seed, steps=250: _masses(_alignments(seed, steps), weight=1.0)),
    Mistake("untrained", "these are the masses of an untrained model (nearly uniform weights): train for `steps` "
            "steps before reading the alignment", lambda seed, steps=250: _masses(_alignments(seed, 0))),
    Mistake("steps-ignored", f"the run trained 250 steps whatever `steps` said (the grader asked for "
            f"{CHECK_STEPS}): pass `steps` on to the training", lambda seed, steps=250: _reference(seed, 250)),
    Mistake("seed-ignored", "the run did not start from `seed` (it matches seed 0): seed the model's weights "
            "(deterministic(seed, ...)) and the batch order (torch.Generator().manual_seed(seed))",
            lambda seed, steps=250: _reference(0, steps)),
]


def _as_pair(got, label):
    try:
        pair = [float(x) for x in got]
    except (TypeError, ValueError):
        pair = None
    if pair is None or len(pair) != 2:
        raise Fail(f"`alignment_crossing` on {label}: expected a pair of numbers (crossed, straight), "
                   f"got {type(got).__name__}")
    return torch.tensor(pair, dtype=torch.float64)


def _measure_crossing(ns):
    seed = int(torch.randint(0, 10_000, (1,), generator=_gen(403)))
    label = f"seed={seed}, steps={CHECK_STEPS}"
    learner = learner_of(ns)
    reply = learner.call("alignment_crossing", [[(seed, CHECK_STEPS), {}]])
    present(reply, "alignment_crossing")
    results = reply.get("results", [])
    if not results:
        raise Fail(f"`alignment_crossing`: the grader got no result for {label}")
    got = _as_pair(value_of(results[0], "alignment_crossing", label), label)

    want = _reference(seed, CHECK_STEPS)
    if mismatch(got, want, rtol=0.0, atol=TOLERANCE):
        found = diagnose(got, _CROSSING_MISTAKES, (seed, CHECK_STEPS), {}, rtol=0.0, atol=TOLERANCE)
        raise Fail(f"`alignment_crossing({seed}, {CHECK_STEPS})` returned crossed {got[0]:.3f}, straight {got[1]:.3f}; "
                   f"the grader's run of the same recipe with the reference attention gave crossed {want[0]:.3f}, "
                   f"straight {want[1]:.3f} (each must agree within {TOLERANCE}); the run uses your additive_scores "
                   f"and context_vector, so make their checks pass first", found)
    verdict = "the alignment crosses" if want[0] > want[1] else "this run did not cross"
    return (f"{label}: crossed {got[0]:.3f}, straight {got[1]:.3f}, within {TOLERANCE} of the grader's run "
            f"({want[0]:.3f}, {want[1]:.3f}): {verdict}")



TABLES = {
    "additive-score": Function("additive_scores", specs.additive_scores, _additive_cases, _ADDITIVE_MISTAKES),
    "context-vector": Function("context_vector", specs.context_vector, _context_cases, _CONTEXT_MISTAKES,
                               says="{n} cases match the spec, with padding, large scores and an empty row"),
    "decode-step": Function("decode_step", specs.decode_step, _decode_cases, _DECODE_MISTAKES,
                            says="{n} cases match the spec"),
    "alignment-crossing": Measured("experiment", _measure_crossing, {"alignment_crossing": _CROSSING_MISTAKES}),
}
