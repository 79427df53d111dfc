"""Plain PyTorch specs of every graded exercise part.

Each exercise part starts from one of these functions (a notebook shows it with
``show_source``), and the grader uses the same function as its reference: what
the learner reads is what they are graded against. They are written for
clarity, not speed; shapes are in the comments. Tensors are
``(batch, heads, seq, head_dim)`` as everywhere in the course.

Example::

    >>> from attnlab.grading import specs
    >>> specs.softmax(torch.tensor([[1.0, 1.0]]))
    tensor([[0.5000, 0.5000]])
"""

import math

import torch

# ---------------------------------------------------------------------------
# 01 soft alignment (Bahdanau et al., 2014)
# ---------------------------------------------------------------------------


def additive_scores(s, h, w, u, v):
    """Alignment scores e_j = v^T tanh(W s + U h_j).

    s: (B, Dq) decoder state; h: (B, N, Dk) encoder states;
    w: (A, Dq), u: (A, Dk), v: (A,).  Returns (B, N).
    """
    ws = s @ w.T  # (B, A)
    uh = h @ u.T  # (B, N, A)
    return torch.tanh(ws[:, None, :] + uh) @ v  # (B, N)


def context_vector(scores, h, mask=None):
    """Softmax the scores over the N source positions and average the encoder states.

    scores: (B, N); h: (B, N, Dk); mask: bool (B, N), True = real token, or None.
    Returns (context (B, Dk), weights (B, N)). A row with no real token gets zero weights.
    """
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)  # (B, 1), the row max
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)  # (B, N), masked positions are exp(-inf) = 0
    total = e.sum(dim=-1, keepdim=True)  # (B, 1)
    weights = torch.where(total > 0, e / total.clamp_min(1e-30), torch.zeros_like(e))
    context = (weights[:, :, None] * h).sum(dim=1)  # (B, Dk)
    return context, weights


def decode_step(s, h, w, u, v, w_s, w_c, mask=None):
    """One step of an attention decoder: attend with the current state, then update it.

    s: (B, Dq); h: (B, N, Dk); w, u, v as in ``additive_scores``;
    w_s: (Dq, Dq), w_c: (Dq, Dk); mask: bool (B, N) or None.
    Returns (new state (B, Dq) = tanh(s W_s^T + c W_c^T), weights (B, N)).
    """
    scores = additive_scores(s, h, w, u, v)  # (B, N)
    c, weights = context_vector(scores, h, mask)  # (B, Dk), (B, N)
    s_new = torch.tanh(s @ w_s.T + c @ w_c.T)  # (B, Dq)
    return s_new, weights


# ---------------------------------------------------------------------------
# 02 queries, keys and values
# ---------------------------------------------------------------------------


def padding_mask(lengths, max_len):
    """Bool (B, max_len), True where position j < lengths[b] (a real token).

    lengths: int (B,).
    """
    positions = torch.arange(max_len, device=lengths.device)  # (max_len,)
    return positions[None, :] < lengths[:, None]  # (B, max_len)


def causal_mask(n_q, n_k, device=None):
    """Bool (n_q, n_k), True where key j <= query i (top-left aligned, like PyTorch's is_causal)."""
    i = torch.arange(n_q, device=device)[:, None]  # (n_q, 1)
    j = torch.arange(n_k, device=device)[None, :]  # (1, n_k)
    return j <= i


def masked_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d) with masked scores removed) v.

    q: (B, H, Nq, d); k: (B, H, Nk, d); v: (B, H, Nk, dv);
    mask: bool broadcastable to (B, H, Nq, Nk), True = attend, or None.
    A query row with no key to attend to outputs zeros. Returns (B, H, Nq, dv).
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Nq, Nk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)  # (B, H, Nq, Nk)
    total = e.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, e / total.clamp_min(1e-30), torch.zeros_like(e))
    return p @ v  # (B, H, Nq, dv)


# ---------------------------------------------------------------------------
# 03 scaled dot-product attention
# ---------------------------------------------------------------------------


def softmax(x, dim=-1):
    """Numerically stable softmax: subtract each row's max before exp."""
    m = x.amax(dim=dim, keepdim=True)
    e = torch.exp(x - m)
    return e / e.sum(dim=dim, keepdim=True)


