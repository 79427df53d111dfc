"""Calling the learner's functions and launching kernels, in the process that holds them.

:func:`handle` answers one request on a namespace of the learner's names: ``call`` (``name`` and
``cases``, [args, kwargs] or [args, kwargs, grad_output] with ``grad``) returns the learner's *outputs*;
``launch`` launches the learner's ``@triton.jit`` kernel ``name`` on tensors placed inside sentinel-filled
memory (:class:`Buffer`), once per sentinel, in Triton's interpreter through
:func:`attnlab._interp_hooks.memory_hooks` (on a GPU: natively), and returns the outputs and what the memory
shows: elements changed outside the tensors, loads outside them, output elements no ``tl.store`` wrote, and
which program loaded which elements. Nothing here knows the references or the scores, or what a part forbids
(that is read from the learner's code by :mod:`attnlab.grading.shortcuts`).

Two processes use it: the inline ``check()`` in a notebook (:class:`attnlab.grading.core.LocalLearner`,
feedback), and under ``attnlab grade`` the fresh sandboxed process of :mod:`attnlab.grading.sandbox.runner` (calls)
and :mod:`attnlab.grading.sandbox.isolated` (launches, of kernels taken from the notebook as text), whose answers are
data for the grader.
"""

import contextlib

GUARD = 4096  # elements of sentinel before and after every buffer


# ---------------------------------------------------------------------------------------
# Triton launches
# ---------------------------------------------------------------------------------------


def device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Buffer:
    """A tensor of ``data``'s shape inside sentinel-filled memory; ``pad_rows``/``pad_cols`` extra
    rows/cols after each slice, and ``GUARD`` elements before and after.

    ``view`` is what the kernel gets; everything else in ``memory`` must stay the sentinel.
    """

    def __init__(self, data, sentinel, pad_rows=0, pad_cols=0):
        import torch

        *lead, rows, cols = data.shape
        self.shape = tuple(data.shape)
        inner = (*lead, rows + pad_rows, cols + pad_cols)
        numel = 1
        for s in inner:
            numel *= s
        self.memory = torch.full((2 * GUARD + numel,), sentinel, dtype=data.dtype, device=device())
        body = self.memory[GUARD:GUARD + numel].view(inner)
        self.view = body[..., :rows, :cols]
        self.view.copy_(data)
        self.sentinel = self.memory[0].item()  # the sentinel as the buffer holds it (7 in an int8 buffer)
        self.inside = torch.zeros(self.memory.shape, dtype=torch.bool)
        self.inside[GUARD:GUARD + numel].view(inner)[..., :rows, :cols] = True
        # memory index -> flat index into the tensor (-1 outside it)
        self.element = torch.full((self.memory.numel(),), -1, dtype=torch.long)
        v = self.view
        self.element.as_strided(v.shape, v.stride(), v.storage_offset()).copy_(torch.arange(v.numel()).view(v.shape))

    def outside_changed(self):
        return int((self.memory.cpu()[~self.inside] != self.sentinel).sum())

    def never_written(self):
        return int((self.view == self.sentinel).sum())

    def indices(self, addresses):
        """Indices into ``memory`` of those ``addresses`` (numpy uint64) that fall in it."""
        import numpy as np

        start, size = self.memory.data_ptr(), self.memory.element_size()
        index = (np.asarray(addresses).astype(np.int64) - start) // size
        return index[(index >= 0) & (index < self.memory.numel())]


def _kernel_function(obj, name):
    """The Python function of a real ``@triton.jit`` kernel; Refused for anything else."""
    from attnlab._interp_hooks import kernel_function

    fn = kernel_function(obj)
    if fn is None:
        raise Refused(f"`{name}` must be a Triton kernel: a function decorated with @triton.jit, got "
                      f"{type(obj).__name__}. The grader launches it through Triton itself, so an object that "
                      f"only looks like a kernel (kernel[grid](...) computing the result in PyTorch) gets no points")
    return fn


class Refused(Exception):
    pass


