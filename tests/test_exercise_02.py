"""Exercise 02 (queries, keys and values): wrong implementations fail their check with the matching diagnosis."""

import math

import pytest
import torch

from attnlab.grading.checks import run_check
from mistakes import Wrong

WRONG = Wrong()


WRONG.add("padding-mask", "off-by-one", padding_mask=lambda lengths, n: torch.arange(n)[None] <= lengths[:, None])
WRONG.add("padding-mask", "inverted", padding_mask=lambda lengths, n: ~(torch.arange(n)[None] < lengths[:, None]))
WRONG.add("padding-mask", "not-bool", padding_mask=lambda lengths, n: (torch.arange(n)[None] < lengths[:, None]).float())

WRONG.add("causal-mask", "off-by-one-diagonal",
      causal_mask=lambda n_q, n_k, device=None: torch.ones(n_q, n_k, dtype=torch.bool).tril(-1))
WRONG.add("causal-mask", "transposed",
      causal_mask=lambda n_q, n_k, device=None: torch.ones(n_q, n_k, dtype=torch.bool).triu())
WRONG.add("causal-mask", "bottom-right",
      causal_mask=lambda n_q, n_k, device=None: torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q))


def _attention(scale=True, mask_mode="fill", dim=-1):
    def masked_attention(q, k, v, mask=None):
        s = q @ k.transpose(-2, -1)
        if scale:
            s = s / math.sqrt(q.shape[-1])
        if mask is not None and mask_mode == "fill":
            s = s.masked_fill(~mask, float("-inf"))
        if mask is not None and mask_mode == "inverted":
            s = s.masked_fill(mask, float("-inf"))
        p = torch.softmax(s, dim=dim)
        if mask is not None and mask_mode == "after":
            p = p * mask
        return torch.nan_to_num(p) @ v
    return masked_attention


WRONG.add("attention-masks", "mask-after-softmax", masked_attention=_attention(mask_mode="after"))
WRONG.add("attention-masks", "inverted-mask", masked_attention=_attention(mask_mode="inverted"))
WRONG.add("attention-masks", "scale-forgotten", masked_attention=_attention(scale=False))
WRONG.add("attention-masks", "wrong-axis", masked_attention=_attention(dim=-2))


def _attention_nan_rows(q, k, v, mask=None):
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


WRONG.add("attention-masks", "fully-masked-row", masked_attention=_attention_nan_rows)


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


def test_missing_and_unfinished_functions_are_named():
    result = run_check("attention-masks", {})
    assert not result.passed and "`masked_attention` is not defined" in result.message

    def masked_attention(q, k, v, mask=None):
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


def test_a_fused_library_kernel_is_refused():
    def masked_attention(q, k, v, mask=None):  # right, but PyTorch's fused kernel does the work: refused
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return torch.nan_to_num(out)

    result = run_check("attention-masks", {"masked_attention": masked_attention})
    assert not result.passed and "shortcut" in result.diagnosis
    assert "torch.nn.functional.scaled_dot_product_attention" in result.message
