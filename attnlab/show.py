"""Show the library's own code in a lesson, so what the learner reads is what runs."""

import ast
import inspect
import textwrap


def show_source(obj, *, lines=None, constexprs=None, checks=False):
    """Display the source of a function, class or module of attnlab.

    In a notebook the code is shown highlighted; elsewhere it is printed.
    ``checks=False`` (the default) folds the input checks a learner skips (calls of
    ``attnlab.validate`` or of a ``_check...`` helper, and ``if ...: raise`` blocks) into one
    comment line; ``checks=True`` shows every line.
    ``lines=(start, stop)`` keeps only that slice of the source's lines (after the folding).
    ``constexprs={"CAUSAL": False}`` shows a kernel as Triton compiles it for those values: each
    ``if NAME:`` (or ``if not NAME:``) keeps only the branch that runs, dedented; comments inside
    it stay. This cuts by the code's structure, never by a comment's wording.

    Example: ``show_source(attnlab.scaled_dot_product_attention)``;
    ``show_source(_attn_fwd_kernel, constexprs={"CAUSAL": False})``
    """
    obj = getattr(obj, "fn", obj)  # a Triton kernel (attnlab's Kernel, triton.JITFunction): its Python function
    try:
        source = inspect.getsource(obj)
    except TypeError as exc:
        raise TypeError(f"obj: expected a function, class or module, got {type(obj).__name__}") from exc
    source = textwrap.dedent(source)
    if not checks:
        source = fold_checks(source)
    if constexprs:
        source = specialize(source, constexprs)
    if lines is not None:
        start, stop = lines
        source = "\n".join(source.splitlines()[start:stop])
    try:
        from IPython.display import display
        from IPython import get_ipython
    except ImportError:  # plain Python: print it
        print(source)
        return None
    if get_ipython() is None:
        print(source)
        return None
    where = _repo_relative(inspect.getsourcefile(obj) or "")
    display(_Listing(where, source))
    return None


class _Listing:
    """A source listing for a notebook: highlighted HTML that scrolls sideways instead of wrapping
    (a wrapped line breaks mid-word where the frontend's ``pre`` style allows it), with Markdown
    and plain text for frontends that do not show HTML."""

    def __init__(self, where, source):
        self.where, self.source = where, source

    def _repr_mimebundle_(self, include=None, exclude=None):
        import html

        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer

            body = highlight(self.source, PythonLexer(), HtmlFormatter(noclasses=True, nowrap=True))
        except ImportError:  # pragma: no cover - IPython brings pygments
            body = html.escape(self.source)
        pre = ("white-space:pre; overflow-wrap:normal; word-break:normal; overflow-x:auto; "
               "padding:6px 8px; margin:2px 0; line-height:1.3; font-size:var(--jp-code-font-size, 13px); "
               "background:var(--jp-layout-color2, #f5f5f5)")
        return {
            "text/html": f"<div><code>{html.escape(self.where)}</code><pre style='{pre}'>{body}</pre></div>",
            "text/markdown": f"`{self.where}`\n```python\n{self.source}\n```",
            "text/plain": f"{self.where}\n{self.source}",
        }


def _repo_relative(path):
    """``.../attnlab/attention.py`` -> ``attnlab/attention.py``; kernels show as ``kernels/...``."""
    parts = path.replace("\\", "/").split("/")
    tops = [i for i, part in enumerate(parts) if part in ("attnlab", "kernels")]
    if not tops:
        return path
    return "/".join(parts[tops[-1]:])  # the innermost: attnlab/kernels/x.py in a wheel -> kernels/x.py


CHECKS_FOLDED = "# (the input checks are folded away: show_source(..., checks=True) shows them)"


