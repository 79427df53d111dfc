"""The gated delta rule in Triton, chunk by chunk: the state lives in registers, never in memory.

What you learn here:

* that a linear-attention layer has no KV cache: its memory is a state ``S`` of ``d_k x d_v``
  numbers per head, the same size after 10 tokens as after 100,000. The delta rule
  (DeltaNet; Gated DeltaNet, Yang, Kautz and Hatamizadeh, arXiv:2412.06464, ICLR 2025) updates
  it token by token: ``S = S exp(g_t)``, ``u_t = beta_t (v_t - S^T k_t)``, ``S = S + k_t u_t^T``,
  ``o_t = S^T (scale q_t)`` (``attnlab.linear_attention.delta_rule_recurrent``, the reference);
* that the recurrence need not run one token at a time. Inside a chunk of ``C`` tokens the
  corrections ``U`` solve a unit lower-triangular ``C x C`` system, whose inverse ``T`` (the
  UT transform) turns the chunk into matmuls - the WY representation of a product of
  Householder-like matrices (Yang, Wang, Zhang, Shen and Kim, "Parallelizing Linear
  Transformers with the Delta Rule over Sequence Length", NeurIPS 2024). Only the state
  crosses from one chunk to the next: a scan of ``N / C`` steps of ``tl.dot`` instead of ``N``
  steps of vector work. ``attnlab.linear_attention.delta_rule_chunked`` is the same
  algorithm in PyTorch, equation by equation; read its docstring first;
* how a triangular inverse is computed inside a kernel, where a row of a register tile cannot
  be indexed: forward substitution, one row per step, picking row ``i`` with a mask and a sum.

One program per (batch, head) walks the chunks in order, carrying ``S`` in registers. Per
chunk (C rows, ``K``/``Q`` ``C x d_k``, ``V`` ``C x d_v``, ``G`` the cumulative log decay)::

    A = -strictly_lower(beta_i exp(G_i - G_j) K K^T)   # C x C, on chip
    T = (I - A)^-1 by forward substitution             # C - 1 steps of C x C vector work
    W = T diag(beta exp G) K ;  U = T diag(beta) V - W S
    O = scale (diag(exp G) Q S + (Q K^T * exp(G_i - G_j), j <= i) U)    # write C x d_v
    S = exp(G_C) S + (K exp(G_C - G))^T U               # stays in registers

Memory traffic per (batch, head), counted in elements (``attnlab.linear_attention.delta_rule_io``
counts exactly this in bytes, and ``attnlab.memory.trace`` measures it)::

    naive (``delta_rule_recurrent``, one kernel per PyTorch op): the d_k x d_v state goes
      through memory at every token - read and written by the decay, read by S^T k, read and
      written by the update, read by S^T q: about 6 d_k d_v elements per token, and about
      12 d_k d_v with the d_k x d_v temporaries of its broadcast products
      (``attnlab.memory.trace_ops`` measures 12.3 at d_k = d_v = 64): traffic that grows
      with N d_k d_v and dwarfs the inputs;
    this kernel: read N d_k (Q) + N d_k (K) + N d_v (V) + N (beta) + N (g, if given),
      d_k d_v fp32 (the initial state, if given); write N d_v (O), d_k d_v fp32 (the final
      state, if asked). Every input read once, the output written once, the state touched
      at most twice whatever N: constant per (batch, head), nothing per token beyond the
      token's own q, k, v, beta, g and o.

Choices, said plainly:

* everything is computed in float32: inputs are converted on load, ``tl.dot`` runs with
  ``input_precision="ieee"`` (``_runtime.dot_precision(torch.float32)``) whatever the input
  dtype, because the state is carried across every chunk and ``T`` amplifies rounding: TF32's
  10 mantissa bits would cost ~1e-3. O is stored in q's dtype; states are float32;
* ``chunk_size`` is a power of two >= 16 (``tl.dot``'s minimum); d_k and d_v may be any size
  up to 256: the tiles are padded to the next power of two >= 16 and the padding is masked
  off on every load and store (it reads and writes nothing, and zeros in K and V keep it
  out of the state). A ragged last chunk is masked the same way: its missing rows load
  ``k = v = beta = g = 0``, which gives them ``u = 0`` and no effect on the state;
* the forward substitution loops over ``ROWS`` (= ``CHUNK``) passed as a runtime int, so the
  compiler keeps it a loop instead of unrolling ``CHUNK - 1`` copies. Compiling for a GPU is
  still slow at large tiles (sm_80, one try on a busy 2-core CPU: about 40 s for chunk 64 and
  d_k = d_v = 64; about 7 minutes for 64 x 128 x 128 when the loop was unrolled), once per
  configuration; the interpreter compiles nothing;
* backward: the kernel is forward only. When an input requires grad, autograd
  recomputes the forward with the PyTorch chunked reference and differentiates that
  (correct, but with PyTorch's memory and speed); double backward raises.

What the fast GPU kernels do differently (flash-linear-attention's ``chunk_gated_delta_rule``,
Yang et al.): they split the work across several kernels and many more programs. First, in
parallel over *all* chunks, a kernel computes ``A``, inverts it (in blocks of 16 with small
matmuls rather than row by row) and writes ``W`` and ``U'`` to memory; the sequential scan
over chunks then only does ``U = U' - W S`` and the state update, with ``d_v`` split into
blocks across programs (the columns of ``S`` never interact), and writes each chunk's
starting state so the output kernel can run in parallel over chunks again. They use
bf16/fp16 ``tl.dot`` operands with fp32 accumulation. That moves more bytes (W, U' and the
per-chunk states go through memory) in exchange for parallelism: one program per
(batch, head), as here, leaves most of a GPU idle when B x H is small, and a ``128 x 128``
fp32 state does not fit in one program's registers.

Example::

    from attnlab.kernels import chunked_delta_rule
    o, state = chunked_delta_rule(q, k, v, beta, g, chunk_size=16, output_final_state=True)
"""

