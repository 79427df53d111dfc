"""Widgets that show attention, built on ipywidgets 8 and matplotlib (no JavaScript of our own).

``from attnlab.widgets import AttentionMap, ScalingExplorer, MemoryTraffic, BlockMaskEditor``

Each is an ``ipywidgets.VBox``: a cell that ends with one shows it live. Each has
``to_figure()``, a matplotlib Figure of its current state, and carries a PNG of
its state in its display output, so nbconvert and GitHub show a picture where
no widget frontend runs (see ``attnlab/widgets/_base.py`` and ``docs/widgets.md``).

Example::

    w = AttentionMap(weights, query_tokens=tokens)   # (layers, heads, Nq, Nk)
    w.head.value = 2; w.query.value = 4               # what a click does
    w.to_figure()                                     # that state as a picture
"""

from importlib import import_module

_WIDGETS = {
    "AttentionMap": "attnlab.widgets.attention_map",
    "ScalingExplorer": "attnlab.widgets.scaling",
    "MemoryTraffic": "attnlab.widgets.memory_traffic",
    "BlockMaskEditor": "attnlab.widgets.block_mask_editor",
    "SelectionExplorer": "attnlab.widgets.selection",
}

__all__ = sorted(_WIDGETS)


def __getattr__(name):
    module = _WIDGETS.get(name)
    if module is None:
        raise AttributeError(f"module 'attnlab.widgets' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
