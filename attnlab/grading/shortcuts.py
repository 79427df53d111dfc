"""Find calls a part forbids in the learner's answer cells, from their syntax tree (in the grader).

The patterns are those of :func:`attnlab.grading.parts.forbidden`: ``torch.softmax``,
``torch.Tensor.softmax`` (any ``x.softmax(...)``), ``torch.nn.Softmax.forward`` (the module
``torch.nn.Softmax`` used at all), ``attnlab.attention.*`` (everything in that package), ``'"sdpa"'`` (that
string: the name of one of the library's attention backends). A name of ``torch`` or ``attnlab`` is also read
for what it is (:func:`_same`): a re-export or a library module's import of a forbidden object is that object.
Names are resolved through the notebook's imports (``import torch.nn.functional as F``,
``from attnlab.grading import specs``, ``from attnlab import scaled_dot_product_attention``)
and ``getattr(module, "name")`` with a literal name. Cells are read as IPython runs them (magics
transformed, the code of ``%time ...`` parsed too). Every part also forbids the ways around a list
of names (:data:`ESCAPES`: ``torch.ops.aten.*``, private bindings, ``torch._softmax`` for
``torch.softmax``, importlib, a string naming the references' files). The learner's code never runs here.

It is the one rule for forbidden calls: ``attnlab grade`` reads the cells of the notebook file, the inline
``check()`` the cells the learner ran (IPython's ``In``) or, for a plain namespace, each function's source
(:func:`in_namespace`); both take a part's cells the same way (:func:`part_cells`).

Example::

    uses(["import torch\\ndef f(x):\\n    return torch.softmax(x, -1)"], ["torch.softmax"])
    # [("torch.softmax", 3)]
"""

import ast
import functools
import importlib
import inspect
import symtable
import textwrap


def _exports():
    try:
        import attnlab

        return dict(getattr(attnlab, "_EXPORTS", {}))
    except Exception:  # pragma: no cover
        return {}


def _parse(source):
    """The syntax tree of a cell as IPython runs it: magics transformed the way IPython does, and the code a
    magic runs (``%time x = f()``, ``%%timeit`` cells) parsed as well and added (at its line); None when the
    cell is not Python."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        source = TransformerManager().transform_cell(source)
    except Exception:  # pragma: no cover - IPython is a dependency of the kernel; plain Python otherwise
        pass
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    extra = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("run_line_magic", "run_cell_magic") and len(node.args) >= 2:
            for arg in node.args[1:]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    inner = _magic_code(arg.value)
                    if inner is not None:
                        ast.increment_lineno(inner, node.lineno - 1)
                        extra.extend(inner.body)
    tree.text, tree.magic_from = source, len(tree.body)  # the code as IPython runs it; where the magics' code starts
    tree.body.extend(extra)
    return tree


def _magic_code(text):
    """The Python a magic's argument holds (options like ``-n 3`` skipped), or None."""
    words = text.split()
    for skip in range(0, min(len(words), 8) + 1):
        candidate = text.split(None, skip)[-1] if skip else text
        tree = _parse(candidate) if candidate.strip() else None
        if tree is not None:
            return tree
    return None


