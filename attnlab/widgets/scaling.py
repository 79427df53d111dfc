"""ScalingExplorer: why scaled dot-product attention divides the scores by sqrt(d_k).

For random q, k with independent N(0, 1) entries, q.k has mean 0 and variance
d_k (Vaswani et al., 2017, footnote 4). Unscaled, the logits grow like
sqrt(d_k), the softmax saturates towards one-hot, its entropy drops to 0 and its
Jacobian ``diag(p) - p p^T`` (what backpropagation multiplies by) vanishes.
Dividing by sqrt(d_k) keeps the logits at unit variance whatever d_k is.
"""

import ipywidgets as widgets
import numpy as np

from attnlab.widgets._base import FigureWidget, html_table, new_figure, text_panel

D_K_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _softmax(x):
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_stats(logits):
    """Entropy (nats) and Frobenius norm of the softmax Jacobian ``diag(p) - p p^T`` per row.

    ``logits``: ``(..., n)`` -> ``(entropy (...), jacobian_norm (...))``.
    Example: ``softmax_stats(np.zeros(4))`` -> ``(log 4, sqrt(3)/4)``.
    """
    p = _softmax(np.asarray(logits, dtype=np.float64))
    entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=-1)
    # ||diag(p) - p p^T||_F^2 = sum_i p_i^2 - 2 sum_i p_i^3 + (sum_i p_i^2)^2
    s2 = (p**2).sum(axis=-1)
    s3 = (p**3).sum(axis=-1)
    jac_norm = np.sqrt(np.maximum(s2 - 2 * s3 + s2**2, 0.0))
    return entropy, jac_norm


