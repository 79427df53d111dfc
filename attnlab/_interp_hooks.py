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
5. :func:`before_each_access` runs a check before every load and store (the bounds-checked
   launch of the notebooks' demo cells), and :func:`nan_for_missing_other` gives the masked
   lanes of a load without ``other=`` NaN instead of zeros (the grader's launches); both are
   layers of one patch of ``InterpreterBuilder``, made under the lock while any is active and
   run per thread.

Every patch of ``triton.language`` (Triton's own, made at each interpreted launch, and ours) is
**scoped to the thread** that makes it (:class:`_ThreadScope`): a patched module attribute or
class attribute is looked up per thread, so a kernel compiled in another thread while an
interpreted launch runs (a native launch on a GPU, or ``triton.compile`` for a GPU target on a
CPU machine) sees the real ``triton.language``. Triton's interpreter patches the modules
process-wide, and a compile that met its patches failed with ``'ir.value' object has no
attribute 'dtype'`` at ``tl.arange``.

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
import types

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
    _scope_patches_to_threads()


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


# ---------------------------------------------------------------------------------------
# Patches of triton.language, scoped to the thread that makes them
# ---------------------------------------------------------------------------------------
_MISSING = object()
_thread = threading.local()   # .values: {(id(obj), name): this thread's patched value}
_scoped = {}                  # (id(obj), name) -> obj, for every attribute that is looked up per thread


def _thread_values():
    values = getattr(_thread, "values", None)
    if values is None:
        values = _thread.values = {}
    return values


class _ScopedModule(types.ModuleType):
    """A module (``triton.language``, ``.core``, ``.math``, ...) whose patched attributes are
    looked up per thread: the calling thread's patch if it has one, else the module's own.

    Triton's compiler lets a kernel read a global that is ``type(v) is ModuleType`` or whose
    ``__module__`` starts with ``triton.language``; a module of this class passes by the second
    rule (its ``__module__`` is read from this class, as modules have none of their own)."""

    __module__ = "triton.language"

    def __getattribute__(self, name):
        values = getattr(_thread, "values", None)
        if values:
            value = values.get((id(self), name), _MISSING)
            if value is not _MISSING:
                return value
        return types.ModuleType.__getattribute__(self, name)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):     # Triton's JIT skips `type(v) is ModuleType` and deep-copies the rest
        return self


class _ScopedAttribute:
    """A class attribute (``tl.tensor.__add__``, ``tl.dtype.to_ir``, ...) looked up per thread,
    bound as the value it stands for would be (function, property, ...)."""

    def __init__(self, cls, name, original):
        self.key, self.cls, self.name, self.original = (id(cls), name), cls, name, original

    def __get__(self, instance, owner=None):
        values = getattr(_thread, "values", None)
        value = values.get(self.key, _MISSING) if values else _MISSING
        if value is _MISSING:
            value = self.original
        if value is _MISSING:                       # the class had no such attribute of its own
            value = next((base.__dict__[self.name] for base in self.cls.__mro__[1:] if self.name in base.__dict__),
                         _MISSING)
            if value is _MISSING:
                if self.name == "__bool__" and instance is not None:
                    return lambda: True             # Python's default truth (the class has no __len__)
                raise AttributeError(self.name)
        get = getattr(type(value), "__get__", None)
        return value if get is None else get(value, instance, owner)


class _ThreadScope:
    """Triton's ``_LangPatchScope`` (``set_attr``/``restore``), scoped to the calling thread.

    The first patch of an attribute makes it a per-thread lookup for good (a module becomes a
    :class:`_ScopedModule`, a class attribute a :class:`_ScopedAttribute`); after that a patch
    is an entry in the thread's own table, and ``restore`` puts back what the thread saw before.
    Objects of any other kind are patched process-wide, as Triton does."""

    def __init__(self):
        self._changes = []

    def set_attr(self, obj, name, value):
        key = (id(obj), name)
        if key not in _scoped and not self._make_scoped(key, obj, name):
            self._changes.append((None, (obj, name, getattr(obj, name, _MISSING))))
            setattr(obj, name, value)
            return
        values = _thread_values()
        self._changes.append((key, values.get(key, _MISSING)))
        values[key] = value

    @staticmethod
    def _make_scoped(key, obj, name):
        """Turn ``obj.name`` into a per-thread lookup; False for an object that cannot be."""
        with _lock:
            if key in _scoped:
                return True
            if type(obj) is types.ModuleType:
                obj.__class__ = _ScopedModule
            elif isinstance(obj, type):
                type.__setattr__(obj, name, _ScopedAttribute(obj, name, obj.__dict__.get(name, _MISSING)))
            elif not isinstance(obj, _ScopedModule):
                return False
            _scoped[key] = obj
            return True

    def restore(self):
        values = _thread_values()
        while self._changes:
            key, before = self._changes.pop()
            if key is None:                         # a process-wide patch
                obj, name, original = before
                if original is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, original)
            elif before is _MISSING:
                values.pop(key, None)
            else:
                values[key] = before


def _scope_patches_to_threads():
    """Make Triton's interpreter patch ``triton.language`` per thread (its ``_patch_lang``,
    called at every interpreted launch, builds its scope from this name)."""
    from triton.runtime import interpreter as ti

    if ti._LangPatchScope is not _ThreadScope:
        with _lock:
            ti._LangPatchScope = _ThreadScope
    if not getattr(ti.InterpretedFunction.__call__, "_restores_patches", False):
        with _lock:
            device_call = ti.InterpretedFunction.__call__

            def restoring_call(self, *args, **kwargs):
                # a @triton.jit helper called from a kernel patches triton.language for its own globals
                # (_patch_lang) and Triton never restores it: put this thread's table back on return,
                # or a kernel compiled later on this thread would see the interpreter's functions
                values = _thread_values()
                before = dict(values)
                try:
                    return device_call(self, *args, **kwargs)
                finally:
                    values.clear()
                    values.update(before)

            restoring_call._restores_patches = True
            ti.InterpretedFunction.__call__ = restoring_call


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
        builder = ti.interpreter_builder
        old_options = builder.options
        old_threads = torch.get_num_threads()
        scope = None
        _session_depth = 1
        # Triton patches triton.language again at every call of a @triton.jit helper from a kernel
        # (InterpretedFunction.__call__) and never restores it: this thread's table is put back as it was
        before = dict(_thread_values())
        try:
            scope = ti._patch_lang(_language_anchor)   # a _ThreadScope (check_triton_version)
            for mod_name in _LANGUAGE_MODULES:
                mod = importlib.import_module(mod_name)
                for name, value in list(vars(mod).items()):
                    if name.startswith("_") or not isinstance(value, JITFunction):
                        continue
                    replacement = _interpreted_library.get(id(value))
                    if replacement is None:
                        replacement = _interpreted_library[id(value)] = (value, _DirectCall(value))
                    scope.set_attr(mod, name, replacement[1])    # this thread's tl.max, tl.sum, ...
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
            if scope is not None:
                scope.restore()
            values = _thread_values()
            values.clear()
            values.update(before)


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

    _scope_patches_to_threads()
    return InterpretedFunction(fn, **jit_kwargs)


def compiled(fn):
    """The compiled ``@triton.jit`` kernel of the plain Python function ``fn`` (for a GPU), whatever
    ``TRITON_INTERPRET`` is: launched as ``compiled(fn)[grid](...)``."""
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)


