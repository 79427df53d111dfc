"""Calling the learner's functions and launching kernels, in the process that holds them.

:func:`handle` answers one request on a namespace of the learner's names: ``call`` returns the learner's
*outputs*; ``launch`` launches the learner's ``@triton.jit`` kernel on tensors inside sentinel-filled memory
(:class:`Buffer`), once per sentinel, traced in Triton's interpreter (on a GPU: natively), and returns the outputs and
what the memory shows. Nothing here knows the references, the scores or what a part forbids. It runs in the inline
``check()`` (:class:`attnlab.grading.core.LocalLearner`: feedback) and, under ``attnlab grade``, in the sandboxed
processes of :mod:`.runner` (calls) and :mod:`.isolated` (launches), whose answers are data for the grader.
"""

import ast
import contextlib
import ctypes
import inspect
import math
import textwrap

import numpy as np
import torch

from attnlab.grading.feedback import describe_exception as describe_error  # the learner's line first, in plain words

GUARD = 4096  # elements of sentinel before and after every buffer


class Refused(Exception):
    """A kernel the grader does not launch: not a real ``@triton.jit`` function, or not Triton code it accepts."""


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


class Buffer:
    """A tensor of ``data``'s shape inside sentinel-filled memory; ``pad_rows``/``pad_cols`` extra rows/cols after
    each slice, and ``GUARD`` elements before and after. ``view`` is what the kernel gets; everything else in
    ``memory`` must stay the sentinel."""

    def __init__(self, data, sentinel, pad_rows=0, pad_cols=0):
        *lead, rows, cols = data.shape
        self.shape = tuple(data.shape)
        inner = (*lead, rows + pad_rows, cols + pad_cols)
        numel = math.prod(inner)
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

    def indices(self, addresses):
        """Indices into ``memory`` of those ``addresses`` (numpy uint64) that fall in it."""
    
        start, size = self.memory.data_ptr(), self.memory.element_size()
        index = (np.asarray(addresses).astype(np.int64) - start) // size
        return index[(index >= 0) & (index < self.memory.numel())]


def launch(obj, name, grid, args, kwargs, buffers, loads=()):
    """Launch the kernel ``obj`` once with ``args`` on ``buffers`` ({name: Buffer}): the outputs, elements changed
    outside the tensors, output elements never written and, traced, loads outside them, elements no ``tl.store``
    wrote, the bytes moved and which program loaded which elements of the tensors named in ``loads``. Raises
    Refused (not a real ``@triton.jit`` kernel), NotImplementedError or the kernel's exception."""
    from attnlab._interp_hooks import kernel_function

    fn = kernel_function(obj)
    if fn is None:
        raise Refused(f"`{name}` must be a Triton kernel: a function decorated with @triton.jit, got "
                      f"{type(obj).__name__}. The grader launches it through Triton itself, so an object that "
                      f"only looks like a kernel (kernel[grid](...) computing the result in PyTorch) gets no points")
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
    out = {"outside_changed": {k: int((b.memory.cpu()[~b.inside] != b.sentinel).sum()) for k, b in buffers.items()},
           "never_written": {k: int((b.view == b.sentinel).sum()) for k, b in buffers.items()},
           "values": {k: b.view.detach().cpu().clone() for k, b in buffers.items()},
           "traced": seen is not None}
    if seen is None:
        return out
    # traffic: bytes inside each tensor, every access counted (a row loaded twice: twice)
    out.update(loads_outside={}, not_stored={}, traffic={}, loaded={k: [] for k in loads})
    for k, b in buffers.items():
        flags, element, loaded = b.inside.numpy(), b.element.numpy(), {}
        written, distinct = np.zeros_like(flags), np.zeros_like(flags)
        moved, outside = {"load_bytes": 0, "store_bytes": 0}, 0
        for program, op, addresses in seen:
            index = b.indices(addresses)
            moved[f"{op}_bytes"] += int(flags[index].sum()) * b.memory.element_size()
            if op != "load":
                written[index] = True
                continue
            distinct[index[flags[index]]] = True
            outside += int((~flags[index]).sum())
            flat = element[index]
            if k in loads and (flat >= 0).any():
                loaded.setdefault(program, set()).update(flat[flat >= 0].tolist())
        out["loads_outside"][k], out["not_stored"][k] = outside, int((flags & ~written).sum())
        out["traffic"][k] = {**moved, "load_elements": int(distinct.sum())}
        if k in loads:
            out["loaded"][k] = [[list(p), torch.tensor(sorted(s), dtype=torch.long)] for p, s in sorted(loaded.items())]
    return out


