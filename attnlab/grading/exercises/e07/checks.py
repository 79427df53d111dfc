"""The checks of exercise 07_flash_attention (one ``@CHECKS(part id)`` per graded part)."""

import math

import torch

from attnlab.grading.core import Mistake, Registry, check_function, gen as _gen, randn as _randn
from attnlab.grading.exercises.e07 import spec as specs
from attnlab.grading.exercises.e08.spec import block_to_element_mask
from attnlab.grading.kernel_check import cdiv, kernel_failure, run_guarded

CHECKS = Registry()


def _online_cases():
    cases = []
    for seed, (m_rows, nb, dv, first) in enumerate([(4, 8, 5, True), (3, 16, 4, False), (6, 5, 8, False),
                                                      (2, 4, 3, False)]):
        g = _gen(1300 + seed)
        scale = 30.0 if seed == 3 else 1.0
        s_block, v_block = _randn(g, m_rows, nb, scale=scale), _randn(g, nb, dv)
        if first:
            m = torch.full((m_rows,), float("-inf"))
            l, acc = torch.zeros(m_rows), torch.zeros(m_rows, dv)
            label = f"the first block (m = -inf, l = 0, acc = 0), M={m_rows}, Nb={nb}"
        else:
            m, l, acc = _randn(g, m_rows) * 2 * scale, torch.rand(m_rows, generator=g) + 0.5, _randn(g, m_rows, dv)
            label = f"a later block, M={m_rows}, Nb={nb}" + (", scores ~ 30" if scale > 1 else "")
        cases.append((label, (m, l, acc, s_block, v_block), {}))
    return cases


def _online_with(rescale_acc=True, rescale_l=True, update_max=True, inverted=False):
    def impl(m, l, acc, s_block, v_block):
        m_new = torch.maximum(m, s_block.amax(-1)) if update_max else m
        alpha = torch.exp(m_new - m) if inverted else torch.exp(m - m_new)
        p = torch.exp(s_block - m_new[:, None])
        l_new = (alpha * l if rescale_l else l) + p.sum(-1)
        acc_new = (alpha[:, None] * acc if rescale_acc else acc) + p @ v_block
        return m_new, l_new, acc_new
    return impl


_ONLINE_MISTAKES = [
    Mistake("acc-not-rescaled", "the accumulator is not rescaled: multiply acc by exp(m_old - m_new) before adding "
            "the new block", _online_with(rescale_acc=False)),
    Mistake("l-not-rescaled", "the running sum l is not rescaled by exp(m_old - m_new)", _online_with(rescale_l=False)),
    Mistake("max-not-updated", "the running max is not updated with the new block's max",
            _online_with(update_max=False)),
    Mistake("rescale-inverted", "the rescale factor is inverted: it is exp(m_old - m_new) <= 1",
            _online_with(inverted=True)),
]


@CHECKS("online-softmax-update")
def _check_online(ns):
    n = check_function(ns, "online_softmax_update", specs.online_softmax_update, _online_cases(), _ONLINE_MISTAKES)
    return f"{n} cases match the spec, including the first block"


def _tiled_cases():
    cases = []
    for seed, (m, n, d, bk) in enumerate([(5, 32, 8, 16), (4, 37, 8, 16), (3, 7, 4, 8), (6, 50, 16, 16)]):
        g = _gen(1400 + seed)
        cases.append((f"M={m}, N={n}, d={d}, block_k={bk}", (_randn(g, m, d), _randn(g, n, d), _randn(g, n, d)),
                       {"block_k": bk}))
    return cases


