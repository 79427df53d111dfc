"""Linear attention and the gated delta rule in plain PyTorch: the references lesson 12 and its kernel use.

Softmax attention keeps every key and value (the KV cache grows by one row per token). Linear
attention replaces ``softmax(q k^T)`` with a product of features ``phi(q)^T phi(k)``, and then the
sum over the past regroups into a *state* of constant size (Katharopoulos, Vyas, Pappas and
Fleuret 2020, "Transformers are RNNs", ICML)::

    o_t = phi(q_t)^T S_t / (phi(q_t)^T z_t),   S_t = S_{t-1} + phi(k_t) v_t^T,   z_t = z_{t-1} + phi(k_t)

S is ``d_k x d_v`` (and the normaliser z is ``d_k``) whatever the length: attention becomes a
recurrence, an RNN (claim C41). The same sum can be computed all at once, as masked matmuls
(the *parallel* form) - training uses that one, generation the recurrent one.

Read top to bottom:

1. ``elu_feature_map``: Katharopoulos et al.'s ``phi(x) = elu(x) + 1`` (positive, so z > 0).
2. ``linear_attention_recurrent`` and ``linear_attention_parallel``: the two forms, equal.
3. ``delta_rule_recurrent``: the gated delta rule, token by token - *the* reference the Triton
   kernel (``attnlab.kernels.chunked_delta_rule``) and the grader compare against. Linear
   attention only ever *adds* ``k v^T``; the delta rule first reads what the state already
   stores for ``k_t`` (``S^T k_t``) and writes only the correction, ``beta_t (v_t - S^T k_t)``
   (Widrow and Hoff's rule; DeltaNet, Schlag, Irie and Schmidhuber 2021). A gate
   ``alpha_t = exp(g_t)`` in (0, 1] lets it forget: Gated DeltaNet (Yang, Kautz and
   Hatamizadeh, "Gated Delta Networks", arXiv:2412.06464, ICLR 2025), the layer Qwen3-Next
   uses for three layers in four (claim C42).
4. ``delta_rule_chunked``: the same numbers, computed chunk by chunk with matmuls inside a
   chunk and a scan across chunks (Yang, Wang, Zhang, Shen and Kim, "Parallelizing Linear
   Transformers with the Delta Rule over Sequence Length", NeurIPS 2024): the WY / UT form.
   This is the plain path beside the kernel.
5. ``recurrent_state_bytes`` and ``delta_rule_io``: the state's constant size, and the
   kernel's exact HBM traffic and FLOPs.

Conventions: q, k ``(B, H, N, d_k)``, v ``(B, H, N, d_v)``, beta and g ``(B, H, N)``, the state
``(B, H, d_k, d_v)`` (``S^T k`` reads it with a key, ``k u^T`` writes to it). Everything is
computed in float32; outputs come back in q's dtype, states in float32. Causal by construction
(a recurrence only sees the past). Bad input raises ``ValueError`` / ``TypeError`` naming the
argument before any work. The state's bytes beside the KV cache's:
``recurrent_state_bytes`` (section 5) and ``attnlab.iomodel.kv_cache_bytes``; the kernel's
traffic: ``delta_rule_io`` (kept beside the method, as ``attnlab.approx`` keeps its cost functions).

Example::

    o = delta_rule_recurrent(q, k, v, beta, g)
    o2 = delta_rule_chunked(q, k, v, beta, g, chunk_size=16)   # equal up to rounding
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab import validate

__all__ = [
    "elu_feature_map",
    "linear_attention_recurrent",
    "linear_attention_parallel",
    "delta_rule_recurrent",
    "delta_rule_chunked",
    "check_delta_rule_inputs",
    "recurrent_state_bytes",
    "delta_rule_io",
]


# ---------------------------------------------------------------------------------------------
# 1-2. Linear attention (Katharopoulos et al. 2020)
# ---------------------------------------------------------------------------------------------

def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """``phi(x) = elu(x) + 1``, Katharopoulos et al. 2020, eq. 7: positive everywhere, so the
    normaliser ``phi(q)^T sum phi(k)`` never vanishes. Shape-preserving: (..., d) -> (..., d).

    Example: ``elu_feature_map(torch.tensor([-1.0, 0.0, 2.0]))  # tensor([0.3679, 1.0000, 3.0000])``
    """
    return F.elu(x) + 1.0


def _check_linear_inputs(q, k, v, feature_map, eps, output_final_state=False):
    """q, k (B, H, N, d_k), v (B, H, N, d_v); a callable feature map; eps >= 0."""
    validate.qkv(q, k, v, same_length=True, nonempty=True)
    if not callable(feature_map):
        raise TypeError(f"feature_map: expected a callable (B, H, N, d_k) -> (B, H, N, m), got "
                        f"{type(feature_map).__name__}")
    validate.number_in(eps, "eps", 0.0, float("inf"))
    validate.flag(output_final_state, "output_final_state")


def _features(feature_map, x, name):
    """phi(x) in float32, checked: same (B, H, N) as x, one feature dim."""
    phi = feature_map(x.float())                                          # (B, H, N, m)
    if not isinstance(phi, torch.Tensor) or phi.dim() != 4 or phi.shape[:3] != x.shape[:3]:
        got = tuple(phi.shape) if isinstance(phi, torch.Tensor) else type(phi).__name__
        raise ValueError(f"feature_map: expected a tensor (B, H, N, m) = {tuple(x.shape[:3])} + (m,) for {name}, "
                         f"got {got}")
    return phi.float()


def linear_attention_recurrent(q, k, v, *, feature_map=elu_feature_map, eps=1e-6, output_final_state=False):
    """Causal linear attention as an RNN: one token at a time over a state of constant size.

    For t = 1..N: ``S = S + phi(k_t) v_t^T``; ``z = z + phi(k_t)``;
    ``o_t = phi(q_t)^T S / (phi(q_t)^T z + eps)``. q, k (B, H, N, d_k), v (B, H, N, d_v);
    ``feature_map`` maps (B, H, N, d_k) to (B, H, N, m) (default elu + 1, m = d_k).
    Returns o (B, H, N, d_v) in q's dtype, and with ``output_final_state`` also the state
    ``(S, z)``: S (B, H, m, d_v) and z (B, H, m), float32 - its size does not depend on N.

    Example: ``o = linear_attention_recurrent(q, k, v)``
    """
    _check_linear_inputs(q, k, v, feature_map, eps, output_final_state)
    phi_q = _features(feature_map, q, "q")                                # (B, H, N, m)
    phi_k = _features(feature_map, k, "k")                                # (B, H, N, m)
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(f"feature_map: expected one feature dim for q and k, got {phi_q.shape[-1]} and "
                         f"{phi_k.shape[-1]}")
    v32 = v.float()                                                       # (B, H, N, d_v)
    B, H, N, m = phi_q.shape
    S = phi_q.new_zeros(B, H, m, v.shape[-1])                             # (B, H, m, d_v) the state
    z = phi_q.new_zeros(B, H, m)                                          # (B, H, m) the normaliser
    out = []
    for t in range(N):
        S = S + phi_k[:, :, t, :, None] * v32[:, :, t, None, :]           # (B, H, m, d_v) += phi(k_t) v_t^T
        z = z + phi_k[:, :, t]                                            # (B, H, m)
        num = (phi_q[:, :, t, :, None] * S).sum(-2)                       # (B, H, d_v) phi(q_t)^T S
        den = (phi_q[:, :, t] * z).sum(-1, keepdim=True) + eps            # (B, H, 1)  phi(q_t)^T z
        out.append(num / den)                                             # (B, H, d_v)
    o = torch.stack(out, dim=2).to(q.dtype)                               # (B, H, N, d_v)
    return (o, (S, z)) if output_final_state else o


def linear_attention_parallel(q, k, v, *, feature_map=elu_feature_map, eps=1e-6):
    """Causal linear attention all at once: ``A = phi(Q) phi(K)^T`` masked to ``j <= i``, then
    ``O = A V / (A 1 + eps)``. The same numbers as :func:`linear_attention_recurrent` (sums
    regrouped), with an N x N matrix - like softmax attention without the exponential.
    q, k (B, H, N, d_k), v (B, H, N, d_v) -> o (B, H, N, d_v) in q's dtype.

    Example: ``o = linear_attention_parallel(q, k, v)``
    """
    _check_linear_inputs(q, k, v, feature_map, eps)
    phi_q = _features(feature_map, q, "q")                                # (B, H, N, m)
    phi_k = _features(feature_map, k, "k")                                # (B, H, N, m)
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(f"feature_map: expected one feature dim for q and k, got {phi_q.shape[-1]} and "
                         f"{phi_k.shape[-1]}")
    N = q.shape[2]
    causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()  # (N, N) j <= i
    a = (phi_q @ phi_k.transpose(-2, -1)).masked_fill(~causal, 0.0)       # (B, H, N, N)
    num = a @ v.float()                                                   # (B, H, N, d_v)
    den = a.sum(-1, keepdim=True) + eps                                   # (B, H, N, 1)
    return (num / den).to(q.dtype)                                        # (B, H, N, d_v)


# ---------------------------------------------------------------------------------------------
# 3. The gated delta rule, token by token: the reference
# ---------------------------------------------------------------------------------------------

def check_delta_rule_inputs(q, k, v, beta, g=None, scale=None, initial_state=None, output_final_state=False, *,
                            dtypes=None):
    """Every check of the delta rule's arguments (the references' and the kernel's); returns the scale.

    q, k (B, H, N, d_k) and v (B, H, N, d_v), N >= 1, floating, one dtype (one of ``dtypes``
    when given) and device; beta (B, H, N) and g (B, H, N) or None of q's dtype and device, g
    finite and <= 0 (the log of a decay in (0, 1]); scale a finite number or None
    (``d_k ** -0.5``); initial_state None or (B, H, d_k, d_v) float32; output_final_state a bool.

    Example: ``scale = check_delta_rule_inputs(q, k, v, beta, g)``
    """
    validate.qkv(q, k, v, dtypes=dtypes, same_length=True, nonempty=True)
    B, H, N, d_k = q.shape
    d_v = v.shape[-1]
    for name, x in (("beta", beta), ("g", g)):
        if x is None and name == "g":
            continue
        validate.tensor(x, name, 3, "(batch, heads, seq)", floating=True)
        if tuple(x.shape) != (B, H, N):
            raise ValueError(f"{name}: expected shape {(B, H, N)} (batch, heads, seq) like q, got {tuple(x.shape)}")
        validate.like(x, name, q, "q")
    if g is not None:
        if not bool(torch.isfinite(g).all()):
            raise ValueError("g: expected finite values (the log of a decay in (0, 1]), got inf or nan")
        if bool((g > 0).any()):
            raise ValueError(f"g: expected values <= 0 (the log of a decay in (0, 1]), got max {float(g.max()):.4g}")
    scale = validate.scale(scale, d_k)
    if initial_state is not None:
        validate.tensor(initial_state, "initial_state", 4, "(batch, heads, d_k, d_v)", dtypes=(torch.float32,))
        if tuple(initial_state.shape) != (B, H, d_k, d_v):
            raise ValueError(f"initial_state: expected shape {(B, H, d_k, d_v)} (batch, heads, d_k, d_v), got "
                             f"{tuple(initial_state.shape)}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state: expected device {q.device} (the device of q), got {initial_state.device}")
    validate.flag(output_final_state, "output_final_state")
    return scale


def delta_rule_recurrent(q, k, v, beta, g=None, *, scale=None, initial_state=None, output_final_state=False):
    """The (gated) delta rule, one token at a time: the reference of the kernel and the grader.

    For t = 1..N, with the state S (d_k x d_v)::

        S = S * exp(g_t)                    # forget (Gated DeltaNet); g_t <= 0, None: no decay
        u_t = beta_t * (v_t - S^T k_t)      # what S returns for k_t, corrected towards v_t
        S = S + k_t u_t^T                   # write only the correction
        o_t = S^T (scale * q_t)             # read with the query

    q, k (B, H, N, d_k); v (B, H, N, d_v); beta, g (B, H, N); scale defaults to d_k ** -0.5;
    initial_state (B, H, d_k, d_v) float32 or None (zeros). Computed in float32. Returns o
    (B, H, N, d_v) in q's dtype, and with ``output_final_state`` the tuple (o, final state
    (B, H, d_k, d_v) float32). With beta = 1 and a unit-norm key, ``S^T k_t = v_t`` afterwards:
    the write replaces what k_t stored.

    Example: ``o, state = delta_rule_recurrent(q, k, v, beta, g, output_final_state=True)``
    """
    scale = check_delta_rule_inputs(q, k, v, beta, g, scale, initial_state, output_final_state)
    B, H, N, d_k = q.shape
    q32, k32, v32, b32 = q.float(), k.float(), v.float(), beta.float()    # (B, H, N, d_k) x2, (B, H, N, d_v), (B, H, N)
    S = (initial_state.float().clone() if initial_state is not None
         else q32.new_zeros(B, H, d_k, v.shape[-1]))                      # (B, H, d_k, d_v)
    out = []
    for t in range(N):
        if g is not None:
            S = S * g[:, :, t].float().exp()[:, :, None, None]            # (B, H, d_k, d_v) decay
        k_t = k32[:, :, t]                                                # (B, H, d_k)
        read = (k_t[..., None] * S).sum(-2)                               # (B, H, d_v)  S^T k_t
        u = b32[:, :, t, None] * (v32[:, :, t] - read)                    # (B, H, d_v)  the correction
        S = S + k_t[..., None] * u[..., None, :]                          # (B, H, d_k, d_v) += k_t u_t^T
        out.append(((scale * q32[:, :, t])[..., None] * S).sum(-2))      # (B, H, d_v)  S^T (scale q_t)
    o = torch.stack(out, dim=2).to(q.dtype)                               # (B, H, N, d_v)
    return (o, S) if output_final_state else o


# ---------------------------------------------------------------------------------------------
# 4. The chunkwise-parallel form (WY / UT representation)
# ---------------------------------------------------------------------------------------------

def delta_rule_chunked(q, k, v, beta, g=None, *, scale=None, initial_state=None, output_final_state=False,
                       chunk_size=64):
    """The gated delta rule chunk by chunk: matmuls inside a chunk, a scan across chunks.

    Inside a chunk of C tokens that starts from state S0, write ``G_i = g_1 + ... + g_i`` (the
    log of the decay from the chunk's start to token i). Unrolling the recurrence of
    :func:`delta_rule_recurrent`, the corrections ``u_i`` (rows of U, C x d_v) satisfy::

        u_i + beta_i sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S0^T k_i)

    a unit lower-triangular system ``(I + A) U = diag(beta) (V - diag(exp G) K S0)`` with
    ``A = strictly_lower(diag(beta) K K^T * exp(G_i - G_j))``. With ``T = (I + A)^-1`` (the UT
    transform; forward substitution, here ``torch.linalg.solve_triangular``) the WY form is::

        W = T diag(beta exp G) K          # (C, d_k): depends on keys only
        U = T diag(beta) V - W S0         # (C, d_v)
        O = scale (diag(exp G) Q S0 + (Q K^T * exp(G_i - G_j), j <= i) U)
        S = exp(G_C) S0 + (K * exp(G_C - G_j))^T U      # the state at the chunk's end

    Every line is a matmul over the chunk; only the last one carries across chunks (a scan of
    N / C steps instead of N). Yang et al., NeurIPS 2024 (DeltaNet) and Yang, Kautz and
    Hatamizadeh, ICLR 2025 (the gate). Same arguments and result as
    :func:`delta_rule_recurrent`, plus ``chunk_size`` (any positive int; the last chunk may
    be shorter, so N need not be a multiple).

    Example: ``o = delta_rule_chunked(q, k, v, beta, g, chunk_size=16)``
    """
    scale = check_delta_rule_inputs(q, k, v, beta, g, scale, initial_state, output_final_state)
    chunk_size = validate.integer(chunk_size, "chunk_size")
    B, H, N, d_k = q.shape
    d_v = v.shape[-1]
    q32, k32, v32, b32 = q.float(), k.float(), v.float(), beta.float()    # (B, H, N, d_k) x2, (B, H, N, d_v), (B, H, N)
    g32 = g.float() if g is not None else torch.zeros_like(b32)           # (B, H, N) log decay, 0 = none
    S = (initial_state.float().clone() if initial_state is not None
         else q32.new_zeros(B, H, d_k, d_v))                              # (B, H, d_k, d_v)
    out = []
    for c0 in range(0, N, chunk_size):
        c1 = min(c0 + chunk_size, N)
        C = c1 - c0
        qc, kc, vc = q32[:, :, c0:c1], k32[:, :, c0:c1], v32[:, :, c0:c1]  # (B, H, C, d_k) x2, (B, H, C, d_v)
        bc = b32[:, :, c0:c1]                                             # (B, H, C)
        G = g32[:, :, c0:c1].cumsum(-1)                                   # (B, H, C) log decay since chunk start
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()   # (C, C) j <= i
        # exp(G_i - G_j) for j <= i only: above the diagonal G_i - G_j >= 0 could overflow
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # (B, H, C, C)
        A = (bc[..., None] * (kc @ kc.transpose(-2, -1)) * decay).tril(-1)  # (B, H, C, C) strictly lower
        I_A = A + torch.eye(C, device=q.device)                           # (B, H, C, C) unit lower triangular
        W = torch.linalg.solve_triangular(I_A, (bc * G.exp())[..., None] * kc, upper=False,
                                          unitriangular=True)             # (B, H, C, d_k) T diag(beta e^G) K
        U = torch.linalg.solve_triangular(I_A, bc[..., None] * vc, upper=False,
                                          unitriangular=True) - W @ S     # (B, H, C, d_v) T diag(beta) V - W S0
        inter = (G.exp()[..., None] * qc) @ S                             # (B, H, C, d_v) what S0 gives each query
        intra = ((qc @ kc.transpose(-2, -1)) * decay) @ U                 # (B, H, C, d_v) this chunk's writes
        out.append(scale * (inter + intra))                               # (B, H, C, d_v)
        G_last = G[..., -1]                                               # (B, H)
        S = (G_last.exp()[..., None, None] * S
             + ((G_last[..., None] - G).exp()[..., None] * kc).transpose(-2, -1) @ U)  # (B, H, d_k, d_v)
    o = torch.cat(out, dim=2).to(q.dtype)                                 # (B, H, N, d_v)
    return (o, S) if output_final_state else o


# ---------------------------------------------------------------------------------------------
# 5. What it costs: the state's bytes (constant) and the kernel's traffic
# ---------------------------------------------------------------------------------------------

def recurrent_state_bytes(layers=1, heads=1, d_k=64, d_v=None, bytes_per_element=4, *, normalizer=False) -> int:
    """Bytes of a linear-attention / delta-rule state: layers x heads x d_k x d_v x bytes, whatever the length.

    The counterpart of :func:`attnlab.iomodel.kv_cache_bytes`, which grows by one K and V row
    per token: this does not grow at all. ``d_v`` None means ``d_k``; ``normalizer`` adds
    Katharopoulos et al.'s z (d_k more numbers per head); states are float32 (4 bytes) here.
    Example: ``recurrent_state_bytes(layers=48, heads=32, d_k=128, d_v=128)  # 100,663,296 B, any length``
    """
    d_v = d_k if d_v is None else d_v
    for name, val in (("layers", layers), ("heads", heads), ("d_k", d_k), ("d_v", d_v),
                      ("bytes_per_element", bytes_per_element)):
        validate.integer(val, name)
    validate.flag(normalizer, "normalizer")
    return layers * heads * d_k * (d_v + int(normalizer)) * bytes_per_element


def delta_rule_io(batch, heads, n, d_k=64, d_v=None, bytes_per_element=2, *, gate=True, initial_state=False,
                  final_state=False, chunk_size=64, state_bytes_per_element=4):
    """HBM bytes and FLOPs of ``attnlab.kernels.chunked_delta_rule``, exactly as ``attnlab.memory.trace`` counts them.

    Per (batch, head): read q and k (n d_k each), v (n d_v), beta (n) and, with ``gate``, g (n),
    in ``bytes_per_element``; with ``initial_state`` the d_k x d_v state (float32); write o
    (n d_v) and, with ``final_state``, the state again. Nothing else: the state stays in
    registers, so the traffic per token is the token's own q, k, v, beta, g and o.
    FLOPs: the kernel's ``tl.dot`` matmuls on ceil(n / C) chunks of C = ``chunk_size`` rows
    (a ragged last chunk still computes whole tiles), per chunk ``6 C^2 d_k + 4 C^2 d_v +
    6 C d_k d_v`` (K K^T, T K, T V, W S, Q K^T, Q S, (QK^T) U, K^T U; 2 FLOPs a multiply-add);
    the forward substitution's (C - 1) C^2 multiply-adds are vector work, not counted, like the
    softmax's exponentials in :mod:`attnlab.iomodel`. Returns an :class:`attnlab.iomodel.IO`
    with one part, ``"chunked_delta_rule"``.

    Example: ``delta_rule_io(1, 16, 4096, d_k=128, d_v=128, final_state=True).total_bytes``
    """
    from attnlab.iomodel import IO

    d_v = d_k if d_v is None else d_v
    for name, val in (("batch", batch), ("heads", heads), ("n", n), ("d_k", d_k), ("d_v", d_v),
                      ("bytes_per_element", bytes_per_element), ("chunk_size", chunk_size),
                      ("state_bytes_per_element", state_bytes_per_element)):
        validate.integer(val, name)
    for name, val in (("gate", gate), ("initial_state", initial_state), ("final_state", final_state)):
        validate.flag(val, name)
    e, es, C = bytes_per_element, state_bytes_per_element, chunk_size
    state = d_k * d_v * es                                                # bytes of one (batch, head)'s state
    read = n * (2 * d_k + d_v + 1 + int(gate)) * e + int(initial_state) * state
    written = n * d_v * e + int(final_state) * state
    chunks = -(-n // C)
    flops = chunks * (6 * C * C * d_k + 4 * C * C * d_v + 6 * C * d_k * d_v)
    part = IO(read, written, flops)
    return IO(part.bytes_read, part.bytes_written, part.flops, {"chunked_delta_rule": part}).scaled(batch * heads)
