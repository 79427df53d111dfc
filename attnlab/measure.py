"""Measure on this machine by running the real function: wall time, peak allocated memory, what fits a budget.

Everything here runs the real function and reads the real allocator:

* on a CUDA device, :func:`peak_memory` uses ``torch.cuda.max_memory_allocated``;
* on the CPU it records every allocation and free that PyTorch's allocator
  makes during the call (``torch.profiler`` with ``profile_memory=True``) and
  returns the highest running total. This counts tensors PyTorch allocates,
  not Python objects or the allocator's cached-but-free pages. The profiler
  sees only the thread that started it, so the call runs with one torch
  thread: code that spreads its work over threads when torch has several
  (``attnlab.tiled`` runs its blocks on a thread pool) then runs it all on
  the measured thread, and its tiles are counted.

Used by lesson 05 (time and memory against n, C13/C14) and lesson 08 (the
longest sequence that fits in a memory budget, C18 scaled down).

Example::

    rows = scaling_sweep({"naive": lambda q, k, v: naive_attention(q, k, v)[0]}, [256, 512])
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
import warnings

import torch

from attnlab import validate
# format_bytes lives with the byte counts (attnlab.memory) and is re-exported here, where the
# lessons have always imported it; this module imports memory and never the other way round
from attnlab.memory import format_bytes, trace_ops

__all__ = ["peak_memory", "time_call", "random_qkv", "scaling_sweep", "longest_sequence", "format_bytes"]


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence what native code writes to file descriptor 2 (the profiler's start/stop lines)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real fd 2 (some embedded interpreters)
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _device(device):
    return torch.device(device) if device is not None else torch.device("cpu")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(fn, *args, device=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` once; return ``(result, peak_bytes)``.

    ``peak_bytes`` is the largest amount of tensor memory allocated *during the
    call* on ``device`` (default CPU) above what was allocated before it:
    tensors made inside ``fn`` (its intermediates and output) count; tensors
    passed in do not. To count the inputs too, create them inside ``fn``.
    On the CPU ``fn`` runs with ``torch.set_num_threads(1)`` (restored after):
    the profiler records the allocations of this thread only.

    Example: ``out, peak = peak_memory(torch.matmul, a, b)``
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    dev = _device(device)
    gc.collect()
    if dev.type == "cuda":
        _sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        result = fn(*args, **kwargs)
        _sync(dev)
        return result, int(torch.cuda.max_memory_allocated(dev) - base)
    if dev.type != "cpu":
        raise ValueError(f"device: peak memory is measured on 'cpu' or 'cuda', got {dev.type!r}")
    from torch.profiler import ProfilerActivity, profile
    from torch._C._profiler import _EventType

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # everything on the profiled thread (see the module docstring)
    try:
        with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            fields = e.extra_fields
            if fields.device.type == "cpu":
                events.append((e.start_time_ns, fields.alloc_size))  # > 0 allocate, < 0 free
        stack.extend(e.children)
    events.sort()
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    return result, int(peak)


def time_call(fn, *args, repeats=3, warmup=1, device=None, reduce="median", **kwargs):
    """Wall-clock seconds of ``fn(*args, **kwargs)``: the median (or ``reduce="min"``) of ``repeats`` runs after ``warmup``.

    Synchronises CUDA around each run so GPU time is counted. The minimum is the better
    estimate on a busy machine, where other work only ever adds time.

    Example: ``seconds = time_call(torch.matmul, a, b, repeats=5)``
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected an int >= 1, got {repeats!r}")
    if reduce not in ("median", "min"):
        raise ValueError(f"reduce: expected 'median' or 'min', got {reduce!r}")
    dev = _device(device)
    for _ in range(warmup):
        fn(*args, **kwargs)
    times = []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return min(times) if reduce == "min" else statistics.median(times)