def _tiled_with(update=specs.online_softmax_update, drop_tail=False, use_scale=True, normalise=True):
    def impl(q, k, v, block_k=16, scale=None):
        sc = (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale) if use_scale else 1.0
        m = torch.full((q.shape[0],), float("-inf"))
        l, acc = torch.zeros(q.shape[0]), torch.zeros(q.shape[0], v.shape[-1])
        stop = (k.shape[0] // block_k) * block_k if drop_tail else k.shape[0]
        if stop == 0:
            return torch.full((q.shape[0], v.shape[-1]), float("nan"))
        for start in range(0, stop, block_k):
            m, l, acc = update(m, l, acc, q @ k[start:start + block_k].T * sc, v[start:start + block_k])
        return acc / l[:, None] if normalise else acc
    return impl


_TILED_MISTAKES = [
    Mistake("acc-not-rescaled", "the accumulator is not rescaled when the running max grows",
            _tiled_with(update=_online_with(rescale_acc=False))),
    Mistake("off-by-one-block-edge", "the last, partial block of keys is skipped: loop over range(0, N, block_k)",
            _tiled_with(drop_tail=True)),
    Mistake("scale-forgotten", "the 1/sqrt(d) scale is forgotten", _tiled_with(use_scale=False)),
    Mistake("not-normalised", "the result is not divided by the running sum l at the end", _tiled_with(normalise=False)),
]


@CHECKS("tiled-forward")
def _check_tiled(ns):
    n = check_function(ns, "tiled_attention_forward", specs.tiled_attention_forward, _tiled_cases(), _TILED_MISTAKES)
    return f"{n} cases match the spec, including partial last blocks"


def _kernel_reference(q, k, v, scale, block_n, block_mask=None, block_m=None, rescale_acc=True, use_scale=True,
                      mask_tail=True, mask_ignored=False, mask_transposed=False, nan_empty=False):
    """The Triton loop in PyTorch, with switches for the mistakes (q, k, v: (BH, N, D))."""
    bh, n, d = q.shape
    sc = scale if use_scale else 1.0
    kp, vp = k, v
    if not mask_tail:  # keys past n_ctx loaded as 0 and not masked: they join the softmax with score 0
        pad = (-n) % block_n
        kp = torch.cat([k, k.new_zeros(bh, pad, d)], dim=1)
        vp = torch.cat([v, v.new_zeros(bh, pad, d)], dim=1)
    s = q @ kp.transpose(-2, -1) * sc  # (BH, N, Nk')
    mask = None
    if block_mask is not None and not mask_ignored:
        bm = block_mask.transpose(-2, -1) if mask_transposed else block_mask
        mask = block_to_element_mask(bm, (block_m, block_n), n, kp.shape[1])
    if not rescale_acc:
        out = torch.zeros(bh, n, d)
        m = torch.full((bh, n), float("-inf"))
        l = torch.zeros(bh, n)
        for start in range(0, kp.shape[1], block_n):
            sb = s[:, :, start:start + block_n]
            if mask is not None:
                sb = sb.masked_fill(~mask[:, :, start:start + block_n], float("-inf"))
            m_new = torch.maximum(m, sb.amax(-1))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.exp(sb - m_safe[..., None])
            l = torch.exp(torch.where(torch.isfinite(m), m - m_safe, torch.full_like(m, float("-inf")))) * l + p.sum(-1)
            out = out + p @ vp[:, start:start + block_n]
            m = m_new
        return out / torch.where(l > 0, l, torch.ones_like(l))[..., None]
    out = specs.attention(q, kp, vp, scale=sc, mask=mask)
    if nan_empty and mask is not None:
        empty = ~mask.any(-1)
        out = out.masked_fill(empty[..., None], float("nan"))
    return out


def _flash_cases():
    cases = []
    for seed, (bh, n, d, bm, bn, amp) in enumerate([(2, 32, 16, 16, 16, 1.0), (2, 40, 16, 16, 16, 1.0),
                                                    (1, 7, 16, 16, 16, 1.0), (2, 48, 16, 16, 16, 8.0)]):
        g = _gen(1500 + seed)
        q, k, v = _randn(g, bh, n, d, scale=amp), _randn(g, bh, n, d, scale=amp), _randn(g, bh, n, d)
        label = f"BH={bh}, N={n}, D={d}, BLOCK_M={bm}, BLOCK_N={bn}" + (" with large scores" if amp > 1 else "")
        cases.append((label, q, k, v, bm, bn))
    return cases


def _attention_buffers(q, k, v, pad_rows):
    return {"q": {"data": q, "pad_rows": pad_rows}, "k": {"data": k, "pad_rows": pad_rows},
            "v": {"data": v, "pad_rows": pad_rows}, "o": {"shape": list(q.shape), "output": True, "pad_rows": pad_rows}}


_ATTENTION_ARGS = [["buf", "q", None], ["buf", "k", None], ["buf", "v", None], ["buf", "o", None]]


_FLASH_MISTAKES = [
    Mistake("acc-not-rescaled", "the accumulator is not rescaled: acc = acc * alpha[:, None] + tl.dot(p, v)",
            lambda q, k, v, sc, bm, bn: _kernel_reference(q, k, v, sc, bn, rescale_acc=False)),
    Mistake("scale-forgotten", "the scale is not applied to the scores",
            lambda q, k, v, sc, bm, bn: _kernel_reference(q, k, v, sc, bn, use_scale=False)),
    Mistake("off-by-one-block-edge", "keys past n_ctx in the last block are not masked out: set their scores to "
            "-inf (offs_n < n_ctx) so they get no weight",
            lambda q, k, v, sc, bm, bn: _kernel_reference(q, k, v, sc, bn, mask_tail=False)),
]


@CHECKS("flash-kernel-loop")
def _check_flash(ns):
    cases = _flash_cases()
    for label, q, k, v, bm, bn in cases:
        bh, n, d = q.shape
        scale = d ** -0.5
        args = _ATTENTION_ARGS + [["stride", "o", 0], ["stride", "o", 1], ["val", n], ["val", scale]]
        got = run_guarded(ns, "flash_fwd_kernel", label, _attention_buffers(q, k, v, pad_rows=16),
                          (cdiv(n, bm), bh), args, {"HEAD_DIM": d, "BLOCK_M": bm, "BLOCK_N": bn}, ["o"])["o"]
        want = specs.attention(q, k, v, scale=scale)
        kernel_failure(label, "flash_fwd_kernel", got, want, _FLASH_MISTAKES, (q, k, v, scale, bm, bn), {},
                        uses_dot=True)
    return f"{len(cases)} launches match the spec (partial blocks, N < BLOCK, large scores), with no stray access"
