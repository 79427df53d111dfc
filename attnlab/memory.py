"""Trace the bytes a computation really moves, by watching it run: Triton kernels and PyTorch ops.

``trace(fn, *args, **kwargs)`` runs ``fn`` (one kernel launch, a wrapper that launches
several, or a forward plus backward) with every attnlab kernel in Triton's interpreter,
and records each ``tl.load`` and ``tl.store`` of each program: which kernel parameter it
touched, how many bytes moved (masked-off elements do not count), and which block of the
tensor. Example::

    from attnlab.memory import trace
    from attnlab.kernels import flash_attention
    t = trace(flash_attention, q, k, v)
    print(t)                      # bytes read and written, per tensor and per launch
    t.by_tensor["K"]              # {"read": ..., "written": ...}
    t.events_for((0, 0, 0))       # what program (0, 0, 0) loaded and stored, in order

``trace_ops(fn, *args)`` does the same for plain PyTorch code, one row per ATen operator: the
bytes each op reads and writes when every op is its own kernel (eager PyTorch, unfused).

What it counts, and what it does not: the bytes that *programs* load from and store to
global memory (HBM on a GPU). A GPU's L2 cache can absorb repeated reads of the same tile
by different programs, so a profiler's DRAM counter may show less than ``bytes_read``;
``unique_bytes_read`` (each byte counted once, however often it was read) is the lower
bound beside it. Both numbers are what :mod:`attnlab.iomodel` predicts.

The tensors are named by the kernel's parameter names (``Q``, ``K``, ``V``, ``O``, ``L``,
``S``, ``P``, ...). When one parameter name is used by several launches, its bytes add up
under that name and ``tensors[name]`` describes the first tensor seen under it.

How: :mod:`attnlab._interp_hooks` wraps the interpreter's load/store builder calls and its
launcher (the only place that touches Triton internals; supported Triton: 3.8.x, any other
version fails with a clear message). Kernels decorated with plain ``triton.jit`` are traced
too when ``TRITON_INTERPRET=1`` was set before they were decorated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from attnlab import _interp_hooks

__all__ = ["trace", "trace_ops", "MemoryTrace", "MemoryEvent", "TensorInfo", "format_bytes"]


def format_bytes(n):
    """``1536`` -> ``'1.5 KiB'``: bytes in binary units, for tables."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"



@dataclass(frozen=True)
class MemoryEvent:
    """One ``tl.load`` or ``tl.store`` of one program.

    launch: index of the kernel launch in ``MemoryTrace.launches``; program: the program ids
    (x, y, z); op: "load" or "store"; tensor: the kernel parameter's name; nbytes: bytes moved
    (masked-off elements excluded); lead: index over the tensor's leading dims flattened (e.g.
    batch * heads + head); rows, cols: (start, stop) bounding box of the elements in the
    tensor's last two dims (a 1-D tensor has rows (0, 1)).
    """

    launch: int
    program: tuple
    op: str
    tensor: str
    nbytes: int
    lead: int
    rows: tuple
    cols: tuple


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple
    dtype: torch.dtype
    element_size: int


@dataclass
class MemoryTrace:
    """The loads and stores recorded by :func:`trace`. All byte counts are ints."""

    events: list = field(default_factory=list)
    launches: list = field(default_factory=list)
    tensors: dict = field(default_factory=dict)
    unique_bytes_read: int = 0
    unique_bytes_written: int = 0
    result: object = None

    @property
    def bytes_read(self) -> int:
        return sum(e.nbytes for e in self.events if e.op == "load")

    @property
    def bytes_written(self) -> int:
        return sum(e.nbytes for e in self.events if e.op == "store")

    @property
    def total_bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def by_tensor(self) -> dict:
        """{name: {"read": bytes, "written": bytes}} in order of first use."""
        out = {}
        for e in self.events:
            d = out.setdefault(e.tensor, {"read": 0, "written": 0})
            d["read" if e.op == "load" else "written"] += e.nbytes
        return out

    def by_launch(self) -> list:
        """[{"launch": i, "kernel": name, "read": bytes, "written": bytes}] in launch order."""
        out = [{"launch": i, "kernel": n, "read": 0, "written": 0} for i, n in enumerate(self.launches)]
        for e in self.events:
            out[e.launch]["read" if e.op == "load" else "written"] += e.nbytes
        return out

    def programs(self, launch: int | None = None) -> list:
        """The program-id tuples that moved memory, in order of first appearance (of one launch, or all)."""
        seen = {}
        for e in self.events:
            if launch is None or e.launch == launch:
                seen.setdefault(e.program, None)
        return list(seen)

    def events_for(self, program: tuple, launch: int | None = None) -> list:
        """The events of one program, in program order (of one launch, or of every launch)."""
        program = tuple(program)
        n = len(program)
        return [e for e in self.events
                if e.program[:n] == program and all(p == 0 for p in e.program[n:])
                and (launch is None or e.launch == launch)]

    def __repr__(self):
        lines = [
            f"MemoryTrace: {len(self.launches)} launch(es) {self.launches}, {len(self.events)} loads/stores",
            f"  read {format_bytes(self.bytes_read)}, written {format_bytes(self.bytes_written)}, total {format_bytes(self.total_bytes)}"
            f" (unique: read {format_bytes(self.unique_bytes_read)}, written {format_bytes(self.unique_bytes_written)})",
        ]
        for name, d in self.by_tensor.items():
            lines.append(f"  {name:>6}: read {format_bytes(d['read']):>10}  written {format_bytes(d['written']):>10}")
        return "\n".join(lines)


