"""What the four widgets share: a VBox that shows a matplotlib picture of its state.

Each widget is an ``ipywidgets.VBox`` holding its controls and an
``ipywidgets.Image``. The picture is a matplotlib figure (``ShowableFigure``,
not tracked by pyplot) rendered by the Agg backend to PNG bytes: no JavaScript
of our own, no CDN, works offline in JupyterLab 4, Notebook 7, VS Code and Colab.

Two ways to draw: a widget either rebuilds its figure with ``to_figure()`` on
every change (AttentionMap: its layout changes with the view), or keeps one
figure and updates its artists (``_make_figure``/``_update_figure``); a widget
of the second kind may also list the artists a control can change as
"dynamic", and then everything else is drawn once and only those are blitted
(MemoryTraffic, BlockMaskEditor). ``to_figure()`` always returns a fresh figure.

Static fallback: ``_repr_mimebundle_`` returns the usual widget view *and* an
``image/png`` of the widget's state when it was displayed. A live frontend
(JupyterLab, Notebook 7, VS Code) prefers the widget view; nbconvert (without
saved widget state), GitHub's viewer and JupyterLab on an untrusted notebook
(freshly cloned) show the PNG instead of "Loading widget...". The PNG is the
state at display time; ``display(w.to_figure())`` shows a later state.
"""

import base64
import contextlib
import io
import time

import ipywidgets as widgets
import numpy as np
import PIL.Image
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# Picture size: a figure of w x h inches is shown at w * DPI x h * DPI CSS pixels (small enough to
# fit a laptop screen) and rendered with SCALE times the pixels, sharp on a 2x (HiDPI) display.
DPI = 80
SCALE = 2


def png_size(png):
    """(width, height) in pixels of PNG bytes (from the IHDR chunk)."""
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def css_size(png):
    """(width, height) in CSS pixels at which a picture rendered with ``SCALE`` is shown."""
    w, h = png_size(png)
    return round(w / SCALE), round(h / SCALE)


class ShowableFigure(Figure):
    """A matplotlib Figure that pyplot does not track (no auto-display, no leak between redraws)
    and that a notebook shows as a PNG when it ends a cell (``_repr_png_``), whatever the backend."""

    def _repr_png_(self):
        png = figure_png(self)
        w, h = css_size(png)
        return png, {"width": w, "height": h}  # twice the pixels, shown at CSS size


