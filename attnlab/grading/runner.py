"""Running one notebook in a sandboxed Jupyter kernel, and the worker process that grades it.

:class:`_Runner` starts the kernel in :mod:`attnlab.grading.sandbox` and runs the notebook one cell at
a time, with a per-cell and a total time limit, keeping at most ``OUTPUT_LIMIT`` bytes of a cell's
output. :func:`grade_in_subprocess` grades one notebook in a worker process of its own (``python -I``
from an empty folder, its memory capped), whose report comes back through a pipe.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from attnlab.grading import sandbox

DEFAULT_CELL_TIMEOUT = 120
DEFAULT_TIMEOUT = 600
DEFAULT_MEMORY_MB = 4096
WORKER_GRACE = 60  # seconds a worker may take beyond --timeout (kernel start, parent-side checks)

_AGENT_CALL = "__import__('attnlab.grading.agent', fromlist=['serve']).serve({!r})"


def kernel_env(work):
    """The kernel's environment: nothing of the grader's but what Python and a GPU need."""
    keep = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES",
            "NVIDIA_VISIBLE_DEVICES", "CUDA_HOME", "VIRTUAL_ENV", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    root = str(Path(__file__).resolve().parents[2])
    work = str(work)
    env.update({
        "PYTHONPATH": root, "HOME": work, "IPYTHONDIR": f"{work}/.ipython", "MPLCONFIGDIR": f"{work}/.matplotlib",
        "TRITON_CACHE_DIR": f"{work}/.triton", "XDG_CACHE_HOME": f"{work}/.cache", "TMPDIR": "/tmp",
        "JUPYTER_PLATFORM_DIRS": "1", "ATTNLAB_GRADING": "1", "MPLBACKEND": "Agg", "PYTHONDONTWRITEBYTECODE": "1",
    })
    return env


OUTPUT_LIMIT = 8 * 2**20  # bytes of output one cell may send the grader; more is dropped


def _capped_client():
    from nbclient import NotebookClient

    class CappedClient(NotebookClient):
        """A client that keeps at most OUTPUT_LIMIT bytes of each cell's output (the rest is dropped)."""

        def output(self, outs, msg, display_id, cell_index):
            size = len(json.dumps(msg.get("content", {}), default=str))
            used = self._output_bytes.get(cell_index, 0) + size
            self._output_bytes[cell_index] = used
            if used > OUTPUT_LIMIT:
                self.truncated.add(cell_index)
                return None
            return super().output(outs, msg, display_id, cell_index)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._output_bytes, self.truncated = {}, set()

    return CappedClient


def _CappedClient(*args, **kwargs):
    return _capped_client()(*args, **kwargs)


