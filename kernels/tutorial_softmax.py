"""Fused softmax at the size of Triton's tutorial 02: one row per program, nothing else.

What you learn here:

* a program can keep a whole row on the chip between the max, the exponentials, the sum and
  the division, so the row is read from global memory once and written once;
* the mask at the end of the row loads ``-inf``, which adds ``exp(-inf) = 0`` to the sum:
  any row length works with a power-of-two block.

This is the kernel to read first. ``softmax.py`` is the one the course ships: the same body,
plus what this one leaves out (several rows per program, a grid-stride loop, rows longer
than one block, rows that are entirely ``-inf``). Lesson 06 sets the two side by side.

Memory traffic, counted in elements for an (M, N) input: read MN, write MN. The unfused
PyTorch softmax (``softmax.naive_softmax``) reads 5MN + 2M and writes 3MN + 2M.
"""

import torch
import triton
import triton.language as tl

from ._runtime import jit
from .softmax import _check_softmax_input

__all__ = ["tutorial_softmax", "softmax_row_kernel"]


@jit
def softmax_row_kernel(
    X, Y,                    # input (M, N) and output (M, N), rows contiguous
    stride_x, stride_y,      # elements from one row to the next
    n_cols,                  # N
    BLOCK: tl.constexpr,     # a power of two >= N: the whole row is one block
):
    row = tl.program_id(0)                              # one program per row
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols                                # lanes past the end of the row are off
    # read N elements (masked lanes load -inf and cost nothing)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
    z = x - tl.max(x, axis=0)                           # on chip: subtract the row max (lesson 03)
    num = tl.exp(z)                                     # exp(-inf) = 0 on the masked lanes
    den = tl.sum(num, axis=0)
    # write N elements
    tl.store(Y + row * stride_y + cols, (num / den).to(Y.dtype.element_ty), mask=mask)
    # in total, M programs: read MN elements, write MN elements


def tutorial_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax of a 2-D tensor by :func:`softmax_row_kernel`, one program per row.

    x: (M, N) float32 or float16 (bfloat16 on a GPU) -> (M, N), same dtype. A row must fit
    in one block (any N the shipped ``softmax`` takes in one pass, N <= 16384); a row that is
    entirely ``-inf`` gives NaN here (``softmax`` gives zeros).

    Example: ``tutorial_softmax(torch.randn(4, 1000))``
    """
    _check_tutorial_input(x)
    x = x.contiguous()
    y = torch.empty_like(x)
    n_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)              # the whole row in one block
    softmax_row_kernel[(n_rows,)](x, y, x.stride(0), y.stride(0), n_cols, BLOCK=block)
    return y


def _check_tutorial_input(x):
    _check_softmax_input(x)
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor (rows, cols), got shape {tuple(x.shape)}")
    if x.shape[1] > 16384:
        raise ValueError(f"x: expected rows of at most 16384 elements (one block; attnlab.kernels.softmax takes "
                         f"longer rows in two passes), got shape {tuple(x.shape)}")