def scaled_dot_product_attention(q, k, v, scale=None):
    """softmax(q k^T * scale) v with scale = 1/sqrt(d) by default.

    q: (B, H, Nq, d); k: (B, H, Nk, d); v: (B, H, Nk, dv). Returns (B, H, Nq, dv).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, Nq, Nk)
    return softmax(scores, dim=-1) @ v  # (B, H, Nq, dv)


def score_variance(q, k):
    """Variance of raw and scaled dot products of matching rows.

    q, k: (n, d) with independent N(0, 1) entries. The raw scores are
    q_i . k_i (n of them); the scaled ones are divided by sqrt(d).
    Returns a tensor [var(raw), var(scaled)] (torch.var, unbiased).
    """
    raw = (q * k).sum(dim=-1)  # (n,)
    scaled = raw / math.sqrt(q.shape[-1])
    return torch.stack([raw.var(), scaled.var()])


# ---------------------------------------------------------------------------
# 04 multi-head attention
# ---------------------------------------------------------------------------


def split_heads(x, num_heads):
    """(B, N, d_model) -> (B, h, N, d_model / h): head i holds features [i*dh, (i+1)*dh)."""
    b, n, d_model = x.shape
    d_head = d_model // num_heads
    return x.view(b, n, num_heads, d_head).transpose(1, 2)  # (B, h, N, dh)


def merge_heads(x):
    """(B, h, N, dh) -> (B, N, h*dh), the inverse of ``split_heads``."""
    b, h, n, dh = x.shape
    return x.transpose(1, 2).reshape(b, n, h * dh)  # (B, N, d_model)


def multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads, causal=False):
    """Multi-head self-attention without biases (nn.Linear convention: y = x W^T).

    x: (B, N, d_model); w_q, w_k, w_v, w_o: (d_model, d_model).
    Returns (B, N, d_model).
    """
    q = split_heads(x @ w_q.T, num_heads)  # (B, h, N, dh)
    k = split_heads(x @ w_k.T, num_heads)
    v = split_heads(x @ w_v.T, num_heads)
    n = x.shape[1]
    mask = causal_mask(n, n, device=x.device) if causal else None
    heads = masked_attention(q, k, v, mask)  # (B, h, N, dh), scaled by 1/sqrt(dh)
    return merge_heads(heads) @ w_o.T  # (B, N, d_model)


# ---------------------------------------------------------------------------
# 05 the quadratic cost
# ---------------------------------------------------------------------------


def attention_flops(batch, heads, n, d):
    """FLOPs of standard attention's two matmuls (a multiply-add counts 2).

    S = Q K^T: 2 n^2 d per head; O = P V: 2 n^2 d per head. The softmax is not counted.
    """
    return batch * heads * (2 * n * n * d + 2 * n * n * d)


def attention_bytes(batch, heads, n, d, element_size=4):
    """HBM bytes standard attention moves when it materialises S and P.

    Per head, in elements: read Q, K (2nd), write S (n^2), read S (n^2), write P (n^2),
    read P (n^2) and V (nd), write O (nd): 4nd + 4n^2.
    """
    elements = 4 * n * d + 4 * n * n
    return batch * heads * elements * element_size


def arithmetic_intensity(batch, heads, n, d, element_size=4):
    """FLOPs per HBM byte of standard attention."""
    return attention_flops(batch, heads, n, d) / attention_bytes(batch, heads, n, d, element_size)


def is_memory_bound(intensity, peak_flops, bandwidth):
    """True when a kernel of this intensity (FLOP/byte) cannot reach peak compute.

    The machine's ridge point is peak_flops / bandwidth (FLOP/s over byte/s).
    """
    return intensity < peak_flops / bandwidth


# ---------------------------------------------------------------------------
# 06 Triton primer (the kernels' specs; the grader launches the learner's kernel)
# ---------------------------------------------------------------------------


def scale(x, alpha):
    """y = alpha * x elementwise; x: (n,)."""
    return alpha * x


def softmax_traffic(n_rows, n_cols, element_size=4):
    """Bytes of HBM traffic of a row softmax, naive (PyTorch ops) vs fused (one kernel).

    Naive (Triton's fused-softmax tutorial): x.max -> read MN, write M; x - max -> read MN + M,
    write MN; exp -> read MN, write MN; sum -> read MN, write M; divide -> read MN + M, write MN.
    In all 8MN + 4M elements. Fused: read MN, write MN = 2MN elements.
    Returns (naive_bytes, fused_bytes).
    """
    m, n = n_rows, n_cols
    naive = (8 * m * n + 4 * m) * element_size
    fused = 2 * m * n * element_size
    return naive, fused


# ---------------------------------------------------------------------------
# 07 FlashAttention
# ---------------------------------------------------------------------------


def online_softmax_update(m, l, acc, s_block, v_block):
    """Fold one block of scores into running softmax statistics.

    m: (M,) running max; l: (M,) running sum of exp(s - m); acc: (M, dv) running
    unnormalised output; s_block: (M, Nb) scores of the new keys; v_block: (Nb, dv).
    Returns (m_new, l_new, acc_new). At the end, out = acc / l[:, None].
    """
    m_new = torch.maximum(m, s_block.amax(dim=-1))  # (M,)
    alpha = torch.exp(m - m_new)  # (M,) rescales what was accumulated so far
    p = torch.exp(s_block - m_new[:, None])  # (M, Nb)
    l_new = alpha * l + p.sum(dim=-1)
    acc_new = alpha[:, None] * acc + p @ v_block  # (M, dv)
    return m_new, l_new, acc_new


def tiled_attention_forward(q, k, v, block_k=16, scale=None):
    """Attention computed one block of keys at a time (FlashAttention's outer loop in PyTorch).

    q: (M, d); k: (N, d); v: (N, dv); any N (the last block may be partial).
    Returns (M, dv), equal to softmax(q k^T * scale) v.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    m = torch.full((q.shape[0],), float("-inf"), dtype=q.dtype)
    l = torch.zeros(q.shape[0], dtype=q.dtype)
    acc = torch.zeros(q.shape[0], v.shape[-1], dtype=q.dtype)
    for start in range(0, k.shape[0], block_k):
        s = q @ k[start : start + block_k].T * scale  # (M, <= block_k)
        m, l, acc = online_softmax_update(m, l, acc, s, v[start : start + block_k])
    return acc / l[:, None]


def attention(q, k, v, scale=None, mask=None):
    """Reference for the Triton kernels: attention over the last two dims, any leading dims.

    q: (..., Nq, d); k, v: (..., Nk, d); mask: bool broadcastable to (..., Nq, Nk) or None.
    Rows with nothing to attend to are zeros.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.transpose(-2, -1) * scale  # (..., Nq, Nk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, e / total.clamp_min(1e-30), torch.zeros_like(e))
    return p @ v  # (..., Nq, dv)


# ---------------------------------------------------------------------------
# 08 block-sparse attention
# ---------------------------------------------------------------------------


def sliding_window_block_mask(n_blocks, window, causal=False):
    """Bool (n_blocks, n_blocks): query block i sees key block j when |i - j| <= window,
    and, if causal, only j <= i."""
    i = torch.arange(n_blocks)[:, None]
    j = torch.arange(n_blocks)[None, :]
    keep = (i - j).abs() <= window
    if causal:
        keep = keep & (j <= i)
    return keep


def block_to_element_mask(block_mask, block_size, n_q, n_k):
    """Expand a bool block mask (..., nqb, nkb) to an element mask (..., n_q, n_k).

    block_size = (BQ, BK); element (i, j) is kept when block (i // BQ, j // BK) is.
    """
    bq, bk = block_size
    full = block_mask.repeat_interleave(bq, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :n_q, :n_k]


# ---------------------------------------------------------------------------
# Hidden while `attnlab grade` runs a notebook
# ---------------------------------------------------------------------------

HIDDEN = False  # True in a kernel run by `attnlab grade`: the functions above are stand-ins


def _hidden(*args, **kwargs):
    """The grader's references are not available while `attnlab grade` runs this notebook."""
    raise RuntimeError("attnlab.grading.specs is not available while `attnlab grade` runs your notebook: "
                       "the grader's references are not answers")


def _hide_references():
    # the learner's kernel under `attnlab grade` (ATTNLAB_GRADING=1, set before the notebook's first
    # cell) gets stand-ins: the grader compares with the real functions in its own process
    import types

    globals()["HIDDEN"] = True
    for name, value in list(globals().items()):
        if isinstance(value, types.FunctionType) and not name.startswith("_") and value.__module__ == __name__:
            stub = types.FunctionType(_hidden.__code__, {}, name)
            stub.__doc__ = _hidden.__doc__
            stub.__module__ = __name__
            globals()[name] = stub


if __import__("os").environ.get("ATTNLAB_GRADING") == "1":
    _hide_references()
