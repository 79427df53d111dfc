"""SelectionExplorer: learned block selection against lesson 08's fixed window, at the same k.

An indexer scores every (query block, key block) of one attention layer; each query block keeps
its ``topk`` best key blocks (``attnlab.sparse.select_blocks``) and attention reads only those. A
fixed local window keeps the ``topk`` most recent blocks whatever the content. Both read the same
number of blocks, so they move the same bytes; what differs is how much of the dense softmax's
mass they keep. Move ``topk``, the query block and the head and the widget shows, from the
library's own functions:

* the indexer's block scores, with the selected tiles outlined (blue) and the window's (orange);
* for the chosen query block, the dense attention mass of each key block, and which blocks each
  rule keeps;
* the mass kept against ``topk`` for both rules (``attnlab.sparse.attention_mass_kept``), and
  the forward bytes of ``attnlab.kernels.selected_attention`` for each selection beside dense
  FlashAttention's (``attnlab.iomodel``).
"""

import ipywidgets as widgets
import numpy as np
import torch

from attnlab.measure import format_bytes
from attnlab.widgets._base import FigureWidget, html_table, new_figure, text_panel

__all__ = ["SelectionExplorer", "window_block_indices", "own_qk_block_scores"]

_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


def window_block_indices(n, topk, block_size, *, heads=1):
    """Lesson 08's local window as a selection: the ``topk`` most recent key blocks of every query block.

    The tiles of ``attnlab.kernels.local_mask(n, n, window=(topk - 1) * block_size)`` (the
    BlockMaskEditor's ``local`` preset), kept causal: key blocks ``i - topk + 1 .. i`` of query
    block ``i``. Returns int32 ``block_indices`` (1, heads, ceil(n / block_size), topk), -1 padded,
    for ``attnlab.kernels.selected_attention``: the window read whole tile by whole tile, so it
    costs exactly what any selection of ``topk`` blocks costs.

    Example: ``window_block_indices(128, 3, 16)[0, 0, 5].tolist()  # [3, 4, 5]``
    """
    from attnlab import kernels
    from attnlab.sparse import select_blocks

    tiles = kernels.local_mask(n, n, window=(topk - 1) * block_size, block_size=(block_size, block_size)).mask[0, 0]
    scores = torch.zeros(tiles.shape).masked_fill(~tiles, float("-inf"))   # (nqb, nkb): only the band can win
    return select_blocks(scores[None], topk)[:, None].expand(1, heads, *scores.shape[:1], topk).contiguous()


def own_qk_block_scores(q, k, block_size):
    """The indexer this course can run on a trained model that has none: each head's own q and k.

    For head h, ``attnlab.sparse.indexer_block_scores(q[:, h:h+1], k[:, h])``: DSA's lightning
    indexer with one indexer head whose query and key are the layer's own (ReLU of q.k, max over a
    key block, mean over a query block). A trained indexer is a few cheap heads taught (by a KL
    loss) to imitate the layer's attention; this one *is* the layer's logits, so it shows what a
    well-trained indexer could reach, not what a cheap one does. q, k: (B, H, N, d) ->
    (B, H, n_q_blocks, n_k_blocks).

    Example: ``own_qk_block_scores(torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16), 16).shape  # (1, 2, 4, 4)``
    """
    from attnlab.sparse import indexer_block_scores

    return torch.stack([indexer_block_scores(q[:, h:h + 1], k[:, h], block_size=block_size)
                        for h in range(q.shape[1])], dim=1)


