"""The sandboxed processes, their grader's end (:class:`Sandboxed`, :class:`Functions`: frames on two pipes of their
own, stdin, stdout and stderr ``/dev/null``), the functions process itself (:func:`main`: the cells through IPython's
``InteractiveShell``, then calls), and the worker process that grades a notebook (:func:`grade_in_subprocess`)."""

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from attnlab.grading import sandbox
from attnlab.grading.sandbox.frames import _receive, _send, frames, requests
from attnlab.grading.reports import sanitize

DEFAULT_CELL_TIMEOUT = 120
DEFAULT_TIMEOUT = 600
DEFAULT_MEMORY_MB = 4096
WORKER_GRACE = 60  # seconds a worker may take beyond --timeout (process start, parent-side checks)
COURSE = str(Path(__file__).resolve().parents[3])  # the course's own code comes first on a process's sys.path


def kernel_env(work):
    """The sandboxed process's environment: nothing of the grader's but what Python and a GPU need."""
    keep = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES",
            "NVIDIA_VISIBLE_DEVICES", "CUDA_HOME", "VIRTUAL_ENV", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update({
        "PYTHONPATH": COURSE, "HOME": str(work), "IPYTHONDIR": f"{work}/.ipython",
        "MPLCONFIGDIR": f"{work}/.matplotlib",
        "TRITON_CACHE_DIR": f"{work}/.triton", "XDG_CACHE_HOME": f"{work}/.cache", "TMPDIR": "/tmp",
        "ATTNLAB_GRADING": "1", "MPLBACKEND": "Agg", "PYTHONDONTWRITEBYTECODE": "1",
    })
    return env


def _boot(module, call):
    """``python -I -c`` code that runs ``call`` of ``module``, imported from the course's own code."""
    return f"import sys; sys.path.insert(0, {COURSE!r}); from {module} import {call}"


def _status(result, shell):
    """{"status": "ok"} or {"status": "error"|"exit", "ename", "evalue"} from IPython's ExecutionResult."""
    exc = result.error_before_exec or result.error_in_exec
    if shell.exit_now:  # IPython's exit() / quit(): the shell asks to stop, without raising
        shell.exit_now = False
        return {"status": "exit", "ename": "exit()", "evalue": ""}
    if exc is None:
        return {"status": "ok"}
    return {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)[:500]}


def main(in_fd, out_fd):
    """The functions process: cells and calls from the grader, answers to it."""
    frames_in, frames_out = frames(in_fd, out_fd)
    from IPython.core.interactiveshell import InteractiveShell

    from attnlab.grading.sandbox import agent, ranks

    shell = InteractiveShell.instance()
    shell.ask_exit = lambda: setattr(shell, "exit_now", True)  # what exit() calls (a terminal's shell has it)
    for req in requests(frames_in):
        try:
            if req.get("op") == "run":
                reply = _status(shell.run_cell(req["source"], store_history=True), shell)
            elif req.get("op") == "ranks":  # the ranks are forked first, then asked for their shards (ranks.serve)
                reply = ranks.serve(req, shell.user_ns, frames_in, frames_out, agent._outcome)
            else:
                reply = agent.handle(req, shell.user_ns)
        except BaseException as exc:  # the learner's object failing oddly: reported, never fatal here
            reply = {"agent_error": agent.describe_error(exc)}
        _send(frames_out, reply)


class Dead(Exception):
    """The process hung (killed after its time) or died; the text says which."""


