"""Exercise 02 (queries, keys and values): wrong implementations fail their check with the matching diagnosis,
shortcuts are refused, and the timing experiment's tolerances hold."""

import math
import time

import pytest
import torch

from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.exercises.e02 import spec
from mistakes import Wrong

WRONG = Wrong()

# ---------------------------------------------------------------------------------------------
# padding-mask
# ---------------------------------------------------------------------------------------------

WRONG.add("padding-mask", "off-by-one", padding_mask=lambda lengths, n: torch.arange(n)[None] <= lengths[:, None])
WRONG.add("padding-mask", "inverted", padding_mask=lambda lengths, n: ~(torch.arange(n)[None] < lengths[:, None]))
WRONG.add("padding-mask", "not-bool", padding_mask=lambda lengths, n: (torch.arange(n)[None] < lengths[:, None]).float())
WRONG.add("padding-mask", "max-len-ignored",
          padding_mask=lambda lengths, n: torch.arange(int(lengths.max()))[None] < lengths[:, None])
WRONG.add("padding-mask", "left-padded",
          padding_mask=lambda lengths, n: torch.arange(n)[None] >= (n - lengths)[:, None])
WRONG.add("padding-mask", "transposed", padding_mask=lambda lengths, n: torch.arange(n)[:, None] < lengths[None, :])

# ---------------------------------------------------------------------------------------------
# causal-mask
# ---------------------------------------------------------------------------------------------

WRONG.add("causal-mask", "off-by-one-diagonal",
          causal_mask=lambda n_q, n_k, device=None: torch.ones(n_q, n_k, dtype=torch.bool).tril(-1))
WRONG.add("causal-mask", "transposed",
          causal_mask=lambda n_q, n_k, device=None: torch.ones(n_q, n_k, dtype=torch.bool).triu())
WRONG.add("causal-mask", "bottom-right",
          causal_mask=lambda n_q, n_k, device=None: torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q))
WRONG.add("causal-mask", "square-only",
          causal_mask=lambda n_q, n_k, device=None: torch.ones(n_q, n_q, dtype=torch.bool).tril())
WRONG.add("causal-mask", "not-bool", causal_mask=lambda n_q, n_k, device=None: torch.tril(torch.ones(n_q, n_k)))
WRONG.add("causal-mask", "additive-mask",
          causal_mask=lambda n_q, n_k, device=None: torch.triu(torch.full((n_q, n_k), float("-inf")), diagonal=1))


# ---------------------------------------------------------------------------------------------
# attention-masks
# ---------------------------------------------------------------------------------------------

def _tril(n_q, n_k):
    return torch.ones(n_q, n_k, dtype=torch.bool).tril()


def _attention(scale=True, fill=float("-inf"), mask_mode="fill", dim=-1, causal_mode="and", nan_to_zero=True,
               stable=True):
    def masked_attention(q, k, v, mask=None, causal=False):
        s = q @ k.transpose(-2, -1)
        if scale:
            s = s / math.sqrt(q.shape[-1])
        if causal and causal_mode == "and":
            mask = _tril(q.shape[-2], k.shape[-2]) if mask is None else mask & _tril(q.shape[-2], k.shape[-2])
        elif causal and causal_mode == "replaces":
            mask = _tril(q.shape[-2], k.shape[-2])
        elif causal and causal_mode == "bottom-right":
            n_q, n_k = q.shape[-2], k.shape[-2]
            c = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
            mask = c if mask is None else mask & c
        if mask is not None and mask_mode == "fill":
            s = s.masked_fill(~mask, fill)
        if mask is not None and mask_mode == "inverted":
            s = s.masked_fill(mask, fill)
        if mask is not None and mask_mode == "zero":
            s = torch.where(mask, s, torch.zeros_like(s))
        if stable:
            p = torch.softmax(s, dim=dim)
        else:
            p = s.exp() / s.exp().sum(dim, keepdim=True)
        if mask is not None and mask_mode == "after":
            p = p * mask
        return (torch.nan_to_num(p) if nan_to_zero else p) @ v
    return masked_attention


