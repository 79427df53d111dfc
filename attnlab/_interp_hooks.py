"""Everything attnlab does with the *internals* of Triton's interpreter, in one place.

Triton's interpreter (``triton/runtime/interpreter.py``) runs a kernel's Python source with
numpy, one program at a time. attnlab leans on four of its internals, all here:

1. :func:`interpreter_session` swaps ``triton.language``'s own ``@jit`` helpers (``tl.max``,
   ``tl.sum``, ``tl.zeros``, ...) for interpreted versions while a kernel runs. They were
   decorated when ``triton`` was imported, normally without ``TRITON_INTERPRET``, and a
   compiled ``JITFunction`` refuses to be called from Python. This is what lets the same
   process run kernels natively on CUDA tensors and interpreted on CPU tensors.
2. It also makes the interpreter fast enough for lessons: ``tl.dot`` on float operands goes
   to ``torch.matmul`` on one thread (float32 products, float32 accumulation, as on the GPU).
   A multi-threaded BLAS call on 128 x 128 tiles costs ~40 ms on a loaded 2-core machine
   (threads wait for each other) against ~0.05 ms on one thread, so torch runs with one
   thread while an interpreted kernel runs (restored afterwards). The integer-overflow
   sanitizer is off too (it re-checks every integer ``+``/``*`` in int64; the course's
   interpreter sizes are tiny).
3. :func:`memory_hooks` wraps ``InterpreterBuilder.create_masked_load`` /
   ``create_masked_store`` (plain loads and stores go through them too) and
   ``GridExecutor`` (to learn each launch's kernel, arguments and program ids). This is
   what :mod:`attnlab.memory` records.
4. :func:`interpreted` builds the interpreter's wrapper of a kernel's Python function,
   :func:`kernel_function` finds the Python function of a real ``@triton.jit`` kernel (the
   grader accepts nothing else), and :func:`jit_helpers_interpreted` makes a learner's own
   ``@triton.jit`` helpers run interpreted when an interpreted kernel calls them.

No module outside this one touches ``triton.runtime.interpreter`` or patches ``JITFunction``
(``tests/test_interp_hooks.py`` checks the source).

Supported: Triton 3.8.x, the tested version, and 3.7.x and 3.6.x, on which the kernel and
tracer tests pass too (:data:`SUPPORTED_TRITON`; 3.6 is what some GPU images ship). On any
other version :func:`check_triton_version` raises a ``RuntimeError`` saying so, because these
internals change between releases. Triton 3.6's interpreter also needs numpy older than 2.4
(it converts one-element arrays to ``int``, which numpy 2.4 refuses): that is checked too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import threading

import numpy as np
import torch

SUPPORTED_TRITON = ("3.8", "3.7", "3.6")

_lock = threading.RLock()
_interpreted_library: dict = {}
_LANGUAGE_MODULES = ("triton.language", "triton.language.standard", "triton.language.random", "triton.language.math")


# Triton versions whose interpreter needs an older numpy: (triton, first numpy that breaks it)
_NUMPY_LIMIT = {"3.6": (2, 4)}


def interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run attnlab's kernels with these versions, or None."""
    series = next((v for v in SUPPORTED_TRITON if triton_version == v or triton_version.startswith(v + ".")), None)
    if series is None:
        return (f"attnlab relies on internals of Triton's interpreter that it has checked for Triton "
                f"{', '.join(v + '.x' for v in SUPPORTED_TRITON)}; this is Triton {triton_version}. "
                f"Install the tested version: pip install 'triton==3.8.0'")
    limit = _NUMPY_LIMIT.get(series)
    if limit is not None:
        major_minor = tuple(int(x) for x in numpy_version.split(".")[:2] if x.isdigit())
        if major_minor >= limit:
            return (f"Triton {triton_version}'s interpreter fails with numpy {numpy_version} "
                    f"(numpy {limit[0]}.{limit[1]} refuses int() of a one-element array, which that "
                    f"interpreter does): pip install 'numpy<{limit[0]}.{limit[1]}', or the tested "
                    f"set: pip install 'triton==3.8.0' 'numpy==2.4.6'")
    return None


