"""Approximate attention: what the FlashAttention paper measured itself against.

Three families, each small enough to read in one sitting, all on tensors shaped
``(batch, heads, seq, head_dim)`` like the rest of attnlab:

* **local window** (Vaswani et al. 2017, section 4, "restricted" self-attention;
  Longformer, BigBird): each query sees only keys within ``window`` positions.
  The pattern is :func:`attnlab.mask_mods.local` (or ``sliding_window``, its
  causal half): an element mask handed to the exact reference attention, or a
  ``BlockMask`` for the block-sparse kernel, exact (partial tiles masked element
  by element), so the only thing that changes is *which* scores exist. :func:`path_length` measures how many layers information needs to
  cross the sequence (Vaswani et al. 2017, Table 1: O(n/r)).
* **low rank** (Linformer, Wang et al. 2020): keys and values are projected
  along the sequence from ``n`` rows to ``rank`` rows, ``K' = E K``,
  ``V' = F V``, so the score matrix is ``n x rank`` instead of ``n x n``.
  Linformer *learns* E and F; here they are fixed ("learning-free"): segment
  means (``projection="pool"``, exact when ``rank == n``) or Linformer's seeded
  Gaussian initialisation (``projection="gaussian"``, which shows why the
  learning matters).
* **random features** (Performer / FAVOR+, Choromanski et al. 2021):
  ``exp(q.k) = E_w[phi(q) phi(k)]`` with positive features
  ``phi(x) = exp(w.x - |x|^2 / 2) / sqrt(m)``, so attention becomes
  ``phi(Q) (phi(K)^T V)`` normalised by ``phi(Q) phi(K)^T 1``: linear in ``n``.
  Unbiased; the error falls like ``1/sqrt(m)`` with the number of features.

Each method has a cost function (:func:`linformer_io`, :func:`performer_io`,
:func:`local_window_io`) returning an :class:`attnlab.iomodel.IO`: the HBM bytes
read and written and the FLOPs, step by step, with :mod:`attnlab.iomodel`'s
conventions (a matmul ``(a, b) @ (b, c)`` is ``2abc`` FLOPs, elementwise work is
not counted; every unfused step reads its inputs from HBM and writes its output
there; ``bytes_per_element`` 2 for fp16, 4 for fp32). Set them beside
``iomodel.standard_forward_io`` and ``iomodel.flash_forward_io``.

Example::

    out = performer_attention(q, k, v, num_features=256, seed=0)
"""

from __future__ import annotations

import functools
import math

import torch

from attnlab import mask_mods, validate

__all__ = [
    "local_window_mask",
    "local_window_block_mask",
    "local_window_attention",
    "path_length",
    "local_window_path_length",
    "linformer_projection",
    "linformer_attention",
    "performer_features",
    "performer_attention",
    "relative_error",
    "local_window_io",
    "linformer_io",
    "performer_io",
]


def relative_error(approx, exact):
    """``||approx - exact|| / ||exact||`` (Frobenius norms over all elements), as a float.

    Example: ``relative_error(performer_attention(q, k, v), exact)``
    """
    validate.tensor(approx, "approx")
    validate.tensor(exact, "exact")
    if approx.shape != exact.shape:
        raise ValueError(f"approx: expected shape {tuple(exact.shape)} like exact, got {tuple(approx.shape)}")
    return float((approx.double() - exact.double()).norm() / exact.double().norm())


# ----------------------------------------------------------------------------- local window
def local_window_mask(n_q, n_k, window, causal=False, device=None):
    """Element mask of local-window attention: True where ``|i - j| <= window``.

    Query ``i`` may attend to key ``j`` when ``j`` lies within ``window``
    positions of ``i`` (a neighbourhood of size ``r = 2 * window + 1``, or
    ``window + 1`` keys when ``causal``, which also requires ``j <= i``; the
    course's top-left alignment). ``window=0`` keeps the diagonal only.

    Returns a bool tensor ``(n_q, n_k)``.

    Example: ``local_window_mask(8, 8, window=2)``
    """
    validate.integer(n_q, "n_q")
    validate.integer(n_k, "n_k")
    validate.flag(causal, "causal")
    return mask_mods.create_mask(_local_mod(window, causal), None, None, n_q, n_k, device=device or "cpu")[0, 0]


def _local_mod(window, causal):
    """The mask_mod of the window: attnlab.mask_mods' ``local`` (both sides) or ``sliding_window`` (causal)."""
    return mask_mods.sliding_window(window) if causal else mask_mods.local(window)


