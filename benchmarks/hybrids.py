"""Hybrid layouts trained longer than lesson 12 can afford: does the 150-step ranking hold?

Lesson 12 runs ``attnlab.hybrids.compare_layouts()`` live (4 layouts x 3 seeds x 150 steps,
about 35 s on one CPU core). At 150 steps the tiny model is still learning its first
statistics, so the ranking there says how fast each layout *starts*. This script runs the same
comparison (same recipe, same seeds, same batches) at several step counts and writes one table
per count, with the wall time and the machine's load average (the machine may be shared).

Usage: ``python benchmarks/hybrids.py`` (150 and 600 steps) or ``--steps 150 300 1200``;
``--out FILE`` writes the markdown there too (default: print only).
"""

import argparse
import os
import platform
import time

import torch

from attnlab.data.stdlib_text import load_corpus
from attnlab.hybrids import LAYOUTS, RECIPE, compare_layouts


def table(rows, steps, seconds):
    lines = [f"### {steps} steps ({seconds:.0f} s for {len(rows)} layouts x {len(rows[0]['val_loss'])} seeds)", "",
             f"| layout | kinds | validation loss (mean +- std) | per seed | kept @ {rows[0]['context']} (B) "
             "| kept per token (B) | read per decoding step (B) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        seeds = ", ".join(f"{v:.3f}" for v in r["val_loss"])
        lines.append(f"| {r['name']} | {' '.join(r['layout'])} | {r['mean']:.3f} +- {r['std']:.3f} | {seeds} "
                     f"| {r['held_bytes']:,} | {r['held_bytes_per_token']:.1f} | {r['decode_bytes_per_token']:,} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[RECIPE["steps"], 600])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    corpus = load_corpus()
    command = f"python benchmarks/hybrids.py --steps {' '.join(map(str, args.steps))}"
    parts = [f"# Hybrid layouts, trained longer (`{command}`)",
             "", f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, one thread per run. Recipe: `attnlab.hybrids.RECIPE` "
             f"({RECIPE['model']}), layouts `attnlab.hybrids.LAYOUTS`, seeds 0, 1, 2.", ""]
    for steps in args.steps:
        t0 = time.perf_counter()
        rows = compare_layouts(LAYOUTS, steps=steps, corpus=corpus)
        seconds = time.perf_counter() - t0
        parts += [table(rows, steps, seconds), "", f"Load average after the run: {os.getloadavg()[0]:.2f}", ""]
        print("\n".join(parts[-4:]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(parts))


if __name__ == "__main__":
    main()
