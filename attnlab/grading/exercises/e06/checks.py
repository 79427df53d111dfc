"""The checks of exercise 06_triton_primer: one table per graded part (:mod:`attnlab.grading.engine`), in ``TABLES``.

Every kernel part is a :class:`~attnlab.grading.engine.Kernel`: the grader launches the learner's ``@triton.jit``
kernel itself (:func:`attnlab.grading.engine.launch`: its own grid and block sizes, tensors inside sentinel-guarded
memory whose rows are further apart than they are long), compares the values with the spec and, in Triton's
interpreter, holds the traced traffic to each launch's byte budget. A failure is named from what the launch showed
(an out-of-bounds access, an output element never written, more bytes than the budget, a kernel that is right only
on contiguous rows) or from a wrong version of the spec that gives the same numbers.
"""

import torch

from attnlab.grading.core import Mistake, check_function, gen as _gen, randn as _randn
from attnlab.grading.engine import Kernel, Launch, Measured
from attnlab.grading.exercises.e06 import spec as specs
from attnlab.grading.kernel_check import cdiv, next_power_of_2
from attnlab.grading.sandbox.agent import device as _device


def _read_once(inp, out, n_in, n_out):
    """{buffer: (max load bytes, max store bytes)}: ``n_in`` float32 of ``inp`` read once, ``n_out`` of ``out``
    written once."""
    return {inp: (4 * n_in, None), out: (None, 4 * n_out)}


# ----------------------------------------------------------------------------- masked-scale: y = alpha * x

_SCALE_MISTAKES = [
    Mistake("added-not-multiplied", "alpha is added to x: y = alpha * x", lambda x, alpha: x + alpha),
    Mistake("alpha-ignored", "alpha is never applied: y = alpha * x", lambda x, alpha: x.clone()),
]


def _scale_launches():
    out = []
    for seed, (n, block) in enumerate([(1000, 128), (64, 64), (1, 32), (257, 64)]):
        x, alpha = _randn(_gen(1100 + seed), n), 0.5 + seed
        out.append(Launch(f"n={n}, BLOCK_SIZE={block}, grid=({cdiv(n, block)},)",
                          {"x": {"data": x[None, :]}, "y": {"shape": [1, n], "output": True}}, (cdiv(n, block),),
                          [["buf", "x", 0], ["buf", "y", 0], ["val", n], ["val", alpha]], {"BLOCK_SIZE": block},
                          {"y": specs.scale(x, alpha)[None, :]}, (x, alpha), ("x", "alpha"),
                          _read_once("x", "y", n, n)))
    return out


# ----------------------------------------------------------------------------- tile-transpose: y = x^T, with strides

_TRANSPOSE_MISTAKES = [
    Mistake("not-transposed", "the tile is stored where it was loaded from (y = x): x[i, j] goes to y[j, i]",
            lambda x: x.clone()),
]


def _transpose_launches():
    out = []
    for seed, (m, n, bm, bn) in enumerate([(8, 8, 4, 4), (10, 6, 4, 4), (5, 12, 8, 4)]):
        x = _randn(_gen(1150 + seed), m, n)
        grid = (cdiv(m, bm), cdiv(n, bn))
        out.append(Launch(f"x of shape ({m}, {n}), BLOCK_M={bm}, BLOCK_N={bn}, grid={grid}",
                          {"x": {"data": x, "pad_cols": 3}, "y": {"shape": [n, m], "output": True, "pad_cols": 5}},
                          grid, [["buf", "x", None], ["buf", "y", None], ["val", m], ["val", n], ["stride", "x", 0],
                                 ["stride", "x", 1], ["stride", "y", 0], ["stride", "y", 1]],
                          {"BLOCK_M": bm, "BLOCK_N": bn}, {"y": specs.transpose(x)}, (x,), ("x",),
                          _read_once("x", "y", m * n, m * n)))
    return out


# ----------------------------------------------------------------------------- outer-product: x[i] * y[j], broadcast

