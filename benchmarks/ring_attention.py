"""Bytes per rank and time against world size: ring attention (contiguous, zigzag) and Ulysses all-to-all.

For each world size P the same computation (attention over ``n`` positions, forward + backward) is sharded
over P processes joined in one torch.distributed group: gloo on this CPU, NCCL on GPUs. Each row gives the
bytes one rank sent (measured by the Trace, beside ``attnlab.iomodel``'s formula), the time of the step
(the slowest rank's span, after a warm-up, between barriers), and the slowest and fastest ranks' compute and
the largest time a rank spent waiting for a transfer (communication the compute did not hide).

Usage:
    python benchmarks/ring_attention.py                     # world sizes 1, 2, 3, 4 on this machine's CPU
    python benchmarks/ring_attention.py --quick             # small, world sizes 1 and 2
    torchrun --nproc-per-node 4 benchmarks/ring_attention.py    # one world size, the one torchrun started
Options: --n, --heads, --head-dim, --causal, --attn plain|flash|tiled, --world-sizes 1,2,4.
On a shared machine the times are noisy (the load average is printed); the bytes are exact.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from attnlab import iomodel
from attnlab.distributed import experiments, init_from_env, launch


def rows_for(results, args, world):
    """Table rows from every rank's ``profile_methods`` result (a list, one dict per rank)."""
    rows = []
    for method in results[0]:
        ranks = [r[method] for r in results]
        span = max(p["t1"] for p in ranks) - min(p["t0"] for p in ranks)
        sent = ranks[0]["forward"]["bytes_sent"] + ranks[0]["backward"]["bytes_sent"]
        if method.startswith("ring"):
            formula = sum(iomodel.ring_attention_bytes(1, args.heads, args.n, args.head_dim, world, 4, backward=b)
                          for b in (False, True))
        else:
            formula = 2 * iomodel.ulysses_attention_bytes(1, args.heads, args.n, args.head_dim, world, 4)
        same = all(p["forward"]["bytes_sent"] + p["backward"]["bytes_sent"] == sent for p in ranks)
        compute = [p["forward"]["compute_s"] + p["backward"]["compute_s"] for p in ranks]
        wait = [p["forward"]["wait_s"] + p["backward"]["wait_s"] for p in ranks]
        rows.append((world, method, sent if same else "differs", formula, span, max(compute), min(compute), max(wait)))
    return rows


def print_table(rows, args, backend):
    print(f"attention over n = {args.n}, {args.heads} heads, head_dim {args.head_dim}, float32, "
          f"{'causal' if args.causal else 'no mask'}, forward + backward; per-shard attention: {args.attn}; "
          f"backend {backend}")
    print("| P | method | bytes sent per rank | iomodel formula | step time (s) | compute, slowest rank (s) "
          "| compute, fastest rank (s) | most waiting, one rank (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for world, method, sent, formula, span, cmax, cmin, wmax in rows:
        sent_s = f"{sent:,}" if isinstance(sent, int) else sent
        print(f"| {world} | {method} | {sent_s} | {formula:,} | {span:.3f} | {cmax:.3f} | {cmin:.3f} | {wmax:.3f} |")
    if hasattr(os, "getloadavg"):
        print(f"\nLoad average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--attn", default=None, choices=("plain", "flash", "tiled"))
    parser.add_argument("--world-sizes", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    args.n = args.n or (96 if args.quick else 2016)   # multiples of 24: 2P equal zigzag chunks for P = 1..4
    profile = dict(n=args.n, heads=args.heads, d=args.head_dim, causal=args.causal)
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ and not dist.is_initialized():   # started by torchrun
        rank, world = init_from_env()
        args.attn = args.attn or ("flash" if torch.cuda.is_available() else "plain")
        mine = experiments.profile_methods(attn=args.attn, **profile)
        results = [None] * world
        dist.all_gather_object(results, mine)
        if rank == 0:
            print_table(rows_for(results, args, world), args, dist.get_backend())
        dist.destroy_process_group()
        return
    args.attn = args.attn or ("flash" if torch.cuda.is_available() else "plain")
    worlds = [int(w) for w in args.world_sizes.split(",")] if args.world_sizes else ([1, 2] if args.quick else [1, 2, 3, 4])
    if torch.cuda.is_available() and torch.cuda.device_count() < max(worlds):
        sys.exit(f"--world-sizes: {max(worlds)} ranks need as many GPUs, this machine has {torch.cuda.device_count()}")
    rows = []
    for world in worlds:
        rows += rows_for(launch(experiments.profile_methods, world, kwargs=dict(attn=args.attn, **profile)), args, world)
    print_table(rows, args, "nccl" if torch.cuda.is_available() else "gloo")


if __name__ == "__main__":
    main()
