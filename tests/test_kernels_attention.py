"""The attention kernels (FlashAttention, and standard attention: the same checks and bad inputs) against torch
SDPA, in the CPU interpreter; their launch configuration. The softmax kernel: tests/test_kernels_softmax.py."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.kernels import flash_attention, standard_attention
from attnlab.kernels import _tuning
from attnlab.kernels._tuning import default_block_sizes

fa_mod = importlib.import_module("attnlab.kernels.flash_attention")  # the module (the package exports the function)


def _qkv(b, h, nq, nk, d, dtype=torch.float32, seed=0, scale=1.0, grad=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float32) for n in (nq, nk, nk))
    q = q * scale
    return [t.to(dtype).requires_grad_(grad) for t in (q, k, v)]


def _check(fn, q, k, v, causal, atol, rtol, **kw):
    o = fn(q, k, v, causal=causal, **kw)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    assert o.dtype == q.dtype and o.shape == q.shape
    torch.testing.assert_close(o.float(), ref, atol=atol, rtol=rtol)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(o.float(), (q, k, v), g)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal), (qf, kf, vf), g)
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a.float(), b, atol=atol, rtol=rtol, msg=lambda m: f"d{name}: {m}")


@settings(max_examples=min(12, settings.default.max_examples))   # fewer in make test-fast (ATTNLAB_HYPOTHESIS_EXAMPLES)
@given(
    b=st.integers(1, 2), h=st.integers(1, 2), nq=st.integers(1, 80), nk=st.integers(1, 80),
    d=st.sampled_from([16, 32]), causal=st.booleans(),
    blocks=st.sampled_from([(16, 16), (32, 16), (16, 32), (64, 64)]),
)
def test_flash_matches_sdpa_random_shapes(b, h, nq, nk, d, causal, blocks):
    q, k, v = _qkv(b, h, nq, nk, d, seed=nq * 100 + nk)
    _check(flash_attention, q, k, v, causal, 2e-5, 2e-4, block_m=blocks[0], block_n=blocks[1])


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 37), (37, 1), (129, 130), (200, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_ragged_and_seq1(nq, nk, causal):
    q, k, v = _qkv(1, 2, nq, nk, 32, seed=nq + nk)
    _check(flash_attention, q, k, v, causal, 2e-5, 2e-4)  # default interpreter blocks (128 x 128)


@pytest.mark.parametrize("nq,nk,bm,bn", [(64, 64, 16, 32), (64, 128, 32, 16), (128, 32, 16, 16), (96, 96, 32, 16),
                                         (96, 64, 32, 32), (64, 96, 16, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_even_lengths_skip_masks_exactly(nq, nk, bm, bn, causal):
    # lengths that are multiples of the blocks take the unmasked path (EVEN_M/EVEN_N), and only the
    # blocks crossing the diagonal apply the causal mask: unequal blocks and Nq != Nk exercise both
    q, k, v = _qkv(1, 2, nq, nk, 16, seed=nq + 7 * nk)
    _check(flash_attention, q, k, v, causal, 2e-5, 2e-4, block_m=bm, block_n=bn)


@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_flash_head_dims(d):
    q, k, v = _qkv(1, 1, 33, 45, d, seed=d)
    _check(flash_attention, q, k, v, True, 2e-5, 2e-4, block_m=16, block_n=32)


def test_flash_large_logits_stay_finite():
    # logits of magnitude ~1e4: the online softmax must not overflow
    q, k, v = _qkv(1, 1, 40, 50, 16, scale=2500.0)
    o = flash_attention(q, k, v, block_m=16, block_n=16)
    ref = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-4)
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all()
        # the softmax is saturated: gradients are tiny differences of huge logits, so compare
        # relative to each gradient's own magnitude
        torch.testing.assert_close(a, b, atol=1e-3 * float(b.abs().max()) + 1e-6, rtol=0)


def test_flash_fp16_looser_tolerance():
    q, k, v = _qkv(1, 2, 70, 90, 32, dtype=torch.float16, seed=3)
    _check(flash_attention, q, k, v, True, 2e-3, 2e-2, block_m=32, block_n=32)


def _grads(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(fn(q, k, v), (q, k, v), do.to(q.dtype))


@pytest.mark.parametrize("kernel", ["flash", "block-sparse"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_fp16_gradients_with_large_inputs_keep_flash_attentions_rule(large_fp16_qkv, kernel, causal, d):
    """flash-attention's tolerance for float16: each gradient's error at most twice PyTorch's float16
    error (plus one float16 spacing at the gradient's largest value), against float64 on the same
    float16 inputs, at magnitude ~100 (scores 2e4-4e4). dQ must also be no worse than PyTorch's: it
    is where D = rowsum(dO * O) matters (dQ_i sums dS_ij K_j with keys sharing one large direction,
    so an error in D_i comes back times |K|), and D is made of the float32 O the forward kept; a
    float16 O broke this (1.6 to 1.9 times PyTorch's error at these seeds)."""
    from attnlab import mask_mods
    from attnlab.kernels import block_sparse_attention, create_block_mask

    n = 48
    q, k, v = large_fp16_qkv(d, n)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(100))
    if kernel == "flash":
        fn = lambda a, b, c: flash_attention(a, b, c, causal=causal)   # noqa: E731 - default (interpreter) blocks
    else:
        mask = create_block_mask(mask_mods.causal if causal else mask_mods.full, None, None, n, n, block_size=(32, 32))
        fn = lambda a, b, c: block_sparse_attention(a, b, c, mask)     # noqa: E731
    ref = _grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal),
                 q.double(), k.double(), v.double(), do.double())
    torch_grads = _grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), q, k, v, do)
    grads = _grads(fn, q, k, v, do)
    for name, g, t, r in zip("qkv", grads, torch_grads, ref):
        assert g.dtype == torch.float16
        err, torch_err = (g.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
        spacing = 2.0 ** (math.floor(math.log2(r.abs().max().item())) - 10)   # float16's at the largest value
        assert err <= 2 * torch_err + spacing, f"d{name}: error {err:.4g}, PyTorch's {torch_err:.4g}"
        if name == "q":
            assert err <= torch_err, f"dq: error {err:.4g}, PyTorch's {torch_err:.4g} (D's precision)"


def test_flash_return_lse_and_scale():
    q, k, v = _qkv(1, 1, 20, 30, 16, grad=False)
    o, lse = flash_attention(q, k, v, scale=0.3, return_lse=True)
    s = (q @ k.transpose(-1, -2)) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o, torch.softmax(s, -1) @ v, atol=1e-5, rtol=1e-5)
    assert lse.shape == (1, 1, 20) and lse.dtype == torch.float32