class _Runner:
    """One notebook in one sandboxed kernel, restarted when it hangs or dies."""

    def __init__(self, nb, work, runtime, cell_timeout, deadline, limits, forbidden, copy=None):
        self.nb, self.work, self.runtime, self.copy = nb, Path(work), Path(runtime), copy
        self.cell_timeout, self.deadline, self.limits, self.forbidden = cell_timeout, deadline, limits, forbidden
        self.cgroup = None
        self.client = _CappedClient(nb, timeout=cell_timeout, kernel_name="python3", allow_errors=True,
                                    interrupt_on_timeout=False, record_timing=False, startup_timeout=120,
                                    resources={"metadata": {"path": str(work)}})
        self.ok_cells = []  # indices of cells that ran without error, replayed after a restart
        self.alive = False
        # nbclient writes an executed cell back into nb.cells[index]: the grader's own cells run
        # at an index past the notebook's end, which the notebook's loop never reaches
        self.scratch = len(nb.cells)
        import nbformat

        nb.cells.append(nbformat.v4.new_code_cell(""))
        self.last_reply = None
        self.client.on_cell_executed = self._remember_reply

    def _remember_reply(self, cell=None, cell_index=None, execute_reply=None, **kwargs):
        self.last_reply = execute_reply

    def _kernel_manager(self):
        from jupyter_client.manager import AsyncKernelManager

        work, runtime, copy, limits = self.work, self.runtime, self.copy, self.limits

        # asynchronous, as nbclient expects: its check that the kernel is still alive runs beside the wait
        # for output, so a kernel that dies mid-cell is noticed
        class SandboxedKernelManager(AsyncKernelManager):
            def format_kernel_cmd(self, extra_arguments=None):
                return sandbox.wrap_command(super().format_kernel_cmd(extra_arguments), work, runtime, copy, limits)

        km = SandboxedKernelManager(kernel_name="python3", transport="ipc", ip=str(self.runtime / "kernel"))
        km.connection_file = str(self.runtime / "kernel.json")
        return km

    def start(self):
        import zmq

        self.client.km = self._kernel_manager()
        # no message from the kernel may be larger than this: a bigger one closes the connection
        self.client.km.context.setsockopt(zmq.MAXMSGSIZE, OUTPUT_LIMIT)
        self.cgroup = sandbox.Cgroup.make(self.limits)
        self.work.mkdir(parents=True, exist_ok=True)  # outside the sandbox: where its tmpfs goes
        self.client.start_new_kernel(env=kernel_env(self.work), cwd=str(self.work), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                     preexec_fn=sandbox.preexec(self.limits, self.cgroup))
        self.client.start_new_kernel_client()
        self.alive = True
        reply, problem = self.request({"op": "install", "forbidden": self.forbidden})
        if problem is not None or "installed" not in (reply or {}):
            raise RuntimeError(f"the grader's agent did not start in the kernel: {problem or reply}")

    def stop(self):
        if self.client.km is not None:
            try:
                if self.client.kc is not None:
                    self.client.kc.stop_channels()
                from jupyter_core.utils import run_sync

                run_sync(self.client.km.shutdown_kernel)(now=True)  # no graceful wait: the kernel is done
            except Exception:
                pass
        self.client.kc = None
        self.client.km = None
        self.alive = False
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        sandbox.kill_descendants()  # whatever the kernel started, wherever it went

    def restart(self):
        """A fresh kernel with the cells that worked run again. False when time ran out."""
        self.stop()
        if self.remaining() <= 1:
            return False
        try:
            self.start()
        except Exception:  # no kernel to grade with: the caller reports what it could not grade
            return False
        for i in self.ok_cells:
            problem = self._execute(self.nb.cells[i], i, replay=True)
            if problem is not None:
                return False
        return True

    def remaining(self):
        return self.deadline - time.monotonic()

    def _execute(self, cell, index, replay=False):
        """Run one cell; None when it ran cleanly, else (kind, text)."""
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        budget = min(self.cell_timeout, self.remaining())
        if budget <= 1:
            return ("total-timeout", "the notebook ran past the total time limit before this cell")
        self.client.timeout = max(1, int(budget))
        work = cell if not replay else _copy_cell(cell)
        self.last_reply = None
        try:
            self.client.execute_cell(work, index)
        except CellTimeoutError:
            self.alive = False
            return ("timeout", f"did not finish within {self.client.timeout} s (an endless loop?)")
        except DeadKernelError:
            self.alive = False
            return ("dead", "killed the kernel (it crashed, ran out of memory, was killed, or called exit())")
        except Exception as exc:  # a kernel or client failure is the notebook's, never the grader's
            self.alive = False
            return ("dead", f"stopped the kernel: {type(exc).__name__}: {exc}")
        payload = ((self.last_reply or {}).get("content") or {}).get("payload") or []
        if any(p.get("source") == "ask_exit" and not p.get("keepkernel") for p in payload):
            self.alive = False  # IPython's exit(): the kernel shuts down right after replying
            return ("dead", "called exit(), which shut the kernel down")
        # the reply's status says whether the cell raised (what the cell displays can be silenced)
        content = (self.last_reply or {}).get("content") or {}
        errors = [o for o in work.get("outputs", []) if o.get("output_type") == "error"]
        if (self.last_reply is not None and content.get("status") != "ok") or errors:
            shown = errors[0] if errors else content
            name, value = str(shown.get("ename", "an error")), str(shown.get("evalue", ""))[:500]
            if name == "SystemExit":
                return ("error", f"called sys.exit({value})")
            return ("error", f"raised {name}: {value}".rstrip(": "))
        return None

    def run_cell(self, index):
        cell = self.nb.cells[index]
        problem = self._execute(cell, index)
        if problem is None:
            self.ok_cells.append(index)
        return problem

    def request(self, req):
        """Send one request to the agent; (reply dict, None) or (None, (kind, text))."""
        import nbformat

        from attnlab.grading import agent as wire
        from attnlab.grading.agent import RESULT_MIME

        cell = nbformat.v4.new_code_cell(_AGENT_CALL.format(wire.encode(req)))
        problem = self._execute(cell, self.scratch)
        self.nb.cells[self.scratch] = nbformat.v4.new_code_cell("")  # do not keep the answers around
        answers = [o["data"][RESULT_MIME] for o in cell.get("outputs", [])
                   if o.get("output_type") == "display_data" and RESULT_MIME in o.get("data", {})]
        if problem is not None and problem[0] in ("timeout", "dead", "total-timeout"):
            return None, problem
        if len(answers) != 1:
            why = problem[1] if problem else f"{len(answers)} answers instead of one"
            return {"agent_error": f"the kernel did not answer the grader ({why})"}, None
        text = answers[0] if isinstance(answers[0], str) else json.dumps(answers[0])
        try:
            return wire.decode(text), None
        except (ValueError, TypeError, KeyError) as exc:
            return {"agent_error": f"the kernel's answer could not be read ({exc})"}, None