def launch(obj, name, grid, make_args, kwargs, buffers, loads=()):
    """Launch the kernel ``obj`` once on ``buffers`` ({name: Buffer}); ``make_args(buffers)``.

    Returns the observations (see the module doc). Raises Refused, NotImplementedError or the
    kernel's exception.
    """
    import numpy as np
    import torch

    fn = _kernel_function(obj, name)
    args = make_args(buffers)
    if device() == "cuda":
        from attnlab._interp_hooks import compiled

        kernel = compiled(fn)   # built here from the function: nothing of the learner's object runs
        kernel[tuple(grid)](*args, **kwargs)
        torch.cuda.synchronize()
        seen = None
    else:
        from attnlab._interp_hooks import interpreted, interpreter_session, jit_helpers_interpreted, memory_hooks

        seen = []  # (program, op, addresses)

        def on_access(info, program, op, ptrs, mask, element_size):
            seen.append((tuple(int(i) for i in program), op, ptrs[mask.astype(bool)].ravel().copy()))

        kernel = interpreted(fn)   # built here from the function: nothing of the learner's object runs
        with interpreter_session(), jit_helpers_interpreted(), memory_hooks(lambda info: None, on_access), \
                np.errstate(all="ignore"):
            kernel[tuple(grid)](*args, **kwargs)
    out = {"outside_changed": {k: b.outside_changed() for k, b in buffers.items()},
           "never_written": {k: b.never_written() for k, b in buffers.items()},
           "values": {k: b.view.detach().cpu().clone() for k, b in buffers.items()},
           "traced": seen is not None}
    if seen is not None:
        loads_outside, stored, loaded, traffic = {}, {}, {k: {} for k in loads}, {}
        for k, b in buffers.items():
            outside, written = 0, np.zeros(b.memory.numel(), dtype=bool)
            flags = b.inside.numpy()
            element = b.element.numpy()
            moved = {"load_bytes": 0, "store_bytes": 0}
            distinct = np.zeros(b.memory.numel(), dtype=bool)
            for program, op, addresses in seen:
                index = b.indices(addresses)
                if not index.size:
                    continue
                moved[f"{op}_bytes"] += int(flags[index].sum()) * b.memory.element_size()
                if op == "load":
                    distinct[index[flags[index]]] = True
                    outside += int((~flags[index]).sum())
                    if k in loaded:
                        flat = element[index]
                        flat = flat[flat >= 0]
                        if flat.size:
                            loaded[k].setdefault(program, set()).update(flat.tolist())
                else:
                    written[index] = True
            loads_outside[k] = outside
            stored[k] = int((flags & ~written).sum())
            traffic[k] = {**moved, "load_elements": int(distinct.sum())}
        out["loads_outside"] = loads_outside
        out["not_stored"] = stored
        out["traffic"] = traffic  # bytes inside each tensor, every access counted (a row loaded twice: twice)
        out["loaded"] = {k: [[list(p), torch.tensor(sorted(s), dtype=torch.long)] for p, s in sorted(v.items())]
                         for k, v in loaded.items()}
    return out


def build_args(spec, buffers):
    """Kernel arguments from the grader's description: ["buf", name, row], ["stride", name, dim],
    ["val", value] or ["dev", tensor]."""
    out = []
    for item in spec:
        kind = item[0]
        if kind == "buf":
            view = buffers[item[1]].view
            out.append(view if item[2] is None else view[item[2]])
        elif kind == "stride":
            out.append(buffers[item[1]].view.stride(item[2]))
        elif kind == "dev":
            out.append(item[1].to(device()))
        else:
            out.append(item[1])
    return out


def describe_error(exc):
    from attnlab.grading.feedback import describe_exception  # the learner's line first, in plain words

    return describe_exception(exc)


def torch_full(shape, value):
    import torch

    return torch.full(tuple(shape), value)


def run_launch(obj, req, before=None):
    """One ``launch`` request on the kernel object ``obj``; the per-sentinel observations. ``before(args)``
    runs before each launch (the isolated process verifies the kernel there). With ``"undefined_other": True``
    the masked lanes of a load without ``other=`` read NaN, as on a GPU they may
    (:func:`attnlab._interp_hooks.nan_for_missing_other`)."""
    from attnlab._interp_hooks import nan_for_missing_other

    with nan_for_missing_other() if req.get("undefined_other") else contextlib.nullcontext():
        return _run_launch(obj, req, before)


def _run_launch(obj, req, before):
    results = []
    for sentinel in req["sentinels"]:
        buffers = {k: Buffer(b["data"] if not b.get("output") else torch_full(b["shape"], sentinel), sentinel,
                             b.get("pad_rows", 0), b.get("pad_cols", 0)) for k, b in req["buffers"].items()}
        args = build_args(req["args"], buffers)
        if before is not None:
            before(args)
        results.append(launch(obj, req["name"], req["grid"], lambda bufs: args, req.get("kwargs", {}), buffers,
                              loads=req.get("loads", []) if not results else ()))
    return results


