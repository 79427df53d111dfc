"""The Triton version gate of attnlab._interp_hooks: which Triton and numpy versions the
interpreter hooks accept, and how the tracer and `attnlab doctor` say so when they do not."""

import pytest
import torch

from attnlab.kernels import softmax
from attnlab.memory import trace


def test_unsupported_triton_version_fails_clearly(monkeypatch):
    import triton

    monkeypatch.setattr(triton, "__version__", "9.9.9")
    with pytest.raises(RuntimeError, match="Triton 9.9.9"):
        trace(softmax, torch.randn(2, 2))


def test_interpreter_version_rules():
    from attnlab._interp_hooks import interpreter_problem

    for triton_version, numpy_version in [("3.8.0", "2.4.6"), ("3.7.1", "2.4.6"), ("3.6.0", "2.3.5")]:
        assert interpreter_problem(triton_version, numpy_version) is None
    assert "Triton 3.5.1" in interpreter_problem("3.5.1", "2.3.5")
    # triton 3.6's interpreter calls int() on one-element arrays, which numpy 2.4 refuses
    for numpy_version in ("2.4.0", "2.5.2", "3.0.0"):
        problem = interpreter_problem("3.6.0", numpy_version)
        assert f"numpy {numpy_version}" in problem and "numpy<2.4" in problem


def test_doctor_reports_an_interpreter_that_cannot_run(monkeypatch, capsys):
    import numpy as np
    import triton

    from attnlab import doctor

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(np, "__version__", "2.5.2")
    real = doctor._installed
    monkeypatch.setattr(doctor, "_installed", lambda name: "2.5.2" if name == "numpy" else real(name))
    assert doctor.run() == 1
    out = capsys.readouterr().out
    assert "problem: the kernels cannot run in Triton's interpreter" in out and "numpy<2.4" in out
    with pytest.raises(RuntimeError, match="numpy 2.5.2"):
        trace(softmax, torch.randn(2, 2))


def test_no_module_outside_interp_hooks_touches_triton_internals():
    """Every use of Triton's interpreter internals, and every patch of JITFunction, lives in
    attnlab/_interp_hooks.py behind its version gate and lock (read from the code, not comments)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    internals = {"InterpretedFunction", "GridExecutor", "InterpreterBuilder", "interpreter_builder", "_patch_lang"}
    found = []
    for path in sorted((root / "attnlab").rglob("*.py")) + sorted((root / "kernels").rglob("*.py")):
        if path.name == "_interp_hooks.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(root)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and (
                    node.module.startswith("triton.runtime.interpreter")
                    or (node.module == "triton.runtime" and any(a.name == "interpreter" for a in node.names))):
                found.append(f"{where}:{node.lineno} imports triton's interpreter")
            if isinstance(node, ast.Import) and any(a.name.startswith("triton.runtime.interpreter") for a in node.names):
                found.append(f"{where}:{node.lineno} imports triton's interpreter")
            if isinstance(node, (ast.Name, ast.Attribute)):
                name = node.id if isinstance(node, ast.Name) else node.attr
                if name in internals:
                    found.append(f"{where}:{node.lineno} uses {name}")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and "JITFunction" in ast.unparse(target) + ast.unparse(
                        target.value):
                    found.append(f"{where}:{node.lineno} assigns to {ast.unparse(target)}")
                if isinstance(target, ast.Attribute) and ast.unparse(target).startswith("triton."):
                    found.append(f"{where}:{node.lineno} assigns to {ast.unparse(target)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args and \
                    any(k in ast.unparse(node.args[0]) for k in ("JITFunction", "triton")):
                found.append(f"{where}:{node.lineno} setattr on {ast.unparse(node.args[0])}")
    assert not found, "Triton internals touched outside attnlab/_interp_hooks.py:\n" + "\n".join(found)


def _compile_for_sm80(kernel, signature, constexprs):
    """Lower ``kernel`` (an attnlab kernel: its ``.fn`` is the Python function) to PTX and a cubin
    for sm_80 with Triton's bundled toolchain (no GPU needed)."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction
        import triton
    except ImportError as e:  # pragma: no cover - a triton build without its GPU backend
        pytest.skip(f"no Triton GPU backend: {e}")
    src = ASTSource(JITFunction(kernel.fn), signature, constexprs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 80, 32), options={"num_warps": 4})
    except (RuntimeError, FileNotFoundError) as e:  # pragma: no cover - toolchain missing
        if "ptxas" in str(e) or "not found" in str(e).lower():
            pytest.skip(f"Triton's CUDA toolchain is not available: {e}")
        raise