def aliases(sources):
    """{local name: dotted name} from the imports of every cell in ``sources``."""
    out = {}
    exports = _exports()
    for source in sources:
        tree = _parse(source)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        out[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        out[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    if a.name == "*":
                        continue
                    full = f"{node.module}.{a.name}"
                    if node.module == "attnlab" and a.name in exports:
                        full = f"{exports[a.name]}.{a.name}"
                    out[a.asname or a.name] = full
    return out


def _member(node):
    """(the object's expression, the name) for a member named by a literal string: ``getattr(x, "name")``,
    ``x.__dict__["name"]``, ``vars(x)["name"]``, ``x.__dict__.get("name")``, ``x.__getattribute__("name")``; or
    None."""
    def literal(n):
        return isinstance(n, ast.Constant) and isinstance(n.value, str)

    if isinstance(node, ast.Subscript) and literal(node.slice):
        v = node.value
        if isinstance(v, ast.Attribute) and v.attr == "__dict__":
            return v.value, node.slice.value
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "vars" and len(v.args) == 1:
            return v.args[0], node.slice.value
    if isinstance(node, ast.Call) and node.args:
        f = node.func
        if isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) >= 2 and literal(node.args[1]):
            return node.args[0], node.args[1].value
        if isinstance(f, ast.Attribute) and literal(node.args[0]) and (f.attr == "__getattribute__" or (
                f.attr == "get" and isinstance(f.value, ast.Attribute) and f.value.attr == "__dict__")):
            return (f.value if f.attr == "__getattribute__" else f.value.value), node.args[0].value
    return None


def _dotted(node, names):
    """The dotted name an expression refers to, resolved through ``names``, or None."""
    parts = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
            continue
        member = _member(node)
        if member is None:
            break
        node, name = member
        parts.append(name)
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    full = ".".join([names[node.id], *reversed(parts)])
    if full.startswith("attnlab.") and full.count(".") == 1:  # attnlab.X: its defining module
        exports = _exports()
        name = full.split(".", 1)[1]
        if name in exports:
            full = f"{exports[name]}.{name}"
    return full


def _matches(name, pattern):
    if pattern.endswith(".*"):
        return name == pattern[:-2] or name.startswith(pattern[:-1])
    if name == pattern or name.startswith(pattern + "."):
        return True
    # a class whose method is forbidden (torch.nn.Softmax.forward): using the class at all
    head, _, method = pattern.rpartition(".")
    return method == "forward" and name == head


_TRUSTED = ("torch", "attnlab")  # packages whose names this process resolves by importing them: never the learner's


@functools.lru_cache(maxsize=4096)
def _resolve(dotted):
    """(True, the object) a dotted name of ``torch`` or ``attnlab`` names, found by importing its longest module
    prefix here and reading the rest as attributes, or (False, None). Only the course's and PyTorch's own modules
    are imported: the learner's code never runs."""
    parts = dotted.split(".")
    if parts[0] not in _TRUSTED:
        return False, None
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except Exception:
            return False, None
        return True, obj
    return False, None


def _same(name, pattern):
    """What ``pattern`` forbids, when ``name`` is it under another name (else None): the same object (a re-export,
    ``torch.distributed.distributed_c10d.all_gather`` for ``torch.distributed.all_gather``, or reached through a
    library module that imported it, ``attnlab.models.gpt.F.scaled_dot_product_attention``), or for ``attnlab.x.*`` an
    object defined there (``attnlab.models.gpt.scaled_dot_product_attention`` is attnlab.attention's)."""
    found, obj = _resolve(name)
    if not found or obj is None or isinstance(obj, (bool, int, float, str)):
        return None
    if pattern.endswith(".*"):
        if not pattern.startswith("attnlab."):
            return None  # torch's builtins say torch._C of themselves: only attnlab's homes are read this way
        home = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
        return home if isinstance(home, str) and home != name and _matches(home, pattern) else None
    head, _, method = pattern.rpartition(".")
    for target in (pattern, head) if method == "forward" else (pattern,):
        known, forbidden = _resolve(target)
        if known and forbidden is obj and target != name:
            return target
    return None


def _hit(name, patterns):
    """The name to report when ``name`` is forbidden by one of ``patterns`` (itself, or ``name (which is X)``)."""
    for p in patterns:
        if _matches(name, p):
            return name
    for p in patterns:
        same = _same(name, p)
        if same:
            return f"{name} (which is {same})"
    return None


# ways around every list of forbidden names: PyTorch's operator registry and private bindings
ESCAPES = ["torch.ops.*", "torch._C.*", "torch._VF.*", "torch._ops.*", "torch._refs.*", "torch._decomp.*",
           "torch._prims.*", "importlib.*", "runpy.*", "builtins.exec", "builtins.eval", "builtins.__import__"]
BUILTINS = {"exec": "builtins.exec", "eval": "builtins.eval", "__import__": "builtins.__import__"}


def _escapes(patterns):
    """ESCAPES, and each forbidden ``torch.x`` under its private name ``torch._x`` too."""
    out = list(ESCAPES)
    for p in patterns:
        head, _, name = p.rpartition(".")
        if head in ("torch", "torch.nn.functional", "torch.special") and not name.startswith("_"):
            out.append(f"{head}._{name}")
    return out


def defined_names(sources):
    """The method and attribute names the learner's cells define (a ``def`` in a ``class``, ``self.x = ...``): what
    ``obj.x(...)`` may call. A module-level ``def softmax`` is not one (``x.softmax(dim)`` is still the Tensor's)."""
    out = set()
    for source in sources:
        tree = _parse(source)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                out |= {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
    return out


def _passed(tree):
    """The ids of the values a tree hands on: an argument of a call (not ``print``'s), a parameter's default, the
    value of an assignment. A string pattern (``'"sdpa"'``) is read there, not in a label (``("standard", run)``),
    a comparison or a dict key."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id == "print"):
            out += node.args + [k.value for k in node.keywords]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out += node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            out.append(node.value)
    return {id(n) for n in out}


def _bound(tree, names):
    """{name: dotted name} for what ``tree`` binds to a resolvable name by assignment, a parameter's default or the
    walrus (``_t = torch``, ``def f(x, sm=torch.softmax)``, ``(F := torch.nn.functional)``): ordinary Python that
    holds a forbidden object under another name. Followed to a fixed point, so ``a = torch; b = a.softmax`` works."""
    out = {}
    while True:
        grown = False
        known = {**names, **out}
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                pairs = [(t.id, node.value) for t in targets if isinstance(t, ast.Name)]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                positional = a.posonlyargs + a.args
                pairs = list(zip([x.arg for x in positional[len(positional) - len(a.defaults):]], a.defaults))
                pairs += [(x.arg, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for name, value in pairs:
                dotted = _dotted(value, known)
                if dotted is not None and out.get(name) != dotted and names.get(name) != dotted:
                    out[name], grown = dotted, True
        if not grown:
            return out


# reading a name the syntax cannot follow: refused outright in a part's code, whatever it reaches
DYNAMIC = {"vars": "vars()", "globals": "globals()", "locals": "locals()", "compile": "compile()",
           "__builtins__": "__builtins__", "breakpoint": "breakpoint()"}
DYNAMIC_DOTTED = ("sys.modules", "operator.attrgetter", "operator.methodcaller", "builtins.getattr",
                  "inspect.getmembers", "types.FunctionType", "types.CodeType")


def _dynamic(node, local, shadowed):
    """A description of ``node`` when it reaches an object by a name the syntax cannot read, else None: ``getattr``
    with a computed name, ``vars()``, ``globals()``, ``sys.modules``, ``x.__dict__``, ``operator.attrgetter``, ..."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
            and node.func.id not in shadowed and len(node.args) >= 2 and not (
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return f"{node.func.id}() with a computed name"
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in DYNAMIC and node.id not in shadowed:
        return DYNAMIC[node.id]
    if isinstance(node, ast.Attribute) and node.attr in ("__dict__", "__globals__", "__builtins__", "__code__",
                                                         "__closure__", "__subclasses__", "__getattribute__"):
        return f".{node.attr}"
    if isinstance(node, ast.Attribute):
        dotted = _dotted(node, local)
        if dotted is not None and any(dotted == d or dotted.startswith(d + ".") for d in DYNAMIC_DOTTED):
            return dotted
    return None


def uses(sources, patterns, all_sources=None):
    """[(forbidden name, line)] in ``sources`` (cells), with imports read from ``all_sources``.

    A method call ``obj.softmax(...)`` on an object the syntax cannot place counts as
    ``torch.Tensor.softmax`` only when the learner defined no ``softmax`` of their own (a method of
    their class, called as ``self.softmax(s)``)."""
    everything = all_sources if all_sources is not None else sources
    mine = defined_names(everything)
    own = {n.name for source in everything for n in ast.walk(_parse(source) or ast.Module(body=[], type_ignores=[]))
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    names = {k: v for k, v in {**BUILTINS, **aliases(everything)}.items() if k not in own}  # the learner's def wins
    methods = {p.rsplit(".", 1)[1] for p in patterns if p.startswith("torch.Tensor.")}
    patterns = list(patterns) + _escapes(patterns)
    found = []
    for source in sources:
        tree = _parse(source)
        if tree is None:
            continue
        local = dict(names)
        local.update(aliases([source]))
        local.update(_bound(tree, local))
        shadowed = own | {k for k in aliases(everything + [source])}   # the learner's own `vars`, an imported one
        passed = _passed(tree)
        for node in ast.walk(tree):
            dynamic = _dynamic(node, local, shadowed)
            if dynamic is not None:
                found.append((f"{dynamic} (a name the grader cannot read)", getattr(node, "lineno", 0)))
                continue
            name = None
            if isinstance(node, (ast.Attribute, ast.Name, ast.Call, ast.Subscript)):
                name = _dotted(node, local)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    hit = _hit(full, patterns) or next((full for p in patterns if a.name == "*" and p.startswith(
                        node.module + ".")), None)
                    if hit:
                        found.append((hit, node.lineno))
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    if any(p.endswith(".*") and _matches(a.name, p) for p in patterns):
                        found.append((a.name, node.lineno))
                continue
            if name is not None:
                hit = _hit(name, patterns)
                if hit:
                    found.append((hit, node.lineno))
                    continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and f'"{node.value}"' in patterns \
                    and id(node) in passed:
                found.append((f"{node.value!r} (the name of one of the library's backends)", node.lineno))
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
                    r in node.value.replace("\\", "/") for r in ("grading/exercises", "grading.exercises")):
                found.append(("attnlab.grading.exercises (named in a string)", node.lineno))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "clear_refs" in node.value:
                # without a cgroup the grader reads the kernel's peak memory (VmHWM) from outside; a
                # learner who resets it through /proc/self/clear_refs would hide an N x N matrix
                found.append(("/proc/self/clear_refs (named in a string)", node.lineno))
                continue
            if isinstance(node, ast.Attribute) and node.attr in methods and _dotted(node, local) is None and not (
                    node.attr in mine and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                # x.softmax(...) is the Tensor's; only self.softmax(...) in a class that defines one is the learner's
                found.append((f"torch.Tensor.{node.attr}", node.lineno))
    # one report per name and line (an attribute chain matches at several depths)
    seen, out = set(), []
    for name, line in found:
        key = (name.split(".")[0], line)
        if key not in seen:
            seen.add(key)
            out.append((name, line))
    return out


def names(source, kind):
    """The names ``source`` reads anywhere (kind ast.Name), reads from the notebook's namespace ("global": at its
    top level, or in a function, class or lambda, as a global; not a parameter or a local), or defines at its top
    level ("defined": not by a plain ``import module``, which a scratch cell and an answer share without feeding it
    anything)."""
    from attnlab.grading.layout import _defined

    tree = _parse(source)
    if tree is None:
        return set()
    if kind == "defined":
        return {n for node in tree.body if not isinstance(node, ast.Import) for n in _defined(node)}
    if kind == "global":
        try:
            top = symtable.symtable(ast.unparse(tree), "<cell>", "exec")
        except SyntaxError:  # parsed, not compiled (a `return` outside a function): every name it reads
            return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        found, tables = set(), [top]
        while tables:
            table = tables.pop()
            found |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and (table is top or s.is_global())}
            tables += table.get_children()
        return found
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _defining(source, wanted, objects=frozenset()):
    """``source`` with only its top-level statements that define one of ``wanted``, change one of them that is among
    ``objects`` (the learner's own lists, dicts and namespaces: ``ops.append(torch.softmax)``), or star-import (the
    others blank lines, so that a line number is still the cell's), or None when it has none. A ``print`` comparing
    with ``torch.softmax``, or ``x = torch.randn(4)`` for a function whose parameter is ``x``, is not kept."""
    from attnlab.grading.layout import _defined

    tree = _parse(source)
    kept = [(i, node) for i, node in enumerate(tree.body if tree else []) if not isinstance(node, ast.Import) and (
        _defined(node) & wanted or _changed(node) & wanted & objects or "*" in _defined(node))]
    if not kept:
        return None
    text, lines = tree.text.splitlines(), {}
    for i, node in kept:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        code = text[first - 1:node.end_lineno] if i < tree.magic_from else ast.unparse(node).splitlines()[:1]
        lines.update(enumerate(code, first))
    return "\n".join(lines.get(n, "") for n in range(1, max(lines) + 1)) + "\n"


def _changed(node):
    """The names a statement changes in place: ``d[k] = ...``, ``obj.x = ...``, ``ops.append(...)``, ``setattr(obj, ...)``."""
    from attnlab.grading.layout import _base

    out = {_base(n) for n in ast.walk(node) if isinstance(n, (ast.Attribute, ast.Subscript)) and isinstance(n.ctx, ast.Store)}
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        if isinstance(call.func, ast.Attribute):
            out.add(_base(call.func.value))  # a method of the object: ops.append(torch.softmax), d.update(f=...)
        elif isinstance(call.func, ast.Name) and call.func.id in ("setattr", "delattr") and call.args:
            out.add(_base(call.args[0]))
    return out - {None}


def part_code(learners, functions, mine=None):
    """[(code, own)]: what a part's answer is read from. From its own cells (``mine``; default: the learner cells that
    define one of its ``functions``; ``own`` True) and every other learner cell, the statements that define one of
    those functions or a name they read from the notebook's namespace, and so on (``_sm = torch.softmax`` above the
    answer, a helper of a helper, a relabelled answer cell). A scratch cell's comparison with ``torch.softmax``, or a
    cell that only shares a parameter's name (``x = torch.randn(4)``), is not read."""
    from attnlab.grading.layout import _defined

    own = [s for s in learners if names(s, "defined") & set(functions)] if mine is None else list(mine)
    pool = own + [s for s in learners if s not in own]
    objects = set()  # what the learner's cells bind other than by an import: their own objects
    for source in pool:
        tree = _parse(source)
        objects |= {n for node in (tree.body if tree else []) if not isinstance(node, (ast.Import, ast.ImportFrom))
                    for n in _defined(node)}
    reads, taken = set(functions), {}
    while True:
        grown = False
        for i, source in enumerate(pool):
            text = _defining(source, reads, objects)
            if text is not None and text != taken.get(i):
                taken[i], grown = text, True
        if not grown:
            return [(taken[i], i < len(own)) for i in sorted(taken)]
        reads |= {n for text in taken.values() for n in names(text, "global")}


def part_cells(learners, functions, mine=None):
    """The code of :func:`part_code`, without saying whose cell it came from."""
    return [code for code, _own in part_code(learners, functions, mine)]


class _DeadCode(ast.NodeTransformer):
    """Drops what can never run whatever the inputs: the branch of an ``if``/``while``/``x if c else y`` whose
    test is a constant (``if False:``, ``while 0:``, ``if TYPE_CHECKING:``), the right side of ``False and ...`` /
    ``True or ...``, and the statements after a ``return``, ``raise``, ``break`` or ``continue`` in one block."""

    @staticmethod
    def _known(test):
        if isinstance(test, ast.Constant):
            return bool(test.value)
        if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
            return False
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = _DeadCode._known(test.operand)
            return None if inner is None else not inner
        return None

    def generic_visit(self, node):
        node = super().generic_visit(node)   # children first: a dead branch is gone before its block is cut
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list) or not all(isinstance(x, ast.stmt) for x in stmts):
                continue
            end = next((i + 1 for i, x in enumerate(stmts)
                        if isinstance(x, (ast.Return, ast.Raise, ast.Break, ast.Continue))), len(stmts))
            stmts = stmts[:end]
            if not stmts and field == "body" and not isinstance(node, ast.Module):
                stmts = [ast.Pass()]   # a block left empty is still a block: the cell must parse again
            setattr(node, field, stmts)
        return node

    def visit_If(self, node):
        known = self._known(node.test)
        return self.generic_visit(node) if known is None else self._branch(node.body if known else node.orelse)

    def visit_While(self, node):
        return self._branch(node.orelse) if self._known(node.test) is False else self.generic_visit(node)

    def _branch(self, stmts):
        """The statements of the one branch that runs, in place of the statement that chose it."""
        return self.generic_visit(ast.Module(body=stmts, type_ignores=[])).body

    def visit_IfExp(self, node):
        known = self._known(node.test)
        return self.generic_visit(node) if known is None else self.visit(node.body if known else node.orelse)

    def visit_BoolOp(self, node):
        values = []
        for value in node.values:   # `False and f()`: f never runs; `True or f()`: neither
            values.append(value)
            known = self._known(value)
            if known is not None and known == isinstance(node.op, ast.Or):
                break
        node.values = values if len(values) > 1 else values + [ast.Constant(value=None)]
        return self.generic_visit(node)


def live_code(source):
    """``source`` without the code that can never run (:class:`_DeadCode`): a required call inside ``if False:``
    is not a call. The source unchanged when it is not Python."""
    tree = _parse(source)
    if tree is None:
        return source
    tree = _DeadCode().visit(tree)
    return ast.unparse(ast.fix_missing_locations(tree))


def missing(sources, required, all_sources=None, rebound=()):
    """The keys of ``required`` ({name: why}; a key "a|b" is either name) that none of ``sources`` (a part's code,
    :func:`part_code`) reads. A dotted name (``attnlab.memory.trace``) is read under any name: an import's alias,
    the module's attribute, but not a function of the learner's own of that name. A plain one is read as itself,
    unless ``rebound`` holds it (:func:`rebound`: ``kernel_attention = my_sdpa`` is not the given one)."""
    sources = [live_code(text) for text in sources]
    everything = list(all_sources if all_sources is not None else sources) + list(sources)
    read = set().union(*(names(text, "global") for text in sources)) if sources else set()
    wanted = [name for key in required for name in key.split("|")]
    dotted = set()
    if any("." in name for name in wanted):
        own = {n.name for source in everything for n in ast.walk(_parse(source) or ast.Module(body=[], type_ignores=[]))
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))} | set(rebound)
        local = {k: v for k, v in aliases(everything).items() if k not in own}
        for text in sources:
            tree = _parse(text)
            for node in ast.walk(tree) if tree is not None else ():
                if isinstance(node, (ast.Attribute, ast.Name)):
                    name = _dotted(node, local)
                    if name is not None:
                        dotted.add(name)

    def found(name):
        if "." in name:
            return any(_matches(d, name) or _same(d, name) for d in dotted)
        return name in read and name not in rebound
    return [key for key in required if not any(found(name) for name in key.split("|"))]