_OUTER_MISTAKES = [
    Mistake("added-not-multiplied", "x[i] + y[j] is a broadcast sum: the outer product multiplies",
            lambda x, y: x[:, None] + y[None, :]),
    Mistake("transposed", "out[i, j] = x[j] * y[i]: rows of out follow x (x[:, None]), columns follow y (y[None, :])",
            lambda x, y: y[:, None] * x[None, :]),
]

_TILE_LOADED = Mistake("broadcast-by-loading", "x or y is loaded as a (BLOCK_M, BLOCK_N) tile, so each value is read "
                       "once per lane of the other axis: load them as 1-D blocks and broadcast in registers "
                       "(x[:, None] * y[None, :])", None)


def outer_budget(m, n, bm, bn):
    """{buffer: (max load bytes, max store bytes)}: x once per column of tiles, y once per row of tiles."""
    return {"x": (4 * m * cdiv(n, bn), None), "y": (4 * n * cdiv(m, bm), None), "out": (None, 4 * m * n)}


def _outer_launches():
    out = []
    for seed, (m, n, bm, bn) in enumerate([(6, 6, 4, 4), (13, 9, 8, 4), (1, 20, 4, 8)]):
        g = _gen(1180 + seed)
        x, y = _randn(g, m), _randn(g, n)
        grid = (cdiv(m, bm), cdiv(n, bn))
        out.append(Launch(f"x ({m},), y ({n},), BLOCK_M={bm}, BLOCK_N={bn}, grid={grid}",
                          {"x": {"data": x[None, :]}, "y": {"data": y[None, :]},
                           "out": {"shape": [m, n], "output": True, "pad_cols": 3}},
                          grid, [["buf", "x", 0], ["buf", "y", 0], ["buf", "out", None], ["val", m], ["val", n],
                                 ["stride", "out", 0]],
                          {"BLOCK_M": bm, "BLOCK_N": bn}, {"out": specs.outer(x, y)}, (x, y), ("x", "y"),
                          outer_budget(m, n, bm, bn)))
    return out


# ----------------------------------------------------------------------------- row-sum: a loop over column blocks

_ROW_SUM_MISTAKES = [
    Mistake("first-block-only", "only the first BLOCK_N columns are summed: loop over the row, "
            "for start in range(0, n_cols, BLOCK_N)", lambda x, bn: x[:, :bn].sum(-1)[None, :]),
    Mistake("tail-dropped", "the last, partial block is left out: the loop must run up to n_cols (range(0, n_cols, "
            "BLOCK_N)), with the lanes past n_cols masked",
            lambda x, bn: x[:, :(x.shape[1] // bn) * bn].sum(-1)[None, :]),
    Mistake("other-missing", "the masked load has no other=0.0: the lanes past n_cols are undefined (Triton's "
            "interpreter happens to give 0, a GPU gives whatever is there), so the last, partial block adds "
            "garbage; pass other=0.0 so that masked lanes add nothing",
            lambda x, bn: torch.full((1, x.shape[0]), float("nan") if x.shape[1] % bn else 0.0) +
            (0.0 if x.shape[1] % bn else x.sum(-1)[None, :])),
]


def _row_sum_launches():
    out = []
    for seed, (m, n, bn) in enumerate([(4, 40, 16), (3, 64, 16), (5, 7, 16), (2, 100, 32)]):
        x = _randn(_gen(1200 + seed), m, n)
        out.append(Launch(f"x of shape ({m}, {n}), BLOCK_N={bn}" + (" (one partial block)" if n < bn else ""),
                          {"x": {"data": x, "pad_cols": 3}, "out": {"shape": [1, m], "output": True}}, (m,),
                          [["buf", "x", None], ["buf", "out", 0], ["val", n], ["stride", "x", 0]], {"BLOCK_N": bn},
                          {"out": specs.row_sum(x)[None, :]}, (x, bn), ("x", "BLOCK_N"),
                          _read_once("x", "out", m * n, m)))
    return out


# ----------------------------------------------------------------------------- softmax-kernel: one row per program

def _padded_softmax(x, block):
    # masked-off lanes loaded as 0 join the row: what `other=0` computes
    width = cdiv(x.shape[-1], block) * block
    padded = torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[-1])], dim=-1)
    return specs.row_softmax(padded)[:, : x.shape[-1]]


