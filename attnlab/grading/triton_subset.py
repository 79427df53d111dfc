"""The Triton subset ``attnlab grade`` accepts in a learner's kernel, read from its syntax before any Triton code sees
it (:func:`not_triton`), and the names a kernel's module-level constants may use.

Used by :mod:`attnlab.grading.sandbox.isolated` (the grader: a refused kernel is never sent to a process) and by
:mod:`attnlab.grading.sandbox.agent` (the inline ``check()``: the same reading, so the notebook says what the grader
decides). It imports nothing of the learner's and runs nothing.
"""

import ast

_DTYPES = ("float16", "float32", "float64", "bfloat16", "int1", "int8", "int16", "int32", "int64", "uint8", "uint16",
           "uint32", "uint64", "float8e4nv", "float8e5")
# the names a constant may use: Triton's dtypes and constexpr, math's constants and functions, and nothing bound by
# the notebook (a constant or kernel is never named math, tl, triton, float, int or bool)
_NAMES = {f"{m}.{n}" for m in ("tl", "triton.language") for n in ("constexpr", *_DTYPES)} | {
    f"math.{n}" for n in ("pi", "e", "tau", "inf", "nan")}
_CALLS = {"tl.constexpr", "triton.language.constexpr", "float", "int", "bool"} | {
    f"math.{n}" for n in ("log", "log2", "log10", "exp", "exp2", "sqrt", "ceil", "floor", "pow", "isqrt")}

# What a kernel's body may name, read by the grader before any Triton code sees the kernel (Triton's frontend
# evaluates a kernel's Python: it calls whatever callable it reaches, through a module attribute too, and folds the
# branches it can decide). Anything else is refused with the reason.
_TL = ("tl", "triton.language")
_TL_REFUSED = {"extra", "inline_asm_elementwise", "map_elementwise", "target_info", "math"}
_BUILTINS = {"range", "min", "max", "float", "int", "len", "print"}
_NOT_TRITON = (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef,
               ast.ClassDef, ast.With, ast.AsyncWith, ast.Try, ast.Await, ast.Yield, ast.YieldFrom, ast.ListComp,
               ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Delete, ast.Starred, ast.NamedExpr, ast.Match)


def _language_names():
    """{dotted name a kernel may use}: triton.language's public names (``tl.load``, ``tl.float32``) and
    ``tl.math``'s functions, under ``tl.`` and ``triton.language.``; math's constants and plain functions."""
    import triton.language as tl

    names = {n for n in tl.__all__ if n not in _TL_REFUSED}
    names |= {f"math.{n}" for n in dir(tl.math) if not n.startswith("_") and callable(getattr(tl.math, n))
              and getattr(getattr(tl.math, n), "__module__", "").startswith("triton.language")}
    return {f"{p}.{n}" for p in _TL for n in names} | set(_NAMES) | _CALLS - {"float", "int", "bool"}


def _dotted(node):
    """``a.b.c`` for a chain of names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def not_triton(fn, constants, kernels, language=None):
    """Why the body of the kernel ``fn`` (an ``ast.FunctionDef``) is not in the Triton subset the grader accepts, or
    None. Accepted: its parameters and local names, the module's constants, the other kernels, triton.language's
    public names (``tl.*``, ``tl.math.*``), math's constants and plain functions, ``range``/``min``/``max``/
    ``float``/``int``/``len``/``print``, and attributes of its own values that do not start with ``_``
    (``x.to(tl.float32)``, ``acc.T``). Refused: any other name (``getattr``, ``exec``, ``vars``...), a module's
    attribute outside that list (``tl.core.builtins``), dunders, imports, nested functions and lambdas,
    comprehensions, ``with``/``try``/``global``, the walrus and star arguments."""
    language = _language_names() if language is None else language
    a = fn.args
    own = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None}
    own |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    known = own | set(constants) | set(kernels)
    inner = {id(n.value) for n in ast.walk(fn) if isinstance(n, ast.Attribute)}   # tl.math of tl.math.exp2
    for node in ast.walk(ast.Module(body=fn.body, type_ignores=[])):
        where = f"line {getattr(node, 'lineno', 0) - fn.lineno + 1} of `{fn.name}`"
        if isinstance(node, _NOT_TRITON):
            return f"{where}: `{ast.unparse(node).splitlines()[0][:60]}` is not Triton code the grader accepts"
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            return f"{where}: `{ast.unparse(node)[:60]}` reaches a private attribute"
        if isinstance(node, ast.Attribute) and id(node) not in inner and _dotted(node) is not None:
            dotted = _dotted(node)
            root = dotted.split(".")[0]
            if root in known:
                continue
            if root in ("tl", "triton", "math") and not any(dotted == n or dotted.startswith(n + ".")
                                                            for n in language):
                return f"{where}: `{dotted}` is not one of triton.language's public names (tl.load, tl.float32, ...)"
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in known \
                and node.id not in _BUILTINS and node.id not in ("tl", "triton", "math"):
            return (f"{where}: `{node.id}` is none of the kernel's parameters, its own variables, the module's "
                    f"constants, the notebook's other kernels, triton.language or {', '.join(sorted(_BUILTINS))}")
        if isinstance(node, ast.Name) and node.id in ("tl", "triton", "math") and id(node) not in inner \
                and isinstance(node.ctx, ast.Load):
            return f"{where}: the module `{node.id}` itself is not a value a kernel uses"
    return None