def check_triton_version() -> None:
    """Raise ``RuntimeError`` unless the installed Triton (and numpy) can run our interpreter hooks."""
    import triton

    problem = interpreter_problem(getattr(triton, "__version__", "unknown"), np.__version__)
    if problem is not None:
        raise RuntimeError(problem)


def _fast_dot(original):
    from triton.runtime.interpreter import TensorHandle

    def create_dot(a, b, d, input_precision, max_num_imprecise_acc):
        ad, bd, dd = a.data, b.data, d.data
        if (ad.dtype == bd.dtype and ad.dtype in (np.float16, np.float32) and dd.dtype == np.float32):
            a32 = torch.from_numpy(np.ascontiguousarray(ad, dtype=np.float32))
            b32 = torch.from_numpy(np.ascontiguousarray(bd, dtype=np.float32))
            out = torch.matmul(a32, b32).numpy()
            return TensorHandle(out + dd, d.dtype.scalar)
        return original(a, b, d, input_precision, max_num_imprecise_acc)

    return create_dot


class _DirectCall:
    """An interpreted ``triton.language`` helper called without re-patching the language
    (the session has patched it once already; ``InterpretedFunction.__call__`` would redo it
    on every call, which costs milliseconds)."""

    def __init__(self, jit_fn):
        from triton.runtime.interpreter import InterpretedFunction

        self.fn = jit_fn.fn
        self._interp = InterpretedFunction(jit_fn.fn)
        self._rewritten = None

    def __call__(self, *args, **kwargs):
        if self._rewritten is None:
            self._rewritten = self._interp.rewrite()
        return self._rewritten(*args, **kwargs)

    @property
    def __name__(self):
        return self.fn.__name__


# a function whose globals hold both `tl` and `core`, so that `_patch_lang` patches both
import triton.language as tl  # noqa: E402
from triton.language import core  # noqa: E402,F401


def _language_anchor():  # pragma: no cover - never called, only its __globals__ are used
    return tl, core


_session_depth = 0


@contextlib.contextmanager
def interpreter_session():
    """Make interpreted kernels runnable (and quick) inside this block. Re-entrant."""
    global _session_depth
    from triton.runtime import interpreter as ti
    from triton.runtime.jit import JITFunction

    with _lock:
        if _session_depth > 0:
            _session_depth += 1
            try:
                yield
            finally:
                _session_depth -= 1
            return
        check_triton_version()
        try:  # imported lazily by triton during a launch; it must see the original JITFunctions
            import triton.experimental.gluon  # noqa: F401
        except Exception:  # pragma: no cover
            pass
        saved = []
        builder = ti.interpreter_builder
        old_options = builder.options
        old_threads = torch.get_num_threads()
        scope = None
        _session_depth = 1
        try:
            scope = ti._patch_lang(_language_anchor)
            for mod_name in _LANGUAGE_MODULES:
                mod = importlib.import_module(mod_name)
                for name, value in list(vars(mod).items()):
                    if name.startswith("_") or not isinstance(value, JITFunction):
                        continue
                    replacement = _interpreted_library.get(id(value))
                    if replacement is None:
                        replacement = _interpreted_library[id(value)] = (value, _DirectCall(value))
                    saved.append((mod, name, value))
                    setattr(mod, name, replacement[1])
            builder.create_dot = _fast_dot(type(builder).create_dot.__get__(builder))
            builder.options = dataclasses.replace(old_options, sanitize_overflow=False)
            if old_threads != 1:
                torch.set_num_threads(1)
            yield
        finally:
            _session_depth = 0
            if torch.get_num_threads() != old_threads:
                torch.set_num_threads(old_threads)
            builder.options = old_options
            builder.__dict__.pop("create_dot", None)
            for mod, name, value in reversed(saved):
                setattr(mod, name, value)
            if scope is not None:
                scope.restore()


# ---------------------------------------------------------------------------------------
# Memory hooks for attnlab.memory
# ---------------------------------------------------------------------------------------
class LaunchInfo:
    """What the tracer needs to know about one kernel launch."""

    def __init__(self, name, tensors):
        self.name = name
        self.tensors = tensors  # list of (param name, host tensor) in parameter order
        self.grid_idx = (0, 0, 0)


