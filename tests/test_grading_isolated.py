"""Triton parts are launched from the notebook's text in a fresh process (attnlab/grading/isolated.py):
only @triton.jit functions and plain numbers cross, Triton's frontend refuses anything that is not
Triton code, and the launch, its bounds and its traffic are measured there."""

import nbformat
import pytest

from attnlab.grading import isolated
from attnlab.grading.checks import run_check
from attnlab.grading.runner import RemoteLearner
from attnlab.grading.sandbox import Limits

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

KERNEL = '''import os
import triton
import triton.language as tl
os.system("echo module-level code of the notebook")
SCALE_BLOCK = 64

@triton.jit
def scale_kernel(x_ptr, y_ptr, n, alpha, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    tl.store(y_ptr + offs, alpha * tl.load(x_ptr + offs, mask=mask), mask=mask)
'''

PYTHON_INSIDE = '''import triton
import triton.language as tl

@triton.jit
def scale_kernel(x_ptr, y_ptr, n, alpha, BLOCK_SIZE: tl.constexpr):
    import os
    os.system("echo a kernel that runs Python")
'''


def test_only_kernels_and_numbers_cross():
    text, names, defined = isolated.kernel_module([KERNEL, "def helper():\n    return 1\n"])
    assert names == {"scale_kernel"} and "helper" in defined
    assert "os.system" not in text and "SCALE_BLOCK = 64" in text and "@triton.jit" in text


def _learner(tmp_path, sources):
    return RemoteLearner(None, isolated.IsolatedKernels(sources, tmp_path, Limits(memory_mb=2048), timeout=120))


@pytest.mark.slow
def test_a_kernel_from_the_notebook_s_text_passes_its_check(tmp_path):
    learner = _learner(tmp_path, [KERNEL])
    try:
        result = run_check("masked-scale", learner)
    finally:
        learner.kernels.stop()
    assert result.passed, result.message


@pytest.mark.slow
def test_python_inside_a_kernel_is_refused_by_triton_s_frontend(tmp_path):
    learner = _learner(tmp_path, [PYTHON_INSIDE])
    try:
        result = run_check("masked-scale", learner)
    finally:
        learner.kernels.stop()
    assert not result.passed and "not Triton code" in result.message and "Import" in result.message


def test_an_object_that_is_not_a_kernel_is_refused_and_a_skeleton_is_not_done(tmp_path):
    sources = ["class K:\n    def __getitem__(self, grid):\n        return lambda *a, **k: None\n\nscale_kernel = K()\n"]
    result = run_check("masked-scale", _learner(tmp_path, sources))
    assert not result.passed and "must be a Triton kernel" in result.message
    nb = nbformat.read(str(ROOT / "exercises" / "06_triton_primer.ipynb"), as_version=4)
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    result = run_check("masked-scale", _learner(tmp_path, sources))
    assert not result.passed and "not implemented yet" in result.message
