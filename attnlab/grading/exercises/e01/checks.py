"""The checks of exercise 01_soft_alignment: one table per graded part (:mod:`attnlab.grading.engine`), in
``TABLES``."""

from functools import lru_cache

import torch

from attnlab.attention import padding_mask
from attnlab.grading.core import (Fail, Mistake, diagnose, each_result, gen as _gen, mismatch, mistakes,
                                  randn as _randn, table)
from attnlab.grading.engine import Function, Measured
from attnlab.grading.exercises.e01 import spec as specs


def _decoder_inputs(g, b, n, dq, dk, a):
    """s (B, Dq), h (B, N, Dk), w (A, Dq), u (A, Dk), v (A,) drawn from ``g``."""
    return _randn(g, b, dq), _randn(g, b, n, dk), _randn(g, a, dq, scale=0.5), _randn(g, a, dk, scale=0.5), _randn(g, a)


def _additive_cases():
    # the first case is square (B = N, Dq = Dk = A) so that every known mistake runs on it and can be recognised
    return table(100, [(5, 5, 4, 4, 4, "square: B = N, Dq = Dk = A"), (3, 7, 4, 6, 5, "Dq != Dk"),
                       (1, 1, 3, 2, 8, "one source position"), (4, 9, 5, 5, 3, "A smaller than Dq")],
                 lambda g, b, n, dq, dk, a, what: (f"B={b}, N={n}, Dq={dq}, Dk={dk}, A={a}, {what}",
                                                   _decoder_inputs(g, b, n, dq, dk, a), {}))


_ADDITIVE_MISTAKES = [
    Mistake("no-tanh", "the tanh is missing: e_j = v^T tanh(W s + U h_j)",
            lambda s, h, w, u, v: ((s @ w.T)[:, None, :] + h @ u.T) @ v),
    Mistake("swapped-projections", "W projects the decoder state s, U the encoder states h",
            lambda s, h, w, u, v: torch.tanh((s @ u.T)[:, None, :] + h @ w.T) @ v),
    Mistake("softmax-applied", "return raw scores: the softmax comes later, in `context_vector`",
            lambda s, h, w, u, v: torch.softmax(specs.additive_scores(s, h, w, u, v), dim=-1)),
    Mistake("tanh-after-v", "the tanh goes before the dot product with v, not after",
            lambda s, h, w, u, v: torch.tanh(((s @ w.T)[:, None, :] + h @ u.T) @ v)),
    Mistake("query-not-broadcast", "W s (B, A) needs a position axis to add to U h (B, N, A): (s @ w.T)[:, None, :]",
            lambda s, h, w, u, v: torch.tanh(s @ w.T + h @ u.T) @ v),
    Mistake("not-transposed", "W and U are (A, Dq) and (A, Dk): the projections are s @ w.T and h @ u.T",
            lambda s, h, w, u, v: torch.tanh((s @ w)[:, None, :] + h @ u) @ v),
    Mistake("v-ignored", "the A-vector was summed: read it out with v (a dot product over the last axis)",
            lambda s, h, w, u, v: torch.tanh((s @ w.T)[:, None, :] + h @ u.T).sum(-1)),
]


def _context_cases():
    cases = []
    for seed, scale, (b, n, dk), lengths, label in [
            (200, 1.0, (3, 6, 4), None, "B=3, N=6, Dk=4, no mask"),
            (201, 1.0, (2, 1, 5), None, "B=2, N=1, Dk=5, no mask"),
            (202, 1.0, (4, 9, 3), None, "B=4, N=9, Dk=3, no mask"),
            (210, 1.0, (3, 7, 4), [5, 2, 7], "B=3, N=7 with padding (lengths 5, 2, 7)"),
            (211, 200.0, (2, 6, 3), None, "B=2, N=6, large scores (up to ~400): needs the max subtracted"),
            (212, 1.0, (2, 5, 3), [3, 0], "B=2, N=5 where row 1 has no real token (must give zero weights)")]:
        g = _gen(seed)
        cases.append((label, (_randn(g, b, n, scale=scale), _randn(g, b, n, dk)),
                      {} if lengths is None else {"mask": padding_mask(torch.tensor(lengths), n)}))
    return cases


def _ctx(weights, h):
    return (weights[:, :, None] * h).sum(dim=1), weights


def _masked(scores, mask, fill=float("-inf")):
    return scores if mask is None else scores.masked_fill(~mask, fill)


