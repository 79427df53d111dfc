"""How the attention kernels are launched on a GPU: tile sizes, warps, stages, and the autotuner.

The kernels in ``flash_attention.py``, ``block_sparse_attention.py`` and
``standard_attention.py`` say *what* a program computes; this module says *how big* the
programs are. Keeping the two apart lets the kernel files read like Triton's tutorials.

* In Triton's interpreter (CPU tensors) the cost is per operation, not per element, so big
  blocks are cheap: :data:`INTERPRETER_BLOCKS`, no warps or stages.
* On a GPU, :func:`gpu_config` is the fixed default for a head dim, dtype and compute
  capability, chosen from ptxas's register and spill counts
  (``benchmarks/gpu_compile_check.py``); :func:`gpu_candidates` adds a few of the shapes
  Triton's fused-attention tutorial tries, and :func:`fixed_block_candidates` the warps and
  stages to try when the caller fixed the tiles.
* :func:`launch` picks the configuration for one kernel launch (timing the candidates on the
  first launch of each shape, as ``@triton.autotune`` does, unless ``ATTNLAB_AUTOTUNE=0``)
  and runs it, turning an out-of-shared-memory error into one that names the arguments.

Example::

    def run(config):                      # launches the kernel once with this configuration
        _attn_fwd_kernel[grid(config)](..., BLOCK_M=config["block_m"], **native_options(config))
    launch("fwd", run, q, n_q, n_k, causal, block_m=None, block_n=None)
"""

from __future__ import annotations

import os

import torch

from ._runtime import use_interpreter

__all__ = ["INTERPRETER_BLOCKS", "gpu_config", "gpu_candidates", "fixed_block_candidates", "default_block_sizes",
           "device_capability", "choose_config", "launch", "native_options", "autotune_enabled", "tuned_config",
           "tuning_log"]

# The interpreter pays a fixed cost per operation, not per element: big blocks are cheap.
INTERPRETER_BLOCKS = (128, 128)


def gpu_config(head_dim: int, dtype: torch.dtype, capability=(9, 0), backward: bool = False) -> dict:
    """Launch configuration on an NVIDIA GPU of compute ``capability``:
    {"block_m", "block_n", "num_warps", "num_stages"}. The fixed default: used with
    ``ATTNLAB_AUTOTUNE=0`` or explicit block sizes, and the autotuner's first candidate.
    Checked to compile within shared memory for sm_75, sm_80 and sm_90 by
    ``benchmarks/gpu_compile_check.py``."""
    if dtype == torch.float32:  # exact fp32 products (no tensor cores): small tiles, 8 warps, no spills
        bm, bn = (32, 32) if (backward or head_dim > 64) else (64, 32)
        warps = 8
    elif backward:  # 64 x 64 keeps both backward kernels on Hopper's wgmma (it needs 64-row tiles)
        bm, bn = 64, 64
        warps = 8 if head_dim >= 128 else 4
    else:
        bm, bn = 128, 64
        warps = 8 if head_dim >= 128 else 4
    stages = 2 if (backward or head_dim > 64) else 3
    if tuple(capability) < (8, 0):
        # Turing/Volta (a T4): 64 KiB of shared memory, no async copies, and Triton's mma.sync
        # code needs many registers there: these tiles are the ones ptxas compiles for sm_75
        # without spilling (or spilling least), checked by benchmarks/gpu_compile_check.py
        bm = 64 if (not backward and head_dim <= 64) else 32
        if backward and head_dim >= 128 and dtype == torch.float32:
            bm = 16
        bn, warps, stages = 32, 8, 1
    return {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}


def device_capability(device):
    """The CUDA compute capability of ``device``, or (9, 0) where there is none (compile checks, tests)."""
    try:
        return torch.cuda.get_device_capability(device)
    except Exception:  # no CUDA here (compile checks, tests): assume a recent GPU
        return (9, 0)


