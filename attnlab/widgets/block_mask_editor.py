"""BlockMaskEditor: draw a block-sparsity pattern by clicking blocks, see what it saves.

Each button is one (query block, key block) tile of the attention matrix: on means
the block-sparse kernel computes that tile, off means it skips it (never loads the
K and V blocks for it). Presets fill in the usual patterns (local window,
strided, global tokens, causal, random), built with the kernels' own mask
helpers. The editor shows the density, the element mask the block mask implies,
and the FLOPs and HBM bytes of block-sparse attention with this mask against dense
FlashAttention, from ``attnlab.iomodel``. ``.block_mask`` is the ``BlockMask``
to pass to ``attnlab.kernels.block_sparse_attention``.
"""

import ipywidgets as widgets
import numpy as np

from attnlab.measure import format_bytes
from attnlab.widgets._base import FigureWidget, html_table, new_figure, text_panel

PRESETS = ("custom", "local", "strided", "global", "causal", "random", "dense", "empty")
_MAX_BLOCKS = 32
BLOCK_SIZES = (16, 32, 64, 128)  # what attnlab.kernels' BlockMask accepts  # a grid of more buttons than 32 x 32 is unusable in a notebook


def _positive_int(value, name, hi=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1 or (hi is not None and value > hi):
        raise ValueError(f"{name}: expected an int in [1, {hi}], got {value}" if hi else f"{name}: expected >= 1, got {value}")
    return int(value)


def _fmt_flops(n):
    for unit, f in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n:.0f} FLOP"


