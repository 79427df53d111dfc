"""Show the library's own code in a lesson, so what the learner reads is what runs."""

import inspect
import textwrap


def show_source(obj, *, lines=None):
    """Display the source of a function, class or module of attnlab.

    In a notebook the code is shown highlighted; elsewhere it is printed.
    ``lines=(start, stop)`` keeps only that slice of the source's lines.

    Example: ``show_source(attnlab.scaled_dot_product_attention)``
    """
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
    where = inspect.getsourcefile(obj) or ""
    where = where[where.rfind("attnlab"):] if "attnlab" in where else where
    where = where.replace("attnlab/kernels", "kernels")
    display(Markdown(f"`{where}`\n```python\n{source}\n```"))
    return None
