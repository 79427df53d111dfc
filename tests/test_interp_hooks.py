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