def _is_check(stmt):
    """True for a statement that only checks its inputs: ``validate.x(...)``, ``_check_x(...)``,
    ``self._check_x(...)``, ``raise``, an ``if`` (with no ``else``) whose body ends in a raise and
    returns nothing, or a ``for`` loop made of checks."""
    if isinstance(stmt, ast.Raise):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        func = stmt.value.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "validate":
            return True
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name.startswith("_check")
    if isinstance(stmt, ast.If) and not stmt.orelse:
        returns = any(isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom)) for n in ast.walk(stmt))
        return not returns and (all(_is_check(s) for s in stmt.body) or isinstance(stmt.body[-1], ast.Raise))
    if isinstance(stmt, ast.For) and not stmt.orelse:
        return all(_is_check(s) for s in stmt.body)
    return False


def fold_checks(source):
    """``source`` without the input-check statements (see ``_is_check``) of its functions' bodies:
    the first run of them in each function becomes one comment line, ``CHECKS_FOLDED``, later
    runs go without one. Everything else is kept as written.

    Example: ``fold_checks("def f(x):\n    validate.tensor(x, 'x')\n    return x")`` keeps ``return x``
    """
    text = source.splitlines()
    tree = ast.parse(source)
    drop = {}  # first line of a run -> (its last line, its indent), 0-based
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        run, first = [], True
        for stmt in node.body + [None]:
            if stmt is not None and _is_check(stmt):
                run.append(stmt)
                continue
            if run:
                drop[run[0].lineno - 1] = (run[-1].end_lineno - 1, run[0].col_offset, first)
                run, first = [], False
    if not drop:
        return source
    out, i = [], 0
    while i < len(text):
        if i in drop:
            last, col, comment = drop[i]
            if comment:
                out.append(" " * col + CHECKS_FOLDED)
            i = last + 1
        else:
            out.append(text[i])
            i += 1
    return "\n".join(out)


def specialize(source, constexprs):
    """``source`` with every ``if NAME:`` / ``if not NAME:`` on a name of ``constexprs`` replaced by
    the branch that runs for its value (what Triton does to a ``tl.constexpr`` at compile time).

    Example: ``specialize("if A:\\n    x = 1\\nelse:\\n    x = 2\\n", {"A": False}) == "x = 2"``
    """
    text = source.splitlines()
    keep, dedent, used = [True] * len(text), [0] * len(text), set()

    def value(test):
        if isinstance(test, ast.Name) and test.id in constexprs:
            used.add(test.id)
            return bool(constexprs[test.id])
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            v = value(test.operand)
            return None if v is None else not v
        return None

    def indent(i):
        return len(text[i]) - len(text[i].lstrip())

    def header(i, region):  # drop a header line (if / else), keeping its comment above the kept branch
        keep[i] = False
        if "#" in text[i] and region and any(text[j].strip() for j in region):
            first = next(j for j in region if text[j].strip())
            text[i] = " " * indent(first) + text[i][text[i].index("#"):]
            keep[i], dedent[i] = True, dedent[first]

    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.If) or (v := value(node.test)) is None:
            continue
        if_line, end = node.lineno - 1, node.end_lineno
        else_line = next((i for i in range(node.body[-1].end_lineno, end) if text[i].strip().startswith("else")), None)
        if node.orelse and else_line is None:
            raise ValueError(f"constexprs: an elif on {ast.unparse(node.test)} is not supported")
        body = range(if_line + 1, else_line if else_line is not None else end)
        orelse = range(else_line + 1, end) if else_line is not None else range(0)
        kept, dropped = (body, orelse) if v else (orelse, body)
        for j in dropped:
            keep[j] = False
        for j in kept:
            if text[j].strip():
                dedent[j] += indent(kept[0]) - indent(if_line) if kept else 0
        header(if_line, kept if v else range(0))
        if else_line is not None:
            header(else_line, kept if not v else range(0))
    unknown = set(constexprs) - used
    if unknown:
        raise ValueError(f"constexprs: {sorted(unknown)} is not the condition of any if in this source")
    out = [t[d:] if t.strip() else t for t, d, k in zip(text, dedent, keep) if k]
    return "\n".join(out)
