"""The notebook's ``check()`` says what ``attnlab grade`` says, as a learner meets it (issue: correct kernels that use a
reduction failed the inline check with a CompilationError; an answer built on a name the setup cell imports was said
not to use it; a rewritten answer was judged by the code it replaced).

Each case runs as a learner runs it: the exercise's own setup cell, then the learner's cells, in one fresh Jupyter
kernel (nbclient), and reads what ``check`` printed. Every solution notebook is held to the same standard by the
root ``conftest.py`` (a notebook cell printing ``[FAIL]`` fails its nbval test).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup_cell(exercise):
    nb = nbformat.read(ROOT / "exercises" / f"{exercise}.ipynb", as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code")


def run_as_learner(exercise, *cells):
    """What each cell printed, the exercise's setup cell first, in one fresh kernel."""
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (_setup_cell(exercise), *cells)]
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "exercises")}}
                   ).execute()
    return ["".join(o.get("text", "") for o in c.outputs if o.get("output_type") == "stream") for c in nb.cells]


ROW_MAX_AND_SOFTMAX = '''
import math

import torch
import triton
import triton.language as tl

from attnlab.memory import trace              # as the exercises' setup cell: attnlab is imported before any launch
from attnlab.grading.sandbox.agent import verify


@triton.jit
def _exp_shifted(x):
    return tl.exp(x - tl.max(x, axis=0))


@triton.jit
def softmax_rows(X, Y, N: tl.constexpr):
    r = tl.program_id(0)
    x = tl.load(X + r * N + tl.arange(0, N))
    m = x.max(0)                          # a tensor's method: tl.tensor's wrapper of tl.max
    e = _exp_shifted(x) * tl.exp(m - m)   # a helper of the learner's own, itself calling tl.max
    tl.store(Y + r * N + tl.arange(0, N), e / tl.sum(e, axis=0))


@triton.jit
def calls_python(X, N: tl.constexpr):
    tl.store(X + tl.arange(0, N), math.sqrt(tl.load(X + tl.arange(0, N))))


x, y = torch.randn(3, 16), torch.empty(3, 16)
softmax_rows[(3,)](x, y, 16)                   # interpreted first, as a notebook does
assert torch.allclose(y, torch.softmax(x, 1), atol=1e-6)
verify(softmax_rows.fn, (x, y, 16), {})        # then lowered with Triton's frontend, in the same process
try:
    verify(calls_python.fn, (x, 16), {})
except Exception as exc:
    print("refused:", type(exc).__name__)
else:
    raise SystemExit("a kernel calling math.sqrt on a tensor was lowered")
'''


def test_a_reduction_kernel_lowers_in_a_process_that_interprets_it(tmp_path):
    # the root cause: under TRITON_INTERPRET=1 every @triton.jit function, tl.max's own included, is an
    # InterpretedFunction, which Triton's frontend called as Python on its IR values
    script = tmp_path / "kernels.py"           # Triton reads a kernel's source from its file
    script.write_text(ROW_MAX_AND_SOFTMAX)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: CompilationError" in out.stdout


def test_a_correct_reduction_kernel_passes_the_notebook_check():
    answer = textwrap.dedent('''
        @triton.jit
        def row_sum_kernel(x_ptr, out_ptr, n_cols, stride_xm, BLOCK_N: tl.constexpr):
            row = tl.program_id(0)
            acc = tl.zeros((BLOCK_N,), tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                acc += tl.load(x_ptr + row * stride_xm + cols, mask=cols < n_cols, other=0.0)
            tl.store(out_ptr + row, acc.sum(axis=0))
    ''')
    printed = run_as_learner("06_triton_primer", answer, 'check("row-sum")')
    assert printed[-1].startswith("[PASS] row-sum"), printed[-1]


DECODE_BYTES_WITH_IOMODEL = '''
from attnlab import iomodel

def decode_bytes(contexts, kv_heads_list, heads=8, d=16):
    return torch.tensor([[iomodel.decode_io(1, heads, [L], d, kv_heads=h).total_bytes for L in contexts]
                         for h in kv_heads_list], dtype=torch.int64)
'''

DECODE_BYTES_WITH_TRACE = '''
def decode_bytes(contexts, kv_heads_list, heads=8, d=16):
    rows = []
    for kv_heads in kv_heads_list:
        row = []
        for L in contexts:
            q = torch.randn(1, heads, 1, d).half()
            k, v = torch.randn(1, kv_heads, L, d).half(), torch.randn(1, kv_heads, L, d).half()
            t = trace(flash_decode, q, k, v, torch.tensor([L], dtype=torch.int32), num_splits=1)
            row.append(t.bytes_read + t.bytes_written)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)
'''


def test_an_answer_using_the_setup_cells_trace_and_rewritten_from_a_forbidden_one_passes():
    # `trace` comes from the exercise's setup cell (as hint 2 says); the first version used attnlab.iomodel, which
    # the part forbids, and was replaced in a new cell: the check reads the answer the namespace holds
    printed = run_as_learner("10_inference", DECODE_BYTES_WITH_IOMODEL, 'check("decode-bytes")',
                             DECODE_BYTES_WITH_TRACE, 'check("decode-bytes")')
    assert printed[2].startswith("[FAIL] decode-bytes") and "attnlab.iomodel" in printed[2], printed[2]
    assert printed[4].startswith("[PASS] decode-bytes"), printed[4]


def test_the_inline_reading_of_the_history_keeps_what_the_namespace_holds():
    from attnlab.grading import shortcuts
    from attnlab.grading.layout import given_sources
    from attnlab.grading.parts import forbidden, required

    given = list(given_sources("10_inference").values())
    ns = {"In": ["", given[0], DECODE_BYTES_WITH_IOMODEL, DECODE_BYTES_WITH_TRACE]}
    assert shortcuts.in_namespace(ns, ["decode_bytes"], forbidden("decode-bytes"), given) == []
    assert shortcuts.missing_in_namespace(ns, ["decode_bytes"], required("decode-bytes"), given) == []
    ns["In"].append(DECODE_BYTES_WITH_IOMODEL)      # and back again: the latest version is read
    found = shortcuts.in_namespace(ns, ["decode_bytes"], forbidden("decode-bytes"), given)
    assert found and all(name.startswith("attnlab.iomodel") for name, _line in found)
    assert shortcuts.missing_in_namespace(ns, ["decode_bytes"], required("decode-bytes"), given) != []


def test_the_check_output_a_lesson_stores_is_what_check_prints_now():
    # nbval-lax compares no output: a shortened mistake message left lesson 00's stored [FAIL] saying the old words
    import contextlib
    import io

    from attnlab.grading import check, hint

    for path in sorted((ROOT / "lessons").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type != "code" or "check(" not in cell.source:
                continue
            stored = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile("import torch\n" + cell.source, str(path), "exec"), {"check": check, "hint": hint})
            assert printed.getvalue() == stored, (path.name, printed.getvalue(), stored)
