"""Exercise 02 (queries, keys and values): wrong implementations fail their check with the matching diagnosis,
shortcuts are refused, and the loop of the timing experiment is scored on its values only."""

import math

import pytest
import torch

from attnlab.grading.checks import run_check
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
# loop-timing: the learner's loop, verified from its values; timings are the grader's own and never scored
# ---------------------------------------------------------------------------------------------

def _loop(pick=lambda b, h, i: (b, h, i), heads=None, part=1, calls=1):
    """A learner's loop_attention (calling attention_row ``calls`` times per query) with one thing changed."""
    def loop_attention(q, k, v):
        out = torch.zeros(*q.shape[:-1], v.shape[-1] if part == 1 else k.shape[-2])
        for b in range(q.shape[0]):
            for h in range(q.shape[1] if heads is None else heads):
                for i in range(q.shape[2]):
                    for _ in range(calls - 1):
                        attention_row(q[pick(b, h, i)], k[b, h], v[b, h])   # the weights, say, in a call of its own
                    out[b, h, i] = attention_row(q[pick(b, h, i)], k[b, h], v[b, h])[part]
        return out
    return loop_attention


def _called_once_then_batched(q, k, v):
    """attention_row called (once), the numbers from batched attention: the loop the part times is not there."""
    attention_row(q[0, 0, 0], k[0, 0], v[0, 0])
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def attention_row(q, k, v, keep=None):  # the learner's part 4 (a right one), as the loop's namespace sees it
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)   # one query, or several
    return weights, weights @ v


WRONG.add("loop-timing", "first-head-only", loop_attention=_loop(heads=1))
WRONG.add("loop-timing", "one-query-repeated", loop_attention=_loop(pick=lambda b, h, i: (b, h, 0)))
WRONG.add("loop-timing", "weights-not-output", loop_attention=_loop(part=0))
WRONG.add("loop-timing", "row-never-called", loop_attention=_called_once_then_batched)
WRONG.add("loop-timing", "not-one-call-per-query", loop_attention=_loop(calls=2))

test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


@pytest.mark.parametrize("salt", [0, 12345, 987654321])
def test_a_right_loop_passes_under_secret_salts_and_shows_the_grader_s_timing(salt):
    ns = {"loop_attention": _loop(), "attention_row": attention_row}
    result = run_check("loop-timing", ns, salt=salt)
    assert result.passed, result.message
    assert "the grader's own timing" in result.message and "not scored" in result.message
    assert "N=256" in result.message


def _one_call_per_head(q, k, v):
    """attention_row called once per (b, h) on all of its queries at once (this attention_row takes them)."""
    return torch.stack([torch.stack([attention_row(q[b, h], k[b, h], v[b, h])[1] for h in range(q.shape[1])])
                        for b in range(q.shape[0])])


def _backwards(q, k, v):
    """One call per query, the queries taken last to first."""
    rows = [[[attention_row(q[b, h, i], k[b, h], v[b, h])[1] for i in reversed(range(q.shape[2]))]
             for h in range(q.shape[1])] for b in range(q.shape[0])]
    return torch.stack([torch.stack([torch.stack(r[::-1]) for r in hs]) for hs in rows])


def test_one_call_per_query_in_any_order_passes_and_the_calls_are_seen_not_read():
    """The grader sees the calls (each case runs again with attention_row's k-th call shifted by k times a salted
    step): a loop over the queries in any order passes; one call for all of a head's queries does not, and neither
    does a loop whose code calls attention_row (so the syntax rule is met) but whose numbers come from elsewhere."""
    for salt in (0, 777):
        result = run_check("loop-timing", {"loop_attention": _backwards, "attention_row": attention_row}, salt=salt)
        assert result.passed, result.message
    result = run_check("loop-timing", {"loop_attention": _one_call_per_head, "attention_row": attention_row})
    assert not result.passed and result.diagnosis == ["not-one-call-per-query"], result.message
    result = run_check("loop-timing", {"loop_attention": _called_once_then_batched, "attention_row": attention_row})
    assert not result.passed and result.diagnosis == ["row-never-called"], result.message
    assert attention_row.__name__ == "attention_row"   # the tap is gone after the call


def test_made_up_timings_score_nothing():
    # the old experiment's answer: plausible numbers for the table, nothing the grader can verify
    def loop_vs_batched(sizes, d=32, seed=0, repeat=5):
        return {"loop": torch.tensor([8e-4, 8e-3, 3.5e-2])[:len(sizes)],
                "batched": torch.tensor([6e-5, 4e-5, 2e-4])[:len(sizes)], "max_abs_diff": 4e-7}

    result = run_check("loop-timing", {"loop_vs_batched": loop_vs_batched})
    assert not result.passed and "`loop_attention` is not defined" in result.message, result.message


def test_a_loop_that_never_calls_attention_row_scores_nothing():
    # right values from the batched attention: not the loop the part times
    def masked_attention(q, k, v, mask=None, causal=False):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v

    def loop_attention(q, k, v):
        return masked_attention(q, k, v)

    result = run_check("loop-timing", {"loop_attention": loop_attention, "masked_attention": masked_attention})
    assert not result.passed and "attention_row" in result.message, result.message


def test_the_loop_s_sizes_depend_on_the_salt():
    from attnlab.grading import core
    from attnlab.grading.exercises.e02 import checks

    seen = set()
    for salt in (0, 1, 2):
        core._SALT[0] = salt
        try:
            seen.add(checks._loop_cases()[2][0])
        finally:
            core._SALT[0] = 0
    assert len(seen) == 3


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


def test_a_loop_through_the_fused_kernel_is_refused():
    def loop_attention(q, k, v):
        attention_row(q[0, 0, 0], k[0, 0], v[0, 0])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    _refused("loop-timing", {"loop_attention": loop_attention, "attention_row": attention_row},
             "torch.nn.functional.scaled_dot_product_attention")
