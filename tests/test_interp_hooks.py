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
