"""Timings of the Triton kernels in the CPU interpreter (what a lesson waits for).

Usage: python benchmarks/interpreter_attention.py [--repeats 3]
Each cell: the best of --repeats calls, one head, d = 64, float32, interpreter block sizes.
The interpreter pays a fixed cost per operation per program, so time tracks the number of
(program, block) steps, not the FLOPs.
"""

import argparse
import platform
import time

import torch
import torch.nn.functional as F

import triton
from attnlab.kernels import block_sparse_attention, flash_attention, local_mask, standard_attention


def best(fn, repeats):
    fn()  # warm-up: rewrites the kernel's AST once
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512, 1024])
    args = ap.parse_args()
    d = 64
    print(f"CPU interpreter, {platform.processor() or platform.machine()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'N':>5} {'flash fwd':>10} {'flash causal':>13} {'flash fwd+bwd':>14} {'standard fwd':>13} "
          f"{'sparse local':>13} {'torch SDPA':>11}   (seconds)")
    for n in args.sizes:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, n, d, generator=g) for _ in range(3))
        mask = local_mask(n, n, 64, (64, 64))

        def fwd_bwd():
            qq = q.clone().requires_grad_()
            flash_attention(qq, k, v).sum().backward()

        row = [
            best(lambda: flash_attention(q, k, v), args.repeats),
            best(lambda: flash_attention(q, k, v, causal=True), args.repeats),
            best(fwd_bwd, args.repeats),
            best(lambda: standard_attention(q, k, v), args.repeats),
            best(lambda: block_sparse_attention(q, k, v, mask), args.repeats),
            best(lambda: F.scaled_dot_product_attention(q, k, v), args.repeats),
        ]
        print(f"{n:>5} {row[0]:>10.3f} {row[1]:>13.3f} {row[2]:>14.3f} {row[3]:>13.3f} {row[4]:>13.3f} {row[5]:>11.4f}")


if __name__ == "__main__":
    main()
