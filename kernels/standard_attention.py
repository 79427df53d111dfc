"""Standard (unfused) attention as Triton kernels: the baseline whose memory traffic the course counts.

What you learn here:

* attention written the way a framework runs it without fusion: three kernels, each of
  which reads its inputs from global memory (HBM on a GPU) and writes its output back:
  ``S = Q K^T * scale`` (an Nq x Nk matrix written out), ``P = softmax(S)`` (read and
  written again), ``O = P V`` (read once more);
* that even when each kernel is tiled well, the Nq x Nk matrices S and P make the traffic
  grow with N^2 while the inputs and output grow with N d;
* the backward pass done the same way (Dao et al. 2022, Algorithm 3): ``dV = P^T dO``,
  ``dP = dO V^T``, ``dS = P * (dP - rowsum(P * dP))``, ``dQ = dS K``, ``dK = dS^T Q``, each a
  kernel that reads and writes N x N matrices. It needs P saved from the forward.

Compare with ``flash_attention.py``, which never writes S or P. ``attnlab.iomodel``
(``standard_forward_io``, ``standard_backward_io``) predicts the traffic of these kernels
exactly; ``attnlab.memory.trace`` measures it.

Causal attention here writes ``-inf`` above the diagonal of S and the softmax turns it into
zeros of P; nothing is skipped, so causal traffic equals non-causal traffic (this is the
unfused baseline).

S is stored in float32 whatever the inputs' dtype; P, dP and dS are stored in the inputs' dtype.
The softmax is exact under a shift of a row, so what matters in S is its *absolute* error, and
float16 keeps a *relative* one: near a score of 40,000 (what inputs of magnitude 100 give at
d = 64) float16's spacing is 32, so rounding moves a score by up to 16, P by factors up to e^16
and O by hundreds. P is in [0, 1]
and only ever needs float16's relative error (FlashAttention rounds its P the same way before
the PV product). For float16 inputs this makes S's write and its read by the softmax cost 4
bytes an element: ``iomodel.standard_forward_io(..., score_bytes=4)``.
"""

import torch
import triton
import triton.language as tl

from attnlab import validate

from ._runtime import dot_precision, jit, use_interpreter
from ._tuning import device_capability as gpu_capability
from .softmax import _launch_softmax, rows_per_program, softmax_num_warps

__all__ = ["standard_attention", "standard_block_sizes"]


# The naive version, for comparison, is three PyTorch lines:
#   s = q @ k.transpose(-2, -1) * scale      # read (Nq + Nk) d;   write Nq Nk
#   p = torch.softmax(s, dim=-1)             # read Nq Nk;         write Nq Nk
#   o = p @ v                                # read Nq Nk + Nk d;  write Nq d
# The kernels below do the same with the reads of tiled kernels counted exactly.
# Each kernel opens with the same few lines (program ids, batch and head, row offsets, the first
# load) as the kernels of flash_attention.py do: written out in each on purpose, as in Triton's
# tutorials, so that every kernel reads on its own from top to bottom.