def rebound(learners, given):
    """The names the course's ``given`` cells define that a cell of ``learners`` binds otherwise: a top-level
    statement defining one of them that is none of the given statements (``kernel_attention = my_sdpa``; an edited
    given cell that keeps the definition does not count)."""
    from attnlab.grading.layout import _defined

    theirs = {}
    for source in given:
        tree = _parse(source)
        for node in tree.body if tree is not None else ():
            for name in _defined(node):
                theirs.setdefault(name, set()).add(ast.dump(node))
    out = set()
    for source in learners:
        tree = _parse(source)
        for node in tree.body if tree is not None else ():
            out |= {name for name in _defined(node) & theirs.keys() if ast.dump(node) not in theirs[name]}
    return out


def _current_cells(history, given):
    """The learner's code as the notebook's namespace holds it now, from IPython's ``In``: the cells it ran, less the
    ``given`` ones (``attnlab grade`` reads only the learner's, with the given cells as context), each cut to the
    top-level statements that bind a name no later cell binds again. A ``decode_bytes`` rewritten in a new cell is
    read from that cell alone, and an import the old cell also made stays (lines keep their numbers: what is cut
    becomes blank lines)."""
    from attnlab.grading.layout import _defined

    given = {g.strip() for g in given}
    cells, covered = [], set()
    for source in reversed([s for s in history if isinstance(s, str) and s.strip() and s.strip() not in given]):
        tree = _parse(source)
        if tree is None:
            continue
        lines, kept, binds = tree.text.splitlines(), [], set()   # the cell as IPython runs it (magics transformed)
        for node in tree.body[:tree.magic_from]:
            bound = _defined(node)
            if bound and not bound - covered:
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
                for i in range(first - 1, node.end_lineno):
                    lines[i] = ""
            else:
                kept.append(node)
                binds |= bound
        if kept:
            cells.insert(0, "\n".join(lines))
        covered |= binds
    return cells