class Sandboxed:
    """One fresh sandboxed ``python -I`` process at a time, running ``ENTRY`` (module, function), which is given
    the two pipes' descriptors. A request that runs past its time kills the process; a process that dies raises
    :class:`Dead`, and the next request starts a fresh one."""

    ENTRY = ("attnlab.grading.sandbox.runner", "main")

    def __init__(self, root, limits, timeout, deadline=float("inf"), copy=None):
        self.root, self.limits, self.timeout, self.deadline, self.copy = Path(root), limits, timeout, deadline, copy
        self.proc = self.cgroup = self.pid = None
        self.starts = 0

    def remaining(self):
        return self.deadline - time.monotonic()

    def _budget(self, most=None):
        budget = min(self.timeout if most is None else most, self.remaining())
        if budget <= 1:
            raise Dead("the notebook ran past the total time limit")
        return budget

    def _start(self):
        self.starts += 1
        work = self.root / f"work-{self.starts}"
        work.mkdir(parents=True)  # outside the sandbox: where its tmpfs goes
        to_child, from_grader = os.pipe()[::-1]
        from_child, to_grader = os.pipe()
        boot = _boot(*self.ENTRY) + f" as f; f({from_grader}, {to_grader})"
        cmd = sandbox.wrap_command([sys.executable, "-I", "-c", boot], work, self.root, self.copy, self.limits)
        self.cgroup = sandbox.Cgroup.make(self.limits)
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, pass_fds=(from_grader, to_grader),
                                         env=kernel_env(work), cwd=str(work),
                                         preexec_fn=sandbox.preexec(self.limits, self.cgroup))
        finally:
            os.close(from_grader)
            os.close(to_grader)
        self.proc.frames = os.fdopen(to_child, "wb"), os.fdopen(from_child, "rb")
        self._exchange(None, self._budget(120), "did not start")
        self.pid = _python_below(self.proc.pid)  # found before any learner code runs: it cannot fork a decoy first
        for req, what in self._first():
            self._exchange(req, self._budget(), what)

    def _first(self):
        """(request, what failing it means) sent to a fresh process before anything else."""
        return []

    def _exchange(self, req, budget, what, frames_for=None):
        """Send ``req``, read the reply; where the process answers ``{"send": key}`` (ranks.serve: its ranks are
        forked), the frames ``frames_for(key)`` go to it first (it raises on a key it does not know)."""
        proc = self.proc
        watchdog = threading.Timer(budget, proc.kill)  # a request that never ends: its process is killed
        watchdog.start()
        try:
            if req is not None:
                _send(proc.frames[0], req)
            reply = _receive(proc.frames[1])
            while frames_for is not None and isinstance(reply, dict) and set(reply) == {"send"}:
                for frame in frames_for(reply["send"]):
                    _send(proc.frames[0], frame)
                reply = _receive(proc.frames[1])
            if not isinstance(reply, dict):
                raise TypeError("the reply is not a dict")
            return reply
        except Exception as exc:  # died (memory, exit), killed by the watchdog, or sent what cannot be read
            timed_out = not watchdog.is_alive()
            self.stop()
            raise Dead(f"did not finish within {budget:.0f} s (an endless loop?)" if timed_out else
                       f"{what}: the process running it died or was killed ({type(exc).__name__}: {exc}; out of "
                       "memory, a signal, os._exit?)")
        finally:
            watchdog.cancel()

    def ask(self, req, what="stopped during the call", frames_for=None):
        """One request: the reply dict; raises Dead. ``frames_for``: see :meth:`_exchange`."""
        if self.proc is None:
            try:
                self._start()
            except Exception as exc:  # a process half started is not left behind
                self.stop()
                if isinstance(exc, Dead):
                    raise
                raise Dead(f"no process could be started ({type(exc).__name__}: {exc})")
        return self._exchange(req, self._budget(), what, frames_for)

    def stop(self):
        proc, self.proc, self.pid = self.proc, None, None
        if proc is not None:
            sandbox.kill([proc.pid, *sandbox.descendants(proc.pid)])
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            for stream in getattr(proc, "frames", ()):
                with contextlib.suppress(OSError):  # a frame half written to a process that died
                    stream.close()
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None


class Functions(Sandboxed):
    """The notebook's cells and the learner's functions (:func:`main`). A fresh process runs the cells that ran so
    far again (not those that ended a process), their statuses not read again."""

    def __init__(self, root, cell_timeout, deadline, limits, copy=None):
        super().__init__(root, limits, cell_timeout, deadline, copy)
        self.ran = []  # (index, source) of the cells run so far

    def _first(self):
        return [({"op": "run", "source": source}, "stopped while its cells ran again") for _, source in self.ran]

    def run(self, index, source):
        """Run one cell: its status dict; raises Dead (and the cell is never run again)."""
        reply = self.ask({"op": "run", "source": source}, "stopped")
        self.ran.append((index, source))
        return reply


def _python_below(root):
    """The first process at or below ``root`` that runs this Python (the sandbox's own processes stand above it;
    a process the learner forks is below it)."""
    exe = os.fsencode(sys.executable)
    for _ in range(100):
        for pid in [root, *sandbox.below(root)]:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0] == exe:
                    return pid
        time.sleep(0.02)
    return None


