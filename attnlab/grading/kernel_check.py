"""Launching a learner's Triton kernel under guard: what every Triton part's check shares.

The Triton parts follow Triton-Puzzles: the spec fixes the kernel's signature, the learner writes the kernel, and
the check launches it itself (so it chooses the grid, the block sizes and the memory layout). Every tensor the
kernel sees lives inside a larger buffer whose surroundings (padding after each row or head, and guard regions
before and after) are filled with a sentinel value:

- a store outside the tensor changes the sentinel: an **out-of-bounds store**;
- a load outside the tensor reads the sentinel, so running the kernel again with a different sentinel changes its
  output: an **out-of-bounds load**;
- elements of the output still holding the sentinel were never written.

In the interpreter every load and store is also recorded: each tensor's bytes (every access counted, so a row loaded
twice counts twice), held to a part's budget by :func:`check_traffic`, and which program loaded which elements, so a
check can fail a kernel that loads K/V blocks its mask leaves out (right numbers, too many bytes). On a GPU there is
no trace: those checks are skipped, and the check says so.

Under Triton's interpreter (CPU) the buffers are real memory, so an access that stays within the guards is caught
here instead of corrupting the process. The kernel runs on the GPU when there is one, else in the interpreter,
whatever ``TRITON_INTERPRET`` was when the learner defined it.
"""

import math

import torch

from attnlab.grading.sandbox.agent import device as _device
from attnlab.grading.core import Fail, Mistake, case_line, diagnose, learner_of, mismatch, present, value_of

SENTINELS = (7.25, -3.5)


