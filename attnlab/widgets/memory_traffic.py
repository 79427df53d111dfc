"""MemoryTraffic: play the HBM traffic of attention kernels, event by event, side by side.

A ``MemoryTrace`` (from ``attnlab.memory.trace``) lists every load and store a
kernel made, with the block of the tensor it touched. This widget replays one or
more traces: each tensor (Q, K, V, O, and S and P for standard attention) is a
grid of blocks in HBM, coloured by how often each element has been read (blue,
darker = read more often) and whether it has been written (orange); the event
just performed is outlined (blue: load, red: store); a panel lists what the
current program holds in SRAM; counters give the bytes read and written so far.

Below, a control for the SRAM size M re-derives FlashAttention's block sizes
(B_c = M / (4 d), B_r = min(B_c, d); Dao et al., 2022, Algorithm 1) and plots the
HBM traffic against M: measured from live traces of the real kernel for the
traced (small) shape, and from ``attnlab.iomodel`` for a large shape (labelled).
"""

import html
import math

import ipywidgets as widgets
import numpy as np
from matplotlib.patches import Rectangle

from attnlab.measure import format_bytes
from attnlab.widgets._base import FigureWidget, figure_png, html_table, new_figure, text_panel

# tensors in the order a reader expects: inputs, intermediates, outputs
_ORDER = ["Q", "K", "V", "S", "P", "O", "L", "dO", "dQ", "dK", "dV", "D"]
_UNTOUCHED = np.array([0.93, 0.93, 0.93])
_READ = np.array([0.12, 0.35, 0.75])
_WRITTEN = np.array([0.95, 0.55, 0.15])


