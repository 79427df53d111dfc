"""The kernels on a CUDA GPU, natively compiled: outputs and gradients against PyTorch.

Skipped where no GPU is visible (CI and this course's CPU machines); ``benchmarks/gpu_check.sh``
runs them on a GPU. They check what the interpreter cannot: the compiled code, bfloat16, the
tensor-core precision of ``tl.dot`` (fp32 goes through ``input_precision="ieee"``, fp16 and
bf16 through tensor cores with fp32 accumulation), the autotuner and the launch limits of a
real device.
"""

import os

import pytest
import torch
import torch.nn.functional as F

# ATTNLAB_GPU_TESTS_ON_CPU=1 runs these on the CPU, in the interpreter: a dry run of the tests
# themselves before device time is spent on them (bfloat16 and the autotuner are skipped there)
DEV = "cpu" if os.environ.get("ATTNLAB_GPU_TESTS_ON_CPU") == "1" else "cuda"
pytestmark = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (runs in benchmarks/gpu_check.sh)")

# forward and gradients against an fp32 reference computed from the same (rounded) inputs
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}


def _qkv(b, h, nq, nk, d, dtype, seed=0):
    if DEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bfloat16 runs on a GPU only")
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(b, h, n, d, device=DEV, dtype=dtype, generator=g).requires_grad_() for n in (nq, nk, nk)]


def _reference(q, k, v, causal, mask=None, do=None):
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    if mask is not None:
        o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask)
    else:
        o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal)
    o.backward(do.float())
    return o, qf.grad, kf.grad, vf.grad


def _compare(o, q, k, v, ref, do, dtype):
    atol, rtol = TOL[dtype]
    assert o.dtype == dtype and o.device.type == DEV
    torch.testing.assert_close(o.float(), ref[0], atol=atol, rtol=rtol)
    o.backward(do)
    for name, t, want in zip("qkv", (q, k, v), ref[1:]):
        torch.testing.assert_close(t.grad.float(), want, atol=atol * 5, rtol=rtol * 5, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(512, 512), (300, 700), (1000, 257)])
def test_flash_attention_on_gpu(dtype, d, causal, nq, nk):
    from attnlab.kernels import flash_attention

    q, k, v = _qkv(2, 3, nq, nk, d, dtype, seed=d + nq)
    do = torch.randn_like(q)
    ref = _reference(q, k, v, causal, do=do)
    _compare(flash_attention(q, k, v, causal=causal), q, k, v, ref, do, dtype)


def test_flash_attention_fixed_blocks_and_lse_on_gpu():
    from attnlab.kernels import flash_attention

    q, k, v = _qkv(1, 2, 384, 384, 64, torch.float16, seed=3)
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True, block_m=64, block_n=32)
    s = (q.float() @ k.float().transpose(-1, -2)) * 64 ** -0.5
    s = s.masked_fill(~torch.ones(384, 384, dtype=torch.bool, device=DEV).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(o.float(), F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True),
                               atol=1e-2, rtol=1e-2)


def test_autotuner_ran_and_chose_a_candidate():
    from attnlab.kernels import _tuning, flash_attention

    if DEV == "cpu":
        pytest.skip("the autotuner times native launches only")
    q, k, v = _qkv(1, 4, 2048, 2048, 64, torch.float16, seed=5)
    flash_attention(q, k, v).sum().backward()
    # keys of free block sizes: (kernel, d, dtype, causal, Nq bucket, Nk bucket, capability, device)
    kinds = {e["key"][0]: e for e in _tuning.tuning_log() if len(e["key"]) == 8 and e["key"][1] == 64
             and e["key"][4] == 2048}
    assert {"fwd", "dkdv", "dq"} <= set(kinds)
    cap = torch.cuda.get_device_capability()
    for kind, entry in kinds.items():
        assert entry["best"] in _tuning.gpu_candidates(64, torch.float16, cap, kind)
        assert any(err is None for _, _, err in entry["timings"])
    # fixed block sizes (a block mask's): only warps and stages were tuned
    flash_attention(q, k, v, block_m=128, block_n=128)
    fixed = [e for e in _tuning.tuning_log() if e["key"][-2:] == (128, 128) and e["key"][0] == "fwd"]
    assert fixed and all((c["block_m"], c["block_n"]) == (128, 128) for c, _, _ in fixed[-1]["timings"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_block_sparse_attention_on_gpu(dtype):
    from attnlab.kernels import BlockMask, block_sparse_attention, local_mask

    n, bs = 1024, (64, 64)
    mask = local_mask(n, n, window=192, block_size=bs)
    q, k, v = _qkv(1, 2, n, n, 64, dtype, seed=7)
    do = torch.randn_like(q)
    dense_mask = mask.to_element_mask(n, n).to(DEV)[0, 0]
    ref = _reference(q, k, v, False, mask=dense_mask, do=do)
    _compare(block_sparse_attention(q, k, v, BlockMask(mask.mask.to(DEV), bs)), q, k, v, ref, do, dtype)


def test_standard_attention_and_softmax_on_gpu():
    from attnlab.kernels import softmax, standard_attention

    x = torch.randn(37, 5000, device=DEV)
    torch.testing.assert_close(softmax(x), torch.softmax(x, -1))
    q, k, v = _qkv(1, 2, 200, 300, 64, torch.float16, seed=9)
    do = torch.randn_like(q)
    ref = _reference(q, k, v, True, do=do)
    _compare(standard_attention(q, k, v, causal=True), q, k, v, ref, do, torch.float16)


def test_bad_input_on_gpu_names_the_argument():
    from attnlab.kernels import flash_attention

    q, k, v = _qkv(1, 1, 16, 16, 64, torch.float16)
    if DEV == "cuda":
        with pytest.raises(ValueError, match="k is on cpu"):
            flash_attention(q, k.detach().cpu(), v)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attention(*_qkv(1, 1, 16, 16, 48, torch.float16))


def test_trace_of_gpu_tensors_counts_the_same_bytes_as_on_the_cpu():
    from attnlab.kernels import flash_attention
    from attnlab.memory import trace

    q, k, v = (t.detach() for t in _qkv(1, 1, 256, 256, 32, torch.float16, seed=11))
    on_gpu = trace(flash_attention, q, k, v, causal=True)
    on_cpu = trace(flash_attention, q.cpu(), k.cpu(), v.cpu(), causal=True)
    assert on_gpu.bytes_read == on_cpu.bytes_read and on_gpu.bytes_written == on_cpu.bytes_written
    torch.testing.assert_close(on_gpu.result.cpu(), on_cpu.result)
