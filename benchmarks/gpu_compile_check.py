"""Compile every GPU variant of the course's kernels for an NVIDIA target, without a GPU.

Usage: python benchmarks/gpu_compile_check.py [--arch 90] [--quick]

Triton can lower a kernel to PTX and a cubin with its bundled ptxas on a machine with no
GPU. This script does that for the launch configurations the wrappers actually use on a
GPU (block sizes, warps, stages from ``gpu_config`` and ``standard_block_sizes``; fp16, bf16 and
fp32; head dims 16 to 128; causal; the block-sparse kernels), and prints each kernel's shared memory next to
the target's limit, with the registers per thread and any spills that ptxas reports. It
catches compile errors, shared-memory overflows and register spills of the native path on a
CPU-only machine; it does not run anything and says nothing else about speed.
"""

import argparse
import importlib
import inspect
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

fa = importlib.import_module("attnlab.kernels.flash_attention")
bsa = importlib.import_module("attnlab.kernels.block_sparse_attention")
sm = importlib.import_module("attnlab.kernels.softmax")
st = importlib.import_module("attnlab.kernels.standard_attention")
tune = importlib.import_module("attnlab.kernels._tuning")

SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 75: 64 * 1024}
TL_NAME = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
INDEX_PTRS = {"KV_NUM", "KV_IDX", "FULL_KV_NUM", "FULL_KV_IDX", "Q_NUM", "Q_IDX", "FULL_Q_NUM", "FULL_Q_IDX", "TILE_IDS"}
INT8_PTRS = {"TILES"}
STAT_PTRS = {"L", "DELTA", "DLSE", "O_F32"}   # float32 whatever the inputs
HEAD_COUNTS = ("H", "H_KV", "GROUP")   # small ints (often 1): not divisible by 16


def signature(kernel, dtype, consts, ints=("H", "H_KV", "GROUP", "N_Q", "N_K"), floats=("sm_scale", "alpha"), none=()):
    """(signature, constexprs, attrs) of one specialisation of ``kernel``.

    ``attrs`` marks every pointer, stride and length as divisible by 16, as Triton's JIT does at
    a launch on contiguous tensors with lengths that are multiples of 16 (the benchmarks' case).
    That matters: only with it does the compiler pipeline loads through shared memory
    (cp.async), which is what decides whether a configuration fits. Without it a compile check
    under-counts shared memory."""
    params = list(inspect.signature(kernel.fn).parameters)
    defaults = {n: p.default for n, p in inspect.signature(kernel.fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    consts = {**defaults, **consts}   # a constexpr with a default (HUGE_SCALE=False) takes it, as a launch does
    if consts.get("KEEP_F32_O") is False:   # the forward's float32 copy of O is None unless it is kept
        none = tuple(none) + ("O_F32",)
    sig, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(params):
        if n not in consts and n not in none and n not in floats and n not in HEAD_COUNTS:
            attrs[(i,)] = [["tt.divisibility", 16]]
        if n in consts:
            sig[n], constexprs[(i,)] = "constexpr", consts[n]
        elif n in none:
            sig[n], constexprs[(i,)] = "constexpr", None
        elif n in floats:
            sig[n] = "fp32"
        elif n in ints or not n.isupper():
            sig[n] = "i32"
        elif n in INDEX_PTRS:
            sig[n] = "*i32"
        elif n in INT8_PTRS:
            sig[n] = "*i8"
        elif n in STAT_PTRS:
            sig[n] = "*fp32"
        else:
            sig[n] = "*" + TL_NAME[dtype]
    return sig, constexprs, attrs


def compile_one(target, kernel, sig, constexprs, num_warps, num_stages, attrs=None):
    src = ASTSource(JITFunction(kernel.fn), sig, constexprs, attrs)
    return triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})


