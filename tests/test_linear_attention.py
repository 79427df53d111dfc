"""attnlab/linear_attention.py and kernels/delta_rule.py: linear attention's two forms agree; the gated delta
rule's chunked reference and Triton kernel equal the token-by-token recurrence (ragged N, d_k != d_v, a scale
other than d_k**-0.5, with and without the gate, initial and final states, float16); the kernel's traced bytes
equal delta_rule_io to the byte; the delta rule's defining property (beta = 1 and a unit key store v exactly);
and every argument error names its argument before any work."""

import re

import pytest
import torch
import torch.nn.functional as F

from attnlab.iomodel import kv_cache_bytes
from attnlab.kernels import chunked_delta_rule
from attnlab.kernels import delta_rule as delta_rule_module
from attnlab.linear_attention import (delta_rule_chunked, delta_rule_io, delta_rule_recurrent, elu_feature_map,
                                      linear_attention_parallel, linear_attention_recurrent, recurrent_state_bytes)
from attnlab.memory import trace

MESSAGE = re.compile(r"^[a-z_]+: expected .+, got .+", re.S)


def make(B=2, H=2, N=17, d_k=16, d_v=32, *, gate=True, state=True, dtype=torch.float32, seed=0):
    """q, k (unit-norm keys, as Gated DeltaNet normalises them), v, beta in (0, 1), g <= 0, a state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, d_k, generator=gen)
    k = F.normalize(torch.randn(B, H, N, d_k, generator=gen), dim=-1)
    v = torch.randn(B, H, N, d_v, generator=gen)
    beta = torch.rand(B, H, N, generator=gen)
    g = -0.3 * torch.rand(B, H, N, generator=gen) if gate else None
    s0 = torch.randn(B, H, d_k, d_v, generator=gen) if state else None
    cast = [x.to(dtype) if x is not None else None for x in (q, k, v, beta, g)]
    return (*cast, s0)


# ---------------------------------------------------------------------------------------------
# Linear attention (Katharopoulos et al. 2020): recurrent == parallel
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N,d_k,d_v", [(1, 4, 4), (23, 8, 5)])
def test_linear_attention_recurrent_equals_parallel(N, d_k, d_v):
    q, k, v, *_ = make(N=N, d_k=d_k, d_v=d_v)
    o_rec, (S, z) = linear_attention_recurrent(q, k, v, output_final_state=True)
    o_par = linear_attention_parallel(q, k, v)
    torch.testing.assert_close(o_rec, o_par, atol=1e-5, rtol=1e-5)
    # the state is the sum of every phi(k) v^T: d_k x d_v numbers whatever N
    phi_k = elu_feature_map(k)
    assert S.shape == (2, 2, d_k, d_v) and z.shape == (2, 2, d_k)
    torch.testing.assert_close(S, phi_k.transpose(-2, -1) @ v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z, phi_k.sum(2), atol=1e-5, rtol=1e-5)
    # the first output is v_0 (one key, weight 1), and the last depends on the whole past
    torch.testing.assert_close(o_rec[:, :, 0], v[:, :, 0], atol=1e-5, rtol=1e-5)


def test_linear_attention_takes_another_feature_map_and_keeps_the_dtype():
    q, k, v, *_ = make(N=9, d_k=8, d_v=8)

    def squares(x):                                       # (B, H, N, d) -> (B, H, N, 2d), positive
        return torch.cat([x.square(), torch.ones_like(x)], dim=-1)

    o_rec = linear_attention_recurrent(q, k, v, feature_map=squares)
    torch.testing.assert_close(o_rec, linear_attention_parallel(q, k, v, feature_map=squares), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(o_rec, linear_attention_parallel(q, k, v), atol=1e-3)   # the map matters
    half = linear_attention_parallel(q.half(), k.half(), v.half())
    assert half.dtype == torch.float16


# ---------------------------------------------------------------------------------------------
# The gated delta rule: chunked reference and kernel against the recurrence
# ---------------------------------------------------------------------------------------------

CASES = [  # N, d_k, d_v, gate, state, scale
    pytest.param(1, 16, 32, True, True, 0.3, id="N1"),
    pytest.param(17, 16, 32, True, True, 0.3, id="N17-gate-state"),
    pytest.param(50, 32, 16, False, True, None, id="N50-nogate-state"),
    pytest.param(50, 16, 16, True, False, 1.7, id="N50-gate-nostate"),
    pytest.param(33, 8, 12, True, True, 0.5, id="N33-padded-dims"),
]


@pytest.mark.parametrize("N,d_k,d_v,gate,state,scale", CASES)
@pytest.mark.parametrize("chunk_size", [16, 5])
def test_chunked_reference_equals_the_recurrence(N, d_k, d_v, gate, state, scale, chunk_size):
    q, k, v, beta, g, s0 = make(N=N, d_k=d_k, d_v=d_v, gate=gate, state=state)
    o_ref, S_ref = delta_rule_recurrent(q, k, v, beta, g, scale=scale, initial_state=s0, output_final_state=True)
    o, S = delta_rule_chunked(q, k, v, beta, g, scale=scale, initial_state=s0, output_final_state=True,
                              chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("N,d_k,d_v,gate,state,scale", CASES)
def test_kernel_equals_the_recurrence(N, d_k, d_v, gate, state, scale):
    q, k, v, beta, g, s0 = make(N=N, d_k=d_k, d_v=d_v, gate=gate, state=state)
    o_ref, S_ref = delta_rule_recurrent(q, k, v, beta, g, scale=scale, initial_state=s0, output_final_state=True)
    o, S = chunked_delta_rule(q, k, v, beta, g, chunk_size=16, scale=scale, initial_state=s0, output_final_state=True)
    assert o.shape == (2, 2, N, d_v) and o.dtype == torch.float32
    assert S.shape == (2, 2, d_k, d_v) and S.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=1e-5)
    # without output_final_state: o alone, the same numbers
    torch.testing.assert_close(chunked_delta_rule(q, k, v, beta, g, chunk_size=16, scale=scale, initial_state=s0),
                               o_ref, atol=1e-5, rtol=1e-5)


def test_the_scale_and_the_chunk_size_matter_as_they_should():
    q, k, v, beta, g, s0 = make(N=40)
    o16 = chunked_delta_rule(q, k, v, beta, g, chunk_size=16, initial_state=s0)
    o32 = chunked_delta_rule(q, k, v, beta, g, chunk_size=32, initial_state=s0)
    torch.testing.assert_close(o16, o32, atol=1e-5, rtol=1e-5)          # chunking is exact
    o_default = delta_rule_recurrent(q, k, v, beta, g, initial_state=s0)  # scale d_k ** -0.5 = 0.25
    torch.testing.assert_close(o16, o_default, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_delta_rule(q, k, v, beta, g, chunk_size=16, initial_state=s0, scale=0.5),
                               2 * o_default, atol=1e-5, rtol=1e-5)   # the output is linear in the scale


def test_strong_decay_neither_overflows_nor_loses_the_state():
    """A gate of exp(-40) inside a chunk: exp(G_i - G_j) above the diagonal would be exp(+40 * ...),
    which both implementations mask before exponentiating."""
    q, k, v, beta, g, s0 = make(N=37, d_k=16, d_v=16)
    g[:, :, 10] = -40.0
    g[:, :, 30] = -25.0
    o_ref, S_ref = delta_rule_recurrent(q, k, v, beta, g, initial_state=s0, output_final_state=True)
    for o, S in (delta_rule_chunked(q, k, v, beta, g, initial_state=s0, output_final_state=True, chunk_size=32),
                 chunked_delta_rule(q, k, v, beta, g, initial_state=s0, output_final_state=True, chunk_size=32)):
        assert torch.isfinite(o).all() and torch.isfinite(S).all()
        torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=1e-5)


def test_float16_inputs_compute_in_float32_and_return_float16():
    q, k, v, beta, g, s0 = make(N=50, d_k=16, d_v=32, dtype=torch.float16)
    o, S = chunked_delta_rule(q, k, v, beta, g, chunk_size=16, initial_state=s0, output_final_state=True)
    assert o.dtype == torch.float16 and S.dtype == torch.float32
    # the reference on the same float16 values (it computes in float32 too): only o's rounding differs
    o_ref, S_ref = delta_rule_recurrent(q, k, v, beta, g, initial_state=s0, output_final_state=True)
    assert o_ref.dtype == torch.float16
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(S, S_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(delta_rule_chunked(q, k, v, beta, g, chunk_size=16, initial_state=s0).float(),
                               o_ref.float(), atol=2e-3, rtol=2e-3)


def test_kernel_gradients_equal_the_recurrences():
    """The kernel is forward only; its backward recomputes with delta_rule_chunked (autograd through it)."""
    q, k, v, beta, g, s0 = make(B=1, H=2, N=20, d_k=16, d_v=16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, g, s0)]
    o, S = chunked_delta_rule(*leaves[:5], chunk_size=16, scale=0.4, initial_state=leaves[5], output_final_state=True)
    gen = torch.Generator().manual_seed(3)
    do, dS = torch.randn(o.shape, generator=gen), torch.randn(S.shape, generator=gen)
    grads = torch.autograd.grad([o, S], leaves, [do, dS])
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, g, s0)]
    o_r, S_r = delta_rule_recurrent(*ref_leaves[:5], scale=0.4, initial_state=ref_leaves[5], output_final_state=True)
    ref = torch.autograd.grad([o_r, S_r], ref_leaves, [do, dS])
    for name, a, b in zip(("q", "k", "v", "beta", "g", "initial_state"), grads, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")
    # only o used, and only some inputs requiring grad
    qq = q.clone().requires_grad_()
    (dq,) = torch.autograd.grad(chunked_delta_rule(qq, k, v, beta, chunk_size=16).sum(), [qq])
    qr = q.clone().requires_grad_()
    (dq_ref,) = torch.autograd.grad(delta_rule_recurrent(qr, k, v, beta).sum(), [qr])
    torch.testing.assert_close(dq, dq_ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# What the delta rule does: it writes the correction, so a unit key with beta = 1 stores v exactly
# ---------------------------------------------------------------------------------------------

def test_beta_one_and_a_unit_key_store_v_exactly():
    _, k, v, _, _, s0 = make(B=1, H=2, N=1, d_k=16, d_v=8)
    beta = torch.ones(1, 2, 1)
    _, S = delta_rule_recurrent(k, k, v, beta, initial_state=s0, output_final_state=True)
    read = (k[:, :, 0, :, None] * S).sum(-2)                                  # (B, H, d_v) S^T k
    torch.testing.assert_close(read, v[:, :, 0], atol=1e-5, rtol=1e-5)       # whatever S held before
    # linear attention only adds k v^T: what it reads back still carries the old state
    added = s0 + k[:, :, 0, :, None] * v[:, :, 0, None, :]
    assert not torch.allclose((k[:, :, 0, :, None] * added).sum(-2), v[:, :, 0], atol=1e-2)


def test_orthonormal_keys_with_beta_one_are_all_retrieved_by_every_implementation():
    """d_k orthonormal keys written with beta = 1 do not disturb each other: reading with q = k_i
    (scale 1) after all the writes returns v_i, from the recurrence, the chunked form and the kernel."""
    d_k, d_v = 16, 8
    gen = torch.Generator().manual_seed(5)
    basis, _ = torch.linalg.qr(torch.randn(d_k, d_k, generator=gen))        # (d_k, d_k) orthonormal columns
    k = basis.T.reshape(1, 1, d_k, d_k).contiguous()                          # (1, 1, N = d_k, d_k)
    v = torch.randn(1, 1, d_k, d_v, generator=gen)
    beta = torch.ones(1, 1, d_k)
    s0 = torch.randn(1, 1, d_k, d_v, generator=gen)
    kw = dict(scale=1.0, initial_state=s0, output_final_state=True)
    for _, S in (delta_rule_recurrent(k, k, v, beta, **kw), delta_rule_chunked(k, k, v, beta, chunk_size=4, **kw),
                 chunked_delta_rule(k, k, v, beta, chunk_size=16, **kw)):
        torch.testing.assert_close(k[0, 0] @ S[0, 0], v[0, 0], atol=1e-4, rtol=1e-4)   # S^T k_i = v_i for all i


# ---------------------------------------------------------------------------------------------
# Bytes: the kernel's traffic, traced, against delta_rule_io; the state against the KV cache
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gate,state", [(True, True), (False, False)])
def test_traced_bytes_equal_delta_rule_io(gate, state):
    B, H, N, d_k, d_v = 2, 3, 50, 8, 12                 # ragged N for chunks of 16, padded head dims
    q, k, v, beta, g, s0 = make(B=B, H=H, N=N, d_k=d_k, d_v=d_v, gate=gate, state=state, dtype=torch.float16)
    t = trace(lambda: chunked_delta_rule(q, k, v, beta, g, chunk_size=16, initial_state=s0, output_final_state=state))
    model = delta_rule_io(B, H, N, d_k=d_k, d_v=d_v, bytes_per_element=2, gate=gate, initial_state=state,
                          final_state=state, chunk_size=16)
    assert t.launches == ["_chunked_delta_rule_kernel"]
    assert (t.bytes_read, t.bytes_written) == (model.bytes_read, model.bytes_written)
    # every input read once and the output written once: the traffic is the tensors' sizes, not N x state
    assert t.bytes_read == t.unique_bytes_read and t.bytes_written == t.unique_bytes_written
    by = t.by_tensor
    assert by["Q"] == {"read": B * H * N * d_k * 2, "written": 0}
    assert by["O"] == {"read": 0, "written": B * H * N * d_v * 2}
    if state:
        assert by["S0"] == {"read": B * H * d_k * d_v * 4, "written": 0}
        assert by["ST"] == {"read": 0, "written": B * H * d_k * d_v * 4}
    else:
        assert "S0" not in by and "ST" not in by and "G" not in by


def test_delta_rule_io_hand_count_and_the_state_against_the_kv_cache():
    # n = 20, d_k = 2, d_v = 3, 1 byte: read q, k 40 each, v 60, beta 20, g 20; the state 2 x 3 x 4 B
    m = delta_rule_io(1, 1, 20, d_k=2, d_v=3, bytes_per_element=1, initial_state=True, final_state=True,
                      chunk_size=16)
    assert (m.bytes_read, m.bytes_written) == (40 + 40 + 60 + 20 + 20 + 24, 60 + 24)
    assert m.flops == 2 * (6 * 256 * 2 + 4 * 256 * 3 + 6 * 16 * 2 * 3)       # two chunks of 16 rows
    assert delta_rule_io(3, 2, 20, d_k=2, d_v=3, bytes_per_element=1, gate=False).total_bytes == 6 * (160 + 60)
    # the state does not grow; the KV cache grows by one K and V row per token
    state = recurrent_state_bytes(layers=4, heads=8, d_k=64, d_v=64)
    assert state == 4 * 8 * 64 * 64 * 4
    assert recurrent_state_bytes(heads=2, d_k=3, d_v=5, bytes_per_element=2, normalizer=True) == 2 * 3 * 6 * 2
    first = next(n for n in range(1, 10**6)
                 if kv_cache_bytes(n, layers=4, kv_heads=8, d=64, bytes_per_element=2) > state)
    assert first == 65                                                      # beyond 64 tokens the cache is larger


# ---------------------------------------------------------------------------------------------
# Errors name their argument, before any work
# ---------------------------------------------------------------------------------------------

def _bad_cases():
    q, k, v, beta, g, s0 = make(B=1, H=2, N=5, d_k=16, d_v=16)
    ok = dict(q=q, k=k, v=v, beta=beta, g=g)
    rows = [  # what, changes, error, argument
        ("q not a tensor", dict(q=q.tolist()), TypeError, "q"),
        ("k head dim", dict(k=k[..., :8]), ValueError, "k"),
        ("v length", dict(v=v[:, :, :3]), ValueError, "v"),
        ("integer q", dict(q=q.long(), k=k.long(), v=v.long(), beta=beta.long(), g=g.long()), TypeError, "q"),
        ("beta shape", dict(beta=beta[..., None]), ValueError, "beta"),
        ("beta length", dict(beta=beta[:, :, :4]), ValueError, "beta"),
        ("beta dtype", dict(beta=beta.double()), TypeError, "beta"),
        ("g positive", dict(g=g.abs() + 0.1), ValueError, "g"),
        ("g nan", dict(g=torch.full_like(g, float("nan"))), ValueError, "g"),
        ("g dtype", dict(g=g.half()), TypeError, "g"),
        ("state shape", dict(initial_state=s0[..., :8]), ValueError, "initial_state"),
        ("state dtype", dict(initial_state=s0.double()), TypeError, "initial_state"),
        ("bool scale", dict(scale=True), TypeError, "scale"),
        ("nan scale", dict(scale=float("nan")), ValueError, "scale"),
        ("flag", dict(output_final_state=1), TypeError, "output_final_state"),
    ]
    for what, change, err, arg in rows:
        yield what, {**ok, **change}, err, arg


CALLS = {
    "recurrent": lambda a: delta_rule_recurrent(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("beta"), a.pop("g"), **a),
    "chunked": lambda a: delta_rule_chunked(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("beta"), a.pop("g"), **a),
    "kernel": lambda a: chunked_delta_rule(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("beta"), a.pop("g"), **a),
}


def _check_error(call, err, arg):
    with pytest.raises(err) as info:
        call()
    message = str(info.value)
    assert MESSAGE.match(message), message
    assert message.split(":")[0] == arg, message


@pytest.mark.parametrize("fn", list(CALLS))
@pytest.mark.parametrize("what,args,err,arg", [pytest.param(*row, id=row[0]) for row in _bad_cases()])
def test_delta_rule_errors_name_their_argument_before_any_work(fn, what, args, err, arg, monkeypatch):
    def no_launch(*a, **kw):
        raise AssertionError("the kernel was launched before the arguments were checked")

    monkeypatch.setattr(delta_rule_module, "_launch", no_launch)
    _check_error(lambda: CALLS[fn](dict(args)), err, arg)


def test_errors_of_the_kernel_only_and_of_linear_attention(monkeypatch):
    monkeypatch.setattr(delta_rule_module, "_launch", lambda *a, **kw: pytest.fail("launched"))
    q, k, v, beta, g, _ = make(B=1, H=1, N=5, d_k=16, d_v=16)
    _check_error(lambda: chunked_delta_rule(q, k, v, beta, g, chunk_size=24), ValueError, "chunk_size")
    _check_error(lambda: chunked_delta_rule(q, k, v, beta, g, chunk_size=8), ValueError, "chunk_size")
    _check_error(lambda: delta_rule_chunked(q, k, v, beta, g, chunk_size=0), ValueError, "chunk_size")
    _check_error(lambda: chunked_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16(), g.bfloat16()),
                 TypeError, "q")
    _check_error(lambda: chunked_delta_rule(q.double(), k.double(), v.double(), beta.double(), g.double()),
                 TypeError, "q")
    big = torch.randn(1, 1, 5, 512)
    _check_error(lambda: chunked_delta_rule(big, big, v, beta, g), ValueError, "q")
    _check_error(lambda: chunked_delta_rule(q, k, big, beta, g), ValueError, "v")
    _check_error(lambda: linear_attention_recurrent(q, k, v, feature_map="elu"), TypeError, "feature_map")
    _check_error(lambda: linear_attention_parallel(q, k, v, feature_map=lambda x: x[..., 0]), ValueError,
                 "feature_map")
    _check_error(lambda: linear_attention_parallel(q, k, v[:, :, :2]), ValueError, "v")
    _check_error(lambda: linear_attention_recurrent(q, k, v, eps=-1.0), ValueError, "eps")
    _check_error(lambda: delta_rule_io(1, 1, 0), ValueError, "n")
    _check_error(lambda: recurrent_state_bytes(d_k=2.5), TypeError, "d_k")


def test_the_kernel_compiles_for_a_gpu():
    """No GPU here: lower the kernel to PTX and a cubin for sm_80 with Triton's bundled toolchain, with the
    gate, both states and float16 inputs (the interpreter accepts code a GPU compile rejects, and back)."""
    from test_interp_hooks import _compile_for_sm80

    names = ["Q", "K", "V", "BETA", "G", "S0", "O", "ST", "N", "D_K", "D_V", "scale", "ROWS"]
    signature = {n: "*fp16" if n in ("Q", "K", "V", "BETA", "G", "O") else "*fp32" for n in names[:8]}
    signature.update(N="i32", D_K="i32", D_V="i32", scale="fp32", ROWS="i32")
    constexprs = {"CHUNK": 16, "BLOCK_DK": 16, "BLOCK_DV": 32, "HAS_G": True, "HAS_S0": True, "STORE_ST": True,
                  "DOT_PRECISION": "ieee"}
    signature.update({n: "constexpr" for n in constexprs})
    order = list(signature)
    compiled = _compile_for_sm80(delta_rule_module._chunked_delta_rule_kernel, signature,
                                 {(order.index(n),): value for n, value in constexprs.items()})
    assert "ptx" in compiled.asm and "cubin" in compiled.asm
