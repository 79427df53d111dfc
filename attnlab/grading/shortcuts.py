"""The syntax rule: the calls a part forbids, and those it requires, in the learner's cells (docs/grading.md).

Patterns are :func:`attnlab.grading.parts.forbidden`'s: ``torch.softmax``, ``torch.Tensor.softmax`` (any
``x.softmax(...)``), ``torch.nn.Softmax.forward`` (the class used at all), ``attnlab.attention.*``, ``'"sdpa"'`` (that
string handed on). Names are followed through imports, assignments, defaults, the walrus and literal ``getattr``; a
name of ``torch`` or ``attnlab`` is read for what it is (:func:`_same`); a name the syntax cannot follow is refused
(:func:`_dynamic`), and so are the ways around any list (:data:`ESCAPES`). Code that can never run is not read
(:func:`live_code`). ``attnlab grade`` reads the notebook's cells, the inline ``check()`` the cells IPython ran or each
function's source (:func:`in_namespace`); the learner's code never runs here.

Example: ``uses(["import torch\\ndef f(x):\\n    return torch.softmax(x, -1)"], ["torch.softmax"])`` is
``[("torch.softmax", 3)]``.
"""

import ast
import functools
import importlib
import inspect
import symtable
import textwrap

from attnlab.grading.feedback import _is_learners

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _parse(source):
    """The syntax tree of a cell as IPython runs it (magics transformed; ``tree.text``), with the code a magic runs
    (``%time x = f()``) added at its line after ``tree.body[:tree.magic_from]``; None when it is not Python."""
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
                node.func.attr in ("run_line_magic", "run_cell_magic"):
            for arg in node.args[1:]:
                inner = _magic_code(arg.value) if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
                if inner is not None:
                    ast.increment_lineno(inner, node.lineno - 1)
                    extra.extend(inner.body)
    tree.text, tree.magic_from = source, len(tree.body)
    tree.body.extend(extra)
    return tree


def _magic_code(text):
    """The Python a magic's argument holds (options like ``-n 3`` skipped), or None."""
    for skip in range(0, min(len(text.split()), 8) + 1):
        candidate = text.split(None, skip)[-1] if skip else text
        tree = _parse(candidate) if candidate.strip() else None
        if tree is not None:
            return tree
    return None


def _trees(sources):  # those that are Python
    return [tree for tree in map(_parse, sources) if tree is not None]


def _defined(node):
    """The names a statement binds in the namespace it runs in, a ``def`` inside ``if``/``try``/``with`` included."""
    if isinstance(node, _DEFINITIONS):  # and what it declares global
        return {node.name} | {n for g in ast.walk(node) if isinstance(g, ast.Global) for n in g.names}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, ast.Name):
        return {node.id} if isinstance(node.ctx, ast.Store) else set()
    bound = {getattr(node, "name", None) or getattr(node, "rest", None)} - {None} \
        if isinstance(node, (ast.MatchAs, ast.MatchStar, ast.MatchMapping, ast.ExceptHandler)) else set()  # case x:
    return bound.union(*(_defined(child) for child in ast.iter_child_nodes(node)))


def _base(node):
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _changed(node, calls=True):
    """What a statement fills in place (``runs[name] = ...``, ``obj.x = ...``) and, with ``calls``, what it changes by
    a method or ``setattr`` (``ops.append(torch.softmax)``)."""
    out = {_base(n) for n in ast.walk(node) if isinstance(n, (ast.Subscript, ast.Attribute))
           and isinstance(n.ctx, ast.Store)}
    for call in (n for n in ast.walk(node) if calls and isinstance(n, ast.Call)):
        if isinstance(call.func, ast.Attribute):
            out.add(_base(call.func.value))
        elif isinstance(call.func, ast.Name) and call.func.id in ("setattr", "delattr") and call.args:
            out.add(_base(call.args[0]))
    return out - {None}


def _home(full):
    """``attnlab.X`` named by its defining module (the package re-exports X); any other name as it is."""
    head, _, name = full.partition(".")
    exports = getattr(importlib.import_module("attnlab"), "_EXPORTS", {})
    return f"{exports[name]}.{name}" if head == "attnlab" and name in exports else full


def _bindings(trees):
    """({local name: dotted name} the cells' ``trees`` import, the functions and classes they define, the names
    ``obj.x(...)`` may call of theirs: a ``def`` in a ``class``, ``self.x = ...``; not a module-level ``def``)."""
    imports, defined, members = {}, set(), set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, _DEFINITIONS):
                defined.add(node.name)
            if isinstance(node, ast.ClassDef):
                members |= {n.name for n in node.body if isinstance(n, _FUNCTIONS)}
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                members.add(node.attr)
            elif isinstance(node, ast.Import):
                imports.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                                for a in node.names})
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imports.update({a.asname or a.name: _home(f"{node.module}.{a.name}") for a in node.names
                                if a.name != "*"})
    return imports, defined, members