def lower_to_ttir(fn, signature, constexprs):
    """Triton's own frontend on the plain Python kernel ``fn``, for an sm_80 target (no GPU needed): the module
    in TTIR, or what Triton raises for code it does not compile. ``signature``: {parameter: Triton type string},
    ``constexprs``: {(index,): value}, as Triton's ``ASTSource`` takes them. Triton's compiler internals
    (``ASTSource``, ``make_backend``) are used here only, behind :func:`check_triton_version`."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    check_triton_version()
    target = GPUTarget("cuda", 80, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(compiled(fn), signature, constexprs)
    with compiled_frontend():   # in a notebook that set TRITON_INTERPRET=1, tl.max & co. are interpreted functions
        return source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                              context)


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


_compiled_twins: dict = {}   # id(InterpretedFunction) -> (it, the JITFunction of the same Python function)


def _compiled_twin(value):
    """The ``JITFunction`` of an ``InterpretedFunction``'s Python function (made once, kept), else ``value``."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if type(value) is not InterpretedFunction:
        return value
    twin = _compiled_twins.get(id(value))
    if twin is None:
        accepted = inspect.signature(JITFunction.__init__).parameters
        kwargs = {k: v for k, v in value.kwargs.items() if k in accepted}
        twin = _compiled_twins[id(value)] = (value, JITFunction(value.fn, **kwargs))
    return twin[1]


