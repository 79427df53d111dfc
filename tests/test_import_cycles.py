"""No import cycle in attnlab/ (and kernels/, imported as attnlab.kernels).

A cycle (a imports b, b imports a) works only as long as one side imports lazily or late, and
the first import of the other side breaks: `attnlab.measure` and `attnlab.memory` had one
(memory needed measure's `format_bytes`, measure's deprecated `op_traffic` imported memory
inside the function). This reads every module's source with `ast` and counts every import,
at the top of a module or inside a function, except under `if TYPE_CHECKING:`.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"attnlab": ROOT / "attnlab", "attnlab.kernels": ROOT / "kernels"}


def _modules():
    """{dotted name: (path, is a package)} for every .py file of the two trees."""
    found = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = (path, is_package)
    return found


def _type_checking_nodes(tree):
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def import_graph():
    """{module: set of attnlab modules it imports}, resolved to the longest known module name."""
    modules = _modules()

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        package = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    targets.add(full if full in modules else resolve(source))
        targets.discard(None)
        targets.discard(name)
        graph[name] = targets
    return graph


def cycles(graph):
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_modules_and_their_imports():
    graph = import_graph()
    assert "attnlab.kernels.flash_attention" in graph and "attnlab.grading.core" in graph
    assert "attnlab.memory" in graph["attnlab.measure"]        # measure re-exports format_bytes
    assert "attnlab._interp_hooks" in graph["attnlab.memory"]


def test_cycles_finds_a_cycle_through_a_lazy_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_attnlab():
    found = cycles(import_graph())
    assert not found, f"import cycles in attnlab/ (each group imports itself through the others): {found}"