import torch
import triton
import triton.language as tl

from attnlab import validate
from attnlab.linear_attention import check_delta_rule_inputs, delta_rule_chunked

from ._runtime import dot_precision, jit, use_interpreter

__all__ = ["chunked_delta_rule", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256    # d_k and d_v: the state tile (d_k x d_v, padded) lives in one program's registers


# ---------------------------------------------------------------------------------------
# The kernel: one program per (batch, head), a loop over chunks carrying S
# ---------------------------------------------------------------------------------------
@jit
def _chunked_delta_rule_kernel(
    Q, K, V, BETA, G, S0, O, ST,         # q, k (BH, N, d_k); v, o (BH, N, d_v); beta, g (BH, N); states (BH, d_k, d_v)
    N, D_K, D_V, scale,
    ROWS,                                # = CHUNK, passed as a runtime int: the substitution loop is not unrolled
    CHUNK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_G: tl.constexpr, HAS_S0: tl.constexpr, STORE_ST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)   # which (batch, head); 64-bit: bh * N * d can pass 2**31
    offs_c = tl.arange(0, CHUNK)         # rows of a chunk
    offs_k = tl.arange(0, BLOCK_DK)      # columns of q and k (padding masked off)
    offs_v = tl.arange(0, BLOCK_DV)      # columns of v, o and the state
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    s_offs = bh * D_K * D_V + offs_k[:, None] * D_V + offs_v[None, :]
    s_ok = k_ok[:, None] & v_ok[None, :]
    if HAS_S0:
        # read d_k * d_v fp32: the initial state, once
        S = tl.load(S0 + s_offs, mask=s_ok, other=0.0)
    else:
        S = tl.zeros([BLOCK_DK, BLOCK_DV], tl.float32)             # (DK, DV) the state, in registers
    incl = offs_c[:, None] >= offs_c[None, :]                      # (C, C) j <= i
    strict = offs_c[:, None] > offs_c[None, :]                     # (C, C) j < i
    eye = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)   # (C, C)

    for c0 in range(0, N, CHUNK):
        rows = c0 + offs_c                                         # (C,) token positions
        row_ok = rows < N                                          # the last chunk may be ragged
        qk_offs = bh * N * D_K + rows[:, None] * D_K + offs_k[None, :]
        qk_ok = row_ok[:, None] & k_ok[None, :]
        # read C * d_k elements of Q and of K, C * d_v of V, C of beta and of g (missing rows and padding: 0)
        q = tl.load(Q + qk_offs, mask=qk_ok, other=0.0).to(tl.float32)               # (C, DK)
        k = tl.load(K + qk_offs, mask=qk_ok, other=0.0).to(tl.float32)               # (C, DK)
        v_offs = bh * N * D_V + rows[:, None] * D_V + offs_v[None, :]
        vo_ok = row_ok[:, None] & v_ok[None, :]
        v = tl.load(V + v_offs, mask=vo_ok, other=0.0).to(tl.float32)                # (C, DV)
        beta = tl.load(BETA + bh * N + rows, mask=row_ok, other=0.0).to(tl.float32)  # (C,)
        if HAS_G:
            g = tl.load(G + bh * N + rows, mask=row_ok, other=0.0).to(tl.float32)    # (C,)
            Gc = tl.cumsum(g, 0)                                   # (C,) log decay since the chunk's start
        else:
            Gc = tl.zeros([CHUNK], tl.float32)
        # exp(G_i - G_j) for j <= i only (above the diagonal the exponent is >= 0 and could overflow)
        decay = tl.exp(tl.where(incl, Gc[:, None] - Gc[None, :], float("-inf")))    # (C, C)

        # The UT transform. M = -strictly_lower(diag(beta) K K^T * decay), T = (I - M)^-1 = I + X with
        # X strictly lower: row i of X is m_i + sum_{j<i} m_ij X_j (forward substitution), built in
        # place, one row per step, rows below i still holding M.
        kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)                   # (C, C)
        X = tl.where(strict, -(beta[:, None] * kk * decay), 0.0)                      # (C, C) M
        for i in range(1, ROWS):
            is_row = offs_c[:, None] == i                                            # (C, 1)
            m_i = tl.sum(tl.where(is_row, X, 0.0), 0)                                # (C,) row i of M
            x_i = m_i + tl.sum(m_i[:, None] * X, 0)                                  # (C,) sum over j < i only
            X = tl.where(is_row, x_i[None, :], X)
        T = X + eye                                                                  # (C, C)

        eg = tl.exp(Gc)                                                              # (C,) decay since chunk start
        W = tl.dot(T, k * (beta * eg)[:, None], input_precision=DOT_PRECISION)       # (C, DK)
        U = tl.dot(T, v * beta[:, None], input_precision=DOT_PRECISION) \
            - tl.dot(W, S, input_precision=DOT_PRECISION)                            # (C, DV) the corrections
        # O = scale (what the chunk's starting state gives + what this chunk wrote)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay           # (C, C), j <= i
        o = tl.dot(q * eg[:, None], S, input_precision=DOT_PRECISION) \
            + tl.dot(qk, U, input_precision=DOT_PRECISION)                           # (C, DV)
        # write C * d_v elements of O
        tl.store(O + v_offs, (o * scale).to(O.dtype.element_ty), mask=vo_ok)
        # the state at the chunk's end (missing rows have g = 0, so row C-1 holds the last real G)
        g_last = tl.sum(tl.where(offs_c == CHUNK - 1, Gc, 0.0), 0)                  # scalar
        kd = k * tl.exp(g_last - Gc)[:, None]                                        # (C, DK)
        S = S * tl.exp(g_last) + tl.dot(tl.trans(kd), U, input_precision=DOT_PRECISION)   # (DK, DV)

    if STORE_ST:
        # write d_k * d_v fp32: the final state, once
        tl.store(ST + s_offs, S, mask=s_ok)