class RemoteLearner:
    """The learner's functions, called in the kernel by the agent (see :class:`core.LocalLearner`); the
    learner's Triton kernels, launched from their text in a fresh process (:mod:`attnlab.grading.isolated`)."""

    def __init__(self, runner, kernels=None):
        self.runner, self.kernels = runner, kernels
        self.forbidden = []
        self.broke = None  # (kind, text) when a call hung or killed the kernel

    def _ask(self, req):
        if self.broke is not None:
            return {"agent_error": f"an earlier call {self.broke[1]}"}
        if not self.runner.alive and not self.runner.restart():
            return {"agent_error": "no kernel could be started to call it"}
        reply, problem = self.runner.request(req)
        if problem is not None:
            self.broke = problem
            return {"agent_error": problem[1]}
        return reply

    def call(self, name, cases, grad=None):
        req = {"op": "call", "name": name, "cases": cases, "forbidden": self.forbidden}
        if grad is not None:
            req["grad"] = grad
        return self._ask(req)

    def launch(self, request):
        if self.kernels is not None:  # never the learner's process: it could say anything about a launch
            return self.kernels.launch(request)
        return self._ask({**request, "op": "launch", "forbidden": self.forbidden})


def _copy_cell(cell):
    import copy

    c = copy.deepcopy(cell)
    c.outputs = []
    return c


def grade_in_subprocess(path, cell_timeout=DEFAULT_CELL_TIMEOUT, timeout=DEFAULT_TIMEOUT, memory_mb=DEFAULT_MEMORY_MB):
    """Grade one notebook in a worker process of its own; the report dict.

    The report comes back through a pipe this process made and only the worker holds (the
    kernel inherits no file descriptor), never through a file a notebook could find.
    """
    read_fd, write_fd = os.pipe()
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(_read_all(read_fd)), daemon=True)
    env = dict(os.environ, ATTNLAB_GRADING="0")
    env.pop("PYTHONPATH", None)
    root = str(Path(__file__).resolve().parents[2])
    # -I: no PYTHONPATH, no user site, not the current folder (a submission's nbformat/ never runs here);
    # the course's own code first, started from a folder of its own
    boot = f"import sys; sys.path.insert(0, {root!r}); from attnlab.grading.scoring import _worker_main; " \
           "sys.exit(_worker_main(sys.argv[1:]))"
    cmd = [sys.executable, "-I", "-c", boot, str(Path(path).absolute()), "--report-fd", str(write_fd),
           "--cell-timeout", str(cell_timeout), "--timeout", str(timeout), "--memory", str(memory_mb)]
    neutral = tempfile.mkdtemp(prefix="attnlab-worker-")
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    pass_fds=(write_fd,), start_new_session=True, cwd=neutral,
                                    preexec_fn=_cap_worker(memory_mb))
        finally:
            os.close(write_fd)
        reader.start()
        try:
            proc.wait(timeout=timeout + WORKER_GRACE)
            stderr = None
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
            stderr = "the grader's worker did not finish in time"
        try:  # the worker's session (other workers run beside it: kill only what is its own)
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        reader.join(timeout=10)
        os.close(read_fd)
        os.rmdir(neutral)
        data = chunks[0] if chunks else b""
        if data:
            try:
                from attnlab.grading.reports import sanitize

                return sanitize(json.loads(data))
            except ValueError:
                pass
        if stderr is None:
            err.seek(0)
            stderr = err.read().decode(errors="replace")
    tail = "\n".join(stderr.strip().splitlines()[-5:])
    from attnlab.grading.reports import sanitize

    return sanitize({"path": str(path), "score": 0, "max_score": 0, "parts": [],
                     "error": f"the grader's worker failed: {tail}"})


def _cap_worker(memory_mb):
    """The worker's own memory: its references and the kernel's replies, never what a notebook prints."""
    def apply():
        import resource

        limit = (2 * memory_mb + 4096) * 2**20
        try:
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        except (ValueError, OSError):
            pass
    return apply


def _read_all(fd, limit=64 * 2**20):
    out = bytearray()
    while True:
        block = os.read(fd, 1 << 16)
        if not block:
            return bytes(out)
        if len(out) < limit:
            out += block