def new_figure(width, height):
    """A ShowableFigure of `width` x `height` inches (shown at ``DPI`` CSS pixels per inch, rendered at
    ``SCALE`` times that) with an Agg canvas and constrained layout."""
    fig = ShowableFigure(figsize=(width, height), dpi=DPI * SCALE, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_png(fig):
    """PNG bytes of a figure (Agg)."""
    buf = io.BytesIO()
    fig.canvas.print_png(buf)
    return buf.getvalue()


def rgba_png(fig):
    """PNG bytes of what the figure's Agg canvas holds now (after blitting), without drawing it again."""
    buf = io.BytesIO()
    PIL.Image.fromarray(np.asarray(fig.canvas.buffer_rgba())).save(buf, format="png", compress_level=3)
    return buf.getvalue()


def blit_png(fig, dynamic, store, first):
    """PNG of ``fig`` where only the ``dynamic`` artists are redrawn after the first time.

    The first call draws everything else once and keeps it in ``store["background"]``;
    later calls restore that background and draw just the dynamic artists over it.
    """
    if first:
        for artist in dynamic:
            artist.set_animated(True)  # left out of a full draw: the background
        fig.canvas.draw()
        fig.set_layout_engine("none")
        store["background"] = fig.canvas.copy_from_bbox(fig.bbox)
    else:
        fig.canvas.restore_region(store["background"])
    for artist in dynamic:
        fig.draw_artist(artist)
    return rgba_png(fig)


def as_array(x, name):
    """A float64 numpy array from a torch tensor, numpy array or nested list; TypeError naming `name` otherwise."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor without importing torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":  # numpy has no bfloat16
            x = x.float()
        x = x.numpy()
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected a tensor, numpy array or nested list of numbers, got {type(x).__name__}") from exc
    return arr


def html_table(header, rows, numeric=()):
    """A small HTML table for the widgets' text panels: header a list of str, rows lists of str (already escaped).

    Columns are padded apart and cells never wrap, so numbers cannot run into each other;
    the columns whose indices are in ``numeric`` are right-aligned. A table wider than its
    panel scrolls sideways inside it.
    """
    def cell(j, tag, text):
        align = "right" if j in numeric else "left"
        return f"<{tag} style='padding:1px 0.9em 1px 0; text-align:{align}; white-space:nowrap'>{text}</{tag}>"

    head = "".join(cell(j, "th", h) for j, h in enumerate(header))
    body = "".join("<tr>" + "".join(cell(j, "td", c) for j, c in enumerate(row)) + "</tr>" for row in rows)
    return (f"<div style='overflow-x:auto; max-width:100%'><table style='border-collapse:collapse; font-size:90%'>"
            f"<tr>{head}</tr>{body}</table></div>")


def text_panel():
    """An ``ipywidgets.HTML`` for a widget's tables: never wider than the widget (a wide table scrolls inside it)."""
    return widgets.HTML(layout=widgets.Layout(max_width="100%", overflow="auto"))


def show_png(image, png):
    """Put PNG bytes (rendered with ``SCALE``) in an ``ipywidgets.Image`` shown at CSS size (shrunk if its box is narrower)."""
    w, _ = css_size(png)
    image.layout.width = f"{w}px"
    image.value = png


# A widget reopened from the state saved in a notebook has no kernel behind it until its cell runs
# again: ipywidgets marks every view of it "disconnected" and draws a broken-link icon before each
# control (64 on BlockMaskEditor's tiles, whose grid then wraps onto a ninth row). This style (in
# a hidden HTML child, so it travels with the saved state) replaces those icons by one line above
# the widget that says what to do. A live widget never has the class: the line never shows there.
DISCONNECTED_STYLE = (
    "<style>"
    ".attnlab-widget .jupyter-widgets-disconnected::before{display:none !important}"
    ".attnlab-widget.jupyter-widgets-disconnected::before{display:block !important;"
    "content:'A saved view: run this cell again to use its controls.' !important;"
    "font:inherit !important;font-size:90% !important;font-style:italic !important;"
    "color:var(--jp-ui-font-color2, #666) !important;margin:0 0 4px 0 !important;"
    "position:static !important;width:auto !important;height:auto !important}"
    "</style>"
)


class FigureWidget(widgets.VBox):
    """Base: controls above, the picture (an ``ipywidgets.Image``) below, a status line.

    Subclasses implement ``to_figure()`` or ``_make_figure()``/``_update_figure()`` (see the
    module docstring), call ``self._build(controls_above, widgets_below)`` at the end of
    ``__init__``, and let each control's observer call ``self.redraw()``.
    """

    def _build(self, children_above, children_below=()):
        # natural size (not stretched to the cell's width by the VBox), shrunk only if the cell is narrower
        self._image = widgets.Image(
            format="png", layout=widgets.Layout(max_width="100%", height="auto", align_self="flex-start",
                                                object_fit="contain")
        )
        self._status = widgets.HTML()
        self._style = widgets.HTML(DISCONNECTED_STYLE, layout=widgets.Layout(display="none"))
        self.last_redraw_ms = None
        self.redraw_ms = []  # every redraw's time, for benchmarks/widgets_redraw.py
        super().__init__(children=[self._style, *children_above, self._image, *children_below, self._status])
        # CSS classes: the browser test (and a curious learner's devtools) find each widget by them
        self.add_class("attnlab-widget")
        self.add_class("attnlab-" + type(self).__name__.lower())
        self.redraw()

    def _layout_key(self):
        """A hashable naming the structure of the live figure (panels, tick labels): the widget keeps one
        persistent figure per key it has shown (the last few), so going back to a view is a cheap update."""
        return None

    def _render_png(self):
        if self._make_figure is not None:
            return self._render_live()
        return figure_png(self.to_figure())

    def _render_live(self):
        """Redraw the persistent figure. If its handles list ``"dynamic"`` artists (all that a
        control can change), draw everything else once and blit only those afterwards."""
        key = self._layout_key()
        lives = self.__dict__.setdefault("_lives", {})
        first = key not in lives
        if first:
            if len(lives) >= 8:  # keep the memory bounded: forget the oldest view
                lives.pop(next(iter(lives)))
            lives[key] = self._make_figure()
        live = lives[key]
        fig = self._update_figure(live)
        dynamic = live.get("dynamic")
        if dynamic is None:
            png = figure_png(fig)
            if first:  # keep the constrained layout of the first draw
                fig.set_layout_engine("none")
            return png
        return blit_png(fig, dynamic, live, first)

    def _update_state(self):
        """Recompute derived state (text panels etc.) before drawing; subclasses override."""

    # Two ways to draw. Either a subclass overrides to_figure() (a new Figure each
    # time), or it implements _make_figure() -> handles (a dict with "fig") and
    # _update_figure(handles) -> fig: then live redraws update one persistent
    # figure's artists and reuse its first layout, and to_figure() builds a fresh one.
    _make_figure = None

    def to_figure(self):
        """A matplotlib Figure of the widget's current state (the static fallback)."""
        if self._make_figure is None:  # pragma: no cover - subclasses provide one of the two
            raise NotImplementedError
        return self._update_figure(self._make_figure())

    @contextlib.contextmanager
    def _one_redraw(self):
        """Change several controls, then redraw once."""
        self._held = True
        try:
            yield
        finally:
            self._held = False
        self.redraw()

    def redraw(self, *_):
        """Recompute and redraw the picture; records the time taken in ``last_redraw_ms``."""
        if getattr(self, "_held", False) or not hasattr(self, "_image"):
            return
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            self._update_state()
            show_png(self._image, self._render_png())
            self._status.value = ""
        except Exception as exc:  # show it in the notebook, then let it propagate (tests see it)
            self._status.value = f"<span style='color:#b00'>error: {type(exc).__name__}: {exc}</span>"
            raise
        self.last_redraw_ms = 1000 * (time.perf_counter() - t0)
        # CPU time of this process: what the redraw costs on an idle machine (wall time counts other load)
        self.last_redraw_cpu_ms = 1000 * (time.process_time() - c0)
        self.redraw_ms.append(self.last_redraw_ms)

    @property
    def png(self):
        """The PNG bytes the widget shows now."""
        return bytes(self._image.value)

    def _static_png(self):
        """The PNG stored with the widget's output for viewers without a widget frontend."""
        return self.png

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs)
        if data is not None and self._image.value:
            png = self._static_png()
            data["image/png"] = base64.b64encode(png).decode("ascii")
            w, h = css_size(png)
            return data, {"image/png": {"width": w, "height": h}}  # twice the pixels, shown at CSS size
        return data