def _grid_shape(shape):
    """(rows, cols) a tensor is drawn as: all leading dims stacked into rows (batch x heads x seq), last dim across."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return 1, 1
    return int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]


class _Replay:
    """One trace, prepared for fast replay: events as arrays, cumulative byte counters."""

    def __init__(self, trace, label, index):
        name = f"traces[{index}]"
        for attr in ("events", "tensors", "bytes_read", "bytes_written"):
            if not hasattr(trace, attr):
                raise TypeError(f"{name}: expected a MemoryTrace from attnlab.memory.trace, got {type(trace).__name__}")
        events = list(trace.events)
        if not events:
            raise ValueError(f"{name}: the trace has no events (did the traced function launch a kernel?)")
        self.trace, self.label = trace, label
        used = []
        for e in events:
            if e.tensor not in used:
                used.append(e.tensor)
        self.names = sorted(used, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), used.index(n)))
        self.grid = {}
        for n in self.names:
            if n not in trace.tensors:
                raise ValueError(f"{name}: event on tensor {n!r}, which is not in the trace's tensors")
            self.grid[n] = _grid_shape(trace.tensors[n].shape)
        tid = {n: i for i, n in enumerate(self.names)}
        prog_ids, self.program_keys = {}, []
        rows = []
        for i, e in enumerate(events):
            if e.op not in ("load", "store"):
                raise ValueError(f"{name}: event {i} has op {e.op!r}, expected 'load' or 'store'")
            key = (int(e.launch), tuple(e.program))
            if key not in prog_ids:
                prog_ids[key] = len(self.program_keys)
                self.program_keys.append(key)
            rows.append((tid[e.tensor], e.op == "load", int(e.nbytes), int(e.lead), *map(int, e.rows), *map(int, e.cols),
                         prog_ids[key]))
        a = np.array(rows, dtype=np.int64)  # (n_events, 9)
        self.tensor, self.is_load, self.nbytes, lead = a[:, 0], a[:, 1].astype(bool), a[:, 2], a[:, 3]
        self.r0, self.r1, self.c0, self.c1, self.prog = a[:, 4], a[:, 5], a[:, 6], a[:, 7], a[:, 8]
        # Rows in the stacked picture: lead * rows_per_lead + row. A kernel may view a tensor with other
        # leading dims than the one `tensors` describes (the softmax kernel sees P as (B*H*N, N), the PV
        # kernel as (B, H, N, N)), so a launch that uses more leads than the described shape has gets
        # rows_per_lead = the tensor's rows / the leads it used.
        launch = np.array([int(e.launch) for e in events])
        for i, n in enumerate(self.names):
            total_rows = self.grid[n][0]
            shape = tuple(trace.tensors[n].shape)
            described = shape[-2] if len(shape) >= 2 else 1  # rows per lead in the described view
            for la in np.unique(launch[self.tensor == i]):
                sel = (self.tensor == i) & (launch == la)
                n_leads = int(lead[sel].max()) + 1
                per_lead = described
                if n_leads * described > total_rows and total_rows % n_leads == 0:
                    per_lead = total_rows // n_leads
                self.r0[sel] += lead[sel] * per_lead
                self.r1[sel] += lead[sel] * per_lead
        self.n = len(events)
        self.cum_read = np.concatenate([[0], np.cumsum(np.where(self.is_load, self.nbytes, 0))])
        self.cum_written = np.concatenate([[0], np.cumsum(np.where(self.is_load, 0, self.nbytes))])
        # block boundaries seen per tensor, for the grid lines (none where they would be denser than 32)
        self.row_edges, self.col_edges = {}, {}
        for n, i in tid.items():
            sel = self.tensor == i
            re = np.unique(np.concatenate([self.r0[sel], self.r1[sel]]))
            ce = np.unique(np.concatenate([self.c0[sel], self.c1[sel]]))
            self.row_edges[n] = re if len(re) <= 33 else np.array([], np.int64)
            self.col_edges[n] = ce if len(ce) <= 33 else np.array([], np.int64)
        # a wide, flat tensor (the log-sum-exp L, one number per query row) is drawn standing up
        self.transposed = {n: self.grid[n][0] <= 4 and self.grid[n][1] > 4 * self.grid[n][0] for n in self.names}
        # darkest blue = the most reads any element gets in the whole trace
        self.max_reads = max(1, max(int(self.counts(n, self.n)[0].max()) for n in self.names))

    def counts(self, name, step):
        """(reads, writes) per element of tensor `name` (rows: leading dims stacked), after the first `step` events."""
        r, c = self.grid[name]
        reads, writes = np.zeros((r, c), np.int32), np.zeros((r, c), np.int32)
        i = self.names.index(name)
        sel = np.nonzero(self.tensor[:step] == i)[0]
        for j in sel:
            target = reads if self.is_load[j] else writes
            target[self.r0[j] : self.r1[j], self.c0[j] : self.c1[j]] += 1
        return reads, writes

    def image(self, name, step):
        reads, writes = self.counts(name, step)
        # read at least once: light blue; the most-read elements of the trace: dark blue
        level = np.where(reads > 0, 0.3 + 0.7 * np.log1p(reads) / np.log1p(self.max_reads), 0.0)[..., None]
        rgb = _UNTOUCHED + level * (_READ - _UNTOUCHED)
        rgb = np.where((writes > 0)[..., None], 0.75 * _WRITTEN + 0.25 * rgb, rgb)
        return np.clip(rgb, 0, 1)

    def sram(self, step):
        """What the program of the last event holds after `step` events: its latest tile of each tensor.

        -> (program key or None, [(tensor, op, rows, cols, nbytes), ...]); rows in the stacked picture.
        """
        if step <= 0:
            return None, []
        prog = self.prog[step - 1]
        idx = np.nonzero(self.prog[:step] == prog)[0]
        latest = {}
        for j in idx:
            latest[self.names[self.tensor[j]]] = j
        held = [
            (n, "load" if self.is_load[j] else "store", (int(self.r0[j]), int(self.r1[j])),
             (int(self.c0[j]), int(self.c1[j])), int(self.nbytes[j]))
            for n, j in sorted(latest.items(), key=lambda kv: kv[1])
        ]
        return self.program_keys[prog], held


class MemoryTraffic(FigureWidget):
    """Replay one or more memory traces side by side (one row each).

    ``traces``: ``MemoryTrace`` objects from ``attnlab.memory.trace`` (for
    example of standard, flash and block-sparse attention on the same shape).
    ``labels``: a name per trace (default "trace 0", ...). ``sram_study``: show
    the SRAM-size control and its plot below the replay; it traces the flash
    kernel at ``sram_shape = (N, d)`` once per block size when the widget is built
    (about a second for the default (128, 64)). ``to_figure()`` draws the replay;
    ``sram_study.to_figure()`` draws the SRAM plot.

    Controls: ``step`` (how many events have happened; the same step for every
    trace, clipped to each trace's length), ``play`` (a Play button driving
    ``step``) and ``sram_kib`` (SRAM size for the block-size study). A tensor's
    leading dims (batch x heads) are stacked in its picture, head after head.
    ``counters`` gives the bytes read and written so far per trace; at the last
    step they equal the trace's ``bytes_read`` and ``bytes_written``.

    Example: ``MemoryTraffic(trace(standard_attention, q, k, v), trace(flash_attention, q, k, v), labels=["standard", "flash"])``
    """

    def __init__(self, *traces, labels=None, sram_study=True, sram_shape=(128, 64)):
        if not traces:
            raise ValueError("traces: expected at least one MemoryTrace, got none")
        if labels is None:
            labels = [f"trace {i}" for i in range(len(traces))]
        if isinstance(labels, str) or len(labels) != len(traces):
            raise ValueError(f"labels: expected one label per trace ({len(traces)}), got {labels!r}")
        self.replays = [_Replay(t, str(lab), i) for i, (t, lab) in enumerate(zip(traces, labels))]
        # one colour scale for all rows, so that "read more often" compares across traces
        most = max(r.max_reads for r in self.replays)
        for r in self.replays:
            r.max_reads = most
        n_max = max(r.n for r in self.replays)
        style = {"description_width": "initial"}
        # redraws queue up in the kernel if values come faster than it draws: the slider sends on release,
        # and a full play is about 60 frames of 300 ms
        self.step = widgets.IntSlider(value=n_max, min=0, max=n_max, description="events done", style=style,
                                      layout=widgets.Layout(width="480px", max_width="100%"), continuous_update=False)
        self.play = widgets.Play(value=n_max, min=0, max=n_max, step=max(1, math.ceil(n_max / 60)), interval=300,
                                 description="play")
        widgets.jslink((self.play, "value"), (self.step, "value"))
        self.counters_html = text_panel()
        self.step.observe(self.redraw, names="value")
        top = [self.play, self.step]
        below = [self.counters_html]
        self.sram_study = None
        if sram_study:
            from attnlab.widgets._sram_study import SramStudy

            if not (isinstance(sram_shape, (tuple, list)) and len(sram_shape) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in sram_shape)):
                raise TypeError(f"sram_shape: expected a pair of ints (N, d), got {sram_shape!r}")
            if not (16 <= sram_shape[0] <= 512 and sram_shape[1] in (16, 32, 64, 128)):
                raise ValueError(f"sram_shape: expected N in [16, 512] (traced in the interpreter) and d in "
                                 f"16, 32, 64, 128 (the kernels' head dims), got {tuple(sram_shape)}")
            self.sram_study = SramStudy(*sram_shape)
            self.sram_kib = self.sram_study.slider
            # a secondary panel: folded away, so the replay alone fits a laptop screen (open it with a click,
            # or from code: traffic.sram_panel.selected_index = 0)
            self.sram_panel = widgets.Accordion(children=[self.sram_study.box], selected_index=None)
            self.sram_panel.set_title(0, "SRAM size and HBM traffic (FlashAttention forward): "
                                         "an SRAM-size slider, click to open")
            below += [self.sram_panel]
        self._build([widgets.HBox(top, layout=widgets.Layout(flex_flow="row wrap"))], below)  # wraps when narrow

    # ---------------------------------------------------------------- state
    def step_of(self, i):
        """The step trace `i` is drawn at (the shared step, clipped to its number of events)."""
        return min(self.step.value, self.replays[i].n)

    @property
    def counters(self):
        """Per trace: ``{"label", "step", "events", "bytes_read", "bytes_written", "total_read", "total_written"}``."""
        out = []
        for i, r in enumerate(self.replays):
            s = self.step_of(i)
            out.append({
                "label": r.label, "step": s, "events": r.n,
                "bytes_read": int(r.cum_read[s]), "bytes_written": int(r.cum_written[s]),
                "total_read": int(r.trace.bytes_read), "total_written": int(r.trace.bytes_written),
            })
        return out

    def sram_contents(self, i=0):
        """What the current program of trace `i` holds in SRAM: ``(program, [(tensor, op, rows, cols, nbytes)])``."""
        return self.replays[i].sram(self.step_of(i))

    def _update_state(self):
        rows = [[f"<b>{html.escape(c['label'])}</b>", f"{c['step']} / {c['events']}",
                 f"{format_bytes(c['bytes_read'])} / {format_bytes(c['total_read'])}",
                 f"{format_bytes(c['bytes_written'])} / {format_bytes(c['total_written'])}",
                 format_bytes(c["bytes_read"] + c["bytes_written"])] for c in self.counters]
        self.counters_html.value = html_table(
            # two-line headers: the table fits a notebook at 1024 px with the file browser open
            ["trace", "events", "HBM read<br><small>so far / total</small>",
             "HBM written<br><small>so far / total</small>", "traffic<br><small>so far</small>"], rows,
            numeric=(1, 2, 3, 4))

    # ---------------------------------------------------------------- drawing
    def to_figure(self):
        """The replay at the current step and, below it, the SRAM-size plot (when the widget has one)."""
        return self._update_figure(self._make_figure(with_sram=self.sram_study is not None))

    def _static_png(self):
        return figure_png(self.to_figure())  # the stored picture includes the SRAM plot

    def _make_figure(self, with_sram=False):
        n_tr = len(self.replays)
        height_each = 1.9  # three traces, the controls and the counters fit a 1280 x 800 screen
        fig = new_figure(10, height_each * n_tr + 0.3 + (3.4 if with_sram else 0))
        ratios = [height_each] * n_tr + ([3.4] if with_sram else [])
        subfigs = np.atleast_1d(fig.subfigures(len(ratios), 1, hspace=0.04, height_ratios=ratios))
        if with_sram:
            self.sram_study.to_figure(subfigs[-1])
            subfigs = subfigs[:-1]
        h = {"fig": fig, "rows": [], "dynamic": []}  # dynamic: what a step changes (blitted)
        layouts = []
        for r in self.replays:
            shown = {n: (r.grid[n][1], r.grid[n][0]) if r.transposed[n] else r.grid[n] for n in r.names}
            tallest = max(nr for nr, _ in shown.values())
            layouts.append((shown, [max(shown[n][1] / tallest, 0.2) for n in r.names]))
        # the same horizontal scale in every row: shorter rows get a blank spacer before the SRAM panel
        widest = max(sum(w) for _, w in layouts)
        for r, sub, (shown, widths) in zip(self.replays, subfigs, layouts):
            spacer = widest - sum(widths)
            ratios = [*widths] + ([spacer] if spacer > 1e-9 else []) + [0.55 * widest]
            axes = sub.subplots(1, len(ratios), width_ratios=ratios)
            if spacer > 1e-9:
                axes[-2].set_axis_off()
            row = {"images": {}, "boxes": {}}
            for n, ax in zip(r.names, axes):
                nr, nc = shown[n]
                row["images"][n] = ax.imshow(np.zeros((nr, nc, 3)), interpolation="nearest", aspect="auto",
                                             extent=(0, nc, nr, 0))
                re, ce = (r.col_edges[n], r.row_edges[n]) if r.transposed[n] else (r.row_edges[n], r.col_edges[n])
                row.setdefault("grid", []).extend(
                    [ax.hlines(re, 0, nc, color="white", lw=0.6), ax.vlines(ce, 0, nr, color="white", lw=0.6)])
                ax.set_xticks([])
                ax.set_yticks([])
                gr, gc = r.grid[n]
                ax.set_title(f"{n}\n{gr}x{gc}", fontsize=8)
                row["boxes"][n] = ax.add_patch(Rectangle((0, 0), 0, 0, fill=False, lw=2.2, visible=False))
            sax = axes[-1]
            sax.set_xticks([])
            sax.set_yticks([])
            sax.set_title("SRAM (current program)", fontsize=10)
            # sizes chosen to stay readable when the picture is shrunk to 74% (1024 px screen, side bar open)
            row["sram_text"] = sax.text(0.04, 0.96, "", va="top", ha="left", fontsize=9, family="monospace", linespacing=1.1,
                                        transform=sax.transAxes)
            row["header"] = sub.suptitle("", fontsize=11, x=0.01, ha="left")
            # blitted in this order: the pictures, the block grid over them, the outline, the texts
            h["dynamic"] += [*row["images"].values(), *row.get("grid", []), *row["boxes"].values(), row["sram_text"],
                             row["header"]]
            if not h["rows"]:
                sax.text(0.04, 0.03, "blue: read from HBM (darker: more often)\norange: written (brown: written, read back)\n"
                         "outline: last event (green load, red store)", fontsize=8, va="bottom",
                         transform=sax.transAxes, color="0.3")
            h["rows"].append(row)
        return h

    def _update_figure(self, h):
        for i, (r, row) in enumerate(zip(self.replays, h["rows"])):
            s = self.step_of(i)
            for n in r.names:
                img = r.image(n, s)
                row["images"][n].set_data(img.transpose(1, 0, 2) if r.transposed[n] else img)
                row["boxes"][n].set_visible(False)
            if s > 0:
                j = s - 1
                n = r.names[r.tensor[j]]
                box = row["boxes"][n]
                x0, x1, y0, y1 = r.c0[j], r.c1[j], r.r0[j], r.r1[j]
                if r.transposed[n]:
                    x0, x1, y0, y1 = y0, y1, x0, x1
                box.set_bounds(x0, y0, x1 - x0, y1 - y0)
                box.set_edgecolor("#00b000" if r.is_load[j] else "red")
                box.set_visible(True)
            prog, held = r.sram(s)
            if prog is None:
                text = "(nothing yet)"
            else:
                lines = [f"launch {prog[0]}, program {prog[1]}"]
                for n, op, rr, cc, nb in held:
                    verb = "loaded" if op == "load" else "stored"
                    lines.append(f"{n}[{rr[0]}:{rr[1]}, {cc[0]}:{cc[1]}] {verb} {format_bytes(nb)}")
                lines.append(f"tiles: {format_bytes(sum(x[4] for x in held))}")
                text = "\n".join(lines)
            row["sram_text"].set_text(text)
            c = self.counters[i]
            row["header"].set_text(
                f"{r.label}: event {s}/{r.n}  |  HBM read {format_bytes(c['bytes_read'])}"
                f" (of {format_bytes(c['total_read'])})  |  written {format_bytes(c['bytes_written'])}"
                f" (of {format_bytes(c['total_written'])})"
            )
        return h["fig"]
