"""GPT-2 medium attention: HBM traffic of standard attention vs FlashAttention, traced from the kernels.

Usage: python benchmarks/gpt2_traffic.py [--batch 64] [--heads 16]
Compare with Dao et al. 2022, Fig. 2 (40.3 GB vs 4.4 GB). Runs on the CPU (Triton interpreter).
"""

import argparse
import time

import torch

from attnlab.traffic import format_comparison, gpt2_medium_comparison


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = gpt2_medium_comparison(seq=args.seq, batch=args.batch, heads=args.heads, dtype=getattr(torch, args.dtype))
    print(format_comparison(res))
    for r in res["rows"]:
        assert r["traced_bytes"] == r["model_bytes"], r
    print(f"(traced bytes equal attnlab.iomodel's prediction; {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