def random_qkv(n, d=64, batch=1, heads=1, device=None, dtype=torch.float32, seed=0):
    """Seeded random ``q, k, v``, each ``(batch, heads, n, d)``, made on the CPU and moved to ``device``.

    Example: ``q, k, v = random_qkv(512, 64)``
    """
    g = torch.Generator().manual_seed(int(seed))
    shape = (batch, heads, n, d)
    return tuple(torch.randn(shape, generator=g, dtype=dtype).to(_device(device)) for _ in range(3))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def scaling_sweep(methods, ns, d=64, batch=1, heads=1, device=None, dtype=torch.float32, repeats=3, seed=0):
    """Time and peak memory of each attention method at each sequence length.

    ``methods``: ``{name: fn(q, k, v) -> out or (out, ...)}``; ``ns``: sequence
    lengths. Returns a list of rows ``{"method", "n", "seconds", "peak_bytes"}``
    where ``peak_bytes`` is the memory allocated during the call beyond its
    inputs (:func:`peak_memory`) and ``seconds`` the fastest of ``repeats`` runs
    (the least disturbed by whatever else the machine is doing).

    Example: ``scaling_sweep({"sdpa": torch.nn.functional.scaled_dot_product_attention}, [256, 512])``
    """
    if not isinstance(methods, dict):
        raise TypeError(f"methods: expected a dict {{name: fn(q, k, v)}}, got {type(methods).__name__}")
    if not methods:
        raise ValueError("methods: expected at least one method, got an empty dict")
    for name, fn in methods.items():
        if not callable(fn):
            raise TypeError(f"methods: expected a callable for {name!r}, got {type(fn).__name__}")
    dev = _device(device)
    rows = []
    for n in ns:
        q, k, v = random_qkv(n, d, batch, heads, dev, dtype, seed)
        for name, fn in methods.items():
            call = lambda: _first(fn(q, k, v))  # noqa: E731
            _, peak = peak_memory(call, device=dev)
            seconds = time_call(call, repeats=repeats, device=dev, reduce="min")
            rows.append({"method": name, "n": int(n), "seconds": seconds, "peak_bytes": peak})
        del q, k, v
    return rows


def longest_sequence(fn, budget_bytes, d=64, batch=1, heads=1, device=None, dtype=torch.float32,
                     step=64, n_start=64, n_max=16384, seed=0):
    """The longest sequence length (a multiple of ``step``) whose measured peak memory fits ``budget_bytes``.

    The footprint counted is everything the call allocates *including* its
    inputs ``q, k, v`` (made inside the measured call), measured with
    :func:`peak_memory`. Searches by doubling from ``n_start`` and then
    bisecting, measuring each probe for real; stops at ``n_max``. Returns
    ``{"n": longest that fits (None if n_start does not), "peak_bytes": its
    peak, "n_over": the shortest measured length that did not fit (None if
    n_max fits), "peak_over": its peak, "probes": [(n, peak_bytes), ...]}``.

    Example: ``longest_sequence(lambda q, k, v: naive_attention(q, k, v)[0], 16 * 2**20)``
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    for name, value in (("budget_bytes", budget_bytes), ("step", step), ("n_start", n_start), ("n_max", n_max)):
        validate.integer(value, name)
    for name, value in (("n_start", n_start), ("n_max", n_max)):
        if value % step:
            raise ValueError(f"{name}: expected a multiple of step={step}, got {value}")
    dev = _device(device)
    probes = {}

    def measure(n):
        if n not in probes:
            def call():
                q, k, v = random_qkv(n, d, batch, heads, dev, dtype, seed)
                return _first(fn(q, k, v))

            _, peak = peak_memory(call, device=dev)
            probes[n] = peak
        return probes[n]

    if measure(n_start) > budget_bytes:
        return {"n": None, "peak_bytes": None, "n_over": n_start, "peak_over": probes[n_start],
                "probes": sorted(probes.items())}
    lo, hi = n_start, None
    while hi is None:  # doubling: lo fits
        nxt = min(lo * 2, n_max)
        if measure(nxt) <= budget_bytes:
            if nxt == n_max:
                return {"n": n_max, "peak_bytes": probes[n_max], "n_over": None, "peak_over": None,
                        "probes": sorted(probes.items())}
            lo = nxt
        else:
            hi = nxt
    while hi - lo > step:  # bisection on multiples of step: lo fits, hi does not
        mid = ((lo + hi) // 2) // step * step
        if mid in (lo, hi):
            break
        if measure(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid
    return {"n": lo, "peak_bytes": probes[lo], "n_over": hi, "peak_over": probes[hi],
            "probes": sorted(probes.items())}


def op_traffic(fn, *args, **kwargs):
    """Deprecated alias of :func:`attnlab.memory.trace_ops` (it traces bytes, and this module
    times): the old name works until after attnlab 0.2, with a ``DeprecationWarning``."""
    warnings.warn("attnlab.measure.op_traffic is deprecated and will be removed after attnlab 0.2; "
                  "use attnlab.memory.trace_ops", DeprecationWarning, stacklevel=2)
    return trace_ops(fn, *args, **kwargs)
