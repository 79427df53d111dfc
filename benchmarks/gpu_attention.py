"""GPU benchmark of the course's Triton attention kernels against PyTorch SDPA's flash backend.

Usage: python benchmarks/gpu_attention.py [--quick]

Prints TFLOP/s for the forward and for forward plus backward, causal and not, fp16,
head dim 64 and 128, sequence length 1k to 16k (batch x seq = 16k tokens, heads x d = 2048,
as in the FlashAttention-2 paper's benchmarks), then block-sparse against dense at densities
1, 0.5, 0.25 and 0.1. Needs a CUDA GPU; without one it says so and exits with status 2.

FLOPs: forward 4 * B * H * N^2 * d (halved when causal), backward 2.5x the forward (the
convention of the FlashAttention papers), block-sparse counted as the dense FLOPs scaled by
the density (the work actually needed).

Our kernels run as a learner gets them: autotuned at the first call of each shape (the table
ends with what the autotuner timed and chose), unless ATTNLAB_AUTOTUNE=0 is set, which takes
the fixed gpu_config instead. Timings are triton.testing.do_bench's (L2 flushed between
runs), after a warm-up call that compiles and tunes.
"""

import argparse
import sys

import torch


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer sizes (1k, 4k) for a short check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu_attention.py needs a CUDA GPU (torch.cuda.is_available() is False). "
              "On the CPU, run benchmarks/interpreter_attention.py instead.")
        return 2

    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from attnlab.kernels import block_sparse_attention, flash_attention, random_mask
    from attnlab.kernels.block_mask import BlockMask

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    print(f"{name}; torch {torch.__version__}; triton {triton.__version__}; CUDA {torch.version.cuda}")
    dtype = torch.float16
    sizes = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384]

    def inputs(n, d, grad):
        b, h = max(16384 // n, 1), 2048 // d
        g = torch.Generator(device=dev).manual_seed(0)
        return [torch.randn(b, h, n, d, device=dev, dtype=dtype, generator=g).requires_grad_(grad) for _ in range(3)]

    def sdpa(q, k, v, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def bench_pair(fn, q, k, v, causal):
        """(forward ms, forward+backward ms)."""
        fwd = do_bench(lambda: fn(q, k, v, causal))
        do = torch.randn_like(q)

        def fb():
            o = fn(q, k, v, causal)
            o.backward(do)

        fwdbwd = do_bench(fb, grad_to_none=[q, k, v])
        return fwd, fwdbwd

    print("\nDense attention, TFLOP/s (ours / SDPA flash backend = ratio)")
    print(f"{'d':>4} {'N':>6} {'causal':>6} | {'fwd ours':>9} {'fwd sdpa':>9} {'ratio':>6} | "
          f"{'f+b ours':>9} {'f+b sdpa':>9} {'ratio':>6}")
    for d in (64, 128):
        for n in sizes:
            for causal in (False, True):
                q, k, v = inputs(n, d, True)
                b, h = q.shape[:2]
                flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                ours = bench_pair(lambda a, b_, c, cz: flash_attention(a, b_, c, causal=cz), q, k, v, causal)
                ref = bench_pair(sdpa, q, k, v, causal)
                # correctness spot check on the same inputs
                with torch.no_grad():
                    err = (flash_attention(q, k, v, causal=causal) - sdpa(q, k, v, causal)).abs().max().item()
                f_o, f_r = tflops(flops, ours[0]), tflops(flops, ref[0])
                fb_o, fb_r = tflops(3.5 * flops, ours[1]), tflops(3.5 * flops, ref[1])
                print(f"{d:>4} {n:>6} {str(causal):>6} | {f_o:>9.1f} {f_r:>9.1f} {f_o / f_r:>6.2f} | "
                      f"{fb_o:>9.1f} {fb_r:>9.1f} {fb_o / fb_r:>6.2f}   max|diff| {err:.1e}")
                del q, k, v
                torch.cuda.empty_cache()

    print("\nBlock-sparse (random tiles, 128 x 128 blocks) vs our dense kernel, fp16, d=64, forward")
    print(f"{'N':>6} {'density':>8} | {'ms sparse':>10} {'ms dense':>9} {'speedup':>8} | {'f+b sparse':>11} {'f+b dense':>10} {'speedup':>8}")
    bs = (128, 128)
    for n in ([4096, 16384] if not args.quick else [4096]):
        q, k, v = inputs(n, 64, True)
        b, h = q.shape[:2]
        dense = bench_pair(lambda a, b_, c, cz: flash_attention(a, b_, c, block_m=bs[0], block_n=bs[1]), q, k, v, False)
        for density in (1.0, 0.5, 0.25, 0.1):
            mask = random_mask(n, n, density, bs, seed=0, batch=1, heads=h)
            m = mask.mask.clone()
            m[..., torch.arange(m.shape[-2]), torch.arange(m.shape[-1])] = True  # keep the diagonal: no empty rows
            mask = BlockMask(m.to(dev), bs)
            sp = bench_pair(lambda a, b_, c, cz: block_sparse_attention(a, b_, c, mask), q, k, v, False)
            print(f"{n:>6} {mask.density:>8.2f} | {sp[0]:>10.3f} {dense[0]:>9.3f} {dense[0] / sp[0]:>8.2f} | "
                  f"{sp[1]:>11.3f} {dense[1]:>10.3f} {dense[1] / sp[1]:>8.2f}")
        del q, k, v
        torch.cuda.empty_cache()

    from attnlab.kernels._tuning import tuning_log

    print("\nAutotuner choices (dense kernels; each candidate's ms per launch, * = chosen; "
          "blocks m x n / warps / stages)")
    for entry in tuning_log():
        kind, d, dt, causal, n_q, n_k = entry["key"][:6]
        cells = []
        for cfg, ms, err in entry["timings"]:
            label = f"{cfg['block_m']}x{cfg['block_n']}/{cfg['num_warps']}/{cfg['num_stages']}"
            mark = "*" if cfg == entry["best"] else ""
            cells.append(f"{mark}{label} {'failed: ' + err if err else f'{ms:.3f}'}")
        print(f"{kind:>4} d={d:<3} causal={str(causal):<5} N<={n_q:<5} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