_TL = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64", "int32": "i32",
       "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def _signature(fn, args, kwargs):
    """Triton's (signature, constexprs) of the function ``fn`` for one launch's arguments."""
    import inspect

    import torch

    params = list(inspect.signature(fn).parameters.values())
    sig, constexprs = {}, {}
    values = dict(zip([p.name for p in params], args))
    values.update(kwargs)
    for i, p in enumerate(params):
        annotation = p.annotation
        is_constexpr = annotation is not inspect.Parameter.empty and "constexpr" in str(
            getattr(annotation, "__name__", annotation))
        value = values.get(p.name, p.default)
        if is_constexpr or value is None or isinstance(value, bool):
            sig[p.name], constexprs[(i,)] = "constexpr", value
        elif torch.is_tensor(value):
            sig[p.name] = "*" + _TL.get(str(value.dtype).replace("torch.", ""), "fp32")
        elif isinstance(value, int):
            sig[p.name] = "i64" if abs(value) >= 2**31 else "i32"
        elif isinstance(value, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"argument {p.name!r} of type {type(value).__name__} is not a Triton argument")
    return sig, constexprs


def verify(fn, args, kwargs):
    """Lower ``fn`` (the plain Python function) to TTIR with Triton's frontend; raise if it is not Triton code."""
    from attnlab._interp_hooks import lower_to_ttir

    lower_to_ttir(fn, *_signature(fn, args, kwargs))


def outside_subset(fn):
    """Why the Python function of a kernel is outside the Triton subset ``attnlab grade`` accepts
    (:func:`attnlab.grading.sandbox.isolated.not_triton`), read from its source with the names of its module: constants
    (numbers, strings, Triton's constexpr and dtypes) and other kernels; None when it is inside, or when its source
    cannot be read here (the grader reads it from the notebook's text)."""
    import ast
    import inspect
    import textwrap

    import triton.language as tl

    from attnlab._interp_hooks import kernel_function
    from attnlab.grading.triton_subset import not_triton

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef)), None)
    if node is None:
        return None
    scope = fn.__globals__
    kernels = {n for n, v in scope.items() if kernel_function(v) is not None}
    constants = {n for n, v in scope.items() if n not in kernels and (
        isinstance(v, (bool, int, float, str, tl.constexpr, tl.dtype)) or v is None)}
    return not_triton(node, constants, kernels)


def verifier(name, obj, req, verified):
    """What runs before each launch of the kernel ``obj`` for ``req``: :func:`verify` once per signature (the keys
    in ``verified``), raising :class:`Refused` with Triton's reason."""
    fn = obj
    while hasattr(fn, "fn"):  # @triton.jit, and @triton.autotune/heuristics around it in the learner's own process
        fn = fn.fn

    def verified_first(args):
        key = (name, repr([(type(a).__name__, getattr(a, "dtype", None)) for a in args]),
               repr(sorted(req.get("kwargs", {}).items())))
        if key not in verified:
            why = outside_subset(fn)    # read first, as attnlab grade reads it (isolated.not_triton)
            if why is not None:
                raise Refused(f"`{name}` is not Triton code the grader accepts: {why}")
            try:
                verify(fn, args, req.get("kwargs", {}))
            except Exception as exc:
                why = describe_error(exc)
                if "is not defined" in why:
                    why += (" (the kernel's process holds only the notebook's @triton.jit functions and its module-"
                            "level constants, such as X = tl.constexpr(1 / math.log(2)); pass anything else as an "
                            "argument)")
                elif "Cannot access global variable" in why:
                    why += " (Triton's interpreter lets a kernel read it; Triton's compiler, as on a GPU, does not)"
                raise Refused(f"`{name}` is not Triton code that Triton's compiler accepts: {why}") from None
            verified.add(key)

    return verified_first


# ---------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------


def _outcome(fn):
    """{"ok": value}, {"refused": why} or {"raised": ..., "not_implemented": bool}."""
    try:
        value = fn()
        out = {"ok": value}
    except Refused as exc:
        out = {"refused": str(exc)}
    except NotImplementedError:
        out = {"raised": "NotImplementedError", "not_implemented": True}
    except BaseException as exc:  # the learner's bug (even SystemExit), reported, never fatal here
        out = {"raised": describe_error(exc), "not_implemented": "NotImplementedError" in repr(exc)}
    return out


