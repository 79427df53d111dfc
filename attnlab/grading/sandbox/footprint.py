"""What a learner's call costs, measured from outside the learner's code: peak memory and matmul FLOPs,
and launches in which a masked ``tl.load`` without ``other=`` gets undefined (NaN) lanes.

The checks of the tiled parts ask three things that the output alone cannot show:

- **peak memory** (:func:`measured_call`): the peak resident memory of the process that runs the call,
  read from ``/proc/PID/status`` (``VmHWM``) after resetting it by writing ``5`` to ``/proc/PID/clear_refs``
  (Linux, ``Documentation/filesystems/proc.rst``). At a size where an N x N score matrix dominates
  (N = 2048: 16 MiB of float32) a tiled function stays far below it, whatever it says about itself;
- **matmul FLOPs** (:func:`measured_call`): ``torch.utils.flop_counter.FlopCounterMode`` around the call,
  so a causal function that skips no tile does twice the work of one that skips;
- **undefined masked lanes** (:func:`undefined_other`): Triton's interpreter fills the masked lanes of a
  ``tl.load`` without ``other=`` with zeros; on a GPU they are undefined (Triton's ``tl.load`` docs). A kernel
  that only works because of the interpreter's zeros is launched here with NaN in those lanes.

Where the learner's code runs in this process (:class:`attnlab.grading.core.LocalLearner`: the inline
``check()`` and the tests) all three are done here. Under ``attnlab grade`` (docs/grading.md) the grader
measures from outside: the PyTorch functions run in a fresh sandboxed process (:mod:`attnlab.grading.sandbox.runner`),
whose cgroup's peak memory the grader resets and reads (files the sandbox does not see; without a cgroup, that
process's ``VmHWM`` through its ``/proc``); the kernels launch in :mod:`attnlab.grading.sandbox.isolated`'s process, where
:func:`attnlab.grading.sandbox.agent.run_launch` honours ``"undefined_other": True`` as it does here. A memory measurement that cannot be made is a failed check, never a
pass. FLOPs are not counted there (counting them in the learner's process would be the learner's word):
the causal-skip check of exercise 07 rests on its NaN-poisoned tail instead (why no outside measurement can
replace it: the docstring of ``attnlab/grading/exercises/e07/checks.py``).
"""

import contextlib
import os

from attnlab.grading.core import LocalLearner, learner_of


def _status(pid, key):
    """``key`` (VmHWM, VmRSS) of process ``pid`` in bytes, or None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak(pid):
    """Reset ``pid``'s peak resident memory (VmHWM) to its current one; False where that is not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _inner(learner):
    """The learner below the wrappers a check is given (core._Counted, _UndefinedOther: they keep it as
    ``.learner``); calls still go through the wrappers, only what kind of learner it is is read here."""
    for _ in range(8):
        if isinstance(learner, LocalLearner) or hasattr(learner, "runner") or not hasattr(learner, "learner"):
            break
        learner = learner.learner
    return learner


def pid_of(learner):
    """The process that runs ``learner``'s calls: this one for a LocalLearner, else its ``pid`` (under
    ``attnlab grade``, the sandboxed functions process's Python, found by the grader when it started); None
    when none is known."""
    learner = _inner(learner)
    if isinstance(learner, LocalLearner):
        return os.getpid()
    return getattr(learner, "pid", None)


class _CgroupPeak:
    """The peak memory of a whole cgroup (the functions process and every process it starts, their tmpfs pages),
    reset by the grader before a call and read after it: files the sandbox cannot see, so the learner's code
    can neither reset nor fake them (v2's ``memory.peak``, reset per open file since Linux 6.12; v1's
    ``memory.max_usage_in_bytes``, reset by writing 0)."""

    def __init__(self, cgroup):
        self.file, self.before = None, None
        for folder in getattr(cgroup, "paths", ()):
            try:
                if (folder / "memory.max_usage_in_bytes").exists():  # v1
                    (folder / "memory.max_usage_in_bytes").write_text("0")
                    self.before = int((folder / "memory.usage_in_bytes").read_text())
                    self.file = folder / "memory.max_usage_in_bytes"
                    return
                if (folder / "memory.peak").exists():  # v2: the peak seen by this open file
                    f = open(folder / "memory.peak", "r+")
                    try:
                        f.write("reset\n")
                        f.flush()
                        self.before = int((folder / "memory.current").read_text())
                    except OSError:
                        f.close()
                        continue
                    self.file = f
                    return
            except (OSError, ValueError):
                continue

    def growth(self):
        try:
            if isinstance(self.file, os.PathLike):
                return max(0, int(self.file.read_text()) - self.before)
            if self.file is not None:
                with self.file:
                    self.file.seek(0)
                    return max(0, int(self.file.read()) - self.before)
        except (OSError, ValueError):
            pass
        return None


