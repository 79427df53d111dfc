"""Vector addition: the smallest Triton kernel, and the first one of the course (after Triton's tutorial 01).

What you learn here:

* a kernel is launched as a *grid* of programs; each program knows its index
  (``tl.program_id``) and nothing else about the others;
* a program works on a *block* of ``BLOCK`` elements at once: ``tl.arange(0, BLOCK)``
  is a vector of offsets, and ``X + offsets`` is a vector of *pointers*;
* ``tl.load`` and ``tl.store`` move whole blocks between global memory (HBM on a GPU)
  and the program's registers; the *mask* turns off the lanes that would fall past the
  end of the array when ``n`` is not a multiple of ``BLOCK``.

Memory traffic, counted in elements: read ``2n``, write ``n``; nothing else. PyTorch's
``x + y`` moves exactly the same: addition has nothing to fuse.
"""

import torch
import triton
import triton.language as tl

from attnlab import validate

from ._runtime import check_interpreter_dtype, jit

__all__ = ["vector_add", "add_kernel"]


@jit
def add_kernel(
    X, Y, Z,                 # pointers to the first element of x, y and the output z
    n,                       # number of elements
    BLOCK: tl.constexpr,     # elements per program (a power of two, known at compile time)
):
    pid = tl.program_id(0)                   # which program am I? 0, 1, ..., cdiv(n, BLOCK) - 1
    offsets = pid * BLOCK + tl.arange(0, BLOCK)  # the BLOCK element indices this program owns
    mask = offsets < n                       # the last program may run past the end: switch those lanes off
    x = tl.load(X + offsets, mask=mask)      # read BLOCK elements of x (masked lanes read nothing)
    y = tl.load(Y + offsets, mask=mask)      # read BLOCK elements of y
    tl.store(Z + offsets, x + y, mask=mask)  # write BLOCK elements of z
    # per program: read 2 * BLOCK, write BLOCK elements; in total read 2n, write n


def _check_add_args(x, y, block):
    """x and y: 1-D floating tensors of one shape, dtype and device; block: a power of two."""
    for name, t in (("x", x), ("y", y)):
        validate.tensor(t, name, 1, floating=True)
    validate.like(y, "y", x, "x")
    if y.shape != x.shape:
        raise ValueError(f"y: expected shape {tuple(x.shape)} like x, got {tuple(y.shape)}")
    validate.power_of_two(block, "block", minimum=1)
    check_interpreter_dtype(x=x, y=y)


def vector_add(x: torch.Tensor, y: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``x + y`` for two 1-D tensors, by :func:`add_kernel`: one program per ``block`` elements.

    x, y: ``(n,)`` on the same device, same floating dtype -> ``(n,)``.
    CPU tensors run in Triton's interpreter, CUDA tensors natively.

    Example: ``vector_add(torch.arange(5.0), torch.ones(5))``
    """
    _check_add_args(x, y, block)
    x, y = x.contiguous(), y.contiguous()
    z = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return z
    grid = (triton.cdiv(n, block),)  # enough programs to cover n elements
    add_kernel[grid](x, y, z, n, BLOCK=block)
    return z
