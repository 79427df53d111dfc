"""The checks of every exercise part, and ``check(part)`` for notebooks.

``check("attention-masks")`` finds the learner's function in the notebook (the
caller's namespace), runs it against the spec of ``attnlab.grading.specs`` on
randomized inputs and edge cases, prints PASS or FAIL and, on a failure, the
likely mistake. ``attnlab grade`` runs the same checks itself, from a fresh
import, after the notebook has run: what a notebook prints is never trusted.

Example (in an exercise notebook)::

    from attnlab.grading import check
    check("attention-masks")
"""

import math
import os
import sys
from dataclasses import dataclass

import torch

from attnlab.grading import specs
from attnlab.grading.core import CheckResult, Fail, LocalLearner, Mistake, check_function, learner_of, run_part
from attnlab.grading.parts import TABLE, exercises, forbidden


@dataclass
class Part:
    id: str
    exercise: str
    title: str
    points: int
    names: tuple
    body: object = None  # body(ns) -> message; raises Fail


# part id -> Part, and exercise -> [part id, ...] in notebook order, from the table in parts.py
PARTS = {row[0]: Part(row[0], exercise, *row[1:]) for exercise, rows in TABLE.items() for row in rows}
EXERCISES = exercises()


def part(part_id):
    """Register the check body of a part listed in ``parts.TABLE``."""

    def register(body):
        if part_id not in PARTS:
            raise KeyError(f"part {part_id!r} is not in attnlab/grading/parts.py")
        PARTS[part_id].body = body
        return body

    return register


def run_check(part_id, ns, salt=0):
    """Run the check of ``part_id``; returns a CheckResult.

    ``ns``: the learner's names (a dict, checked in this process with the part's tripwires),
    or a learner object (the grader's, whose calls run in the learner's kernel). ``salt``
    shifts every random input: the grader draws it from a secret, so a notebook cannot know
    the inputs in advance; 0 (the inline check) gives the same inputs every time.
    """
    global _SALT
    _load_all()
    if part_id not in PARTS:
        known = ", ".join(sorted(PARTS))
        raise ValueError(f"part_id: unknown exercise part {part_id!r}; known parts: {known}")
    learner = learner_of(ns)
    if isinstance(learner, LocalLearner) and learner.forbidden is None:
        learner.forbidden = forbidden(part_id)
    _SALT = int(salt) % (2**62)
    try:
        return run_part(part_id, PARTS[part_id].body, learner)
    finally:
        _SALT = 0


def check(part_id, namespace=None):
    """Check one exercise part against its spec and print what was found.

    Looks the learner's functions up in ``namespace`` (default: the caller's
    globals, i.e. the notebook). Under nbgrader's autograder a failure raises
    AssertionError, so nbgrader can award the cell's points. Returns None.
    """
    if os.environ.get("ATTNLAB_GRADING") == "1" or specs.HIDDEN:
        print(f"[....] {part_id}: checked by `attnlab grade` itself, in its own process")
        return None
    ns = namespace if namespace is not None else sys._getframe(1).f_globals
    result = run_check(part_id, ns)
    print(result.report())
    if not result.passed and (os.environ.get("NBGRADER_EXECUTION") or os.environ.get("NBGRADER_VALIDATING")):
        raise AssertionError(result.report())
    return None


def _load_all():
    # the Triton parts' checks live in their own module (it imports triton only when a check runs)
    if PARTS["block-sparse-loop"].body is None:
        from attnlab.grading import checks_triton  # noqa: F401


_SALT = 0  # set by run_check for the grader (a secret), 0 for the inline check


def _gen(seed):
    return torch.Generator().manual_seed((seed + _SALT * 7919) % (2**63))


def _randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


# ---------------------------------------------------------------------------
# 01 soft alignment
# ---------------------------------------------------------------------------


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


@part("additive-score")
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
    mask = specs.padding_mask(lengths, 7)
    cases.append(("B=3, N=7 with padding (lengths 5, 2, 7)", (_randn(g, 3, 7), _randn(g, 3, 7, 4)), {"mask": mask}))
    g = _gen(211)
    cases.append(("B=2, N=6, large scores (up to ~400): needs the max subtracted",
                  (_randn(g, 2, 6, scale=200.0), _randn(g, 2, 6, 3)), {}))
    g = _gen(212)
    mask = specs.padding_mask(torch.tensor([3, 0]), 5)
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


@part("context-vector")
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
        kwargs = {} if lens is None else {"mask": specs.padding_mask(torch.tensor(lens), n)}
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


@part("decode-step")
def _check_decode(ns):
    n = check_function(ns, "decode_step", specs.decode_step, _decode_cases(), _DECODE_MISTAKES)
    return f"{n} cases match the spec"


# ---------------------------------------------------------------------------
# 02 queries, keys and values
# ---------------------------------------------------------------------------


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


@part("padding-mask")
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


@part("causal-mask")
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


@part("attention-masks")
def _check_masked_attention(ns):
    n = check_function(ns, "masked_attention", specs.masked_attention, _attention_cases(), _MASKED_ATTENTION_MISTAKES)
    return f"{n} cases match the spec (no mask, padding, causal, a fully masked row)"


# ---------------------------------------------------------------------------
# 03 scaled dot-product attention
# ---------------------------------------------------------------------------


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


@part("stable-softmax")
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


@part("scaled-attention")
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


