"""Exercise 07 (FlashAttention-2): wrong implementations fail their check with the matching diagnosis,
shortcuts are refused, and the byte budgets and the experiment's tolerance hold what they claim."""

import os

import pytest
import torch
import triton
import triton.language as tl

from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.exercises.e07 import checks as e07_checks
from attnlab.grading.exercises.e07 import spec as specs
from attnlab.memory import trace
from mistakes import Wrong, variant as _variant

WRONG = Wrong()


# ---------------------------------------------------------------------------------------------
# online-softmax-update
# ---------------------------------------------------------------------------------------------

# its known mistakes are proven by the check's own emulations (tests/test_every_mistake.py)

def _online():
    def online_softmax_update(m, l, acc, s_block, v_block):
        m_new = torch.maximum(m, s_block.max(-1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s_block - m_new[:, None])
        return m_new, alpha * l + p.sum(-1), alpha[:, None] * acc + p @ v_block
    return online_softmax_update


# ---------------------------------------------------------------------------------------------
# tiled-forward: a learner's tiled forward, with one switch per mistake
# ---------------------------------------------------------------------------------------------

def _dense_forward(q, k, v, causal=False, block_m=16, block_n=16):
    """No tiles at all: the whole score matrix, and the softmax by hand."""
    s = q @ k.transpose(1, 2) * q.shape[-1] ** -0.5                      # (B, Nq, Nk): N x N
    if causal:
        s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1), -float("inf"))
    m = s.amax(-1)
    p = torch.exp(s - m[..., None])
    l = p.sum(-1)
    return p @ v / l[..., None], m + torch.log(l)


def _tiled(skip=True):
    """A learner's tiled forward; ``skip=False`` computes the causal blocks above the diagonal too."""
    def tiled_attention_forward(q, k, v, causal=False, block_m=16, block_n=16):
        B, n_q, d = q.shape
        n_k = k.shape[1]
        scale = d ** -0.5
        o, L = torch.empty(B, n_q, v.shape[-1]), torch.empty(B, n_q)
        for q0 in range(0, n_q, block_m):
            qi = q[:, q0:q0 + block_m]
            rows = torch.arange(q0, q0 + qi.shape[1])[:, None]
            m = torch.full(qi.shape[:2], -float("inf"))
            l, acc = torch.zeros(qi.shape[:2]), torch.zeros(*qi.shape[:2], v.shape[-1])
            stop = min(q0 + qi.shape[1], n_k) if causal and skip else n_k
            for k0 in range(0, stop, block_n):
                s = qi @ k[:, k0:k0 + block_n].transpose(1, 2) * scale
                if causal:
                    cols = torch.arange(k0, k0 + s.shape[-1])[None, :]
                    s = s.masked_fill(cols > rows, -float("inf"))
                m_new = torch.maximum(m, s.amax(-1))
                alpha = torch.exp(m - m_new)
                p = torch.exp(s - m_new[..., None])
                l = alpha * l + p.sum(-1)
                acc = alpha[..., None] * acc + p @ v[:, k0:k0 + block_n]
                m = m_new
            o[:, q0:q0 + block_m] = acc / l[..., None]
            L[:, q0:q0 + block_m] = m + torch.log(l)
        return o, L
    return tiled_attention_forward


def _row_block_forward(q, k, v, causal=False, block_m=16, block_n=16):
    """Tiled in the queries only: each row block of queries against every key at once, (block_m, Nk) held."""
    scale = q.shape[-1] ** -0.5
    o, L = torch.empty(*q.shape[:2], v.shape[-1]), torch.empty(q.shape[:2])
    for q0 in range(0, q.shape[1], block_m):
        s = q[:, q0:q0 + block_m] @ k.transpose(1, 2) * scale         # (B, block_m, Nk): a row block
        if causal:
            rows = torch.arange(q0, q0 + s.shape[1])[:, None]
            s = s.masked_fill(torch.arange(k.shape[1])[None, :] > rows, float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - m)
        l = p.sum(dim=-1, keepdim=True)
        o[:, q0:q0 + block_m] = p / l @ v
        L[:, q0:q0 + block_m] = (m + torch.log(l)).squeeze(-1)
    return o, L