def local_window_block_mask(n_q, n_k, window, block_size=(64, 64), causal=False, device=None):
    """The ``BlockMask`` of :func:`local_window_mask` for the block-sparse kernel, exact.

    ``attnlab.kernels.create_block_mask`` of the same mask_mod: tiles wholly inside the window are
    full (computed with no element mask), tiles it crosses partial (masked element by element),
    the rest empty (never loaded). Its ``.mask`` is the bool ``(1, 1, ceil(n_q / block_m),
    ceil(n_k / block_n))`` table of the tiles computed, for ``block_size=(block_m, block_n)``.

    Example: ``local_window_block_mask(256, 256, window=32, block_size=(64, 64))``
    """
    from attnlab.kernels import create_block_mask

    bq, bk = validate.block_pair(block_size, single_int=False)
    validate.integer(n_q, "n_q")
    validate.integer(n_k, "n_k")
    validate.flag(causal, "causal")
    return create_block_mask(_local_mod(window, causal), None, None, n_q, n_k, block_size=(bq, bk),
                             device=device or "cpu")


def local_window_attention(q, k, v, window, causal=False, scale=None):
    """Exact attention restricted to a local window (Vaswani et al. 2017's restricted self-attention).

    ``q``: ``(B, H, Nq, D)``, ``k``: ``(B, H, Nk, D)``, ``v``: ``(B, H, Nk, Dv)``
    -> ``(B, H, Nq, Dv)``. Runs the reference
    :func:`attnlab.attention.scaled_dot_product_attention` under
    :func:`local_window_mask`; on a GPU the same pattern runs through the
    block-sparse kernel with :func:`local_window_block_mask` (the same mask, exactly).

    Example: ``out = local_window_attention(q, k, v, window=16)``
    """
    validate.qkv(q, k, v)
    validate.integer(window, "window", minimum=0)
    validate.flag(causal, "causal")
    from attnlab.attention import scaled_dot_product_attention

    mask = local_window_mask(q.shape[-2], k.shape[-2], window, causal=causal, device=q.device)
    return scaled_dot_product_attention(q, k, v, mask=mask, scale=validate.scale(scale, q.shape[-1]))


def path_length(mask):
    """Longest shortest path, in layers, between any two positions of self-attention under ``mask``.

    One layer carries information from key position ``j`` to query position
    ``i`` when ``mask[i, j]``; stacking layers composes the masks (boolean
    matrix product, with each position keeping its own state through the
    residual connection). Returns the smallest ``L`` such that after ``L``
    layers every position ``i`` has heard from every position ``j`` that it
    can ever hear from (for a causal mask, every ``j <= i``); returns ``None``
    if some such pair never connects. ``mask`` is a bool tensor ``(n, n)``.

    Example: ``path_length(local_window_mask(64, 64, window=4))`` -> 16
    """
    validate.tensor(mask, "mask", dtypes=(torch.bool,))
    if mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        raise ValueError(f"mask: expected a square (n, n) self-attention mask, got {tuple(mask.shape)}")
    n = mask.shape[0]
    step = (mask | torch.eye(n, dtype=torch.bool, device=mask.device)).float()  # (n, n)
    # everything reachable in the limit: transitive closure by repeated squaring
    closure = step.clone()
    for _ in range(max(1, math.ceil(math.log2(max(n, 2)))) + 1):
        closure = ((closure @ closure) > 0).float()
    target = closure > 0
    reach = step > 0
    layers = 1
    while not torch.equal(reach, target):
        nxt = ((reach.float() @ step) > 0)
        if torch.equal(nxt, reach):  # cannot happen (target is the fixed point), kept as a guard
            return None
        reach = nxt
        layers += 1
    full = torch.ones_like(target)
    lower = torch.tril(full)
    if not (torch.equal(target, full) or torch.equal(target, lower)):
        return None  # some positions never hear from others
    return layers


def local_window_path_length(n, window):
    """Path length of local-window self-attention by formula: ``ceil((n - 1) / window)`` layers.

    Each layer moves information at most ``window`` positions, so crossing
    ``n - 1`` positions takes that many layers: O(n / r) for a neighbourhood
    of size ``r = 2 * window + 1`` (Vaswani et al. 2017, Table 1). The same
    formula holds for the causal window.

    Example: ``local_window_path_length(64, 4)`` -> 16
    """
    validate.integer(n, "n")
    validate.integer(window, "window")
    return max(1, math.ceil((n - 1) / window))


