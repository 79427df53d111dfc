"""The fused softmax kernel (attnlab.kernels.softmax): one and two passes, empty rows, fp16, bad inputs."""

import importlib

import pytest
import torch

from attnlab.kernels import softmax


def test_softmax_one_and_two_pass(monkeypatch):
    sm = importlib.import_module("attnlab.kernels.softmax")  # the name `softmax` is the function

    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 30
    x[2] = float("-inf")  # a fully masked row gives zeros
    ref = torch.softmax(x, -1).nan_to_num(0.0)
    torch.testing.assert_close(softmax(x), ref)
    monkeypatch.setattr(sm, "MAX_FUSED_BLOCK", 64)  # force the two-pass loop over 64-wide chunks
    assert sm.softmax_block_size(300) == (64, False)
    torch.testing.assert_close(softmax(x), ref)
    torch.testing.assert_close(softmax(torch.randn(3, 1)), torch.ones(3, 1))
    h = torch.randn(2, 3, 7, dtype=torch.float16)
    torch.testing.assert_close(softmax(h), torch.softmax(h.float(), -1).half(), atol=1e-3, rtol=1e-3)


def test_softmax_bad_inputs():
    with pytest.raises(TypeError, match="x: expected dtype"):
        softmax(torch.arange(4))
    with pytest.raises(TypeError, match="bfloat16"):
        softmax(torch.randn(2, 2).bfloat16())
    with pytest.raises(ValueError, match="x: expected at least one element"):
        softmax(torch.randn(0))
