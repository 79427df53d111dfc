"""The SRAM-size control of MemoryTraffic: block sizes from M, and the HBM traffic they cause.

FlashAttention (Dao et al., 2022, Algorithm 1) sizes its tiles from the on-chip memory
M (in elements): B_c = ceil(M / (4 d)) keys and B_r = min(B_c, d) queries per tile, so
that a Q tile, a K and a V tile and an O tile fit. K and V are read once per query tile,
N / B_r times, which gives Theorem 2's Theta(N^2 d^2 / M) HBM accesses.

Here: for a small shape (default N = 128, d = 64, float32; d >= 32 so that B_r = min(B_c, d)
can grow with M) the flash kernel is traced live with the block sizes each M gives (rounded
down to the powers of two >= 16 that the kernels take, and at most the sequence length); for
a large shape, ``attnlab.iomodel`` predicts the traffic. The plot labels which is which.
"""

import math
import time

import ipywidgets as widgets
import numpy as np

from attnlab.measure import format_bytes
from attnlab.widgets._base import blit_png, new_figure, show_png

SRAM_KIB = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)  # 192-256 KiB: an A100/H100 SM's shared memory + L1
LARGE = {"n": 4096, "d": 64, "dtype": "float16", "element_size": 2}


def _pow2_floor(x):
    return 1 << max(0, int(math.floor(math.log2(max(1, x)))))


def block_sizes(sram_bytes, head_dim, element_size, n_q, n_k):
    """(B_r, B_c) the kernels can run for an SRAM of `sram_bytes`: Algorithm 1's sizes
    (``attnlab.iomodel.flash_block_sizes``), rounded down to powers of two in [16, 128] and at
    most the (power-of-two-rounded-up) sequence lengths.

    Example: ``block_sizes(64 * 1024, 64, 2, 4096, 4096)`` -> ``(64, 128)``
    """
    from attnlab.iomodel import flash_block_sizes

    b_r, b_c = flash_block_sizes(int(sram_bytes), head_dim, element_size)

    def fit(b, n):
        return int(min(max(_pow2_floor(b), 16), 128, max(16, 1 << math.ceil(math.log2(n)))))

    return fit(b_r, n_q), fit(b_c, n_k)