def cdiv(a, b):
    return -(-a // b)


def next_power_of_2(n):
    return 1 << max(0, (n - 1).bit_length())


OOB_LOAD = Mistake("out-of-bounds-load", "an out-of-bounds load: the kernel reads memory past the end of a row or "
                   "block (its output depends on what lies there); mask the load, e.g. "
                   "tl.load(ptr + offs, mask=offs < n, other=...)", None)
OOB_STORE = Mistake("out-of-bounds-store", "an out-of-bounds store: the kernel writes past the end of the output; "
                    "pass mask=offs < n to tl.store", None)
OFF_BY_ONE = Mistake("off-by-one-block-edge", "off by one at the block edge: exactly one element past the end is "
                     "touched; the mask is offs < n, not offs <= n", None)
NOT_STORED = Mistake("not-stored-by-kernel", "the output must be written by the kernel's own tl.store: elements of it "
                     "were written some other way (PyTorch code inside or around the kernel)", None)


def run_guarded(learner, name, label, buffers, grid, args, kwargs, outputs, loads=None, traffic=None):
    """Have the learner's kernel launched twice with different sentinels; detect stray accesses.

    buffers: {name: {"data": tensor, "pad_rows": r, "pad_cols": c}} for inputs, {name: {"shape": [...], "output": True,
    ...}} for outputs (they start as the sentinel); args: the kernel's arguments as
    :func:`attnlab.grading.sandbox.agent.build_args` reads them; outputs: names of the output buffers. Returns {name:
    output tensor} of the first run. loads: optional {buffer name: None}; in the interpreter each entry is set to what
    the first run's programs loaded from that buffer ({program: bool tensor}); on a GPU it stays None. traffic: optional
    dict; in the interpreter it is filled with the first run's traffic per buffer, {name: {"load_bytes", "store_bytes",
    "load_elements"}} (bytes count every access, so a row loaded twice counts twice; load_elements counts distinct
    elements); on a GPU it stays empty. Check it against a budget with :func:`check_traffic`.
    """
    learner = learner_of(learner)
    request = {"name": name, "grid": list(grid), "buffers": buffers, "args": args, "kwargs": kwargs,
               "sentinels": list(SENTINELS), "loads": sorted(loads or {})}
    reply = learner.launch(request)
    present(reply, name)
    if "result" not in reply:
        raise Fail(f"`{name}`: the grader got no result for {label}")
    runs = value_of(reply["result"], name, f"launching it on {label}")
    traced = _device() != "cuda"   # the grader's side decides: in the interpreter every launch is traced
    shapes = {k: tuple(b["data"].shape) if "data" in b else tuple(b["shape"]) for k, b in buffers.items()}
    if not isinstance(runs, list) or len(runs) != len(SENTINELS):
        raise Fail(f"`{name}` on {label}: the kernel's launch reported nothing the grader can read")
    values = []
    for run in runs:
        if traced and not (run.get("traced") is True and isinstance(run.get("traffic"), dict)
                           and isinstance(run.get("loaded"), dict)):
            raise Fail(f"`{name}` on {label}: the launch came back without the trace of its loads and stores, "
                       f"which the grader measures in Triton's interpreter: nothing was measured")
        changed = run["outside_changed"]
        bad = {k: int(n) for k, n in changed.items() if n}
        if bad:
            where = ", ".join(f"{n} element(s) around `{k}`" for k, n in bad.items())
            found = [OFF_BY_ONE] if sum(bad.values()) <= max(1, len(bad)) * _rows_of(shapes, bad) else []
            raise Fail(f"`{name}` on {label}: wrote outside its tensors ({where})", [OOB_STORE, *found])
        bad_loads = {k: int(n) for k, n in run.get("loads_outside", {}).items() if n}
        if bad_loads:
            where = ", ".join(f"{n} element(s) outside `{k}`" for k, n in bad_loads.items())
            found = [OFF_BY_ONE] if sum(bad_loads.values()) <= len(bad_loads) * _rows_of(shapes, bad_loads) else []
            raise Fail(f"`{name}` on {label}: loaded {where}", [OOB_LOAD, *found])
        for k in outputs:
            unwritten = int(run["never_written"][k])
            if unwritten:
                raise Fail(f"`{name}` on {label}: {unwritten} element(s) of `{k}` were never written; "
                           f"does the grid (or the offsets) cover the whole tensor?")
            not_stored = int(run.get("not_stored", {}).get(k, 0))
            if not_stored:
                raise Fail(f"`{name}` on {label}: {not_stored} element(s) of `{k}` hold values no tl.store of the "
                           f"kernel wrote", [NOT_STORED])
        out = {}
        for k in outputs:
            v = run["values"][k]
            if not torch.is_tensor(v) or tuple(v.shape) != shapes[k]:
                raise Fail(f"`{name}` on {label}: the kernel's launch reported an output the grader cannot read")
            out[k] = v
        values.append(out)
    for k in outputs:
        a, b = values[0][k], values[1][k]
        if not torch.equal(torch.nan_to_num(a, nan=1.5), torch.nan_to_num(b, nan=1.5)):
            raise Fail(f"`{name}` on {label}: the output depends on memory outside the input tensors", [OOB_LOAD])
    if traffic is not None and traced:
        traffic.clear()
        traffic.update({k: dict(v) for k, v in runs[0]["traffic"].items()})
        if set(traffic) != set(buffers) or not all(
                type(v) is dict and set(v) == {"load_bytes", "store_bytes", "load_elements"}
                and all(type(n) is int and n >= 0 for n in v.values()) for v in traffic.values()):
            raise Fail(f"`{name}` on {label}: the launch's trace does not cover its tensors")
    if loads is not None and traced:
        for k in loads:
            seen = {}
            for program, flat in runs[0]["loaded"][k]:
                mask = torch.zeros(math.prod(shapes[k]), dtype=torch.bool)
                mask[flat.long()] = True
                seen[tuple(int(i) for i in program)] = mask.view(shapes[k])
            loads[k] = seen
    return values[0]


def _rows_of(shapes, bad):
    # one stray element per row (or per slice) is the signature of an off-by-one mask
    return max(math.prod(shapes[k][:-1]) for k in bad)


def kernel_failure(label, name, got, want, mistakes, args, kwargs, uses_dot=False):
    # On an NVIDIA GPU tl.dot multiplies float32 in TF32 by default (10 mantissa bits): a correct
    # kernel is then ~1e-3 from the float32 spec. Every mistake the checks name is off by far more.
    tol = 5e-3 if (uses_dot and _device() == "cuda") else None
    rtol, atol = (tol, tol) if tol else (1e-4, 1e-5)
    why = mismatch(got, want, rtol, atol)
    if why:
        raise Fail("\n    ".join([f"`{name}` on {label}: {why}", case_line(label, args, kwargs)]),
                   diagnose(got, mistakes, args, kwargs, rtol, atol))


TOO_MUCH_TRAFFIC = Mistake("extra-traffic", "the kernel moves more bytes than the part allows: load each input "
                           "element once (keep what you need in registers instead of loading it again) and store "
                           "each output element once", None)


def check_traffic(name, label, traffic, budget, mistakes=(), says=None):
    """Fail unless the traced ``traffic`` (from :func:`run_guarded`) fits ``budget``.

    budget: {buffer name: (max load bytes, max store bytes)} (None: not limited). ``says`` (e.g. "each row read
    at most twice, written once"), the part's own budget in words, replaces the diagnosis's generic "load each
    input element once", which a part whose budget is two passes, or K and V once per query block, contradicts.
    On a GPU there is no trace (``traffic`` is empty) and nothing is checked: returns False; True when checked.
    Whether a trace is due is the grader's side's decision (the device it sees), never the launch's report.
    """
    if not traffic:
        if _device() != "cuda":   # the trusted side knows a CPU launch is traced: no trace is no measurement
            raise Fail(f"`{name}` on {label}: no trace of the launch's loads and stores to hold to the budget")
        return False
    extra = TOO_MUCH_TRAFFIC if says is None else Mistake(
        TOO_MUCH_TRAFFIC.key, f"the kernel moves more bytes than the part allows: {says}", None)
    for k, limits in budget.items():
        for op, done, most in zip(("load", "store"), ("loaded {} bytes from", "stored {} bytes to"), limits):
            seen = traffic.get(k, {}).get(f"{op}_bytes", 0)
            if most is not None and seen > most:
                raise Fail(f"`{name}` on {label}: {done.format(seen)} `{k}`; the budget is {most} bytes "
                           f"({seen / max(most, 1):.2f}x)", [*mistakes, extra])
    return True


def labelled(names, args, mistakes):
    """(kwargs, mistakes) for a check that calls :func:`kernel_failure` without parameter names: the arguments
    keyed by ``names``, so the counterexample labels them, and each mistake taking them back in order."""
    kwargs = dict(zip(names, args))

    def positional(impl):
        return None if impl is None else (lambda **kw: impl(*kw.values()))

    return kwargs, [Mistake(m.key, m.message, positional(m.impl)) for m in mistakes]


# ----------------------------------------------------------------------------- attention kernels' launches

def attention_launch(tensors, pads, strides, values, lists=()):
    """(buffers, args) of an attention kernel's launch, as :func:`run_guarded` reads them. ``tensors``: {buffer:
    an input tensor, or an output's shape}, each inside sentinel memory padded by ``pads`` ({buffer: rows, or
    (rows, columns)}, or one number of rows for all) so that its strides are its own; the arguments are the
    buffers in that order, the device tensors ``lists`` (block lists), the strides ``strides`` (a buffer: its
    dims 0 and 1; (buffer, dim): that one), then the numbers ``values``."""
    buffers = {}
    for k, t in tensors.items():
        pad = pads.get(k, 0) if isinstance(pads, dict) else pads
        rows, cols = pad if isinstance(pad, tuple) else (pad, 0)
        buffers[k] = {**({"data": t} if torch.is_tensor(t) else {"shape": list(t), "output": True}),
                      "pad_rows": rows, "pad_cols": cols}
    pairs = [p for s in strides for p in (((s, 0), (s, 1)) if isinstance(s, str) else (s,))]
    args = ([["buf", k, None] for k in buffers] + [["dev", t] for t in lists]
            + [["stride", k, dim] for k, dim in pairs] + [["val", x] for x in values])
    return buffers, args


def block_rows(j, block, n):
    """Rows of key block ``j`` (of ``block`` rows) in a sequence of ``n``: the last one may be ragged."""
    return max(0, min(n, (j + 1) * block) - j * block)


def attention_budget(shape, kv_rows, element_size=4):
    """{buffer: (max load bytes, max store bytes)} of an attention forward on (BH, N, D) ``shape``: Q read once,
    ``kv_rows`` rows of K and of V (every program's, summed), O written once."""
    bh, n, d = shape
    once, kv = bh * n * d * element_size, kv_rows * d * element_size
    return {"q": (once, 0), "k": (kv, 0), "v": (kv, 0), "o": (0, once)}


def blocks_allowed(visit, block, shape):
    """allowed(program) for a launch's ``allowed``: program (pid_m, pid_h) may load, of a (BH, N, D) tensor
    ``shape``, the rows of its own head's key blocks (of ``block`` rows) that ``visit`` (BH, n_qb, n_kb) marks."""
    def allowed(program):
        pid_m, pid_h = program[:2]
        out = torch.zeros(shape, dtype=torch.bool)
        out[pid_h] = visit[pid_h, pid_m].repeat_interleave(block)[:shape[1]].view(-1, *[1] * (len(shape) - 2))
        return out
    return allowed
