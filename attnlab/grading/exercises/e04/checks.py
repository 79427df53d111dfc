"""The checks of exercise 04_multi_head: one table per graded part (:mod:`attnlab.grading.engine`), in ``TABLES``."""

import functools
import math

import torch

from attnlab.attention import causal_mask
from attnlab.grading import engine
from attnlab.grading.core import Mistake, NotDone, gen, mistakes, randn, salted_ints, table
from attnlab.grading.engine import Function, InTurn, Measured
from attnlab.grading.exercises.e04 import spec as specs


def _split_cases():
    return table(800, [(2, 5, 12, 3, ""), (1, 4, 8, 2, ""), (3, 6, 16, 4, ", d_head = h"), (2, 3, 6, 1, ", one head"),
                       (1, 3, 4, 4, ", d_head = 1")], lambda g, b, n, d, h, note: (
        f"x of shape ({b}, {n}, {d}), {h} heads{note}", (randn(g, b, n, d), h), {}))


def _view(x, h, swapped=False):
    """x (B, N, d_model) viewed as (B, N, h, dh), or as (B, N, dh, h) when ``swapped``."""
    return x.reshape(x.shape[0], x.shape[1], *((x.shape[2] // h, h) if swapped else (h, x.shape[2] // h)))


_SPLIT_MISTAKES = [Mistake(*row) for row in [
    ("heads-order", "a straight reshape to (B, h, N, dh) mixes positions into heads: view as (B, N, h, dh), swap "
     "N and h", lambda x, h: x.reshape(x.shape[0], h, x.shape[1], x.shape[2] // h)),
    ("interleaved-heads", "head i holds the features [i*dh, (i+1)*dh): view as (B, N, h, dh), not (B, N, dh, h)",
     lambda x, h: _view(x, h, swapped=True).permute(0, 3, 1, 2)),
    ("transposed", "the last two dims are swapped: (B, h, N, dh)", lambda x, h: _view(x, h).permute(0, 2, 3, 1)),
    ("no-transpose", "the heads axis must come second: (B, N, h, dh) -> (B, h, N, dh)", _view),
    ("heads-in-batch", "the heads are folded into the batch: keep their own axis, (B, h, N, dh)",
     lambda x, h: _view(x, h).transpose(1, 2).reshape(-1, x.shape[1], x.shape[2] // h)),
    ("h-and-dh-swapped", "num_heads is used as the head size: cut d_model into h heads of d_model/h features",
     lambda x, h: _view(x, h, swapped=True).transpose(1, 2)),
]]


def _merge_cases():
    return table(900, [(2, 3, 5, 4, ""), (1, 2, 4, 4, ""), (3, 4, 6, 2, ""), (2, 1, 3, 5, ", one head"),
                       (1, 4, 3, 1, ", d_head = 1")], lambda g, b, h, n, dh, note: (
        f"x of shape ({b}, {h}, {n}, {dh}){note}", (randn(g, b, h, n, dh),), {}))


_MERGE_MISTAKES = [Mistake(*row) for row in [
    ("heads-order", "the heads are not moved back: transpose(1, 2) before reshaping to (B, N, h*dh)",
     lambda x: x.reshape(x.shape[0], x.shape[2], x.shape[1] * x.shape[3])),
    ("interleaved-heads", "the heads are interleaved: head 0's dh features first, then head 1's, ...",
     lambda x: x.permute(0, 2, 3, 1).reshape(x.shape[0], x.shape[2], -1)),
    ("summed-heads", "the heads are summed; they are concatenated", lambda x: x.sum(dim=1)),
    ("averaged-heads", "the heads are averaged; they are concatenated", lambda x: x.mean(dim=1)),
    ("concatenated-positions", "concatenate the heads' features, (B, N, h*dh), not their positions",
     lambda x: torch.cat(x.unbind(1), dim=1)),
    ("heads-reversed", "the heads come out in reverse order: head 0's features go first",
     lambda x: x.flip(1).transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)),
]]


def _mha_case(g, label, shape, opts):
    (b, nq, nk, d, h), state, kwargs = shape, {}, {k: opts[k] for k in ("causal", "mask") if k in opts}
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        state[f"{name}.weight"] = randn(g, d, d, scale=opts.get("scale", 1.0) * d ** -0.5)
        if opts.get("bias", True):
            state[f"{name}.bias"] = randn(g, d, scale=0.1)
    query = randn(g, b, nq, d)
    if "lengths" in opts:   # key padding, (B, 1, 1, Nk)
        kwargs["mask"] = (torch.arange(nk) < torch.tensor(opts["lengths"])[:, None])[:, None, None, :]
    if opts.get("cross"):   # a distinct key and value
        kwargs["key"], kwargs["value"] = randn(g, b, nk, d), randn(g, b, nk, d)
    return f"{label}: query ({b}, {nq}, {d}), {h} heads", (state, h, query), kwargs


def _mha_cases():
    per_head = torch.rand(2, 2, 4, 4, generator=gen(1100)) < 0.6
    per_head[0, 1, 2] = False   # one fully masked row
    return table(1000, [  # (label, (B, Nq, Nk, d_model, h), options)
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
    ], _mha_case)


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
        keep = torch.ones(s.shape[-2:], dtype=torch.bool)
        if causal and wrong != "causal-ignored":
            keep = keep.tril(s.shape[-1] - s.shape[-2] if wrong == "causal-bottom-right" else 0)
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
    ("causal-bottom-right", "the causal mask is aligned bottom-right; here it is top-left: query i sees keys j <= i"),
    ("mask-ignored", "the mask argument is ignored"),
    ("mask-inverted", "the mask is inverted: True means attend"),
    ("mask-filled-with-zero", "masked scores are set to 0, which still gets weight exp(0): fill them with -inf"),
    ("nan-rows", "a fully masked row gives NaN: its weights must be 0 (torch.nan_to_num, or torch.where)"),
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


def _param_cases():
    h, k = salted_ints(4100, (2, 6), (1, 9))   # and one size no one knows
    return [("d_model=512, 8 heads", (512, 8), {}), ("d_model=512, 1 head", (512, 1), {}),
            ("d_model=64, 4 heads, bias=False", (64, 4), {"bias": False}),
            ("d_model=96, 12 heads, bias=True", (96, 12), {"bias": True}), ("d_model=6, 3 heads", (6, 3), {}),
            (f"d_model={2 * h * k}, {h} heads", (2 * h * k, h), {})]


def _params(d, h, bias=True, *, layers=4, per_head=False, one_head=False, biases=None):
    """The parameter count, with the mistakes' switches (``biases`` overrides ``bias``)."""
    w = d // h if one_head else d   # the output features of each layer
    return (h if per_head else 1) * layers * (d * w + (w if (bias if biases is None else biases) else 0))


_PARAM_MISTAKES = mistakes(lambda **switch: functools.partial(_params, **switch), [
    ("per-head-matrices", "head i owns a d_head-wide slice of each projection: the count does not depend on h",
     {"per_head": True}),
    ("biases-forgotten", "with bias=True each of the four Linear layers also has d_model biases", {"biases": False}),
    ("output-projection-forgotten", "four Linear layers: q_proj, k_proj, v_proj and out_proj", {"layers": 3}),
    ("one-head-slice", "this is one head's slice: the h heads together fill d_model x d_model", {"one_head": True}),
    ("biases-always", "bias=False: the Linear layers have no biases", {"biases": True}),
])


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
    """Matmul FLOPs (2 per multiply-add), and the mistakes' ``bias`` (per projected feature), ``per_score``."""
    rows = (1 + out) * nq + 2 * (nq if kv_from_q else nk)     # the rows projected: by q_proj, out_proj, k_proj, v_proj
    one = (proj * d * d * rows + attn * nq * nk * d * (h if heads_wide else 1) + bias * d * (2 * nq + 2 * nk)
           + per_score * h * nq * nk)
    return (b if batch else 1) * one


_FLOP_MISTAKES = [Mistake(key, message, functools.partial(_flops, **switch)) for key, message, switch in [
    ("multiply-add-once", "a multiply-add is 2 FLOPs: a (m, k) @ (k, n) matmul costs 2*m*n*k", dict(proj=1, attn=2)),
    ("projections-forgotten", "the four projections are matmuls too: 2*d_model^2 FLOPs per row", dict(proj=0)),
    ("attention-forgotten", "QK^T and PV are missing: 4*n_q*n_k*d_model FLOPs over all heads", dict(attn=0)),
    ("query-length-everywhere", "the key and value projections run on n_k rows, not n_q", dict(kv_from_q=True)),
    ("full-width-per-head", "each head's QK^T and PV run in d_head dimensions, not d_model", dict(heads_wide=True)),
    ("output-projection-forgotten", "the output projection (2*n_q*d_model^2) is missing", dict(out=False)),
    ("batch-forgotten", "multiply by the batch", dict(batch=False)),
    ("bias-additions-counted", "count matmul FLOPs only (as FlopCounterMode does), not the biases", dict(bias=1)),
] + [  # a few FLOPs per score (exp, sum, divide, the max, the scale ...), whichever number the learner chose
    ("softmax-counted", "count matmul FLOPs only (as FlopCounterMode does), not the softmax or the scale",
     dict(per_score=per)) for per in range(1, 7)
]]


TOLERANCE = 0.1   # absolute, on every entry of the (h, 3) profile
_trained = functools.lru_cache(maxsize=8)(specs.trained_model)   # (seed, num_heads, steps): one training each


def _reference(seed, num_heads=2, steps=200):
    """specs.head_specialisation on the cached training of the library's model (the mistakes reuse it)."""
    return specs.profile(specs.attention_weights(*_trained(seed, num_heads, steps)))


def _profile_with(seed, num_heads=2, steps=200, *, trained=True, causal=True, softmax=True, ahead=False, summed=False):
    """A wrong experiment: layer 0's weights of the grader's model recomputed from its q/k projections, switches set."""
    model, tokens = _trained(seed, num_heads, steps if trained else 0)
    with torch.no_grad():
        n, block = tokens.shape[1], model.blocks[0]
        x = block.ln_attn(model.tok_emb(tokens) + model.pos_emb(torch.arange(n)))
        q, k = (specs.split_heads(proj(x), num_heads) for proj in (block.attn.q_proj, block.attn.k_proj))
        w = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            w = w.masked_fill(~causal_mask(n, n), float("-inf") if softmax else 0.0)
        w = torch.softmax(w, dim=-1) if softmax else w
    return specs.profile(w, ahead, summed)


_HEAD_MISTAKES = mistakes(lambda **switch: functools.partial(_profile_with, **switch), [
    ("no-causal-mask", "the weights are recomputed without the causal mask the model has", {"causal": False}),
    ("untrained", "this is the model before training: train it first (train_previous_two)", {"trained": False}),
    ("no-softmax", "these are raw scores, not attention weights: apply the softmax over the keys", {"softmax": False}),
    ("summed-not-averaged", "the weights are summed over the sequences and positions: average them", {"summed": True}),
    ("future-diagonal", "diagonal(+1) is key i+1, after the query: key i-1 is diagonal(-1)", {"ahead": True}),
]) + [Mistake("heads-averaged", "the heads are averaged: return one row per head, shape (h, 3)",
              lambda *args, **kwargs: _reference(*args, **kwargs).mean(dim=0, keepdim=True))]


def _head_cases():
    return [(f"seed={s}, 2 heads, 200 steps", (s,), {"num_heads": 2, "steps": 200})
            for s in salted_ints(1200, (0, 9_999), (0, 9_999))]


TABLES = {
    "split-heads": Function("split_heads", specs.split_heads, _split_cases, _SPLIT_MISTAKES, rtol=0, atol=0,
                            says="{n} cases match the spec (1 head, d_head = 1 and d_head = h among them)"),
    "merge-heads": Function("merge_heads", specs.merge_heads, _merge_cases, _MERGE_MISTAKES, rtol=0, atol=0),
    "mha-forward": _module_written(Function(
        "mha_forward", specs.mha_forward, _mha_cases, _MHA_MISTAKES,
        says="{n} cases match the spec: masks, causal, cross-attention, fully masked rows, no biases, large logits")),
    "mha-cost": InTurn("{n} cases match torch's own counts (the parameters of the module, FlopCounterMode's FLOPs)", (
        Function("mha_parameters", specs.mha_parameters, _param_cases, _PARAM_MISTAKES, ordered=True),
        Function("mha_flops", specs.mha_flops, _flop_cases, _FLOP_MISTAKES, ordered=True))),
    "head-specialisation": Function("head_specialisation", _reference, _head_cases, _HEAD_MISTAKES, rtol=0,
                                    atol=TOLERANCE, says=f"{{n}} seeds: your profiles match the grader's own training "
                                    f"within {TOLERANCE} on every entry"),
}