def _as_4d(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor (heads, seq, head_dim), got {type(x).__name__}")
    if x.dim() == 3:
        x = x[None]
    if x.dim() != 4 or x.shape[0] != 1:
        raise ValueError(f"{name}: expected shape (heads, seq, head_dim) or (1, heads, seq, head_dim), "
                         f"got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating tensor, got {x.dtype}")
    return x.detach().float().cpu()


class SelectionExplorer(FigureWidget):
    """Top-k block selection by an indexer against a fixed window of the same k, on one layer's q and k.

    q, k: (heads, N, d) or (1, heads, N, d), one sequence of one layer (causal). ``block_size``: a
    power of two >= 16 (the kernel's tile). ``block_scores``: the indexer's scores, (heads,
    n_q_blocks, n_k_blocks) or with a leading 1; None: :func:`own_qk_block_scores`.
    ``dtype`` sets the bytes per element of the byte counts. Controls: ``topk``, ``query_block``,
    ``head``. State: ``selected`` and ``window`` (int32 block_indices of the head shown,
    (1, 1, n_q_blocks, topk)), ``stats`` (blocks read by the query block, mass kept by it and over
    all queries, forward bytes, for ``"selected"`` and ``"window"``, and dense bytes),
    ``mass_curves`` (mass kept over all queries for every k).

    Example: ``SelectionExplorer(q[0], k[0], block_size=16, topk=2)``
    """

    def __init__(self, q, k, *, block_size=16, block_scores=None, topk=2, query_block=None, head=0,
                 dtype="float32"):
        from attnlab.attention import scaled_dot_product_attention
        from attnlab.sparse import n_blocks

        self.q, self.k = _as_4d(q, "q"), _as_4d(k, "k")
        if self.k.shape != self.q.shape:
            raise ValueError(f"k: expected the shape of q {tuple(self.q.shape)} (self-attention, one KV head per "
                             f"head), got {tuple(self.k.shape)}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16 or \
                block_size & (block_size - 1):
            raise ValueError(f"block_size: expected a power of two >= 16 (the kernel's tile), got {block_size!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(_DTYPES)}, got {dtype!r}")
        self.block_size, self.dtype = block_size, dtype
        _, self.heads, self.n, self.d = self.q.shape
        self.nqb = n_blocks(self.n, block_size)
        if self.nqb < 2:
            raise ValueError(f"q: expected at least 2 blocks of {block_size} positions, got seq {self.n}")
        if block_scores is None:
            block_scores = own_qk_block_scores(self.q, self.k, block_size)
        else:
            if not isinstance(block_scores, torch.Tensor):
                raise TypeError(f"block_scores: expected a torch.Tensor, got {type(block_scores).__name__}")
            block_scores = block_scores.detach().float().cpu()
            block_scores = block_scores[None] if block_scores.dim() == 3 else block_scores
            if tuple(block_scores.shape) != (1, self.heads, self.nqb, self.nqb):
                raise ValueError(f"block_scores: expected shape ({self.heads}, {self.nqb}, {self.nqb}) (heads, "
                                 f"query blocks, key blocks), got {tuple(block_scores.shape)}")
        self.block_scores = block_scores                                  # (1, H, nqb, nkb)
        # dense causal attention of every head: the mass each key block holds for each query
        _, p = scaled_dot_product_attention(self.q, self.k, self.k, causal=True, return_weights=True)  # (1, H, N, N)
        pad = self.nqb * block_size - self.n
        p = torch.nn.functional.pad(p, (0, pad))                           # (1, H, N, nkb * bs)
        self._key_block_mass = p.view(1, self.heads, self.n, self.nqb, block_size).sum(-1)[0]  # (H, N, nkb)
        self._curves = {}

        style = {"description_width": "initial"}
        self.topk = widgets.IntSlider(value=1, min=1, max=self.nqb, description="k (key blocks kept)", style=style,
                                      continuous_update=False)
        self.query_block = widgets.IntSlider(value=self.nqb - 1, min=0, max=self.nqb - 1, description="query block",
                                             style=style, continuous_update=False)
        self.head = widgets.Dropdown(options=list(range(self.heads)), value=0, description="head", style=style,
                                     layout=widgets.Layout(width="140px"))
        self.stats_html = text_panel()
        # initial values: set before the observers and the picture exist, so nothing redraws yet
        self.topk.value = self._int(topk, "topk", 1, self.nqb)
        self.query_block.value = self._int(self.nqb - 1 if query_block is None else query_block, "query_block",
                                           0, self.nqb - 1)
        self.head.value = self._int(head, "head", 0, self.heads - 1)
        for c in (self.topk, self.query_block, self.head):
            c.observe(self.redraw, names="value")
        self._build([widgets.HBox([self.topk, self.query_block, self.head],
                                  layout=widgets.Layout(flex_flow="row wrap"))], [self.stats_html])

    @staticmethod
    def _int(value, name, lo, hi):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value}")
        return int(value)

    # ---------------------------------------------------------------- state
    def _selection(self, head, topk):
        from attnlab.sparse import select_blocks

        return select_blocks(self.block_scores[:, head:head + 1], topk)         # (1, 1, nqb, topk)

    def _window(self, topk):
        return window_block_indices(self.n, topk, self.block_size)              # (1, 1, nqb, topk)

    def _mass(self, head, block_indices):
        """Mass kept by every query of ``head``: (N,) (``attnlab.sparse.attention_mass_kept``)."""
        from attnlab.sparse import attention_mass_kept

        h = slice(head, head + 1)
        return attention_mass_kept(self.q[:, h], self.k[:, h], block_indices, block_size=self.block_size)[0, 0]

    @property
    def selected(self):
        """The indexer's top-k block_indices for the head shown: int32 (1, 1, n_q_blocks, topk)."""
        return self._selection(self.head.value, self.topk.value)

    @property
    def window(self):
        """The window's block_indices at the same k: int32 (1, 1, n_q_blocks, topk)."""
        return self._window(self.topk.value)

    @property
    def mass_curves(self):
        """Mean mass kept over all queries of the head shown, for k = 1 .. n_k_blocks: ``{"selected": [...],
        "window": [...]}``."""
        h = self.head.value
        if h not in self._curves:
            self._curves[h] = {
                "selected": [float(self._mass(h, self._selection(h, t)).mean()) for t in range(1, self.nqb + 1)],
                "window": [float(self._mass(h, self._window(t)).mean()) for t in range(1, self.nqb + 1)],
            }
        return self._curves[h]

    @property
    def stats(self):
        """What the panel prints, from the library: for ``"selected"`` and ``"window"``, the key blocks the query
        block reads, the mass they keep for its queries (mean) and for all queries of the head (mean), and the
        forward HBM bytes of ``selected_attention`` for this head (``iomodel.selected_attention_forward_io``);
        ``"dense_bytes"``: causal FlashAttention at the same tiles (``iomodel.flash_forward_io``)."""
        from attnlab import iomodel

        h, i, bs, e = self.head.value, self.query_block.value, self.block_size, _DTYPES[self.dtype]
        rows = slice(i * bs, min((i + 1) * bs, self.n))
        out = {}
        for name, bi in (("selected", self.selected), ("window", self.window)):
            mass = self._mass(h, bi)                                            # (N,)
            io = iomodel.selected_attention_forward_io(1, 1, self.n, d=self.d, bytes_per_element=e,
                                                       block_indices=bi, block_size=bs)
            out[name] = {"blocks": [b for b in bi[0, 0, i].tolist() if b >= 0],
                         "mass_block": float(mass[rows].mean()), "mass": float(mass.mean()),
                         "bytes": io.total_bytes}
        out["dense_bytes"] = iomodel.flash_forward_io(1, 1, self.n, d=self.d, bytes_per_element=e, block_m=bs,
                                                      block_n=bs, causal=True).total_bytes
        return out

    def _update_state(self):
        s = self.stats
        k, i = self.topk.value, self.query_block.value
        rows = [[name, ", ".join(map(str, s[name]["blocks"])), f"{s[name]['mass_block']:.3f}", f"{s[name]['mass']:.3f}",
                 format_bytes(s[name]["bytes"]), f"{s[name]['bytes'] / s['dense_bytes']:.2f}"]
                for name in ("selected", "window")]
        rows.append(["dense (causal)", f"0-{i}", "1.000", "1.000", format_bytes(s["dense_bytes"]), "1.00"])
        self.stats_html.value = (
            f"<b>k = {k}</b> of {self.nqb} key blocks of {self.block_size}, query block {i}, head {self.head.value}, "
            f"N={self.n}, d={self.d}, {self.dtype}<br>"
            + html_table(["", "key blocks read", f"mass kept, block {i}", "mass kept, all queries",
                          "forward bytes", "vs dense"], rows, numeric=(2, 3, 4, 5))
            + "<small>mass: attnlab.sparse.attention_mass_kept; bytes: attnlab.iomodel."
              "selected_attention_forward_io (one head), flash_forward_io (causal)</small>"
        )

    # ---------------------------------------------------------------- drawing
    def to_figure(self):
        from matplotlib.patches import Rectangle

        h, i, k = self.head.value, self.query_block.value, self.topk.value
        s = self.stats
        sel, win = set(s["selected"]["blocks"]), set(s["window"]["blocks"])
        fig = new_figure(11, 3.5)
        ax_s, ax_m, ax_c = fig.subplots(1, 3, width_ratios=[1, 1.15, 1])
        scores = self.block_scores[0, h].numpy().copy()
        scores[~np.isfinite(scores)] = np.nan                                   # future blocks: blank
        ax_s.imshow(scores, cmap="viridis", interpolation="nearest", extent=(0, self.nqb, self.nqb, 0))
        chosen, window = self.selected[0, 0].tolist(), self.window[0, 0].tolist()
        wx, wy = zip(*[(b + 0.5, row + 0.5) for row in range(self.nqb) for b in window[row] if b >= 0])
        cx, cy = zip(*[(b + 0.5, row + 0.5) for row in range(self.nqb) for b in chosen[row] if b >= 0])
        ax_s.scatter(wx, wy, s=150, marker="s", facecolors="none", edgecolors="tab:orange", linewidths=1.6)
        ax_s.scatter(cx, cy, s=28, marker="o", color="tab:blue", edgecolors="white", linewidths=0.6)
        ax_s.add_patch(Rectangle((0, i), self.nqb, 1, fill=False, ec="red", lw=1.5, ls="--"))
        ax_s.set(xlabel="key block", ylabel="query block")
        ax_s.set_title(f"indexer block scores, head {h}\nblue dots: top-{k}; orange squares: window of {k}",
                       fontsize=9)
        ticks = np.arange(self.nqb) + 0.5
        ax_s.set_xticks(ticks, [str(j) for j in range(self.nqb)], fontsize=7)
        ax_s.set_yticks(ticks, [str(j) for j in range(self.nqb)], fontsize=7)

        rows = slice(i * self.block_size, min((i + 1) * self.block_size, self.n))
        mass = self._key_block_mass[h, rows].mean(0).numpy()                    # (nkb,) mean over the block's queries
        cols = ["tab:blue" if j in sel else "0.8" for j in range(self.nqb)]
        ax_m.bar(np.arange(self.nqb), mass, color=cols, edgecolor=["tab:orange" if j in win else "none"
                                                                    for j in range(self.nqb)], linewidth=2)
        ax_m.set(xlabel="key block", ylabel="dense attention mass", xlim=(-0.6, self.nqb - 0.4))
        ax_m.set_xticks(np.arange(self.nqb))
        ax_m.tick_params(labelsize=7)
        ax_m.set_title(f"query block {i}: mass per key block; kept by\ntop-{k} {s['selected']['mass_block']:.3f} "
                       f"(blue bars), window {s['window']['mass_block']:.3f} (orange edges)", fontsize=9)

        curves = self.mass_curves
        ks = np.arange(1, self.nqb + 1)
        ax_c.plot(ks, curves["selected"], "o-", color="tab:blue", ms=3, label="indexer top-k")
        ax_c.plot(ks, curves["window"], "s--", color="tab:orange", ms=3, label="window of k blocks")
        ax_c.axvline(k, color="red", lw=0.8, ls=":")
        ax_c.set(xlabel="k (key blocks per query block)", ylabel="mass kept, all queries (mean)", ylim=(0, 1.02))
        ax_c.set_title(f"mass kept against k; at k = {k} both read\n{format_bytes(s['selected']['bytes'])}, "
                       f"{s['selected']['bytes'] / s['dense_bytes']:.2f} of dense's bytes", fontsize=9)
        ax_c.legend(fontsize=7, loc="lower right")
        ax_c.tick_params(labelsize=7)
        return fig