@contextlib.contextmanager
def compiled_frontend():
    """Inside this block, on this thread, Triton's frontend (``ASTSource.make_ir``) lowers the Python function of
    every ``InterpretedFunction`` it meets as the ``JITFunction`` of that function.

    Under ``TRITON_INTERPRET=1`` (set by a notebook before ``import triton``) every ``@triton.jit`` function,
    ``triton.language``'s own helpers included (``tl.max``, ``tl.sum``, ``tl.softmax``, ...), is an
    ``InterpretedFunction``, and the frontend calls such a thing as plain Python on its IR values: any kernel that
    used a reduction failed to lower (``'ir.value' object has no attribute 'data'``). The frontend meets every
    function it calls as a global of the function it lowers (``CodeGenerator.gscope``), as the value of a name or an
    attribute (:meth:`CodeGenerator.visit`), or as a tensor's
    method (``x.max(0)``, :meth:`CodeGenerator.get_Attribute`), and the kernel's cache key meets each function it
    names (:meth:`DependenciesFinder.record_reference`): the four are wrapped here, scoped to this thread."""
    from triton.compiler.code_generator import BoundJITMethod, CodeGenerator, _is_triton_value
    from triton.runtime.jit import DependenciesFinder

    _scope_patches_to_threads()
    init, visit, get_attribute = CodeGenerator.__init__, CodeGenerator.visit, CodeGenerator.get_Attribute
    record_reference = DependenciesFinder.record_reference

    def compiled_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.gscope = {name: _compiled_twin(value) for name, value in self.gscope.items()}

    def compiled_visit(self, node):
        return _compiled_twin(visit(self, node))

    def compiled_get_attribute(self, lhs, attr):
        value = get_attribute(self, lhs, attr)
        if _is_triton_value(lhs):
            # x.max(axis=0): tl.tensor's method is a wrapper of the free function (core._tensor_member_fn) when that
            # function is not a JITFunction; its only free variable is that function
            func = getattr(value, "__func__", None)
            code = getattr(func, "__code__", None)
            if code is not None and code.co_freevars == ("fn",) and func.__closure__:
                inner = func.__closure__[0].cell_contents
                if _compiled_twin(inner) is not inner:
                    return BoundJITMethod(lhs, _compiled_twin(inner))
        return _compiled_twin(value)

    def compiled_record_reference(self, val, *args, **kwargs):
        return record_reference(self, _compiled_twin(val), *args, **kwargs)

    scope = _ThreadScope()
    scope.set_attr(DependenciesFinder, "record_reference", compiled_record_reference)
    scope.set_attr(CodeGenerator, "__init__", compiled_init)
    scope.set_attr(CodeGenerator, "visit", compiled_visit)
    scope.set_attr(CodeGenerator, "get_Attribute", compiled_get_attribute)
    try:
        yield
    finally:
        scope.restore()


def is_interpreted(obj):
    """Whether ``obj`` is a kernel made by ``@triton.jit`` under ``TRITON_INTERPRET=1`` (Triton's interpreter)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(obj, InterpretedFunction)


@contextlib.contextmanager
def jit_helpers_interpreted():
    """Inside this block a ``@triton.jit`` helper called from an interpreted kernel runs
    interpreted too (a compiled ``JITFunction`` refuses to be called from Python)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    scope = _ThreadScope()          # this thread's JITFunction.__call__ only
    scope.set_attr(JITFunction, "__call__", lambda jf, *a, **k: InterpretedFunction(jf.fn)(*a, **k))
    try:
        yield
    finally:
        scope.restore()


# ---------------------------------------------------------------------------------------
# Checks around each load and store, for the grader: bounds first, NaN in undefined lanes
# ---------------------------------------------------------------------------------------
_access = threading.local()     # .layers: this thread's active access layers, innermost last
_access_users = {"count": 0, "originals": None}