def test_flash_noncontiguous_inputs():
    q, k, v = _qkv(1, 3, 24, 24, 16, grad=False)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    torch.testing.assert_close(flash_attention(qt, k, v), flash_attention(q, k, v))


def test_interpreter_blocks_are_large():
    assert default_block_sizes(64, torch.float32, "cpu") == (128, 128)


@pytest.mark.parametrize("causal", [False, True])
def test_standard_attention_matches_sdpa(causal):
    q, k, v = _qkv(2, 1, 50, 70, 32, seed=5)
    _check(standard_attention, q, k, v, causal, 2e-5, 2e-4, block_m=32, block_n=16, block_k=16)
    q, k, v = _qkv(1, 1, 1, 1, 16, seed=6)
    _check(standard_attention, q, k, v, causal, 2e-5, 2e-4)


# ---- bad input: raised before any launch, naming the argument ------------------------------
def _good():
    return _qkv(1, 1, 8, 8, 16, grad=False)


@pytest.mark.parametrize("fn", [flash_attention, standard_attention])
def test_bad_inputs(fn):
    q, k, v = _good()
    with pytest.raises(TypeError, match="bfloat16"):
        fn(q.bfloat16(), k.bfloat16(), v.bfloat16())
    with pytest.raises(ValueError, match="head_dim"):
        fn(*_qkv(1, 1, 8, 8, 24, grad=False))
    with pytest.raises(ValueError, match="k: expected head_dim"):
        fn(q, k[:, :, :, :8], v)
    with pytest.raises(ValueError, match=r"v: expected \(batch, heads, seq\)"):
        fn(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match=r"k: expected \(batch, heads\)"):
        fn(q, k.expand(2, 1, 8, 16), v)
    with pytest.raises(ValueError, match="q: expected a 4-D tensor"):
        fn(q[0], k, v)
    with pytest.raises(TypeError, match="k: expected dtype"):
        fn(q, k.half(), v)
    with pytest.raises(ValueError, match="k: expected device"):
        fn(q, k.to("meta"), v)
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        fn(q.numpy(), k, v)
    with pytest.raises(TypeError, match="causal"):
        fn(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="block_m"):
        fn(q, k, v, block_m=24)