def default_block_sizes(head_dim: int, dtype: torch.dtype, device, backward: bool = False) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the fixed default on ``device`` (interpreter or GPU; on a GPU the
    autotuner may pick others, see :func:`gpu_candidates`)."""
    if use_interpreter(device):
        return INTERPRETER_BLOCKS
    cfg = gpu_config(head_dim, dtype, device_capability(device), backward)
    return cfg["block_m"], cfg["block_n"]


def gpu_candidates(head_dim: int, dtype: torch.dtype, capability=(9, 0), kernel: str = "fwd") -> list[dict]:
    """The configurations the autotuner times for ``kernel`` ("fwd", "dkdv" or "dq") on a GPU:
    :func:`gpu_config`'s default first, then a few of the shapes Triton's fused-attention
    tutorial tries. A candidate that does not fit a GPU's shared memory is skipped there."""
    default = gpu_config(head_dim, dtype, capability, backward=kernel != "fwd")

    def cfg(bm, bn, warps, stages):
        return {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}

    if tuple(capability) < (8, 0):
        extra = [cfg(32, 32, 8, 1), cfg(64, 32, 8, 1), cfg(32, 64, 8, 1)]
    elif dtype == torch.float32:
        extra = [cfg(64, 32, 8, 2), cfg(32, 64, 8, 2), cfg(32, 32, 4, 3)]
    elif kernel == "fwd":       # BLOCK_M queries per program, a loop over BLOCK_N keys
        extra = [cfg(128, 128, 8, 3), cfg(128, 64, 8, 3), cfg(128, 32, 4, 4), cfg(64, 64, 4, 4)]
    # all without register spills for head dims 64 and 128 on sm_90 (ptxas -v)
    elif kernel == "dkdv":      # BLOCK_N keys per program, a loop over BLOCK_M queries
        extra = [cfg(32, 128, 8, 3), cfg(64, 64, 8, 3),
                 cfg(64, 128, 8, 2) if head_dim <= 64 else cfg(32, 64, 4, 3)]
    else:                       # dq: BLOCK_M queries per program, a loop over BLOCK_N keys
        extra = [cfg(128, 32, 8, 3), cfg(128, 64, 8, 2), cfg(64, 64, 8, 2)]
    out = []
    for c in [default] + extra:
        if c not in out:
            out.append(c)
    return out


