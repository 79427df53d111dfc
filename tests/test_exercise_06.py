"""Exercise 06 (the Triton primer): wrong implementations fail their check with the matching diagnosis."""


import triton
import triton.language as tl

from mistakes import Wrong

WRONG = Wrong()


WRONG.add("softmax-traffic", "elements-not-bytes", softmax_traffic=lambda m, n, es=4: (8 * m * n + 4 * m, 2 * m * n))
WRONG.add("softmax-traffic", "reads-only", softmax_traffic=lambda m, n, es=4: ((5 * m * n + 2 * m) * es, m * n * es))
WRONG.add("softmax-traffic", "row-vectors-forgotten", softmax_traffic=lambda m, n, es=4: (8 * m * n * es, 2 * m * n * es))


@triton.jit
def scale_no_mask(x_ptr, y_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    tl.store(y_ptr + offs, alpha * tl.load(x_ptr + offs))


@triton.jit
def scale_off_by_one(x_ptr, y_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs <= n_elements
    tl.store(y_ptr + offs, alpha * tl.load(x_ptr + offs, mask=mask), mask=mask)


@triton.jit
def scale_load_unmasked(x_ptr, y_ptr, n_elements, alpha, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, alpha * x + 0.0 * tl.sum(x, axis=0), mask=offs < n_elements)


WRONG.add("masked-scale", "out-of-bounds-store", scale_kernel=scale_no_mask)
WRONG.add("masked-scale", "off-by-one-block-edge", scale_kernel=scale_off_by_one)
WRONG.add("masked-scale", "out-of-bounds-load", scale_kernel=scale_load_unmasked)


@triton.jit
def softmax_other_zero(output_ptr, input_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    x = tl.load(input_ptr + row * input_row_stride + cols, mask=cols < n_cols, other=0.0)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(output_ptr + row * output_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@triton.jit
def softmax_no_max(output_ptr, input_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    x = tl.load(input_ptr + row * input_row_stride + cols, mask=cols < n_cols, other=-float("inf"))
    e = tl.exp(x)
    tl.store(output_ptr + row * output_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@triton.jit
def softmax_no_mask(output_ptr, input_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    x = tl.load(input_ptr + row * input_row_stride + cols)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(output_ptr + row * output_row_stride + cols, e / tl.sum(e, axis=0))


WRONG.add("softmax-kernel", "masked-lanes-zero", softmax_kernel=softmax_other_zero)
WRONG.add("softmax-kernel", "no-max-subtraction", softmax_kernel=softmax_no_max)
WRONG.add("softmax-kernel", "out-of-bounds-store", softmax_kernel=softmax_no_mask)


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()
