"""The checks of exercise 06_triton_primer: one table per graded part; rows padded so that strides matter."""

from functools import partial

import torch

from attnlab.grading.core import Mistake, check_function, gen as _gen, randn as _randn, table
from attnlab.grading.engine import Kernel, Launch, Measured
from attnlab.grading.exercises.e06 import spec as specs
from attnlab.grading.kernel_check import cdiv, next_power_of_2
from attnlab.grading.sandbox.agent import device as _device


def _args(*items):
    """Arguments for run_guarded: "x" a buffer, "x[0]" its row 0 (1-D), "x.1" its stride along dim 1, else a value."""
    return [["val", a] if not isinstance(a, str) else ["stride", a[:-2], int(a[-1])] if "." in a
            else ["buf", a[:-3], 0] if a.endswith("[0]") else ["buf", a, None] for a in items]


def _buf(x, pad=0):
    """A buffer: an input tensor (1-D: one row), or an output's shape; ``pad`` elements after each row."""
    b = {"data": x[None, :] if x.dim() == 1 else x} if torch.is_tensor(x) else {"shape": list(x), "output": True}
    return {**b, "pad_cols": pad} if pad else b


def matmul_budget(m, n, k, bm, bn, names="abc"):
    """{buffer: (max load bytes, max store bytes)} of C = A @ B in (bm, bn) tiles: A read once per column of tiles,
    B once per row, C written once (attnlab.iomodel.matmul_io's model; the outer product is K = 1)."""
    a, b, c = names
    return {a: (4 * m * k * cdiv(n, bn), None), b: (4 * k * n * cdiv(m, bm), None), c: (None, 4 * m * n)}


def _scale_launch(g, n, block, alpha):
    x = _randn(g, n)
    return Launch(f"n={n}, BLOCK_SIZE={block}, grid=({cdiv(n, block)},)", {"x": _buf(x), "y": _buf((1, n))},
                  (cdiv(n, block),), _args("x[0]", "y[0]", n, alpha), {"BLOCK_SIZE": block},
                  {"y": specs.scale(x, alpha)[None, :]}, (x, alpha), ("x", "alpha"),
                  {"x": (4 * n, None), "y": (None, 4 * n)})


def _transpose_launch(g, m, n, bm, bn):
    x, grid = _randn(g, m, n), (cdiv(m, bm), cdiv(n, bn))
    return Launch(f"x of shape ({m}, {n}), BLOCK_M={bm}, BLOCK_N={bn}, grid={grid}",
                  {"x": _buf(x, 3), "y": _buf((n, m), 5)}, grid, _args("x", "y", m, n, "x.0", "x.1", "y.0", "y.1"),
                  {"BLOCK_M": bm, "BLOCK_N": bn}, {"y": specs.transpose(x)}, (x,), ("x",),
                  {"x": (4 * m * n, None), "y": (None, 4 * m * n)})


def _outer_launch(g, m, n, bm, bn):
    x, y, grid = _randn(g, m), _randn(g, n), (cdiv(m, bm), cdiv(n, bn))
    return Launch(f"x ({m},), y ({n},), BLOCK_M={bm}, BLOCK_N={bn}, grid={grid}",
                  {"x": _buf(x), "y": _buf(y), "out": _buf((m, n), 3)}, grid,
                  _args("x[0]", "y[0]", "out", m, n, "out.0"), {"BLOCK_M": bm, "BLOCK_N": bn},
                  {"out": specs.outer(x, y)}, (x, y), ("x", "y"), matmul_budget(m, n, 1, bm, bn, ("x", "y", "out")))


def _row_sum_launch(g, m, n, bn):
    x = _randn(g, m, n)
    return Launch(f"x of shape ({m}, {n}), BLOCK_N={bn}" + (" (one partial block)" if n < bn else ""),
                  {"x": _buf(x, 3), "out": _buf((1, m))}, (m,), _args("x", "out[0]", n, "x.0"), {"BLOCK_N": bn},
                  {"out": specs.row_sum(x)[None, :]}, (x, bn), ("x", "BLOCK_N"),
                  {"x": (4 * m * n, None), "out": (None, 4 * m)})


def _softmax_launch(g, rows, cols, block, scale, what="", reads=1):
    """One program per row, each row read at most ``reads`` times; ``block`` None: the row's power of 2."""
    x, block = _randn(g, rows, cols, scale=scale), block or next_power_of_2(cols)
    if what == "grows":  # the max grows along the row: every block rescales the sum
        x, what = x + torch.linspace(0, 12, cols), " whose max grows along the row"
    label = f"a ({rows}, {cols}) input" + (f", BLOCK_SIZE={block}" if reads > 1 else "")
    return Launch(label + (" with large logits (~1000)" if scale > 100 else what), {"x": _buf(x, 3),
                  "y": _buf((rows, cols), 5)}, (rows,), _args("y", "x", "x.0", "y.0", cols), {"BLOCK_SIZE": block},
                  {"y": specs.row_softmax(x)}, (x, block), ("x", "BLOCK_SIZE"),
                  {"x": (4 * reads * rows * cols, None), "y": (None, 4 * rows * cols)})


