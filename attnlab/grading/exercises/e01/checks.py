"""The checks of exercise 01_soft_alignment (one ``@CHECKS(part id)`` per graded part)."""


import torch

from attnlab.grading.core import Mistake, Registry, check_function, gen as _gen, randn as _randn
from attnlab.grading.exercises.e01 import spec as specs
from attnlab.grading.exercises.e02.spec import padding_mask

CHECKS = Registry()


def _additive_params(g, dq, dk, a):
    return _randn(g, a, dq, scale=0.5), _randn(g, a, dk, scale=0.5), _randn(g, a)


def _additive_cases():
    cases = []
    # the first case has Dq == Dk so that swapped projections run and can be recognised
    for seed, (b, n, dq, dk, a) in enumerate([(2, 5, 6, 6, 4), (3, 7, 4, 6, 5), (1, 1, 3, 2, 8), (4, 9, 5, 5, 3)]):
        g = _gen(100 + seed)
        s, h = _randn(g, b, dq), _randn(g, b, n, dk)
        w, u, v = _additive_params(g, dq, dk, a)
        cases.append((f"B={b}, N={n}, Dq={dq}, Dk={dk}, A={a} (seed {100 + seed})", (s, h, w, u, v), {}))
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
]


@CHECKS("additive-score")
def _check_additive(ns):
    n = check_function(ns, "additive_scores", specs.additive_scores, _additive_cases(), _ADDITIVE_MISTAKES)
    return f"{n} randomized cases match the spec"


def _context_cases():
    cases = []
    for seed, (b, n, dk) in enumerate([(3, 6, 4), (2, 1, 5), (4, 9, 3)]):
        g = _gen(200 + seed)
        cases.append((f"B={b}, N={n}, Dk={dk}, no mask (seed {200 + seed})", (_randn(g, b, n), _randn(g, b, n, dk)), {}))
    g = _gen(210)
    lengths = torch.tensor([5, 2, 7])
    mask = padding_mask(lengths, 7)
    cases.append(("B=3, N=7 with padding (lengths 5, 2, 7)", (_randn(g, 3, 7), _randn(g, 3, 7, 4)), {"mask": mask}))
    g = _gen(211)
    cases.append(("B=2, N=6, large scores (up to ~400): needs the max subtracted",
                  (_randn(g, 2, 6, scale=200.0), _randn(g, 2, 6, 3)), {}))
    g = _gen(212)
    mask = padding_mask(torch.tensor([3, 0]), 5)
    cases.append(("B=2, N=5 where row 1 has no real token (must give zero weights)",
                  (_randn(g, 2, 5), _randn(g, 2, 5, 3)), {"mask": mask}))
    return cases


def _naive_softmax(x, dim=-1):
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def _ctx_from_weights(weights, h):
    return (weights[:, :, None] * h).sum(dim=1), weights


def _masked_scores(scores, mask):
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


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
]


@CHECKS("context-vector")
def _check_context(ns):
    n = check_function(ns, "context_vector", specs.context_vector, _context_cases(), _CONTEXT_MISTAKES)
    return f"{n} cases match the spec, with padding, large scores and an empty row"


def _decode_cases():
    cases = []
    for seed, (b, n, dq, dk, a, lens) in enumerate([(2, 5, 4, 4, 3, None), (3, 6, 5, 3, 4, [6, 2, 4]), (1, 3, 2, 6, 5, None)]):
        g = _gen(300 + seed)
        s, h = _randn(g, b, dq), _randn(g, b, n, dk)
        w, u, v = _additive_params(g, dq, dk, a)
        w_s, w_c = _randn(g, dq, dq, scale=0.5), _randn(g, dq, dk, scale=0.5)
        kwargs = {} if lens is None else {"mask": padding_mask(torch.tensor(lens), n)}
        cases.append((f"B={b}, N={n}, Dq={dq}, Dk={dk}" + (f", lengths {lens}" if lens else ""),
                      (s, h, w, u, v, w_s, w_c), kwargs))
    return cases


def _decode_with(weights_fn, update_fn):
    def impl(s, h, w, u, v, w_s, w_c, mask=None):
        scores = specs.additive_scores(s, h, w, u, v)
        weights = weights_fn(scores, mask)
        c = (weights[:, :, None] * h).sum(dim=1)
        return update_fn(s, c, w_s, w_c), weights
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
]


@CHECKS("decode-step")
def _check_decode(ns):
    n = check_function(ns, "decode_step", specs.decode_step, _decode_cases(), _DECODE_MISTAKES)
    return f"{n} cases match the spec"
