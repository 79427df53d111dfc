"""Fused row softmax: the first kernel of the course (after Triton's tutorial 02).

What you learn here:

* why a softmax written as separate PyTorch operations moves ~5x more memory than it needs;
* how one Triton program per row (or, in the interpreter, per group of rows) keeps the row in on-chip memory (registers/SRAM) between
  the max, the exponentials, the sum and the division, so the row is read once and
  written once;
* what happens when a row is too long to fit: the kernel falls back to two passes over the
  row (online max and sum, then normalise) and reads it twice.

Memory traffic is counted in elements in the comments; multiply by the element size for
bytes. ``attnlab.iomodel.softmax_io`` predicts the same numbers and ``attnlab.memory.trace``
measures them from the kernel itself.
"""

import torch
import triton
import triton.language as tl

from attnlab import validate

from ._runtime import check_interpreter_dtype, jit, use_interpreter

__all__ = ["softmax", "naive_softmax", "softmax_block_size", "rows_per_program", "MAX_FUSED_BLOCK", "softmax_kernel"]


def naive_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax in plain PyTorch, one operation at a time. x: (M, N) -> (M, N)."""
    validate.tensor(x, "x", 2, "(M, N)", floating=True)
    # read  MN elements; write M elements
    x_max = x.max(dim=1)[0]
    # read MN + M elements; write MN elements
    z = x - x_max[:, None]
    # read  MN elements; write MN elements
    numerator = torch.exp(z)
    # read  MN elements; write M elements
    denominator = numerator.sum(dim=1)
    # read MN + M elements; write MN elements
    return numerator / denominator[:, None]
    # in total: read 5MN + 2M elements, write 3MN + 2M elements.
    # A fused kernel reads MN and writes MN: about 4x less traffic.


# The longest row the kernel keeps on chip in one piece. Longer rows take the two-pass loop.
# On a GPU a row of 16384 fp32 values is 64 KiB: already more than one program should hold
# in registers. The interpreter has no registers to run out of.
MAX_FUSED_BLOCK = 16384


@jit
def _softmax_kernel(
    S, P,                      # input scores (M, N) and output probabilities (M, N)
    stride_s_row, stride_p_row,
    n_rows, n_cols,
    BLOCK: tl.constexpr,       # power of two >= n_cols (one pass) or the loop's chunk (two passes)
    ROWS: tl.constexpr,        # rows per program: 1 on a GPU (tutorial 02), many in the interpreter
    ONE_PASS: tl.constexpr,
):
    # each program takes ROWS rows at a time (a grid-stride loop keeps the grid small on a GPU)
    first = tl.program_id(0) * ROWS
    step = tl.num_programs(0) * ROWS
    for row0 in range(first, n_rows, step):
        rows = row0 + tl.arange(0, ROWS)
        s_rows = S + rows[:, None] * stride_s_row
        p_rows = P + rows[:, None] * stride_p_row
        row_ok = rows[:, None] < n_rows
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            mask = row_ok & (cols[None, :] < n_cols)
            # read ROWS * n_cols elements (the padding up to BLOCK is masked off: it costs nothing)
            x = tl.load(s_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            x_max = tl.max(x, axis=1)
            # a row of -inf (everything masked out) gives zeros, not NaN
            x_max = tl.where(x_max == float("-inf"), 0.0, x_max)
            num = tl.exp(x - x_max[:, None])
            den = tl.sum(num, axis=1)
            den = tl.where(den == 0.0, 1.0, den)
            # write ROWS * n_cols elements
            tl.store(p_rows + cols[None, :], (num / den[:, None]).to(P.dtype.element_ty), mask=mask)
        else:
            # pass 1: running max m and running sum l of exp(x - m), chunk by chunk
            # read ROWS * n_cols elements
            m = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
            l = tl.zeros([ROWS, BLOCK], tl.float32)
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(s_rows + cols[None, :], mask=row_ok & (cols[None, :] < n_cols), other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m, x)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l = l * tl.exp(m - m_safe) + tl.exp(x - m_safe)
                m = m_new
            row_max = tl.max(m, axis=1)
            row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
            den = tl.sum(l * tl.exp(m - row_max[:, None]), axis=1)
            den = tl.where(den == 0.0, 1.0, den)
            # pass 2: normalise. read ROWS * n_cols elements again; write ROWS * n_cols elements
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = row_ok & (cols[None, :] < n_cols)
                x = tl.load(s_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                tl.store(p_rows + cols[None, :], (tl.exp(x - row_max[:, None]) / den[:, None]).to(P.dtype.element_ty), mask=mask)
    # in total: read M * n_cols (one pass) or 2 * M * n_cols (two passes); write M * n_cols


# In the interpreter a program costs a fixed amount per operation whatever its size, so each
# program takes about this many elements' worth of rows.
INTERPRETER_TILE = 1 << 16


# the kernel under a public name, for lessons that show or trace it (the private name stays)
softmax_kernel = _softmax_kernel


def softmax_block_size(n_cols: int) -> tuple[int, bool]:
    """(BLOCK, one_pass) the kernel uses for rows of ``n_cols`` elements."""
    block = triton.next_power_of_2(max(int(n_cols), 1))
    if block <= MAX_FUSED_BLOCK:
        return block, True
    return MAX_FUSED_BLOCK, False


def softmax_num_warps(block: int) -> int:
    """Warps per program on a GPU: a row of ``block`` floats is spread over the program's
    threads, and with 4 warps a 16384-wide block is 128 values per thread, more than the
    registers hold (ptxas spills them to local memory). Triton's softmax tutorial scales the
    warps with the block in the same way."""
    return 4 if block < 2048 else 8 if block < 8192 else 16


def rows_per_program(block: int, device) -> int:
    """How many rows one program of the row-wise kernels handles."""
    return max(1, INTERPRETER_TILE // block) if use_interpreter(device) else 1


def _launch_softmax(s: torch.Tensor, p: torch.Tensor) -> None:
    """Row softmax of the 2-D views s -> p (both (M, N), last dim contiguous)."""
    n_rows, n_cols = s.shape
    block, one_pass = softmax_block_size(n_cols)
    rows = rows_per_program(block, s.device)
    n_prog = triton.cdiv(n_rows, rows)
    if use_interpreter(s.device):
        grid, extra = (n_prog,), {}
    else:
        grid = (min(n_prog, 8 * torch.cuda.get_device_properties(s.device).multi_processor_count),)
        extra = {"num_warps": softmax_num_warps(block)}
    _softmax_kernel[grid](s, p, s.stride(0), p.stride(0), n_rows, n_cols, BLOCK=block, ROWS=rows, ONE_PASS=one_pass,
                          **extra)


def _check_softmax_input(x):
    validate.tensor(x, "x", dtypes=(torch.float32, torch.float16, torch.bfloat16), nonempty=True)
    if x.dim() < 1:
        raise ValueError(f"x: expected at least one dimension, got shape {tuple(x.shape)}")
    check_interpreter_dtype(x=x)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along ``dim`` (the last by default, like :func:`attnlab.softmax`) with one fused Triton kernel.

    x: (..., N) float32 or float16 (bfloat16 on a GPU) -> same shape and dtype.
    Rows that are entirely ``-inf`` give zeros. Another ``dim`` is moved last for the kernel (a copy)
    and back.

    Example: ``softmax(torch.randn(4, 1000))``
    """
    _check_softmax_input(x)
    dim = validate.dim(dim, x)
    if dim % x.dim() != x.dim() - 1:
        return softmax(x.movedim(dim, -1)).movedim(-1, dim)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y2 = torch.empty_like(x2)
    _launch_softmax(x2, y2)
    return y2.reshape(x.shape)
