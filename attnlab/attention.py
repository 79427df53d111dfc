"""Reference attention in plain PyTorch: the spec every kernel of the course is checked against.

Read top to bottom, this file is the course in miniature:

1. ``softmax`` and ``masked_softmax``: turning scores into weights, stably.
2. ``padding_mask`` and ``causal_mask``: which keys a query may look at.
3. ``AdditiveAttention``: Bahdanau et al. (2014), score ``v^T tanh(W s + U h)``.
4. ``scaled_dot_product_attention``: Vaswani et al. (2017), ``softmax(q k^T * scale) v``.
5. ``MultiHeadAttention``: projections, split into heads, attend, merge.
6. ``naive_attention``: the same maths, materialising the n-by-n matrices S and P and
   reporting how many bytes they took (the cost FlashAttention removes).
7. ``block_sparse_reference``: dense attention under the element mask a block mask implies.

Conventions (the whole course uses them):

- Tensors are ``(batch, heads, seq, head_dim)``, written ``(B, H, N, D)`` in shape comments;
  ``Nq`` and ``Nk`` when queries and keys differ in length.
- Masks are bool, ``True`` = attend / keep. A mask only has to *broadcast* to ``(B, H, Nq, Nk)``.
- ``causal=True`` is TOP-LEFT aligned: query ``i`` sees keys ``j <= i``, exactly like
  ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, also when ``Nq != Nk``.
- A query row whose keys are all masked gets weights of zero and an output of zero (not NaN),
  as torch's SDPA does.
- Bad input raises ``ValueError`` / ``TypeError`` naming the argument and what was expected.
"""

import torch
from torch import nn

from attnlab import mask_mods, validate

__all__ = [
    "softmax",
    "masked_softmax",
    "padding_mask",
    "causal_mask",
    "AdditiveAttention",
    "scaled_dot_product_attention",
    "MultiHeadAttention",
    "naive_attention",
    "block_sparse_reference",
]


# ---------------------------------------------------------------------------------------------
# input checks specific to this file's modules (the shared rules are in attnlab/validate.py)
# ---------------------------------------------------------------------------------------------

def _check_additive_inputs(query, keys, query_dim, key_dim):
    """AdditiveAttention's inputs: query (B, query_dim), keys (B, N, key_dim), same dtype and device."""
    validate.tensor(query, "query", 2, "(batch, query_dim)")
    validate.tensor(keys, "keys", 3, "(batch, seq, key_dim)")
    if query.shape[1] != query_dim:
        raise ValueError(f"query: expected last dim query_dim={query_dim}, got shape {tuple(query.shape)}")
    if keys.shape[2] != key_dim:
        raise ValueError(f"keys: expected last dim key_dim={key_dim}, got shape {tuple(keys.shape)}")
    if keys.shape[0] != query.shape[0]:
        raise ValueError(f"keys: expected batch {query.shape[0]} like query, got shape {tuple(keys.shape)}")
    validate.like(keys, "keys", query, "query")


def _check_key_mask(mask, shape):
    """None, or a bool (batch, seq) mask of exactly ``shape`` (True = real token)."""
    if mask is None:
        return
    validate.tensor(mask, "mask", 2, "(batch, seq)")
    if mask.shape != shape:
        raise ValueError(f"mask: expected shape {tuple(shape)} (batch, seq), got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask: expected a bool tensor (True = real token), got dtype {mask.dtype}")