def _matmul_launch(g, m, n, k, col_major, bm=16, bn=16, bk=16):
    a, b, grid = _randn(g, m, k), _randn(g, k, n), (cdiv(m, bm), cdiv(n, bn))
    return Launch(f"A ({m}, {k}) @ B ({k}, {n}), blocks 16 x 16 x 16, grid={grid}"
                  + (", B stored column-major (stride_bk = 1)" if col_major else ""),
                  {"a": _buf(a, 3), "b": _buf(b.T.contiguous() if col_major else b, 5), "c": _buf((m, n), 2)}, grid,
                  _args("a", "b", "c", m, n, k, "a.0", "a.1", *(("b.1", "b.0") if col_major else ("b.0", "b.1")),
                        "c.0", "c.1"), {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, {"c": specs.matmul(a, b)},
                  (a, b, bk), ("A", "B", "BLOCK_K"), matmul_budget(m, n, k, bm, bn))


def _causal_launch(g, n_q, n_k, bm, bn, scale):
    s = _randn(g, n_q, n_k)
    what = "non-square tiles" if bm != bn else "square" if n_q == n_k else "more queries than keys" \
        if n_q > n_k else "more keys than queries (tiles wholly above the diagonal)"
    return Launch(f"S of shape ({n_q}, {n_k}) ({what}), BLOCK_M={bm}, BLOCK_N={bn}",
                  {"s": _buf(s, 3), "out": _buf((n_q, n_k), 2)}, (cdiv(n_q, bm), cdiv(n_k, bn)),
                  _args("s", "out", n_q, n_k, "s.0", "out.0", scale), {"BLOCK_M": bm, "BLOCK_N": bn},
                  {"out": specs.causal_scores(s, scale)}, (s, scale, bm, bn), ("S", "scale", "BLOCK_M", "BLOCK_N"),
                  {"s": (4 * specs.tiles_touching_causal(n_q, n_k, bm, bn), None), "out": (None, 4 * n_q * n_k)})


def _padded_softmax(x, block):
    # masked-off lanes loaded as 0 join the row: what `other=0` computes
    width = cdiv(x.shape[-1], block) * block
    return specs.row_softmax(torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[-1])], dim=-1))[:, :x.shape[-1]]


def _online_unrescaled(x, block):
    """The online kernel's pass 1 without the rescale of the running sum, then pass 2."""
    m, l = torch.full((x.shape[0],), float("-inf")), torch.zeros(x.shape[0])
    for start in range(0, x.shape[1], block):
        xb = x[:, start:start + block]
        m_new = torch.maximum(m, xb.amax(-1))
        l, m = l + torch.exp(xb - m_new[:, None]).sum(-1), m_new
    return torch.exp(x - m[:, None]) / l[:, None]