_CONTEXT_MISTAKES = [
    Mistake("wrong-axis", "the softmax runs over the wrong axis: normalise over the N source positions (dim=-1)",
            lambda sc, h, mask=None: _ctx(torch.softmax(_masked(sc, mask), dim=0), h)),
    Mistake("mask-after-softmax", "the mask is applied after the softmax: set masked scores to -inf before it",
            lambda sc, h, mask=None: _ctx(torch.softmax(sc, dim=-1) * (1.0 if mask is None else mask.float()), h)),
    Mistake("no-max-subtraction", "exp overflows on large scores: subtract each row's max before exp",
            lambda sc, h, mask=None: _ctx(_masked(sc, mask).exp() / _masked(sc, mask).exp().sum(-1, True), h)),
    Mistake("fully-masked-row", "a row with no real token gives NaN (0/0): it should give zero weights",
            lambda sc, h, mask=None: _ctx(torch.softmax(_masked(sc, mask), dim=-1), h)),
    Mistake("mask-inverted", "the mask is inverted: True marks a real token (keep it), False padding",
            lambda sc, h, mask=None: specs.context_vector(sc, h, None if mask is None else ~mask)),
    Mistake("masked-to-zero", "masked scores set to 0 still get weight (exp(0) = 1): set them to -inf",
            lambda sc, h, mask=None: _ctx(torch.softmax(_masked(sc, mask, 0.0), dim=-1), h)),
    Mistake("context-from-scores", "the context is weighted by the raw scores: weight h by the softmax weights",
            lambda sc, h, mask=None: (_ctx(_masked(sc, mask, 0.0), h)[0], specs.context_vector(sc, h, mask)[1])),
]


def _decode_case(g, b, n, dq, dk, a, lens, big):
    s, h, w, u, v = _decoder_inputs(g, b, n, dq, dk, a)
    w_s, w_c = _randn(g, dq, dq, scale=0.5), _randn(g, dq, dk, scale=0.5)
    return (f"B={b}, N={n}, Dq={dq}, Dk={dk}, A={a}" + (f", lengths {lens}" if lens else ", no mask")
            + (f", v x {big:g} (large scores)" if big != 1 else ""), (s, h, w, u, v * big, w_s, w_c),
            {} if lens is None else {"mask": padding_mask(torch.tensor(lens), n)})


def _decode_cases():
    # the first case is square so that every known mistake of the scores runs on it, with a sequence of no real
    # token (its context is zero); the last has scores of ~100, past float32's exp
    return table(300, [(4, 4, 4, 4, 4, [4, 0, 2, 3], 1.0), (2, 5, 4, 4, 3, None, 1.0), (3, 6, 5, 3, 4, [6, 2, 4], 1.0),
                       (1, 3, 2, 6, 5, None, 1.0), (2, 5, 4, 4, 3, [5, 3], 80.0)], _decode_case)


def _decode_with(update=lambda s, c, w_s, w_c: torch.tanh(s @ w_s.T + c @ w_c.T), score=specs.additive_scores,
                 context=specs.context_vector, raw=False):
    """A wrong state update, or a right one over a wrong part 1 or 2, or the raw scores returned as the weights."""
    def impl(s, h, w, u, v, w_s, w_c, mask=None):
        scores = score(s, h, w, u, v)
        c, weights = context(scores, h, mask)
        return update(s, c, w_s, w_c), scores if raw else weights
    return impl


_DECODE_MISTAKES = mistakes(_decode_with, [
    ("no-tanh", "the state update lost its tanh: s' = tanh(W_s s + W_c c)",
     {"update": lambda s, c, w_s, w_c: s @ w_s.T + c @ w_c.T}),
    ("mask-ignored", "pass the padding mask on: padded positions get weight",
     {"context": lambda sc, h, mask=None: specs.context_vector(sc, h)}),
    ("wrong-axis", "normalise over the N source positions", {"context": _CONTEXT_MISTAKES[0].impl}),
    ("swapped-update-weights", "W_s multiplies the old state, W_c the context",
     {"update": lambda s, c, w_s, w_c: torch.tanh(s @ w_c.T + c @ w_s.T)}),
    ("state-weights-transposed", "W_s is applied transposed: the old state's term is s @ w_s.T",
     {"update": lambda s, c, w_s, w_c: torch.tanh(s @ w_s + c @ w_c.T)}),
    ("scores-returned", "return the attention weights (after the softmax), not the raw scores", {"raw": True}),
    ("context-not-used", "the new state ignores the context: s' = tanh(W_s s + W_c c)",
     {"update": lambda s, c, w_s, w_c: torch.tanh(s @ w_s.T)}),
] + [  # a right decode_step that calls a wrong part 1 or part 2 (the learner's own, as the notebook has it)
    (f"{part}-wrong", f"decode_step looks right, but the {name} it calls is not: make check(\"{part}\") pass first",
     {arg: m.impl}) for part, name, arg, wrong in [("additive-score", "additive_scores", "score", _ADDITIVE_MISTAKES),
                                                    ("context-vector", "context_vector", "context", _CONTEXT_MISTAKES)]
    for m in wrong])