def test_a_compile_never_sees_the_patches_of_an_interpreted_launch_in_another_thread():
    """Thread A holds an interpreter session and launches interpreted kernels, back to back,
    while this thread compiles a kernel for a GPU: the compile must see the real
    ``triton.language`` (Triton's interpreter patches it process-wide, and a compile that met
    those patches failed with "'ir.value' object has no attribute 'dtype'" at ``tl.arange``)."""
    import threading

    import triton.language as tl

    import importlib

    from attnlab._interp_hooks import interpreter_session

    vector_add = importlib.import_module("attnlab.kernels.vector_add")   # the module (the package exports the function)

    inside, done = threading.Event(), threading.Event()
    seen, errors, launches = {}, [], []
    x = torch.randn(8, 300)

    def interpreted_launches():
        try:
            with interpreter_session():
                seen["arange in the session"] = tl.arange
                inside.set()
                while not done.is_set():
                    torch.testing.assert_close(softmax(x), torch.softmax(x, dim=-1))
                    launches.append(1)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            inside.set()

    thread = threading.Thread(target=interpreted_launches, daemon=True)
    thread.start()
    try:
        assert inside.wait(60)
        assert not tl.core.is_builtin(seen["arange in the session"])   # A's tl.arange is the interpreter's
        assert tl.core.is_builtin(tl.arange)                            # this thread's is Triton's own
        for _ in range(2):
            compiled = _compile_for_sm80(vector_add.add_kernel, {"X": "*fp32", "Y": "*fp32", "Z": "*fp32", "n": "i32",
                                                                  "BLOCK": "constexpr"}, {(4,): 128})
            assert "ptx" in compiled.asm
    finally:
        done.set()
        thread.join(120)
    assert not errors, errors
    assert launches, "no interpreted launch ran while the kernel compiled"
    torch.testing.assert_close(softmax(x), torch.softmax(x, dim=-1))   # and the interpreter still works after


def _masked_sum_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def masked_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)  # no other=: the masked lanes are undefined on a GPU
        tl.store(out_ptr, tl.sum(x, axis=0))
    return masked_sum


def _run_masked_sum(n=5, block=8):
    from attnlab._interp_hooks import interpreted, interpreter_session, kernel_function

    x, out = torch.ones(n), torch.zeros(1)
    with interpreter_session():
        interpreted(kernel_function(_masked_sum_kernel()))[(1,)](x, out, n, BLOCK=block)
    return out.item()


def test_nan_for_missing_other_is_scoped_nested_and_restored():
    import math

    from triton.runtime import interpreter as ti  # the test reads what the hooks restore

    from attnlab._interp_hooks import nan_for_missing_other

    original = ti.InterpreterBuilder.create_masked_load
    assert _run_masked_sum() == 5.0                       # the interpreter's zeros
    with nan_for_missing_other():
        assert math.isnan(_run_masked_sum())
        with nan_for_missing_other():
            assert math.isnan(_run_masked_sum())
        assert math.isnan(_run_masked_sum())              # the inner block's exit leaves the outer's patch
        assert _run_masked_sum(n=8) == 8.0                # no masked lane, nothing undefined
    assert _run_masked_sum() == 5.0
    assert ti.InterpreterBuilder.create_masked_load is original


def test_an_access_layer_of_one_thread_never_reaches_another_threads_launch():
    import threading

    from attnlab._interp_hooks import nan_for_missing_other

    entered, leave, errors = threading.Event(), threading.Event(), []

    def hold():
        try:
            with nan_for_missing_other():
                entered.set()
                leave.wait(60)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            entered.set()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    try:
        assert entered.wait(60)
        assert _run_masked_sum() == 5.0                   # this thread's launch keeps the interpreter's zeros
    finally:
        leave.set()
        thread.join(60)
    assert not errors, errors


def test_before_each_access_sees_only_the_lanes_moved_and_stops_an_access():
    from attnlab._interp_hooks import before_each_access

    seen = []
    with before_each_access(lambda op, addresses, program: seen.append((op, addresses.size, program))):
        assert _run_masked_sum() == 5.0
    assert seen == [("load", 5, (0, 0, 0)), ("store", 1, (0, 0, 0))], seen

    class Stop(Exception):
        pass

    def refuse_stores(op, addresses, program):
        if op == "store":
            raise Stop
    with before_each_access(refuse_stores), pytest.raises(Exception) as info:
        _run_masked_sum()
    cause = info.value
    while cause.__cause__ is not None:
        cause = cause.__cause__
    assert isinstance(cause, Stop)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _double(x):
    return x * 2


@triton.jit
def doubled_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32) + tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, _double(acc))


def test_a_jit_helper_called_from_a_direct_interpreted_launch_leaves_this_thread_compiling():
    """A kernel launched straight through Triton's interpreter (no attnlab session, as a notebook with
    TRITON_INTERPRET=1 does) whose @triton.jit helper runs interpreted: Triton patches triton.language
    again at the helper's call and never restores it, so a GPU compile later on this thread met the
    interpreter's tl.zeros ("Unsupported function referenced"). The thread's patches are gone after."""
    import triton.language as tl

    from attnlab import _interp_hooks
    from attnlab._interp_hooks import interpreted, jit_helpers_interpreted, kernel_function

    x, out = torch.arange(16.0), torch.zeros(16)
    before = dict(_interp_hooks._thread_values())
    with jit_helpers_interpreted():
        interpreted(kernel_function(doubled_kernel))[(1,)](x, out, BLOCK=16)
    torch.testing.assert_close(out, 2 * x)
    assert _interp_hooks._thread_values() == before
    assert tl.core.is_builtin(tl.arange)
    vector_add = __import__("importlib").import_module("attnlab.kernels.vector_add")
    compiled = _compile_for_sm80(vector_add.add_kernel, {"X": "*fp32", "Y": "*fp32", "Z": "*fp32", "n": "i32",
                                                          "BLOCK": "constexpr"}, {(4,): 128})
    assert "ptx" in compiled.asm