def _history_cells(ns, functions, given):
    """:func:`_current_cells` of the notebook's ``In`` when a cell there defines one of ``functions``; else None, and
    the function's own code is read instead (a plain namespace, or cells run without history: nbval and other
    runners execute with ``store_history=False``, and ``In`` then holds none of them)."""
    history = ns.get("In")
    if not isinstance(history, list):
        return None
    cells = _current_cells(history, given)
    return cells if any(names(c, "defined") & set(functions) for c in cells) else None


def missing_in_namespace(ns, functions, required, given=()):
    """:func:`missing` for the inline ``check()``: in a notebook on the cells IPython ran (as :func:`in_namespace`
    takes them), in a plain namespace on what the part's functions, and the functions of that namespace they
    reach, read (their code objects: a global that is the required object counts, under any name)."""
    if not required:
        return []
    cells = _history_cells(ns, functions, given)
    if cells is not None:
        return missing(part_cells(cells, functions), required, cells + list(given), rebound(cells, given))
    read, objects, todo, seen = set(), [], [ns.get(name) for name in functions], set()
    while todo:
        fn = todo.pop()
        fn = getattr(fn, "__func__", fn)
        if not inspect.isfunction(fn) or id(fn) in seen:
            continue
        seen.add(id(fn))
        codes, used = [fn.__code__], set()
        while codes:
            c = codes.pop()
            used.update(c.co_names)
            codes.extend(k for k in c.co_consts if inspect.iscode(k))
        read |= used
        objects += [fn.__globals__[n] for n in used if n in fn.__globals__]
        todo += [ns[n] for n in used if fn.__globals__ is ns and n in ns]

    def found(name):
        if "." not in name:
            return name in read
        known, obj = _resolve(name)
        return name.rsplit(".", 1)[1] in read or (known and any(o is obj for o in objects))
    return [key for key in required if not any(found(name) for name in key.split("|"))]


