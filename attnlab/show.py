"""Show the library's own code in a lesson, so what the learner reads is what runs."""

import inspect
import textwrap


def show_source(obj, *, lines=None):
    """Display the source of a function, class or module of attnlab.

    In a notebook the code is shown highlighted; elsewhere it is printed.
    ``lines=(start, stop)`` keeps only that slice of the source's lines.

    Example: ``show_source(attnlab.scaled_dot_product_attention)``
    """
    obj = getattr(obj, "fn", obj)  # a Triton kernel (attnlab's Kernel, triton.JITFunction): its Python function
    try:
        source = inspect.getsource(obj)
    except TypeError as exc:
        raise TypeError(f"obj: expected a function, class or module, got {type(obj).__name__}") from exc
    source = textwrap.dedent(source)
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