class ScalingExplorer(FigureWidget):
    """Scaled against unscaled dot-product scores, side by side, for a chosen d_k and temperature.

    Panels (left: logits ``q.k / T``, right: ``q.k / (sqrt(d_k) T)``):
    the distribution of q.k over ``n_samples`` random pairs of N(0, 1) vectors;
    one query's softmax weights over ``n_keys`` random keys with their entropy
    and softmax-Jacobian norm; and the mean entropy and Jacobian norm over
    ``n_rows`` queries as d_k grows, with the current d_k marked.

    Controls: ``d_k`` (1 to 1024), ``temperature`` (0.1 to 10), ``seed``.
    The numbers shown are in ``stats``. Everything is seeded.

    Example: ``ScalingExplorer(d_k=64)``
    """

    def __init__(self, *, d_k=64, temperature=1.0, n_keys=16, n_samples=4000, n_rows=64, seed=0):
        if d_k not in D_K_CHOICES:
            raise ValueError(f"d_k: expected one of {D_K_CHOICES}, got {d_k!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0.1 <= temperature <= 10:
            raise ValueError(f"temperature: expected a number in [0.1, 10], got {temperature!r}")
        for name, value, lo, hi in (("n_keys", n_keys, 2, 256), ("n_samples", n_samples, 10, 10**6), ("n_rows", n_rows, 1, 4096)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
                raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
        self.n_keys, self.n_samples, self.n_rows = int(n_keys), int(n_samples), int(n_rows)
        self._cache = {}
        style = {"description_width": "initial"}
        self.d_k = widgets.SelectionSlider(options=D_K_CHOICES, value=d_k, description="d_k", style=style,
                                           continuous_update=False)
        self.temperature = widgets.FloatLogSlider(value=float(temperature), base=10, min=-1, max=1, step=0.05,
                                                  description="temperature", style=style, continuous_update=False)
        self.seed = widgets.BoundedIntText(value=int(seed), min=0, max=2**31 - 1, description="seed",
                                           style=style, layout=widgets.Layout(width="150px"))
        for control in (self.d_k, self.temperature, self.seed):
            control.observe(self.redraw, names="value")
        self.stats_html = text_panel()
        self._build([widgets.HBox([self.d_k, self.temperature, self.seed], layout=widgets.Layout(flex_flow="row wrap"))],
                    [self.stats_html])  # the controls wrap when narrow

    # ---------------------------------------------------------------- numbers
    def _samples(self, d_k):
        """Raw (unscaled) scores for this seed and d_k: (pair dots (n_samples,), row scores (n_rows, n_keys))."""
        return self._dots(d_k), self._rows(d_k)

    def _dots(self, d_k):
        key = ("dots", self.seed.value, d_k)
        if key not in self._cache:
            rng = np.random.default_rng([self.seed.value, d_k, 0])
            q = rng.standard_normal((self.n_samples, d_k), dtype=np.float32)
            k = rng.standard_normal((self.n_samples, d_k), dtype=np.float32)
            self._cache[key] = np.einsum("nd,nd->n", q, k).astype(np.float64)  # (n_samples,)
        return self._cache[key]

    def _rows(self, d_k):
        key = ("rows", self.seed.value, d_k)
        if key not in self._cache:
            rng = np.random.default_rng([self.seed.value, d_k, 1])
            rq = rng.standard_normal((self.n_rows, 1, d_k))
            rk = rng.standard_normal((self.n_rows, self.n_keys, d_k))
            self._cache[key] = (rq * rk).sum(-1)  # (n_rows, n_keys): q.k for each query and its keys
        return self._cache[key]

    def _divisors(self, d_k):
        t = self.temperature.value
        return {"unscaled": t, "scaled": np.sqrt(d_k) * t}

    def _curves(self):
        """Mean entropy and Jacobian norm over the rows, for every d_k, both variants."""
        out = {"unscaled": ([], []), "scaled": ([], [])}
        for d in D_K_CHOICES:
            rows = self._rows(d)
            for name, div in self._divisors(d).items():
                ent, jac = softmax_stats(rows / div)
                out[name][0].append(ent.mean())
                out[name][1].append(jac.mean())
        return {k: (np.array(e), np.array(j)) for k, (e, j) in out.items()}

    @property
    def stats(self):
        """Numbers of the current state, per variant ``"unscaled"``/``"scaled"``:
        ``score_std`` (std of the logits over the random pairs), ``weights`` (row 0's softmax),
        ``entropy`` and ``jacobian_norm`` of row 0, ``mean_entropy``/``mean_jacobian_norm`` over all rows.
        """
        d = self.d_k.value
        dots, rows = self._samples(d)
        out = {}
        for name, div in self._divisors(d).items():
            ent, jac = softmax_stats(rows / div)
            out[name] = {
                "score_std": float((dots / div).std()),
                "weights": _softmax(rows[0] / div),
                "entropy": float(ent[0]),
                "jacobian_norm": float(jac[0]),
                "mean_entropy": float(ent.mean()),
                "mean_jacobian_norm": float(jac.mean()),
            }
        return out

    def _update_state(self):
        s = self.stats
        rows = [[name, f"{v['score_std']:.2f}", f"{v['weights'].max():.3f}", f"{v['mean_entropy']:.3f}",
                 f"{v['mean_jacobian_norm']:.4f}"] for name, v in s.items()]
        self.stats_html.value = html_table(
            # two-line headers: the table fits a notebook at 1024 px with the file browser open
            ["", "std of<br>logits", "max weight<br><small>(row 0)</small>",
             f"mean entropy<br><small>(max {np.log(self.n_keys):.2f})</small>",
             "mean ||softmax<br>Jacobian||"], rows, numeric=(1, 2, 3, 4))

    # ---------------------------------------------------------------- drawing
    # A live redraw updates the artists of one persistent figure (set_data, set_text):
    # rebuilding six axes and laying them out again would take most of the 200 ms budget.
    def _make_figure(self):
        fig = new_figure(9, 6.3)  # with its controls and table it fits a 1280 x 800 screen
        axes = fig.subplots(3, 2, height_ratios=[1, 1, 1.1])
        colors = {"unscaled": "tab:orange", "scaled": "tab:blue"}
        h = {"fig": fig, "axes": axes}
        for col, name in enumerate(("unscaled", "scaled")):
            ax = axes[0, col]
            h["hist", name] = ax.stairs(np.zeros(60), np.linspace(-1, 1, 61), fill=True, color=colors[name], alpha=0.7)
            ax.set_yticks([])
            ax.set_ylabel("count", fontsize=9)
            ax.set_xlabel("logit", fontsize=9)
            h["hist_title", name] = ax.set_title("", fontsize=10)
            ax = axes[1, col]
            h["bars", name] = ax.bar(np.arange(self.n_keys), np.zeros(self.n_keys), color=colors[name])
            ax.set_ylim(0, 1)
            ax.set_yticks([0, 0.5, 1])
            ax.set_xlabel("key", fontsize=9)
            h["bar_title", name] = ax.set_title("", fontsize=10)
        axes[1, 0].set_ylabel("softmax weight", fontsize=9)
        axes[1, 1].set_ylabel("softmax weight", fontsize=9)
        for col, (what, ylabel) in enumerate((("mean entropy (nats)", "entropy (nats)"),
                                              ("mean ||softmax Jacobian||_F", "||J||_F"))):
            ax = axes[2, col]
            for name in ("unscaled", "scaled"):
                (h["curve", col, name],) = ax.plot(D_K_CHOICES, np.zeros(len(D_K_CHOICES)), "o-", ms=3,
                                                   color=colors[name], label=name)
            h["vline", col] = ax.axvline(1, color="gray", ls="--", lw=1, label="current d_k")
            ax.set_ylabel(ylabel, fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_xticks(D_K_CHOICES[::2], [str(v) for v in D_K_CHOICES[::2]])  # plain labels: no mathtext
            ax.minorticks_off()
            ax.set_xlabel("d_k", fontsize=9)
            h["curve_title", col] = ax.set_title("", fontsize=10)
            h["curve_what", col] = what
        axes[2, 0].axhline(np.log(self.n_keys), color="k", lw=0.8, ls=":",
                           label=f"uniform: ln {self.n_keys}")  # the largest entropy over n_keys keys
        # one legend for both curve panels, below them, where it covers no data
        handles, names = axes[2, 0].get_legend_handles_labels()
        fig.legend(handles, names, fontsize=8, ncol=len(names), loc="outside lower center")
        h["suptitle"] = fig.suptitle("", fontsize=11)
        return h

    def _update_figure(self, h):
        d, t = self.d_k.value, self.temperature.value
        dots, _ = self._samples(d)
        stats = self.stats
        divs = self._divisors(d)
        lim = max(4.0, float(np.abs(dots / divs["unscaled"]).max()), float(np.abs(dots / divs["scaled"]).max()))
        bins = np.linspace(-lim, lim, 61)
        labels = {"unscaled": "q.k / T", "scaled": "q.k / (sqrt(d_k) T)"}
        for col, name in enumerate(("unscaled", "scaled")):
            s = stats[name]
            counts, _ = np.histogram(dots / divs[name], bins=bins)
            h["hist", name].set_data(counts, bins)
            ax = h["axes"][0, col]
            ax.set_xlim(-lim, lim)
            ax.set_ylim(0, counts.max() * 1.05)
            h["hist_title", name].set_text(f"{name}: logits {labels[name]}, std {s['score_std']:.2f}")
            for rect, w in zip(h["bars", name], s["weights"]):
                rect.set_height(w)
            h["bar_title", name].set_text(
                f"softmax of one row: entropy {s['entropy']:.2f} nats, ||J|| {s['jacobian_norm']:.3f}"
            )
        curves = self._curves()
        for col in (0, 1):
            top = 0.0
            for name in ("unscaled", "scaled"):
                y = curves[name][col]
                h["curve", col, name].set_ydata(y)
                top = max(top, float(y.max()))
            if col == 0:
                top = max(top, float(np.log(self.n_keys)))
            h["axes"][2, col].set_ylim(0, top * 1.1 + 1e-9)
            h["vline", col].set_xdata([d, d])
            h["curve_title", col].set_text(f"{h['curve_what', col]} vs d_k (T = {t:.2f})")
        h["suptitle"].set_text(f"d_k = {d}, temperature = {t:.2f}, {self.n_keys} keys, seed {self.seed.value}")
        return h["fig"]