def _mask_ignored(q, k, v, mask=None, causal=False):
    """What a learner writes first: scaled scores, the causal triangle, softmax; `mask` is never read."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(n_q, n_k, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


WRONG.add("attention-masks", "mask-ignored", masked_attention=_mask_ignored)
WRONG.add("attention-masks", "mask-after-softmax", masked_attention=_attention(mask_mode="after"))
WRONG.add("attention-masks", "inverted-mask", masked_attention=_attention(mask_mode="inverted"))
WRONG.add("attention-masks", "scale-forgotten", masked_attention=_attention(scale=False))
WRONG.add("attention-masks", "wrong-axis", masked_attention=_attention(dim=-2))
WRONG.add("attention-masks", "mask-zero-fill", masked_attention=_attention(mask_mode="zero", nan_to_zero=False))
WRONG.add("attention-masks", "fully-masked-row", masked_attention=_attention(nan_to_zero=False))
WRONG.add("attention-masks", "finite-fill", masked_attention=_attention(fill=-1e9))
WRONG.add("attention-masks", "causal-ignored", masked_attention=_attention(causal_mode="ignored"))
WRONG.add("attention-masks", "causal-replaces-mask", masked_attention=_attention(causal_mode="replaces"))
WRONG.add("attention-masks", "causal-bottom-right", masked_attention=_attention(causal_mode="bottom-right"))
WRONG.add("attention-masks", "no-max-subtraction", masked_attention=_attention(stable=False))


def _scaled_by_d(q, k, v, mask=None, causal=False):
    s = q @ k.transpose(-2, -1) / q.shape[-1]
    if causal:
        mask = _tril(q.shape[-2], k.shape[-2]) if mask is None else mask & _tril(q.shape[-2], k.shape[-2])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.nan_to_num(torch.softmax(s, -1)) @ v


WRONG.add("attention-masks", "scale-one-over-d", masked_attention=_scaled_by_d)


# ---------------------------------------------------------------------------------------------
# attention-row
# ---------------------------------------------------------------------------------------------

def _row(scale=True, fill=float("-inf"), after=False, swap=False, normalise=True, nan_to_zero=True, stable=True):
    def attention_row(q, k, v, keep=None):
        if swap:
            k, v = v, k
        scores = torch.mv(k, q)
        if scale:
            scores = scores / q.shape[0] ** 0.5
        if keep is not None and not after:
            scores = torch.where(keep, scores, torch.full_like(scores, fill))
        if not normalise:
            weights = scores.exp()
        elif stable:
            weights = torch.softmax(scores, dim=0)
        else:
            weights = scores.exp() / scores.exp().sum()
        if keep is not None and after:
            weights = weights * keep
        if nan_to_zero:
            weights = torch.nan_to_num(weights)
        return weights, weights @ v
    return attention_row


WRONG.add("attention-row", "scale-forgotten", attention_row=_row(scale=False))
WRONG.add("attention-row", "keys-values-swapped", attention_row=_row(swap=True))
WRONG.add("attention-row", "not-normalised", attention_row=_row(normalise=False))
WRONG.add("attention-row", "mask-after-softmax", attention_row=_row(after=True))
WRONG.add("attention-row", "fully-masked-row", attention_row=_row(nan_to_zero=False))
WRONG.add("attention-row", "finite-fill", attention_row=_row(fill=-1e9))
WRONG.add("attention-row", "no-max-subtraction", attention_row=_row(stable=False))


# ---------------------------------------------------------------------------------------------
# loop-timing: learners' experiments (each times its own functions; here the references stand in for them)
# ---------------------------------------------------------------------------------------------

def _best(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _experiment(row=spec.attention_row, fixed_n=None, unit=1.0, swap=False, diff=None, per_query=False,
                result=None):
    """A learner's loop_vs_batched with one thing changed."""
    def loop(q, k, v):
        out = torch.empty(q.shape[2], v.shape[-1])
        for i in range(q.shape[2]):
            out[i] = row(q[0, 0, i], k[0, 0], v[0, 0])[1]
        return out[None, None]

    def run(sizes, d, seed, repeat):
        g = torch.Generator().manual_seed(seed)
        loops, batched, biggest = [], [], 0.0
        for n in sizes:
            n_here = fixed_n or n
            q, k, v = (torch.randn(1, 1, n_here, d, generator=g) for _ in range(3))
            biggest = max(biggest, (loop(q, k, v) - spec.masked_attention(q, k, v)).abs().max().item())
            t_loop = _best(lambda: loop(q, k, v), repeat) / (n_here if per_query else 1)
            t_batched = _best(lambda: spec.masked_attention(q, k, v), repeat)
            loops.append(unit * t_loop)
            batched.append(unit * t_batched)
        if swap:
            loops, batched = batched, loops
        out = {"loop": torch.tensor(loops), "batched": torch.tensor(batched),
               "max_abs_diff": biggest if diff is None else diff}
        return out if result is None else result(out)

    def loop_vs_batched(sizes, d=32, seed=0, repeat=5):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the exercise's setup cell does
        try:
            return run(sizes, d, seed, repeat)
        finally:
            torch.set_num_threads(threads)
    return loop_vs_batched