def build_args(spec, buffers):
    """Kernel arguments from the grader's description: ["buf", name, row], ["stride", name, dim],
    ["val", value] or ["dev", tensor]."""
    def arg(kind, what, index=None):
        if kind == "buf":
            return buffers[what].view if index is None else buffers[what].view[index]
        if kind == "stride":
            return buffers[what].view.stride(index)
        return what.to(device()) if kind == "dev" else what
    return [arg(*item) for item in spec]


def run_launch(obj, req, before=None):
    """One ``launch`` request on the kernel object ``obj``; the per-sentinel observations. ``before(args)``
    runs before each launch (the isolated process verifies the kernel there). With ``"undefined_other": True``
    the masked lanes of a load without ``other=`` read NaN, as on a GPU they may
    (:func:`attnlab._interp_hooks.nan_for_missing_other`)."""
    from attnlab._interp_hooks import nan_for_missing_other

    results = []
    with nan_for_missing_other() if req.get("undefined_other") else contextlib.nullcontext():
        for sentinel in req["sentinels"]:
            buffers = {k: Buffer(torch.full(tuple(b["shape"]), sentinel) if b.get("output") else b["data"], sentinel,
                                 b.get("pad_rows", 0), b.get("pad_cols", 0)) for k, b in req["buffers"].items()}
            args = build_args(req["args"], buffers)
            if before is not None:
                before(args)
            results.append(launch(obj, req["name"], req["grid"], args, req.get("kwargs", {}), buffers,
                                  loads=req.get("loads", []) if not results else ()))
    return results


_TL = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64", "int32": "i32",
       "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def _signature(fn, args, kwargs):
    """Triton's (signature, constexprs) of the function ``fn`` for one launch's arguments."""
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


def _outcome(fn):
    """{"ok": value}, {"refused": why} or {"raised": ..., "not_implemented": bool}."""
    try:
        return {"ok": fn()}
    except Refused as exc:
        return {"refused": str(exc)}
    except NotImplementedError:
        return {"raised": "NotImplementedError", "not_implemented": True}
    except BaseException as exc:  # the learner's bug (even SystemExit), reported, never fatal here
        return {"raised": describe_error(exc), "not_implemented": "NotImplementedError" in repr(exc)}


def backward(fn, args, kwargs, inputs, output, grad_output):
    """Call ``fn`` with the arguments at positions ``inputs`` requiring grad and backpropagate ``grad_output``
    from its output (``output``: an index into a returned tuple, or None for the whole output). Returns
    (the output, detached; [each input's .grad, None if it got none]). The learner's function, the spec and
    the mistakes all go through here, so the three are differentiated the same way."""
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


@contextlib.contextmanager
def _tapped(ns, tap):
    """While one case runs, ``tap["name"]`` of ``ns`` (a function the part requires, in the namespace the called
    function reads its globals from) adds ``tap["step"]`` times k to each floating-point tensor its k-th call returns
    (an int or integer tensor: int(step) times k; in a tuple too): what the graded function returns then shows the
    grader how many times it called that function and which output each call made. No tap, or a name that is not a
    function of the notebook: nothing changes."""
    name = tap.get("name") if isinstance(tap, dict) else None
    fn = ns.get(name) if isinstance(name, str) else None
    if not callable(fn) or type(tap.get("step")) is not float:
        yield
        return
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


def _with_grad(obj, args, kwargs, grad, grad_output):
    out, grads = backward(obj, args, kwargs, grad["inputs"], grad.get("output"), grad_output)
    return {"out": out, "grads": grads}


def handle(req, ns):
    """The answer to one request, given the notebook's namespace ``ns``. After a call request the C heap's free
    pages go back to the system (glibc's ``malloc_trim``): memory freed earlier stays resident in the heap, and the
    peak-memory checks (:mod:`.footprint`) would not see a later call reuse it (a copy of a whole KV cache went
    unseen that way in a long-lived process)."""
    try:
        return _handle(req, ns)
    finally:
        if req.get("op") == "call":
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None).malloc_trim(0)


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
        results, grad = [], req.get("grad")
        for case in req["cases"]:
            args, kwargs = case[0], case[1]
            with _tapped(getattr(obj, "__globals__", ns), req.get("tap")):   # where the function reads its names
                results.append(_outcome(lambda: obj(*args, **kwargs) if grad is None else
                                        _with_grad(obj, args, kwargs, grad, case[2])))
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