def backward(fn, args, kwargs, inputs, output, grad_output):
    """Call ``fn`` with the arguments at positions ``inputs`` requiring grad and backpropagate ``grad_output``
    from its output (``output``: an index into a returned tuple, or None for the whole output). Returns
    (the output, detached; [each input's .grad, None if it got none]). The learner's function, the spec and
    the mistakes all go through here, so the three are differentiated the same way."""
    import torch

    args = list(args)
    for i in inputs:
        args[i] = args[i].detach().clone().requires_grad_(True)
    out = fn(*args, **kwargs)
    y = out if output is None else out[output]
    if not torch.is_tensor(y) or not y.requires_grad:
        raise TypeError("the output does not depend on the inputs through autograd: return the result of your "
                        "autograd.Function's apply (not a detached tensor)")
    torch.autograd.backward([y], [grad_output])

    def detached(x):
        if torch.is_tensor(x):
            return x.detach()
        if isinstance(x, (tuple, list)):
            return type(x)(detached(v) for v in x)
        return x

    return detached(out), [None if args[i].grad is None else args[i].grad.detach() for i in inputs]


def _call_with_grad(obj, args, kwargs, grad, grad_output):
    """{"out": the output (detached), "grads": [each input's .grad]} of :func:`backward` for a request's ``grad``."""
    out, grads = backward(obj, args, kwargs, grad["inputs"], grad.get("output"), grad_output)
    return {"out": out, "grads": grads}


def _give_back_free_memory():
    """Return the C heap's free pages to the system (glibc's ``malloc_trim(0)``; nothing where there is none).

    Done after every call request: memory freed by earlier work stays resident in the heap, and a later
    allocation that reuses it adds nothing to the process's resident memory, which is what the peak-memory
    checks measure (:mod:`attnlab.grading.sandbox.footprint`). In a long-lived process (the tests, a notebook kernel)
    a copy of a whole KV cache went unseen that way."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _tapped(ns, tap):
    """While one case runs, ``tap["name"]`` of ``ns`` (a function the part requires, in the namespace the called
    function reads its globals from: the notebook's) adds ``tap["step"]`` times
    k to each floating-point tensor its k-th call returns (an int or integer tensor: int(step) times k; in a tuple
    too): what the graded function returns then shows, to the grader's side,
    how many times it called that function on this call and which output each call made (nothing is reported).
    No tap, or a name that is not a function of the notebook: nothing changes."""
    name = tap.get("name") if isinstance(tap, dict) else None
    fn = ns.get(name) if isinstance(name, str) else None
    if not callable(fn) or type(tap.get("step")) is not float:
        yield
        return
    import torch

    calls = []

    def shifted(out):
        if torch.is_tensor(out) and out.is_floating_point():
            return out + tap["step"] * len(calls)
        if type(out) is int or torch.is_tensor(out) and out.dtype in (torch.int32, torch.int64):
            return out + int(tap["step"]) * len(calls)
        return type(out)(shifted(x) for x in out) if type(out) in (tuple, list) else out

    def tapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        calls.append(None)
        return shifted(out)

    ns[name] = tapped
    try:
        yield
    finally:
        if ns.get(name) is tapped:
            ns[name] = fn


def handle(req, ns):
    """The answer to one request, given the notebook's namespace ``ns``."""
    try:
        return _handle(req, ns)
    finally:
        if req.get("op") == "call":
            _give_back_free_memory()


def _handle(req, ns):
    op, name = req["op"], req["name"]
    if name not in ns:
        return {"missing": True}
    obj = ns[name]
    if op == "call":
        if not callable(obj):
            return {"not_callable": type(obj).__name__}
        if req.get("ranks"):  # each case: one [args, kwargs] per rank, called in a gloo group (ranks.py)
            from attnlab.distributed.group import call_on_ranks
            return {"results": call_on_ranks(obj, req["cases"], req["ranks"], _outcome)}
        results = []
        grad, tap = req.get("grad"), req.get("tap")
        for case in req["cases"]:
            args, kwargs = case[0], case[1]
            with _tapped(getattr(obj, "__globals__", ns), tap):   # where the function reads its names
                if grad is None:
                    results.append(_outcome(lambda: obj(*args, **kwargs)))
                else:
                    results.append(_outcome(lambda: _call_with_grad(obj, args, kwargs, grad, case[2])))
            if "ok" not in results[-1]:
                break  # the grader stops at the first failure
        return {"results": results}
    if op == "launch":
        launched = []
        result = _outcome(lambda: run_launch(obj, req, launched.append))
        if req.get("verify") and "ok" in result and launched and hasattr(obj, "fn"):
            # the inline check: a kernel that ran in the interpreter is also verified, as the grader's process
            # does before it launches (a global that is not a tl.constexpr runs here, and not in Triton's compiler)
            verified = _outcome(lambda: verifier(name, obj, req, set())(launched[0]))
            result = result if "ok" in verified else verified
        return {"result": result}
    raise ValueError(f"unknown request {op!r}")