# ---------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------
def _check(q, k, v, beta, g, scale, initial_state, output_final_state, chunk_size):
    """Every check before launch; returns the scale."""
    scale = check_delta_rule_inputs(q, k, v, beta, g, scale, initial_state, output_final_state,
                                    dtypes=validate.KERNEL_DTYPES)
    validate.power_of_two(chunk_size, "chunk_size", minimum=16)
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"q: expected d_k <= {MAX_HEAD_DIM} (the state tile lives in registers), got shape "
                         f"{tuple(q.shape)}")
    if v.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"v: expected d_v <= {MAX_HEAD_DIM} (the state tile lives in registers), got shape "
                         f"{tuple(v.shape)}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q: expected a CPU (interpreter) or CUDA tensor, got device {q.device}")
    validate.interpreter_dtypes(use_interpreter, q=q, k=k, v=v, beta=beta, g=g)
    return scale


def _launch(q, k, v, beta, g, scale, initial_state, output_final_state, chunk_size):
    """Run the kernel on detached, contiguous inputs; returns (o, final state or None)."""
    B, H, N, d_k = q.shape
    d_v = v.shape[-1]
    q, k, v, beta = (x.detach().contiguous() for x in (q, k, v, beta))
    g = g.detach().contiguous() if g is not None else None
    s0 = initial_state.detach().contiguous() if initial_state is not None else None
    o = torch.empty((B, H, N, d_v), device=q.device, dtype=q.dtype)                  # (B, H, N, d_v)
    st = torch.empty((B, H, d_k, d_v), device=q.device, dtype=torch.float32) if output_final_state else None
    _chunked_delta_rule_kernel[(B * H,)](
        q, k, v, beta, g, s0, o, st,
        N, d_k, d_v, scale, chunk_size,
        CHUNK=chunk_size,
        BLOCK_DK=max(16, triton.next_power_of_2(d_k)), BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        HAS_G=g is not None, HAS_S0=s0 is not None, STORE_ST=output_final_state,
        DOT_PRECISION=dot_precision(torch.float32),   # the operands are float32 whatever the input dtype
    )
    return o, st


