"""tiled_attention (FlashAttention in PyTorch) against torch's SDPA: outputs, lse and gradients."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from attnlab.tiled import _backward_reference, _forward_reference, tiled_attention


def _inputs(B, H, Nq, Nk, D, Dv, dtype=torch.float64, seed=0, mult=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, Nq, D, generator=g, dtype=dtype) * mult).requires_grad_()
    k = (torch.randn(B, H, Nk, D, generator=g, dtype=dtype) * mult).requires_grad_()
    v = torch.randn(B, H, Nk, Dv, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


def _lse_reference(q, k, causal, scale):
    """log-sum-exp of each row of the scaled (causally masked, top-left) scores, (B, H, Nq)."""
    s = (q @ k.transpose(-2, -1)) * scale                                      # (B, H, Nq, Nk)
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()     # top-left, as SDPA
        s = s.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(s, dim=-1)                                          # (B, H, Nq)


shapes = st.fixed_dictionaries({
    "B": st.integers(1, 2), "H": st.integers(1, 3),
    "Nq": st.integers(1, 40), "Nk": st.integers(1, 40),
    "D": st.integers(1, 12), "Dv": st.integers(1, 12),
    "block_m": st.integers(1, 17), "block_n": st.integers(1, 17),
    "causal": st.booleans(), "seed": st.integers(0, 2**16),
    "scale": st.one_of(st.none(), st.floats(0.05, 2.0)),
})


@given(shapes)
def test_matches_sdpa_outputs_lse_and_gradients(c):
    """Any lengths (seq 1, not multiples of the blocks, Nq != Nk), causal or not, fp64: exact to rounding."""
    q, k, v = _inputs(c["B"], c["H"], c["Nq"], c["Nk"], c["D"], c["Dv"], seed=c["seed"])
    scale = c["scale"] if c["scale"] is not None else 1 / math.sqrt(c["D"])
    out, lse = tiled_attention(q, k, v, causal=c["causal"], scale=c["scale"],
                               block_m=c["block_m"], block_n=c["block_n"], return_lse=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"], scale=scale)
    ref_lse = _lse_reference(q, k, c["causal"], scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)

    g = torch.Generator().manual_seed(c["seed"] + 1)
    dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
    dlse = torch.randn(lse.shape, generator=g, dtype=lse.dtype)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
    want = torch.autograd.grad((ref * dout).sum() + (ref_lse * dlse).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Nq,Nk", [(1, 1), (1, 37), (37, 1), (100, 64), (64, 100)])
def test_float32_default_blocks(causal, Nq, Nk):
    q, k, v = _inputs(2, 2, Nq, Nk, 16, 16, dtype=torch.float32, seed=Nq * 1000 + Nk)
    out = tiled_attention(q, k, v, causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_logits_of_magnitude_1e4_stay_finite(causal):
    """Scores around 1e4 (exp would overflow at ~88): the running max keeps every exponent <= 0."""
    q, k, v = _inputs(1, 2, 45, 33, 8, 8, dtype=torch.float32, seed=3, mult=60.0)
    scale = 1 / math.sqrt(8)
    logits = (q @ k.transpose(-2, -1)) * scale
    assert logits.abs().max() > 1e4
    out, lse = tiled_attention(q, k, v, causal=causal, block_m=16, block_n=8, return_lse=True)
    grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert all(torch.isfinite(g).all() for g in grads)
    # compare with SDPA in float64 (fp32 scores of 1e4 carry absolute rounding of ~1e-3)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)
    torch.testing.assert_close(lse.double(), _lse_reference(q64, k64, causal, scale), rtol=1e-6, atol=0)


def test_no_keys_gives_zero_rows_and_zero_gradients():
    """With top-left causal masking every row sees key 0, so a row is fully masked only when Nk == 0:
    such rows output zeros (as torch's SDPA does) with lse = -inf, and gradients are zero."""
    q, k, v = _inputs(1, 2, 5, 0, 4, 3)
    out, lse = tiled_attention(q, k, v, block_m=2, block_n=2, return_lse=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    assert (out == 0).all() and (lse == float("-inf")).all()
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert (dq == 0).all()


def test_only_lse_used_in_the_loss():
    q, k, v = _inputs(1, 1, 9, 7, 4, 4)
    _, lse = tiled_attention(q, k, v, causal=True, block_m=4, block_n=3, return_lse=True)
    got = torch.autograd.grad(lse.sum(), (q, k))
    want = torch.autograd.grad(_lse_reference(q, k, True, 0.5).sum(), (q, k))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_half_precision_inputs_are_computed_in_float32():
    q, k, v = _inputs(1, 2, 20, 30, 8, 8, dtype=torch.float32, seed=5)
    out, lse = tiled_attention(q.half(), k.half(), v.half(), causal=True, block_m=8, block_n=8,
                               return_lse=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    ref = F.scaled_dot_product_attention(q.half().float(), k.half().float(), v.half().float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)


def test_plain_loop_is_the_same_algorithm():
    """_forward_reference (one head, no tricks, natural exp) agrees with SDPA and the fast path."""
    q, k, v = (x.detach() for x in _inputs(1, 1, 23, 19, 6, 5))
    out, lse = _forward_reference(q[0, 0], k[0, 0], v[0, 0], 0.4, 5, 4)
    fast, fast_lse = tiled_attention(q, k, v, scale=0.4, block_m=5, block_n=4, return_lse=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.4)[0, 0])
    torch.testing.assert_close(out, fast[0, 0])
    torch.testing.assert_close(lse, fast_lse[0, 0])


def test_plain_backward_loop_is_the_same_algorithm():
    q, k, v = _inputs(1, 1, 23, 19, 6, 5)
    out, lse = tiled_attention(q, k, v, scale=0.4, block_m=5, block_n=4, return_lse=True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    want = torch.autograd.grad(out, (q, k, v), dout)
    got = _backward_reference(q[0, 0].detach(), k[0, 0].detach(), v[0, 0].detach(), out[0, 0].detach(),
                              lse[0, 0].detach(), dout[0, 0], 0.4, 5, 4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b[0, 0])


def test_causal_skips_tiles_above_the_diagonal(monkeypatch):
    """Causal attention computes about half the tiles: count the score tiles the forward pass builds."""
    import attnlab.tiled as tiled

    calls = []
    real_bmm = torch.bmm

    def counting_bmm(a, b):
        calls.append((a.shape, b.shape))
        return real_bmm(a, b)

    monkeypatch.setattr(tiled.torch, "bmm", counting_bmm)
    q, k, v = (x.detach() for x in _inputs(1, 1, 64, 64, 4, 4))
    tiled_attention(q, k, v, causal=True, block_m=16, block_n=16)
    causal_tiles = len(calls)
    calls.clear()
    tiled_attention(q, k, v, causal=False, block_m=16, block_n=16)
    assert len(calls) == 16 and causal_tiles == 10      # 4 x 4 tiles; lower triangle incl. diagonal
    monkeypatch.undo()


# ---------------------------------------------------------------------------------------------
# bad input: ValueError / TypeError naming the argument
# ---------------------------------------------------------------------------------------------

def _ok(**over):
    args = dict(q=torch.zeros(1, 2, 5, 4), k=torch.zeros(1, 2, 6, 4), v=torch.zeros(1, 2, 6, 3))
    args.update(over)
    return args


@pytest.mark.parametrize("args,exc,name", [
    (_ok(q=torch.zeros(2, 5, 4)), ValueError, "q"),
    (_ok(k=torch.zeros(1, 2, 6, 4, 1)), ValueError, "k"),
    (_ok(v=[[1.0]]), TypeError, "v"),
    (_ok(k=torch.zeros(1, 3, 6, 4)), ValueError, "k"),
    (_ok(k=torch.zeros(1, 2, 6, 5)), ValueError, "k"),
    (_ok(v=torch.zeros(1, 2, 7, 3)), ValueError, "v"),
    (_ok(k=torch.zeros(1, 2, 6, 4, dtype=torch.float64)), TypeError, "k"),
    (_ok(q=torch.zeros(1, 2, 5, 4, dtype=torch.int64)), TypeError, "q"),
    (_ok(v=torch.zeros(1, 2, 6, 3, device="meta")), ValueError, "v"),
    (dict(_ok(), block_m=0), ValueError, "block_m"),
    (dict(_ok(), block_n=-3), ValueError, "block_n"),
    (dict(_ok(), block_n=2.5), TypeError, "block_n"),
    (dict(_ok(), scale="big"), TypeError, "scale"),
])
def test_bad_input_names_the_argument(args, exc, name):
    with pytest.raises(exc, match=rf"^{name}:"):
        tiled_attention(**args)


def test_the_old_tile_names_still_work_for_one_release_with_a_warning_naming_the_new_one():
    q, k, v = _inputs(1, 1, 9, 7, 4, 4)
    new = tiled_attention(q, k, v, block_m=4, block_n=3)
    with pytest.warns(DeprecationWarning, match="block_q is deprecated .* use block_m"):
        with pytest.warns(DeprecationWarning, match="block_k is deprecated .* use block_n"):
            old = tiled_attention(q, k, v, block_q=4, block_k=3)
    torch.testing.assert_close(old, new, rtol=0, atol=0)
    with pytest.raises(TypeError, match="^block_q: expected only block_m"):
        tiled_attention(q, k, v, block_q=4, block_m=4)