def _pow2(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def choose_config(kernel, q, n_q, n_k, causal, block_m, block_n, launch):
    """The launch configuration of ``kernel``: {"block_m", "block_n"}, plus num_warps and
    num_stages for a native launch. Block sizes the caller fixed are kept; otherwise the
    interpreter takes :data:`INTERPRETER_BLOCKS` and a GPU the autotuner's choice (or
    :func:`gpu_config` with ``ATTNLAB_AUTOTUNE=0``)."""
    if use_interpreter(q.device):
        bm, bn = INTERPRETER_BLOCKS if block_m is None else (block_m, block_n)
        return {"block_m": bm, "block_n": bn}
    d, cap = q.shape[-1], device_capability(q.device)
    if block_m is None:
        if autotune_enabled():
            key = (kernel, d, q.dtype, bool(causal), _pow2(n_q), _pow2(n_k), tuple(cap), str(q.device))
            return tuned_config(key, gpu_candidates(d, q.dtype, cap, kernel), launch)
        return gpu_config(d, q.dtype, cap, backward=kernel != "fwd")
    # block sizes fixed by the caller (or by a block mask): only warps and stages are free
    candidates = fixed_block_candidates(block_m, block_n, d, q.dtype, cap, backward=kernel != "fwd")
    if autotune_enabled():
        key = (kernel, d, q.dtype, bool(causal), _pow2(n_q), _pow2(n_k), tuple(cap), str(q.device), block_m, block_n)
        return tuned_config(key, candidates, launch)
    return candidates[0]


def fixed_block_candidates(block_m, block_n, head_dim, dtype, capability=(9, 0), backward=False) -> list[dict]:
    """Warps and stages to try when the block sizes are fixed (explicit ``block_m``/``block_n``,
    or a block mask's block size); the first is the default. Large tiles need 8 warps: at
    128 x 128 with 4 warps the backward kernels spill hundreds of bytes per thread (ptxas)."""
    big = block_m * block_n >= 128 * 64 or (head_dim >= 128 and block_m * block_n >= 64 * 64)
    first = 8 if big or dtype == torch.float32 or tuple(capability) < (8, 0) else 4  # sm_75: see gpu_config
    other = 4 if first == 8 else 8
    if tuple(capability) < (8, 0):  # no async copies: one stage
        pairs = [(first, 1), (other, 1)]
    else:
        stages = 2 if backward or head_dim > 64 else 3
        pairs = [(first, stages), (first, 5 - stages), (other, 2), (other, 3)]
    return [{"block_m": block_m, "block_n": block_n, "num_warps": w, "num_stages": st} for w, st in pairs]


def native_options(config):
    """The keyword arguments a native launch takes from ``config`` (the interpreter takes none)."""
    return {k: config[k] for k in ("num_warps", "num_stages") if k in config}


_KERNEL_NAMES = {"fwd": "forward", "dkdv": "dK/dV", "dq": "dQ"}


def _launch_checked(kernel, launch, config, q):
    """``launch(config)``, turning Triton's out-of-shared-memory error into one that names the
    arguments to change (the tiles are fixed by block_m/block_n or by a block mask)."""
    from triton.runtime.errors import OutOfResources

    try:
        launch(config)
    except OutOfResources as exc:
        raise ValueError(
            f"the {kernel} kernel with {config['block_m']} x {config['block_n']} tiles, head_dim {q.shape[-1]} "
            f"and {q.dtype} needs more {exc.name} than this GPU has ({exc.required} > {exc.limit}): pass "
            f"smaller block_m/block_n, or build the block mask with smaller blocks, or use float16"
        ) from exc


def launch(kernel, run, q, n_q, n_k, causal, block_m=None, block_n=None):
    """Launch ``kernel`` ("fwd", "dkdv" or "dq") through ``run(config)`` with the configuration
    :func:`choose_config` picks for these inputs; errors name the arguments to change."""
    config = choose_config(kernel, q, n_q, n_k, causal, block_m, block_n, run)
    _launch_checked(_KERNEL_NAMES[kernel], run, config, q)


# ---------------------------------------------------------------------------------------
# Choosing a launch configuration on a GPU
# ---------------------------------------------------------------------------------------
# Like ``@triton.autotune`` in Triton's tutorials: the first launch for a key (kernel, head dim,
# dtype, lengths rounded up to a power of two, ...) times a few candidate configurations and
# every later launch with that key uses the fastest. attnlab does it in the wrappers rather
# than with the decorator because the same kernels also take explicit block sizes (the
# lessons choose them to show their effect on traffic) and run in the interpreter.
_tuned: dict = {}
_tuning_log: list = []


def autotune_enabled() -> bool:
    """On unless ``ATTNLAB_AUTOTUNE=0``: then the wrappers use their fixed default configuration."""
    return os.environ.get("ATTNLAB_AUTOTUNE", "1").lower() not in ("0", "false", "no", "off")


def tuned_config(key, candidates, launch, bench=None):
    """The fastest of ``candidates`` (dicts) for ``key``, timed once per process.

    ``launch(config)`` runs the kernel once with that configuration and must be safe to
    repeat (the kernels only overwrite their outputs). A candidate that fails (a
    configuration that does not fit the GPU's shared memory raises ``OutOfResources``) is
    skipped; if all fail, the first candidate is returned and its error will surface at
    the real launch. ``bench(fn) -> ms`` defaults to ``triton.testing.do_bench``.
    """
    if key in _tuned:
        return _tuned[key]
    if bench is None:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=5, rep=20)

    timings = []
    for i, config in enumerate(candidates):
        try:
            ms = bench(lambda: launch(config))
        except Exception as exc:  # noqa: BLE001 - any failure rules this configuration out
            timings.append((float("inf"), i, config, f"{type(exc).__name__}"))
            continue
        timings.append((ms, i, config, None))
    ok = [t for t in timings if t[3] is None]
    best = min(ok)[2] if ok else candidates[0]
    _tuned[key] = best
    _tuning_log.append({"key": key, "best": best, "timings": [(c, ms, err) for ms, _, c, err in timings]})
    return best


def tuning_log():
    """What the autotuner timed so far: a list of {"key", "best", "timings": [(config, ms, error)]}."""
    return list(_tuning_log)