def _naive_softmax(x, block=None):
    e = torch.exp(x)
    return e / e.sum(-1, keepdim=True)


def _not_normalised(x, block=None):
    return torch.exp(x - x.amax(-1, keepdim=True))


_SOFTMAX_KERNEL_MISTAKES = [
    Mistake("masked-lanes-zero", "masked-off lanes are loaded as 0, which still adds exp(0 - max) to the sum: "
            "load them with other=-float('inf')", lambda x: _padded_softmax(x, next_power_of_2(x.shape[-1]))),
    Mistake("no-max-subtraction", "exp overflows on large logits: subtract the row's max before tl.exp",
            _naive_softmax),
    Mistake("not-normalised", "exp(x - max) is stored without dividing by its sum over the row", _not_normalised),
]


def _softmax_launch(label, x, block, inputs, names, reads):
    """A launch of a softmax kernel, one program per row, each row read at most ``reads`` times. The rows are 3
    (input) and 5 (output) elements further apart than they are long: the kernel must use the strides."""
    rows, cols = x.shape
    return Launch(label, {"x": {"data": x, "pad_cols": 3}, "y": {"shape": [rows, cols], "output": True, "pad_cols": 5}},
                  (rows,), [["buf", "y", None], ["buf", "x", None], ["stride", "x", 0], ["stride", "y", 0],
                            ["val", cols]], {"BLOCK_SIZE": block}, {"y": specs.row_softmax(x)}, inputs, names,
                  _read_once("x", "y", reads * rows * cols, rows * cols))


def _softmax_kernel_launches():
    out = []
    for seed, (rows, cols, scale) in enumerate([(4, 8, 1.0), (3, 100, 1.0), (5, 1, 1.0), (2, 130, 1.0),
                                                 (3, 20, 500.0)]):
        x = _randn(_gen(1250 + seed), rows, cols, scale=scale)
        label = f"a ({rows}, {cols}) input" + (" with large logits (~1000)" if scale > 1 else "")
        out.append(_softmax_launch(label, x, next_power_of_2(cols), (x,), ("x",), reads=1))
    return out


# ----------------------------------------------------------------------------- online-softmax-kernel: two passes

def _online_emulation(x, block, rescale=True):
    """The kernel's pass 1 in PyTorch, block by block, with the rescale switch; then pass 2."""
    m = torch.full((x.shape[0],), float("-inf"))
    l = torch.zeros(x.shape[0])
    for start in range(0, x.shape[1], block):
        xb = x[:, start:start + block]
        m_new = torch.maximum(m, xb.amax(-1))
        l = (l * torch.exp(m - m_new) if rescale else l) + torch.exp(xb - m_new[:, None]).sum(-1)
        m = m_new
    return torch.exp(x - m[:, None]) / l[:, None]


_ONLINE_MISTAKES = [
    Mistake("sum-not-rescaled", "the running sum is not rescaled when the max grows: "
            "l = l * exp(m - m_new) + sum(exp(x - m_new))", lambda x, bs: _online_emulation(x, bs, rescale=False)),
    Mistake("masked-lanes-zero", "masked-off lanes of the last block are loaded as 0 and join the sum: "
            "load them with other=-float('inf')", _padded_softmax),
    Mistake("no-max-subtraction", "exp overflows on large logits: keep a running max and subtract it",
            _naive_softmax),
    Mistake("not-normalised", "pass 2 stores exp(x - m) without dividing by the running sum l", _not_normalised),
]

_THIRD_PASS = Mistake("more-than-two-passes", "the row is read more than twice (a pass for the max, one for the sum, "
                      "one for the output?): update the max and the sum in the same pass, rescaling the sum when the "
                      "max grows", None)