# ----------------------------------------------------------------------------- Linformer
_PROJECTIONS = ("pool", "gaussian")


def linformer_projection(n, rank, projection="pool", seed=0, dtype=torch.float32, device=None):
    """The fixed sequence projections ``E, F`` of Linformer-style attention, each ``(rank, n)``.

    ``projection="pool"``: both are the same segment-mean matrix: row ``r``
    averages a contiguous segment of about ``n / rank`` positions
    (Linformer's pooling option, Wang et al. 2020, section 4); ``rank == n``
    gives the identity. ``projection="gaussian"``: independent seeded
    ``N(0, 1 / rank)`` matrices, the random projections of Linformer's
    analysis (Wang et al. 2020, Theorem 2) and its starting point before
    training. Generated on the CPU from ``seed`` so every device gets the same
    numbers.

    Example: ``E, F = linformer_projection(1024, 64)``
    """
    validate.integer(n, "n")
    validate.integer(rank, "rank")
    validate.one_of(projection, "projection", _PROJECTIONS)
    if projection == "pool":
        if rank > n:
            raise ValueError(f"rank: pooling needs rank <= n, got rank={rank} for n={n}")
        bounds = [(r * n) // rank for r in range(rank + 1)]
        e = torch.zeros(rank, n, dtype=torch.float64)
        for r in range(rank):
            e[r, bounds[r]:bounds[r + 1]] = 1.0 / (bounds[r + 1] - bounds[r])
        e = e.to(dtype=dtype, device=device)
        return e, e.clone()
    g = torch.Generator().manual_seed(int(seed))
    e = torch.randn(rank, n, generator=g, dtype=torch.float64) / math.sqrt(rank)
    f = torch.randn(rank, n, generator=g, dtype=torch.float64) / math.sqrt(rank)
    return e.to(dtype=dtype, device=device), f.to(dtype=dtype, device=device)


def linformer_attention(q, k, v, rank, projection="pool", seed=0, scale=None):
    """Linformer-style low-rank attention: ``softmax(Q (E K)^T * scale) (F V)``.

    ``q``: ``(B, H, Nq, D)``, ``k``: ``(B, H, N, D)``, ``v``: ``(B, H, N, Dv)``
    -> ``(B, H, Nq, Dv)``. ``E, F`` (``(rank, N)``) come from
    :func:`linformer_projection`; the score matrix is ``Nq x rank``, so time
    and memory are linear in ``N`` for a fixed rank. With pooling, a pooled
    key stands for its whole segment, so its score gets ``+ log(segment
    length)`` (a no-op when all segments are equal); ``rank == N`` is exact.
    Not causal: a projection along the sequence mixes future positions in.

    Example: ``out = linformer_attention(q, k, v, rank=64)``
    """
    validate.qkv(q, k, v)
    validate.integer(rank, "rank")
    n = k.shape[-2]
    e, f = linformer_projection(n, rank, projection=projection, seed=seed, dtype=q.dtype, device=q.device)
    s = validate.scale(scale, q.shape[-1])
    k_proj = e @ k  # (rank, N) @ (B, H, N, D) -> (B, H, rank, D)
    v_proj = f @ v  # (B, H, rank, Dv)
    scores = (q @ k_proj.transpose(-2, -1)) * s  # (B, H, Nq, rank)
    if projection == "pool":
        seg = (e > 0).sum(dim=1).to(q.dtype)  # (rank,) positions per segment
        scores = scores + seg.log()
    return torch.softmax(scores, dim=-1) @ v_proj  # (B, H, Nq, Dv)


# ----------------------------------------------------------------------------- Performer
def performer_features(head_dim, num_features, seed=0, orthogonal=True, dtype=torch.float32, device=None):
    """Random feature directions ``W`` ``(num_features, head_dim)`` for FAVOR+.

    Rows are ``N(0, I)`` samples; with ``orthogonal=True`` (FAVOR+'s default)
    each block of ``head_dim`` rows is made orthogonal and the rows are given
    chi-distributed norms, which keeps every row marginally ``N(0, I)`` while
    lowering the variance (Choromanski et al. 2021, section 2.4). Drawn on the
    CPU from ``seed``.

    Example: ``w = performer_features(64, 256, seed=0)``
    """
    validate.integer(head_dim, "head_dim")
    validate.integer(num_features, "num_features")
    return _features(head_dim, num_features, int(seed), bool(orthogonal)).to(dtype=dtype, device=device)


def _orthonormal_rows(gauss):
    """Gram-Schmidt (twice, for stability) on the rows of a square float64 matrix: a random orthogonal matrix."""
    out = torch.empty_like(gauss)
    for i, row in enumerate(gauss):
        for _ in range(2):  # subtract the projections on the rows done so far
            row = row - out[:i].T @ (out[:i] @ row)
        out[i] = row / row.norm()
    return out


@functools.lru_cache(maxsize=64)
def _features(head_dim, num_features, seed, orthogonal):
    g = torch.Generator().manual_seed(seed)
    if not orthogonal:
        return torch.randn(num_features, head_dim, generator=g, dtype=torch.float64)
    blocks = []
    remaining = num_features
    while remaining > 0:
        gauss = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
        blocks.append(_orthonormal_rows(gauss)[: min(remaining, head_dim)])  # (<= D, D) orthonormal rows
        remaining -= head_dim
    w = torch.cat(blocks, dim=0)  # (m, D) unit rows
    norms = torch.randn(num_features, head_dim, generator=g, dtype=torch.float64).norm(dim=1)  # chi(D) lengths
    return w * norms[:, None]


def _positive_features(x, w, is_query):
    """phi(x) = exp(w.x - |x|^2/2) / sqrt(m), stabilised by a constant that cancels in the normalisation."""
    log_phi = x @ w.T - (x * x).sum(dim=-1, keepdim=True) / 2  # (B, H, N, m): w.x - |x|^2 / 2
    if is_query:  # per query row: cancels between numerator and denominator
        stab = log_phi.amax(dim=-1, keepdim=True)
    else:  # one constant per (batch, head) over all keys: cancels too
        stab = log_phi.amax(dim=(-2, -1), keepdim=True)
    return torch.exp(log_phi - stab) / math.sqrt(w.shape[0])


def performer_attention(q, k, v, num_features=256, seed=0, causal=False, scale=None, orthogonal=True):
    """Performer (FAVOR+) attention with positive random features.

    ``q``: ``(B, H, Nq, D)``, ``k``: ``(B, H, N, D)``, ``v``: ``(B, H, N, Dv)``
    -> ``(B, H, Nq, Dv)``. With ``x = q * sqrt(scale)``, ``y = k * sqrt(scale)``,
    ``exp(scale * q.k) = E[phi(x).phi(y)]``, so softmax attention is
    estimated by ``phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1)``, which never
    forms an ``N x N`` matrix: ``O(N m D)`` time. ``causal=True`` uses prefix
    sums over the keys (memory ``O(N m Dv)``; written for clarity, not speed).
    The estimate is unbiased per score and tightens as ``num_features`` grows.

    Example: ``out = performer_attention(q, k, v, num_features=256, seed=0)``
    """
    validate.qkv(q, k, v)
    validate.integer(num_features, "num_features")
    validate.flag(causal, "causal")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"k: expected seq {q.shape[-2]} like q (causal Performer), got shape {tuple(k.shape)}")
    s = validate.scale(scale, q.shape[-1], positive=True)  # the features use sqrt(scale)
    w = performer_features(q.shape[-1], num_features, seed=seed, orthogonal=orthogonal, dtype=q.dtype, device=q.device)
    root = math.sqrt(s)
    phi_q = _positive_features(q * root, w, is_query=True)  # (B, H, Nq, m)
    phi_k = _positive_features(k * root, w, is_query=False)  # (B, H, N, m)
    if not causal:
        kv = phi_k.transpose(-2, -1) @ v  # (B, H, m, Dv)
        num = phi_q @ kv  # (B, H, Nq, Dv)
        den = phi_q @ phi_k.sum(dim=-2).unsqueeze(-1)  # (B, H, Nq, 1)
    else:
        kv = torch.cumsum(phi_k.unsqueeze(-1) * v.unsqueeze(-2), dim=-3)  # (B, H, N, m, Dv)
        num = (phi_q.unsqueeze(-2) @ kv).squeeze(-2)  # (B, H, N, Dv)
        den = (phi_q * torch.cumsum(phi_k, dim=-2)).sum(dim=-1, keepdim=True)  # (B, H, N, 1)
    return num / den


