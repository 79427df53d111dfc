"""The checks of exercise 04_multi_head: one table per graded part (:mod:`attnlab.grading.engine`), in ``TABLES``."""

import functools
import math

import torch

from attnlab.attention import causal_mask
from attnlab.grading import engine
from attnlab.grading.core import Mistake, NotDone, gen, randn, salted_ints
from attnlab.grading.engine import Function, InTurn, Measured
from attnlab.grading.exercises.e04 import spec as specs


# -------------------------------------------------------------------------------------------- split-heads, merge-heads

def _split_cases():
    return [(f"x of shape ({b}, {n}, {d}), {h} heads{note}", (randn(gen(800 + seed), b, n, d), h), {})
            for seed, (b, n, d, h, note) in enumerate([(2, 5, 12, 3, ""), (1, 4, 8, 2, ""), (3, 6, 16, 4, ", d_head = "
                                                       "h"), (2, 3, 6, 1, ", one head"), (1, 3, 4, 4, ", d_head = 1")])]


def _view(x, h, swapped=False):
    """x (B, N, d_model) viewed as (B, N, h, dh), or as (B, N, dh, h) when ``swapped``."""
    return x.reshape(x.shape[0], x.shape[1], *((x.shape[2] // h, h) if swapped else (h, x.shape[2] // h)))


_SPLIT_MISTAKES = [
    Mistake("heads-order", "reshaped straight to (B, h, N, dh): that mixes positions into heads. View as "
            "(B, N, h, dh) first, then swap N and h",
            lambda x, h: x.reshape(x.shape[0], h, x.shape[1], x.shape[2] // h)),
    Mistake("interleaved-heads", "the heads are interleaved: head i must hold the contiguous features "
            "[i*dh, (i+1)*dh), i.e. view as (B, N, h, dh), not (B, N, dh, h)",
            lambda x, h: _view(x, h, swapped=True).permute(0, 3, 1, 2)),
    Mistake("transposed", "the last two dims are swapped: the result must be (B, h, N, dh), not (B, h, dh, N)",
            lambda x, h: _view(x, h).permute(0, 2, 3, 1)),
    Mistake("no-transpose", "the heads axis must come second: (B, N, h, dh) -> (B, h, N, dh)", _view),
    Mistake("heads-in-batch", "the heads are folded into the batch, (B*h, N, dh): keep them as their own axis, "
            "(B, h, N, dh)", lambda x, h: _view(x, h).transpose(1, 2).reshape(-1, x.shape[1], x.shape[2] // h)),
    Mistake("h-and-dh-swapped", "num_heads is used as the head size: the last axis is cut into (d_model/h, h) "
            "pieces of h features; cut it into h heads of d_model/h features",
            lambda x, h: _view(x, h, swapped=True).transpose(1, 2)),
]


def _merge_cases():
    return [(f"x of shape ({b}, {h}, {n}, {dh}){note}", (randn(gen(900 + seed), b, h, n, dh),), {})
            for seed, (b, h, n, dh, note) in enumerate([(2, 3, 5, 4, ""), (1, 2, 4, 4, ""), (3, 4, 6, 2, ""),
                                                        (2, 1, 3, 5, ", one head"), (1, 4, 3, 1, ", d_head = 1")])]


_MERGE_MISTAKES = [
    Mistake("heads-order", "reshaped without moving the heads back: swap h and N (transpose(1, 2)) before "
            "reshaping to (B, N, h*dh)", lambda x: x.reshape(x.shape[0], x.shape[2], x.shape[1] * x.shape[3])),
    Mistake("interleaved-heads", "the heads are interleaved: concatenate head 0's dh features, then head 1's, ...",
            lambda x: x.permute(0, 2, 3, 1).reshape(x.shape[0], x.shape[2], -1)),
    Mistake("summed-heads", "the heads are summed; they are concatenated", lambda x: x.sum(dim=1)),
    Mistake("averaged-heads", "the heads are averaged; they are concatenated", lambda x: x.mean(dim=1)),
    Mistake("concatenated-positions", "the heads are concatenated along the sequence axis, (B, h*N, dh): "
            "concatenate their features, (B, N, h*dh)", lambda x: torch.cat(x.unbind(1), dim=1)),
    Mistake("heads-reversed", "the heads come out in reverse order: head 0's features go first",
            lambda x: x.flip(1).transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)),
]


# -------------------- mha-forward: the learner's module, built by the notebook's mha_forward with the grader's weights

def _mha_cases():
    per_head = torch.rand(2, 2, 4, 4, generator=gen(1100)) < 0.6
    per_head[0, 1, 2] = False   # one fully masked row
    rows = [  # (label, (B, Nq, Nk, d_model, h), options; lengths: key padding, cross: a distinct key and value)
        ("self-attention, no mask", (2, 5, 5, 12, 3), {}),
        ("causal self-attention", (1, 6, 6, 16, 4), {"causal": True}),
        ("key padding mask, lengths [6, 3], shape (B, 1, 1, Nk)", (2, 6, 6, 16, 2), {"lengths": [6, 3]}),
        ("cross-attention, Nq=3, Nk=7, distinct key and value, padding lengths [7, 4]", (2, 3, 7, 8, 2),
         {"cross": True, "lengths": [7, 4]}),
        ("causal and padding (lengths [5, 2]) together", (2, 5, 5, 8, 2), {"causal": True, "lengths": [5, 2]}),
        ("causal cross-attention, Nq=4 < Nk=6 (top-left: query i sees keys j <= i)", (1, 4, 6, 8, 4),
         {"cross": True, "causal": True}),
        ("a per-head mask (B, h, Nq, Nk) with one fully masked row", (2, 4, 4, 8, 2), {"mask": per_head}),
        ("a sequence of length 0 (padding lengths [4, 0]): its rows are fully masked", (2, 4, 4, 8, 2),
         {"lengths": [4, 0]}),
        ("no biases (bias=False)", (2, 5, 5, 8, 2), {"bias": False}),
        ("d_head = 1 (h = d_model = 4), causal", (2, 5, 5, 4, 4), {"causal": True}),
        ("large logits (weights x 30)", (1, 6, 6, 8, 2), {"scale": 30.0}),
    ]
    cases = []
    for seed, (label, (b, nq, nk, d, h), opts) in enumerate(rows):
        g, state = gen(1000 + seed), {}
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            state[f"{name}.weight"] = randn(g, d, d, scale=opts.get("scale", 1.0) * d ** -0.5)
            if opts.get("bias", True):
                state[f"{name}.bias"] = randn(g, d, scale=0.1)
        query, kwargs = randn(g, b, nq, d), {"causal": True} if opts.get("causal") else {}
        if "lengths" in opts:                                                            # (B, 1, 1, Nk)
            opts["mask"] = (torch.arange(nk) < torch.tensor(opts["lengths"])[:, None])[:, None, None, :]
        if "mask" in opts:
            kwargs["mask"] = opts["mask"]
        if opts.get("cross"):
            kwargs["key"], kwargs["value"] = randn(g, b, nk, d), randn(g, b, nk, d)
        cases.append((f"{label}: query ({b}, {nq}, {d}), {h} heads", (state, h, query), kwargs))
    return cases


def _mha_with(wrong=None):
    """A multi-head attention with the mistake ``wrong`` (its key) made; ``_mha_with()`` is the spec."""
    def impl(state, num_heads, query, key=None, value=None, mask=None, causal=False):
        key = query if key is None else key
        value = key if (value is None or wrong == "value-from-key") else value

        def linear(name, x):
            bias = None if wrong == "biases-ignored" else state.get(f"{name}.bias")
            return x @ state[f"{name}.weight"].T + (0 if bias is None else bias)

        q, k, v = (specs.split_heads(linear(n, t), num_heads)
                   for n, t in (("q_proj", query), ("k_proj", key), ("v_proj", value)))   # (B, h, N, dh)
        scale = {"scale-d-model": query.shape[-1] ** -0.5, "scale-forgotten": 1.0}.get(wrong, q.shape[-1] ** -0.5)
        s = q @ k.transpose(-2, -1) * scale                                              # (B, h, Nq, Nk)
        nq, nk = s.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool)
        if causal and wrong != "causal-ignored":
            keep = keep.tril(nk - nq if wrong == "causal-bottom-right" else 0)
        if mask is not None and wrong != "mask-ignored":
            keep = keep & (~mask if wrong == "mask-inverted" else mask)
        w = torch.softmax(s.masked_fill(~keep, 0.0 if wrong == "mask-filled-with-zero" else float("-inf")), dim=-1)
        o = (w if wrong == "nan-rows" else torch.nan_to_num(w, nan=0.0)) @ v             # (B, h, Nq, dh)
        o = o.reshape(o.shape[0], o.shape[2], -1) if wrong == "heads-order" else specs.merge_heads(o)
        return o if wrong == "no-output-projection" else linear("out_proj", o)
    return impl


_MHA_MISTAKES = [Mistake(key, message, _mha_with(key)) for key, message in [
    ("scale-d-model", "the scale uses d_model; each head scales by 1/sqrt(d_head)"),
    ("scale-forgotten", "the 1/sqrt(d_head) scale is forgotten"),
    ("heads-order", "heads merged in the wrong order: (B, h, N, dh) -> transpose(1, 2) -> (B, N, h*dh)"),
    ("no-output-projection", "the output projection out_proj is missing"),
    ("causal-ignored", "causal=True is ignored: mask out the keys after the query"),
    ("causal-bottom-right", "the causal mask is aligned bottom-right (query i sees keys j <= i + Nk - Nq); in this "
     "course it is top-left: query i sees keys j <= i"),
    ("mask-ignored", "the mask argument is ignored"),
    ("mask-inverted", "the mask is inverted: True means attend (keep), False means masked out"),
    ("mask-filled-with-zero", "masked scores are set to 0; a score of 0 still gets weight exp(0). Fill them with -inf"),
    ("nan-rows", "a fully masked row gives NaN (softmax of all -inf): such a row attends to nothing, so its weights "
     "must be 0 (torch.nan_to_num, or torch.where on the row's mask)"),
    ("value-from-key", "the values are projected from `key`: project `value` (it defaults to key only when None)"),
    ("biases-ignored", "the Linear layers' biases are not used: call the nn.Linear layers (or add .bias)"),
]]


def _module_written(table):
    """``table``, whose mha_forward the notebook gives: what is not implemented yet is the module it builds."""
    def measure(learner):
        try:
            return engine.run(table, learner)
        except NotDone as exc:
            raise NotDone(exc.message.replace(f"`{table.name}` is not implemented yet",
                                              "your `MultiHeadAttention` is not implemented yet")) from None
    return Measured("function", measure, {table.name: list(table.mistakes)})


# ------------------------------------------------------------------------------------------------------------ mha-cost

def _param_cases():
    h, k = salted_ints(4100, (2, 6), (1, 9))   # and one size no one knows
    return [("d_model=512, 8 heads", (512, 8), {}), ("d_model=512, 1 head", (512, 1), {}),
            ("d_model=64, 4 heads, bias=False", (64, 4), {"bias": False}),
            ("d_model=96, 12 heads", (96, 12), {"bias": True}), ("d_model=6, 3 heads", (6, 3), {}),
            (f"d_model={2 * h * k}, {h} heads", (2 * h * k, h), {})]


def _params(d, h, bias=True, *, layers=4, width=None):
    w = d if width is None else width   # the output features of each layer
    return layers * (d * w + (w if bias else 0))


_PARAM_MISTAKES = [
    Mistake("per-head-matrices", "each head does not have its own d_model x d_model matrices: head i owns a "
            "d_head-wide slice of each projection, so the count does not depend on num_heads",
            lambda d, h, bias=True: h * _params(d, h, bias)),
    Mistake("biases-forgotten", "with bias=True each of the four Linear layers also has d_model biases",
            lambda d, h, bias=True: _params(d, h, False)),
    Mistake("output-projection-forgotten", "four Linear layers: q_proj, k_proj, v_proj and out_proj",
            lambda d, h, bias=True: _params(d, h, bias, layers=3)),
    Mistake("one-head-slice", "this is one head's slice (d_model x d_head per projection); all h heads together "
            "fill d_model x d_model", lambda d, h, bias=True: _params(d, h, bias, width=d // h)),
    Mistake("biases-always", "bias=False: the Linear layers have no biases", lambda d, h, bias=True: _params(d, h)),
]


def _flop_cases():
    b, nq, nk, h, k = salted_ints(4101, (1, 3), (5, 60), (5, 60), (2, 6), (1, 8))
    return [("batch=1, n_q=n_k=128, d_model=512, 8 heads", (1, 128, 128, 512, 8), {}),
            ("batch=1, n_q=n_k=128, d_model=512, 1 head", (1, 128, 128, 512, 1), {}),
            ("batch=2, n_q=3, n_k=7 (cross-attention), d_model=16, 4 heads", (2, 3, 7, 16, 4), {}),
            ("batch=4, n_q=n_k=2048, d_model=768, 12 heads", (4, 2048, 2048, 768, 12), {}),
            ("batch=1, n_q=1000, n_k=10, d_model=64, 2 heads", (1, 1000, 10, 64, 2), {}),
            (f"batch={b}, n_q={nq}, n_k={nk}, d_model={2 * h * k}, {h} heads", (b, nq, nk, 2 * h * k, h), {})]


def _flops(b, nq, nk, d, h, *, proj=2, attn=4, kv_from_q=False, out=True, heads_wide=False, batch=True, bias=0,
           per_score=0):
    """The matmul FLOPs (2 per multiply-add), with switches for the mistakes: ``bias`` additions per projected row
    and feature, ``per_score`` FLOPs per score (the softmax, the scale)."""
    rows = (1 + out) * nq + 2 * (nq if kv_from_q else nk)     # the rows projected: by q_proj, out_proj, k_proj, v_proj
    one = (proj * d * d * rows + attn * nq * nk * d * (h if heads_wide else 1) + bias * d * (2 * nq + 2 * nk)
           + per_score * h * nq * nk)
    return (b if batch else 1) * one


_FLOP_MISTAKES = [Mistake(key, message, functools.partial(_flops, **switch)) for key, message, switch in [
    ("multiply-add-once", "a multiply-add is 2 FLOPs: a (m, k) @ (k, n) matmul costs 2*m*n*k", dict(proj=1, attn=2)),
    ("projections-forgotten", "the four projections are matmuls too: 2*d_model^2 FLOPs per row projected",
     dict(proj=0)),
    ("attention-forgotten", "QK^T and PV are missing: 4*n_q*n_k*d_model FLOPs over all heads", dict(attn=0)),
    ("query-length-everywhere", "the key and value projections run on the n_k rows of the keys, not on n_q rows",
     dict(kv_from_q=True)),
    ("full-width-per-head", "each head's QK^T and PV run in d_head = d_model/h dimensions, not d_model: over h heads "
     "that is d_model once", dict(heads_wide=True)),
    ("output-projection-forgotten", "the output projection (2*n_q*d_model^2) is missing", dict(out=False)),
    ("batch-forgotten", "multiply by the batch", dict(batch=False)),
    ("bias-additions-counted", "the bias additions are counted: the part counts matmul FLOPs only, as "
     "FlopCounterMode does (not the softmax, the scale or the biases)", dict(bias=1)),
] + [  # a few FLOPs per score (exp, sum, divide, the max, the scale ...), whichever number the learner chose
    ("softmax-counted", "the softmax (or the scale) is counted: the part counts matmul FLOPs only, as FlopCounterMode "
     "does, and the softmax and the scale are not matmuls", dict(per_score=per)) for per in range(1, 7)
]]


# ------------------------- head-specialisation: the learner trains and measures; the grader trains the library's model

TOLERANCE = 0.1   # absolute, on every entry of the (h, 3) profile
_trained = functools.lru_cache(maxsize=8)(specs.trained_model)   # (seed, num_heads, steps): one training each


def _reference(seed, num_heads=2, steps=200):
    """specs.head_specialisation on the cached training (the mistakes reuse it)."""
    return specs.profile(specs.attention_weights(*_trained(seed, num_heads, steps)))


def _profile_with(seed, num_heads=2, steps=200, *, causal=True, softmax=True, ahead=False, summed=False):
    """A wrong experiment: the grader's trained model, layer 0's weights recomputed from its q/k projections with
    switches (``ahead``: on keys i+1, i+2; ``summed``: over the sequences and positions, not averaged)."""
    model, tokens = _trained(seed, num_heads, steps)
    with torch.no_grad():
        n, block = tokens.shape[1], model.blocks[0]
        x = block.ln_attn(model.tok_emb(tokens) + model.pos_emb(torch.arange(n)))
        q, k = (specs.split_heads(proj(x), num_heads) for proj in (block.attn.q_proj, block.attn.k_proj))
        w = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            w = w.masked_fill(~causal_mask(n, n), float("-inf") if softmax else 0.0)
        w = torch.softmax(w, dim=-1) if softmax else w
    if not (ahead or summed):
        return specs.profile(w)
    reduce = functools.partial(torch.sum if summed else torch.mean, dim=(0, 2))
    near, far = reduce(w.diagonal(1 if ahead else -1, dim1=-2, dim2=-1)[..., 0 if ahead else 1:]), reduce(
        w.diagonal(2 if ahead else -2, dim1=-2, dim2=-1))
    rows = torch.stack([near, far, (w.shape[0] * (n - 2) if summed else 1) - near - far], dim=1)
    return rows[rows[:, 0].argsort(descending=True)]


_HEAD_MISTAKES = [
    Mistake("no-causal-mask", "the weights are recomputed without the causal mask: the model was trained causal, "
            "so its queries never saw later keys", functools.partial(_profile_with, causal=False)),
    Mistake("untrained", "this is the profile of the model before training: train it first (train_previous_two)",
            lambda seed, num_heads=2, steps=200: _profile_with(seed, num_heads, 0)),
    Mistake("no-softmax", "these are raw scores, not attention weights: apply the softmax over the keys",
            functools.partial(_profile_with, softmax=False)),
    Mistake("heads-averaged", "the heads are averaged: return one row per head, shape (h, 3)",
            lambda *args, **kwargs: _reference(*args, **kwargs).mean(dim=0, keepdim=True)),
    Mistake("summed-not-averaged", "the weights are summed over the test sequences and positions: average them "
            "(each entry is a fraction of a query's weight, between 0 and 1)",
            functools.partial(_profile_with, summed=True)),
    Mistake("future-diagonal", "diagonal(+1) is key i+1 (after the query, masked): key i-1 is diagonal(-1)",
            functools.partial(_profile_with, ahead=True)),
]


def _head_cases():
    g = gen(1200)
    return [(f"seed={s}, 2 heads, 200 steps", (s,), {"num_heads": 2, "steps": 200})
            for s in [int(torch.randint(0, 10_000, (1,), generator=g)) for _ in range(2)]]


TABLES = {
    "split-heads": Function("split_heads", specs.split_heads, _split_cases, _SPLIT_MISTAKES, rtol=0, atol=0,
                            says="{n} cases match the spec (1 head, d_head = 1 and d_head = h among them)"),
    "merge-heads": Function("merge_heads", specs.merge_heads, _merge_cases, _MERGE_MISTAKES, rtol=0, atol=0,
                            says="{n} cases match the spec"),
    "mha-forward": _module_written(Function(
        "mha_forward", specs.mha_forward, _mha_cases, _MHA_MISTAKES,
        says="{n} cases match the spec: masks, causal, cross-attention, fully masked rows, no biases, large logits")),
    "mha-cost": InTurn("{n} cases match torch's own counts (the parameters of the module, FlopCounterMode's FLOPs)", (
        Function("mha_parameters", specs.mha_parameters, _param_cases, _PARAM_MISTAKES, ordered=True),
        Function("mha_flops", specs.mha_flops, _flop_cases, _FLOP_MISTAKES, ordered=True))),
    "head-specialisation": Function("head_specialisation", _reference, _head_cases, _HEAD_MISTAKES, rtol=0,
                                    atol=TOLERANCE, says=f"{{n}} seeds: your profiles match the grader's own training "
                                    f"of the same model within {TOLERANCE} on every entry"),
}
