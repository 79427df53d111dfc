"""Exercise 03 (scaled dot-product attention): wrong implementations fail their check with the matching diagnosis,
shortcuts are refused, and the variance experiment is reproduced within its stated tolerance."""

import math
import re

import pytest
import torch

from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.exercises.e03 import spec
from mistakes import Wrong

WRONG = Wrong()

# ---------------------------------------------------------------------------------------------
# stable-softmax
# ---------------------------------------------------------------------------------------------

WRONG.add("stable-softmax", "no-max-subtraction", softmax=lambda x, dim=-1: x.exp() / x.exp().sum(dim, keepdim=True))
WRONG.add("stable-softmax", "wrong-axis",
          softmax=lambda x, dim=-1: (x - x.amax(-1, keepdim=True)).exp() / (x - x.amax(-1, keepdim=True)).exp().sum(
              -1, keepdim=True))
WRONG.add("stable-softmax", "global-max",
          softmax=lambda x, dim=-1: (x - x.max()).exp() / (x - x.max()).exp().sum(dim, keepdim=True))


def _softmax_without_keepdim(x, dim=-1):
    e = torch.exp(x - x.max(dim=dim).values)
    return e / e.sum(dim=dim, keepdim=True)


def _softmax_minus_mean(x, dim=-1):
    e = torch.exp(x - x.mean(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True)


def _softmax_max_on_last_axis(x, dim=-1):
    e = torch.exp(x - x.max(-1, keepdim=True).values)
    return e / e.sum(dim, keepdim=True)


WRONG.add("stable-softmax", "missing-keepdim", softmax=_softmax_without_keepdim)
WRONG.add("stable-softmax", "mean-not-max", softmax=_softmax_minus_mean)
WRONG.add("stable-softmax", "max-wrong-axis", softmax=_softmax_max_on_last_axis)

# ---------------------------------------------------------------------------------------------
# softmax-backward
# ---------------------------------------------------------------------------------------------

WRONG.add("softmax-backward", "missing-rowsum", softmax_backward=lambda p, dp, dim=-1: p * dp)
WRONG.add("softmax-backward", "diagonal-only", softmax_backward=lambda p, dp, dim=-1: dp * p * (1 - p))
WRONG.add("softmax-backward", "unweighted-rowsum",
          softmax_backward=lambda p, dp, dim=-1: p * (dp - dp.sum(dim, keepdim=True)))
WRONG.add("softmax-backward", "missing-p-factor",
          softmax_backward=lambda p, dp, dim=-1: dp - (dp * p).sum(dim, keepdim=True))
WRONG.add("softmax-backward", "wrong-sign",
          softmax_backward=lambda p, dp, dim=-1: p * ((p * dp).sum(dim, keepdim=True) - dp))
WRONG.add("softmax-backward", "wrong-axis",
          softmax_backward=lambda p, dp, dim=-1: p * (dp - (dp * p).sum(-1, keepdim=True)))
WRONG.add("softmax-backward", "missing-keepdim", softmax_backward=lambda p, dp, dim=-1: p * (dp - (dp * p).sum(dim)))


def _backward_by_jacobian(p, dp, dim=-1):
    """Right, by the full Jacobian diag(p) - p p^T of each row (a longer way to the same numbers)."""
    p_, dp_ = p.movedim(dim, -1), dp.movedim(dim, -1)
    jac = torch.diag_embed(p_) - p_[..., :, None] * p_[..., None, :]  # (..., n, n), symmetric
    return (jac @ dp_[..., None])[..., 0].movedim(-1, dim)


def test_the_softmax_backward_by_the_full_jacobian_passes():
    assert run_check("softmax-backward", {"softmax_backward": _backward_by_jacobian}).passed


def test_the_backward_reference_is_autograd_and_equals_the_formula():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 4, 5, generator=g, dtype=torch.float64) * 3
    dp = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    for dim in (-1, 1, 0):
        s_leaf = s.clone().requires_grad_(True)
        torch.softmax(s_leaf, dim).backward(dp)
        p = torch.softmax(s, dim)
        assert torch.allclose(spec.softmax_backward(p, dp, dim), s_leaf.grad, atol=1e-12)
        assert torch.allclose(p * (dp - (dp * p).sum(dim, keepdim=True)), s_leaf.grad, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# scaled-attention
# ---------------------------------------------------------------------------------------------

def _sdpa(scale_of_d, dim=-1, honour=True, outside=False, stable=True):
    def scaled_dot_product_attention(q, k, v, scale=None):
        sc = scale if (scale is not None and honour) else scale_of_d(q.shape[-1], v.shape[-1])
        s = q @ k.transpose(-2, -1) * (1.0 if outside else sc)
        p = torch.softmax(s, dim=dim) if stable else s.exp() / s.exp().sum(dim, keepdim=True)
        return p @ v * (sc if outside else 1.0)
    return scaled_dot_product_attention


WRONG.add("scaled-attention", "scale-forgotten", scaled_dot_product_attention=_sdpa(lambda d, dv: 1))
WRONG.add("scaled-attention", "scale-one-over-d", scaled_dot_product_attention=_sdpa(lambda d, dv: 1 / d))
WRONG.add("scaled-attention", "scale-uses-dv", scaled_dot_product_attention=_sdpa(lambda d, dv: 1 / math.sqrt(dv)))
WRONG.add("scaled-attention", "scale-outside-softmax",
          scaled_dot_product_attention=_sdpa(lambda d, dv: d ** -0.5, outside=True))
WRONG.add("scaled-attention", "wrong-axis", scaled_dot_product_attention=_sdpa(lambda d, dv: d ** -0.5, dim=-2))
WRONG.add("scaled-attention", "scale-ignored", scaled_dot_product_attention=_sdpa(lambda d, dv: d ** -0.5, honour=False))
WRONG.add("scaled-attention", "no-max-subtraction",
          scaled_dot_product_attention=_sdpa(lambda d, dv: d ** -0.5, stable=False))

# ---------------------------------------------------------------------------------------------
# variance-experiment
# ---------------------------------------------------------------------------------------------


def _experiment(score=lambda q, k: (q * k).sum(-1), stat=lambda x: x.var(), scaled=lambda raw, d: raw / d ** 0.5,
                seeded=True, fixed_seed=None, same=False, result=None):
    def score_variance(dims, n_pairs=8192, seed=0):
        g = torch.Generator().manual_seed(seed if fixed_seed is None else fixed_seed)
        out = []
        for d in dims:
            q = torch.randn(n_pairs, d, generator=g) if seeded else torch.randn(n_pairs, d)
            k = q if same else (torch.randn(n_pairs, d, generator=g) if seeded else torch.randn(n_pairs, d))
            raw = score(q, k)
            out.append([stat(raw).item(), stat(scaled(raw, d)).item()])
        return torch.tensor(out) if result is None else result(out)
    return score_variance


WRONG.add("variance-experiment", "divided-by-d", score_variance=_experiment(scaled=lambda raw, d: raw / d))
WRONG.add("variance-experiment", "scaled-wrong-way", score_variance=_experiment(scaled=lambda raw, d: raw * d ** 0.5))
WRONG.add("variance-experiment", "std-not-var", score_variance=_experiment(stat=lambda x: x.std()))
WRONG.add("variance-experiment", "mean-not-var", score_variance=_experiment(stat=lambda x: x.mean()))
WRONG.add("variance-experiment", "summed-over-pairs", score_variance=_experiment(score=lambda q, k: (q * k).sum(0)))
WRONG.add("variance-experiment", "no-sum", score_variance=_experiment(score=lambda q, k: (q * k).reshape(-1)))
WRONG.add("variance-experiment", "same-draw", score_variance=_experiment(same=True))
WRONG.add("variance-experiment", "seed-ignored", score_variance=_experiment(seeded=False))
WRONG.add("variance-experiment", "seed-fixed", score_variance=_experiment(fixed_seed=0))
WRONG.add("variance-experiment", "wrong-structure", score_variance=_experiment(result=lambda rows: rows[-1]))
WRONG.add("variance-experiment", "biased-variance", score_variance=_experiment(stat=lambda x: x.var(correction=0)))
WRONG.add("variance-experiment", "theory-not-measured",
          score_variance=lambda dims, n_pairs=8192, seed=0: torch.tensor([[float(d), 1.0] for d in dims]))


def _other_draws(dims, n_pairs=8192, seed=0):
    """k drawn before q, float64, one draw for all d: an honest experiment, but not the given seed's draws, which
    is all the grader can check."""
    g = torch.Generator().manual_seed(seed)
    both = torch.randn(2, n_pairs, max(dims), generator=g, dtype=torch.float64)
    rows = []
    for d in dims:
        k, q = both[0, :, :d], both[1, :, :d]
        raw = torch.einsum("nd,nd->n", q, k)
        rows.append(torch.stack([raw.var(), (raw / math.sqrt(d)).var()]))
    return torch.stack(rows)


WRONG.add("variance-experiment", "other-draws", score_variance=_other_draws)
test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


def test_a_list_instead_of_a_tensor_passes():
    assert run_check("variance-experiment", {"score_variance": _experiment(result=lambda rows: rows)}).passed


def test_round_off_differences_pass():
    # the recipe's draws, computed another way (einsum, the variance in float64): only round-off differs
    def score_variance(dims, n_pairs=8192, seed=0):
        g = torch.Generator().manual_seed(seed)
        rows = []
        for d in dims:
            q, k = torch.randn(n_pairs, d, generator=g), torch.randn(n_pairs, d, generator=g)
            raw = torch.einsum("nd,nd->n", q, k).double()
            rows.append(torch.stack([raw.var(), (raw * d ** -0.5).var()]))
        return torch.stack(rows)

    result = run_check("variance-experiment", {"score_variance": score_variance})
    assert result.passed, result.message
    assert "grows as d^" in result.message


@pytest.mark.parametrize("salt", [12345, 987654321])
def test_the_honest_experiment_passes_under_secret_salts(salt):
    result = run_check("variance-experiment", {"score_variance": _experiment()}, salt=salt)
    assert result.passed, result.message


def test_the_textbook_values_score_nothing():
    # d and 1, what the theory predicts, returned without running anything
    theory = lambda dims, n_pairs=8192, seed=0: torch.tensor([[float(d), 1.0] for d in dims])  # noqa: E731
    result = run_check("variance-experiment", {"score_variance": theory}, salt=4242)
    assert not result.passed and "theory-not-measured" in result.diagnosis, result.message

    # the theory with seed-dependent noise of a plausible size: not the grader's draws either
    def noisy(dims, n_pairs=8192, seed=0):
        g = torch.Generator().manual_seed(seed)
        t = torch.tensor([[float(d), 1.0] for d in dims])
        return t * (1 + 0.02 * torch.randn(t.shape, generator=g))

    result = run_check("variance-experiment", {"score_variance": noisy}, salt=4242)
    assert not result.passed and "other-draws" in result.diagnosis, result.message


def test_the_sizes_depend_on_the_salt():
    from attnlab.grading import core
    from attnlab.grading.exercises.e03 import checks

    seen = set()
    for salt in (0, 1, 2):
        core._SALT[0] = salt
        try:
            seen.add(repr(checks._sizes()))
        finally:
            core._SALT[0] = 0
    assert len(seen) == 3


# ---------------------------------------------------------------------------------------------
# shortcuts
# ---------------------------------------------------------------------------------------------

def _refused(part, ns, name):
    result = run_check(part, ns)
    assert not result.passed and "shortcut" in result.diagnosis, result.message
    assert name in result.message, result.message


def test_torch_softmax_is_refused_as_the_softmax():
    _refused("stable-softmax", {"softmax": lambda x, dim=-1: torch.softmax(x, dim=dim)}, "torch.softmax")


def test_the_library_softmax_is_refused():
    from attnlab import attention

    _refused("stable-softmax", {"softmax": lambda x, dim=-1: attention.softmax(x, dim=dim)}, "attnlab.attention.softmax")


def test_autograd_is_refused_in_the_softmax_backward():
    def softmax_backward(p, dp, dim=-1):
        s = p.log().detach().requires_grad_(True)
        with torch.enable_grad():
            y = (s - s.amax(dim, keepdim=True).detach()).exp()
            y = y / y.sum(dim, keepdim=True)
            (ds,) = torch.autograd.grad(y, s, dp)
        return ds

    _refused("softmax-backward", {"softmax_backward": softmax_backward}, "torch.autograd.grad")


def test_tensor_backward_and_vjp_are_refused_in_the_softmax_backward():
    def by_backward(p, dp, dim=-1):
        with torch.enable_grad():
            s = p.log().detach().requires_grad_(True)
            y = s.exp() / s.exp().sum(dim, keepdim=True)
            y.backward(dp)
        return s.grad

    def by_vjp(p, dp, dim=-1):
        def f(s):
            e = s.exp()
            return e / e.sum(dim, keepdim=True)

        return torch.autograd.functional.vjp(f, p.log(), dp)[1]

    _refused("softmax-backward", {"softmax_backward": by_backward}, "torch.Tensor.backward")
    _refused("softmax-backward", {"softmax_backward": by_vjp}, "torch.autograd.functional.vjp")


def test_pytorch_s_own_softmax_backward_is_refused():
    _refused("softmax-backward",
             {"softmax_backward": lambda p, dp, dim=-1: torch._softmax_backward_data(dp, p, dim, p.dtype)},
             "torch._softmax_backward_data")


def test_the_fused_attention_is_refused():
    _refused("scaled-attention", {"scaled_dot_product_attention": lambda q, k, v, scale=None:
                                  torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)},
             "torch.nn.functional.scaled_dot_product_attention")


def test_the_grader_s_experiment_is_refused():
    _refused("variance-experiment", {"score_variance": spec.score_variance},
             "attnlab.grading.exercises.e03.spec.score_variance")


def test_a_right_experiment_reports_the_reproduced_quantities():
    result = run_check("variance-experiment", LocalLearner({"score_variance": _experiment()}, forbidden=[]))
    assert result.passed, result.message
    exponent = float(re.search(r"Var\(q\.k\) grows as d\^([0-9.]+)", result.message).group(1))
    assert 0.9 <= exponent <= 1.1 and "reproduces the grader's" in result.message