def test_kernels_run_in_interpreter_without_env(monkeypatch):
    from attnlab.kernels._runtime import use_interpreter

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert use_interpreter("cpu")
    assert not use_interpreter("cuda")
    assert math.isfinite(float(flash_attention(*_good()).sum()))


def _compile_for_gpu(kernel, consts, dtype, arch, num_warps, num_stages, none=()):
    """Lower ``kernel`` to a cubin for sm_``arch`` with Triton's bundled toolchain, no GPU needed,
    exactly as ``benchmarks/gpu_compile_check.py`` does (specialised like a real launch on
    contiguous tensors, so loads are pipelined and the reported shared memory is real)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu_compile_check.py")
    spec = importlib.util.spec_from_file_location("gpu_compile_check", path)
    check = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(check)
    except ImportError as e:  # pragma: no cover - a triton build without its GPU backend
        pytest.skip(f"no Triton GPU backend: {e}")
    sig, cx, attrs = check.signature(kernel, dtype, consts, none=none)
    try:
        return check.compile_one(check.GPUTarget("cuda", arch, 32), kernel, sig, cx, num_warps, num_stages, attrs)
    except (RuntimeError, FileNotFoundError) as e:  # pragma: no cover - toolchain missing from this triton build
        if "ptxas" in str(e) or "not found" in str(e).lower():
            pytest.skip(f"Triton's CUDA toolchain is not available: {e}")
        raise


@pytest.mark.parametrize("arch", [80, 90])
def test_native_gpu_path_compiles_without_a_gpu(arch):
    """The block-sparse forward kernel (fp16 training: it also writes the float32 O, ragged lengths,
    the GPU's block sizes) lowered for sm_80 (A100) and sm_90 (H100, H200) from a target given by
    hand (``GPUTarget``), no GPU needed: catches breakage of the compiled path on a CPU machine."""
    import importlib

    bsa_mod = importlib.import_module("attnlab.kernels.block_sparse_attention")   # the module, not the function

    bm, bn = _tuning.default_block_sizes(64, torch.float16, "cuda")
    consts = dict(HEAD_DIM=64, BLOCK_M=bm, BLOCK_N=bn, DOT_PRECISION="tf32", EVEN_N=False, KEEP_F32_O=True)
    compiled = _compile_for_gpu(bsa_mod._bsa_fwd_kernel, consts, torch.float16, arch, 4, 3)
    limit = {80: 163, 90: 227}[arch] * 1024
    assert "cubin" in compiled.asm and compiled.metadata.shared <= limit
    assert f".target sm_{arch}" in compiled.asm["ptx"]
    mma = "wgmma" if arch == 90 else "mma.sync"     # Hopper's warpgroup MMA, Ampere's warp-level MMA
    assert "cp.async" in compiled.asm["ptx"] and mma in compiled.asm["ptx"]  # pipelined loads, tensor cores


@pytest.mark.parametrize("arch,dtype,kind", [(75, torch.float32, "dkdv"), (75, torch.float16, "fwd"),
                                             (75, torch.float16, "dq"), (80, torch.float16, "dkdv"),
                                             (90, torch.bfloat16, "fwd")])
def test_default_gpu_configs_fit_shared_memory(arch, dtype, kind):
    # the largest (head dim 128) default launch of each kernel must fit the GPU's shared memory:
    # a T4 (sm_75, Colab's free GPU) has 64 KiB, an A100 163 KiB, an H100/H200 227 KiB
    limit = {75: 64, 80: 163, 90: 227}[arch] * 1024
    cfg = _tuning.gpu_config(128, dtype, (arch // 10, arch % 10), backward=kind != "fwd")
    kernel = {"fwd": fa_mod._attn_fwd_kernel, "dkdv": fa_mod._attn_bwd_dkdv_kernel, "dq": fa_mod._attn_bwd_dq_kernel}[kind]
    consts = dict(HEAD_DIM=128, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], CAUSAL=True,
                  DOT_PRECISION=fa_mod.dot_precision(dtype), EVEN_N=True)
    if kind == "fwd":   # a training step: float16/bfloat16 also write the float32 O (the larger variant)
        consts.update(KEEP_F32_O=dtype != torch.float32)
    if kind == "dkdv":
        consts.update(EVEN_M=True, GROUP=1)
    compiled = _compile_for_gpu(kernel, consts, dtype, arch, cfg["num_warps"], cfg["num_stages"])
    assert compiled.metadata.shared <= limit, (cfg, compiled.metadata.shared)