class BlockMaskEditor(FigureWidget):
    """Edit a block mask of ``n_q_blocks`` x ``n_k_blocks`` tiles by clicking, or from a preset.

    ``block_size``: ``(BQ, BK)`` elements per tile; ``head_dim`` and ``dtype``
    (``"float16"`` or ``"float32"``): the shape the costs are computed for,
    sequence lengths ``n_q_blocks * BQ`` and ``n_k_blocks * BK``.

    Controls: ``buttons[i][j]`` (a ToggleButton per tile), ``preset``,
    ``param`` (window of ``local``, stride of ``strided``, number of global
    blocks of ``global``), ``density_target`` and ``seed`` (``random``).
    ``mask`` is the current boolean ``(n_q_blocks, n_k_blocks)`` array,
    ``density`` its fraction of kept tiles, ``costs`` the FLOPs and HBM bytes,
    ``block_mask`` the kernels' ``BlockMask``.

    Example: ``BlockMaskEditor(8, 8, block_size=(64, 64))``
    """

    def __init__(self, n_q_blocks, n_k_blocks, *, block_size=(64, 64), head_dim=64, dtype="float16", preset="local"):
        self.n_q_blocks = _positive_int(n_q_blocks, "n_q_blocks", _MAX_BLOCKS)
        self.n_k_blocks = _positive_int(n_k_blocks, "n_k_blocks", _MAX_BLOCKS)
        if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
            raise TypeError(f"block_size: expected a pair (BQ, BK), got {block_size!r}")
        self.block_size = (_positive_int(block_size[0], "block_size[0]"), _positive_int(block_size[1], "block_size[1]"))
        if not all(b in BLOCK_SIZES for b in self.block_size):
            raise ValueError(f"block_size: the kernels take blocks of {BLOCK_SIZES} elements, got {self.block_size}")
        self.head_dim = _positive_int(head_dim, "head_dim")
        if dtype not in ("float16", "float32", "bfloat16"):
            raise ValueError(f"dtype: expected 'float16', 'bfloat16' or 'float32', got {dtype!r}")
        self.dtype = dtype
        if preset not in PRESETS:
            raise ValueError(f"preset: expected one of {PRESETS}, got {preset!r}")
        self.n_q, self.n_k = self.n_q_blocks * self.block_size[0], self.n_k_blocks * self.block_size[1]
        self._applying = False

        style = {"description_width": "initial"}
        cell = widgets.Layout(width="26px", height="22px", padding="0", margin="1px")
        self.buttons = [
            [widgets.ToggleButton(value=False, layout=cell, tooltip=f"query block {i}, key block {j}")
             for j in range(self.n_k_blocks)]
            for i in range(self.n_q_blocks)
        ]
        for row in self.buttons:
            for b in row:
                b.observe(self._on_toggle, names="value")
        grid = widgets.GridBox(
            [b for row in self.buttons for b in row],
            layout=widgets.Layout(grid_template_columns=f"repeat({self.n_k_blocks}, 28px)", grid_gap="0px"),
        )
        self.preset = widgets.Dropdown(options=PRESETS, value="custom", description="preset", style=style)
        n = max(self.n_q_blocks, self.n_k_blocks)
        wide = widgets.Layout(width="440px", max_width="100%")  # the whole track visible beside its label
        self.param = widgets.IntSlider(value=min(2, n), min=1, max=n, description="window / stride / globals",
                                       style=style, continuous_update=False, layout=wide)
        self.density_target = widgets.FloatSlider(value=0.3, min=0.0, max=1.0, step=0.05, description="random density",
                                                  style=style, continuous_update=False, layout=wide)
        self.seed = widgets.BoundedIntText(value=0, min=0, max=2**31 - 1, description="seed", style=style,
                                           layout=widgets.Layout(width="140px"))
        for c in (self.preset, self.param, self.density_target, self.seed):
            c.observe(self._on_preset, names="value")
        self.preset.observe(self._enable_parameters, names="value")
        self.stats_html = text_panel()
        controls = widgets.VBox([self.preset, self.param, self.density_target, self.seed, self.stats_html],
                                layout=widgets.Layout(min_width="300px", flex="1 1 360px"))
        head = widgets.HTML("<b>click tiles</b> (rows: query blocks, columns: key blocks)")
        # side by side on a wide screen, the controls below the tiles on a narrow one
        self._build([widgets.HBox([widgets.VBox([head, grid], layout=widgets.Layout(flex="0 0 auto")), controls],
                                  layout=widgets.Layout(flex_flow="row wrap", grid_gap="4px 16px"))])
        self._enable_parameters()
        if preset != "custom":
            self.preset.value = preset

    # which preset each parameter control shapes; the others grey it out (a slider that did nothing, silently,
    # was the alternative): clicking tiles leaves "custom", where none applies
    PARAMETERS = {"param": ("local", "strided", "global"), "density_target": ("random",), "seed": ("random",)}

    def _enable_parameters(self, *_):
        for name, presets in self.PARAMETERS.items():
            control = getattr(self, name)
            control.disabled = self.preset.value not in presets
            control.tooltip = (None if not control.disabled else
                               f"used by the preset{'s' if len(presets) > 1 else ''} {', '.join(presets)}: pick one above")

    # ---------------------------------------------------------------- state
    @property
    def mask(self):
        """The block mask being edited: bool ``(n_q_blocks, n_k_blocks)``."""
        return np.array([[b.value for b in row] for row in self.buttons], dtype=bool)

    def set_mask(self, mask):
        """Set every tile from a bool ``(n_q_blocks, n_k_blocks)`` array-like (one redraw)."""
        m = np.asarray(mask.detach().cpu() if hasattr(mask, "detach") else mask).astype(bool)
        m = m.reshape(m.shape[-2:]) if m.ndim > 2 and all(s == 1 for s in m.shape[:-2]) else m
        if m.shape != (self.n_q_blocks, self.n_k_blocks):
            raise ValueError(f"mask: expected shape ({self.n_q_blocks}, {self.n_k_blocks}), got {tuple(m.shape)}")
        self._applying = True
        try:
            with self._one_redraw():
                for i, row in enumerate(self.buttons):
                    for j, b in enumerate(row):
                        b.value = bool(m[i, j])
        finally:
            self._applying = False

    @property
    def density(self):
        """Fraction of tiles kept."""
        return float(self.mask.mean())

    def _preset_mask(self, name):
        from attnlab.widgets import _masks

        return _masks.preset(name, self.n_q_blocks, self.n_k_blocks, self.block_size, self.param.value,
                             self.density_target.value, self.seed.value)

    def _on_preset(self, change):
        if self.preset.value == "custom":
            return
        self.set_mask(self._preset_mask(self.preset.value))

    def _on_toggle(self, change):
        change["owner"].button_style = "info" if change["new"] else ""  # kept tiles show in colour
        if self._applying:
            return
        if self.preset.value != "custom":
            self.preset.unobserve(self._on_preset, names="value")
            self.preset.value = "custom"
            self.preset.observe(self._on_preset, names="value")
        self.redraw()

    @property
    def block_mask(self):
        """The kernels' ``BlockMask`` for this pattern (mask ``(1, 1, n_q_blocks, n_k_blocks)``)."""
        from attnlab.widgets import _masks

        return _masks.to_block_mask(self.mask, self.block_size)

    def element_mask(self):
        """The element mask the block mask implies: bool ``(n_q, n_k)`` numpy array (``BlockMask.to_element_mask``)."""
        em = self.block_mask.to_element_mask(self.n_q, self.n_k)
        return em.reshape(em.shape[-2:]).numpy().astype(bool)

    @property
    def costs(self):
        """FLOPs and HBM bytes of the forward pass, block-sparse with this mask and dense (``attnlab.iomodel``)."""
        from attnlab.widgets import _masks

        return _masks.costs(self.mask, self.block_size, self.head_dim, self.dtype)

    def _update_state(self):
        c = self.costs
        sp, de = c["sparse"], c["dense"]
        self.stats_html.value = (
            f"<b>density {self.density:.3f}</b> ({int(self.mask.sum())} of {self.mask.size} tiles), "
            f"N<sub>q</sub>={self.n_q}, N<sub>k</sub>={self.n_k}, d={self.head_dim}, {self.dtype}<br>"
            + html_table(["", "block-sparse", "dense", "ratio"], [
                ["FLOPs", _fmt_flops(sp["flops"]), _fmt_flops(de["flops"]), f"{sp['flops'] / de['flops']:.3f}"],
                ["HBM bytes", format_bytes(sp["bytes"]), format_bytes(de["bytes"]), f"{sp['bytes'] / de['bytes']:.3f}"],
                ["standard (unfused) bytes", "", format_bytes(c["standard"]["bytes"]), ""],
            ], numeric=(1, 2, 3))
            + f"<small>{c['source']}</small>"
        )

    # ---------------------------------------------------------------- drawing
    def _make_figure(self):
        fig = new_figure(10, 3.6)
        ax_b, ax_e, ax_c = fig.subplots(1, 3, width_ratios=[1, 1, 0.9])
        h = {"fig": fig, "axes": (ax_b, ax_e, ax_c)}
        h["blocks"] = ax_b.imshow(np.zeros((self.n_q_blocks, self.n_k_blocks)), cmap="Blues", vmin=0, vmax=1.25,
                                  interpolation="nearest", extent=(0, self.n_k_blocks, self.n_q_blocks, 0))
        h["grid"] = [ax_b.hlines(np.arange(self.n_q_blocks + 1), 0, self.n_k_blocks, color="white", lw=0.8),
                     ax_b.vlines(np.arange(self.n_k_blocks + 1), 0, self.n_q_blocks, color="white", lw=0.8)]
        ax_b.set_xticks(np.arange(self.n_k_blocks) + 0.5, [str(j) for j in range(self.n_k_blocks)], fontsize=8)
        ax_b.set_yticks(np.arange(self.n_q_blocks) + 0.5, [str(i) for i in range(self.n_q_blocks)], fontsize=8)
        ax_b.set_xlabel("key block")
        ax_b.set_ylabel("query block")
        h["blocks_title"] = ax_b.set_title("", fontsize=10)
        h["elements"] = ax_e.imshow(np.zeros((self.n_q, self.n_k)), cmap="Greys", vmin=0, vmax=1.6,
                                    interpolation="nearest", extent=(0, self.n_k, self.n_q, 0))
        ax_e.set_xlabel("key")
        ax_e.set_ylabel("query")
        ax_e.set_title(f"element mask ({self.n_q} x {self.n_k})", fontsize=10)
        h["bars"] = ax_c.bar([0, 1, 3, 4], [1, 1, 1, 1], color=["tab:blue", "0.7", "tab:orange", "0.7"])
        ax_c.set_xticks([0, 1, 3, 4], ["sparse\nFLOPs", "dense\nFLOPs", "sparse\nbytes", "dense\nbytes"], fontsize=8)
        ax_c.set_ylim(0, 1.18)
        ax_c.set_ylabel("fraction of dense")
        h["bar_labels"] = [ax_c.text(x, 0, "", ha="center", va="bottom", fontsize=8) for x in (0, 1, 3, 4)]
        h["cost_title"] = ax_c.set_title("forward cost vs dense (iomodel)", fontsize=10)
        h["dynamic"] = [h["blocks"], *h["grid"], h["blocks_title"], h["elements"], *h["bars"], *h["bar_labels"]]  # blitted
        return h

    def _update_figure(self, h):
        m = self.mask
        h["blocks"].set_data(m.astype(float))
        h["blocks_title"].set_text(f"block mask, density {m.mean():.2f}")
        h["elements"].set_data(self.element_mask().astype(float))
        c = self.costs
        values = [c["sparse"]["flops"] / c["dense"]["flops"], 1.0, c["sparse"]["bytes"] / c["dense"]["bytes"], 1.0]
        for bar, label, v in zip(h["bars"], h["bar_labels"], values):
            bar.set_height(v)
            label.set_position((label.get_position()[0], v))
            label.set_text(f"{v:.2f}")
        return h["fig"]
