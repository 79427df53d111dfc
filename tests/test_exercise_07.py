"""Exercise 07 (FlashAttention): wrong implementations fail their check with the matching diagnosis."""


import torch
import triton
import triton.language as tl

from attnlab.grading.exercises.e07 import spec as specs
from mistakes import Wrong, variant as _variant

WRONG = Wrong()


def _online(rescale_acc=True, rescale_l=True, update_max=True):
    def online_softmax_update(m, l, acc, s_block, v_block):
        m_new = torch.maximum(m, s_block.max(-1).values) if update_max else m
        alpha = torch.exp(m - m_new)
        p = torch.exp(s_block - m_new[:, None])
        return m_new, (alpha * l if rescale_l else l) + p.sum(-1), (alpha[:, None] * acc if rescale_acc else acc) + p @ v_block
    return online_softmax_update


WRONG.add("online-softmax-update", "acc-not-rescaled", online_softmax_update=_online(rescale_acc=False))
WRONG.add("online-softmax-update", "l-not-rescaled", online_softmax_update=_online(rescale_l=False))
WRONG.add("online-softmax-update", "max-not-updated", online_softmax_update=_online(update_max=False))


def _tiled(update=specs.online_softmax_update, tail=True, scaled=True):
    def tiled_attention_forward(q, k, v, block_k=16, scale=None):
        sc = (q.shape[-1] ** -0.5 if scale is None else scale) if scaled else 1.0
        m, l, acc = torch.full((q.shape[0],), -float("inf")), torch.zeros(q.shape[0]), torch.zeros(q.shape[0], v.shape[1])
        stop = k.shape[0] if tail else k.shape[0] - k.shape[0] % block_k
        for start in range(0, stop, block_k):
            m, l, acc = update(m, l, acc, q @ k[start:start + block_k].T * sc, v[start:start + block_k])
        return acc / l[:, None]
    return tiled_attention_forward


WRONG.add("tiled-forward", "acc-not-rescaled", tiled_attention_forward=_tiled(update=_online(rescale_acc=False)))
WRONG.add("tiled-forward", "off-by-one-block-edge", tiled_attention_forward=_tiled(tail=False))
WRONG.add("tiled-forward", "scale-forgotten", tiled_attention_forward=_tiled(scaled=False))


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


def _flash_variant(**flags):
    return _variant(_flash_body, **flags)


_FLASH_OK = dict(RESCALE=True, MASK_TAIL=True, MASK_LOADS=True)
WRONG.add("flash-kernel-loop", "acc-not-rescaled", flash_fwd_kernel=_flash_variant(**{**_FLASH_OK, "RESCALE": False}))
WRONG.add("flash-kernel-loop", "off-by-one-block-edge",
      flash_fwd_kernel=_flash_variant(**{**_FLASH_OK, "MASK_TAIL": False}))
WRONG.add("flash-kernel-loop", "out-of-bounds-load",
      flash_fwd_kernel=_flash_variant(**{**_FLASH_OK, "MASK_LOADS": False}))


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()
