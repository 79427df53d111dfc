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
``check()`` and the tests) all three are done here. A learner whose calls run in another process is
measured through what it offers: ``pid`` (the process that runs the calls: its ``/proc`` is read from
here), ``measured_call(name, case, grad)`` (the boundary measures FLOPs and peak memory itself) and a
launch that honours ``"undefined_other": True``. Without them the measurement is reported as not made.
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


def pid_of(learner):
    """The process that runs ``learner``'s calls: this one for a LocalLearner, else its ``pid``, else (today's
    ``attnlab grade``) the ipykernel process below its kernel manager's; None when none is found."""
    if isinstance(learner, LocalLearner):
        return os.getpid()
    pid = getattr(learner, "pid", None)
    if pid is not None:
        return pid
    try:
        root = learner.runner.client.km.provisioner.process.pid
    except AttributeError:
        return None
    return _kernel_below(root)


def _kernel_below(root):
    """The ipykernel process among ``root`` and its descendants (a sandbox may stand between them)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = None, [root]
    while todo:  # the deepest match: a sandbox's own command line names the kernel's too
        pid = todo.pop(0)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ipykernel" in f.read():
                    found = pid
        except OSError:
            pass
        todo.extend(children.get(pid, []))
    return found


def measured_call(learner, name, case, grad=None, flops=True):
    """Call the learner's ``name`` on one case ([args, kwargs] or [args, kwargs, grad_output]) and measure it.

    Returns (reply, {"peak_bytes": growth of the peak resident memory during the call or None,
    "flops": matmul FLOPs counted during the call or None}).
    """
    learner = learner_of(learner)
    if hasattr(learner, "measured_call"):  # a boundary that measures in its own process
        return learner.measured_call(name, case, grad)
    pid = pid_of(learner)
    local = isinstance(learner, LocalLearner)
    counter = None
    if flops and local:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
    with counter if counter is not None else contextlib.nullcontext():  # entered first: its own setup is not counted
        before = _status(pid, "VmRSS") if pid is not None and reset_peak(pid) else None
        reply = learner.call(name, [case], grad=grad)
        peak = _status(pid, "VmHWM") if before is not None else None
    return reply, {"peak_bytes": None if peak is None else max(0, peak - before),
                   "flops": counter.get_total_flops() if counter is not None else None}


@contextlib.contextmanager
def _nan_for_missing_other():
    """In Triton's interpreter, masked lanes of a load without ``other=`` read NaN (float) instead of 0."""
    import numpy as np
    from triton.runtime import interpreter as ti

    cls = ti.InterpreterBuilder
    original = cls.create_masked_load

    def create_masked_load(self, ptrs, mask, other, *rest):
        if other is None:
            dtype_np = ti._get_np_dtype(ptrs.get_element_ty())
            if np.issubdtype(dtype_np, np.floating):
                other = ti.TensorHandle(np.full(ptrs.data.shape, np.nan, dtype=dtype_np), ptrs.get_element_ty())
        return original(self, ptrs, mask, other, *rest)

    cls.create_masked_load = create_masked_load
    try:
        yield
    finally:
        cls.create_masked_load = original


class _UndefinedOther:
    def __init__(self, learner):
        self.learner = learner

    def call(self, name, cases, grad=None):
        return self.learner.call(name, cases, grad=grad)

    def launch(self, request):
        if isinstance(self.learner, LocalLearner):
            with _nan_for_missing_other():
                return self.learner.launch(request)
        return self.learner.launch({**request, "undefined_other": True})


def undefined_other(learner):
    """``learner``, whose kernel launches give the masked lanes of a load without ``other=`` NaN (see above)."""
    return _UndefinedOther(learner_of(learner))