# the mistakes the check emulates are proven by tests/test_every_mistake.py; these are measured (technique)
WRONG.add("tiled-forward", "holds-n-by-n", tiled_attention_forward=_dense_forward)
WRONG.add("tiled-forward", "row-block-against-all-keys", tiled_attention_forward=_row_block_forward)
WRONG.add("tiled-forward", "causal-blocks-not-skipped", tiled_attention_forward=_tiled(skip=False))


# ---------------------------------------------------------------------------------------------
# flash-kernel-loop: one kernel source, a switch per mistake (globals set by `variant`)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _fwd_body(Q, K, V, O, L, stride_qb, stride_qn, stride_kb, stride_kn, stride_vb, stride_vn, stride_ob, stride_on,
              stride_lb, N, scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < N
    q = tl.load(Q + pid_b * stride_qb + offs_m[:, None] * stride_qn + offs_d[None, :], mask=rows[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = N
    if CAUSAL:
        if SKIP:
            hi = tl.minimum((pid_m + 1) * BLOCK_M, N)
    sk = stride_kn if STRIDES else HEAD_DIM
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        cols = offs_n < N
        if MASK_LOADS:
            k = tl.load(K + pid_b * stride_kb + offs_n[:, None] * sk + offs_d[None, :], mask=cols[:, None], other=0.0)
            v = tl.load(V + pid_b * stride_vb + offs_n[:, None] * stride_vn + offs_d[None, :], mask=cols[:, None],
                        other=0.0)
        else:
            k = tl.load(K + pid_b * stride_kb + offs_n[:, None] * sk + offs_d[None, :])
            v = tl.load(V + pid_b * stride_vb + offs_n[:, None] * stride_vn + offs_d[None, :])
        if TWICE:  # the K tile loaded again (e.g. once for the max, once for the scores)
            k = tl.load(K + pid_b * stride_kb + offs_n[:, None] * sk + offs_d[None, :], mask=cols[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        if SCALE:
            if SCALE_ARG:
                s = s * scale
            else:
                s = s * (1.0 / HEAD_DIM ** 0.5)  # 1/sqrt(d) written in: the caller's scale is ignored
        if MASK_TAIL:
            s = tl.where(cols[None, :], s, float("-inf"))
        if CAUSAL:
            if STRICT:
                s = tl.where(offs_n[None, :] < offs_m[:, None], s, float("-inf"))
            elif IN_TILE:  # positions inside the tile: 0 ... BLOCK - 1
                s = tl.where(tl.arange(0, BLOCK_N)[None, :] <= tl.arange(0, BLOCK_M)[:, None], s, float("-inf"))
            elif DIAG_MASK:
                s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        if LOG2E:  # log2(e) folded into the scores for exp2 (as Triton's tutorial does), so m is in base 2
            s = s * 1.4426950408889634
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if EXP2 or LOG2E:
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
        else:
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if RESCALE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    tl.store(O + pid_b * stride_ob + offs_m[:, None] * stride_on + offs_d[None, :], acc / l_i[:, None],
             mask=rows[:, None])
    if LOG2E:  # the log-sum-exp stored in the units the loop ran in: base 2
        tl.store(L + pid_b * stride_lb + offs_m, m_i + tl.log2(l_i), mask=rows)
    elif LSE_MAX:
        tl.store(L + pid_b * stride_lb + offs_m, m_i + tl.log(l_i), mask=rows)
    else:
        tl.store(L + pid_b * stride_lb + offs_m, tl.log(l_i), mask=rows)


_FWD_OK = dict(SKIP=True, STRIDES=True, MASK_LOADS=True, TWICE=False, SCALE=True, MASK_TAIL=True, STRICT=False,
               DIAG_MASK=True, EXP2=False, RESCALE=True, LSE_MAX=True, SCALE_ARG=True, IN_TILE=False,
               LOG2E=False)


def _interpreted(make):
    """Decorate as the notebook does, with TRITON_INTERPRET=1: the experiment launches the kernel itself, on the CPU,
    and attnlab.memory.trace watches the interpreter."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return make()
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def _fwd_kernel(**wrong):
    return _interpreted(lambda: _variant(_fwd_body, **{**_FWD_OK, **wrong}))


FWD_KERNEL = _fwd_kernel()

for _key, _flags in [("acc-not-rescaled", dict(RESCALE=False)), ("scale-forgotten", dict(SCALE=False)),
                     ("lse-in-base-2", dict(LOG2E=True)),
                     ("masked-keys-not-masked", dict(MASK_TAIL=False)), ("causal-off-by-one", dict(STRICT=True)),
                     ("causal-diagonal-unmasked", dict(DIAG_MASK=False)), ("lse-missing-max", dict(LSE_MAX=False)),
                     ("exp2-without-log2e", dict(EXP2=True)), ("causal-blocks-not-skipped", dict(SKIP=False)),
                     ("extra-traffic", dict(TWICE=True)), ("ignores-strides", dict(STRIDES=False)),
                     ("out-of-bounds-load", dict(MASK_LOADS=False)), ("scale-argument-ignored", dict(SCALE_ARG=False)),
                     ("causal-positions-in-tile", dict(IN_TILE=True))]:
    WRONG.add("flash-kernel-loop", _key, flash_fwd_kernel=_fwd_kernel(**_flags))


def flash_forward(q, k, v, causal=False, block_m=16, block_n=16, kernel=FWD_KERNEL):
    """The notebook's launcher, for the experiment's wrong measurements. (The notebook sets TRITON_INTERPRET=1
    before importing triton, so tl.max and the other @triton.jit helpers are interpreted too; here triton was
    imported first, and attnlab's hook makes them so.)"""
    from attnlab._interp_hooks import jit_helpers_interpreted

    B, N, d = q.shape
    o, L = torch.empty_like(q), torch.empty(B, N)
    with jit_helpers_interpreted():
        kernel[(triton.cdiv(N, block_m), B)](q, k, v, o, L, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                             v.stride(0), v.stride(1), o.stride(0), o.stride(1), L.stride(0), N,
                                             d ** -0.5, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal)
    return o, L


# ---------------------------------------------------------------------------------------------
# traffic-experiment
# ---------------------------------------------------------------------------------------------

def _measure(value, honour_causal=True, kernel=FWD_KERNEL):
    def forward_traffic(n, causal=False, block_m=16, block_n=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, n, 16, generator=g) for _ in range(3))
        t = trace(flash_forward, q, k, v, causal and honour_causal, block_m, block_n, kernel)
        return value(t)
    return forward_traffic


# kept beside the emulations: each measures a real kernel with the tracer, read the wrong way, so it proves that
# the emulation's formula is what such a learner measures
WRONG.add("traffic-experiment", "reads-only", forward_traffic=_measure(lambda t: t.bytes_read))
WRONG.add("traffic-experiment", "unique-bytes",
          forward_traffic=_measure(lambda t: t.unique_bytes_read + t.unique_bytes_written))
WRONG.add("traffic-experiment", "elements-not-bytes", forward_traffic=_measure(lambda t: t.total_bytes // 4))
WRONG.add("traffic-experiment", "causal-ignored", forward_traffic=_measure(lambda t: t.total_bytes,
                                                                           honour_causal=False))
WRONG.add("traffic-experiment", "blocks-ignored",
          forward_traffic=lambda n, causal=False, block_m=16, block_n=16, seed=0: _measure(lambda t: t.total_bytes)(
              n, causal, seed=seed))  # the blocks asked for never reach the kernel
WRONG.add("traffic-experiment", "kv-only",
          forward_traffic=_measure(lambda t: t.by_tensor["K"]["read"] + t.by_tensor["V"]["read"]))


# ---------------------------------------------------------------------------------------------
# tiled-backward: the learner's Function with a wrong backward
# ---------------------------------------------------------------------------------------------

def _dense_backward(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    """The whole P recomputed at once from L: right gradients, an N x N matrix held."""
    scale = q.shape[-1] ** -0.5
    p = torch.exp(q @ k.transpose(1, 2) * scale - L[..., None])           # (B, Nq, Nk): N x N
    if causal:
        p = p.masked_fill(torch.ones(p.shape[1:], dtype=torch.bool).triu(1), 0.0)
    ds = p * (do @ v.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(1, 2) @ q * scale, p.transpose(1, 2) @ do


def _backward(dense=False, save_causal=True):
    """A learner's backward and autograd Function; ``dense``: the whole P at once, ``save_causal=False``: the Function
    forgets ctx.causal."""
    def tiled_attention_backward(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
        if dense:
            return _dense_backward(q, k, v, o, L, do, causal)
        n_q, n_k, d = q.shape[1], k.shape[1], q.shape[-1]
        scale = d ** -0.5
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        D = (do * o).sum(-1)
        for k0 in range(0, n_k, block_n):
            kj, vj = k[:, k0:k0 + block_n], v[:, k0:k0 + block_n]
            cols = torch.arange(k0, k0 + kj.shape[1])[None, :]
            for q0 in range(0, n_q, block_m):
                qi, doi = q[:, q0:q0 + block_m], do[:, q0:q0 + block_m]
                rows = torch.arange(q0, q0 + qi.shape[1])[:, None]
                s = qi @ kj.transpose(1, 2) * scale
                p = torch.exp(s - L[:, q0:q0 + block_m, None])
                if causal:
                    p = p.masked_fill(cols > rows, 0.0)
                dv[:, k0:k0 + block_n] += p.transpose(1, 2) @ doi
                dp = doi @ vj.transpose(1, 2)
                ds = p * (dp - D[:, q0:q0 + block_m, None])
                dq[:, q0:q0 + block_m] += ds @ kj * scale
                dk[:, k0:k0 + block_n] += ds.transpose(1, 2) @ qi * scale
        return dq, dk, dv

    class FlashAttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal=False, block_m=16, block_n=16):
            o, L = _tiled()(q, k, v, causal, block_m, block_n)
            ctx.save_for_backward(q, k, v, o, L)
            ctx.block_m, ctx.block_n = block_m, block_n
            if save_causal:
                ctx.causal = causal
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, L = ctx.saved_tensors
            dq, dk, dv = tiled_attention_backward(q, k, v, o, L, do, ctx.causal, ctx.block_m, ctx.block_n)
            return dq, dk, dv, None, None, None

    def flash_attention_pytorch(q, k, v, causal=False, block_m=16, block_n=16):
        return FlashAttentionFunction.apply(q, k, v, causal, block_m, block_n)

    return {"tiled_attention_backward": tiled_attention_backward, "flash_attention_pytorch": flash_attention_pytorch}


def _row_block_backward(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    """P recomputed one row block of queries at a time, against every key: (block_m, Nk) held."""
    scale = q.shape[-1] ** -0.5
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0 in range(0, q.shape[1], block_m):
        rows = slice(q0, q0 + block_m)
        p = torch.exp(q[:, rows] @ k.transpose(1, 2) * scale - L[:, rows, None])   # (B, block_m, Nk)
        if causal:
            i = torch.arange(q0, q0 + p.shape[1])[:, None]
            p = p.masked_fill(torch.arange(k.shape[1])[None, :] > i, 0.0)
        dv += p.transpose(1, 2) @ do[:, rows]
        ds = p * (do[:, rows] @ v.transpose(1, 2) - (do[:, rows] * o[:, rows]).sum(-1, keepdim=True))
        dq[:, rows] = ds @ k * scale
        dk += ds.transpose(1, 2) @ q[:, rows] * scale
    return dq, dk, dv


# the mistakes the check emulates are proven by tests/test_every_mistake.py; these are measured (holds-n-by-n), in
# the autograd Function (ctx-attribute-not-saved) or in what the backward returns (gradient-missing)
WRONG.add("tiled-backward", "holds-n-by-n", **_backward(dense=True))
WRONG.add("tiled-backward", "row-block-against-all-keys", tiled_attention_backward=_row_block_backward)
WRONG.add("tiled-backward", "ctx-attribute-not-saved", **_backward(save_causal=False))


def _backward_returning_two(q, k, v, o, L, do, causal=False, block_m=16, block_n=16):
    """dK and dV only (the dK/dV kernel's pair), dQ forgotten."""
    _dq, dk, dv = _backward()["tiled_attention_backward"](q, k, v, o, L, do, causal, block_m, block_n)
    return dk, dv


WRONG.add("tiled-backward", "gradient-missing", **{**_backward(), "tiled_attention_backward": _backward_returning_two})


def test_the_backward_is_called_directly_and_must_return_one_gradient_per_input():
    ok = _backward()["tiled_attention_backward"]

    def no_dk(*args):  # a learner who has not written dK yet
        dq, _dk, dv = ok(*args)
        return dq, None, dv

    def two(*args):    # dq and dk only
        return ok(*args)[:2]

    for fn, words in [(no_dk, "dk is None"), (two, "expected three gradients (dq, dk, dv)")]:
        result = run_check("tiled-backward", LocalLearner({**_backward(), "tiled_attention_backward": fn},
                                                          forbidden=[]))
        assert not result.passed and words in result.message, result.message
        assert result.diagnosis == ["gradient-missing"], result.message
        assert "`tiled_attention_backward` on" in result.message, result.message


def test_a_gradient_check_names_the_input_whose_gradient_is_none():
    from attnlab.grading.core import check_with_gradients, Fail

    class NoDk(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k):
            ctx.save_for_backward(k)
            return q * k.sum()

        @staticmethod
        def backward(ctx, g):
            (k,) = ctx.saved_tensors
            return g * k.sum(), None   # dk not written

    def spec(q, k):
        return q * k.sum()

    case = ("n=3", (torch.randn(3), torch.randn(3)), {}, torch.ones(3))
    with pytest.raises(Fail, match="the gradient of `k` is None"):
        check_with_gradients({"f": NoDk.apply}, "f", spec, [case], inputs=[0, 1])


# ---------------------------------------------------------------------------------------------
# dkdv-kernel
# ---------------------------------------------------------------------------------------------

@triton.jit
def _dkdv_body(Q, K, V, DO, L, D, DK, DV, stride_qb, stride_qn, stride_kb, stride_kn, stride_vb, stride_vn,
               stride_dob, stride_don, stride_lb, N, scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    cols = offs_n < N
    k_ptrs = K + pid_b * stride_kb + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + pid_b * stride_vb + offs_n[:, None] * stride_vn + offs_d[None, :]
    k = tl.load(k_ptrs, mask=cols[:, None], other=0.0)
    v = tl.load(v_ptrs, mask=cols[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo = 0
    if CAUSAL:
        if SKIP:
            lo = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M
    for start_m in range(lo, N, BLOCK_M):
        if KV_IN_LOOP:  # K and V loaded again for every query block
            k = tl.load(k_ptrs, mask=cols[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None], other=0.0)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m < N
        q = tl.load(Q + pid_b * stride_qb + offs_m[:, None] * stride_qn + offs_d[None, :], mask=rows[:, None],
                    other=0.0)
        do = tl.load(DO + pid_b * stride_dob + offs_m[:, None] * stride_don + offs_d[None, :], mask=rows[:, None],
                     other=0.0)
        if ROW_MASK:
            lse = tl.load(L + pid_b * stride_lb + offs_m, mask=rows, other=0.0)
        else:
            lse = tl.load(L + pid_b * stride_lb + offs_m, mask=rows, other=float("-inf"))
        delta = tl.load(D + pid_b * stride_lb + offs_m, mask=rows, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        if RECOMP_SCALE:
            s = s * (scale if SCALE_ARG else 1.0 / HEAD_DIM ** 0.5)
        p = tl.exp(s - lse[:, None])
        if ROW_MASK:
            p = tl.where(rows[:, None] & cols[None, :], p, 0.0)
        else:
            p = tl.where(cols[None, :], p, 0.0)
        if CAUSAL:
            if CAUSAL_MASK:
                p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        dv += tl.dot(tl.trans(p), do, input_precision="ieee")
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        if SUB_D:
            if FLIP:
                ds = p * (delta[:, None] - dp)
            else:
                ds = p * (dp - delta[:, None])
        else:
            ds = p * dp
        dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
    if SCALE_DK:
        dk = dk * (scale if SCALE_ARG else 1.0 / HEAD_DIM ** 0.5)
    tl.store(DK + pid_b * stride_kb + offs_n[:, None] * stride_kn + offs_d[None, :], dk, mask=cols[:, None])
    tl.store(DV + pid_b * stride_vb + offs_n[:, None] * stride_vn + offs_d[None, :], dv, mask=cols[:, None])


_DKDV_OK = dict(SKIP=True, KV_IN_LOOP=False, RECOMP_SCALE=True, CAUSAL_MASK=True, SUB_D=True, FLIP=False,
                SCALE_DK=True, ROW_MASK=True, SCALE_ARG=True)


def _dkdv_kernel(**wrong):
    return _variant(_dkdv_body, **{**_DKDV_OK, **wrong})


for _key, _flags in [("d-not-subtracted", dict(SUB_D=False)), ("ds-sign-flipped", dict(FLIP=True)),
                     ("grad-scale-forgotten", dict(SCALE_DK=False)), ("recompute-scale-forgotten",
                                                                      dict(RECOMP_SCALE=False)),
                     ("causal-mask-missing-in-backward", dict(CAUSAL_MASK=False)),
                     ("causal-blocks-not-skipped", dict(SKIP=False)), ("extra-traffic", dict(KV_IN_LOOP=True)),
                     ("padded-rows-not-zeroed", dict(ROW_MASK=False)), ("scale-argument-ignored", dict(SCALE_ARG=False))]:
    WRONG.add("dkdv-kernel", _key, flash_bwd_dkdv_kernel=_dkdv_kernel(**_flags))


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


# ---------------------------------------------------------------------------------------------
# the right answers pass; shortcuts are refused
# ---------------------------------------------------------------------------------------------

def _ok_namespace():
    return {"online_softmax_update": _online(), "tiled_attention_forward": _tiled(), "flash_fwd_kernel": FWD_KERNEL,
            "forward_traffic": _measure(lambda t: t.total_bytes), **_backward(),
            "flash_bwd_dkdv_kernel": _dkdv_kernel()}


@pytest.mark.parametrize("part", ["online-softmax-update", "tiled-forward", "flash-kernel-loop", "traffic-experiment",
                                  "tiled-backward", "dkdv-kernel"])
def test_the_switch_free_versions_pass(part):
    result = run_check(part, _ok_namespace())   # the part's forbidden list, read from the functions' code
    assert result.passed, result.message


def _shortcut(part, **names):
    result = run_check(part, {**_ok_namespace(), **names})
    assert not result.passed, result.message
    return result


def test_online_update_with_torch_softmax_is_a_shortcut():
    def online_softmax_update(m, l, acc, s_block, v_block):
        m_new = torch.maximum(m, s_block.amax(-1))
        alpha = torch.exp(m - m_new)
        block_sum = torch.exp(s_block.amax(-1) - m_new) / torch.softmax(s_block, dim=-1).amax(-1)  # sum exp(s - m_new)
        p = torch.softmax(s_block, dim=-1) * block_sum[:, None]
        return m_new, alpha * l + p.sum(-1), alpha[:, None] * acc + p @ v_block

    assert "shortcut" in _shortcut("online-softmax-update", online_softmax_update=online_softmax_update).diagnosis


def test_tiled_forward_with_logsumexp_or_sdpa_is_a_shortcut():
    def with_logsumexp(q, k, v, causal=False, block_m=16, block_n=16):
        o, _ = _tiled()(q, k, v, causal, block_m, block_n)
        s = q @ k.transpose(1, 2) * q.shape[-1] ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -float("inf"))
        return o, torch.logsumexp(s, dim=-1)

    def with_sdpa(q, k, v, causal=False, block_m=16, block_n=16):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), _tiled()(q, k, v, causal)[1]

    for fn in (with_logsumexp, with_sdpa):
        result = _shortcut("tiled-forward", tiled_attention_forward=fn)
        assert "shortcut" in result.diagnosis, result.message


def test_library_kernels_are_not_answers():
    from attnlab.kernels.flash_steps import bwd_dkdv_kernel, fwd_causal_kernel

    for part, names in [("flash-kernel-loop", {"flash_fwd_kernel": fwd_causal_kernel}),
                        ("dkdv-kernel", {"flash_bwd_dkdv_kernel": bwd_dkdv_kernel})]:
        result = _shortcut(part, **names)
        assert "must be a Triton kernel" in result.message, result.message


def test_measuring_the_library_kernel_is_a_shortcut():
    def forward_traffic(n, causal=False, block_m=16, block_n=16, seed=0):
        from attnlab.kernels import flash_attention

        q, k, v = (torch.randn(1, 1, n, 16, generator=torch.Generator().manual_seed(seed)) for _ in range(3))
        return trace(flash_attention, q, k, v, causal=causal, block_m=block_m, block_n=block_n).total_bytes

    result = _shortcut("traffic-experiment", forward_traffic=forward_traffic)
    assert "shortcut" in result.diagnosis and "attnlab.kernels.flash_attention" in result.message, result.message


def test_a_backward_through_autograd_is_a_shortcut():
    class Autograd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal=False, block_m=16, block_n=16):
            ctx.save_for_backward(q, k, v)
            ctx.causal = causal
            return _tiled()(q, k, v, causal, block_m, block_n)[0]

        @staticmethod
        def backward(ctx, do):
            q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
            with torch.enable_grad():
                s = q @ k.transpose(1, 2) * q.shape[-1] ** -0.5
                if ctx.causal:
                    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -float("inf"))
                e = torch.exp(s - s.amax(-1, keepdim=True))
                o = (e / e.sum(-1, keepdim=True)) @ v
                return (*torch.autograd.grad(o, (q, k, v), do), None, None, None)

    result = _shortcut("tiled-backward", flash_attention_pytorch=lambda q, k, v, causal=False, block_m=16, block_n=16:
                       Autograd.apply(q, k, v, causal, block_m, block_n))
    assert "shortcut" in result.diagnosis and "torch.autograd.grad" in result.message, result.message


# ---------------------------------------------------------------------------------------------
# what the budgets, the emulations and the experiment's tolerance claim
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, causal, bm, bn", [(40, False, 16, 16), (40, True, 16, 16), (48, True, 32, 16),
                                               (48, True, 16, 32), (7, True, 16, 16)])
def test_the_forward_budget_is_what_attnlab_s_kernel_moves(n, causal, bm, bn):
    from attnlab.kernels import flash_attention

    q, k, v = (torch.randn(2, 1, n, 16) for _ in range(3))
    t = trace(flash_attention, q, k, v, causal=causal, block_m=bm, block_n=bn)
    budget = e07_checks._forward_budget(2, n, 16, causal, bm, bn)
    assert t.by_tensor["K"]["read"] == budget["k"][0] == t.by_tensor["V"]["read"]
    assert t.by_tensor["Q"]["read"] == budget["q"][0] and t.by_tensor["O"]["written"] == budget["o"][1]


def test_the_emulations_without_mistakes_are_the_reference():
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 37, 16, generator=g) for _ in range(4))
    for causal in (False, True):
        o, L = specs.tiled_attention_forward(q, k, v, causal)
        eo, eL = e07_checks._forward_emulation(q, k, v, causal, None, 16, 8)
        assert torch.allclose(o, eo, atol=1e-5) and torch.allclose(L, eL, atol=1e-5)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        specs.flash_attention_pytorch(qq, kk, vv, causal).backward(do)
        grads = e07_checks._backward_emulation(q, k, v, o, L, do, causal)
        assert all(torch.allclose(a, b.grad, atol=1e-5) for a, b in zip(grads, (qq, kk, vv)))


def test_the_experiment_s_tolerance_is_one_percent():
    exact = _measure(lambda t: t.total_bytes)
    for factor, passes in [(1.005, True), (0.995, True), (1.03, False), (0.97, False)]:
        fn = (lambda f: lambda *a, **kw: int(exact(*a, **kw) * f))(factor)
        result = run_check("traffic-experiment", LocalLearner({"forward_traffic": fn}, forbidden=[]))
        assert result.passed == passes, (factor, result.message)


def test_a_kernel_loading_k_twice_fails_on_traffic_only():
    result = run_check("flash-kernel-loop", LocalLearner({"flash_fwd_kernel": _fwd_kernel(TWICE=True)}, forbidden=[]))
    assert not result.passed and result.diagnosis == ["extra-traffic"], result.message
    assert "loaded" in result.message and "from `k`" in result.message


def test_the_untouched_kernel_says_not_implemented():
    @triton.jit
    def flash_fwd_kernel(Q, K, V, O, L, stride_qb, stride_qn, stride_kb, stride_kn, stride_vb, stride_vn, stride_ob,
                         stride_on, stride_lb, N, scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        raise NotImplementedError()

    result = run_check("flash-kernel-loop", LocalLearner({"flash_fwd_kernel": flash_fwd_kernel}, forbidden=[]))
    assert not result.passed and "not implemented" in result.message, result.message


def test_the_tracer_is_allowed_where_attnlab_kernels_are_forbidden():
    # attnlab.memory.trace runs attnlab.kernels._runtime.interpreting: a private module's machinery, never wired as a
    # forbidden call, even when the part forbids attnlab.kernels.* and the module is already imported
    import attnlab.kernels._runtime  # noqa: F401

    result = run_check("traffic-experiment", {"forward_traffic": _measure(lambda t: t.total_bytes)})
    assert result.passed, result.message


def test_hints_are_wrapped_like_the_rest_of_the_feedback(capsys):
    from attnlab.course import hints as course_hints
    from attnlab.grading.feedback import WIDTH

    course_hints._SHOWN.pop("tiled-forward", None)
    words = []
    for _ in range(4):  # the three hints, then the last one again
        course_hints.hint("tiled-forward")
        out = capsys.readouterr().out
        assert all(len(line) <= WIDTH for line in out.splitlines()), out
        words.append(out.split())
    hints = course_hints.all_hints()["tiled-forward"]
    assert max(len(h) for h in hints) > WIDTH                      # there was something to wrap
    assert all(" ".join(hints[i].split()) in " ".join(w) for i, w in enumerate(words[:3]))  # no word lost
    course_hints._SHOWN.pop("tiled-forward", None)


def test_a_nan_byte_count_is_not_within_the_tolerance():
    # `abs(got - want) > tol` is False for NaN: a NaN answer passed the traffic experiment
    result = run_check("traffic-experiment", LocalLearner({"forward_traffic": lambda *a, **k: float("nan")},
                                                          forbidden=[]))
    assert not result.passed, result.message