class _ChunkedDeltaRule(torch.autograd.Function):
    """Forward: the kernel. Backward: recompute with the PyTorch chunked reference and differentiate it."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, initial_state, scale, chunk_size, output_final_state):
        o, st = _launch(q, k, v, beta, g, scale, initial_state, output_final_state, chunk_size)
        ctx.save_for_backward(q, k, v, beta, g, initial_state)
        ctx.scale, ctx.chunk_size, ctx.output_final_state = scale, chunk_size, output_final_state
        return (o, st) if output_final_state else o

    @staticmethod
    def backward(ctx, *grads):
        validate.no_double_backward("chunked_delta_rule")
        saved = ctx.saved_tensors                                  # q, k, v, beta, g, initial_state
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(need) if x is not None else None
                      for x, need in zip(saved, ctx.needs_input_grad[:6])]
            out = delta_rule_chunked(*leaves[:5], scale=ctx.scale, initial_state=leaves[5],
                                     output_final_state=ctx.output_final_state, chunk_size=ctx.chunk_size)
            outs = out if ctx.output_final_state else (out,)
            wanted = [x for x in leaves if x is not None and x.requires_grad]
            pairs = [(t, gr) for t, gr in zip(outs, grads) if gr is not None]
            found = iter(torch.autograd.grad([t for t, _ in pairs], wanted, [gr for _, gr in pairs],
                                             allow_unused=True))
        result = [next(found) if x is not None and x.requires_grad else None for x in leaves]
        return (*result, None, None, None)


def chunked_delta_rule(q, k, v, beta, g=None, *, chunk_size=64, scale=None, initial_state=None,
                       output_final_state=False):
    """The gated delta rule as one Triton kernel, chunkwise: exactly ``delta_rule_recurrent``'s numbers.

    q, k (B, H, N, d_k); v (B, H, N, d_v); beta (B, H, N); g (B, H, N) the log decay, finite and
    <= 0, or None (no decay); all one dtype, float32 or float16 (bfloat16 on a GPU only); any N
    >= 1 (the last chunk may be ragged); d_k, d_v from 1 to 256 (padded to a power of two >= 16
    inside, masked). ``chunk_size`` a power of two >= 16; ``scale`` defaults to d_k ** -0.5;
    ``initial_state`` (B, H, d_k, d_v) float32 or None. Computes in float32; returns o
    (B, H, N, d_v) in q's dtype and, with ``output_final_state``, the tuple (o, final state
    (B, H, d_k, d_v) float32). Differentiable through a recomputation with
    ``attnlab.linear_attention.delta_rule_chunked`` (no double backward).

    Example: ``o = chunked_delta_rule(q, k, v, beta, g, chunk_size=16)``
    """
    scale = _check(q, k, v, beta, g, scale, initial_state, output_final_state, chunk_size)
    return _ChunkedDeltaRule.apply(q, k, v, beta, g, initial_state, scale, chunk_size, output_final_state)