# ----------------------------------------------------------------------------- cost model
def _check_shape_args(**kw):
    for name, value in kw.items():
        validate.integer(value, name)


def _step(name, flops, read, written, e):
    """One unfused step as an :class:`attnlab.iomodel.IO` part: elements read/written times ``e`` bytes."""
    from attnlab.iomodel import IO

    io = IO(int(read * e), int(written * e), int(flops))
    return IO(io.bytes_read, io.bytes_written, io.flops, {name: io})


def local_window_io(batch, heads, n, d=64, window=64, block_size=(64, 64), bytes_per_element=2):
    """HBM bytes and FLOPs of local-window attention run by the block-sparse FlashAttention kernel.

    The kernel visits only the blocks :func:`local_window_block_mask` keeps, so this is
    :func:`attnlab.iomodel.block_sparse_forward_io` under that mask: per kept block one K and
    one V tile read (and per partial block its element-mask tile) and ``4 block_m block_n d``
    FLOPs; Q read and O written once. No n x n matrix
    reaches HBM, and the cost grows as ``n * window`` instead of ``n^2``.
    Returns an :class:`attnlab.iomodel.IO`.

    Example: ``local_window_io(1, 1, 4096, 64, window=256).total_bytes``
    """
    from attnlab.iomodel import block_sparse_forward_io

    _check_shape_args(batch=batch, heads=heads, n=n, d=d, bytes_per_element=bytes_per_element)
    validate.integer(window, "window", minimum=0)
    mask = local_window_block_mask(n, n, window, block_size=block_size)
    return block_sparse_forward_io(batch, heads, n, d=d, bytes_per_element=bytes_per_element,
                                   block_mask=mask, block_size=tuple(block_size))


