"""Find calls a part forbids in the learner's answer cells, from their syntax tree (in the grader).

The patterns are those of :func:`attnlab.grading.parts.forbidden`: ``torch.softmax``,
``torch.Tensor.softmax`` (any ``x.softmax(...)``), ``torch.nn.Softmax.forward`` (the module
``torch.nn.Softmax`` used at all), ``attnlab.attention.*`` (everything in that package).
Names are resolved through the notebook's imports (``import torch.nn.functional as F``,
``from attnlab.grading import specs``, ``from attnlab import scaled_dot_product_attention``)
and ``getattr(module, "name")`` with a literal name. The learner's code never runs here.

Example::

    uses(["import torch\\ndef f(x):\\n    return torch.softmax(x, -1)"], ["torch.softmax"])
    # [("torch.softmax", 3)]
"""

import ast


def _exports():
    try:
        import attnlab

        return dict(getattr(attnlab, "_EXPORTS", {}))
    except Exception:  # pragma: no cover
        return {}


def _parse(source):
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _clean(source):
    # IPython magics and shell lines are not Python: blank them (keeping line numbers)
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n"))


def aliases(sources):
    """{local name: dotted name} from the imports of every cell in ``sources``."""
    out = {}
    exports = _exports()
    for source in sources:
        tree = _parse(_clean(source))
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


def _dotted(node, names):
    """The dotted name an expression refers to, resolved through ``names``, or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        base = _dotted(node.args[0], names)
        if base is None:
            return None
        return ".".join([base, node.args[1].value, *reversed(parts)])
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


def uses(sources, patterns, all_sources=None):
    """[(forbidden name, line)] in ``sources`` (cells), with imports read from ``all_sources``."""
    names = aliases(all_sources if all_sources is not None else sources)
    methods = {p.rsplit(".", 1)[1] for p in patterns if p.startswith("torch.Tensor.")}
    found = []
    for source in sources:
        tree = _parse(_clean(source))
        if tree is None:
            continue
        local = dict(names)
        local.update(aliases([source]))
        for node in ast.walk(tree):
            name = None
            if isinstance(node, (ast.Attribute, ast.Name, ast.Call)):
                name = _dotted(node, local)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    hit = next((p for p in patterns if _matches(full, p)), None)
                    if hit:
                        found.append((full, node.lineno))
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    if any(p.endswith(".*") and _matches(a.name, p) for p in patterns):
                        found.append((a.name, node.lineno))
                continue
            if name is not None:
                if any(_matches(name, p) for p in patterns):
                    found.append((name, node.lineno))
                    continue
            if isinstance(node, ast.Attribute) and node.attr in methods and _dotted(node, local) is None:
                found.append((f"torch.Tensor.{node.attr}", node.lineno))
    # one report per name and line (an attribute chain matches at several depths)
    seen, out = set(), []
    for name, line in found:
        key = (name.split(".")[0], line)
        if key not in seen:
            seen.add(key)
            out.append((name, line))
    return out


def defines(source, names):
    """True when ``source`` defines (def, class, assignment or import) any of ``names``."""
    tree = _parse(_clean(source))
    if tree is None:
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
            return True
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in names:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) in names for a in node.names):
            return True
    return False