def registers(ptx, arch):
    """(registers per thread, spilled bytes) from ptxas -v on ``ptx``: a spill to local memory
    in an attention kernel's loop costs more than any launch-configuration choice gains."""
    import os
    import re
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return None, None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        err = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", err)
    spills = re.search(r"(\d+) bytes spill stores", err)
    return (int(regs.group(1)) if regs else None), (int(spills.group(1)) if spills else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (80 = A100, 90 = H100/H200, 75 = T4)")
    ap.add_argument("--quick", action="store_true", help="fp16, d in {64, 128} only")
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    limit = SHARED_LIMIT.get(args.arch, 99 * 1024)
    print(f"triton {triton.__version__}, target sm_{args.arch}, shared memory limit {limit // 1024} KiB")
    failures = 0
    dtypes = [torch.float16] if args.quick else [torch.float16, torch.bfloat16, torch.float32]
    if args.arch < 80:
        dtypes = [t for t in dtypes if t != torch.bfloat16]  # no bf16 tensor cores before Ampere
    dims = [64, 128] if args.quick else [16, 32, 64, 128]
    jobs, optional = [], {}
    for dtype in dtypes:
        prec = fa.dot_precision(dtype)
        for d in dims:
            cap = (args.arch // 10, args.arch % 10)
            f, bw = tune.gpu_config(d, dtype, cap), tune.gpu_config(d, dtype, cap, backward=True)
            bm, bn, w_f, s_f = f["block_m"], f["block_n"], f["num_warps"], f["num_stages"]
            bbm, bbn, w_b, s_b = bw["block_m"], bw["block_n"], bw["num_warps"], bw["num_stages"]
            for causal in (False, True):
                # EVEN (lengths that are multiples of the blocks) is the fast path the
                # benchmarks take; ragged lengths compile the masked variant
                for even in (True, False):
                    c = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, DOT_PRECISION=prec)
                    # a training step in float16/bfloat16 also writes the float32 O the backward's D reads
                    jobs.append((fa._attn_fwd_kernel, dtype, dict(c, EVEN_N=even, KEEP_F32_O=dtype != torch.float32),
                                 (), w_f, s_f))
                    cb = dict(c, BLOCK_M=bbm, BLOCK_N=bbn)
                    jobs.append((fa._attn_bwd_dkdv_kernel, dtype, dict(cb, EVEN_M=even, EVEN_N=even, GROUP=1), (), w_b, s_b))
                    jobs.append((fa._attn_bwd_dq_kernel, dtype, dict(cb, EVEN_N=even), (), w_b, s_b))
            # the block-sparse kernels at the default tiles, ragged lengths (a mask's usual case)
            c = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, DOT_PRECISION=prec, EVEN_N=False)
            jobs.append((bsa._bsa_fwd_kernel, dtype, dict(c, KEEP_F32_O=dtype != torch.float32), (), w_f, s_f))
            cb = dict(c, BLOCK_M=bbm, BLOCK_N=bbn)
            jobs.append((bsa._bsa_bwd_dkdv_kernel, dtype, dict(cb, EVEN_M=False, GROUP=1), (), w_b, s_b))
            # grouped-query attention: the dK/dV kernels unroll their loop over the group's query heads
            jobs.append((fa._attn_bwd_dkdv_kernel, dtype, dict(cb, CAUSAL=True, EVEN_M=True, EVEN_N=True, GROUP=4), (), w_b, s_b))
            jobs.append((bsa._bsa_bwd_dkdv_kernel, dtype, dict(cb, EVEN_M=True, EVEN_N=True, GROUP=4), (), w_b, s_b))
            jobs.append((bsa._bsa_bwd_dq_kernel, dtype, cb, (), w_b, s_b))
            jobs.append((fa._attn_bwd_preprocess_kernel, dtype, dict(HEAD_DIM=d, BLOCK_M=bbm, HAS_DLSE=False), ("DLSE",), 4, 3))
            jobs.append((fa._attn_bwd_preprocess_kernel, dtype, dict(HEAD_DIM=d, BLOCK_M=bbm, HAS_DLSE=True), (), 4, 3))
            # the autotuner's other candidates (dense, even lengths: what it times); one that
            # does not fit is skipped on a GPU, so here it is reported, not counted as a failure
            for kind, kernel in (("fwd", fa._attn_fwd_kernel), ("dkdv", fa._attn_bwd_dkdv_kernel),
                                 ("dq", fa._attn_bwd_dq_kernel)):
                for cand in tune.gpu_candidates(d, dtype, cap, kind)[1:]:
                    for causal in (False, True):
                        c = dict(HEAD_DIM=d, BLOCK_M=cand["block_m"], BLOCK_N=cand["block_n"], CAUSAL=causal,
                                 DOT_PRECISION=prec, EVEN_N=True)
                        if kind == "dkdv":
                            c.update(EVEN_M=True, GROUP=1)
                        if kind == "fwd":
                            c.update(KEEP_F32_O=False)
                        optional[len(jobs)] = "SKIPPED BY THE AUTOTUNER (too much shared memory)"
                        jobs.append((kernel, dtype, c, (), cand["num_warps"], cand["num_stages"]))
            # block-sparse with a block mask's block size: the tiles are fixed, warps and stages
            # come from fixed_block_candidates; 128 x 128 (and on sm_75 64 x 64 at head dim 128, or
            # 64 in fp32) may not fit (then the mask needs smaller blocks, and the launch says so)
            for bs in (64, 128):
                for kind, kernel in (("fwd", bsa._bsa_fwd_kernel), ("dkdv", bsa._bsa_bwd_dkdv_kernel),
                                     ("dq", bsa._bsa_bwd_dq_kernel)):
                    fb = tune.fixed_block_candidates(bs, bs, d, dtype, cap, backward=kind != "fwd")[0]
                    c = dict(HEAD_DIM=d, BLOCK_M=bs, BLOCK_N=bs, DOT_PRECISION=prec, EVEN_N=True)
                    if kind == "dkdv":
                        c.update(EVEN_M=True, GROUP=1)
                    if kind == "fwd":
                        c.update(KEEP_F32_O=False)
                    small_gpu = args.arch < 80 and (d >= 128 or (dtype == torch.float32 and d >= 64))  # a T4: 64 KiB
                    if bs == 128 or small_gpu:
                        optional[len(jobs)] = f"TOO BIG FOR sm_{args.arch} (block masks need smaller blocks here)"
                    jobs.append((kernel, dtype, c, (), fb["num_warps"], fb["num_stages"]))
            sbm, sbn, sbk = st.standard_block_sizes(d, dtype, "cuda", capability=cap)
            st_stages = 3 if args.arch >= 80 else 1
            jobs.append((st._scores_kernel, dtype, dict(HEAD_DIM=d, BLOCK_M=sbm, BLOCK_N=sbn, CAUSAL=True, DOT_PRECISION=prec), (), 4, st_stages))
            jobs.append((st._pv_kernel, dtype, dict(HEAD_DIM=d, BLOCK_M=sbm, BLOCK_N=sbn, DOT_PRECISION=prec), (), 4, st_stages))
        jobs.append((st._matmul_kernel, dtype, dict(BLOCK_M=sbm, BLOCK_N=sbn, BLOCK_K=sbk, DOT_PRECISION=prec), (), 4, st_stages))
        for block, one in ((1024, True), (sm.MAX_FUSED_BLOCK, True), (sm.MAX_FUSED_BLOCK, False)):
            jobs.append((sm._softmax_kernel, dtype, dict(BLOCK=block, ROWS=1, ONE_PASS=one), (), sm.softmax_num_warps(block), 3))
        for block in (4096, sm.MAX_FUSED_BLOCK):
            jobs.append((st._softmax_bwd_kernel, dtype, dict(BLOCK=block, ROWS=1), (), sm.softmax_num_warps(block), 3))
    skipped = spilled = 0
    for n, (kernel, dtype, consts, none, warps, stages) in enumerate(jobs):
        ints = ("H", "N_Q", "N_K", "M", "N", "K") if kernel is st._matmul_kernel else ("H", "H_KV", "GROUP", "N_Q", "N_K")
        sig, cx, attrs = signature(kernel, dtype, consts, ints=ints, none=none)
        label = f"{kernel.__name__:<28} {TL_NAME[dtype]:>4} " + " ".join(
            f"{k}={v}" for k, v in consts.items() if k not in ("DOT_PRECISION",)) + f" warps={warps} stages={stages}"
        t0 = time.perf_counter()
        try:
            k = compile_one(target, kernel, sig, cx, warps, stages, attrs)
            shared = k.metadata.shared
            if shared <= limit:
                flag = "OK "
            elif n in optional:
                flag, skipped = optional[n], skipped + 1
            else:
                flag, failures = "TOO MUCH SHARED MEMORY", failures + 1
            regs, spills = registers(k.asm["ptx"], args.arch)
            spilled += bool(spills)
            print(f"{flag} {label}  shared {shared / 1024:.0f} KiB, {regs} registers"
                  f"{f', SPILLS {spills} bytes' if spills else ''}  ({time.perf_counter() - t0:.1f} s)")
        except Exception as e:  # report and continue: the point is to see every failure
            failures += 1
            print(f"ERR {label}: {type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}")
    print(f"{len(jobs) - failures - skipped}/{len(jobs)} compiled within limits"
          + (f"; {skipped} optional variants (autotuner candidates, large block-mask tiles) too big for "
             f"sm_{args.arch}" if skipped else "")
          + f"; {spilled} spill registers to local memory")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