def _online_launches():
    out = []
    for seed, (rows, cols, block, scale) in enumerate([(3, 100, 16, 3.0), (2, 64, 16, 1.0), (4, 10, 16, 1.0),
                                                       (2, 50, 16, 500.0)]):
        x = _randn(_gen(1300 + seed), rows, cols, scale=scale)
        if seed == 0:  # the max grows along the row: every block rescales the sum
            x = x + torch.linspace(0, 12, cols)
        label = f"a ({rows}, {cols}) input, BLOCK_SIZE={block}" + (
            " with large logits (~1000)" if scale > 100 else " whose max grows along the row" if seed == 0 else
            " (row shorter than the block)" if cols < block else "")
        out.append(_softmax_launch(label, x, block, (x, block), ("x", "BLOCK_SIZE"), reads=2))
    return out


# ----------------------------------------------------------------------------- tiled-matmul: C = A @ B with tl.dot

def _last_k_block(a, b, bk):
    last = ((a.shape[1] - 1) // bk) * bk
    return a[:, last:] @ b[last:]


def _k_tail_dropped(a, b, bk):
    stop = (a.shape[1] // bk) * bk
    return a[:, :stop] @ b[:stop]


_MATMUL_MISTAKES = [
    Mistake("not-accumulated", "each K step replaces the tile instead of adding to it: acc += tl.dot(a, b, ...)",
            _last_k_block),
    Mistake("k-tail-dropped", "the last, partial K block is left out: loop over range(0, K, BLOCK_K) and mask the "
            "K lanes with other=0.0", _k_tail_dropped),
    Mistake("b-transposed", "B is read transposed (stride_bk and stride_bn swapped): B[k, n] is at "
            "b_ptr + k * stride_bk + n * stride_bn", lambda a, b, bk: a @ b.T),
]


def matmul_budget(m, n, k, bm, bn):
    """{buffer: (max load bytes, max store bytes)}: A read once per column of C tiles (cdiv(N, BLOCK_N) times),
    B once per row of tiles (cdiv(M, BLOCK_M) times), C written once. attnlab.iomodel.matmul_io's model."""
    return {"a": (4 * m * k * cdiv(n, bn), None), "b": (4 * k * n * cdiv(m, bm), None), "c": (None, 4 * m * n)}


def _matmul_launches():
    out = []
    bm = bn = bk = 16
    for seed, (m, n, k, col_major) in enumerate([(32, 32, 32, False), (40, 24, 40, False), (16, 48, 20, True)]):
        g = _gen(1350 + seed)
        a, b = _randn(g, m, k), _randn(g, k, n)
        grid = (cdiv(m, bm), cdiv(n, bn))
        label = (f"A ({m}, {k}) @ B ({k}, {n}), blocks 16 x 16 x 16, grid={grid}"
                 + (", B stored column-major (stride_bk = 1)" if col_major else ""))
        b_strides = [["stride", "b", 1], ["stride", "b", 0]] if col_major else [["stride", "b", 0], ["stride", "b", 1]]
        out.append(Launch(label, {"a": {"data": a, "pad_cols": 3},
                                  "b": {"data": b.T.contiguous() if col_major else b, "pad_cols": 5},
                                  "c": {"shape": [m, n], "output": True, "pad_cols": 2}},
                          grid, [["buf", "a", None], ["buf", "b", None], ["buf", "c", None], ["val", m], ["val", n],
                                 ["val", k], ["stride", "a", 0], ["stride", "a", 1], *b_strides, ["stride", "c", 0],
                                 ["stride", "c", 1]],
                          {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, {"c": specs.matmul(a, b)}, (a, b, bk),
                          ("A", "B", "BLOCK_K"), matmul_budget(m, n, k, bm, bn)))
    return out


# ----------------------------------------------------------------------------- causal-tile: no wholly masked tile read

def _causal_with(offset=0, fill=float("-inf"), transposed=False, use_scale=True, pid_skip=False):
    def impl(s, scale, bm, bn):
        n_q, n_k = s.shape
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        keep = (j >= i) if transposed else (j <= i + offset)
        if pid_skip:  # tiles with pid_n > pid_m written as -inf without a look
            keep = keep & (j // bn <= i // bm)
        return (s * (scale if use_scale else 1.0)).masked_fill(~keep, fill)
    return impl


_CAUSAL_MISTAKES = [
    Mistake("off-by-one-diagonal", "the diagonal is masked too: a query sees its own key (keep j <= i, not j < i)",
            _causal_with(offset=-1)),
    Mistake("mask-transposed", "the mask keeps the future (j >= i): keep key j <= query i", _causal_with(transposed=True)),
    Mistake("filled-with-zero", "masked scores are 0, which softmax still weighs (exp(0) = 1): fill them with -inf",
            _causal_with(fill=0.0)),
    Mistake("scale-forgotten", "the kept scores are not multiplied by scale", _causal_with(use_scale=False)),
    Mistake("tile-skip-by-program-id", "tiles are skipped by comparing program ids (pid_n <= pid_m), which is the "
            "diagonal only when BLOCK_M == BLOCK_N: a tile keeps an entry when its first key column is at most its "
            "last query row, pid_n * BLOCK_N <= pid_m * BLOCK_M + BLOCK_M - 1", _causal_with(pid_skip=True)),
]

_MASKED_READ = Mistake("masked-entries-read", "entries that end as -inf are read anyway: load S with the causal "
                       "mask itself (mask=keep), so a tile wholly above the diagonal reads nothing", None)


def _causal_launches():
    out = []
    for seed, (n_q, n_k, bm, bn) in enumerate([(16, 16, 8, 8), (20, 13, 8, 8), (9, 24, 8, 8), (16, 20, 16, 8),
                                                (12, 24, 4, 8)]):
        s, scale = _randn(_gen(1400 + seed), n_q, n_k), 0.25 + 0.5 * seed
        budget = {"s": (4 * specs.tiles_touching_causal(n_q, n_k, bm, bn), None), "out": (None, 4 * n_q * n_k)}
        what = "non-square tiles" if bm != bn else "square" if n_q == n_k else "more queries than keys" \
            if n_q > n_k else "more keys than queries (tiles wholly above the diagonal)"
        out.append(Launch(f"S of shape ({n_q}, {n_k}) ({what}), BLOCK_M={bm}, BLOCK_N={bn}",
                          {"s": {"data": s, "pad_cols": 3},
                           "out": {"shape": [n_q, n_k], "output": True, "pad_cols": 2}},
                          (cdiv(n_q, bm), cdiv(n_k, bn)),
                          [["buf", "s", None], ["buf", "out", None], ["val", n_q], ["val", n_k], ["stride", "s", 0],
                           ["stride", "out", 0], ["val", scale]],
                          {"BLOCK_M": bm, "BLOCK_N": bn}, {"out": specs.causal_scores(s, scale)}, (s, scale, bm, bn),
                          ("S", "scale", "BLOCK_M", "BLOCK_N"), budget))
    return out


# ----------------------------------------------------------------------------- matmul-traffic-experiment

def _unique(m, n, k, block, seed=0):
    return 4 * (m * k + k * n)


_EXPERIMENT_MISTAKES = [
    Mistake("writes-counted", "this counts the bytes written as well: bytes_read only",
            lambda m, n, k, block, seed=0: specs.matmul_traffic(m, n, k, block) + 4 * m * n),
    Mistake("unique-bytes", "each element is counted once (unique_bytes_read): count every load, as bytes_read does",
            _unique),
    Mistake("elements-not-bytes", "these are elements: the tracer's counts are bytes (4 per float32)",
            lambda m, n, k, block, seed=0: specs.matmul_traffic(m, n, k, block) // 4),
    Mistake("tile-counts-swapped", "A is read once per column of tiles (cdiv(N, block) times) and B once per row "
            "(cdiv(M, block) times), not the other way round",
            lambda m, n, k, block, seed=0: 4 * (m * k * cdiv(m, block) + k * n * cdiv(n, block))),
    Mistake("a-only", "only A's bytes are counted: B is read too",
            lambda m, n, k, block, seed=0: 4 * m * k * cdiv(n, block)),
]


def _experiment_cases():
    g = _gen(1450)
    out = []
    for block in (16, 32, 16):
        m, n, k = (int(v) for v in torch.randint(17, 65, (3,), generator=g))
        seed = int(torch.randint(0, 10_000, (1,), generator=g))
        out.append((f"M={m}, N={n}, K={k}, block={block}, seed={seed}", (m, n, k, block), {"seed": seed}))
    return out


def _measure_traffic(learner):
    """The learner's ``matmul_traffic`` (bytes its own tiled matmul reads, traced) against the tiled model."""
    if _device() == "cuda":
        return ("not checked on a GPU: attnlab.memory.trace watches kernels that run in Triton's interpreter, and "
                "here your kernel runs natively; grade this part on a CPU-only machine")
    n = check_function(learner, "matmul_traffic", specs.matmul_traffic, _experiment_cases(), _EXPERIMENT_MISTAKES)
    return f"{n} measurements reproduced exactly (to the byte) by the tiled-matmul traffic model"


TABLES = {
    "masked-scale": Kernel("scale_kernel", _scale_launches, _SCALE_MISTAKES, budget_says="x read once, y written once"),
    "tile-transpose": Kernel("transpose_kernel", _transpose_launches, _TRANSPOSE_MISTAKES,
                             says="{n} launches (square, ragged, wide; rows padded) match the spec, with no stray "
                             "access", budget_says="x read once, y written once"),
    "outer-product": Kernel("outer_kernel", _outer_launches, _OUTER_MISTAKES,
                            says="{n} launches match the spec, with no stray access",
                            budget_says="x read once per column of tiles and y once per row of tiles (1-D blocks, "
                            "broadcast on the chip), out written once", traffic_mistakes=[_TILE_LOADED]),
    # masked lanes of a load without other= read NaN, as undefined as on a GPU
    "row-sum": Kernel("row_sum_kernel", _row_sum_launches, _ROW_SUM_MISTAKES,
                      says="{n} launches (partial last blocks, a row shorter than the block) match the spec",
                      budget_says="x read once, one value stored per row", undefined_other=True),
    "softmax-kernel": Kernel("softmax_kernel", _softmax_kernel_launches, _SOFTMAX_KERNEL_MISTAKES,
                             says="{n} inputs (odd widths, one column, large logits) match the spec, with no stray "
                             "access", budget_says="each row read once and written once"),
    "online-softmax-kernel": Kernel("online_softmax_kernel", _online_launches, _ONLINE_MISTAKES,
                                    says="{n} inputs (rows of several blocks, a partial last block, large logits) "
                                    "match the spec", budget_says="each row read at most twice (pass 1 for the running "
                                    "max and sum, pass 2 for the output) and each output element written once",
                                    traffic_mistakes=[_THIRD_PASS]),
    "tiled-matmul": Kernel("matmul_kernel", _matmul_launches, _MATMUL_MISTAKES,
                           says="{n} launches (ragged M, N and K, a column-major B) match the spec, with no stray "
                           "access", budget_says="A read cdiv(N, BLOCK_N) times and B cdiv(M, BLOCK_M) times (once "
                           "per tile of C that needs them), each element of C written once", uses_dot=True),
    "causal-tile": Kernel("causal_mask_kernel", _causal_launches, _CAUSAL_MISTAKES,
                          says="{n} launches (square, n_q > n_k, n_q < n_k, BLOCK_M != BLOCK_N) match the spec",
                          budget_says="S read only inside tiles that keep an entry (none of a tile wholly above the "
                          "diagonal), out written once", traffic_mistakes=[_MASKED_READ]),
    "matmul-traffic-experiment": Measured("experiment", _measure_traffic, {"matmul_traffic": _EXPERIMENT_MISTAKES}),
}