def _access_layers():
    layers = getattr(_access, "layers", None)
    if layers is None:
        layers = _access.layers = []
    return layers


def _install_access_dispatch():
    """Patch ``InterpreterBuilder``'s masked load and store once (under the lock) to run this thread's
    layers first. Class-level, below :func:`memory_hooks`' per-builder wrappers, so a trace around a
    layer sees the same accesses."""
    from triton.runtime import interpreter as ti

    cls = ti.InterpreterBuilder
    orig_load, orig_store = cls.create_masked_load, cls.create_masked_store

    def create_masked_load(self, ptrs, mask, other, *rest):
        for layer in reversed(_access_layers()):
            other = layer("load", self, ptrs, mask, other)
        return orig_load(self, ptrs, mask, other, *rest)

    def create_masked_store(self, ptrs, value, mask, *rest):
        for layer in reversed(_access_layers()):
            layer("store", self, ptrs, mask, None)
        return orig_store(self, ptrs, value, mask, *rest)

    cls.create_masked_load, cls.create_masked_store = create_masked_load, create_masked_store
    _access_users["originals"] = (cls, orig_load, orig_store)


@contextlib.contextmanager
def _access_layer(layer):
    """Run ``layer(op, builder, ptrs, mask, other) -> other`` before each interpreted load and store of
    this thread inside the block (other threads' launches are untouched). Nests; re-entrant."""
    check_triton_version()
    with _lock:
        if _access_users["count"] == 0:
            _install_access_dispatch()
        _access_users["count"] += 1
    layers = _access_layers()
    layers.append(layer)
    try:
        yield
    finally:
        for i in range(len(layers) - 1, -1, -1):
            if layers[i] is layer:
                del layers[i]
                break
        with _lock:
            _access_users["count"] -= 1
            if _access_users["count"] == 0:
                cls, orig_load, orig_store = _access_users["originals"]
                cls.create_masked_load, cls.create_masked_store = orig_load, orig_store
                _access_users["originals"] = None


@contextlib.contextmanager
def before_each_access(check):
    """Inside this block, ``check(op, addresses, program)`` runs before every interpreted ``tl.load`` and
    ``tl.store`` of this thread: ``op`` is "load" or "store", ``addresses`` a uint64 numpy array of the
    addresses really moved (masked lanes left out), ``program`` the launch's program id (x, y, z). An
    exception raised by ``check`` stops the access before it happens (the grader's bounds-checked launch
    of demo cells, :mod:`attnlab.guard`)."""

    def layer(op, builder, ptrs, mask, other):
        addresses = ptrs.data[mask.data.astype(bool)].astype(np.uint64).ravel()
        if addresses.size:
            check(op, addresses, tuple(int(i) for i in (builder.grid_idx or (0, 0, 0))))
        return other

    with _access_layer(layer):
        yield


@contextlib.contextmanager
def nan_for_missing_other():
    """Inside this block, the masked lanes of an interpreted float ``tl.load`` without ``other=`` read NaN
    instead of the interpreter's zeros (on a GPU they are undefined: Triton's ``tl.load`` docs), in this
    thread's launches. A kernel that is right only thanks to those zeros then shows it
    (:mod:`attnlab.grading.sandbox.footprint`)."""
    from triton.runtime import interpreter as ti

    def layer(op, builder, ptrs, mask, other):
        if op == "load" and other is None:
            dtype_np = ti._get_np_dtype(ptrs.get_element_ty())
            if np.issubdtype(dtype_np, np.floating):
                return ti.TensorHandle(np.full(ptrs.data.shape, np.nan, dtype=dtype_np), ptrs.get_element_ty())
        return other

    with _access_layer(layer):
        yield


# On import, on a supported Triton: a learner's own first launch (``kernel[grid](...)`` under TRITON_INTERPRET=1, before
# any attnlab launch) must already patch triton.language per thread and restore it after each @triton.jit helper call.
# Triton leaves a helper's patches in place (InterpretedFunction.__call__), process-wide, and a kernel lowered later
# in the same process (the inline check's frontend run) then met the interpreter's tl.arange.
def _install_on_import():
    import triton

    if interpreter_problem(getattr(triton, "__version__", "unknown"), np.__version__) is None:
        _scope_patches_to_threads()


_install_on_import()