def linformer_io(batch, heads, n, d=64, rank=64, bytes_per_element=2):
    """HBM bytes and FLOPs of :func:`linformer_attention` run as unfused PyTorch steps.

    Same conventions as :mod:`attnlab.iomodel`: every step reads its inputs from HBM and
    writes its output there; FLOPs count matmuls only (2 per multiply-add), not the softmax's
    exponentials. Per (batch, head): ``K' = E K`` and ``V' = F V`` (``2 rank n d`` each),
    ``S = Q K'^T`` (``n x rank``), softmax, ``O = P V'``. Returns an :class:`attnlab.iomodel.IO`
    whose ``parts`` name the steps.

    Example: ``linformer_io(1, 1, 4096, 64, rank=256).flops``
    """
    _check_shape_args(batch=batch, heads=heads, n=n, d=d, rank=rank, bytes_per_element=bytes_per_element)
    k, e = rank, bytes_per_element
    io = (_step("K' = E K", 2 * k * n * d, k * n + n * d, k * d, e)
          + _step("V' = F V", 2 * k * n * d, k * n + n * d, k * d, e)
          + _step("S = Q K'^T", 2 * n * k * d, n * d + k * d, n * k, e)
          + _step("P = softmax(S)", 0, n * k, n * k, e)
          + _step("O = P V'", 2 * n * k * d, n * k + k * d, n * d, e))
    return io.scaled(batch * heads)


def performer_io(batch, heads, n, d=64, num_features=256, bytes_per_element=2):
    """HBM bytes and FLOPs of non-causal :func:`performer_attention` run as unfused PyTorch steps.

    Same conventions as :mod:`attnlab.iomodel` (matmul FLOPs only; each step reads its
    inputs and writes its output). Per (batch, head): the feature maps ``phi(Q)``, ``phi(K)``
    (a ``n x d`` by ``d x m`` matmul each, then elementwise), ``phi(K)^T V`` (``m x d``),
    ``phi(Q) (phi(K)^T V)``, the normaliser ``phi(Q) phi(K)^T 1`` and the division.
    Returns an :class:`attnlab.iomodel.IO`.

    Example: ``performer_io(1, 1, 4096, 64, num_features=256).total_bytes``
    """
    _check_shape_args(batch=batch, heads=heads, n=n, d=d, num_features=num_features,
                      bytes_per_element=bytes_per_element)
    m, e = num_features, bytes_per_element
    io = (_step("phi(Q)", 2 * n * d * m, n * d + m * d, n * m, e)
          + _step("phi(K)", 2 * n * d * m, n * d + m * d, n * m, e)
          + _step("KV = phi(K)^T V", 2 * n * m * d, n * m + n * d, m * d, e)
          + _step("num = phi(Q) KV", 2 * n * m * d, n * m + m * d, n * d, e)
          + _step("den = phi(Q) phi(K)^T 1", 2 * n * m, 2 * n * m, n + m, e)
          + _step("O = num / den", 0, n * d + n, n * d, e))
    return io.scaled(batch * heads)