def in_namespace(ns, functions, patterns, given=()):
    """[(forbidden name, line)] for the inline ``check()``: the same syntax rule as ``attnlab grade``'s, on what this
    process can read of the learner's code (advice: nothing here is a score).

    In a notebook the cells are those IPython ran (``In``), less the ``given`` ones (the exercise's own cells, as
    ``attnlab grade`` reads only the learner's); in a plain namespace, the source of each of the part's
    functions and of every function they reach (by a global name of their module or a closure), with the imports of
    the file it was written in; a name they reach that *is* a forbidden function is named too."""
    cells = _history_cells(ns, functions, given)
    if cells is not None:
        return uses(part_cells(cells, functions), patterns, cells + list(given))
    everything = list(patterns) + _escapes(patterns)
    found, sources, code, seen = [], [], [], set()
    todo = [ns.get(name) for name in functions]
    while todo:
        value = todo.pop()
        qualified = f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', None)}"
        if callable(value) and any(_matches(qualified, p) for p in everything):
            found.append((qualified, 0))  # bound from a forbidden module: ``context_vector = F.softmax``
            continue
        fn = getattr(value, "fn", value)  # a @triton.jit kernel's Python function
        if not (inspect.isfunction(fn) or inspect.isclass(fn)) or id(fn) in seen or not _learners(fn):
            continue  # the library's own code is not the answer's: only what it is (above) counts
        seen.add(id(fn))
        try:
            sources.append(_source(fn))
            code.append(inspect.getsource(inspect.getmodule(fn)))
        except (OSError, TypeError):
            continue
        functions_of = [fn] if inspect.isfunction(fn) else [f for f in vars(fn).values() if inspect.isfunction(
            getattr(f, "__func__", f))]
        for f in functions_of:
            f = getattr(f, "__func__", f)
            codes, used = [f.__code__], set()
            while codes:
                c = codes.pop()
                used.update(c.co_names)
                codes.extend(k for k in c.co_consts if inspect.iscode(k))
            todo += [f.__globals__[n] for n in used if n in f.__globals__ and callable(f.__globals__[n])]
            todo += [cell.cell_contents for cell in f.__closure__ or () if _filled(cell)]
    return found + uses(sources, patterns, code + sources)


def _source(fn):
    """The source of a function or class; of a lambda, the lambda alone (its line may hold more than parses)."""
    text = textwrap.dedent(inspect.getsource(fn))
    if getattr(fn, "__name__", "") != "<lambda>" or "lambda" not in text:
        return text
    text = text[text.index("lambda"):]
    for end in range(len(text), 0, -1):  # in brackets, as it stood: its lines may break anywhere
        if _parse(f"({text[:end]})") is not None:
            return f"({text[:end]})"
    return text


def _learners(obj):
    """Whether ``obj`` was written by the learner (a notebook cell, a file outside Python, its packages, attnlab)."""
    from attnlab.grading.feedback import _is_learners

    try:
        return _is_learners(inspect.getsourcefile(obj))
    except TypeError:
        return False
    except OSError:   # a class defined in a notebook cell has no file: the learner's (its source may be unreadable)
        return getattr(obj, "__module__", None) == "__main__"


def _filled(cell):
    try:
        return callable(cell.cell_contents)
    except ValueError:  # an empty closure cell
        return False