@part("variance-experiment")
def _check_variance(ns):
    n = check_function(ns, "score_variance", specs.score_variance, _variance_cases(), _VARIANCE_MISTAKES)
    return f"{n} cases match the spec"


# ---------------------------------------------------------------------------
# 04 multi-head attention
# ---------------------------------------------------------------------------


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


@part("split-heads")
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


@part("merge-heads")
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
            s = s.masked_fill(~specs.causal_mask(x.shape[1], x.shape[1]), float("-inf"))
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


@part("mha-forward")
def _check_mha(ns):
    n = check_function(ns, "multi_head_attention", specs.multi_head_attention, _mha_cases(), _MHA_MISTAKES)
    return f"{n} cases match the spec, causal and not"


# ---------------------------------------------------------------------------
# 05 the quadratic cost
# ---------------------------------------------------------------------------

_SIZES = [(1, 1, 1024, 64), (2, 8, 512, 128), (4, 12, 2048, 64), (1, 2, 100, 30)]


def _size_cases(with_elem=False):
    cases = []
    for i, (b, h, n, d) in enumerate(_SIZES):
        if with_elem:
            es = [4, 2, 2, 1][i]
            cases.append((f"batch={b}, heads={h}, n={n}, d={d}, element_size={es}", (b, h, n, d, es), {}))
        else:
            cases.append((f"batch={b}, heads={h}, n={n}, d={d}", (b, h, n, d), {}))
    return cases


_FLOPS_MISTAKES = [
    Mistake("multiply-add-once", "a multiply-add counts as 2 FLOPs (or: both matmuls, QK^T and PV, must be counted)",
            lambda b, h, n, d: b * h * 2 * n * n * d),
    Mistake("swapped-n-d", "n and d are swapped: each matmul costs 2 n^2 d, quadratic in the sequence length",
            lambda b, h, n, d: b * h * 4 * n * d * d),
    Mistake("per-head-only", "this is one head of one sequence: multiply by batch and heads",
            lambda b, h, n, d: 4 * n * n * d),
]


@part("attention-flops")
def _check_flops(ns):
    n = check_function(ns, "attention_flops", specs.attention_flops, _size_cases(), _FLOPS_MISTAKES)
    return f"{n} sizes match the spec"


_BYTES_MISTAKES = [
    Mistake("elements-not-bytes", "this counts elements: multiply by element_size",
            lambda b, h, n, d, es=4: specs.attention_bytes(b, h, n, d, 1)),
    Mistake("writes-only", "only the writes are counted: S and P are also read back, and Q, K, V read",
            lambda b, h, n, d, es=4: b * h * (2 * n * n + n * d) * es),
    Mistake("matrices-only", "only S and P are counted: Q, K, V are read and O written too (4nd elements)",
            lambda b, h, n, d, es=4: b * h * 4 * n * n * es),
    Mistake("per-head-only", "this is one head of one sequence: multiply by batch and heads",
            lambda b, h, n, d, es=4: (4 * n * d + 4 * n * n) * es),
]


@part("attention-bytes")
def _check_bytes(ns):
    n = check_function(ns, "attention_bytes", specs.attention_bytes, _size_cases(True), _BYTES_MISTAKES)
    return f"{n} sizes match the spec"


_INTENSITY_MISTAKES = [
    Mistake("inverted-ratio", "this is bytes per FLOP: arithmetic intensity is FLOPs / bytes",
            lambda b, h, n, d, es=4: specs.attention_bytes(b, h, n, d, es) / specs.attention_flops(b, h, n, d)),
    Mistake("elements-not-bytes", "divide by bytes, not elements",
            lambda b, h, n, d, es=4: specs.attention_flops(b, h, n, d) / specs.attention_bytes(b, h, n, d, 1)),
    Mistake("multiply-add-once", "a multiply-add counts as 2 FLOPs",
            lambda b, h, n, d, es=4: specs.attention_flops(b, h, n, d) / 2 / specs.attention_bytes(b, h, n, d, es)),
]

_BOUND_CASES = [
    ("intensity 10 FLOP/B on 100 TFLOP/s and 2 TB/s", (10.0, 100e12, 2e12), {}),
    ("intensity 200 FLOP/B on 100 TFLOP/s and 2 TB/s", (200.0, 100e12, 2e12), {}),
    ("intensity 5 FLOP/B on 8 TFLOP/s and 0.3 TB/s", (5.0, 8e12, 0.3e12), {}),
    ("intensity 40 FLOP/B on 8 TFLOP/s and 0.3 TB/s", (40.0, 8e12, 0.3e12), {}),
]

_BOUND_MISTAKES = [
    Mistake("comparison-flipped", "the comparison is flipped: below the ridge point a kernel is memory-bound",
            lambda i, p, bw: i > p / bw),
    Mistake("ridge-inverted", "the ridge point is peak_flops / bandwidth (FLOP per byte), not its inverse",
            lambda i, p, bw: i < bw / p),
]


@part("arithmetic-intensity")
def _check_intensity(ns):
    n = check_function(ns, "arithmetic_intensity", specs.arithmetic_intensity, _size_cases(True), _INTENSITY_MISTAKES)
    n += check_function(ns, "is_memory_bound", specs.is_memory_bound, _BOUND_CASES, _BOUND_MISTAKES)
    return f"{n} cases match the spec"


__all__ = ["check", "run_check", "PARTS", "EXERCISES", "CheckResult", "Fail"]
