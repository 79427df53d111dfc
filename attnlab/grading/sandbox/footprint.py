"""What a learner's call costs, measured from outside the learner's code: the growth of the peak memory of the
sandbox's cgroup (reset and read by the grader), else of the functions process's ``VmHWM`` (reset through its
``clear_refs``), a measurement that cannot be made failing the check; matmul FLOPs only where the call runs in this
process (counted in the learner's, they would be its word); and launches whose masked ``tl.load`` lanes without
``other=`` get NaN, as a GPU leaves them undefined where Triton's interpreter gives zeros (:func:`undefined_other`)."""

import contextlib
import os

import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab.grading.core import Fail, LocalLearner, clone, learner_of, mismatch, present, value_of


def _status(pid, key):
    """``key`` (VmHWM, VmRSS) of process ``pid`` in bytes, or None where /proc cannot tell."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
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
    """The learner below the wrappers a check is given (they keep it as ``.learner``): only its kind is read."""
    for _ in range(8):
        if isinstance(learner, LocalLearner) or hasattr(learner, "runner") or not hasattr(learner, "learner"):
            break
        learner = learner.learner
    return learner


def pid_of(learner):
    """The process that runs ``learner``'s calls: this one, or the sandboxed functions process's Python (found by
    the grader when it started); None when none is known."""
    learner = _inner(learner)
    if isinstance(learner, LocalLearner):
        return os.getpid()
    return getattr(learner, "pid", None)


def _cgroup_peak(folder):
    """(a function reading the peak, the usage now) of one cgroup folder after resetting its peak: v1's
    ``memory.max_usage_in_bytes`` (reset by writing 0), v2's ``memory.peak`` (reset per open file since Linux 6.12);
    (None, None) where neither can be. Files the sandbox cannot see: the learner can neither reset nor fake them."""
    with contextlib.suppress(OSError, ValueError):
        if (folder / "memory.max_usage_in_bytes").exists():
            (folder / "memory.max_usage_in_bytes").write_text("0")
            return (folder / "memory.max_usage_in_bytes").read_text, int((folder / "memory.usage_in_bytes").read_text())
        if (folder / "memory.peak").exists():
            f = open(folder / "memory.peak", "r+")

            def read():  # once, from the file that was reset
                with f:
                    f.seek(0)
                    return f.read()
            try:
                f.write("reset\n")
                f.flush()
                return read, int((folder / "memory.current").read_text())
            except (OSError, ValueError):
                f.close()
    return None, None


def _peak_meter(learner):
    """A function measuring the memory growth of what runs between its creation and its call (None when it cannot
    be measured): the learner's sandbox's cgroup (every process of the sandbox, their tmpfs pages) where it has one,
    else ``VmHWM`` of the process running the calls."""
    inner = _inner(learner)
    read = before = None
    for folder in getattr(getattr(getattr(inner, "runner", None), "cgroup", None), "paths", ()):
        read, before = _cgroup_peak(folder)
        if read is not None:
            break
    else:
        pid = pid_of(inner)
        if pid is not None and reset_peak(pid):
            read, before = (lambda: _status(pid, "VmHWM")), _status(pid, "VmRSS")
    if read is None or before is None:
        return lambda: None

    def growth():
        try:
            peak = read()
            return None if peak is None else max(0, int(peak) - before)
        except (OSError, ValueError):
            return None
    return growth


def measured_call(learner, name, case, grad=None, flops=True):
    """Call the learner's ``name`` on one case ([args, kwargs] or [args, kwargs, grad_output]): (reply,
    {"peak_bytes": the peak memory's growth during the call, "flops": matmul FLOPs}), None where not measured."""
    outer = learner_of(learner)
    learner = _inner(outer)
    counter = FlopCounterMode(display=False) if flops and isinstance(learner, LocalLearner) else None
    with counter if counter is not None else contextlib.nullcontext():  # entered first: its own setup is not counted
        peak = _peak_meter(learner)
        reply = outer.call(name, [case], grad=grad)  # through the wrappers: the check counts it
        peak_bytes = peak()
    return reply, {"peak_bytes": peak_bytes, "flops": counter.get_total_flops() if counter is not None else None}


def _other_values(case, g=None):
    """``case`` with every floating tensor's values drawn afresh, seeded by ``os.urandom`` (the same shapes, dtypes
    and spread): values derived from the case could be inverted and the measured call's result computed from them."""
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
    other values of the same shapes (the allocator grows on a first call). Where it grows by more than ``limit``
    (always, without one) it is measured again on values no earlier call saw (``second``, where the values must keep
    a domain; default: fresh random values), and the smaller growth is the call's: a one-off allocation of the process
    while one call ran is not the call's. With ``spec`` each measured call's result must be right: a result kept from
    an earlier call is not this one. Raises Fail when a call fails or the growth cannot be measured (``what``: "that
    no N x N matrix is held")."""
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
    """``learner``, whose kernel launches give the masked lanes of a load without ``other=`` NaN."""

    def __init__(self, learner):
        self.learner = learner

    def call(self, name, cases, grad=None):
        return self.learner.call(name, cases, grad=grad)

    def launch(self, request):
        return self.learner.launch({**request, "undefined_other": True})  # honoured by agent.run_launch


def undefined_other(learner):
    return _UndefinedOther(learner_of(learner))