@jit
def _scores_kernel(
    Q, K, S,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_sb, stride_sh, stride_sm,
    H, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # one program per (block of BLOCK_M query rows, batch x head): S[rows, :] = Q[rows] K^T * scale
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    # read BLOCK_M * d elements of Q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :],
                mask=offs_m[:, None] < N_Q, other=0.0)
    s_base = S + b * stride_sb + h * stride_sh
    for start_n in range(0, N_K, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # read BLOCK_N * d elements of K
        k = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                    mask=offs_n[:, None] < N_K, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
        if CAUSAL:
            s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        # write BLOCK_M * BLOCK_N elements of S (float32): the N x N matrix goes to global memory
        tl.store(s_base + offs_m[:, None] * stride_sm + offs_n[None, :], s.to(S.dtype.element_ty),
                 mask=(offs_m[:, None] < N_Q) & (offs_n[None, :] < N_K))
    # per (batch, head): read Nq d + ceil(Nq / BLOCK_M) Nk d; write Nq Nk (4 bytes each)


@jit
def _pv_kernel(
    P, V, O,
    stride_pb, stride_ph, stride_pm, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
    H, N_Q, N_K,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # one program per (block of BLOCK_M rows, batch x head): O[rows] = P[rows, :] V
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    p_base = P + b * stride_pb + h * stride_ph
    for start_n in range(0, N_K, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # read BLOCK_M * BLOCK_N elements of P (the N x N matrix comes back from global memory)
        p = tl.load(p_base + offs_m[:, None] * stride_pm + offs_n[None, :],
                    mask=(offs_m[:, None] < N_Q) & (offs_n[None, :] < N_K), other=0.0)
        # read BLOCK_N * d elements of V
        v = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                    mask=offs_n[:, None] < N_K, other=0.0)
        acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    # write BLOCK_M * d elements of O
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=offs_m[:, None] < N_Q)
    # per (batch, head): read Nq Nk + ceil(Nq / BLOCK_M) Nk d; write Nq d


@jit
def _matmul_kernel(
    A, B, C,                      # C = alpha * A @ B for each of the `lead` matrices; any strides
    M, N, K, alpha,
    stride_al, stride_am, stride_ak, stride_bl, stride_bk, stride_bn, stride_cl, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # the backward's four products (tutorial 03's tiled matmul, batched over batch x head)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    lead = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start_k in range(0, K, BLOCK_K):
        offs_k = start_k + tl.arange(0, BLOCK_K)
        # read BLOCK_M * BLOCK_K elements of A and BLOCK_K * BLOCK_N elements of B
        a = tl.load(A + lead * stride_al + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        b = tl.load(B + lead * stride_bl + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION)
    acc = acc * alpha
    # write BLOCK_M * BLOCK_N elements of C
    tl.store(C + lead * stride_cl + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(C.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
    # per matrix: read M K ceil(N / BLOCK_N) + K N ceil(M / BLOCK_M); write M N


@jit
def _softmax_bwd_kernel(
    P, DP, DS, stride_row, n_rows, n_cols, sm_scale,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    # one program per ROWS rows: dS = P * (dP - sum_j P_j dP_j), times the scale (S = scale * Q K^T)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None] * stride_row + cols[None, :]
    # read 2 * ROWS * n_cols elements (P and dP)
    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    dp = tl.load(DP + offs, mask=mask, other=0.0).to(tl.float32)
    ds = p * (dp - tl.sum(p * dp, axis=1)[:, None]) * sm_scale
    # write ROWS * n_cols elements
    tl.store(DS + offs, ds.to(DS.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------
def standard_block_sizes(head_dim, dtype, device, capability=None):
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the standard kernels (matmul tiles) on ``device``."""
    if use_interpreter(device):
        return 128, 128, 128
    if tuple(capability or gpu_capability(device)) < (8, 0):  # 64 KiB of shared memory
        return 64, 32, 32
    return (64, 64, 32) if dtype == torch.float32 else (128, 64, 32)


def _options(device):
    """Native launches on pre-Ampere GPUs: no software pipelining (it needs async copies)."""
    if use_interpreter(device) or tuple(gpu_capability(device)) >= (8, 0):
        return {}
    return {"num_stages": 1}


def _standard_forward(q, k, v, causal, scale, block_m, block_n):
    B, H, n_q, d = q.shape
    n_k = k.shape[-2]
    # S in float32 whatever q's dtype: its absolute error is what the softmax sees (module docstring)
    s = torch.empty((B, H, n_q, n_k), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(n_q, block_m), B * H)
    prec = dot_precision(q.dtype)
    # kernel 1: S = Q K^T * scale, written to global memory
    _scores_kernel[grid](
        q, k, s,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), s.stride(0), s.stride(1), s.stride(2),
        H, n_q, n_k, scale,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal), DOT_PRECISION=prec, **_options(q.device),
    )
    # kernel 2: P = softmax(S), row by row (read S in float32, write P in q's dtype)
    p = torch.empty_like(s, dtype=q.dtype)
    _launch_softmax(s.view(-1, n_k), p.view(-1, n_k))
    # kernel 3: O = P V
    o = torch.empty_like(q)
    _pv_kernel[grid](
        p, v, o,
        p.stride(0), p.stride(1), p.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        H, n_q, n_k,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=prec, **_options(q.device),
    )
    return o, p


def _matmul(a, b, c, alpha, blocks):
    """c[l] = alpha * a[l] @ b[l] for 3-D views (lead, M, K) @ (lead, K, N) -> (lead, M, N)."""
    lead, m, kdim = a.shape
    n = b.shape[-1]
    bm, bn, bk = blocks
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), lead)
    _matmul_kernel[grid](
        a, b, c, m, n, kdim, alpha,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1), c.stride(2),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=dot_precision(a.dtype), **_options(a.device),
    )


def _standard_backward(do, q, k, v, p, scale, blocks):
    B, H, n_q, d = q.shape
    n_k = k.shape[-2]
    L = B * H
    q3, k3, v3, p3 = q.view(L, n_q, d), k.view(L, n_k, d), v.view(L, n_k, d), p.view(L, n_q, n_k)
    do3 = do.contiguous().view(L, n_q, d)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dp = torch.empty_like(p)
    ds = torch.empty_like(p)
    _matmul(p3.transpose(1, 2), do3, dv.view(L, n_k, d), 1.0, blocks)              # dV = P^T dO
    _matmul(do3, v3.transpose(1, 2), dp.view(L, n_q, n_k), 1.0, blocks)             # dP = dO V^T
    block = triton.next_power_of_2(n_k)
    rows = rows_per_program(block, q.device)
    extra = {} if use_interpreter(q.device) else {"num_warps": softmax_num_warps(block)}
    _softmax_bwd_kernel[(triton.cdiv(L * n_q, rows),)](p, dp, ds, n_k, L * n_q, n_k, scale, BLOCK=block, ROWS=rows,
                                                       **extra)  # dS
    _matmul(ds.view(L, n_q, n_k), k3, dq.view(L, n_q, d), 1.0, blocks)              # dQ = dS K
    _matmul(ds.view(L, n_q, n_k).transpose(1, 2), q3, dk.view(L, n_k, d), 1.0, blocks)  # dK = dS^T Q
    return dq, dk, dv


class _StandardAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, blocks):
        o, p = _standard_forward(q, k, v, causal, scale, blocks[0], blocks[1])
        ctx.save_for_backward(q, k, v, p)  # P (Nq x Nk per head) is kept for the backward
        ctx.scale, ctx.blocks = scale, blocks
        return o

    @staticmethod
    def backward(ctx, do):
        validate.no_double_backward("standard_attention")   # not a silent first-order gradient
        q, k, v, p = ctx.saved_tensors
        dq, dk, dv = _standard_backward(do, q, k, v, p, ctx.scale, ctx.blocks)
        return dq, dk, dv, None, None, None


def _standard_blocks(q, k, block_m, block_n, block_k):
    """The block sizes of the three kernels (defaults where None), checked; and the longest row
    the backward's softmax kernel can hold."""
    bm, bn, bk = standard_block_sizes(q.shape[-1], q.dtype, q.device)
    blocks = (bm if block_m is None else block_m, bn if block_n is None else block_n, bk if block_k is None else block_k)
    validate.kernel_blocks(blocks[0], blocks[1])
    validate.power_of_two(blocks[2], "block_k")
    if k.shape[-2] > 16384 and q.requires_grad:
        raise ValueError(f"k: expected at most 16384 positions (the standard backward's softmax kernel holds "
                         f"one row), got shape {tuple(k.shape)}")
    return blocks


def standard_attention(q, k, v, causal=False, scale=None, *, block_m=None, block_n=None, block_k=None):
    """Unfused attention as three Triton kernels (S, softmax, PV); differentiable.

    q: (B, H, Nq, d), k and v: (B, H, Nk, d); d in 16, 32, 64, 128. Returns o (B, H, Nq, d).
    Softmax rows are held whole on chip up to 16384 keys (longer rows take two passes).
    S (B, H, Nq, Nk) is written in float32 for any input dtype, P in the inputs' dtype.
    Double backward (``create_graph=True``) raises a ``RuntimeError``.

    Example: ``o = standard_attention(q, k, v, causal=True)``
    """
    scale = validate.kernel_qkv(q, k, v, scale, causal, interpreted=use_interpreter)   # 1/sqrt(d) for None
    blocks = _standard_blocks(q, k, block_m, block_n, block_k)   # (BLOCK_M, BLOCK_N, BLOCK_K), checked
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _StandardAttention.apply(q, k, v, causal, scale, blocks)
