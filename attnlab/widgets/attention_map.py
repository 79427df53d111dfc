"""AttentionMap: explore attention weights by example, layer, head and query token."""

import html

import ipywidgets as widgets
import numpy as np
from matplotlib.patches import Rectangle

from attnlab.widgets._base import FigureWidget, as_array, html_table, new_figure, text_panel

ALL_HEADS = "all"
NO_QUERY = -1  # the query selector's "(none)" (a Dropdown cannot select an option whose value is None)


def _is_tensor_like(x):
    return hasattr(x, "shape") and hasattr(x, "ndim")


def _check_tokens(tokens, n, name, where=""):
    if tokens is None:
        return [str(i) for i in range(n)]
    if isinstance(tokens, str) or not hasattr(tokens, "__len__"):
        raise TypeError(f"{name}: expected a list of {n} token strings{where}, got {type(tokens).__name__}")
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"{name}: expected {n} tokens{where} to match the weights, got {len(tokens)}")
    return tokens


class AttentionMap(FigureWidget):
    """Heat map of attention weights with layer, head, example and query selectors.

    ``weights`` is one of

    - ``(Nq, Nk)``: one map (a Bahdanau alignment, one head);
    - ``(heads, Nq, Nk)``: one layer of multi-head attention;
    - ``(layers, heads, Nq, Nk)``: a whole model.

    A batch of examples is given either as a list of such arrays (examples may
    differ in Nq and Nk, not in layers and heads) or, with ``batched=True``, as
    one array with a leading batch dimension, for example the ``(B, h, Nq, Nk)``
    weights of ``MultiHeadAttention(..., return_weights=True)``. Without
    ``batched=True`` a 4-D array means ``(layers, heads, Nq, Nk)``.

    ``query_tokens``/``key_tokens``: token strings for the rows and columns (one
    list, or for a batch one list per example). ``key_tokens`` defaults to
    ``query_tokens`` when Nq == Nk (self-attention).

    Controls: ``example``, ``layer``, ``head`` (a head or ``"all"`` for the
    overview of every head of the layer) and ``query`` (``-1`` for none, or a row
    index: highlights that row and lists its ``top_k`` keys; ``selected_query``
    reads it as ``None`` or the index). Set their ``.value`` from
    code or use them in the notebook; ``to_figure()`` draws the current state.

    Example: ``AttentionMap(weights, query_tokens=["the", "cat", "sat"])``
    """

    def __init__(self, weights, query_tokens=None, key_tokens=None, *, batched=False, top_k=5, title=None):
        if not isinstance(batched, bool):
            raise TypeError(f"batched: expected True or False, got {type(batched).__name__}")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise ValueError(f"top_k: expected a positive int, got {top_k!r}")
        self.top_k = int(top_k)
        self.title = title
        self._examples, self._q_tokens, self._k_tokens = self._normalise(weights, query_tokens, key_tokens, batched)
        n_layers, n_heads = self._examples[0].shape[:2]
        self.n_examples, self.n_layers, self.n_heads = len(self._examples), n_layers, n_heads

        style = {"description_width": "initial"}
        self.example = widgets.Dropdown(
            options=[(f"example {i}", i) for i in range(self.n_examples)], value=0, description="example", style=style
        )
        self.layer = widgets.Dropdown(
            options=[(f"layer {i}", i) for i in range(n_layers)], value=0, description="layer", style=style
        )
        head_options = ([("all heads", ALL_HEADS)] if n_heads > 1 else []) + [(f"head {i}", i) for i in range(n_heads)]
        self.head = widgets.Dropdown(
            options=head_options, value=ALL_HEADS if n_heads > 1 else 0, description="head", style=style
        )
        self.query = widgets.Dropdown(description="query", style=style)
        self._set_query_options()
        self.top_keys_html = text_panel()

        for control in (self.layer, self.head, self.query):
            control.observe(self.redraw, names="value")
        self.example.observe(self._on_example, names="value")
        # only show selectors that have a choice to make
        selectors = [c for c, n in ((self.example, self.n_examples), (self.layer, n_layers), (self.head, n_heads)) if n > 1]
        row = widgets.HBox([*selectors, self.query], layout=widgets.Layout(flex_flow="row wrap"))  # wraps when narrow
        self._build([row], [self.top_keys_html])

    # ---------------------------------------------------------------- input
    @staticmethod
    def _normalise(weights, query_tokens, key_tokens, batched):
        """-> (list of (L, H, Nq, Nk) arrays, list of query token lists, list of key token lists)."""
        if isinstance(weights, (list, tuple)) and weights and all(_is_tensor_like(w) for w in weights):
            raw = [as_array(w, f"weights[{i}]") for i, w in enumerate(weights)]
            is_batch = True
        else:
            arr = as_array(weights, "weights")
            if batched:
                if arr.ndim not in (3, 4, 5):
                    raise ValueError(
                        "weights: with batched=True expected shape (B, Nq, Nk), (B, heads, Nq, Nk) or "
                        f"(B, layers, heads, Nq, Nk), got {tuple(arr.shape)}"
                    )
                raw = list(arr)
            else:
                raw = [arr]
            is_batch = batched
        examples = []
        for i, a in enumerate(raw):
            name = f"weights[{i}]" if is_batch else "weights"
            if a.ndim not in (2, 3, 4):
                raise ValueError(
                    f"{name}: expected shape (Nq, Nk), (heads, Nq, Nk) or (layers, heads, Nq, Nk), got {tuple(a.shape)}"
                )
            if 0 in a.shape:
                raise ValueError(f"{name}: is empty (shape {tuple(a.shape)})")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"{name}: contains NaN or infinite values")
            examples.append(a.reshape((1,) * (4 - a.ndim) + a.shape))
        if not examples:
            raise ValueError("weights: got an empty batch")
        lh = examples[0].shape[:2]
        for i, a in enumerate(examples):
            if a.shape[:2] != lh:
                raise ValueError(
                    f"weights[{i}]: every example needs the same (layers, heads) = {lh}, got {a.shape[:2]}"
                )

        def per_example(tokens, name, dim):
            n = len(examples)
            nested = (
                tokens is not None
                and not isinstance(tokens, str)
                and len(tokens) > 0
                and all(not isinstance(t, str) and hasattr(t, "__len__") for t in tokens)
            )
            if is_batch and nested:
                if len(tokens) != n:
                    raise ValueError(f"{name}: expected one token list per example ({n}), got {len(tokens)}")
                return [_check_tokens(t, a.shape[dim], name, f" for example {i}") for i, (t, a) in enumerate(zip(tokens, examples))]
            return [_check_tokens(tokens, a.shape[dim], name, f" for example {i}" if is_batch else "") for i, a in enumerate(examples)]

        q_tokens = per_example(query_tokens, "query_tokens", 2)
        if key_tokens is None and query_tokens is not None and all(a.shape[2] == a.shape[3] for a in examples):
            k_tokens = q_tokens
        else:
            k_tokens = per_example(key_tokens, "key_tokens", 3)
        return examples, q_tokens, k_tokens

    # ---------------------------------------------------------------- state
    def _on_example(self, change):
        # the new example may have another number of query tokens: one redraw for both changes
        with self._one_redraw():
            self._set_query_options()

    def _set_query_options(self):
        tokens = self._q_tokens[self.example.value]
        options = [("(none)", NO_QUERY)] + [(f"{i}: {t}", i) for i, t in enumerate(tokens)]
        old = self.query.value if self.query.value is not None else NO_QUERY
        self.query.options = options
        self.query.value = old if old < len(tokens) else NO_QUERY

    @property
    def selected_query(self):
        """The query row picked (an int), or None."""
        return None if self.query.value in (None, NO_QUERY) else self.query.value

    @property
    def query_tokens(self):
        """Tokens on the rows of the example shown."""
        return self._q_tokens[self.example.value]

    @property
    def key_tokens(self):
        """Tokens on the columns of the example shown."""
        return self._k_tokens[self.example.value]

    @property
    def current_weights(self):
        """The map(s) shown: ``(Nq, Nk)`` for one head, ``(heads, Nq, Nk)`` for the all-heads overview."""
        w = self._examples[self.example.value][self.layer.value]
        return w if self.head.value == ALL_HEADS else w[self.head.value]

    def top_keys(self, query=None, head=None):
        """The ``top_k`` keys of a query row as ``[(key index, key token, weight), ...]``, largest first.

        Defaults: the selected query, and the selected head (head 0 if the overview is shown).
        """
        query = self.selected_query if query is None else query
        if query is None:
            return []
        if head is None:
            head = 0 if self.head.value == ALL_HEADS else self.head.value
        row = self._examples[self.example.value][self.layer.value, head, query]
        order = np.argsort(-row, kind="stable")[: self.top_k]
        return [(int(j), self.key_tokens[j], float(row[j])) for j in order]

    def _update_state(self):
        q = self.selected_query
        if q is None:
            self.top_keys_html.value = "<i>Pick a query token to list the keys it attends to most.</i>"
            return
        heads = range(self.n_heads) if self.head.value == ALL_HEADS else [self.head.value]
        rows = [[f"head {h}"] + [f"<code>{j}:&nbsp;{html.escape(tok)}</code>&nbsp;{w:.3f}" for j, tok, w in self.top_keys(q, h)]
                for h in heads]
        self.top_keys_html.value = (
            f"<b>top {self.top_k} keys of query {q} <code>{html.escape(self.query_tokens[q])}</code></b>"
            + html_table([""] + [f"#{i + 1}" for i in range(min(self.top_k, len(self.key_tokens)))], rows)
        )

    # ---------------------------------------------------------------- drawing
    def _layout_key(self):
        # tick labels depend on the example only; the bar chart writes its labels inside the axes
        return (self.example.value, self.head.value == ALL_HEADS, self.selected_query is None, bool(self.title))

    def _heading(self):
        parts = [self.title] if self.title else []
        if self.n_examples > 1:
            parts.append(f"example {self.example.value}")
        if self.n_layers > 1:
            parts.append(f"layer {self.layer.value}")
        if self.n_heads > 1:
            parts.append("all heads" if self.head.value == ALL_HEADS else f"head {self.head.value}")
        return ", ".join(parts)

    @staticmethod
    def _ticks(ax, tokens, axis):
        n = len(tokens)
        step = max(1, int(np.ceil(n / 40)))
        idx = np.arange(0, n, step)
        labels = [tokens[i] for i in idx]
        if axis == "x":
            ax.set_xticks(idx, labels, rotation=90, fontsize=8)
        else:
            ax.set_yticks(idx, labels, fontsize=8)

    def _color_range(self, w):
        """(vmin, vmax, cmap): 0..max for weights, symmetric and diverging if there are negative scores."""
        vmin, vmax = min(0.0, float(w.min())), max(float(w.max()), 1e-12)
        if vmin < 0:
            vmax = max(vmax, -vmin)
            return -vmax, vmax, "RdBu_r"
        return vmin, vmax, "viridis"

    def _make_figure(self):
        """A figure for the current view's structure (see ``_layout_key``); ``_update_figure`` fills it in."""
        w = self.current_weights
        q = self.selected_query
        if w.ndim == 3:
            return self._make_overview(w)
        n_q, n_k = w.shape
        width = float(np.clip(1.5 + 0.22 * n_k, 4, 9)) + (2.5 if q is not None else 0)
        height = float(np.clip(1.2 + 0.22 * n_q, 2.5, 8))
        fig = new_figure(width, height)
        if q is not None:
            ax, bar_ax = fig.subplots(1, 2, width_ratios=[3, 1.2])
        else:
            ax, bar_ax = fig.subplots(), None
        h = {"fig": fig, "kind": "single", "bar_ax": bar_ax}
        h["im"] = ax.imshow(np.zeros((n_q, n_k)), aspect="auto", interpolation="nearest")
        fig.colorbar(h["im"], ax=ax, fraction=0.05, pad=0.02)
        self._ticks(ax, self.key_tokens, "x")
        self._ticks(ax, self.query_tokens, "y")
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        h["title"] = ax.set_title("", fontsize=10)
        if q is not None:
            h["row"] = ax.add_patch(Rectangle((-0.5, -0.5), n_k, 1, fill=False, edgecolor="red", linewidth=2,
                                              clip_on=False))
            k = min(self.top_k, n_k)
            h["bars"] = bar_ax.barh(range(k), np.zeros(k), color="tab:red", alpha=0.6)
            bar_ax.set_yticks([])
            bar_ax.set_ylim(-0.6, k - 0.4)
            # labels inside the axes: the layout does not depend on which tokens they are
            h["bar_texts"] = [bar_ax.text(0, i, "", va="center", fontsize=9) for i in range(k)]
            h["bar_title"] = bar_ax.set_title("", fontsize=9)
        return h

    def _make_overview(self, w):
        """All heads of the layer, one small map each, with its label above it (outside the map)."""
        n_heads, n_q, n_k = w.shape
        cols = int(min(n_heads, 4 if n_heads <= 8 else int(np.ceil(np.sqrt(n_heads)))))
        rows = int(np.ceil(n_heads / cols))
        width = 8.0
        cell_h = (width - 0.8) / cols * n_q / n_k
        fig = new_figure(width, float(np.clip(rows * (cell_h + 0.3) + 0.6, 2.5, 8.5)))
        axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
        h = {"fig": fig, "kind": "overview", "ims": [], "rows": []}
        for head, ax in enumerate(axes):
            ax.set_xticks([])
            ax.set_yticks([])
            if head >= n_heads:
                ax.set_axis_off()
                continue
            h["ims"].append(ax.imshow(np.zeros((n_q, n_k)), interpolation="nearest", aspect="auto"))
            ax.set_title(f"head {head}", fontsize=9, pad=3)  # above the map, never on it
            h["rows"].append(ax.add_patch(Rectangle((-0.5, -0.5), n_k, 1, fill=False, edgecolor="red",
                                                    linewidth=1.5, clip_on=False, visible=False)))
        fig.colorbar(h["ims"][0], ax=axes.tolist(), fraction=0.04, pad=0.02)
        h["title"] = fig.suptitle("", fontsize=10)
        return h

    def _update_figure(self, h):
        w = self.current_weights
        vmin, vmax, cmap = self._color_range(w)
        q = self.selected_query
        if h["kind"] == "overview":
            for head, (im, row) in enumerate(zip(h["ims"], h["rows"])):
                im.set_data(w[head])
                im.set_cmap(cmap)
                im.set_clim(vmin, vmax)  # one colour scale for all heads
                row.set_visible(q is not None)
                if q is not None:
                    row.set_y(q - 0.5)
            h["title"].set_text((self._heading() or "all heads") + "  (rows: queries, columns: keys)")
            return h["fig"]
        else:
            h["im"].set_data(w)
            h["title"].set_text(self._heading() or "attention weights")
            if q is not None:
                h["row"].set_y(q - 0.5)
                top = self.top_keys(q)[::-1]  # largest at the top
                values = [v for _, _, v in top]
                hi = max(1e-12, max(values))
                for bar, text, i, (j, tok, v) in zip(h["bars"], h["bar_texts"], range(len(top)), top):
                    bar.set_width(v)
                    text.set_position((0.02 * hi, i))
                    text.set_text(f"{j}: {tok}  {v:.3f}")  # position and token: tokens repeat, numbers look alike
                h["bar_ax"].set_xlim(min(0.0, min(values)), hi * 1.05)
                h["bar_title"].set_text(f"top keys of query {q} {self.query_tokens[q]!r}")
        h["im"].set_cmap(cmap)
        h["im"].set_clim(vmin, vmax)
        return h["fig"]
