"""The references are not available in a kernel that ``attnlab grade`` runs.

Each ``exercises/eNN/spec.py`` ends with ``hide(globals())``: when ``ATTNLAB_GRADING=1`` (set by the
grader before the notebook's first cell), its public functions become stand-ins that raise. The grader
compares with the real functions in its own process.
"""

import os
import types


def _hidden(*args, **kwargs):
    """The grader's references are not available while `attnlab grade` runs this notebook."""
    raise RuntimeError("the grader's references (attnlab.grading.exercises) are not available while "
                       "`attnlab grade` runs your notebook: the grader's references are not answers")


def hide(ns):
    """Replace the public functions defined in the module ``ns`` by stand-ins (under the grader)."""
    if os.environ.get("ATTNLAB_GRADING") != "1":
        return
    module = ns["__name__"]
    for name, value in list(ns.items()):
        if isinstance(value, types.FunctionType) and not name.startswith("_") and value.__module__ == module:
            stub = types.FunctionType(_hidden.__code__, {}, name)
            stub.__doc__ = _hidden.__doc__
            stub.__module__ = module
            ns[name] = stub