def _causal_with(offset=0, fill=float("-inf"), transposed=False, use_scale=True, pid_skip=False):
    def impl(s, scale, bm, bn):
        i, j = torch.arange(s.shape[0])[:, None], torch.arange(s.shape[1])[None, :]
        keep = (j >= i) if transposed else (j <= i + offset)
        if pid_skip:  # tiles with pid_n > pid_m written as -inf without a look
            keep = keep & (j // bn <= i // bm)
        return (s * (scale if use_scale else 1.0)).masked_fill(~keep, fill)
    return impl


_SOFTMAX_MISTAKES = [
    Mistake("masked-lanes-zero", "masked lanes loaded as 0 add exp(0 - max): use other=-float('inf')", _padded_softmax),
    Mistake("no-max-subtraction", "exp overflows on large logits: subtract the row's (running) max before tl.exp",
            lambda x, block: torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)),
    Mistake("not-normalised", "divide by the row's sum", lambda x, block: torch.exp(x - x.amax(-1, keepdim=True))),
]
_MISTAKES = {
    "masked-scale": [
        Mistake("added-not-multiplied", "alpha is added to x: y = alpha * x", lambda x, alpha: x + alpha),
        Mistake("alpha-ignored", "alpha is never applied: y = alpha * x", lambda x, alpha: x.clone())],
    "tile-transpose": [
        Mistake("not-transposed", "y = x: x[i, j] goes to y[j, i]", lambda x: x.clone())],
    "outer-product": [
        Mistake("added-not-multiplied", "multiply x[i] * y[j], not add", lambda x, y: x[:, None] + y[None, :]),
        Mistake("transposed", "rows of out follow x (x[:, None]), columns y (y[None, :])",
                lambda x, y: y[:, None] * x[None, :])],
    "row-sum": [
        Mistake("first-block-only", "loop over the row: for start in range(0, n_cols, BLOCK_N)",
                lambda x, bn: x[:, :bn].sum(-1)[None, :]),
        Mistake("tail-dropped", "the last, partial block is left out: loop up to n_cols, the lanes past it masked",
                lambda x, bn: x[:, :(x.shape[1] // bn) * bn].sum(-1)[None, :]),
        Mistake("other-missing", "masked lanes without other=0.0 are undefined on a GPU (the interpreter gives 0): "
                "pass other=0.0", lambda x, bn: torch.full((1, x.shape[0]), float("nan") if x.shape[1] % bn else 0.0)
                + (0.0 if x.shape[1] % bn else x.sum(-1)[None, :]))],
    "softmax-kernel": _SOFTMAX_MISTAKES,
    "online-softmax-kernel": [
        Mistake("sum-not-rescaled", "rescale the running sum when the max grows: l = l * exp(m - m_new) + "
                "sum(exp(x - m_new))", _online_unrescaled), *_SOFTMAX_MISTAKES],
    "tiled-matmul": [
        Mistake("not-accumulated", "each K step replaces the tile instead of adding to it: acc += tl.dot(a, b, ...)",
                lambda a, b, bk: a[:, (a.shape[1] - 1) // bk * bk:] @ b[(a.shape[1] - 1) // bk * bk:]),
        Mistake("k-tail-dropped", "loop over range(0, K, BLOCK_K), masking the K lanes with other=0.0",
                lambda a, b, bk: a[:, :a.shape[1] // bk * bk] @ b[:a.shape[1] // bk * bk]),
        Mistake("b-transposed", "stride_bk and stride_bn are swapped: B[k, n] is at b_ptr + k * stride_bk + n * "
                "stride_bn", lambda a, b, bk: a @ b.T)],
    "causal-tile": [
        Mistake("off-by-one-diagonal", "a query sees its own key: keep j <= i, not j < i", _causal_with(offset=-1)),
        Mistake("mask-transposed", "the mask keeps the future (j >= i): keep j <= i", _causal_with(transposed=True)),
        Mistake("filled-with-zero", "softmax still weighs a 0 (exp(0) = 1): fill with -inf", _causal_with(fill=0.0)),
        Mistake("scale-forgotten", "multiply the kept scores by scale", _causal_with(use_scale=False)),
        Mistake("tile-skip-by-program-id", "pid_n <= pid_m is the diagonal only when BLOCK_M == BLOCK_N: a tile "
                "keeps an entry when pid_n * BLOCK_N <= pid_m * BLOCK_M + BLOCK_M - 1", _causal_with(pid_skip=True))],
    "matmul-traffic-experiment": [
        Mistake("writes-counted", "count bytes_read only, not the writes",
                lambda m, n, k, block, seed=0: specs.matmul_traffic(m, n, k, block) + 4 * m * n),
        Mistake("unique-bytes", "count every load (bytes_read), not unique_bytes_read",
                lambda m, n, k, block, seed=0: 4 * (m * k + k * n)),
        Mistake("elements-not-bytes", "count bytes, 4 per float32, not elements",
                lambda m, n, k, block, seed=0: specs.matmul_traffic(m, n, k, block) // 4),
        Mistake("tile-counts-swapped", "A is read cdiv(N, block) times and B cdiv(M, block) times, not the reverse",
                lambda m, n, k, block, seed=0: 4 * (m * k * cdiv(m, block) + k * n * cdiv(n, block))),
        Mistake("a-only", "B is read too", lambda m, n, k, block, seed=0: 4 * m * k * cdiv(n, block))],
}
_TILE_LOADED = Mistake("broadcast-by-loading", "x and y are loaded as 2-D tiles: load 1-D blocks and broadcast "
                       "(x[:, None] * y[None, :])", None)
_THIRD_PASS = Mistake("more-than-two-passes", "the row is read more than twice: update the max and the sum in one "
                      "pass, rescaling the sum when the max grows", None)
_MASKED_READ = Mistake("masked-entries-read", "load S with the causal mask itself (mask=keep), not whole tiles", None)


def _experiment_cases():
    g, out = _gen(1450), []
    for block in (16, 32, 16):
        m, n, k = (int(v) for v in torch.randint(17, 65, (3,), generator=g))
        seed = int(torch.randint(0, 10_000, (1,), generator=g))
        out.append((f"M={m}, N={n}, K={k}, block={block}, seed={seed}", (m, n, k, block), {"seed": seed}))
    return out


def _measure_traffic(learner):
    """The learner's ``matmul_traffic`` (bytes its own tiled matmul reads, traced) against the tiled model."""
    if _device() == "cuda":
        return "not checked on a GPU: the tracer sees Triton's interpreter only; grade this part on a CPU-only machine"
    n = check_function(learner, "matmul_traffic", specs.matmul_traffic, _experiment_cases(),
                       _MISTAKES["matmul-traffic-experiment"])
    return f"{n} measurements reproduced exactly (to the byte) by the tiled-matmul traffic model"


# (part, kernel, seed, its launches' rows, their builder, the pass message (None: default), the budget in words, more)
_KERNELS = [
    ("masked-scale", "scale_kernel", 1100, [(1000, 128, 0.5), (64, 64, 1.5), (1, 32, 2.5), (257, 64, 3.5)],
     _scale_launch, None, "x read once, y written once", {}),
    ("tile-transpose", "transpose_kernel", 1150, [(8, 8, 4, 4), (10, 6, 4, 4), (5, 12, 8, 4)], _transpose_launch,
     "{n} launches (square, ragged, wide; rows padded) match the spec, with no stray access",
     "x read once, y written once", {}),
    ("outer-product", "outer_kernel", 1180, [(6, 6, 4, 4), (13, 9, 8, 4), (1, 20, 4, 8)], _outer_launch,
     "{n} launches match the spec, with no stray access", "x read once per column of tiles and y once per row of "
     "tiles (1-D blocks, broadcast on the chip), out written once", {"traffic_mistakes": [_TILE_LOADED]}),
    # masked lanes of a load without other= read NaN, as undefined as on a GPU
    ("row-sum", "row_sum_kernel", 1200, [(4, 40, 16), (3, 64, 16), (5, 7, 16), (2, 100, 32)], _row_sum_launch,
     "{n} launches (partial last blocks, a row shorter than the block) match the spec",
     "x read once, one value stored per row", {"undefined_other": True}),
    ("softmax-kernel", "softmax_kernel", 1250, [(4, 8, None, 1.0), (3, 100, None, 1.0), (5, 1, None, 1.0),
                                                (2, 130, None, 1.0), (3, 20, None, 500.0)], _softmax_launch,
     "{n} inputs (odd widths, one column, large logits) match the spec, with no stray access",
     "each row read once and written once", {}),
    ("online-softmax-kernel", "online_softmax_kernel", 1300, [
        (3, 100, 16, 3.0, "grows", 2), (2, 64, 16, 1.0, "", 2), (4, 10, 16, 1.0, " (row shorter than the block)", 2),
        (2, 50, 16, 500.0, "", 2)], _softmax_launch,
     "{n} inputs (rows of several blocks, a partial last block, large logits) match the spec",
     "each row read at most twice (pass 1 for the running max and sum, pass 2 for the output), each output element "
     "written once", {"traffic_mistakes": [_THIRD_PASS]}),
    ("tiled-matmul", "matmul_kernel", 1350, [(32, 32, 32, False), (40, 24, 40, False), (16, 48, 20, True)],
     _matmul_launch, "{n} launches (ragged M, N and K, a column-major B) match the spec, with no stray access",
     "A read cdiv(N, BLOCK_N) times and B cdiv(M, BLOCK_M) times, each element of C written once", {"uses_dot": True}),
    ("causal-tile", "causal_mask_kernel", 1400, [(16, 16, 8, 8, 0.25), (20, 13, 8, 8, 0.75), (9, 24, 8, 8, 1.25),
                                                 (16, 20, 16, 8, 1.75), (12, 24, 4, 8, 2.25)], _causal_launch,
     "{n} launches (square, n_q > n_k, n_q < n_k, BLOCK_M != BLOCK_N) match the spec", "S read only inside tiles that "
     "keep an entry (none of a tile wholly above the diagonal), out written once",
     {"traffic_mistakes": [_MASKED_READ]}),
]

TABLES = {
    **{part: Kernel(name, partial(table, seed, rows, launch), _MISTAKES[part], budget_says=budget,
                    **({"says": says} if says else {}), **more)
       for part, name, seed, rows, launch, says, budget, more in _KERNELS},
    "matmul-traffic-experiment": Measured("experiment", _measure_traffic,
                                          {"matmul_traffic": _MISTAKES["matmul-traffic-experiment"]}),
}
