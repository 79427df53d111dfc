"""Time and peak extra memory of naive attention, torch's SDPA and attnlab's tiled_attention on the CPU.

For N in {1024, 4096, 16384}, head_dim 64, 4 heads, batch 1, fp32 (forward pass only), each
(method, N) runs in its own fresh Python process, so no configuration inherits another's allocator
state, caches or peak memory.

How memory is measured (and why this way). torch allocates large CPU tensors straight from the
operating system, outside Python's allocator, so ``tracemalloc`` sees none of it. What we want is
the memory the attention call needs *beyond its inputs*: the n-by-n matrices for naive attention,
the tiles for the tiled version, and the output for all three. The child process therefore

1. runs the method once on a tiny N (to load libraries and start threads; tiny, so that no
   freed-but-kept memory is reused by the measured call unseen) and allocates q, k, v,
2. records its resident set size ``VmRSS`` (from ``/proc/self/status``) as the baseline,
3. resets the kernel's peak-RSS counter (writes ``5`` to ``/proc/self/clear_refs``; Linux >= 4.0),
4. runs the method once at full size, and
5. reports ``VmHWM - baseline``: the peak resident memory reached during the call, above the baseline.

This counts every page the call touched (torch's tensors, MKL workspaces, thread stacks), and
nothing it did not. Where ``clear_refs`` cannot be written, the script falls back to
``ru_maxrss`` after the call minus the baseline (an over-estimate if the warm-up peaked higher,
which at small warm-up sizes it does not) and says so in the table's notes.

Time is wall-clock time of one call (the median of up to 5 when a call takes under a second).
Threads: torch's default (all cores). The machine may be shared: the load average before and after
is printed with the table, and naive attention is skipped (and marked so) when the memory it needs
is not available.

Usage: ``python benchmarks/cpu_attention.py`` (full, about two minutes on 2 cores) or
``python benchmarks/cpu_attention.py --quick`` (small N, seconds). ``--causal`` times causal attention.
"""

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time

METHODS = ("naive", "sdpa", "tiled")
FULL_SIZES = (1024, 4096, 16384)
QUICK_SIZES = (128, 512)
HEADS, HEAD_DIM, BATCH = 4, 64, 1
MB = 1e6


def _status_kib(field):
    """A field of /proc/self/status in KiB (VmRSS: current resident set, VmHWM: its peak)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M).group(1).strip()
    except (OSError, AttributeError):
        return platform.processor() or platform.machine()


def _memory_available_bytes():
    with open("/proc/meminfo") as f:
        return int(re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def _child(method, n, causal):
    """Run one configuration in this (fresh) process; print one JSON line."""
    import torch
    import torch.nn.functional as F

    from attnlab.attention import naive_attention
    from attnlab.tiled import tiled_attention

    def call(q, k, v):
        if method == "naive":
            return naive_attention(q, k, v, causal=causal)[0]
        if method == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return tiled_attention(q, k, v, causal=causal)

    torch.manual_seed(0)
    with torch.no_grad():
        # warm-up: load libraries, start threads. Tiny on purpose: memory freed here may stay in
        # malloc's free lists and be reused by the measured call without raising its RSS
        small = [torch.randn(BATCH, HEADS, 32, HEAD_DIM) for _ in range(3)]
        call(*small)
        del small
        q, k, v = (torch.randn(BATCH, HEADS, n, HEAD_DIM) for _ in range(3))   # (B, H, N, D)
        baseline_kib = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                           # reset VmHWM (peak RSS) to the current RSS
            how = "VmHWM"
        except OSError:
            how = "ru_maxrss"
        t0 = time.perf_counter()
        out = call(q, k, v)
        times = [time.perf_counter() - t0]
        peak_kib = _status_kib("VmHWM") if how == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        del out
        while sum(times) < 1.0 and len(times) < 5:     # short calls: take the median of a few
            t0 = time.perf_counter()
            call(q, k, v)
            times.append(time.perf_counter() - t0)
    print(json.dumps({"method": method, "n": n, "time_s": statistics.median(times),
                      "extra_bytes": max(0, peak_kib - baseline_kib) * 1024, "how": how,
                      "threads": torch.get_num_threads(), "torch": torch.__version__}))


def _run_child(method, n, causal):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, str(n)] + (["--causal"] if causal else [])
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{method} at N={n} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"small sizes {QUICK_SIZES} (for tests)")
    parser.add_argument("--sizes", type=int, nargs="+", help=f"sequence lengths (default {FULL_SIZES})")
    parser.add_argument("--causal", action="store_true", help="causal attention (top-left)")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], int(args.child[1]), args.causal)
        return 0

    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    load_before = os.getloadavg()
    rows, notes = [], set()
    for n in sizes:
        naive = None
        for method in METHODS:
            if method == "naive":
                need = 2 * BATCH * HEADS * n * n * 4            # S and P in fp32
                avail = _memory_available_bytes()
                if need > 0.8 * avail:
                    rows.append((n, method, None, None, None, None))
                    notes.add(f"naive at N={n} skipped: needs {need / MB:.0f} MB, {avail / MB:.0f} MB available")
                    continue
            r = _run_child(method, n, args.causal)
            if r["how"] != "VmHWM":
                notes.add("peak memory from ru_maxrss (clear_refs unavailable): may over-estimate")
            threads, torch_version = r["threads"], r["torch"]
            if method == "naive":
                naive = r
            speed = naive["time_s"] / r["time_s"] if naive else None
            saving = naive["extra_bytes"] / r["extra_bytes"] if naive and r["extra_bytes"] else None
            rows.append((n, method, r["time_s"], r["extra_bytes"], speed, saving))
    load_after = os.getloadavg()

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    names = {"naive": "naive (S, P materialised)", "sdpa": "torch SDPA (C++)", "tiled": "attnlab tiled_attention"}
    print(f"CPU attention, forward, batch {BATCH}, {HEADS} heads, head_dim {HEAD_DIM}, fp32"
          f"{', causal' if args.causal else ''}; {_cpu_name()}, "
          f"{os.cpu_count()} cores, torch {torch_version} with {threads} threads")
    print()
    print("| N | method | time (s) | peak extra memory (MB) | speed-up vs naive | memory saving vs naive |")
    print("|---|---|---|---|---|---|")
    for n, method, t, b, speed, saving in rows:
        print(f"| {n} | {names[method]} | {fmt(t, '.4g')} | {fmt(None if b is None else b / MB, '.1f')} | "
              f"{fmt(speed, '.2f')}{'x' if speed else ''} | {fmt(saving, '.0f')}{'x' if saving else ''} |")
    print()
    print(f"Load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}.")
    for note in sorted(notes):
        print(f"Note: {note}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
