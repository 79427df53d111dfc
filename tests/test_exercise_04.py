"""Exercise 04 (multi-head attention): a learner's module passes through the notebook's harness; shortcuts are
refused; the experiment's tolerance holds and is not loose. The known mistakes: tests/test_every_mistake.py."""

import math

import pytest
import torch
from torch import nn

from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.exercises.e04 import checks as e04_checks
from attnlab.grading.exercises.e04 import spec as specs
from attnlab.grading.parts import forbidden

# split-heads, merge-heads, mha-forward, mha-cost and head-specialisation: every known mistake is proven by its
# check's own emulation (tests/test_every_mistake.py). A learner's module, run through the notebook's harness:
class _LearnerMHA(nn.Module):
    def __init__(self, d_model, num_heads, bias=True):
        super().__init__()
        self.h, self.dh = num_heads, d_model // num_heads
        self.q_proj, self.k_proj = nn.Linear(d_model, d_model, bias=bias), nn.Linear(d_model, d_model, bias=bias)
        self.v_proj, self.out_proj = nn.Linear(d_model, d_model, bias=bias), nn.Linear(d_model, d_model, bias=bias)

    def forward(self, query, key=None, value=None, mask=None, causal=False):
        key = query if key is None else key
        value = key if value is None else value
        b, nq, d = query.shape
        q = self.q_proj(query).view(b, nq, self.h, self.dh).transpose(1, 2)
        k = self.k_proj(key).view(b, -1, self.h, self.dh).transpose(1, 2)
        v = self.v_proj(value).view(b, -1, self.h, self.dh).transpose(1, 2)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.dh)
        if causal:
            s = s.masked_fill(torch.triu(torch.ones(nq, k.shape[2], dtype=torch.bool), 1), float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        w = torch.softmax(s, dim=-1)
        w = torch.where(torch.isnan(w), torch.zeros_like(w), w)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, nq, d))


def _harness(cls):
    def mha_forward(state_dict, num_heads, query, key=None, value=None, mask=None, causal=False):
        module = cls(state_dict["q_proj.weight"].shape[1], num_heads, bias="q_proj.bias" in state_dict)
        module.load_state_dict(state_dict)
        with torch.no_grad():
            return module(query, key, value, mask=mask, causal=causal)
    return mha_forward


def test_a_learner_s_module_through_the_harness_passes():
    result = run_check("mha-forward", {"MultiHeadAttention": _LearnerMHA, "mha_forward": _harness(_LearnerMHA)})
    assert result.passed, result.message


# --- shortcuts ------------------------------------------------------------------------------------
def _learner(part, ns):
    return LocalLearner(ns, forbidden=forbidden(part))


def test_torch_sdpa_inside_the_module_is_refused():
    class MultiHeadAttention(_LearnerMHA):
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
        layer = _LearnerMHA(d_model, num_heads)
        with FlopCounterMode(display=False) as counter:
            layer(torch.zeros(batch, n_q, d_model), torch.zeros(batch, n_k, d_model))
        return counter.get_total_flops()

    result = run_check("mha-cost", _learner("mha-cost", {"mha_parameters": lambda d, h, bias=True: 4 * d * d + (
        4 * d if bias else 0), "mha_flops": mha_flops}))
    assert not result.passed and "shortcut" in result.diagnosis and "FlopCounterMode" in result.message, result.message
    assert specs.mha_flops(1, 4, 4, 8, 2) == 2 * 64 * 16 + 4 * 16 * 8   # the grader's own count is unaffected