class SramStudy:
    """The SRAM slider and its plot; built by ``MemoryTraffic`` from the traced shape."""

    def __init__(self, n=128, d=64):
        import torch

        from attnlab.kernels import flash_attention, standard_attention
        from attnlab.memory import trace

        element_size = 4  # float32: what the interpreter runs on a CPU
        self.q_shape = (1, 1, n, d)
        self.d, self.n_q, self.n_k, self.element_size = d, n, n, element_size
        n_q = n_k = n
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(self.q_shape, generator=g) for _ in range(3))
        # live traces of the real kernels: one per distinct pair of block sizes
        self.live_blocks = {m: block_sizes(m * 1024, d, element_size, n_q, n_k) for m in SRAM_KIB}
        self.live_bytes = {}
        for blocks in sorted(set(self.live_blocks.values())):
            tr = trace(flash_attention, q, k, v, block_m=blocks[0], block_n=blocks[1])
            self.live_bytes[blocks] = tr.total_bytes
        self.live_standard = trace(standard_attention, q, k, v).total_bytes
        # the large shape, from the IO model, with the paper's exact block sizes
        from attnlab.iomodel import flash_block_sizes, flash_forward_io, standard_forward_io

        n, dl, es = LARGE["n"], LARGE["d"], LARGE["element_size"]
        self.large_blocks = {m: flash_block_sizes(m * 1024, dl, es) for m in SRAM_KIB}
        self.large_bytes = {m: flash_forward_io(1, 1, n, n, dl, es, sram_bytes=m * 1024).total_bytes for m in SRAM_KIB}
        self.large_standard = standard_forward_io(1, 1, n, n, dl, es).total_bytes
        self.large_source = "attnlab.iomodel.flash_forward_io (paper's block sizes, not rounded)"

        self.slider = widgets.SelectionSlider(
            options=[(f"{m} KiB", m) for m in SRAM_KIB], value=128 if 128 in SRAM_KIB else SRAM_KIB[-1],
            description="SRAM size M", style={"description_width": "initial"}, continuous_update=False,
            layout=widgets.Layout(width="420px", max_width="100%"),  # the whole track visible
        )
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%", height="auto",
                                                                      align_self="flex-start"))
        self.text = widgets.HTML()
        self.slider.observe(self.redraw, names="value")
        self._live = None
        self.box = widgets.VBox([widgets.HTML("<b>SRAM size and HBM traffic</b> (FlashAttention forward)"),
                                 self.slider, self.image, self.text])
        self.redraw()

    def tile_bytes(self, b_r, b_c):
        """On-chip bytes of Algorithm 1's tiles for these blocks: Q_i and O_i (B_r x d), K_j and V_j
        (B_c x d), at the traced element size; B_c = M / 4d makes them fit in M."""
        return (2 * b_r + 2 * b_c) * self.d * self.element_size

    def summary(self):
        """Numbers for the current M: block sizes and bytes, live (traced shape) and iomodel (large shape)."""
        m = self.slider.value
        blocks = self.live_blocks[m]
        return {
            "sram_kib": m,
            "live_blocks": blocks, "live_bytes": self.live_bytes[blocks], "live_standard_bytes": self.live_standard,
            "large_blocks": self.large_blocks[m], "large_bytes": self.large_bytes[m],
            "large_standard_bytes": self.large_standard,
        }

    def to_figure(self, fig=None):
        """The SRAM plot as a Figure (or drawn into `fig`, a Figure or SubFigure)."""
        h = self._draw(new_figure(10, 3.2) if fig is None else fig)
        self._update(h)
        return h["fig"]

    def _draw(self, fig):
        """The curves (they do not depend on M); the markers and the title are set by ``_update``."""
        ax_l, ax_r = fig.subplots(1, 2)
        x = np.array(SRAM_KIB)
        live = np.array([self.live_bytes[self.live_blocks[m]] for m in SRAM_KIB])
        ax_l.plot(x, live / 1024, "o-", color="tab:blue", label="flash (traced)")
        ax_l.axhline(self.live_standard / 1024, color="tab:red", ls="--", label="standard (traced)")
        (mark_l,) = ax_l.plot([], [], "o", ms=11, mfc="none", mec="k")
        b, h, n_q, d = self.q_shape
        ax_l.set_title(f"live traces: N={n_q}, d={d}, float32 (measured)", fontsize=10)
        # where FlashAttention moves MORE than standard attention: it reads K and V once per block
        # of B_r queries (2 N^2 d / B_r elements), standard attention writes and reads S and P
        # (about 4 N^2): flash loses while B_r < d / 2
        worse = [m for m in SRAM_KIB if self.live_bytes[self.live_blocks[m]] > self.live_standard]
        if worse:
            b_r = max(self.live_blocks[m][0] for m in worse)
            ax_l.axvspan(x[0] / 1.3, max(worse) * 1.3, color="tab:red", alpha=0.07, lw=0)
            ax_l.text(x[0], self.live_standard / 1024 * 0.55,
                      f"flash > standard while B_r <= {b_r}:\nK, V re-read N/B_r >= {n_q // b_r} times,\n"
                      f"2N\u00b2d/B_r > S, P's ~4N\u00b2", fontsize=7, va="top", color="tab:red")
        ax_l.set_ylabel("HBM bytes (KiB)")
        large = np.array([self.large_bytes[m] for m in SRAM_KIB])
        ax_r.plot(x, large / 2**20, "o-", color="tab:blue", label="flash (iomodel)")
        ax_r.axhline(self.large_standard / 2**20, color="tab:red", ls="--", label="standard (iomodel)")
        # Theorem 2's law, through the smallest M (it holds while B_r = B_c, i.e. M < 4 d^2 elements)
        law = large[0] * x[0] / x
        ax_r.plot(x, law / 2**20, ":", color="0.4", label="N^2 d^2 / M")
        (mark_r,) = ax_r.plot([], [], "o", ms=11, mfc="none", mec="k")
        ax_r.set_title(f"iomodel: N={LARGE['n']}, d={LARGE['d']}, {LARGE['dtype']} (predicted)", fontsize=10)
        ax_r.set_ylabel("HBM bytes (MiB)")
        ax_r.set_yscale("log")
        for ax in (ax_l, ax_r):
            ax.set_xscale("log", base=2)
            ax.set_xticks(x[::2], [str(v) for v in x[::2]])
            ax.minorticks_off()
            ax.set_xlabel("SRAM size M (KiB)")
            ax.legend(fontsize=7)
        ax_l.set_ylim(bottom=0)
        return {"fig": fig, "marks": (mark_l, mark_r), "title": fig.suptitle("", fontsize=10)}

    def _update(self, h):

        s = self.summary()
        h["marks"][0].set_data([s["sram_kib"]], [s["live_bytes"] / 1024])
        h["marks"][1].set_data([s["sram_kib"]], [s["large_bytes"] / 2**20])
        br, bc = s["live_blocks"]
        h["title"].set_text(
            f"SRAM study (what if M = {s['sram_kib']} KiB): B_r x B_c = {br} x {bc}, tiles Q, K, V, O = "
            f"{format_bytes(self.tile_bytes(br, bc))} <= M, traced {format_bytes(s['live_bytes'])}; large shape "
            f"{s['large_blocks'][0]} x {s['large_blocks'][1]} ({format_bytes(s['large_bytes'])})\n"
            f"(the traces above are separate: the kernels' default 128 x 128 blocks)")

    def redraw(self, *_):
        """Move the markers and retitle: the curves are drawn once, the rest is blitted over them."""

        t0 = time.perf_counter()
        first = self._live is None
        if first:
            self._live = self._draw(new_figure(10, 3.2))
        h = self._live
        self._update(h)
        fig = h["fig"]
        show_png(self.image, blit_png(fig, [*h["marks"], h["title"]], h, first))
        self.last_redraw_ms = 1000 * (time.perf_counter() - t0)
        s = self.summary()
        self.text.value = (
            f"<small>Block sizes from M as in FlashAttention's Algorithm 1 (B_c = M/(4d), B_r = min(B_c, d)), rounded "
            f"to the kernels' powers of two in [16, 128] and capped by the sequence length. Left: the real flash "
            f"kernel traced at N={self.n_q}, d={self.d}. Right: {self.large_source}. Standard attention does not depend on M "
            f"(traced: {format_bytes(s['live_standard_bytes'])}; model: {format_bytes(s['large_standard_bytes'])}). "
            f"At small M FlashAttention moves more than standard attention: it reads K and V once per block of B_r "
            f"queries (2N\u00b2d/B_r elements), more than standard's ~4N\u00b2 for S and P while B_r < d/2. "
            f"M is the study's what-if; the traces above use the default 128 x 128 blocks.</small>"
        )