def _literal(node):
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _member(node):
    """(object, name) for a member named by a literal string (``getattr(x, "name")``, ``x.__dict__["name"]``,
    ``vars(x)["name"]``, ``x.__dict__.get("name")``, ``x.__getattribute__("name")``), or None."""
    if isinstance(node, ast.Subscript) and _literal(node.slice):
        v = node.value
        if isinstance(v, ast.Attribute) and v.attr == "__dict__":
            return v.value, node.slice.value
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "vars" and len(v.args) == 1:
            return v.args[0], node.slice.value
    if isinstance(node, ast.Call) and node.args:
        f = node.func
        if isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) >= 2 and _literal(node.args[1]):
            return node.args[0], node.args[1].value
        if isinstance(f, ast.Attribute) and _literal(node.args[0]) and (f.attr == "__getattribute__" or (
                f.attr == "get" and isinstance(f.value, ast.Attribute) and f.value.attr == "__dict__")):
            return (f.value if f.attr == "__getattribute__" else f.value.value), node.args[0].value
    return None


def _dotted(node, names):
    """The dotted name an expression refers to, resolved through ``names``, or None."""
    parts = []
    while isinstance(node, ast.Attribute) or (member := _member(node)):
        node, name = (node.value, node.attr) if isinstance(node, ast.Attribute) else member
        parts.append(name)
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    return _home(".".join([names[node.id], *reversed(parts)]))


def _matches(name, pattern):
    if pattern.endswith(".*"):
        return name == pattern[:-2] or name.startswith(pattern[:-1])
    head, _, method = pattern.rpartition(".")  # a class whose method is forbidden (torch.nn.Softmax.forward): at all
    return name == pattern or name.startswith(pattern + ".") or method == "forward" and name == head


@functools.lru_cache(maxsize=4096)
def _resolve(dotted):
    """(True, the object) a dotted name of ``torch`` or ``attnlab`` names, by importing its longest module prefix
    (only theirs: never the learner's code), or (False, None)."""
    parts = dotted.split(".")
    if parts[0] not in ("torch", "attnlab"):
        return False, None
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        try:
            return True, functools.reduce(getattr, parts[cut:], obj)
        except Exception:
            return False, None
    return False, None


def _same(name, pattern):
    """What ``pattern`` forbids when ``name`` is it under another name, else None: the same object (a re-export,
    ``attnlab.models.gpt.F.scaled_dot_product_attention``), or for ``attnlab.x.*`` an object defined there."""
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
    if any(_matches(name, p) for p in patterns):
        return name
    same = next((same for same in (_same(name, p) for p in patterns) if same), None)
    return same and f"{name} (which is {same})"


# ways around every list of forbidden names: PyTorch's operator registry and private bindings
ESCAPES = ["torch.ops.*", "torch._C.*", "torch._VF.*", "torch._ops.*", "torch._refs.*", "torch._decomp.*",
           "torch._prims.*", "importlib.*", "runpy.*", "builtins.exec", "builtins.eval", "builtins.__import__"]
BUILTINS = {"exec": "builtins.exec", "eval": "builtins.eval", "__import__": "builtins.__import__"}


def _escapes(patterns):
    """ESCAPES, and each forbidden ``torch.x`` under its private name ``torch._x`` too."""
    return ESCAPES + [f"{head}._{name}" for head, _, name in (p.rpartition(".") for p in patterns)
                      if head in ("torch", "torch.nn.functional", "torch.special") and not name.startswith("_")]


