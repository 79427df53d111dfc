"""Exercise 08 (block-sparse attention): wrong implementations fail their check with the matching diagnosis."""


import torch
import triton
import triton.language as tl

from mistakes import Wrong, variant as _variant

WRONG = Wrong()


def _window(strict=False, causal_ok=True, reverse=False):
    def sliding_window_block_mask(n_blocks, window, causal=False):
        i, j = torch.arange(n_blocks)[:, None], torch.arange(n_blocks)[None, :]
        keep = (i - j).abs() < window if strict else (i - j).abs() <= window
        if causal and causal_ok:
            keep &= (j >= i) if reverse else (j <= i)
        return keep
    return sliding_window_block_mask


WRONG.add("block-mask-builder", "off-by-one-window", sliding_window_block_mask=_window(strict=True))
WRONG.add("block-mask-builder", "causal-ignored", sliding_window_block_mask=_window(causal_ok=False))
WRONG.add("block-mask-builder", "causal-reversed", sliding_window_block_mask=_window(reverse=True))

WRONG.add("block-mask-to-elements", "not-cropped",
      block_to_element_mask=lambda bm, bs, n_q, n_k: bm.repeat_interleave(bs[0], -2).repeat_interleave(bs[1], -1))
WRONG.add("block-mask-to-elements", "swapped-block-size",
      block_to_element_mask=lambda bm, bs, n_q, n_k: bm[..., (torch.arange(n_q) // bs[1])[:, None],
                                                       (torch.arange(n_k) // bs[0])[None, :]])
WRONG.add("block-mask-to-elements", "off-by-one-block-edge",
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
WRONG.add("block-sparse-loop", "mask-ignored", block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "USE_MASK": False}))
WRONG.add("block-sparse-loop", "mask-transposed",
      block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "TRANSPOSED": True}))
WRONG.add("block-sparse-loop", "acc-not-rescaled",
      block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "RESCALE": False}))
WRONG.add("block-sparse-loop", "fully-masked-row",
      block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "GUARD_EMPTY": False}))
# right numbers, but skipped blocks are loaded (and masked afterwards): as many bytes as dense attention
WRONG.add("block-sparse-loop", "loads-skipped-blocks",
      block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "LOAD_ALL": 1}))
WRONG.add("block-sparse-loop", "loads-skipped-blocks",
      block_sparse_fwd_kernel=_sparse_variant(**{**_SPARSE_OK, "LOAD_ALL": 2}))


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()
