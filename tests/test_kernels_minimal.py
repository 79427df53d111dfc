"""The minimal kernels lessons 06 and 07 read first (tutorial_softmax.py, flash_steps.py), in the
CPU interpreter: values against attnlab's references, and traffic against attnlab.iomodel."""

import pytest
import torch

from attnlab import iomodel
from attnlab.attention import naive_attention, softmax as reference_softmax
from attnlab.kernels.flash_attention import flash_attention
from attnlab.kernels.flash_steps import (
    flash_backward_minimal,
    flash_forward_causal,
    flash_forward_loop,
    flash_forward_masked,
)
from attnlab.kernels.tutorial_softmax import tutorial_softmax
from attnlab.memory import trace


def _qkv(b, h, n, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(dtype) for _ in range(3)]


def _reference(q, k, v, causal=False):
    return naive_attention(q.double(), k.double(), v.double(), causal=causal)[0]


# --- the tutorial softmax -------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (37, 781), (3, 1024)])
def test_tutorial_softmax_matches_reference(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1])) * 3
    torch.testing.assert_close(tutorial_softmax(x), reference_softmax(x, dim=-1), atol=1e-6, rtol=1e-5)


def test_tutorial_softmax_float16_and_traffic():
    x = torch.randn(19, 300, generator=torch.Generator().manual_seed(1)).half()
    y = tutorial_softmax(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), reference_softmax(x.float(), dim=-1), atol=1e-3, rtol=1e-2)
    t = trace(tutorial_softmax, x)
    # one program per row; each reads its row once and writes it once: MN + MN elements
    assert t.launches == ["softmax_row_kernel"]
    assert t.bytes_read == t.bytes_written == 19 * 300 * 2
    assert t.total_bytes == iomodel.softmax_io(19, 300, 2).total_bytes
    assert len(t.programs()) == 19


def test_tutorial_softmax_bad_input():
    with pytest.raises(ValueError, match="x: expected a 2-D tensor"):
        tutorial_softmax(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="x: expected dtype float32"):
        tutorial_softmax(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="16384"):
        tutorial_softmax(torch.randn(1, 16385))


# --- the forward, step by step -------------------------------------------------------
@pytest.mark.parametrize("n,bm,bn", [(64, 16, 16), (128, 32, 64), (128, 64, 32)])
def test_step_a_loop_matches_reference(n, bm, bn):
    q, k, v = _qkv(2, 2, n, 32, seed=n + bm)
    torch.testing.assert_close(flash_forward_loop(q, k, v, bm, bn).double(), _reference(q, k, v), atol=2e-5, rtol=1e-4)


def test_step_a_needs_even_n():
    q, k, v = _qkv(1, 1, 100, 16)
    with pytest.raises(ValueError, match="q: expected N a multiple of block_m"):
        flash_forward_loop(q, k, v, 32, 32)


@pytest.mark.parametrize("n", [1, 17, 100, 129])
@pytest.mark.parametrize("bm,bn", [(16, 16), (32, 16), (16, 64)])
def test_step_b_masked_any_n(n, bm, bn):
    q, k, v = _qkv(1, 2, n, 16, seed=n)
    torch.testing.assert_close(flash_forward_masked(q, k, v, bm, bn).double(), _reference(q, k, v), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n", [1, 16, 45, 100])
@pytest.mark.parametrize("bm,bn", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("causal", [True, False])
def test_step_c_causal_any_n(n, bm, bn, causal):
    q, k, v = _qkv(1, 2, n, 16, seed=3 * n)
    out = flash_forward_causal(q, k, v, causal=causal, block_m=bm, block_n=bn)
    torch.testing.assert_close(out.double(), _reference(q, k, v, causal=causal), atol=2e-5, rtol=1e-4)


def test_steps_in_float16():
    q, k, v = _qkv(1, 1, 96, 64, dtype=torch.float16, seed=5)
    ref = _reference(q, k, v, causal=True)
    out = flash_forward_causal(q, k, v, block_m=32, block_n=32)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=1e-2)


def test_step_traffic_equals_iomodel_without_the_lse():
    # the steps do not write the log-sum-exp: the shipped kernel's count minus N floats per head
    b, h, n, d, bm, bn = 1, 2, 100, 16, 32, 16
    q, k, v = _qkv(b, h, n, d, seed=9)
    lse = b * h * n * 4
    for causal in (False, True):
        model = iomodel.flash_forward_io(b, h, n, d=d, bytes_per_element=4, block_m=bm, block_n=bn, causal=causal)
        t = trace(flash_forward_causal, q, k, v, causal=causal, block_m=bm, block_n=bn)
        assert (t.bytes_read, t.bytes_written) == (model.bytes_read, model.bytes_written - lse)
    # causal block skipping: the tiles above the diagonal are never loaded
    # (query block i reads keys 0 .. min((i + 1) bm, n) - 1, whole blocks of bn; here bm is a multiple of bn)
    full = trace(flash_forward_masked, q, k, v, block_m=bm, block_n=bn).by_tensor["K"]["read"]
    causal = trace(flash_forward_causal, q, k, v, causal=True, block_m=bm, block_n=bn).by_tensor["K"]["read"]
    n_qblocks = -(-n // bm)
    assert full == n_qblocks * n * d * 4 * h
    assert causal == sum(min((i + 1) * bm, n) for i in range(n_qblocks)) * d * 4 * h
    even = trace(flash_forward_loop, *_qkv(1, 1, 64, 16), block_m=32, block_n=16)
    m = iomodel.flash_forward_io(1, 1, 64, d=16, bytes_per_element=4, block_m=32, block_n=16)
    assert even.total_bytes == m.total_bytes - 64 * 4


# --- the backward --------------------------------------------------------------------
@pytest.mark.parametrize("n,bm,bn", [(64, 16, 32), (96, 32, 16)])
def test_minimal_backward_matches_autograd(n, bm, bn):
    q, k, v = _qkv(1, 2, n, 32, seed=n)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    o, lse = flash_attention(q, k, v, return_lse=True)
    dq, dk, dv = flash_backward_minimal(q, k, v, o, lse, do, bm, bn)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(naive_attention(qr, kr, vr)[0], (qr, kr, vr), do.double())
    for name, a, b_ in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        torch.testing.assert_close(a.double(), b_, atol=5e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_minimal_backward_traffic_equals_iomodel():
    b, h, n, d, bm, bn = 1, 1, 64, 16, 16, 32
    q, k, v = _qkv(b, h, n, d, seed=2)
    do = torch.ones_like(q)
    o, lse = flash_attention(q, k, v, return_lse=True)
    t = trace(flash_backward_minimal, q, k, v, o, lse, do, bm, bn)
    assert t.launches == ["bwd_dkdv_kernel", "bwd_dq_kernel"]
    model = iomodel.flash_backward_io(b, h, n, d=d, bytes_per_element=4, block_m=bm, block_n=bn)
    per_launch = t.by_launch()
    for row, part in zip(per_launch, ("bwd_dkdv", "bwd_dq")):
        assert (row["read"], row["written"]) == (model.parts[part].bytes_read, model.parts[part].bytes_written)


def test_minimal_backward_bad_arguments():
    q, k, v = _qkv(1, 1, 64, 16)
    o, lse = flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse: expected shape"):
        flash_backward_minimal(q, k, v, o, lse[..., :3], torch.ones_like(q), 16, 16)
    with pytest.raises(ValueError, match="block_m: expected a power of two"):
        flash_forward_masked(q, k, v, 24, 16)
