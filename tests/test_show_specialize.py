"""show_source(..., constexprs=...): a kernel shown as Triton compiles it, cut by the code's structure."""

import pytest

from attnlab.kernels.block_sparse_attention import _bsa_fwd_kernel
from attnlab.kernels.flash_attention import _attn_fwd_kernel
from attnlab.show import show_source, specialize


def test_specialize_keeps_the_branch_that_runs():
    src = "a = 0\nif A:  # only with A\n    x = 1\nelse:  # without A\n    x = 2\nif not A:\n    y = 3\nz = 4"
    assert specialize(src, {"A": True}) == "a = 0\n# only with A\nx = 1\nz = 4"
    assert specialize(src, {"A": False}) == "a = 0\n# without A\nx = 2\ny = 3\nz = 4"
    nested = "if A:\n    if B:\n        x = 1\n    else:\n        x = 2\n    w = 0"
    assert specialize(nested, {"A": True, "B": False}) == "x = 2\nw = 0"
    # conditions on other names stay as they are
    assert specialize("if C:\n    x = 1", {}) == "if C:\n    x = 1"
    with pytest.raises(ValueError, match="not the condition of any if"):
        specialize(src, {"CAUSL": False})


def test_causal_and_even_views_of_the_forward_kernels(capsys):
    show_source(_attn_fwd_kernel, constexprs={"CAUSAL": False})
    dense = capsys.readouterr().out
    assert "if CAUSAL" not in dense and "hi = N_K" in dense and "hi = tl.minimum(" not in dense
    assert "if EVEN_N:" in dense
    compile(dense.replace("@jit\n", ""), "<dense>", "exec")   # still valid Python
    show_source(_attn_fwd_kernel, constexprs={"CAUSAL": True, "EVEN_N": True})
    causal = capsys.readouterr().out
    assert "hi = tl.minimum(" in causal and "if EVEN_N" not in causal and "mask=offs_n[:, None] < N_K" not in causal
    compile(causal.replace("@jit\n", ""), "<causal>", "exec")
    show_source(_bsa_fwd_kernel, constexprs={"EVEN_N": True})
    sparse = capsys.readouterr().out
    assert "tl.load(FULL_KV_IDX + idx_off + it)" in sparse and "if EVEN_N" not in sparse and "if CAUSAL" not in sparse
    compile(sparse.replace("@jit\n", ""), "<sparse>", "exec")
