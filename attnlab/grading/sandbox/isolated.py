"""The learner's Triton kernels, taken from the notebook as text (:func:`kernel_module`: the ``@triton.jit`` functions
and module-level constants, nothing else; one outside the Triton subset refused) and launched in a fresh sandboxed
process (:class:`IsolatedKernels`, :func:`main`), never by the learner's process, whose word on a launch a cell could
forge. There Triton's frontend lowers each kernel to TTIR before its first launch of a signature."""

import ast
import os
from pathlib import Path

from attnlab.grading.sandbox.frames import _receive, _send, frames, requests
from attnlab.grading.sandbox.runner import Dead, Sandboxed
from attnlab.grading.triton_subset import _CALLS, _NAMES, _language_names, not_triton

_JIT = {"triton.jit", "jit", "triton.autotune", "triton.heuristics"}
_FILENAME = "<the notebook's @triton.jit functions>"


_RESERVED = {"math", "tl", "triton", "float", "int", "bool"}
_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)


def _constant(node, known):
    """``node`` with the constants it names (``known``: name -> expression) put in their place, when it is a
    constant expression: numbers, strings, True/False/None, arithmetic of them, Triton's dtypes and constexpr,
    math's constants, and ``tl.constexpr(...)``, ``float(...)``, ``int(...)``, ``math.log(...)`` (and math's other
    plain functions) of them; None otherwise. Evaluating one runs no code of the notebook's."""
    if isinstance(node, ast.Constant):
        return node if node.value is None or isinstance(node.value, (bool, int, float, str)) else None
    if isinstance(node, ast.Name):
        return known.get(node.id)
    if isinstance(node, ast.Attribute):
        return node if ast.unparse(node) in _NAMES else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _constant(node.operand, known)
        return operand and ast.UnaryOp(node.op, operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _OPS):
        left, right = _constant(node.left, known), _constant(node.right, known)
        return left and right and ast.BinOp(left, node.op, right)
    if isinstance(node, ast.Call) and not node.keywords and ast.unparse(node.func) in _CALLS:
        args = [_constant(a, known) for a in node.args]
        return None if None in args else ast.Call(node.func, args, [])
    return None


def _when_defined(fn, known):
    """Put the constants in ``fn``'s default values and annotations (Python evaluates them when the ``def`` runs,
    before Triton sees the function); the first that is not a constant expression, as text, or None."""
    a = fn.args
    for values in (a.defaults, a.kw_defaults):
        for i, d in enumerate(values):
            if d is not None:
                values[i] = _constant(d, known)
                if values[i] is None:
                    return ast.unparse(d)
    for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
        if x is not None and x.annotation is not None:
            value = _constant(x.annotation, known)
            if value is None:
                return ast.unparse(x.annotation)
            x.annotation = value
    if fn.returns is not None and _constant(fn.returns, known) is None:
        return ast.unparse(fn.returns)
    return None


def kernel_module(sources):
    """(module text, {kernel names}, {every name the cells define}, {kernel name: why it is refused}) from the
    notebook's code cells (a kernel whose body still raises NotImplementedError is also named
    "<name> (not implemented)").

    The text holds the ``@triton.jit`` functions (the last definition of each name wins, as when the
    notebook runs top to bottom) and the module-level constants (:func:`_constant`); nothing else. A kernel
    whose default values or annotations are code (``_cfg=exec(...)`` would run when the ``def`` does) is
    refused, not sent."""
    from attnlab.grading.layout import _defined as defined_here
    from attnlab.grading.shortcuts import _parse

    kernels, nodes, constants, defined, todo, refused = {}, {}, {}, set(), set(), {}

    def forget(name):  # redefined: no longer a kernel or a constant
        for table in (kernels, refused, constants):
            table.pop(name, None)

    for source in sources:
        tree = _parse(source)
        if tree is None:
            continue
        for node in tree.body:
            defined |= defined_here(node)
            if isinstance(node, ast.FunctionDef) and node.name not in _RESERVED and any(  # @triton.jit(...) too
                    ast.unparse(getattr(d, "func", d)) in _JIT for d in node.decorator_list):
                node.decorator_list = [ast.parse("triton.jit", mode="eval").body]  # only Triton's own jit
                constants.pop(node.name, None)
                code = _when_defined(node, constants)
                if code is not None:
                    kernels.pop(node.name, None)
                    refused[node.name] = (f"`{node.name}`: `{code}` is code that Python runs when the `def` runs, "
                                          f"before Triton sees the kernel; a kernel's default values and "
                                          f"annotations may only be constants: numbers, True/False/None, strings, "
                                          f"Triton's own names (tl.constexpr) and module-level constants")
                    continue
                refused.pop(node.name, None)
                kernels[node.name] = ast.unparse(node)
                nodes[node.name] = node
                todo.discard(node.name)
                if any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n) for n in ast.walk(node)):
                    todo.add(node.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                forget(node.name)
            else:
                for name in defined_here(node):  # a module-level name: a constant, or no longer one
                    forget(name)
                target = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and len(target) == 1 and \
                        isinstance(target[0], ast.Name) and target[0].id not in _RESERVED and node.value is not None:
                    value = _constant(node.value, constants)
                    if value is not None and len(ast.unparse(value)) < 4000:
                        constants[target[0].id] = value
    language = _language_names()
    for name in [n for n in kernels if n not in todo]:   # the exercise's skeleton is said to be not implemented
        why = not_triton(nodes[name], constants, kernels, language)
        if why is not None:
            del kernels[name]
            refused[name] = f"`{name}` is not Triton code the grader accepts: {why}"
    text = "\n\n".join(["import math", "import triton", "import triton.language as tl",
                        *(f"{name} = {ast.unparse(value)}" for name, value in constants.items()),
                        *kernels.values()]) + "\n"
    return text, set(kernels), defined | {f"{n} (not implemented)" for n in todo & set(kernels)}, refused


def main(in_fd, out_fd):
    """The fresh process: the module text first, then launch requests."""
    import linecache

    from attnlab.grading.sandbox import agent

    frames_in, frames_out = frames(in_fd, out_fd)
    first = _receive(frames_in)
    text, names = first["module"], set(first["names"])
    os.environ.pop("TRITON_INTERPRET", None)  # a real JITFunction: the agent builds the interpreted one itself
    linecache.cache[_FILENAME] = (len(text), None, text.splitlines(True), _FILENAME)
    space = {"__name__": "attnlab_answer_kernels"}
    exec(compile(text, _FILENAME, "exec"), space)
    _send(frames_out, {"loaded": True})
    verified = set()
    for req in requests(frames_in):
        name = req["name"]
        obj = space.get(name) if name in names else None
        _send(frames_out, {"missing": True} if obj is None else {"result": agent._outcome(
            lambda: agent.run_launch(obj, req, agent.verifier(name, obj, req, verified)))})


class IsolatedKernels(Sandboxed):
    """The notebook's kernels in a fresh sandboxed process (:func:`main`), started at the first launch; after
    it died or hung, its launches fail with the reason."""

    ENTRY = ("attnlab.grading.sandbox.isolated", "main")

    def __init__(self, sources, root, limits, timeout=120):
        super().__init__(Path(root) / "kernels", limits, timeout)
        self.text, self.names, self.defined, self.refused = kernel_module(sources)
        self.broken = None

    def _first(self):
        return [({"module": self.text, "names": sorted(self.names)}, "did not start")]

    def launch(self, request):
        name = request["name"]
        if name in self.refused:
            return {"result": {"refused": self.refused[name]}}
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