class _Recorder:
    def __init__(self):
        self.trace = MemoryTrace()
        self._ranges = []       # per current launch: (name, start, stop, elem size, shape, strides, key)
        self._touched = {}      # (start address, extent, elem size) -> {"load": bool array, "store": bool array}

    def on_launch(self, info):
        self.trace.launches.append(info.name)
        ranges = []
        for name, t in info.tensors:
            es = t.element_size()
            if t.numel() == 0:
                continue
            extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
            start = t.data_ptr()
            key = (start, extent, es)
            ranges.append((name, start, start + extent * es, es, tuple(t.shape), tuple(t.stride()), key))
            if name not in self.trace.tensors:
                self.trace.tensors[name] = TensorInfo(tuple(t.shape), t.dtype, es)
            if key not in self._touched:
                self._touched[key] = {"load": np.zeros(extent, bool), "store": np.zeros(extent, bool)}
        self._ranges = ranges

    def on_access(self, info, program, op, ptrs, mask, element_size):
        ptrs = np.asarray(ptrs)
        mask = np.broadcast_to(np.asarray(mask, dtype=bool), ptrs.shape)
        live = ptrs[mask].astype(np.int64) if ptrs.ndim else (ptrs.reshape(1)[mask.reshape(1)]).astype(np.int64)
        if live.size == 0:
            return  # everything masked off: no traffic
        lo, hi = int(live.min()), int(live.max())
        for name, start, stop, es, shape, strides, key in self._ranges:
            if start <= lo < stop:
                break
        else:
            raise RuntimeError(f"a {op} in kernel {info.name} touched address {lo:#x}, outside every tensor argument")
        if hi >= stop:
            raise RuntimeError(f"a {op} in kernel {info.name} ran past the end of tensor {name}")
        offs = (live - start) // es
        self._touched[key][op][offs] = True
        # unravel element offsets into indices, outermost stride first
        idx = {}
        rest = offs.copy()
        for dim in sorted(range(len(shape)), key=lambda d_: -strides[d_]):
            if strides[dim] == 0:
                idx[dim] = np.zeros_like(rest)
                continue
            idx[dim] = rest // strides[dim]
            rest = rest - idx[dim] * strides[dim]
        nd = len(shape)
        if nd >= 2:
            r, c = idx[nd - 2], idx[nd - 1]
            lead = 0
            for dim in range(nd - 2):
                lead = lead * shape[dim] + int(idx[dim].min())
            rows = (int(r.min()), int(r.max()) + 1)
        else:
            c = idx[0] if nd == 1 else np.zeros(1, np.int64)
            lead, rows = 0, (0, 1)
        cols = (int(c.min()), int(c.max()) + 1)
        self.trace.events.append(MemoryEvent(
            launch=len(self.trace.launches) - 1, program=tuple(int(p) for p in program), op=op, tensor=name,
            nbytes=int(live.size) * element_size, lead=int(lead), rows=rows, cols=cols,
        ))

    def finish(self):
        for (start, extent, es), d in self._touched.items():
            self.trace.unique_bytes_read += int(d["load"].sum()) * es
            self.trace.unique_bytes_written += int(d["store"].sum()) * es
        return self.trace


def trace(fn, *args, **kwargs) -> MemoryTrace:
    """Run ``fn(*args, **kwargs)`` with attnlab's kernels in Triton's interpreter and record
    every global-memory load and store. Returns a :class:`MemoryTrace` (``.result`` holds
    what ``fn`` returned). Inputs may live on the CPU or a GPU (GPU tensors are copied to the
    host for each launch: slow but exact).

    Example: ``trace(flash_attention, q, k, v).bytes_read``
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    _interp_hooks.check_triton_version()
    from attnlab.kernels._runtime import interpreting

    rec = _Recorder()
    with interpreting(), _interp_hooks.memory_hooks(rec.on_launch, rec.on_access):
        result = fn(*args, **kwargs)
    out = rec.finish()
    out.result = result
    return out


def _distinct_elements(t):
    """Elements a tensor addresses, not counting broadcast (stride-0) repeats."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n


def trace_ops(fn, *args, **kwargs):
    """Run ``fn`` and count, operator by operator, the elements and bytes each PyTorch op reads and writes.

    Every ATen operator that is not a view is taken to read each tensor input
    once (broadcast repeats, stride 0, not counted) and to write each tensor
    output once: exactly what happens in memory when each op is its own kernel
    (unfused eager PyTorch). Views (``unsqueeze``, ``transpose``, ...) move
    nothing. Returns ``(result, rows)`` where ``rows`` is a list of
    ``{"op", "elements_read", "elements_written", "bytes_read", "bytes_written"}``.

    Example: ``_, rows = trace_ops(lambda x: x.exp() / x.exp().sum(-1, keepdim=True), x)``
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    rows = []

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if getattr(func, "is_view", False) or func.__name__.split(".")[0] in ("detach", "alias", "lift_fresh"):
                return out
            ins = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            rows.append({
                "op": func.__name__.split(".")[0],
                "elements_read": sum(_distinct_elements(t) for t in ins),
                "elements_written": sum(t.numel() for t in outs),
                "bytes_read": sum(_distinct_elements(t) * t.element_size() for t in ins),
                "bytes_written": sum(t.numel() * t.element_size() for t in outs),
            })
            return out

    with _Count():
        result = fn(*args, **kwargs)
    return result, rows
