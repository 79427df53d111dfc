"""Wrong implementations, written the way a learner would, fail their check with the matching diagnosis.

Each part gets at least three; the check runs in-process on a namespace holding the
learner's function (what ``check("part")`` does with the notebook's globals).
The Triton kernels run in Triton's interpreter.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from attnlab.grading import specs
from attnlab.grading.checks import EXERCISES, PARTS, run_check
from attnlab.grading.core import LocalLearner

WRONG = []  # (part, {name: function}, expected diagnosis key)


def wrong(part, key, **names):
    WRONG.append(pytest.param(part, names, key, id=f"{part}-{key}"))


# --- 01 soft alignment ---------------------------------------------------------------

wrong("additive-score", "no-tanh", additive_scores=lambda s, h, w, u, v: ((s @ w.T).unsqueeze(1) + h @ u.T) @ v)
wrong("additive-score", "swapped-projections",
      additive_scores=lambda s, h, w, u, v: torch.tanh((s @ u.T).unsqueeze(1) + h @ w.T) @ v)
wrong("additive-score", "softmax-applied",
      additive_scores=lambda s, h, w, u, v: torch.softmax(torch.tanh((s @ w.T)[:, None] + h @ u.T) @ v, dim=1))


def _ctx_wrong_axis(scores, h, mask=None):
    if mask is not None:
        scores = scores.masked_fill(~mask, -1e30)
    w = torch.softmax(scores, dim=0)
    return torch.einsum("bn,bnd->bd", w, h), w


def _ctx_mask_after(scores, h, mask=None):
    w = torch.softmax(scores, dim=-1)
    if mask is not None:
        w = w * mask
    return torch.einsum("bn,bnd->bd", w, h), w


def _ctx_no_max(scores, h, mask=None):
    e = torch.exp(scores)
    if mask is not None:
        e = e * mask
    w = e / e.sum(-1, keepdim=True).clamp_min(1e-30)
    return torch.einsum("bn,bnd->bd", w, h), w


def _ctx_nan_rows(scores, h, mask=None):
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    w = torch.softmax(scores, dim=-1)
    return torch.einsum("bn,bnd->bd", w, h), w


wrong("context-vector", "wrong-axis", context_vector=_ctx_wrong_axis)
wrong("context-vector", "mask-after-softmax", context_vector=_ctx_mask_after)
wrong("context-vector", "no-max-subtraction", context_vector=_ctx_no_max)
wrong("context-vector", "fully-masked-row", context_vector=_ctx_nan_rows)


def _decoder(update, weights_axis=-1, use_mask=True):
    def decode_step(s, h, w, u, v, w_s, w_c, mask=None):
        scores = specs.additive_scores(s, h, w, u, v)
        if mask is not None and use_mask:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=weights_axis)
        c = (weights.unsqueeze(-1) * h).sum(1)
        return update(s, c, w_s, w_c), weights
    return decode_step


wrong("decode-step", "no-tanh", decode_step=_decoder(lambda s, c, ws, wc: s @ ws.T + c @ wc.T))
wrong("decode-step", "mask-ignored", decode_step=_decoder(lambda s, c, ws, wc: torch.tanh(s @ ws.T + c @ wc.T),
                                                           use_mask=False))
wrong("decode-step", "wrong-axis", decode_step=_decoder(lambda s, c, ws, wc: torch.tanh(s @ ws.T + c @ wc.T),
                                                         weights_axis=0))
wrong("decode-step", "swapped-update-weights",
      decode_step=_decoder(lambda s, c, ws, wc: torch.tanh(s @ wc.T + c @ ws.T)))

# --- 02 queries, keys, values ----------------------------------------------------------

wrong("padding-mask", "off-by-one", padding_mask=lambda lengths, n: torch.arange(n)[None] <= lengths[:, None])
wrong("padding-mask", "inverted", padding_mask=lambda lengths, n: ~(torch.arange(n)[None] < lengths[:, None]))
wrong("padding-mask", "not-bool", padding_mask=lambda lengths, n: (torch.arange(n)[None] < lengths[:, None]).float())

wrong("causal-mask", "off-by-one-diagonal",
      causal_mask=lambda n_q, n_k, device=None: torch.ones(n_q, n_k, dtype=torch.bool).tril(-1))
wrong("causal-mask", "transposed",
      causal_mask=lambda n_q, n_k, device=None: torch.ones(n_q, n_k, dtype=torch.bool).triu())
wrong("causal-mask", "bottom-right",
      causal_mask=lambda n_q, n_k, device=None: torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q))


def _attention(scale=True, mask_mode="fill", dim=-1):
    def masked_attention(q, k, v, mask=None):
        s = q @ k.transpose(-2, -1)
        if scale:
            s = s / math.sqrt(q.shape[-1])
        if mask is not None and mask_mode == "fill":
            s = s.masked_fill(~mask, float("-inf"))
        if mask is not None and mask_mode == "inverted":
            s = s.masked_fill(mask, float("-inf"))
        p = torch.softmax(s, dim=dim)
        if mask is not None and mask_mode == "after":
            p = p * mask
        return torch.nan_to_num(p) @ v
    return masked_attention


wrong("attention-masks", "mask-after-softmax", masked_attention=_attention(mask_mode="after"))
wrong("attention-masks", "inverted-mask", masked_attention=_attention(mask_mode="inverted"))
wrong("attention-masks", "scale-forgotten", masked_attention=_attention(scale=False))
wrong("attention-masks", "wrong-axis", masked_attention=_attention(dim=-2))


def _attention_nan_rows(q, k, v, mask=None):
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


wrong("attention-masks", "fully-masked-row", masked_attention=_attention_nan_rows)

# --- 03 scaled dot-product -------------------------------------------------------------

wrong("stable-softmax", "no-max-subtraction", softmax=lambda x, dim=-1: x.exp() / x.exp().sum(dim, keepdim=True))
wrong("stable-softmax", "wrong-axis",
      softmax=lambda x, dim=-1: (x - x.amax(-1, keepdim=True)).exp() / (x - x.amax(-1, keepdim=True)).exp().sum(
          -1, keepdim=True))
wrong("stable-softmax", "global-max",
      softmax=lambda x, dim=-1: (x - x.max()).exp() / (x - x.max()).exp().sum(dim, keepdim=True))


def _sdpa(scale_of_d, dim=-1, honour=True):
    def scaled_dot_product_attention(q, k, v, scale=None):
        sc = scale if (scale is not None and honour) else scale_of_d(q.shape[-1])
        return torch.softmax(q @ k.transpose(-2, -1) * sc, dim=dim) @ v
    return scaled_dot_product_attention


wrong("scaled-attention", "scale-forgotten", scaled_dot_product_attention=_sdpa(lambda d: 1))
wrong("scaled-attention", "scale-one-over-d", scaled_dot_product_attention=_sdpa(lambda d: 1 / d))
wrong("scaled-attention", "wrong-axis", scaled_dot_product_attention=_sdpa(lambda d: d ** -0.5, dim=-2))
wrong("scaled-attention", "scale-ignored", scaled_dot_product_attention=_sdpa(lambda d: d ** -0.5, honour=False))

wrong("variance-experiment", "divided-by-d",
      score_variance=lambda q, k: torch.stack([(q * k).sum(1).var(), ((q * k).sum(1) / q.shape[1]).var()]))
wrong("variance-experiment", "std-not-var",
      score_variance=lambda q, k: torch.stack([(q * k).sum(1).std(), ((q * k).sum(1) / q.shape[1] ** 0.5).std()]))
wrong("variance-experiment", "all-pairs",
      score_variance=lambda q, k: torch.stack([(q @ k.T).var(), (q @ k.T / q.shape[1] ** 0.5).var()]))

# --- 04 multi-head ---------------------------------------------------------------------

wrong("split-heads", "heads-order", split_heads=lambda x, h: x.view(x.shape[0], h, x.shape[1], -1))
wrong("split-heads", "interleaved-heads",
      split_heads=lambda x, h: x.view(x.shape[0], x.shape[1], -1, h).permute(0, 3, 1, 2))
wrong("split-heads", "no-transpose", split_heads=lambda x, h: x.view(x.shape[0], x.shape[1], h, -1))

wrong("merge-heads", "heads-order", merge_heads=lambda x: x.reshape(x.shape[0], x.shape[2], -1))
wrong("merge-heads", "interleaved-heads",
      merge_heads=lambda x: x.permute(0, 2, 3, 1).reshape(x.shape[0], x.shape[2], -1))
wrong("merge-heads", "summed-heads", merge_heads=lambda x: x.sum(1))


def _mha(scale_dim="head", merge_ok=True, out_proj=True, causal_ok=True):
    def multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads, causal=False):
        b, n, d = x.shape
        q, k, v = (specs.split_heads(x @ w.T, num_heads) for w in (w_q, w_k, w_v))
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1] if scale_dim == "head" else d)
        if causal and causal_ok:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.softmax(s, -1) @ v
        o = o.transpose(1, 2).reshape(b, n, d) if merge_ok else o.reshape(b, n, d)
        return o @ w_o.T if out_proj else o
    return multi_head_attention


wrong("mha-forward", "scale-d-model", multi_head_attention=_mha(scale_dim="model"))
wrong("mha-forward", "heads-order", multi_head_attention=_mha(merge_ok=False))
wrong("mha-forward", "no-output-projection", multi_head_attention=_mha(out_proj=False))
wrong("mha-forward", "causal-ignored", multi_head_attention=_mha(causal_ok=False))

# --- 05 quadratic cost -----------------------------------------------------------------

wrong("attention-flops", "multiply-add-once", attention_flops=lambda b, h, n, d: b * h * 2 * n * n * d)
wrong("attention-flops", "swapped-n-d", attention_flops=lambda b, h, n, d: b * h * 4 * n * d * d)
wrong("attention-flops", "per-head-only", attention_flops=lambda b, h, n, d: 4 * n * n * d)

wrong("attention-bytes", "elements-not-bytes", attention_bytes=lambda b, h, n, d, es=4: b * h * (4 * n * d + 4 * n * n))
wrong("attention-bytes", "writes-only", attention_bytes=lambda b, h, n, d, es=4: b * h * (2 * n * n + n * d) * es)
wrong("attention-bytes", "matrices-only", attention_bytes=lambda b, h, n, d, es=4: b * h * 4 * n * n * es)

_OK_BOUND = {"is_memory_bound": specs.is_memory_bound}
wrong("arithmetic-intensity", "inverted-ratio", **_OK_BOUND,
      arithmetic_intensity=lambda b, h, n, d, es=4: specs.attention_bytes(b, h, n, d, es) / specs.attention_flops(
          b, h, n, d))
wrong("arithmetic-intensity", "elements-not-bytes", **_OK_BOUND,
      arithmetic_intensity=lambda b, h, n, d, es=4: 4 * n * n * d / (4 * n * d + 4 * n * n))
_OK_AI = {"arithmetic_intensity": specs.arithmetic_intensity}
wrong("arithmetic-intensity", "comparison-flipped", **_OK_AI, is_memory_bound=lambda i, p, bw: i >= p / bw)
wrong("arithmetic-intensity", "ridge-inverted", **_OK_AI, is_memory_bound=lambda i, p, bw: i < bw / p)

# --- 06 Triton primer ------------------------------------------------------------------

wrong("softmax-traffic", "elements-not-bytes", softmax_traffic=lambda m, n, es=4: (8 * m * n + 4 * m, 2 * m * n))
wrong("softmax-traffic", "reads-only", softmax_traffic=lambda m, n, es=4: ((5 * m * n + 2 * m) * es, m * n * es))
wrong("softmax-traffic", "row-vectors-forgotten", softmax_traffic=lambda m, n, es=4: (8 * m * n * es, 2 * m * n * es))


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


wrong("masked-scale", "out-of-bounds-store", scale_kernel=scale_no_mask)
wrong("masked-scale", "off-by-one-block-edge", scale_kernel=scale_off_by_one)
wrong("masked-scale", "out-of-bounds-load", scale_kernel=scale_load_unmasked)


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


wrong("softmax-kernel", "masked-lanes-zero", softmax_kernel=softmax_other_zero)
wrong("softmax-kernel", "no-max-subtraction", softmax_kernel=softmax_no_max)
wrong("softmax-kernel", "out-of-bounds-store", softmax_kernel=softmax_no_mask)

# --- 07 FlashAttention -----------------------------------------------------------------


def _online(rescale_acc=True, rescale_l=True, update_max=True):
    def online_softmax_update(m, l, acc, s_block, v_block):
        m_new = torch.maximum(m, s_block.max(-1).values) if update_max else m
        alpha = torch.exp(m - m_new)
        p = torch.exp(s_block - m_new[:, None])
        return m_new, (alpha * l if rescale_l else l) + p.sum(-1), (alpha[:, None] * acc if rescale_acc else acc) + p @ v_block
    return online_softmax_update


wrong("online-softmax-update", "acc-not-rescaled", online_softmax_update=_online(rescale_acc=False))
wrong("online-softmax-update", "l-not-rescaled", online_softmax_update=_online(rescale_l=False))
wrong("online-softmax-update", "max-not-updated", online_softmax_update=_online(update_max=False))


def _tiled(update=specs.online_softmax_update, tail=True, scaled=True):
    def tiled_attention_forward(q, k, v, block_k=16, scale=None):
        sc = (q.shape[-1] ** -0.5 if scale is None else scale) if scaled else 1.0
        m, l, acc = torch.full((q.shape[0],), -float("inf")), torch.zeros(q.shape[0]), torch.zeros(q.shape[0], v.shape[1])
        stop = k.shape[0] if tail else k.shape[0] - k.shape[0] % block_k
        for start in range(0, stop, block_k):
            m, l, acc = update(m, l, acc, q @ k[start:start + block_k].T * sc, v[start:start + block_k])
        return acc / l[:, None]
    return tiled_attention_forward


wrong("tiled-forward", "acc-not-rescaled", tiled_attention_forward=_tiled(update=_online(rescale_acc=False)))
wrong("tiled-forward", "off-by-one-block-edge", tiled_attention_forward=_tiled(tail=False))
wrong("tiled-forward", "scale-forgotten", tiled_attention_forward=_tiled(scaled=False))


@triton.jit
def _flash_body(Q, K, V, O, stride_h, stride_n, n_ctx, scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # the mistake switches RESCALE, MASK_TAIL, MASK_LOADS are globals
    pid_m = tl.program_id(0)
    base = tl.program_id(1) * stride_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * stride_n + offs_d[None, :], mask=offs_m[:, None] < n_ctx, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start in range(0, n_ctx, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if MASK_LOADS:
            k = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx, other=0.0)
            v = tl.load(V + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx, other=0.0)
        else:
            k = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :])
            v = tl.load(V + base + offs_n[:, None] * stride_n + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * scale
        if MASK_TAIL:
            s = tl.where(offs_n[None, :] < n_ctx, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if RESCALE:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        else:
            acc = acc + tl.dot(p, v)
        m_i = m_new
    tl.store(O + base + offs_m[:, None] * stride_n + offs_d[None, :], acc / l_i[:, None], mask=offs_m[:, None] < n_ctx)


def _variant(body, **flags):
    """A real @triton.jit kernel: ``body`` with its mistake switches (globals of its code) set to
    ``flags``, called with the spec's signature. (Run in Triton's interpreter, as the tests are.)"""
    import types

    fn = body.fn
    variant = types.FunctionType(fn.__code__, {**fn.__globals__, **flags}, fn.__name__, fn.__defaults__,
                                 fn.__closure__)
    variant.__annotations__ = dict(fn.__annotations__)
    return triton.jit(variant)


def _flash_variant(**flags):
    return _variant(_flash_body, **flags)


_FLASH_OK = dict(RESCALE=True, MASK_TAIL=True, MASK_LOADS=True)
wrong("flash-kernel-loop", "acc-not-rescaled", flash_fwd_kernel=_flash_variant(**{**_FLASH_OK, "RESCALE": False}))
wrong("flash-kernel-loop", "off-by-one-block-edge",
      flash_fwd_kernel=_flash_variant(**{**_FLASH_OK, "MASK_TAIL": False}))
wrong("flash-kernel-loop", "out-of-bounds-load",
      flash_fwd_kernel=_flash_variant(**{**_FLASH_OK, "MASK_LOADS": False}))

# --- 08 block-sparse -------------------------------------------------------------------


def _window(strict=False, causal_ok=True, reverse=False):
    def sliding_window_block_mask(n_blocks, window, causal=False):
        i, j = torch.arange(n_blocks)[:, None], torch.arange(n_blocks)[None, :]
        keep = (i - j).abs() < window if strict else (i - j).abs() <= window
        if causal and causal_ok:
            keep &= (j >= i) if reverse else (j <= i)
        return keep
    return sliding_window_block_mask


wrong("block-mask-builder", "off-by-one-window", sliding_window_block_mask=_window(strict=True))
wrong("block-mask-builder", "causal-ignored", sliding_window_block_mask=_window(causal_ok=False))
wrong("block-mask-builder", "causal-reversed", sliding_window_block_mask=_window(reverse=True))

wrong("block-mask-to-elements", "not-cropped",
      block_to_element_mask=lambda bm, bs, n_q, n_k: bm.repeat_interleave(bs[0], -2).repeat_interleave(bs[1], -1))
wrong("block-mask-to-elements", "swapped-block-size",
      block_to_element_mask=lambda bm, bs, n_q, n_k: bm[..., (torch.arange(n_q) // bs[1])[:, None],
                                                       (torch.arange(n_k) // bs[0])[None, :]])
wrong("block-mask-to-elements", "off-by-one-block-edge",
      block_to_element_mask=lambda bm, bs, n_q, n_k: bm[..., ((torch.arange(n_q) + 1) // bs[0]).clamp(
          max=bm.shape[-2] - 1)[:, None], ((torch.arange(n_k) + 1) // bs[1]).clamp(max=bm.shape[-1] - 1)[None, :]])


@triton.jit
def _sparse_body(Q, K, V, O, block_mask, stride_h, stride_n, n_ctx, n_qb, n_kb, scale, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # the mistake switches USE_MASK, TRANSPOSED, RESCALE, GUARD_EMPTY, LOAD_ALL are globals
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    base = pid_h * stride_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * stride_n + offs_d[None, :], mask=offs_m[:, None] < n_ctx, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for j in range(0, n_kb):
        if TRANSPOSED:
            keep = tl.load(block_mask + (pid_h * n_qb + j) * n_kb + pid_m)
        else:
            keep = tl.load(block_mask + (pid_h * n_qb + pid_m) * n_kb + j)
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        if LOAD_ALL == 2:  # loads hoisted above the test: every block's K and V is read, kept or not
            k_all = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx,
                            other=0.0)
            v_all = tl.load(V + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx,
                            other=0.0)
        if keep != 0 or not USE_MASK or LOAD_ALL == 1:
            if LOAD_ALL == 2:
                k = k_all
                v = v_all
            else:
                k = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx,
                            other=0.0)
                v = tl.load(V + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx,
                            other=0.0)
            s = tl.where(offs_n[None, :] < n_ctx, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
            if LOAD_ALL == 1:  # every block computed, the skipped ones masked to -inf afterwards
                s = tl.where(keep != 0, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no kept key yet: avoid -inf - -inf
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if RESCALE:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            else:
                acc = acc + tl.dot(p, v)
            m_i = m_new
    if GUARD_EMPTY:
        l_i = tl.where(l_i > 0, l_i, 1.0)
    tl.store(O + base + offs_m[:, None] * stride_n + offs_d[None, :], acc / l_i[:, None], mask=offs_m[:, None] < n_ctx)


def _sparse_variant(**flags):
    return _variant(_sparse_body, **{"LOAD_ALL": 0, **flags})


_SPARSE_OK = dict(USE_MASK=True, TRANSPOSED=False, RESCALE=True, GUARD_EMPTY=True)
wrong("block-sparse-loop", "mask-ignored", block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "USE_MASK": False}))
wrong("block-sparse-loop", "mask-transposed",
      block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "TRANSPOSED": True}))
wrong("block-sparse-loop", "acc-not-rescaled",
      block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "RESCALE": False}))
wrong("block-sparse-loop", "fully-masked-row",
      block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "GUARD_EMPTY": False}))
# right numbers, but skipped blocks are loaded (and masked afterwards): as many bytes as dense attention
wrong("block-sparse-loop", "loads-skipped-blocks",
      block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "LOAD_ALL": 1}))
wrong("block-sparse-loop", "loads-skipped-blocks",
      block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "LOAD_ALL": 2}))


# --- the tests -------------------------------------------------------------------------


@pytest.mark.parametrize("part, names, key", WRONG)
def test_wrong_implementation_fails_with_its_diagnosis(part, names, key):
    ns = {name: getattr(specs, name) for name in PARTS[part].names if hasattr(specs, name)}
    ns.update(names)
    result = run_check(part, LocalLearner(ns, forbidden=[]))  # diagnosis only: shortcuts are tested below
    assert not result.passed, result.message
    assert key in result.diagnosis, result.message
    assert "likely mistake" in result.message


def test_every_part_has_at_least_three_wrong_implementations():
    counts = {}
    for p in WRONG:
        counts[p.values[0]] = counts.get(p.values[0], 0) + 1
    assert set(counts) == set(PARTS)
    assert min(counts.values()) >= 3, counts


def test_exercises_have_three_to_six_parts():
    assert sorted(EXERCISES) == ["01_soft_alignment", "02_queries_keys_values", "03_scaled_dot_product",
                                 "04_multi_head", "05_quadratic_cost", "06_triton_primer", "07_flash_attention",
                                 "08_block_sparse"]
    assert all(3 <= len(parts) <= 6 for parts in EXERCISES.values())


@pytest.mark.parametrize("part", [p for p in PARTS if all(hasattr(specs, n) for n in PARTS[p].names)])
def test_the_spec_itself_passes(part):
    result = run_check(part, LocalLearner({n: getattr(specs, n) for n in PARTS[part].names}, forbidden=[]))
    assert result.passed, result.message


@pytest.mark.parametrize("part", [p for p in PARTS if all(hasattr(specs, n) for n in PARTS[p].names)])
def test_the_grader_s_reference_is_refused_as_an_answer(part):
    result = run_check(part, {n: getattr(specs, n) for n in PARTS[part].names})
    assert not result.passed and "shortcut" in result.diagnosis, result.message
    assert "attnlab.grading.specs." in result.message


def test_missing_and_unfinished_functions_are_named():
    result = run_check("attention-masks", {})
    assert not result.passed and "`masked_attention` is not defined" in result.message

    def masked_attention(q, k, v, mask=None):
        raise NotImplementedError()

    result = run_check("attention-masks", {"masked_attention": masked_attention})
    assert not result.passed and "not implemented yet" in result.message


def test_a_crashing_function_is_reported_not_raised():
    result = run_check("causal-mask", {"causal_mask": lambda n_q, n_k, device=None: 1 / 0})
    assert not result.passed and "ZeroDivisionError" in result.message


def test_inputs_are_protected_from_in_place_edits():
    def padding_mask(lengths, max_len):
        out = torch.arange(max_len)[None, :] < lengths[:, None]
        lengths.zero_()  # vandalises its argument
        return out

    assert run_check("padding-mask", {"padding_mask": padding_mask}).passed


def test_check_prints_and_raises_only_under_nbgrader(capsys, monkeypatch):
    from attnlab.grading import check

    monkeypatch.delenv("ATTNLAB_GRADING", raising=False)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    monkeypatch.delenv("NBGRADER_VALIDATING", raising=False)
    def causal_mask(n_q, n_k, device=None):
        return torch.ones(n_q, n_k, dtype=torch.bool).tril()

    check("causal-mask", {"causal_mask": causal_mask})
    assert "[PASS] causal-mask" in capsys.readouterr().out
    check("causal-mask", {"causal_mask": lambda a, b, device=None: torch.ones(a, b, dtype=torch.bool)})
    assert "[FAIL] causal-mask" in capsys.readouterr().out
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    with pytest.raises(AssertionError, match="causal-mask"):
        check("causal-mask", {"causal_mask": lambda a, b, device=None: torch.ones(a, b, dtype=torch.bool)})


def test_unknown_part_is_a_value_error():
    with pytest.raises(ValueError, match="part_id"):
        run_check("no-such-part", {})


def test_equivalent_answers_in_other_forms_pass():
    import numpy as np

    def score_variance(q, k):  # a list instead of a stacked tensor
        raw = (q * k).sum(-1)
        return [raw.var().item(), (raw / q.shape[-1] ** 0.5).var().item()]

    assert run_check("variance-experiment", {"score_variance": score_variance}).passed
    ns = {"arithmetic_intensity": lambda b, h, n, d, es=4: np.float64(4 * n * n * d / ((4 * n * d + 4 * n * n) * es)),
          "is_memory_bound": lambda i, p, bw: np.bool_(i < p / bw)}
    assert run_check("arithmetic-intensity", ns).passed

    def masked_attention(q, k, v, mask=None):  # right, but PyTorch's fused kernel does the work: refused
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return torch.nan_to_num(out)

    result = run_check("attention-masks", {"masked_attention": masked_attention})
    assert not result.passed and "shortcut" in result.diagnosis
    assert "torch.nn.functional.scaled_dot_product_attention" in result.message