def _handed_on(tree, names):
    """(the ids of the values ``tree`` hands on: an argument, not ``print``'s, a default, an assigned value, where a
    string pattern (``'"sdpa"'``) counts, not in a label (``("standard", run)``), a comparison or a dict key;
    {name: dotted name} it binds by assignment, a default or the walrus to what ``names`` resolves: ``_t = torch``,
    ``def f(x, sm=torch.softmax)``, ``(F := torch.nn.functional)``, to a fixed point: ``a = torch; b = a.softmax``)."""
    handed, pairs = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id == "print"):
            handed += node.args + [k.value for k in node.keywords]
        elif isinstance(node, (*_FUNCTIONS, ast.Lambda)):
            a = node.args
            positional = [x.arg for x in a.posonlyargs + a.args]
            defaults = list(zip(positional[len(positional) - len(a.defaults):], a.defaults)) + [
                (x.arg, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            pairs += defaults
            handed += [d for _, d in defaults]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            pairs += [(t.id, node.value) for t in targets if isinstance(t, ast.Name)]
            handed.append(node.value)
    bound = {}
    while True:
        known, grown = {**names, **bound}, False
        for name, value in pairs:
            dotted = _dotted(value, known)
            if dotted is not None and bound.get(name) != dotted and names.get(name) != dotted:
                bound[name], grown = dotted, True
        if not grown:
            return {id(n) for n in handed}, bound


# reading a name the syntax cannot follow: refused outright in a part's code, whatever it reaches
DYNAMIC = {"vars": "vars()", "globals": "globals()", "locals": "locals()", "compile": "compile()",
           "__builtins__": "__builtins__", "breakpoint": "breakpoint()"}
DYNAMIC_DOTTED = ("sys.modules", "operator.attrgetter", "operator.methodcaller", "builtins.getattr",
                  "inspect.getmembers", "types.FunctionType", "types.CodeType")
DYNAMIC_ATTRIBUTES = ("__dict__", "__globals__", "__builtins__", "__code__", "__closure__", "__subclasses__",
                      "__getattribute__")


def _dynamic(node, local, shadowed):
    """What ``node`` is when it reaches an object by a name the syntax cannot read (``getattr`` with a computed name,
    ``vars()``, ``sys.modules``, ``x.__dict__``, ...), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
            and node.func.id not in shadowed and len(node.args) >= 2 and not _literal(node.args[1]):
        return f"{node.func.id}() with a computed name"
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in DYNAMIC and node.id not in shadowed:
        return DYNAMIC[node.id]
    if isinstance(node, ast.Attribute) and node.attr in DYNAMIC_ATTRIBUTES:
        return f".{node.attr}"
    dotted = _dotted(node, local) if isinstance(node, ast.Attribute) else None
    return dotted if dotted and any(dotted == d or dotted.startswith(d + ".") for d in DYNAMIC_DOTTED) else None


def uses(sources, patterns, all_sources=None):
    """[(forbidden name, line)] in ``sources`` (cells), with imports read from ``all_sources``. ``obj.softmax(...)``
    is ``torch.Tensor.softmax`` unless it is ``self.softmax(s)`` of a class that defines one."""
    everything = all_sources if all_sources is not None else sources
    imports, own, mine = _bindings(_trees(everything))
    names = {k: v for k, v in {**BUILTINS, **imports}.items() if k not in own}  # the learner's def wins
    methods = {p.rsplit(".", 1)[1] for p in patterns if p.startswith("torch.Tensor.")}
    patterns = list(patterns) + _escapes(patterns)
    found = []
    for tree in _trees(sources):
        here = _bindings([tree])[0]
        passed, bound = _handed_on(tree, {**names, **here})
        local = {**names, **here, **bound}
        shadowed = own | set(imports) | set(here)   # the learner's own `vars`, an imported one
        for node in ast.walk(tree):
            line = getattr(node, "lineno", 0)
            dynamic = _dynamic(node, local, shadowed)
            if dynamic is not None:
                found.append((f"{dynamic} (a name the grader cannot read)", line))
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found += [(hit, line) for a in node.names if (hit := _hit(f"{node.module}.{a.name}", patterns) or (
                    a.name == "*" and any(p.startswith(node.module + ".") for p in patterns) and f"{node.module}.*"))]
            elif isinstance(node, ast.Import):
                found += [(a.name, line) for a in node.names if any(
                    p.endswith(".*") and _matches(a.name, p) for p in patterns)]
            elif isinstance(node, (ast.Attribute, ast.Name, ast.Call, ast.Subscript)) and \
                    (name := _dotted(node, local)) is not None and (hit := _hit(name, patterns)):
                found.append((hit, line))
            elif _literal(node):
                if f'"{node.value}"' in patterns and id(node) in passed:
                    found.append((f"{node.value!r} (the name of one of the library's backends)", line))
                    continue
                if any(r in node.value.replace("\\", "/") for r in ("grading/exercises", "grading.exercises")):
                    found.append(("attnlab.grading.exercises (named in a string)", line))
                if "clear_refs" in node.value:
                    # without a cgroup the grader reads the kernel's peak memory (VmHWM) from outside; a
                    # learner who resets it through /proc/self/clear_refs would hide an N x N matrix
                    found.append(("/proc/self/clear_refs (named in a string)", line))
            elif isinstance(node, ast.Attribute) and node.attr in methods and _dotted(node, local) is None and not (
                    node.attr in mine and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                # x.softmax(...) is the Tensor's; only self.softmax(...) in a class that defines one is the learner's
                found.append((f"torch.Tensor.{node.attr}", line))
    first = {}  # one report per name and line (an attribute chain matches at several depths)
    for name, line in found:
        first.setdefault((name.split(".")[0], line), (name, line))
    return list(first.values())


def names(source, kind):
    """The names ``source`` reads from the notebook's namespace (``kind`` "global": not a parameter or a local), or
    defines at its top level ("defined": not by a plain ``import module``, which feeds an answer nothing)."""
    tree = _parse(source)
    if tree is None:
        return set()
    if kind == "defined":
        return {n for node in tree.body if not isinstance(node, ast.Import) for n in _defined(node)}
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


def _first_line(node):  # its decorators included
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])


def _defining(source, wanted, objects=frozenset()):
    """``source`` with only the top-level statements that define one of ``wanted``, change one that is among
    ``objects`` (the learner's own: ``ops.append(torch.softmax)``) or star-import, the others blank lines; or None."""
    tree = _parse(source)
    kept = [(i, node) for i, node in enumerate(tree.body if tree else []) if not isinstance(node, ast.Import) and (
        _defined(node) & wanted or _changed(node) & wanted & objects or "*" in _defined(node))]
    if not kept:
        return None
    text, lines = tree.text.splitlines(), {}
    for i, node in kept:
        first = _first_line(node)
        code = text[first - 1:node.end_lineno] if i < tree.magic_from else ast.unparse(node).splitlines()[:1]
        lines.update(enumerate(code, first))
    return "\n".join(lines.get(n, "") for n in range(1, max(lines) + 1)) + "\n"


def part_code(learners, functions, mine=None):
    """[(code, own)]: what a part's answer is read from. Of its own cells (``mine``, or those that define one of its
    ``functions``: ``own`` True) and every other learner cell, the statements that define one of those functions or
    a name they read, and so on (``_sm = torch.softmax`` above the answer, a helper's helper); not a scratch cell's
    comparison with ``torch.softmax`` nor ``x = torch.randn(4)`` beside a parameter ``x``."""
    own = [s for s in learners if names(s, "defined") & set(functions)] if mine is None else list(mine)
    pool = own + [s for s in learners if s not in own]
    objects = {n for tree in _trees(pool) for node in tree.body  # what the cells bind other than by an import
               if not isinstance(node, (ast.Import, ast.ImportFrom)) for n in _defined(node)}
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
    """:func:`part_code`'s code alone."""
    return [code for code, _own in part_code(learners, functions, mine)]


def _known(test):
    """The truth of a test that no value changes (``False``, ``0``, ``TYPE_CHECKING``, ``not ...``), or None."""
    if isinstance(test, ast.Constant):
        return bool(test.value)
    if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
        return False
    inner = _known(test.operand) if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) else None
    return None if inner is None else not inner


class _DeadCode(ast.NodeTransformer):
    """Drops what can never run: the branch of an ``if``/``while``/``x if c else y`` whose test is :func:`_known`,
    the right of ``False and ...``/``True or ...``, and the statements after a ``return``, ``raise``, ``break`` or
    ``continue``."""

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

    def _branch(self, stmts):  # the statements of the branch that runs, in place of the statement that chose it
        return self.generic_visit(ast.Module(body=stmts, type_ignores=[])).body

    def visit_If(self, node):
        known = _known(node.test)
        return self.generic_visit(node) if known is None else self._branch(node.body if known else node.orelse)

    def visit_While(self, node):
        return self._branch(node.orelse) if _known(node.test) is False else self.generic_visit(node)

    def visit_IfExp(self, node):
        known = _known(node.test)
        return self.generic_visit(node) if known is None else self.visit(node.body if known else node.orelse)

    def visit_BoolOp(self, node):
        values = []
        for value in node.values:   # `False and f()`: f never runs; `True or f()`: neither
            values.append(value)
            if (known := _known(value)) is not None and known == isinstance(node.op, ast.Or):
                break
        node.values = values if len(values) > 1 else values + [ast.Constant(value=None)]
        return self.generic_visit(node)


def live_code(source):
    """``source`` without the code that can never run (:class:`_DeadCode`), unchanged when it is not Python."""
    tree = _parse(source)
    return source if tree is None else ast.unparse(ast.fix_missing_locations(_DeadCode().visit(tree)))


def missing(sources, required, all_sources=None, rebound=()):
    """The keys of ``required`` that no live code of ``sources`` (:func:`part_code`) reads: a dotted name under any
    alias but not as a function of the learner's own, a plain one as itself unless ``rebound`` holds it."""
    sources = [live_code(text) for text in sources]
    everything = list(all_sources if all_sources is not None else sources) + sources
    read = set().union(*(names(text, "global") for text in sources))
    dotted = set()
    if any("." in key for key in required):
        imports, own, _members = _bindings(_trees(everything))
        local = {k: v for k, v in imports.items() if k not in own | set(rebound)}
        dotted = {name for tree in _trees(sources) for node in ast.walk(tree)
                  if isinstance(node, (ast.Attribute, ast.Name)) for name in [_dotted(node, local)] if name}
    return [key for key in required if not any(any(_matches(d, n) or _same(d, n) for d in dotted) if "." in n
                                               else n in read and n not in rebound for n in key.split("|"))]


def rebound(learners, given):
    """The names the ``given`` cells define that a top-level statement of ``learners`` that is none of theirs binds
    too (``kernel_attention = my_sdpa``; an edited given cell that keeps the definition does not count)."""
    theirs = {}
    for node in (node for tree in _trees(given) for node in tree.body):
        for name in _defined(node):
            theirs.setdefault(name, set()).add(ast.dump(node))
    return {name for tree in _trees(learners) for node in tree.body
            for name in _defined(node) & theirs.keys() if ast.dump(node) not in theirs[name]}


def _current_cells(history, given):
    """The learner's code as the namespace holds it now, from IPython's ``In``: the cells it ran less the ``given``
    ones, each without the top-level statements whose names a later cell binds again (blank lines in their place)."""
    given, cells, covered = {g.strip() for g in given}, [], set()
    for tree in reversed(_trees([s for s in history if isinstance(s, str) and s.strip() and s.strip() not in given])):
        lines, kept, binds = tree.text.splitlines(), False, set()   # the cell as IPython runs it (magics transformed)
        for node in tree.body[:tree.magic_from]:
            bound = _defined(node)
            if bound and not bound - covered:
                lines[_first_line(node) - 1:node.end_lineno] = [""] * (node.end_lineno - _first_line(node) + 1)
            else:
                kept, binds = True, binds | bound
        if kept:
            cells.insert(0, "\n".join(lines))
        covered |= binds
    return cells


def _history_cells(ns, functions, given):
    """:func:`_current_cells` of ``In`` if one defines one of ``functions``, else None (no notebook, or nbval's)."""
    cells = _current_cells(ns["In"], given) if isinstance(ns.get("In"), list) else []
    return cells if any(names(c, "defined") & set(functions) for c in cells) else None


def _code_names(fn):
    """The global and attribute names a function's code reads, in its nested functions and lambdas too."""
    codes, used = [getattr(fn, "__func__", fn).__code__], set()
    while codes:
        c = codes.pop()
        used.update(c.co_names)
        codes.extend(k for k in c.co_consts if inspect.iscode(k))
    return used


def missing_in_namespace(ns, functions, required, given=()):
    """:func:`missing` for the inline ``check()``: on the cells IPython ran, or on the code objects of the part's
    functions and of the namespace's functions they reach (a global that is the required object counts)."""
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
        used = _code_names(fn)
        read |= used
        objects += [fn.__globals__[n] for n in used if n in fn.__globals__]
        todo += [ns[n] for n in used if fn.__globals__ is ns and n in ns]

    def found(name):
        known, obj = _resolve(name) if "." in name else (False, None)
        return name.rsplit(".", 1)[-1] in read or known and any(o is obj for o in objects)
    return [key for key in required if not any(found(name) for name in key.split("|"))]


def in_namespace(ns, functions, patterns, given=()):
    """:func:`uses` for the inline ``check()`` (advice, not a score): on the cells IPython ran, or on the source of
    the part's functions and of the learner's functions they reach (a global or a closure), with their file's
    imports; a function they reach that *is* a forbidden one is named too."""
    cells = _history_cells(ns, functions, given)
    if cells is not None:
        return uses(part_cells(cells, functions), patterns, cells + list(given))
    everything = list(patterns) + _escapes(patterns)
    found, sources, code, seen, todo = [], [], [], set(), [ns.get(name) for name in functions]
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
        for f in [fn] if inspect.isfunction(fn) else [f for f in vars(fn).values()
                                                      if inspect.isfunction(getattr(f, "__func__", f))]:
            f = getattr(f, "__func__", f)
            todo += [f.__globals__[n] for n in _code_names(f) if n in f.__globals__ and callable(f.__globals__[n])]
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
    """Whether ``obj`` is the learner's (a notebook cell, a file outside Python, its packages, attnlab)."""
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