class RemoteLearner:
    """The learner's functions, called in the :class:`Functions` process (as :class:`core.LocalLearner` calls them);
    the learner's Triton kernels, launched from their text in a fresh process (:mod:`.isolated`)."""

    def __init__(self, runner, kernels=None):
        self.runner, self.kernels = runner, kernels
        self.broke = None  # the text, when a call hung or ended the process

    @property
    def pid(self):
        return None if self.runner is None else self.runner.pid

    def call(self, name, cases, grad=None, ranks=None, tap=None):
        if self.broke is not None:
            return {"agent_error": f"an earlier call {self.broke}"}
        if ranks:  # the shards travel only once the process has forked its ranks, each to its own (ranks.serve)
            if any(len(case) != ranks for case in cases):
                raise ValueError(f"ranks: each case needs one [args, kwargs] per rank ({ranks})")
            req, asked = {"op": "ranks", "name": name, "cases": len(cases), "ranks": ranks}, []

            def frames_for(index):
                if type(index) is not int or index != len(asked) or index >= len(cases):
                    raise TypeError(f"the process asked for the shards of case {index!r} out of turn")
                asked.append(index)
                return [[args, kwargs] for args, kwargs in cases[index]]
        else:
            req, frames_for = {"op": "call", "name": name, "cases": cases, "ranks": None}, None
        req.update({k: v for k, v in (("grad", grad), ("tap", tap)) if v is not None})
        try:
            return self.runner.ask(req, frames_for=frames_for)
        except Dead as exc:
            self.broke = str(exc)
            return {"agent_error": self.broke}

    def launch(self, request):
        if self.kernels is None:
            return {"agent_error": "no process launches kernels here"}
        return self.kernels.launch(request)  # never the learner's process: it could say anything about a launch


def grade_in_subprocess(path, cell_timeout=DEFAULT_CELL_TIMEOUT, timeout=DEFAULT_TIMEOUT, memory_mb=DEFAULT_MEMORY_MB):
    """Grade one notebook in a worker process of its own; the report dict. The report comes back through a pipe
    this process made and only the worker holds (the kernel inherits no file descriptor), never through a file a
    notebook could find."""
    read_fd, write_fd = os.pipe()
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(_read_all(read_fd)), daemon=True)
    env = dict(os.environ, ATTNLAB_GRADING="0")
    env.pop("PYTHONPATH", None)
    # -I: no PYTHONPATH, no user site, not the current folder (a submission's nbformat/ never runs here);
    # the course's own code first, started from a folder of its own
    boot = _boot("attnlab.grading.scoring", "_worker_main") + "; sys.exit(_worker_main(sys.argv[1:]))"
    cmd = [sys.executable, "-I", "-c", boot, str(Path(path).absolute()), "--report-fd", str(write_fd),
           "--cell-timeout", str(cell_timeout), "--timeout", str(timeout), "--memory", str(memory_mb)]
    neutral = tempfile.mkdtemp(prefix="attnlab-worker-")
    # the worker's own memory: its references and the kernel's replies, never what a notebook prints
    cap = (2 * memory_mb + 4096) * 2**20
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    pass_fds=(write_fd,), start_new_session=True, cwd=neutral,
                                    preexec_fn=lambda: sandbox.set_limit(resource.RLIMIT_DATA, cap))
        finally:
            os.close(write_fd)
        reader.start()
        try:
            proc.wait(timeout=timeout + WORKER_GRACE)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        with contextlib.suppress(OSError):  # the worker's session (other workers beside it: only what is its own)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=10)
        os.close(read_fd)
        os.rmdir(neutral)
        if chunks and chunks[0]:
            with contextlib.suppress(ValueError):
                return sanitize(json.loads(chunks[0]))
        err.seek(0)
        tail = "\n".join(err.read().decode(errors="replace").strip().splitlines()[-5:])
    if timed_out:
        tail = "the grader's worker did not finish in time"
    return sanitize({"path": str(path), "score": 0, "max_score": 0, "parts": [],
                     "error": f"the grader's worker failed: {tail}"})


def _read_all(fd, limit=64 * 2**20):
    out = bytearray()
    while True:
        block = os.read(fd, 1 << 16)
        if not block:
            return bytes(out)
        if len(out) < limit:
            out += block
