"""One kernel source, two ways to run it: natively on a GPU, or in Triton's interpreter on a CPU.

``triton.jit`` decides *when a function is decorated* whether it becomes a compiled
``JITFunction`` or an ``InterpretedFunction``: it reads ``TRITON_INTERPRET`` at that
moment. A course that runs the same kernels on a laptop and on an H100 cannot ask the
learner to set an environment variable before importing anything, so ``attnlab``
decorates every kernel with :func:`jit` below instead. It keeps the plain Python function
and builds both wrappers from it, lazily, the first time each one is needed:

* the native one, ``triton.runtime.jit.JITFunction(fn)``, when the kernel is launched on
  CUDA tensors;
* the interpreted one, ``triton.runtime.interpreter.InterpretedFunction(fn)``, when it is
  launched on CPU tensors (or when ``TRITON_INTERPRET=1`` is set, or inside
  :func:`interpreting`, which is how :mod:`attnlab.memory` traces kernels on any device).

Launching reads exactly like Triton: ``kernel[grid](*args, **meta)``. The device is taken
from the tensor arguments; mixing CPU and CUDA tensors is an error (the wrappers check
devices before any launch and raise a ``ValueError`` naming the argument).

Running a kernel interpreted needs a few patches of Triton's interpreter (triton.language's
own ``@jit`` helpers such as ``tl.max`` must be interpreted too; ``tl.dot`` goes to BLAS so
lessons run quickly). They live in :mod:`attnlab._interp_hooks`, applied only while an
interpreted launch runs, and are checked against the supported Triton version.

Two limits of the interpreter matter to the course and are checked here, before launch:
it has no bfloat16 arithmetic (:func:`check_interpreter_dtype` raises ``TypeError``
naming the argument), and it cannot load through pointers stored in tensors (the
block-sparse kernel loads *integer block indices* and does ordinary pointer arithmetic
with them, which the interpreter handles).

``tl.dot`` precision: on NVIDIA GPUs fp32 ``tl.dot`` defaults to TF32 (10 mantissa bits),
which would make fp32 results differ from PyTorch's by ~1e-3. The kernels take the
precision as a constexpr from :func:`dot_precision`: ``"ieee"`` for fp32 inputs (exact
fp32 products; the course's fp32 tests compare at 1e-5 to 1e-4) and ``"tf32"`` otherwise
(ignored for fp16/bf16 operands, which use tensor cores with fp32 accumulation). The
interpreter multiplies in fp32 (torch.matmul on the host) whatever the setting.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from attnlab._interp_hooks import interpreter_session

__all__ = ["jit", "interpreting", "use_interpreter", "check_interpreter_dtype", "dot_precision", "Kernel"]

# How many `interpreting()` blocks are open. Deliberately process-wide, not thread-local:
# autograd runs the backward of CUDA tensors on its own device thread, and a trace of
# forward + backward must interpret that thread's launches too.
_force = 0
_force_lock = threading.Lock()


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def interpreting():
    """Run every attnlab kernel in Triton's interpreter inside this block, whatever the device.

    CUDA tensors are then copied to the host for each launch and back (slow, but exact):
    this is what :func:`attnlab.memory.trace` uses to count loads and stores.
    """
    global _force
    with _force_lock:
        _force += 1
    try:
        yield
    finally:
        with _force_lock:
            _force -= 1


def use_interpreter(device: torch.device | str | None) -> bool:
    """True when a kernel launched on tensors of ``device`` runs in the interpreter."""
    if _force > 0 or _env_interpret():
        return True
    if device is None:
        return not torch.cuda.is_available()
    return torch.device(device).type != "cuda"


def check_interpreter_dtype(**tensors: torch.Tensor) -> None:
    """Raise ``TypeError`` if a tensor that will run in the interpreter is bfloat16.

    Triton's interpreter computes with numpy, which has no bfloat16 type.
    """
    for name, t in tensors.items():
        if t is not None and t.dtype == torch.bfloat16 and use_interpreter(t.device):
            raise TypeError(
                f"{name} is bfloat16, which Triton's CPU interpreter does not support; "
                f"use float32 or float16 on the CPU (bfloat16 runs on a CUDA GPU)"
            )


def dot_precision(dtype: torch.dtype) -> str:
    """The ``input_precision`` the kernels pass to ``tl.dot`` for inputs of ``dtype``."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _first_device(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class Kernel:
    """A Triton kernel usable as ``kernel[grid](...)`` on CPU (interpreted) and CUDA (compiled).

    ``fn`` is the undecorated Python function; ``.fn`` keeps it so that a lesson can show its
    source with ``inspect.getsource(kernel.fn)``.
    """

    def __init__(self, fn, **jit_kwargs):
        self.fn = fn
        self.jit_kwargs = jit_kwargs
        self._native = None
        self._interpreted = None
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def native(self):
        if self._native is None:
            from triton.runtime.jit import JITFunction

            self._native = JITFunction(self.fn, **self.jit_kwargs)
        return self._native

    def interpreted(self):
        if self._interpreted is None:
            from attnlab._interp_hooks import interpreted

            self._interpreted = interpreted(self.fn, **self.jit_kwargs)
        return self._interpreted

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            device = _first_device(args, kwargs)
            if use_interpreter(device):
                with interpreter_session():
                    return self.interpreted()[grid](*args, **kwargs)
            return self.native()[grid](*args, **kwargs)

        return launch

    def __repr__(self):
        return f"<attnlab kernel {self.fn.__name__}>"


def jit(fn=None, **jit_kwargs):
    """Decorator: like ``triton.jit``, but the kernel runs natively on CUDA tensors and in the
    interpreter on CPU tensors, decided at each launch.

    Example::

        @jit
        def add_kernel(X, Y, Z, n, BLOCK: tl.constexpr): ...
        add_kernel[(triton.cdiv(n, 128),)](x, y, z, n, BLOCK=128)
    """
    if fn is None:
        return lambda f: Kernel(f, **jit_kwargs)
    return Kernel(fn, **jit_kwargs)
