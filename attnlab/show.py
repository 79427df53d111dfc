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
        from IPython.display import Markdown, display
        from IPython import get_ipython
    except ImportError:  # plain Python: print it
        print(source)
        return None
    if get_ipython() is None:
        print(source)
        return None
    where = _repo_relative(inspect.getsourcefile(obj) or "")
    display(Markdown(f"`{where}`\n```python\n{source}\n```"))
    return None


def _repo_relative(path):
    """``.../attnlab/attention.py`` -> ``attnlab/attention.py``; kernels show as ``kernels/...``."""
    parts = path.replace("\\", "/").split("/")
    tops = [i for i, part in enumerate(parts) if part in ("attnlab", "kernels")]
    if not tops:
        return path
    return "/".join(parts[tops[-1]:])  # the innermost: attnlab/kernels/x.py in a wheel -> kernels/x.py
