"""The learner's Triton kernels, taken from the notebook as text and launched where the learner cannot reach.

``attnlab grade`` never asks the learner's process to launch a Triton part's kernel: whatever
that process says about a launch (traced or not, in bounds or not) could be forged by a learner cell.
Instead (:class:`IsolatedKernels`):

1. the grader reads every ``@triton.jit`` function of the notebook's code cells, as *text*, with the
   module-level constants they may name (:func:`kernel_module`); nothing else of the notebook's code;
2. a fresh process (:func:`main`, in the same sandbox as the kernel: :mod:`attnlab.grading.sandbox`)
   defines only those functions, and before the first launch of a kernel with a given signature
   checks with Triton's own frontend that it is Triton code: it is lowered to TTIR (which needs no
   GPU; an ``import``, a call of a Python function or any other construct Triton does not compile is
   refused), then launches and traces it (:func:`attnlab.grading.agent.launch`: sentinel-filled
   buffers, every load and store recorded in Triton's interpreter; natively on a GPU);
3. requests and replies cross as ``torch.save`` bytes, read back with ``torch.load(weights_only=True)``
   (tensors, numbers, strings, lists, tuples, dicts: nothing that runs code).

Example (in the grader)::

    kernels = IsolatedKernels(code_cells, root, limits)
    reply = kernels.launch({"name": "scale_kernel", "grid": [4], ...})   # what run_guarded sends
"""

import ast
import os
from pathlib import Path

from attnlab.grading.runner import Dead, Sandboxed, _receive, _send, frames

_JIT = {"triton.jit", "jit", "triton.autotune", "triton.heuristics"}
_FILENAME = "<the notebook's @triton.jit functions>"


def _decorator_name(node):
    """``triton.jit`` for ``@triton.jit`` and ``@triton.jit(...)``: the dotted name, as written."""
    return ast.unparse(node.func if isinstance(node, ast.Call) else node)


def _is_constant(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _is_constant(node.operand)
    if isinstance(node, ast.Call) and _decorator_name(node) in ("tl.constexpr", "triton.language.constexpr"):
        return len(node.args) == 1 and not node.keywords and _is_constant(node.args[0])
    return False


def kernel_module(sources):
    """(module text, {kernel names}, {every name the cells define}) from the notebook's code cells
    (a kernel whose body still raises NotImplementedError is also named "<name> (not implemented)").

    The text holds the ``@triton.jit`` functions (the last definition of each name wins, as when the
    notebook runs top to bottom) and the module-level assignments of plain numbers; nothing else."""
    from attnlab.grading.shortcuts import _parse

    kernels, constants, defined, todo = {}, {}, set(), set()
    for source in sources:
        tree = _parse(source)
        if tree is None:
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if isinstance(node, ast.FunctionDef) and any(_decorator_name(d) in _JIT for d in node.decorator_list):
                node.decorator_list = [ast.parse("triton.jit", mode="eval").body]  # only Triton's own jit
                kernels[node.name] = ast.unparse(node)
                if any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n) for n in ast.walk(node)):
                    todo.add(node.name)
                else:
                    todo.discard(node.name)
                constants.pop(node.name, None)
            elif isinstance(node, ast.FunctionDef) or isinstance(node, ast.ClassDef):
                kernels.pop(node.name, None)  # redefined as something else: no longer a kernel
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                kernels.pop(name, None)
                if _is_constant(node.value):
                    constants[name] = ast.unparse(node)
                else:
                    constants.pop(name, None)
    text = "\n\n".join(["import math", "import triton", "import triton.language as tl", *constants.values(),
                        *kernels.values()]) + "\n"
    return text, set(kernels), defined | {f"{n} (not implemented)" for n in todo & set(kernels)}


# ---------------------------------------------------------------------------------------
# the fresh process
# ---------------------------------------------------------------------------------------

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
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction

    sig, constexprs = _signature(fn, args, kwargs)
    target = GPUTarget("cuda", 80, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(JITFunction(fn), sig, constexprs)
    source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)


def main(in_fd, out_fd):
    """The fresh process: the module text first, then launch requests."""
    import linecache

    from attnlab.grading import agent

    frames_in, frames_out = frames(in_fd, out_fd)
    first = _receive(frames_in)
    text, names = first["module"], set(first["names"])
    os.environ.pop("TRITON_INTERPRET", None)  # a real JITFunction: the agent builds the interpreted one itself
    linecache.cache[_FILENAME] = (len(text), None, text.splitlines(True), _FILENAME)
    space = {"__name__": "attnlab_answer_kernels"}
    exec(compile(text, _FILENAME, "exec"), space)
    _send(frames_out, {"loaded": True})
    verified = set()
    while True:
        try:
            req = _receive(frames_in)
        except EOFError:
            return
        _send(frames_out, _launch(req, space, names, verified, agent))


def _launch(req, space, names, verified, agent):
    name = req["name"]
    if name not in names or name not in space:
        return {"missing": True}
    obj = space[name]

    def verified_first(args):
        key = (name, repr([(type(a).__name__, getattr(a, "dtype", None)) for a in args]),
               repr(sorted(req.get("kwargs", {}).items())))
        if key not in verified:
            try:
                verify(obj.fn, args, req.get("kwargs", {}))
            except Exception as exc:
                raise agent.Refused(f"`{name}` is not Triton code that Triton's compiler accepts: "
                                    f"{agent.describe_error(exc)}") from None
            verified.add(key)

    return {"result": agent._outcome(lambda: agent.run_launch(obj, req, verified_first))}


# ---------------------------------------------------------------------------------------
# the grader's side
# ---------------------------------------------------------------------------------------


class IsolatedKernels(Sandboxed):
    """The notebook's kernels in a fresh sandboxed process (:func:`main`), started at the first launch; after
    it died or hung, its launches fail with the reason."""

    ENTRY = ("attnlab.grading.isolated", "main")

    def __init__(self, sources, root, limits, timeout=120):
        super().__init__(Path(root) / "kernels", limits, timeout)
        self.text, self.names, self.defined = kernel_module(sources)
        self.broken = None

    def _started(self):
        self._exchange({"module": self.text, "names": sorted(self.names)}, self._budget(), "did not start")

    def launch(self, request):
        name = request["name"]
        if f"{name} (not implemented)" in self.defined:  # the exercise's skeleton, untouched
            return {"result": {"raised": "NotImplementedError", "not_implemented": True}}
        if name not in self.names:
            if name in self.defined:
                return {"result": {"refused": (
                    f"`{name}` must be a Triton kernel: a function decorated with @triton.jit in your answer cell. "
                    f"The grader launches it through Triton itself, so an object that only looks like a kernel "
                    f"(kernel[grid](...) computing the result in PyTorch) gets no points")}}
            return {"missing": True}
        if self.broken is None:
            try:
                return self.ask(request, "stopped the process that launches it")
            except Dead as exc:
                self.broken = str(exc)
        return {"agent_error": self.broken}