def _peak_meter(learner):
    """A function measuring the memory growth of what runs between its creation and its call (None when the
    measurement cannot be made): the cgroup of the learner's sandbox where it has one (its functions process's,
    ``runner.cgroup``), else the peak resident memory (VmHWM) of the process that runs the learner's calls."""
    inner = _inner(learner)
    cgroup = getattr(getattr(inner, "runner", None), "cgroup", None)
    if cgroup is not None:
        meter = _CgroupPeak(cgroup)
        if meter.file is not None:
            return meter.growth
    pid = pid_of(inner)
    before = _status(pid, "VmRSS") if pid is not None and reset_peak(pid) else None
    if before is None:
        return lambda: None

    def growth():
        peak = _status(pid, "VmHWM")
        return None if peak is None else max(0, peak - before)
    return growth


def measured_call(learner, name, case, grad=None, flops=True):
    """Call the learner's ``name`` on one case ([args, kwargs] or [args, kwargs, grad_output]) and measure it.

    Returns (reply, {"peak_bytes": growth of the peak memory during the call or None,
    "flops": matmul FLOPs counted during the call, or None: they are counted only where the call runs in this
    process, never by code in the learner's})
    """
    outer = learner_of(learner)
    learner = _inner(outer)
    local = isinstance(learner, LocalLearner)
    counter = None
    if flops and local:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
    with counter if counter is not None else contextlib.nullcontext():  # entered first: its own setup is not counted
        peak = _peak_meter(learner)
        reply = outer.call(name, [case], grad=grad)  # through the wrappers: the check counts it
        peak_bytes = peak()
    return reply, {"peak_bytes": peak_bytes, "flops": counter.get_total_flops() if counter is not None else None}


def _other_values(case, g=None):
    """``case`` with every floating tensor's values drawn afresh from a generator seeded by ``os.urandom`` (the same
    shapes, dtypes and spread): nothing about the measured call's values can be worked out from them (values derived
    from the case, halved and shifted, could be inverted and the measured call's result computed during this one)."""
    import torch

    g = g if g is not None else torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    if torch.is_tensor(case):
        if not case.is_floating_point():
            return case
        spread = float(case.detach().float().std()) if case.numel() > 1 else 1.0
        spread = spread if spread > 0 and spread == spread and spread != float("inf") else 1.0
        return (torch.randn(case.shape, generator=g) * spread).to(case.dtype)
    if isinstance(case, (tuple, list)):
        return type(case)(_other_values(v, g) for v in case)
    return {k: _other_values(v, g) for k, v in case.items()} if isinstance(case, dict) else case


def peak_growth(learner, name, case, label, what, grad=None, spec=None, second=None, limit=None):
    """The peak memory growth (bytes) of a call of the learner's ``name`` on ``case``, after one unmeasured call on
    other values of the same shapes (the allocator grows on a first call; the process gives its free heap back at
    the end of every call request, :func:`attnlab.grading.sandbox.agent.handle`, so memory freed earlier cannot hide
    this call's). It is measured twice, on ``case`` and on values no earlier call saw (``second``, a case of the same
    shapes where the values must keep a domain; default: fresh random values) where the first grows by more than
    ``limit`` (always, without one), and the smaller growth is the call's: a one-off allocation of the process
    while one call ran (a thread's first heap) is not the call's, and each call must compute its own result to be
    small. With ``spec``, each measured call's result must be right
    too: a result remembered from an earlier call is not this one. Raises Fail when a call fails or the growth
    cannot be measured: a part that asks for a measured property (``what``: "that no N x N matrix is held") is never
    credited unmeasured."""
    from attnlab.grading.core import Fail, clone, mismatch, present, value_of

    learner_of(learner).call(name, [_other_values(case)], grad=grad)
    peaks = []
    for measured in (case, _other_values(case) if second is None else second):
        reply, cost = measured_call(learner, name, measured, grad=grad, flops=False)
        present(reply, name)
        got = value_of((reply.get("results") or [{"raised": "no result"}])[0], name, label)
        if spec is not None and grad is None:
            why = mismatch(got, spec(*clone(measured[0]), **clone(measured[1])), rtol=1e-3, atol=1e-4)
            if why:
                raise Fail(f"`{name}` on {label}: a call whose memory the grader measured returned a wrong result "
                           f"({why}); a result kept from an earlier call is not this call's")
        if cost["peak_bytes"] is None:
            raise Fail(f"`{name}`: the grader could not measure the peak memory of the process your code ran in (no "
                       f"cgroup and no readable /proc/PID/status here), so it cannot tell {what}; the part scores 0 "
                       f"on this machine")
        peaks.append(cost["peak_bytes"])
        if limit is not None and peaks[-1] <= limit:
            break
    return min(peaks)


class _UndefinedOther:
    def __init__(self, learner):
        self.learner = learner

    def call(self, name, cases, grad=None):
        return self.learner.call(name, cases, grad=grad)

    def launch(self, request):
        return self.learner.launch({**request, "undefined_other": True})  # honoured by agent.run_launch


def undefined_other(learner):
    """``learner``, whose kernel launches give the masked lanes of a load without ``other=`` NaN (see above)."""
    return _UndefinedOther(learner_of(learner))