def _row_by_key(q, k, v, keep=None):
    """One score at a time: a Python loop over the keys (right values, N^2 Python steps)."""
    scores = torch.stack([torch.dot(q, k[j]) for j in range(k.shape[0])]) / math.sqrt(q.shape[0])
    weights = torch.softmax(scores, 0)
    return weights, weights @ v


WRONG.add("loop-timing", "wrong-unit", loop_vs_batched=_experiment(unit=1e3))            # milliseconds
WRONG.add("loop-timing", "swapped", loop_vs_batched=_experiment(swap=True))
WRONG.add("loop-timing", "flat-loop", loop_vs_batched=_experiment(fixed_n=16))           # the same N every time
WRONG.add("loop-timing", "flat-loop", loop_vs_batched=_experiment(per_query=True))       # time per query
WRONG.add("loop-timing", "steep-loop", loop_vs_batched=_experiment(row=_row_by_key))
WRONG.add("loop-timing", "outputs-disagree", loop_vs_batched=_experiment(diff=float("nan")))
WRONG.add("loop-timing", "wrong-structure",
          loop_vs_batched=_experiment(result=lambda out: torch.stack([out["loop"], out["batched"]], 1)))
WRONG.add("loop-timing", "wrong-structure",
          loop_vs_batched=_experiment(result=lambda out: {**out, "loop": out["loop"][-1:]}))

test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


def test_the_timing_experiment_passes_for_a_right_one_and_says_what_it_measured():
    result = run_check("loop-timing", LocalLearner({"loop_vs_batched": _experiment()}, forbidden=[]))
    assert result.passed, result.message
    assert "N^" in result.message and "faster at N=256" in result.message


def test_the_timing_experiment_accepts_a_slower_loop_within_its_stated_tolerance():
    # a loop with more overhead per query (validation, an extra copy) is still the same experiment
    def heavier_row(q, k, v, keep=None):
        q = q.clone().contiguous()
        assert q.dim() == 1 and k.dim() == 2
        return spec.attention_row(q, k.clone(), v)

    result = run_check("loop-timing", LocalLearner({"loop_vs_batched": _experiment(row=heavier_row)}, forbidden=[]))
    assert result.passed, result.message


# ---------------------------------------------------------------------------------------------
# generic behaviour of the checks, on this exercise's parts
# ---------------------------------------------------------------------------------------------

def test_missing_and_unfinished_functions_are_named():
    result = run_check("attention-masks", {})
    assert not result.passed and "`masked_attention` is not defined" in result.message

    def masked_attention(q, k, v, mask=None, causal=False):
        raise NotImplementedError()

    result = run_check("attention-masks", {"masked_attention": masked_attention})
    assert not result.passed and "not implemented yet" in result.message