def _check_mha_inputs(query, key, value, d_model):
    """MultiHeadAttention's inputs: (batch, seq, d_model) each; key and value share (batch, seq)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        validate.tensor(x, name, 3, "(batch, seq, d_model)")
        if x.shape[-1] != d_model:
            raise ValueError(f"{name}: expected last dim d_model={d_model}, got shape {tuple(x.shape)}")
    if key.shape[0] != query.shape[0]:
        raise ValueError(f"key: expected batch {query.shape[0]} like query, got shape {tuple(key.shape)}")
    if value.shape[:2] != key.shape[:2]:
        raise ValueError(f"value: expected (batch, seq) = {tuple(key.shape[:2])} like key, "
                         f"got shape {tuple(value.shape)}")


def _torch_arguments(q, k, v, mask, causal, attn_mask, is_causal, enable_gqa, dropout_p):
    """torch's SDPA arguments in this file's terms: (k, v with one KV head per query head, the bool mask,
    causal, an additive float mask or None). A floating ``attn_mask`` is a bias whose -inf entries mask."""
    validate.flag(enable_gqa, "enable_gqa")
    validate.qkv(q, k, v, gqa=enable_gqa)
    bias = None
    if attn_mask is not None:
        if mask is not None:
            raise TypeError("attn_mask: pass the mask once, as mask= or as torch's attn_mask=, not both")
        validate.tensor(attn_mask, "attn_mask")
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        elif attn_mask.is_floating_point():
            bias, mask = attn_mask.to(q.dtype), attn_mask != float("-inf")   # -inf entries mask their key
        else:
            raise TypeError(f"attn_mask: expected a bool tensor (True = attend) or a floating one (added to the "
                            f"scores), got dtype {attn_mask.dtype}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask: expected device {q.device} (the device of q), got {attn_mask.device}")
    if is_causal is not None:
        validate.flag(is_causal, "is_causal")
        if causal:
            raise TypeError("is_causal: pass causality once, as causal= or as torch's is_causal=, not both")
        causal = is_causal
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(f"dropout_p: the reference attention has no dropout, expected 0.0, got {dropout_p!r}")
    if k.shape[1] != q.shape[1]:                             # enable_gqa: each KV head serves H / H_kv query heads
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)                # (B, H, Nk, D)
        v = v.repeat_interleave(group, dim=1)                # (B, H, Nk, Dv)
    return k, v, mask, causal, bias


# ---------------------------------------------------------------------------------------------
# 1. softmax
# ---------------------------------------------------------------------------------------------

def softmax(x, dim=-1):
    """Numerically stable softmax: ``exp(x - max) / sum(exp(x - max))`` along ``dim``.

    Subtracting the row maximum changes nothing mathematically (it cancels between numerator
    and denominator) but keeps ``exp`` from overflowing: scores of 1e4 work. Rows that are all
    ``-inf`` give NaN, as in ``torch.softmax``; use ``masked_softmax`` for masks.

    x: any shape, floating point. Returns the same shape.

    Example: ``softmax(torch.tensor([1000.0, 1000.0]))  # tensor([0.5, 0.5])``
    """
    validate.tensor(x, "x", floating=True)
    validate.dim(dim, x)
    if x.shape[dim] == 0:                        # no entries to weigh (no keys at all): nothing to do
        return x.clone()
    m = x.amax(dim=dim, keepdim=True).detach()   # (..., 1, ...) row maxima; the shift cancels, so no gradient
    e = torch.exp(x - m)                   # (...) every entry in (0, 1]
    return e / e.sum(dim=dim, keepdim=True)


def masked_softmax(x, mask, dim=-1):
    """Softmax over the entries where ``mask`` is True; masked entries get weight 0.

    A row whose entries are all masked returns all zeros (not NaN): there is nothing to attend
    to, so nothing is averaged. This matches torch's SDPA.

    x: any shape, floating point. mask: bool, broadcastable to ``x.shape`` (True = keep).
    Returns the shape of x.

    Example: ``masked_softmax(torch.zeros(2, 3), torch.tensor([True, True, False]))  # [[.5, .5, 0], ...]``
    """
    validate.tensor(x, "x", floating=True)
    validate.bool_mask(mask, "mask", x.shape, "True = keep")
    validate.dim(dim, x)
    if x.shape[dim] == 0:                              # no entries to weigh (no keys at all)
        return x.clone()
    x = x.masked_fill(~mask, float("-inf"))            # (...) masked scores -> -inf
    m = x.amax(dim=dim, keepdim=True).detach()         # (..., 1, ...) -inf on fully masked rows
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # keep exp(-inf - m) = 0, not NaN
    e = torch.exp(x - m)                               # (...) 0 where masked
    denom = e.sum(dim=dim, keepdim=True)               # (..., 1, ...) 0 on fully masked rows
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


# ---------------------------------------------------------------------------------------------
# 2. masks
# ---------------------------------------------------------------------------------------------

def padding_mask(lengths, max_len=None):
    """Bool mask ``(B, N)``: True for the first ``lengths[b]`` positions of sequence b (real tokens).

    lengths: ``(B,)`` integer tensor or list of ints. max_len: N, default ``max(lengths)``.
    For attention over keys, broadcast it as ``padding_mask(lengths)[:, None, None, :]``
    (B, 1, 1, Nk).

    Example: ``padding_mask([2, 3], 4)  # [[T, T, F, F], [T, T, T, F]]``
    """
    if not isinstance(lengths, torch.Tensor):
        try:
            lengths = torch.as_tensor(lengths)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"lengths: expected a 1-D integer tensor or list of ints, "
                            f"got {type(lengths).__name__}") from None
    if lengths.dim() != 1:
        raise ValueError(f"lengths: expected a 1-D tensor (batch,), got shape {tuple(lengths.shape)}")
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths: expected integers, got dtype {lengths.dtype}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths: expected non-negative lengths, got {lengths.tolist()}")
    if max_len is None:
        max_len = int(lengths.max()) if lengths.numel() else 0
    if isinstance(max_len, bool) or not isinstance(max_len, int):
        raise TypeError(f"max_len: expected an int, got {type(max_len).__name__}")
    if max_len < 0:
        raise ValueError(f"max_len: expected a non-negative int, got {max_len}")
    if lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(f"max_len: expected at least max(lengths) = {int(lengths.max())}, got {max_len}")
    b = torch.arange(lengths.numel(), device=lengths.device)[:, None]    # (B, 1) row of the batch
    positions = torch.arange(max_len, device=lengths.device)[None, :]    # (1, N) key positions
    return mask_mods.padding(lengths)(b, 0, 0, positions)                # (B, N): the one home's pattern


def causal_mask(n_q, n_k=None, device=None):
    """Bool mask ``(n_q, n_k)``: True where key ``j <= i`` for query ``i`` (top-left aligned).

    This is exactly the mask of ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``
    for every ``n_q``, ``n_k``. When ``n_q > n_k`` the last rows see all keys; when ``n_q < n_k``
    the last keys are seen by nobody. ``n_k`` defaults to ``n_q``.

    Example: ``causal_mask(3)  # [[T, F, F], [T, T, F], [T, T, T]]``
    """
    n_k = n_q if n_k is None else n_k
    for name, n in (("n_q", n_q), ("n_k", n_k)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{name}: expected an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {n}")
    i = torch.arange(n_q, device=device)[:, None]   # (n_q, 1) query positions
    j = torch.arange(n_k, device=device)[None, :]   # (1, n_k) key positions
    return mask_mods.causal(0, 0, i, j)             # (n_q, n_k): j <= i, attnlab.mask_mods' causal


# ---------------------------------------------------------------------------------------------
# 3. additive (Bahdanau) attention
# ---------------------------------------------------------------------------------------------

class AdditiveAttention(nn.Module):
    """Additive attention of Bahdanau, Cho and Bengio (2014): ``e_j = v^T tanh(W s + U h_j)``.

    The decoder state ``s`` (the query) and every encoder state ``h_j`` (the keys) are projected
    into a common ``hidden_dim`` space, added, squashed by tanh and read out by the vector ``v``:
    one score per key. Softmax over the keys gives the alignment weights; the context vector is
    the weighted sum of the keys (in Bahdanau's model the annotations serve as keys and values).

    Parameters (no biases, as in the paper's equation): ``W`` (query_dim -> hidden_dim),
    ``U`` (key_dim -> hidden_dim), ``v`` (hidden_dim -> 1), all ``nn.Linear``.

    forward(query (B, Dq), keys (B, N, Dk), mask=None (B, N) bool True = real token)
        -> (context (B, Dk), weights (B, N)); fully masked rows give zero weights and context.

    Example: ``ctx, w = AdditiveAttention(8, 16, 32)(torch.randn(2, 8), torch.randn(2, 5, 16))``
    """

    def __init__(self, query_dim, key_dim, hidden_dim):
        super().__init__()
        for name, n in (("query_dim", query_dim), ("key_dim", key_dim), ("hidden_dim", hidden_dim)):
            validate.integer(n, name)
        self.query_dim, self.key_dim, self.hidden_dim = query_dim, key_dim, hidden_dim
        self.W = nn.Linear(query_dim, hidden_dim, bias=False)   # projects the query s
        self.U = nn.Linear(key_dim, hidden_dim, bias=False)     # projects each key h_j
        self.v = nn.Linear(hidden_dim, 1, bias=False)           # reads one score out

    def score(self, query, keys):
        """Raw scores ``v^T tanh(W s + U h_j)``: query (B, Dq), keys (B, N, Dk) -> (B, N)."""
        _check_additive_inputs(query, keys, self.query_dim, self.key_dim)
        ws = self.W(query)[:, None, :]          # (B, 1, hidden)
        uh = self.U(keys)                       # (B, N, hidden)
        return self.v(torch.tanh(ws + uh))[..., 0]   # (B, N)

    def forward(self, query, keys, mask=None):
        scores = self.score(query, keys)         # (B, N); checks query and keys
        _check_key_mask(mask, scores.shape)
        if mask is None:
            weights = softmax(scores, dim=-1)    # (B, N)
        else:
            weights = masked_softmax(scores, mask, dim=-1)               # (B, N)
        context = torch.einsum("bn,bnd->bd", weights, keys)             # (B, Dk)
        return context, weights


# ---------------------------------------------------------------------------------------------
# 4. scaled dot-product attention
# ---------------------------------------------------------------------------------------------

def scaled_dot_product_attention(q, k, v, mask=None, causal=False, scale=None, return_weights=False, *,
                                 attn_mask=None, is_causal=None, enable_gqa=False, dropout_p=0.0):
    """``softmax(q k^T * scale) v`` with optional mask and causal masking.

    q: (B, H, Nq, D), k: (B, H, Nk, D), v: (B, H, Nk, Dv). mask: bool broadcastable to
    (B, H, Nq, Nk), True = attend. causal: top-left aligned (key j <= query i), combined with
    ``mask`` by AND. scale: default ``1/sqrt(D)``. Fully masked rows output zeros.
    Returns out (B, H, Nq, Dv), or (out, weights (B, H, Nq, Nk)) if ``return_weights``.

    torch's names work too, as in ``torch.nn.functional.scaled_dot_product_attention``:
    ``attn_mask`` (bool, True = attend, as ``mask``; or floating, added to the scores),
    ``is_causal`` (as ``causal``), ``enable_gqa`` (k and v may have H_kv heads with H % H_kv == 0;
    query head h reads KV head h // (H / H_kv)) and ``dropout_p`` (only 0.0: this is the reference).

    Example: ``out = scaled_dot_product_attention(q, k, v, causal=True)  # or is_causal=True``
    """
    k, v, mask, causal, bias = _torch_arguments(q, k, v, mask, causal, attn_mask, is_causal, enable_gqa, dropout_p)
    validate.qkv(q, k, v)
    scale = validate.scale(scale, q.shape[-1])
    validate.flag(causal, "causal")
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    if mask is not None:
        validate.bool_mask(mask, "mask", (B, H, Nq, Nk))
        if mask.device != q.device:
            raise ValueError(f"mask: expected device {q.device} (the device of q), got {mask.device}")
    scores = (q @ k.transpose(-2, -1)) * scale               # (B, H, Nq, Nk)
    if bias is not None:
        scores = scores + bias                               # (B, H, Nq, Nk) torch's additive float mask
    if causal:
        keep = causal_mask(Nq, Nk, device=q.device)          # (Nq, Nk)
        mask = keep if mask is None else mask & keep         # broadcasts to (B, H, Nq, Nk)
    if mask is None:
        weights = softmax(scores, dim=-1)                    # (B, H, Nq, Nk)
    else:
        weights = masked_softmax(scores, mask, dim=-1)       # (B, H, Nq, Nk)
    out = weights @ v                                        # (B, H, Nq, Dv)
    return (out, weights) if return_weights else out


# ---------------------------------------------------------------------------------------------
# 5. multi-head attention
# ---------------------------------------------------------------------------------------------

class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al., 2017): project, split into heads, attend, merge, project.

    ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` are ``nn.Linear(d_model, d_model, bias=bias)``;
    each of the ``num_heads`` heads works in ``d_head = d_model // num_heads`` dimensions.

    forward(query (B, Nq, d_model), key=None (B, Nk, d_model), value=None (B, Nk, d_model),
    mask=None (bool, broadcastable to (B, h, Nq, Nk), True = attend), causal=False,
    return_weights=False) -> out (B, Nq, d_model), or (out, weights (B, h, Nq, Nk)).
    ``key`` defaults to ``query`` (self-attention), ``value`` to ``key``. For a key padding mask
    pass ``padding_mask(lengths)[:, None, None, :]``.

    Example: ``y = MultiHeadAttention(64, 4)(torch.randn(2, 10, 64), causal=True)``
    """

    def __init__(self, d_model, num_heads, bias=True):
        super().__init__()
        validate.integer(d_model, "d_model")
        validate.integer(num_heads, "num_heads")
        if d_model % num_heads != 0:
            raise ValueError(f"num_heads: expected a divisor of d_model={d_model}, got {num_heads}")
        self.d_model, self.num_heads, self.d_head = d_model, num_heads, d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def split_heads(self, x):
        """(B, N, d_model) -> (B, h, N, d_head): head i gets features [i*d_head, (i+1)*d_head)."""
        validate.tensor(x, "x", 3, "(batch, seq, d_model)")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x: expected last dim d_model={self.d_model}, got shape {tuple(x.shape)}")
        B, N, _ = x.shape
        return x.view(B, N, self.num_heads, self.d_head).transpose(1, 2)   # (B, h, N, d_head)

    def merge_heads(self, x):
        """(B, h, N, d_head) -> (B, N, d_model): the inverse of ``split_heads``."""
        validate.tensor(x, "x", 4, "(batch, heads, seq, d_head)")
        if x.shape[1] != self.num_heads or x.shape[3] != self.d_head:
            raise ValueError(f"x: expected (B, {self.num_heads}, N, {self.d_head}), got shape {tuple(x.shape)}")
        B, h, N, d = x.shape
        return x.transpose(1, 2).reshape(B, N, h * d)                      # (B, N, d_model)

    def forward(self, query, key=None, value=None, mask=None, causal=False, return_weights=False):
        key = query if key is None else key          # self-attention by default
        value = key if value is None else value
        _check_mha_inputs(query, key, value, self.d_model)
        q = self.split_heads(self.q_proj(query))     # (B, h, Nq, d_head)
        k = self.split_heads(self.k_proj(key))       # (B, h, Nk, d_head)
        v = self.split_heads(self.v_proj(value))     # (B, h, Nk, d_head)
        out, weights = scaled_dot_product_attention(q, k, v, mask=mask, causal=causal,
                                                    return_weights=True)   # (B, h, Nq, d_head)
        out = self.out_proj(self.merge_heads(out))   # (B, Nq, d_model)
        return (out, weights) if return_weights else out


# ---------------------------------------------------------------------------------------------
# 6. naive attention: what the n-by-n matrices cost
# ---------------------------------------------------------------------------------------------

def naive_attention(q, k, v, causal=False, scale=None):
    """Standard attention that materialises S = q k^T * scale and P = softmax(S) in memory.

    This is the baseline FlashAttention improves on: S and P are each (B, H, Nq, Nk), so memory
    grows as N^2. Returns ``(out, matrix_bytes)`` where ``matrix_bytes`` is the bytes of S plus P
    that were actually allocated. causal: top-left aligned, as everywhere in attnlab.

    q: (B, H, Nq, D), k: (B, H, Nk, D), v: (B, H, Nk, Dv) -> out (B, H, Nq, Dv), int.

    Example: ``out, nbytes = naive_attention(q, k, v)  # nbytes == 2 * B*H*Nq*Nk * 4 for fp32``
    """
    validate.qkv(q, k, v)
    scale = validate.scale(scale, q.shape[-1])
    validate.flag(causal, "causal")
    S = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)      # (B, H, Nq, Nk)  first n-by-n matrix
    if causal:
        keep = causal_mask(q.shape[2], k.shape[2], device=q.device)   # (Nq, Nk)
        S.masked_fill_(~keep, float("-inf"))                  # top-left: no row is fully masked
    P = torch.softmax(S, dim=-1)                              # (B, H, Nq, Nk)  second n-by-n matrix
    if k.shape[2] == 0:
        P = torch.nan_to_num(P)                               # no keys: attend to nothing
    out = P @ v                                               # (B, H, Nq, Dv)
    matrix_bytes = S.numel() * S.element_size() + P.numel() * P.element_size()
    return out, matrix_bytes


# ---------------------------------------------------------------------------------------------
# 7. block-sparse reference
# ---------------------------------------------------------------------------------------------

def block_sparse_reference(q, k, v, block_mask, block_size=None, causal=False, scale=None):
    """Dense attention under the element mask that a block mask implies.

    The (Nq, Nk) score matrix is cut into tiles of ``block_size = (block_m, block_n)`` (query rows,
    key columns). With a bool tile table, every element of tile (i, j) is kept iff
    ``block_mask[..., i, j]`` (:func:`attnlab.mask_mods.tiles`). With an ``attnlab.kernels.BlockMask``
    the element mask is its ``mask_mod`` evaluated (``to_element_mask``): full tiles whole, partial
    tiles element by element, empty tiles not at all. This is the spec a block-sparse kernel must
    match: it skips the empty tiles and computes the rest exactly.

    block_mask: bool ``(B or 1, H or 1, ceil(Nq/block_m), ceil(Nk/block_n))``, or an object with
    ``.mask`` (that tensor), ``.block_size`` (block_m, block_n) and ``.to_element_mask(n_q, n_k)``,
    such as ``attnlab.kernels.BlockMask``. block_size: int or (block_m, block_n); optional when
    ``block_mask`` carries it. causal: top-left, ANDed with the block mask. Rows with no visible key output zeros.
    q: (B, H, Nq, D), k: (B, H, Nk, D), v: (B, H, Nk, Dv) -> out (B, H, Nq, Dv).

    Example: ``out = block_sparse_reference(q, k, v, torch.eye(4, dtype=torch.bool)[None, None], 16)``
    """
    validate.qkv(q, k, v)
    carrier = None
    if not isinstance(block_mask, torch.Tensor) and hasattr(block_mask, "mask"):
        carrier = block_mask if hasattr(block_mask, "to_element_mask") else None
        carried = getattr(block_mask, "block_size", None)
        if carried is not None:
            carried = validate.block_pair(tuple(carried) if not isinstance(carried, int) else carried)
            if block_size is not None and validate.block_pair(block_size) != carried:
                raise ValueError(f"block_size: expected {carried} (the block_mask's block_size), "
                                 f"got {validate.block_pair(block_size)}")
            block_size = carried
        block_mask = block_mask.mask
    validate.tensor(block_mask, "block_mask", 4, "(batch or 1, heads or 1, n_q_blocks, n_k_blocks)")
    if block_mask.dtype != torch.bool:
        raise TypeError(f"block_mask: expected a bool tensor, got dtype {block_mask.dtype}")
    if block_size is None:
        raise TypeError("block_size: expected an int or (block_m, block_n) since block_mask carries none, got None")
    block_m, block_n = validate.block_pair(block_size)
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    n_qb, n_kb = -(-Nq // block_m), -(-Nk // block_n)      # ceil divisions
    if (block_mask.shape[0] not in (1, B) or block_mask.shape[1] not in (1, H)
            or tuple(block_mask.shape[2:]) != (n_qb, n_kb)):
        raise ValueError(f"block_mask: expected shape ({B} or 1, {H} or 1, {n_qb}, {n_kb}) for "
                         f"Nq={Nq}, Nk={Nk}, block_size=({block_m}, {block_n}), got {tuple(block_mask.shape)}")
    if block_mask.device != q.device:
        raise ValueError(f"block_mask: expected device {q.device} (the device of q), got {block_mask.device}")
    if carrier is not None:      # the BlockMask's own mask_mod, at the lengths it was made for
        element_mask = carrier.to_element_mask(Nq, Nk).to(q.device)                    # (b, h, Nq, Nk)
    else:                        # every element of a kept tile
        element_mask = mask_mods.create_mask(mask_mods.tiles(block_mask, (block_m, block_n)),
                                             block_mask.shape[0], block_mask.shape[1], Nq, Nk, device=q.device)
    return scaled_dot_product_attention(q, k, v, mask=element_mask, causal=causal, scale=scale)