TOLERANCE = 0.05  # absolute, on each of the two masses (the notebook states it)
CHECK_STEPS = 150  # fewer than the default 250: a run that ignores `steps` shows


@lru_cache(maxsize=4)
def _alignments(seed, steps):
    return specs.probe_alignments(specs.train_rnnsearch(seed, steps))


def _crossing_with(seed=None, steps=None, shift=0, scale=1.0, flip=False):
    """alignment_crossing, float64, run with ``seed`` or ``steps``, rows read ``shift`` late, masses x ``scale``."""
    def impl(s, t=250):
        rolled = torch.roll(_alignments(s if seed is None else seed, t if steps is None else steps), shift, dims=1)
        masses = scale * torch.tensor(specs.swap_masses(rolled), dtype=torch.float64)
        return masses.flip(0) if flip else masses
    return impl


_CROSSING_MISTAKES = mistakes(_crossing_with, [
    ("masses-swapped", "return (crossed, straight), the crossed mass first", {"flip": True}),
    ("rows-off-by-one", "row i of the weights is French word i (the step that *outputs* it)", {"shift": 1}),
    ("sum-not-mean", "each pair's mass is the *mean* of its two rows' weights, not their sum", {"scale": 2.0}),
    ("untrained", "these are an untrained model's masses: train `steps` steps first", {"steps": 0}),
    ("steps-ignored", f"the run trained 250 steps where `steps` was {CHECK_STEPS}: pass `steps` on to the training",
     {"steps": 250}),
    ("seed-ignored", "the run did not start from `seed` (it matches seed 0): seed the model's weights "
     "(deterministic(seed, ...)) and the batch order (torch.Generator().manual_seed(seed))", {"seed": 0})])


def _measure_crossing(learner):
    """The learner's run on a salted seed against the grader's run of the same recipe with the reference attention."""
    seed = int(torch.randint(0, 10_000, (1,), generator=_gen(403)))
    label, args = f"seed={seed}, steps={CHECK_STEPS}", (seed, CHECK_STEPS)
    [(_, _, _, got)] = each_result(learner, "alignment_crossing", [(label, args, {})])
    want = _crossing_with()(*args)
    why = mismatch(got, want, rtol=0.0, atol=TOLERANCE)
    if why:
        raise Fail(f"`alignment_crossing({seed}, {CHECK_STEPS})`, (crossed, straight): {why}; the grader's run with "
                   f"the reference attention gave ({want[0]:.3f}, {want[1]:.3f}), each to agree within {TOLERANCE}; "
                   f"the run uses your additive_scores and context_vector, so make their checks pass first",
                   diagnose(got, _CROSSING_MISTAKES, args, {}, rtol=0.0, atol=TOLERANCE))
    crossed, straight = (float(x) for x in got)
    verdict = "the alignment crosses" if want[0] > want[1] else "this run did not cross"
    return (f"{label}: crossed {crossed:.3f}, straight {straight:.3f}, within {TOLERANCE} of the grader's run "
            f"({want[0]:.3f}, {want[1]:.3f}): {verdict}")


TABLES = {
    "additive-score": Function("additive_scores", specs.additive_scores, _additive_cases, _ADDITIVE_MISTAKES),
    "context-vector": Function("context_vector", specs.context_vector, _context_cases, _CONTEXT_MISTAKES,
                               says="{n} cases match the spec, with padding, large scores and an empty row"),
    "decode-step": Function("decode_step", specs.decode_step, _decode_cases, _DECODE_MISTAKES,
                            says="{n} cases match the spec"),
    "alignment-crossing": Measured("experiment", _measure_crossing, {"alignment_crossing": _CROSSING_MISTAKES}),
}
