"""Exercise 04 (multi-head attention): wrong implementations, written as a learner would, fail their check
with the matching diagnosis; shortcuts are refused; the experiment's tolerance holds and is not loose."""

import math

import pytest
import torch
from torch import nn

from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.exercises.e04 import checks as e04_checks
from attnlab.grading.exercises.e04 import spec as specs
from attnlab.grading.parts import forbidden
from mistakes import Wrong

WRONG = Wrong()

# --- split-heads -------------------------------------------------------------------------------
WRONG.add("split-heads", "heads-order", split_heads=lambda x, h: x.view(x.shape[0], h, x.shape[1], -1))
WRONG.add("split-heads", "interleaved-heads",
          split_heads=lambda x, h: x.view(x.shape[0], x.shape[1], -1, h).permute(0, 3, 1, 2))
WRONG.add("split-heads", "no-transpose", split_heads=lambda x, h: x.view(x.shape[0], x.shape[1], h, -1))
WRONG.add("split-heads", "transposed",
          split_heads=lambda x, h: x.view(x.shape[0], x.shape[1], h, -1).permute(0, 2, 3, 1))
WRONG.add("split-heads", "heads-in-batch",
          split_heads=lambda x, h: x.view(x.shape[0], x.shape[1], h, -1).transpose(1, 2).reshape(
              x.shape[0] * h, x.shape[1], -1))
