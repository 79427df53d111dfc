"""Exercise 06 (the Triton puzzles): wrong kernels fail their check with the matching diagnosis, a kernel
that moves more bytes than its part allows fails on traffic even when its output is right, and the
shortcuts are refused.

Each wrong kernel is one kernel source with mistake switches (globals set by ``variant``), written the
way a learner would write it."""

import os
import re

import pytest
import torch
import triton
import triton.language as tl

from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from mistakes import Wrong, variant

WRONG = Wrong()


# --------------------------------------------------------------------------------------------------------------
# masked-scale
# --------------------------------------------------------------------------------------------------------------

@triton.jit
def _scale_body(x_ptr, y_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    if USE_PID:
        offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    else:
        offsets = tl.arange(0, BLOCK_SIZE)
    if OFF_BY_ONE:
        mask = offsets <= n_elements
    else:
        mask = offsets < n_elements
    if MASK_LOAD:
        x = tl.load(x_ptr + offsets, mask=mask)
    else:
        x = tl.load(x_ptr + offsets)
    if LOAD_TWICE:
        x = x + 0.0 * tl.load(x_ptr + offsets, mask=mask)  # a second look at x
    if ADD:
        y = x + alpha
    elif NO_ALPHA:  # alpha forgotten: x copied through
        y = x
    else:
        y = alpha * x
    if MASK_STORE:
        tl.store(y_ptr + offsets, y, mask=mask)
    else:
        tl.store(y_ptr + offsets, y)


_SCALE = dict(USE_PID=True, OFF_BY_ONE=False, MASK_LOAD=True, LOAD_TWICE=False, ADD=False, MASK_STORE=True,
              NO_ALPHA=False)


def _scale(**flags):
    return variant(_scale_body, **{**_SCALE, **flags})


WRONG.add("masked-scale", "out-of-bounds-store", scale_kernel=_scale(MASK_LOAD=False, MASK_STORE=False))
WRONG.add("masked-scale", "off-by-one-block-edge", scale_kernel=_scale(OFF_BY_ONE=True))
WRONG.add("masked-scale", "out-of-bounds-load", scale_kernel=_scale(MASK_LOAD=False))
WRONG.add("masked-scale", "never-written", scale_kernel=_scale(USE_PID=False))
WRONG.add("masked-scale", "extra-traffic", scale_kernel=_scale(LOAD_TWICE=True))
WRONG.add("masked-scale", "added-not-multiplied", scale_kernel=_scale(ADD=True))
WRONG.add("masked-scale", "alpha-ignored", scale_kernel=_scale(NO_ALPHA=True))


# --------------------------------------------------------------------------------------------------------------
# tile-transpose
# --------------------------------------------------------------------------------------------------------------

@triton.jit
def _transpose_body(x_ptr, y_ptr, M, N, stride_xm, stride_xn, stride_ym, stride_yn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if SWAP_PIDS:
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if OFF_BY_ONE:
        mask = (rows[:, None] < M) & (cols[None, :] <= N)
    else:
        mask = (rows[:, None] < M) & (cols[None, :] < N)
    if ROW_STRIDE_IS_N:
        src = x_ptr + rows[:, None] * N + cols[None, :]
    else:
        src = x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn
    if MASK_ROWS_ONLY:
        tile = tl.load(src, mask=rows[:, None] < M)
    else:
        tile = tl.load(src, mask=mask)
    if COPY:
        dst = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    else:
        dst = y_ptr + cols[None, :] * stride_ym + rows[:, None] * stride_yn
    if MASK_STORE:
        tl.store(dst, tile, mask=mask)
    else:
        tl.store(dst, tile)


_TRANSPOSE = dict(SWAP_PIDS=False, OFF_BY_ONE=False, ROW_STRIDE_IS_N=False, MASK_ROWS_ONLY=False, COPY=False,
                  MASK_STORE=True)


def _transpose(**flags):
    return variant(_transpose_body, **{**_TRANSPOSE, **flags})


WRONG.add("tile-transpose", "not-transposed", transpose_kernel=_transpose(COPY=True))
WRONG.add("tile-transpose", "stride-ignored", transpose_kernel=_transpose(ROW_STRIDE_IS_N=True))
WRONG.add("tile-transpose", "out-of-bounds-load", transpose_kernel=_transpose(MASK_ROWS_ONLY=True))
WRONG.add("tile-transpose", "out-of-bounds-store", transpose_kernel=_transpose(MASK_STORE=False))
WRONG.add("tile-transpose", "off-by-one-block-edge", transpose_kernel=_transpose(OFF_BY_ONE=True))
WRONG.add("tile-transpose", "never-written", transpose_kernel=_transpose(SWAP_PIDS=True))


def test_a_missing_column_mask_is_not_called_off_by_one():
    # the grader's tiles overshoot the columns by 2: a missing mask strays twice as far as an off-by-one mask
    result = run_check("tile-transpose", LocalLearner({"transpose_kernel": _transpose(MASK_ROWS_ONLY=True)},
                                                     forbidden=[]))
    assert "out-of-bounds-load" in result.diagnosis and "off-by-one-block-edge" not in result.diagnosis, \
        result.message


# --------------------------------------------------------------------------------------------------------------
# outer-product
# --------------------------------------------------------------------------------------------------------------

@triton.jit
def _outer_body(x_ptr, y_ptr, out_ptr, M, N, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if TILE_LOAD:  # x "broadcast" by loading it as a (BLOCK_M, BLOCK_N) tile: each value read BLOCK_N times
        x = tl.load(x_ptr + rows[:, None] + 0 * cols[None, :], mask=inside)
        y = tl.load(y_ptr + cols, mask=cols < N)
        out = x * y[None, :]
    else:
        if MASK_LOADS:
            x = tl.load(x_ptr + rows, mask=rows < M)
            y = tl.load(y_ptr + cols, mask=cols < N)
        else:
            x = tl.load(x_ptr + rows)
            y = tl.load(y_ptr + cols)
        if ADD:
            out = x[:, None] + y[None, :]
        else:
            out = x[:, None] * y[None, :]
    if TRANSPOSED:
        out = tl.load(y_ptr + rows, mask=rows < M)[:, None] * tl.load(x_ptr + cols, mask=cols < N)[None, :]
    if ROW_STRIDE_IS_N:
        dst = out_ptr + rows[:, None] * N + cols[None, :]
    else:
        dst = out_ptr + rows[:, None] * stride_om + cols[None, :]
    if MASK_STORE:
        tl.store(dst, out, mask=inside)
    else:
        tl.store(dst, out)


_OUTER = dict(TILE_LOAD=False, MASK_LOADS=True, ADD=False, TRANSPOSED=False, ROW_STRIDE_IS_N=False, MASK_STORE=True)


def _outer(**flags):
    return variant(_outer_body, **{**_OUTER, **flags})


WRONG.add("outer-product", "extra-traffic", outer_kernel=_outer(TILE_LOAD=True))
WRONG.add("outer-product", "broadcast-by-loading", outer_kernel=_outer(TILE_LOAD=True))
WRONG.add("outer-product", "added-not-multiplied", outer_kernel=_outer(ADD=True))
WRONG.add("outer-product", "out-of-bounds-load", outer_kernel=_outer(MASK_LOADS=False))
WRONG.add("outer-product", "out-of-bounds-store", outer_kernel=_outer(MASK_STORE=False))
WRONG.add("outer-product", "stride-ignored", outer_kernel=_outer(ROW_STRIDE_IS_N=True))


@triton.jit
def outer_transposed(x_ptr, y_ptr, out_ptr, M, N, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + cols, mask=cols < N)  # x along the columns, y along the rows: swapped
    y = tl.load(y_ptr + rows, mask=rows < M)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y[:, None] * x[None, :],
             mask=(rows[:, None] < M) & (cols[None, :] < N))


WRONG.add("outer-product", "transposed", outer_kernel=outer_transposed)


# --------------------------------------------------------------------------------------------------------------
# row-sum
# --------------------------------------------------------------------------------------------------------------

@triton.jit
def _row_sum_body(x_ptr, out_ptr, n_cols, stride_xm, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    if ROW_STRIDE_IS_N:
        x_row = x_ptr + row * n_cols
    else:
        x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BLOCK_N,), tl.float32)
    if LOOP:
        if DROP_TAIL:
            stop = (n_cols // BLOCK_N) * BLOCK_N
        else:
            stop = n_cols
        for start in range(0, stop, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            if MASK:
                if OFF_BY_ONE:
                    acc += tl.load(x_row + cols, mask=cols <= n_cols, other=0.0)
                elif NO_OTHER:
                    acc += tl.load(x_row + cols, mask=cols < n_cols)  # the interpreter's zeros hide it
                else:
                    acc += tl.load(x_row + cols, mask=cols < n_cols, other=0.0)
            else:
                acc += tl.load(x_row + cols)
    else:
        cols = tl.arange(0, BLOCK_N)
        acc += tl.load(x_row + cols, mask=cols < n_cols, other=0.0)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


_ROW_SUM = dict(ROW_STRIDE_IS_N=False, LOOP=True, DROP_TAIL=False, MASK=True, OFF_BY_ONE=False, NO_OTHER=False)


def _row_sum(**flags):
    return variant(_row_sum_body, **{**_ROW_SUM, **flags})


WRONG.add("row-sum", "first-block-only", row_sum_kernel=_row_sum(LOOP=False))
WRONG.add("row-sum", "tail-dropped", row_sum_kernel=_row_sum(DROP_TAIL=True))
WRONG.add("row-sum", "out-of-bounds-load", row_sum_kernel=_row_sum(MASK=False))
WRONG.add("row-sum", "off-by-one-block-edge", row_sum_kernel=_row_sum(OFF_BY_ONE=True))
WRONG.add("row-sum", "stride-ignored", row_sum_kernel=_row_sum(ROW_STRIDE_IS_N=True))
WRONG.add("row-sum", "other-missing", row_sum_kernel=_row_sum(NO_OTHER=True))


# --------------------------------------------------------------------------------------------------------------
# softmax-kernel
# --------------------------------------------------------------------------------------------------------------

@triton.jit
def _softmax_body(output_ptr, input_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    if ROW_STRIDE_IS_N:
        x_row = input_ptr + row * n_cols
    else:
        x_row = input_ptr + row * input_row_stride
    if MASK:
        x = tl.load(x_row + cols, mask=cols < n_cols, other=OTHER)
    else:
        x = tl.load(x_row + cols)
    if SUBTRACT_MAX:
        if LOAD_TWICE:  # the max from one load, the exponentials from another
            x = tl.load(x_row + cols, mask=cols < n_cols, other=OTHER) - tl.max(x, axis=0)
        else:
            x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    if NORMALISE:
        y = e / tl.sum(e, axis=0)
    else:
        y = e
    if MASK:
        tl.store(output_ptr + row * output_row_stride + cols, y, mask=cols < n_cols)
    else:
        tl.store(output_ptr + row * output_row_stride + cols, y)


_SOFTMAX = dict(ROW_STRIDE_IS_N=False, MASK=True, OTHER=-float("inf"), SUBTRACT_MAX=True, LOAD_TWICE=False,
                NORMALISE=True)


def _softmax(**flags):
    return variant(_softmax_body, **{**_SOFTMAX, **flags})


WRONG.add("softmax-kernel", "masked-lanes-zero", softmax_kernel=_softmax(OTHER=0.0))
WRONG.add("softmax-kernel", "no-max-subtraction", softmax_kernel=_softmax(SUBTRACT_MAX=False))
WRONG.add("softmax-kernel", "out-of-bounds-store", softmax_kernel=_softmax(MASK=False))
WRONG.add("softmax-kernel", "not-normalised", softmax_kernel=_softmax(NORMALISE=False))
WRONG.add("softmax-kernel", "stride-ignored", softmax_kernel=_softmax(ROW_STRIDE_IS_N=True))
WRONG.add("softmax-kernel", "extra-traffic", softmax_kernel=_softmax(LOAD_TWICE=True))


# --------------------------------------------------------------------------------------------------------------
# online-softmax-kernel
# --------------------------------------------------------------------------------------------------------------

@triton.jit
def _online_body(output_ptr, input_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    x_row = input_ptr + row * input_row_stride
    y_row = output_ptr + row * output_row_stride
    m = -float("inf")
    l = 0.0
    if THREE_PASSES:  # the max first, then the sum, then the output: the row is read three times
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + tl.arange(0, BLOCK_SIZE)
            m = tl.maximum(m, tl.max(tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")), axis=0))
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + tl.arange(0, BLOCK_SIZE)
            l += tl.sum(tl.exp(tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")) - m), axis=0)
    else:
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + tl.arange(0, BLOCK_SIZE)
            if MASK_LOAD:
                x = tl.load(x_row + cols, mask=cols < n_cols, other=OTHER)
            else:
                x = tl.load(x_row + cols)
            if USE_MAX:
                m_new = tl.maximum(m, tl.max(x, axis=0))
            else:
                m_new = 0.0
            if RESCALE:
                l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            else:
                l = l + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
    if LOOP_PASS_2:
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + tl.arange(0, BLOCK_SIZE)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf"))
            if NORMALISE:
                tl.store(y_row + cols, tl.exp(x - m) / l, mask=cols < n_cols)
            else:
                tl.store(y_row + cols, tl.exp(x - m), mask=cols < n_cols)
    else:
        cols = tl.arange(0, BLOCK_SIZE)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf"))
        tl.store(y_row + cols, tl.exp(x - m) / l, mask=cols < n_cols)


_ONLINE = dict(THREE_PASSES=False, MASK_LOAD=True, OTHER=-float("inf"), USE_MAX=True, RESCALE=True, LOOP_PASS_2=True,
               NORMALISE=True)


def _online(**flags):
    return variant(_online_body, **{**_ONLINE, **flags})


WRONG.add("online-softmax-kernel", "sum-not-rescaled", online_softmax_kernel=_online(RESCALE=False))
WRONG.add("online-softmax-kernel", "masked-lanes-zero", online_softmax_kernel=_online(OTHER=0.0))
WRONG.add("online-softmax-kernel", "no-max-subtraction", online_softmax_kernel=_online(USE_MAX=False))
WRONG.add("online-softmax-kernel", "not-normalised", online_softmax_kernel=_online(NORMALISE=False))
WRONG.add("online-softmax-kernel", "extra-traffic", online_softmax_kernel=_online(THREE_PASSES=True))
WRONG.add("online-softmax-kernel", "more-than-two-passes", online_softmax_kernel=_online(THREE_PASSES=True))
WRONG.add("online-softmax-kernel", "never-written", online_softmax_kernel=_online(LOOP_PASS_2=False))
WRONG.add("online-softmax-kernel", "out-of-bounds-load", online_softmax_kernel=_online(MASK_LOAD=False))


# --------------------------------------------------------------------------------------------------------------
# tiled-matmul
# --------------------------------------------------------------------------------------------------------------

@triton.jit
def _matmul_body(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if SWAP_B_STRIDES:
        sbk, sbn = stride_bn, stride_bk
    else:
        sbk, sbn = stride_bk, stride_bn
    if A_ROW_STRIDE_IS_K:
        sam = K
    else:
        sam = stride_am
    if DROP_K_TAIL:
        stop = (K // BLOCK_K) * BLOCK_K
    else:
        stop = K
    for start in range(0, stop, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        if MASK_K:
            a_mask = (rows[:, None] < M) & (ks[None, :] < K)
            b_mask = (ks[:, None] < K) & (cols[None, :] < N)
        else:
            a_mask = rows[:, None] < M
            b_mask = cols[None, :] < N
        a = tl.load(a_ptr + rows[:, None] * sam + ks[None, :] * stride_ak, mask=a_mask, other=0.0)
        if RELOAD_A:  # A's tile read a second time in the same step
            a = tl.load(a_ptr + rows[:, None] * sam + ks[None, :] * stride_ak, mask=a_mask, other=0.0) + 0.0 * a
        b = tl.load(b_ptr + ks[:, None] * sbk + cols[None, :] * sbn, mask=b_mask, other=0.0)
        if ACCUMULATE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc = tl.dot(a, b, input_precision="ieee")
    dst = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    if MASK_STORE:
        tl.store(dst, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))
    else:
        tl.store(dst, acc)


_MATMUL = dict(SWAP_B_STRIDES=False, A_ROW_STRIDE_IS_K=False, DROP_K_TAIL=False, MASK_K=True, RELOAD_A=False,
               ACCUMULATE=True, MASK_STORE=True)


def _matmul(**flags):
    return variant(_matmul_body, **{**_MATMUL, **flags})


WRONG.add("tiled-matmul", "not-accumulated", matmul_kernel=_matmul(ACCUMULATE=False))
WRONG.add("tiled-matmul", "k-tail-dropped", matmul_kernel=_matmul(DROP_K_TAIL=True))
WRONG.add("tiled-matmul", "b-transposed", matmul_kernel=_matmul(SWAP_B_STRIDES=True))
WRONG.add("tiled-matmul", "out-of-bounds-load", matmul_kernel=_matmul(MASK_K=False))
WRONG.add("tiled-matmul", "out-of-bounds-store", matmul_kernel=_matmul(MASK_STORE=False))
WRONG.add("tiled-matmul", "stride-ignored", matmul_kernel=_matmul(A_ROW_STRIDE_IS_K=True))
WRONG.add("tiled-matmul", "extra-traffic", matmul_kernel=_matmul(RELOAD_A=True))


# --------------------------------------------------------------------------------------------------------------
# causal-tile
# --------------------------------------------------------------------------------------------------------------

@triton.jit
def _causal_body(s_ptr, out_ptr, n_q, n_k, stride_s, stride_o, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < n_q) & (cols[None, :] < n_k)
    if DIAGONAL == 0:
        keep = inside & (cols[None, :] <= rows[:, None])
    elif DIAGONAL == 1:
        keep = inside & (cols[None, :] < rows[:, None])
    else:
        keep = inside & (cols[None, :] >= rows[:, None])
    if ROW_STRIDE_IS_N:
        src = s_ptr + rows[:, None] * n_k + cols[None, :]
    else:
        src = s_ptr + rows[:, None] * stride_s + cols[None, :]
    if LOAD_WHOLE_TILE:
        s = tl.load(src, mask=inside, other=0.0)
    else:
        s = tl.load(src, mask=keep, other=0.0)
    if SCALE:
        s = s * scale
    out = tl.where(keep, s, FILL)
    if PID_SKIP:  # "tiles above the diagonal": right only when BLOCK_M == BLOCK_N
        if tl.program_id(1) > tl.program_id(0):
            out = tl.full((BLOCK_M, BLOCK_N), FILL, tl.float32)
    if MASK_STORE:
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out, mask=inside)
    else:
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out)


_CAUSAL = dict(DIAGONAL=0, ROW_STRIDE_IS_N=False, LOAD_WHOLE_TILE=False, SCALE=True, FILL=-float("inf"),
               MASK_STORE=True, PID_SKIP=False)


def _causal(**flags):
    return variant(_causal_body, **{**_CAUSAL, **flags})


WRONG.add("causal-tile", "off-by-one-diagonal", causal_mask_kernel=_causal(DIAGONAL=1))
WRONG.add("causal-tile", "mask-transposed", causal_mask_kernel=_causal(DIAGONAL=2))
WRONG.add("causal-tile", "filled-with-zero", causal_mask_kernel=_causal(FILL=0.0))
WRONG.add("causal-tile", "scale-forgotten", causal_mask_kernel=_causal(SCALE=False))
WRONG.add("causal-tile", "extra-traffic", causal_mask_kernel=_causal(LOAD_WHOLE_TILE=True))
WRONG.add("causal-tile", "masked-entries-read", causal_mask_kernel=_causal(LOAD_WHOLE_TILE=True))
WRONG.add("causal-tile", "out-of-bounds-store", causal_mask_kernel=_causal(MASK_STORE=False))
WRONG.add("causal-tile", "stride-ignored", causal_mask_kernel=_causal(ROW_STRIDE_IS_N=True))
WRONG.add("causal-tile", "tile-skip-by-program-id", causal_mask_kernel=_causal(PID_SKIP=True))


# --------------------------------------------------------------------------------------------------------------
# matmul-traffic-experiment: measured with the right kernel, read off the trace the wrong way
# --------------------------------------------------------------------------------------------------------------

MATMUL = _matmul()


def _interpreted_matmul():
    """The right matmul kernel as a notebook without a GPU defines it (TRITON_INTERPRET=1 when decorated), so
    that attnlab.memory.trace sees it run."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return _matmul()
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _measure(read):
    kernel = _interpreted_matmul()

    def matmul_traffic(M, N, K, block, seed=0):
        from attnlab.memory import trace

        g = torch.Generator().manual_seed(seed)
        a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)

        def run(a, b):
            # this process imported triton without TRITON_INTERPRET (a notebook without a GPU sets it first): its
            # tl helpers are interpreted only inside the session attnlab's own launches use
            from attnlab._interp_hooks import interpreter_session, jit_helpers_interpreted

            c = torch.empty(M, N)
            with interpreter_session(), jit_helpers_interpreted():
                kernel[(triton.cdiv(M, block), triton.cdiv(N, block))](
                    a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                    BLOCK_M=block, BLOCK_N=block, BLOCK_K=16)
            return c

        return read(trace(run, a, b))
    return matmul_traffic


# kept beside the emulations (formulas): each traces the right kernel, read the wrong way, so it proves that the
# emulation's formula is what such a learner measures (tile-counts-swapped, a formula, is proven by its emulation in
# tests/test_every_mistake.py)
WRONG.add("matmul-traffic-experiment", "writes-counted", matmul_traffic=_measure(lambda t: t.total_bytes))
WRONG.add("matmul-traffic-experiment", "unique-bytes", matmul_traffic=_measure(lambda t: t.unique_bytes_read))
WRONG.add("matmul-traffic-experiment", "elements-not-bytes", matmul_traffic=_measure(lambda t: t.bytes_read // 4))
WRONG.add("matmul-traffic-experiment", "a-only", matmul_traffic=_measure(lambda t: t.by_tensor["a_ptr"]["read"]))


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


# --------------------------------------------------------------------------------------------------------------
# the right kernels pass; traffic; shortcuts
# --------------------------------------------------------------------------------------------------------------

RIGHT = {"masked-scale": ("scale_kernel", _scale()), "tile-transpose": ("transpose_kernel", _transpose()),
         "outer-product": ("outer_kernel", _outer()), "row-sum": ("row_sum_kernel", _row_sum()),
         "softmax-kernel": ("softmax_kernel", _softmax()), "online-softmax-kernel": ("online_softmax_kernel", _online()),
         "tiled-matmul": ("matmul_kernel", MATMUL), "causal-tile": ("causal_mask_kernel", _causal()),
         "matmul-traffic-experiment": ("matmul_traffic", _measure(lambda t: t.bytes_read))}


@pytest.mark.parametrize("part", sorted(RIGHT))
def test_the_right_kernel_passes(part):
    name, obj = RIGHT[part]
    result = run_check(part, {name: obj})
    assert result.passed, result.message


def test_a_row_loaded_twice_fails_on_traffic_although_its_values_are_right():
    result = run_check("softmax-kernel", {"softmax_kernel": _softmax(LOAD_TWICE=True)})
    assert not result.passed and result.diagnosis == ["extra-traffic"], result.message
    assert "the budget is" in result.message and "(2.00x)" in result.message
    assert "values differ" not in result.message


def test_the_online_softmax_may_read_a_row_twice_but_not_three_times():
    assert run_check("online-softmax-kernel", {"online_softmax_kernel": _online()}).passed
    result = run_check("online-softmax-kernel", {"online_softmax_kernel": _online(THREE_PASSES=True)})
    assert not result.passed and "extra-traffic" in result.diagnosis and "(1.50x)" in result.message


def test_the_matmul_budget_is_the_tiled_traffic_model():
    from attnlab.grading.exercises.e06.checks import matmul_budget
    from attnlab.iomodel import matmul_io

    m, n, k, b = 40, 24, 40, 16
    budget = matmul_budget(m, n, k, b, b)
    assert budget["a"][0] + budget["b"][0] == matmul_io(m, n, k, 4, b, b).bytes_read
    assert budget["a"][0] == 4 * m * k * 2 and budget["b"][0] == 4 * k * n * 3


def test_the_causal_budget_counts_only_tiles_that_keep_an_entry():
    from attnlab.grading.exercises.e06.spec import tiles_touching_causal

    assert tiles_touching_causal(16, 16, 8, 8) == 3 * 64  # the tile above the diagonal is skipped
    assert tiles_touching_causal(9, 24, 8, 8) == 8 * 8 + 1 * 16  # row tile 0: one tile; row 8: two
    assert tiles_touching_causal(20, 13, 8, 8) == 20 * 13 - 8 * 5  # only tile (0, 1) is wholly masked


def test_the_traffic_check_is_skipped_only_on_a_gpu_and_says_so(monkeypatch):
    from attnlab.grading import kernel_check
    from attnlab.grading.core import Fail

    with pytest.raises(Fail, match="no trace"):     # on the CPU every launch is traced: none is no measurement
        kernel_check.check_traffic("k", "case", {}, {"x": (1, 1)})
    result = run_check("masked-scale", {"scale_kernel": _scale()})
    assert result.passed and "traffic within budget (x read once, y written once)" in result.message, result.message
    monkeypatch.setattr(kernel_check, "_device", lambda: "cuda")
    assert kernel_check.check_traffic("k", "case", {}, {"x": (1, 1)}) is False
    # the grader's side sees a GPU: the launch is not traced, and the pass says the traffic went unchecked
    result = run_check("masked-scale", {"scale_kernel": _scale(LOAD_TWICE=True)})
    assert result.passed and "traffic not checked: on a GPU" in result.message, result.message


def test_a_fake_kernel_is_refused():
    class FakeKernel:  # kernel[grid](...) that does the work in PyTorch
        def __getitem__(self, grid):
            return lambda y, x, sx, sy, n, BLOCK_SIZE=None: y.copy_(torch.softmax(x, -1))

    result = run_check("softmax-kernel", {"softmax_kernel": FakeKernel()})
    assert not result.passed and "must be a Triton kernel" in result.message


@triton.jit
def _calls_the_library(x_ptr, y_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):
    import attnlab.attention

    attnlab.attention.causal_mask(2)  # runs as Python in the interpreter: a library call, refused
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    tl.store(y_ptr + offsets, alpha * tl.load(x_ptr + offsets, mask=offsets < n_elements), mask=offsets < n_elements)


@triton.jit
def _calls_torch_softmax(output_ptr, input_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    torch.softmax(torch.zeros(2), 0)  # a forbidden call while the kernel runs
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    x = tl.load(input_ptr + row * input_row_stride + cols, mask=cols < n_cols, other=-float("inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(output_ptr + row * output_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@pytest.mark.parametrize("part, names", [
    ("masked-scale", {"scale_kernel": _calls_the_library}),
    ("softmax-kernel", {"softmax_kernel": _calls_torch_softmax}),
    ("online-softmax-kernel", {"online_softmax_kernel": _calls_torch_softmax}),
    ("matmul-traffic-experiment",
     {"matmul_traffic": lambda M, N, K, block, seed=0: __import__("attnlab.iomodel", fromlist=["x"]).matmul_io(
         M, N, K, 4, block, block).bytes_read}),
])
def test_a_forbidden_call_is_refused_as_a_shortcut(part, names):
    result = run_check(part, LocalLearner(dict(names)))
    assert not result.passed and "shortcut" in result.diagnosis, result.message


# --------------------------------------------------------------------------------------------------------------
# the demo cells' guarded launch, and feedback that names what happened
# --------------------------------------------------------------------------------------------------------------

@triton.jit
def _unmasked_scale(x_ptr, y_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    x = tl.load(x_ptr + offsets)  # the most natural first mistake: no mask
    tl.store(y_ptr + offsets, alpha * x)


def test_a_guarded_demo_launch_names_the_missing_mask_and_touches_nothing(capsys):
    from attnlab.guard import guarded

    x = torch.randn(1000)
    memory = torch.full((1024 + 2048,), 7.0)  # y sits inside: a stray store would change what lies after it
    y = memory[:1000]
    assert guarded(_unmasked_scale)[(8,)](x, y, 1000, 3.0, BLOCK_SIZE=128) is False
    out = capsys.readouterr().out
    assert "out-of-bounds load" in out and "past the end of `x_ptr`" in out and "mask=offs < n" in out, out
    assert (memory[1000:] == 7.0).all()  # stopped before any access outside the tensors
    assert guarded(_scale())[(8,)](x, y, 1000, 3.0, BLOCK_SIZE=128) is True  # a right kernel: silent
    assert capsys.readouterr().out == "" and torch.allclose(y, 3.0 * x)


def test_a_guarded_launch_keeps_the_tracer_s_counts():
    from attnlab.guard import guarded
    from attnlab.memory import trace

    x, y = torch.randn(1000), torch.empty(1000)
    t = trace(lambda: guarded(_scale())[(8,)](x, y, 1000, 3.0, BLOCK_SIZE=128))
    assert t.by_tensor["x_ptr"]["read"] == 4000 and t.by_tensor["y_ptr"]["written"] == 4000


@triton.jit
def _indexes_a_pointer(x_ptr, y_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):
    offsets = tl.arange(0, BLOCK_SIZE)
    x = tl.load(x_ptr[offsets])
    tl.store(y_ptr + offsets, x)


@triton.jit
def _torch_in_kernel(x_ptr, y_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):
    offsets = tl.arange(0, BLOCK_SIZE)
    x = tl.load(x_ptr + offsets)
    tl.store(y_ptr + offsets, torch.exp(x))


@triton.jit
def _runtime_arange(x_ptr, y_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):
    offsets = tl.arange(0, n_elements)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets))


@pytest.mark.parametrize("kernel, words", [(_indexes_a_pointer, "a pointer is not an array"),
                                           (_torch_in_kernel, "a torch function was called inside the kernel"),
                                           (_runtime_arange, "tl.arange needs bounds known")])
def test_interpreter_errors_show_the_learner_s_line_and_one_plain_sentence(kernel, words):
    from attnlab._interp_hooks import interpreted, interpreter_session
    from attnlab.grading.feedback import describe_exception

    with pytest.raises(Exception) as info, interpreter_session():  # as in a notebook with TRITON_INTERPRET=1
        interpreted(kernel.fn)[(1,)](torch.randn(16), torch.empty(16), 16, 1.0, BLOCK_SIZE=16)
    text = describe_exception(info.value)
    first = text.splitlines()[0]
    assert f"of `{kernel.fn.__name__}` (your code)" in first and "interpreter.py" not in text, text
    assert words in text, text
    assert len(text.splitlines()) == 2  # the learner's line and the sentence: no 40-line traceback


def test_the_check_reports_a_kernel_error_in_plain_words():
    result = run_check("masked-scale", LocalLearner({"scale_kernel": _indexes_a_pointer}, forbidden=[]))
    assert not result.passed and "a pointer is not an array" in result.message, result.message
    assert result.diagnosis == ["pointer-indexed"], result.message


def test_counterexamples_label_arguments_and_count_as_the_learner_does():
    from attnlab.grading.core import case_line, mismatch

    got, want = torch.tensor([1.0, 2.0, 5.0]), torch.tensor([1.0, 2.0, 3.0])
    assert mismatch(got, want).endswith("first mismatch at index 2: expected 3, got 5")  # a 1-D output's own index
    pair = mismatch((want, got), (want, want))
    assert pair.startswith("output 2 of 2: ") and pair.endswith("first mismatch at index 2: expected 3, got 5"), pair
    line = case_line("n=3", (want, 0.5), {}, names=("x", "alpha"))
    assert "x: tensor of shape (3,)" in line and "alpha: 0.5" in line, line
    result = run_check("row-sum", LocalLearner({"row_sum_kernel": _row_sum(DROP_TAIL=True)}, forbidden=[]))
    assert "x: tensor of shape" in result.message and "BLOCK_N: 16" in result.message, result.message
    assert "at index (0," not in result.message, result.message  # out is (M,), not the grader's (1, M) buffer


def test_mismatch_says_what_assert_close_says_and_where_the_output_first_differs():
    from attnlab.grading.core import mismatch

    want = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = want.clone()
    got[1, 0] = 9.0
    why = mismatch(got, want)
    try:
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-5)
    except AssertionError as exc:
        said = str(exc)
    assert "Mismatched elements: 1 / 4 (25.0%)" in said and "1 / 4 entries differ (25.0%)" in why, why
    assert "greatest absolute difference: 6.0 at index (1, 0)" in why, why
    assert why.endswith("first mismatch at index (1, 0): expected 3, got 9"), why
    assert mismatch(want.double() + 1e-7, want) is None                      # any real dtype, within tolerance
    assert "shape" in mismatch(torch.ones(3), want) and "(yours != the spec's)" in mismatch(torch.ones(3), want)
    assert "dtype" in mismatch(want > 2, want)                                # a bool for a float is refused
    assert mismatch(torch.tensor([1.0, 2.0, 5.0]), torch.tensor([1.0, 2.0, 3.0])).endswith(
        "first mismatch at index 2: expected 3, got 5")                       # a 1-D output's own index
    nan = want.clone()
    nan[0, 1] = float("nan")
    assert "expected 2, got nan" in mismatch(nan, want)
    assert mismatch(nan, nan, equal_nan=True) is None
    assert mismatch((want, got), (want, want)).startswith("output 2 of 2: values differ")


def test_check_output_wraps_at_word_boundaries():
    from attnlab.grading.feedback import WIDTH

    result = run_check("row-sum", LocalLearner({"row_sum_kernel": _row_sum(DROP_TAIL=True)}, forbidden=[]))
    text = result.report()
    words = set(result.message.split())
    for line in text.splitlines():
        assert len(line) <= WIDTH or " " not in line.strip(), line
        assert all(w in words or w.startswith("[") or w.endswith(":") for w in line.split()), line


def test_exercise_06_with_an_unmasked_part_1_runs_to_the_end_with_the_mask_named(tmp_path):
    """The most natural first mistake, in the notebook itself: the locked demo cell below the answer launches the
    kernel guarded, so a fresh kernel runs every cell (the other parts answered), stays alive, and part 1's check
    names the missing mask."""
    import pathlib

    import nbformat
    from nbclient import NotebookClient

    root = pathlib.Path(__file__).resolve().parents[1]
    nb = nbformat.read(root / "solutions" / "06_triton_primer.ipynb", as_version=4)
    answer = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "masked-scale-answer")
    head, rest = answer.source.split("    ### BEGIN SOLUTION\n")
    answer.source = head + (
        "    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)\n"
        "    x = tl.load(x_ptr + offsets)\n"
        "    tl.store(y_ptr + offsets, alpha * x)\n")
    assert "tl.load(x_ptr + offsets)" in answer.source
    for cell in nb.cells:  # what the learner's notebook holds: no hidden tests (nbgrader's autograder runs those)
        if "### BEGIN HIDDEN TESTS" in cell.source:
            cell.source = re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS\n?", "", cell.source, flags=re.S)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError if any cell fails, DeadKernelError if the kernel dies

    def text(cell):
        return "".join(o.get("text", "") for o in cell.get("outputs", []))

    index = nb.cells.index(answer)
    demo, graded = nb.cells[index + 1], nb.cells[index + 2]
    assert "an out-of-bounds load" in text(demo) and "past the end of `x_ptr`" in text(demo), text(demo)
    assert "[FAIL] masked-scale" in text(graded) and "out-of-bounds" in text(graded), text(graded)
    assert "no common mistake matches" not in text(graded), text(graded)
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    assert last.get("execution_count"), "the notebook did not run to its end"
    assert "[PASS] causal-tile" in text(next(c for c in nb.cells if 'check("causal-tile")' in c.source))


def test_extra_traffic_is_told_in_the_part_s_own_budget():
    # the online softmax may read each row twice: "load each input element once" would contradict the part
    result = run_check("online-softmax-kernel", LocalLearner({"online_softmax_kernel": _online(THREE_PASSES=True)},
                                                             forbidden=[]))
    assert "extra-traffic" in result.diagnosis and "at most twice" in result.message, result.message
    assert "load each input element once" not in result.message, result.message