@contextlib.contextmanager
def memory_hooks(on_launch, on_access):
    """Call ``on_launch(LaunchInfo)`` at each interpreted launch and
    ``on_access(launch_info, program, op, ptrs, mask, element_size)`` at each load or store.

    ``ptrs`` is a uint64 numpy array of addresses, ``mask`` a bool array of the same shape
    (True where the element is really moved).
    """
    from triton.runtime import interpreter as ti

    check_triton_version()
    builder = ti.interpreter_builder
    cls = ti.GridExecutor
    orig_call = cls.__call__
    orig_init_args = cls._init_args_hst
    orig_set_idx = type(builder).set_grid_idx
    current = {"launch": None}

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = orig_init_args(self, args_dev, kwargs)
        bound = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
        tensors = [(name, val) for name, val in bound.items() if hasattr(val, "data_ptr") and hasattr(val, "untyped_storage")]
        info = LaunchInfo(self.fn.__name__, tensors)
        current["launch"] = info
        on_launch(info)
        return args_hst, kwargs_hst

    def call(self, *args, **kwargs):
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            current["launch"] = None

    def set_grid_idx(x, y, z):
        orig_set_idx(builder, x, y, z)
        if current["launch"] is not None:
            current["launch"].grid_idx = (x, y, z)

    def element_size(ptrs):
        return max(ptrs.get_element_ty().primitive_bitwidth // 8, 1)

    def masked_load(ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):
        info = current["launch"]
        if info is not None:
            on_access(info, info.grid_idx, "load", ptrs.data, mask.data, element_size(ptrs))
        return type(builder).create_masked_load(builder, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile)

    def masked_store(ptrs, value, mask, cache_modifier, eviction_policy):
        info = current["launch"]
        if info is not None:
            on_access(info, info.grid_idx, "store", ptrs.data, mask.data, element_size(ptrs))
        return type(builder).create_masked_store(builder, ptrs, value, mask, cache_modifier, eviction_policy)

    # the lock guards the patching only: the traced function may launch kernels from another
    # thread (autograd's device thread), which takes the lock in interpreter_session
    with _lock:
        cls.__call__ = call
        cls._init_args_hst = init_args
        builder.set_grid_idx = set_grid_idx
        builder.create_masked_load = masked_load
        builder.create_masked_store = masked_store
    try:
        yield
    finally:
        with _lock:
            cls.__call__ = orig_call
            cls._init_args_hst = orig_init_args
            for name in ("set_grid_idx", "create_masked_load", "create_masked_store"):
                builder.__dict__.pop(name, None)


# ---------------------------------------------------------------------------------------
# Kernels as Python functions, for attnlab's runtime and the grader
# ---------------------------------------------------------------------------------------
def interpreted(fn, **jit_kwargs):
    """The interpreter's wrapper of the plain Python kernel ``fn`` (what ``@triton.jit`` gives
    under ``TRITON_INTERPRET=1``), launched as ``interpreted(fn)[grid](...)``."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn, **jit_kwargs)


def kernel_function(obj):
    """The Python function of a real ``@triton.jit`` kernel (compiled or interpreted, also inside
    ``@triton.autotune``/``@triton.heuristics``), or None for anything else."""
    import types

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kinds = (JITFunction, InterpretedFunction)
    if type(obj) in kinds and isinstance(getattr(obj, "fn", None), types.FunctionType):
        return obj.fn
    inner = getattr(obj, "fn", None)
    if type(obj).__name__ in ("Autotuner", "Heuristics") and type(inner) in kinds \
            and isinstance(getattr(inner, "fn", None), types.FunctionType):
        return inner.fn
    return None


@contextlib.contextmanager
def jit_helpers_interpreted():
    """Inside this block a ``@triton.jit`` helper called from an interpreted kernel runs
    interpreted too (a compiled ``JITFunction`` refuses to be called from Python)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    with _lock:
        saved = JITFunction.__call__
        JITFunction.__call__ = lambda jf, *a, **k: InterpretedFunction(jf.fn)(*a, **k)
    try:
        yield
    finally:
        with _lock:
            JITFunction.__call__ = saved