WRONG.add("split-heads", "h-and-dh-swapped",
          split_heads=lambda x, h: x.view(x.shape[0], x.shape[1], x.shape[2] // h, h).transpose(1, 2))

# --- merge-heads -------------------------------------------------------------------------------
WRONG.add("merge-heads", "heads-order", merge_heads=lambda x: x.reshape(x.shape[0], x.shape[2], -1))
WRONG.add("merge-heads", "interleaved-heads",
          merge_heads=lambda x: x.permute(0, 2, 3, 1).reshape(x.shape[0], x.shape[2], -1))
WRONG.add("merge-heads", "summed-heads", merge_heads=lambda x: x.sum(1))
WRONG.add("merge-heads", "averaged-heads", merge_heads=lambda x: x.mean(1))
WRONG.add("merge-heads", "concatenated-positions",
          merge_heads=lambda x: torch.cat([x[:, i] for i in range(x.shape[1])], 1))
WRONG.add("merge-heads", "heads-reversed",
          merge_heads=lambda x: torch.cat([x[:, i] for i in reversed(range(x.shape[1]))], dim=-1))


# --- mha-forward: a learner's module with one thing wrong, run through the notebook's harness ------------------
def _module(scale="head", merge_ok=True, out_proj=True, causal_mode="top-left", mask_mode="keep", fill="-inf",
            nan_to_zero=True, value_from_key=False, call_linear=True):
    class MultiHeadAttention(nn.Module):
        def __init__(self, d_model, num_heads, bias=True):
            super().__init__()
            self.h, self.dh = num_heads, d_model // num_heads
            self.q_proj, self.k_proj = nn.Linear(d_model, d_model, bias=bias), nn.Linear(d_model, d_model, bias=bias)
            self.v_proj, self.out_proj = nn.Linear(d_model, d_model, bias=bias), nn.Linear(d_model, d_model, bias=bias)

        def lin(self, layer, x):
            return layer(x) if call_linear else x @ layer.weight.T

        def forward(self, query, key=None, value=None, mask=None, causal=False):
            key = query if key is None else key
            value = key if value is None or value_from_key else value
            b, nq, d = query.shape
            q = self.lin(self.q_proj, query).view(b, nq, self.h, self.dh).transpose(1, 2)
            k = self.lin(self.k_proj, key).view(b, -1, self.h, self.dh).transpose(1, 2)
            v = self.lin(self.v_proj, value).view(b, -1, self.h, self.dh).transpose(1, 2)
            s = q @ k.transpose(-2, -1)
            s = s / math.sqrt(self.dh) if scale == "head" else (s / math.sqrt(d) if scale == "model" else s)
            nk = k.shape[2]
            if causal and causal_mode == "top-left":
                s = s.masked_fill(torch.triu(torch.ones(nq, nk, dtype=torch.bool), 1), float(fill))
            if causal and causal_mode == "bottom-right":
                s = s.masked_fill(torch.triu(torch.ones(nq, nk, dtype=torch.bool), nk - nq + 1), float(fill))
            if mask is not None and mask_mode == "keep":
                s = s.masked_fill(~mask, float(fill))
            if mask is not None and mask_mode == "inverted":
                s = s.masked_fill(mask, float(fill))
            w = torch.softmax(s, dim=-1)
            if nan_to_zero:
                w = torch.where(torch.isnan(w), torch.zeros_like(w), w)
            o = w @ v
            o = o.transpose(1, 2).reshape(b, nq, d) if merge_ok else o.reshape(b, nq, d)
            return self.lin(self.out_proj, o) if out_proj else o
    return MultiHeadAttention


def _harness(cls):
    def mha_forward(state_dict, num_heads, query, key=None, value=None, mask=None, causal=False):
        module = cls(state_dict["q_proj.weight"].shape[1], num_heads, bias="q_proj.bias" in state_dict)
        module.load_state_dict(state_dict)
        with torch.no_grad():
            return module(query, key, value, mask=mask, causal=causal)
    return mha_forward


def _add_mha(key, **flags):
    cls = _module(**flags)
    WRONG.add("mha-forward", key, MultiHeadAttention=cls, mha_forward=_harness(cls))


_add_mha("scale-d-model", scale="model")
_add_mha("scale-forgotten", scale="none")
_add_mha("heads-order", merge_ok=False)
_add_mha("no-output-projection", out_proj=False)
_add_mha("causal-ignored", causal_mode="none")
_add_mha("causal-bottom-right", causal_mode="bottom-right")
_add_mha("mask-ignored", mask_mode="ignored")
_add_mha("mask-inverted", mask_mode="inverted")
_add_mha("mask-filled-with-zero", fill="0")
_add_mha("nan-rows", nan_to_zero=False)
_add_mha("value-from-key", value_from_key=True)
_add_mha("biases-ignored", call_linear=False)

# --- mha-cost ------------------------------------------------------------------------------------
_FLOPS = specs.mha_flops
_PARAMS = specs.mha_parameters
WRONG.add("mha-cost", "per-head-matrices", mha_flops=_FLOPS,
          mha_parameters=lambda d, h, bias=True: h * (4 * d * d + (4 * d if bias else 0)))
WRONG.add("mha-cost", "biases-forgotten", mha_flops=_FLOPS, mha_parameters=lambda d, h, bias=True: 4 * d * d)
WRONG.add("mha-cost", "output-projection-forgotten", mha_flops=_FLOPS,
          mha_parameters=lambda d, h, bias=True: 3 * (d * d + (d if bias else 0)))
WRONG.add("mha-cost", "one-head-slice", mha_flops=_FLOPS,
          mha_parameters=lambda d, h, bias=True: 4 * (d * (d // h) + (d // h if bias else 0)))
WRONG.add("mha-cost", "biases-always", mha_flops=_FLOPS, mha_parameters=lambda d, h, bias=True: 4 * (d * d + d))
WRONG.add("mha-cost", "multiply-add-once", mha_parameters=_PARAMS,
          mha_flops=lambda b, nq, nk, d, h: b * (d * d * (2 * nq + 2 * nk) + 2 * nq * nk * d))
WRONG.add("mha-cost", "projections-forgotten", mha_parameters=_PARAMS,
          mha_flops=lambda b, nq, nk, d, h: b * h * 4 * nq * nk * (d // h))
WRONG.add("mha-cost", "attention-forgotten", mha_parameters=_PARAMS,
          mha_flops=lambda b, nq, nk, d, h: b * 4 * 2 * d * d * (nq + nk) // 2)
WRONG.add("mha-cost", "query-length-everywhere", mha_parameters=_PARAMS,
          mha_flops=lambda b, nq, nk, d, h: b * (4 * 2 * nq * d * d + 4 * nq * nk * d))
WRONG.add("mha-cost", "full-width-per-head", mha_parameters=_PARAMS,
          mha_flops=lambda b, nq, nk, d, h: b * (2 * d * d * (2 * nq + 2 * nk) + h * 4 * nq * nk * d))
WRONG.add("mha-cost", "output-projection-forgotten", mha_parameters=_PARAMS,
          mha_flops=lambda b, nq, nk, d, h: b * (2 * d * d * (nq + 2 * nk) + 4 * nq * nk * d))
WRONG.add("mha-cost", "batch-forgotten", mha_parameters=_PARAMS,
          mha_flops=lambda b, nq, nk, d, h: 2 * d * d * (2 * nq + 2 * nk) + 4 * nq * nk * d)
WRONG.add("mha-cost", "softmax-counted", mha_parameters=_PARAMS,   # exp, sum and divide for every score
          mha_flops=lambda b, nq, nk, d, h: b * (2 * d * d * (2 * nq + 2 * nk) + 4 * nq * nk * d) + 3 * b * h * nq * nk)
WRONG.add("mha-cost", "bias-additions-counted", mha_parameters=_PARAMS,   # one add per output of each Linear
          mha_flops=lambda b, nq, nk, d, h: b * (2 * d * d * (2 * nq + 2 * nk) + 4 * nq * nk * d)
          + b * d * (nq + nk + nk + nq))


# --- head-specialisation: the learner's measurement of the grader's own trained model, one thing wrong ------------
def _weights(seed, num_heads, steps, *, causal=True, softmax=True, train=True):
    model, tokens = e04_checks._trained(seed, num_heads, steps if train else 0)
    block = model.blocks[0]
    with torch.no_grad():
        x = block.ln_attn(model.tok_emb(tokens) + model.pos_emb(torch.arange(tokens.shape[1])))
        b, n, d = x.shape
        q = block.attn.q_proj(x).view(b, n, num_heads, -1).transpose(1, 2)
        k = block.attn.k_proj(x).view(b, n, num_heads, -1).transpose(1, 2)
        s = q @ k.transpose(-2, -1) / math.sqrt(d // num_heads)
        if causal:
            s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf") if softmax else 0.0)
        return s.softmax(-1) if softmax else s


def _profile(w, o1=-1, o2=-2, average=False, total=False):
    rows = []
    for head in range(w.shape[1]):
        a = w[:, head].diagonal(o1, dim1=-2, dim2=-1)
        a = a[:, 1:] if o1 == -1 else a
        c = w[:, head].diagonal(o2, dim1=-2, dim2=-1)
        c = c[:, 1:] if o2 == -1 else c
        if total:
            everything = w.shape[0] * (w.shape[-1] - 2)
            rows.append([a.sum().item(), c.sum().item(), everything - a.sum().item() - c.sum().item()])
        else:
            rows.append([a.mean().item(), c.mean().item(), 1 - a.mean().item() - c.mean().item()])
    rows.sort(key=lambda r: -r[0])
    out = torch.tensor(rows)
    return out.mean(0, keepdim=True) if average else out


def _experiment(**how):
    profile_args = {k: how.pop(k) for k in ("o1", "o2", "average", "total") if k in how}

    def head_specialisation(seed, num_heads=2, steps=200):
        return _profile(_weights(seed, num_heads, steps, **how), **profile_args)
    return head_specialisation


WRONG.add("head-specialisation", "no-causal-mask", head_specialisation=_experiment(causal=False))
WRONG.add("head-specialisation", "untrained", head_specialisation=_experiment(train=False))
WRONG.add("head-specialisation", "no-softmax", head_specialisation=_experiment(softmax=False))
WRONG.add("head-specialisation", "heads-averaged", head_specialisation=_experiment(average=True))
WRONG.add("head-specialisation", "summed-not-averaged", head_specialisation=_experiment(total=True))
WRONG.add("head-specialisation", "future-diagonal", head_specialisation=_experiment(o1=1, o2=2))


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


# --- shortcuts ------------------------------------------------------------------------------------
def _learner(part, ns):
    return LocalLearner(ns, forbidden=forbidden(part))


def test_torch_sdpa_inside_the_module_is_refused():
    class MultiHeadAttention(_module()):
        def forward(self, query, key=None, value=None, mask=None, causal=False):
            key = query if key is None else key
            value = key if value is None else value
            b, nq, d = query.shape
            split = lambda t: t.view(b, -1, self.h, self.dh).transpose(1, 2)  # noqa: E731
            o = torch.nn.functional.scaled_dot_product_attention(split(self.q_proj(query)), split(self.k_proj(key)),
                                                                 split(self.v_proj(value)), attn_mask=mask)
            return self.out_proj(o.transpose(1, 2).reshape(b, nq, d))

    result = run_check("mha-forward", _learner("mha-forward", {"MultiHeadAttention": MultiHeadAttention,
                                                               "mha_forward": _harness(MultiHeadAttention)}))
    assert not result.passed and "shortcut" in result.diagnosis, result.message


def test_the_library_module_is_refused():
    from attnlab.attention import MultiHeadAttention

    result = run_check("mha-forward", _learner("mha-forward", {"MultiHeadAttention": MultiHeadAttention,
                                                               "mha_forward": _harness(MultiHeadAttention)}))
    assert not result.passed and "shortcut" in result.diagnosis, result.message


@pytest.mark.parametrize("part, names", [("split-heads", ["split_heads"]), ("merge-heads", ["merge_heads"]),
                                         ("mha-cost", ["mha_parameters", "mha_flops"])])
def test_the_references_are_refused(part, names):
    result = run_check(part, _learner(part, {n: getattr(specs, n) for n in names}))
    assert not result.passed and "shortcut" in result.diagnosis, result.message


def test_the_experiment_may_not_train_the_library_model():
    result = run_check("head-specialisation", _learner("head-specialisation",
                                                       {"head_specialisation": specs.head_specialisation}))
    assert not result.passed and "shortcut" in result.diagnosis, result.message


# --- what is special ---------------------------------------------------------------------------------
def test_a_module_with_other_layer_names_is_told_which_names():
    class MultiHeadAttention(nn.Module):
        def __init__(self, d_model, num_heads, bias=True):
            super().__init__()
            self.wq = nn.Linear(d_model, d_model, bias=bias)

    def mha_forward(state_dict, num_heads, query, key=None, value=None, mask=None, causal=False):
        module = MultiHeadAttention(state_dict["q_proj.weight"].shape[1], num_heads)
        mine, theirs = sorted(module.state_dict()), sorted(state_dict)
        if mine != theirs:
            raise ValueError(f"your module's parameters are {mine}; the grader's weights are {theirs}")

    result = run_check("mha-forward", {"MultiHeadAttention": MultiHeadAttention, "mha_forward": mha_forward})
    assert not result.passed and "wq.weight" in result.message and "q_proj.weight" in result.message, result.message


def test_the_wrong_module_settings_at_their_defaults_are_the_spec():
    for label, args, kwargs in e04_checks._mha_cases():
        torch.testing.assert_close(e04_checks._mha_with()(*args, **kwargs), specs.mha_forward(*args, **kwargs))


def test_the_flop_count_is_the_formula():
    b, nq, nk, d, h = 3, 10, 7, 24, 6
    assert specs.mha_flops(b, nq, nk, d, h) == b * (2 * d * d * (2 * nq + 2 * nk) + 4 * nq * nk * d)
    assert specs.mha_parameters(24, 6) == 4 * 24 * 24 + 4 * 24 and specs.mha_parameters(24, 6, bias=False) == 4 * 24**2


def test_the_experiment_tolerance_separates_the_heads_from_a_blend():
    """The two heads end up sharp (> 0.8 on their offset): a blend of both offsets (0.5, 0.5) is far outside the
    tolerance, and a second training of the same model lands within it."""
    got = specs.head_specialisation(3)
    assert got[0, 0] > 0.8 and got[1, 1] > 0.8, got
    assert (got - torch.tensor([[0.5, 0.5, 0.0]] * 2)).abs().max() > 3 * e04_checks.TOLERANCE
    again = specs.head_specialisation(3)
    assert (got - again).abs().max() < e04_checks.TOLERANCE / 10


def test_counting_with_torch_s_flop_counter_is_refused_and_the_counter_still_works_after():
    from torch.utils.flop_counter import FlopCounterMode

    def mha_flops(batch, n_q, n_k, d_model, num_heads):
        layer = _module()(d_model, num_heads)
        with FlopCounterMode(display=False) as counter:
            layer(torch.zeros(batch, n_q, d_model), torch.zeros(batch, n_k, d_model))
        return counter.get_total_flops()

    result = run_check("mha-cost", _learner("mha-cost", {"mha_parameters": lambda d, h, bias=True: 4 * d * d + (
        4 * d if bias else 0), "mha_flops": mha_flops}))
    assert not result.passed and "shortcut" in result.diagnosis and "FlopCounterMode" in result.message, result.message
    assert specs.mha_flops(1, 4, 4, 8, 2) == 2 * 64 * 16 + 4 * 16 * 8   # the grader's own count is unaffected
