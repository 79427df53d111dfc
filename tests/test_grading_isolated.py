"""Triton parts are launched from the notebook's text in a fresh process (attnlab/grading/sandbox/isolated.py):
only @triton.jit functions and plain numbers cross, Triton's frontend refuses anything that is not
Triton code, and the launch, its bounds and its traffic are measured there."""

import nbformat
import pytest
import triton
import triton.language as tl

from attnlab.grading.sandbox import isolated
from attnlab.grading.checks import run_check
from attnlab.grading.sandbox.runner import RemoteLearner
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
    text, names, defined, refused = isolated.kernel_module([KERNEL, "def helper():\n    return 1\n"])
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
def test_python_inside_a_kernel_is_refused_before_triton_sees_it(tmp_path):
    learner = _learner(tmp_path, [PYTHON_INSIDE])
    try:
        result = run_check("masked-scale", learner)
    finally:
        learner.kernels.stop()
    assert not result.passed and "not Triton code" in result.message and "import os" in result.message


def test_an_object_that_is_not_a_kernel_is_refused_and_a_skeleton_is_not_done(tmp_path):
    sources = ["class K:\n    def __getitem__(self, grid):\n        return lambda *a, **k: None\n\nscale_kernel = K()\n"]
    result = run_check("masked-scale", _learner(tmp_path, sources))
    assert not result.passed and "must be a Triton kernel" in result.message
    nb = nbformat.read(str(ROOT / "exercises" / "06_triton_primer.ipynb"), as_version=4)
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    result = run_check("masked-scale", _learner(tmp_path, sources))
    assert not result.passed and "not implemented yet" in result.message


CONSTANTS = """import math
import torch
LOG2E = tl.constexpr(1 / math.log(2))
NEG_INF = tl.constexpr(float("-inf"))
ACC = tl.float32
BLOCK = 64
TWICE = BLOCK * 2
BLOCK = 32
NOT_A_CONSTANT = torch.ones(1)
CALLS = print("runs")

@triton.jit
def kernel(x_ptr, BLOCK_N: tl.constexpr = TWICE):
    pass

@triton.jit
def by_default(x_ptr, _cfg=exec("import os; os.system('echo default')")):
    pass

@triton.jit
def by_annotation(x_ptr: print("annotation")):
    pass
"""


def test_constants_cross_as_expressions_of_constants_and_code_in_a_def_line_is_refused():
    """Python runs a def's default values and annotations when the def runs: a kernel whose def line holds code is
    refused, never sent (it would run in the kernels' process before Triton sees anything)."""
    text, names, defined, refused = isolated.kernel_module([CONSTANTS])
    assert names == {"kernel"} and {"by_default", "by_annotation"} <= defined
    assert "exec" not in text and "print" not in text and "torch" not in text and "NOT_A_CONSTANT" not in text
    assert "LOG2E = tl.constexpr(1 / math.log(2))" in text and "NEG_INF = tl.constexpr(float('-inf'))" in text
    assert "ACC = tl.float32" in text and "TWICE = 64 * 2" in text and "BLOCK = 32" in text
    assert "BLOCK_N: tl.constexpr=64 * 2" in text  # the default as it was when the def ran
    assert "exec(" in refused["by_default"] and "print('annotation')" in refused["by_annotation"]
    assert all("runs when the `def` runs" in why for why in refused.values())
    # a constant may not rebind math, tl, triton or float, nor reach beyond Triton's dtypes and math's functions
    shadow = ("math = triton.language.core.builtins\nX = math.exec('1')\nfloat = triton.language.core.builtins.exec\n"
              "Y = float('2')\nZ = triton.knobs\n@triton.jit\ndef k(x, c=math.exec('3')):\n    pass\n")
    text, names, defined, refused = isolated.kernel_module([shadow])
    assert "builtins" not in text and "exec" not in text and "knobs" not in text and names == set() and "k" in refused
    learner = _learner(Path("/nonexistent"), [CONSTANTS])
    reply = learner.kernels.launch({"name": "by_default"})
    assert "runs when the `def` runs" in reply["result"]["refused"]


PLAIN_GLOBAL = 1.0
CONSTEXPR_GLOBAL = tl.constexpr(1.0)


@triton.jit
def _reads_a_plain_global(x_ptr, y_ptr, n, alpha, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    tl.store(y_ptr + offs, PLAIN_GLOBAL * alpha * tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _reads_a_constexpr_global(x_ptr, y_ptr, n, alpha, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    tl.store(y_ptr + offs, alpha * tl.load(x_ptr + offs, mask=mask) * CONSTEXPR_GLOBAL, mask=mask)


def test_the_inline_check_refuses_what_triton_s_compiler_refuses():
    """The interpreter runs a kernel that reads a plain float global; Triton's compiler (a GPU, the grader) does
    not: the inline check says so, as attnlab grade will, and a tl.constexpr global passes both."""
    from attnlab.grading.core import LocalLearner

    result = run_check("masked-scale", LocalLearner({"scale_kernel": _reads_a_plain_global}, forbidden=[]))
    assert not result.passed and "Cannot access global variable PLAIN_GLOBAL" in result.message, result.message
    assert "Triton's interpreter lets a kernel read it" in result.message
    result = run_check("masked-scale", LocalLearner({"scale_kernel": _reads_a_constexpr_global}, forbidden=[]))
    assert result.passed, result.message


ESCAPES = {
    "a module attribute reaching exec": "tl.core.builtins.exec('open(\"/tmp/x\", \"w\")')",
    "getattr": "f = getattr(tl, 'lo' + 'ad')",
    "a dunder": "c = X.__class__",
    "an import": "import os",
    "a lambda": "f = lambda: 0",
    "a nested def": "def g():\n        return 0",
    "a comprehension": "v = [i for i in range(3)]",
    "triton's runtime": "d = triton.runtime.driver",
    "a builtin": "e = eval('1')",
    "the walrus": "if (n := 3) > 2:\n        pass",
    "a module as a value": "m = tl",
    "with": "with open('x') as f:\n        pass",
}


@pytest.mark.parametrize("what", sorted(ESCAPES))
def test_a_kernel_outside_the_triton_subset_is_refused_by_reading_it(what):
    # Triton's frontend evaluates a kernel's Python (it calls what it reaches, through module attributes too): the
    # grader reads the kernel first and sends none of these to a process
    source = (f"@triton.jit\ndef scale_kernel(x_ptr, y_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):\n"
              f"    {ESCAPES[what]}\n    tl.store(y_ptr, tl.load(x_ptr))\n")
    text, names, defined, refused = isolated.kernel_module([source])
    assert "scale_kernel" not in names and "scale_kernel" in refused and "def scale_kernel" not in text, refused


def test_honest_kernels_stay_inside_the_subset():
    source = '''
LOG2E = tl.constexpr(1.4426950408889634)

@triton.jit
def _shifted_exp(x, m):
    return tl.math.exp2((x - m) * LOG2E)

@triton.jit
def softmax_kernel(X, Y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + row * n_cols + offs, mask=offs < n_cols, other=-float("inf")).to(tl.float32)
    e = _shifted_exp(x, x.max(0))
    for _ in tl.static_range(1):
        e = e / tl.sum(e, axis=0)
    tl.store(Y + row * n_cols + offs, e, mask=offs < min(n_cols, BLOCK))
'''
    text, names, defined, refused = isolated.kernel_module([source])
    assert names == {"softmax_kernel", "_shifted_exp"} and not refused, refused
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        refused = isolated.kernel_module([c.source for c in nb.cells if c.cell_type == "code"])[3]
        assert not refused, (path.name, refused)