def test_a_crashing_function_is_reported_not_raised():
    result = run_check("causal-mask", {"causal_mask": lambda n_q, n_k, device=None: 1 / 0})
    assert not result.passed and "ZeroDivisionError" in result.message


def test_inputs_are_protected_from_in_place_edits():
    def padding_mask(lengths, max_len):
        out = torch.arange(max_len)[None, :] < lengths[:, None]
        lengths.zero_()  # vandalises its argument
        return out

    assert run_check("padding-mask", {"padding_mask": padding_mask}).passed


def test_a_failure_shows_a_counterexample_with_the_inputs():
    result = run_check("attention-row", {"attention_row": _row(scale=False)})
    assert not result.passed
    assert "counterexample (q (4,), k (5, 4), v (5, 4), keep=None)" in result.message
    assert "first mismatch at index" in result.message


def test_check_prints_and_raises_only_under_nbgrader(capsys, monkeypatch):
    from attnlab.grading import check

    monkeypatch.delenv("ATTNLAB_GRADING", raising=False)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    monkeypatch.delenv("NBGRADER_VALIDATING", raising=False)

    def causal_mask(n_q, n_k, device=None):
        return torch.ones(n_q, n_k, dtype=torch.bool).tril()

    check("causal-mask", {"causal_mask": causal_mask})
    assert "[PASS] causal-mask" in capsys.readouterr().out
    check("causal-mask", {"causal_mask": lambda a, b, device=None: torch.ones(a, b, dtype=torch.bool)})
    assert "[FAIL] causal-mask" in capsys.readouterr().out
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    with pytest.raises(AssertionError, match="causal-mask"):
        check("causal-mask", {"causal_mask": lambda a, b, device=None: torch.ones(a, b, dtype=torch.bool)})


# ---------------------------------------------------------------------------------------------
# shortcuts: each part refuses the library call that would do it
# ---------------------------------------------------------------------------------------------

def _refused(part, ns, name):
    result = run_check(part, ns)
    assert not result.passed and "shortcut" in result.diagnosis, result.message
    assert name in result.message, result.message


def test_the_library_s_padding_mask_is_refused():
    import attnlab

    _refused("padding-mask", {"padding_mask": lambda lengths, max_len: attnlab.attention.padding_mask(lengths, max_len)},
             "attnlab.attention.padding_mask")


def test_the_library_s_causal_mask_is_refused():
    from attnlab import attention

    _refused("causal-mask", {"causal_mask": lambda n_q, n_k, device=None: attention.causal_mask(n_q, n_k)},
             "attnlab.attention.causal_mask")


def test_a_fused_library_kernel_is_refused():
    def masked_attention(q, k, v, mask=None, causal=False):  # right, but PyTorch's fused kernel does the work
        if causal:
            c = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            mask = c if mask is None else mask & c
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return torch.nan_to_num(out)

    _refused("attention-masks", {"masked_attention": masked_attention},
             "torch.nn.functional.scaled_dot_product_attention")


def test_attention_row_through_the_fused_kernel_is_refused():
    def attention_row(q, k, v, keep=None):
        out = torch.nn.functional.scaled_dot_product_attention(q[None, None], k[None], v[None], attn_mask=keep)
        return out, out

    _refused("attention-row", {"attention_row": attention_row}, "torch.nn.functional.scaled_dot_product_attention")


def test_an_experiment_that_times_the_fused_kernel_is_refused():
    def batched(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def loop_vs_batched(sizes, d=32, seed=0, repeat=5):
        q = torch.randn(1, 1, sizes[0], d)
        batched(q, q, q)
        return {"loop": torch.ones(len(sizes)), "batched": torch.ones(len(sizes)), "max_abs_diff": 0.0}

    _refused("loop-timing", {"loop_vs_batched": loop_vs_batched}, "torch.nn.functional.scaled_dot_product_attention")
