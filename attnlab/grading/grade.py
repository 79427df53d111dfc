"""``attnlab grade PATH... [--json FILE] [--csv FILE] [--gradescope FILE] [-j N]``: grade exercise notebooks.

Scores are computed by a process that never runs the learner's code. For each notebook a
worker process (trusted) starts a Jupyter kernel in a sandbox (:mod:`attnlab.grading.sandbox`:
a temporary copy of the notebook's folder, limits, bubblewrap where installed) and runs the
notebook in it, one cell at a time, with a per-cell and a total time limit. It then grades each
part itself:

- it draws the part's inputs from a secret seed it keeps, and sends them to the kernel, as the
  source of a cell it executes; :mod:`attnlab.grading.agent` in the kernel calls the learner's
  function (or launches the learner's ``@triton.jit`` kernel) and answers with the outputs only,
  as one display message of the cell's reply (:mod:`attnlab.grading.wire`, never pickle);
- it computes the expected values with the references of the exercise packages (:mod:`attnlab.grading.exercises`) in its
  own process, compares, and names the likely mistake (:mod:`attnlab.grading.checks`);
- the part's answer cells must not use what the part forbids (:func:`attnlab.grading.parts.forbidden`):
  the worker reads their syntax tree (:mod:`attnlab.grading.shortcuts`), and the agent's
  tripwires make such calls fail while the learner's function runs.

What the notebook prints, writes or returns from its own ``check(...)`` cells is never read:
those are feedback for the learner. A part scores its points only when its check passes, no
cell of the part (found by nbgrader ``grade_id``, in any order) raised, timed out or killed
the kernel, no setup cell failed, and its answer uses nothing forbidden. Every other case scores
0 for the parts it touches, with the reason.

Batch grading: PATHs may be notebooks or folders (searched recursively, any file name; the
exercise is identified from the notebook's metadata and its cells' grade_ids, with a warning
when the file name disagrees), including nbgrader's ``submitted/<student>/<assignment>/``
layout. What is skipped is listed with the reason. The JSON report is rewritten atomically after
each notebook. Exit status: 0 when every notebook found could be graded, 1 when one could not
or none was found.

Example: ``attnlab grade my-work/02_queries_keys_values.ipynb --json report.json``
"""

import csv
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from attnlab.grading import sandbox

DEFAULT_CELL_TIMEOUT = 120
DEFAULT_TIMEOUT = 600
DEFAULT_MEMORY_MB = 4096
MAX_NOTEBOOK_BYTES = 64 * 2**20
WORKER_GRACE = 60  # seconds a worker may take beyond --timeout (kernel start, parent-side checks)

_AGENT_CALL = "__import__('attnlab.grading.agent', fromlist=['serve']).serve({!r})"


def _first_line(source):
    for line in source.splitlines():
        if line.strip():
            text = line.strip()
            return text if len(text) <= 50 else text[:47] + "..."
    return "(empty)"


def _describe_cell(i, cell):
    return f"cell {i + 1} (`{_first_line(cell.source)}`)"


def _grade_id(cell):
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


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
        for out in work.get("outputs", []):
            if out.get("output_type") == "error":
                name, value = out.get("ename", "Error"), out.get("evalue", "")
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

        from attnlab.grading import wire
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
    """The learner's functions, called in the kernel by the agent (see :class:`core.LocalLearner`)."""

    def __init__(self, runner):
        self.runner = runner
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
        return self._ask({**request, "op": "launch", "forbidden": self.forbidden})


def _copy_cell(cell):
    import copy

    c = copy.deepcopy(cell)
    c.outputs = []
    return c


# ---------------------------------------------------------------------------------------
# which exercise, which part owns which cell
# ---------------------------------------------------------------------------------------


def _stem_guess(path, exercises):
    stem = Path(path).stem
    if stem in exercises:
        return stem
    for exercise in exercises:  # a renamed copy keeps its number: 02_mine.ipynb
        if stem[:3] == exercise[:3]:
            return exercise
    return None


def identify(nb, path):
    """(exercise or None, [warnings]) from the notebook's metadata and its cells' grade_ids.

    The cells decide when metadata and cells disagree; the file name is used only when neither
    says, and a file name that names another exercise gets a warning.
    """
    from attnlab.grading.parts import exercises

    EXERCISES = exercises()
    warnings = []
    meta = nb.get("metadata", {}).get("attnlab", {}).get("exercise")
    meta = meta if meta in EXERCISES else None
    ids = {_grade_id(c) for c in nb.cells} - {None}
    overlap = {ex: len(ids & set(parts)) + len({i for i in ids if any(i.startswith(p + "-answer") for p in parts)})
               for ex, parts in EXERCISES.items()}
    best = max(overlap, key=overlap.get)
    by_cells = best if overlap[best] > 0 else None
    by_name = _stem_guess(path, EXERCISES)
    chosen = by_cells or meta or by_name
    if meta and by_cells and meta != by_cells:
        warnings.append(f"its metadata says {meta} but its cells are those of {by_cells}: graded as {by_cells}")
    if chosen and by_name and by_name != chosen:
        warnings.append(f"the file name suggests {by_name}, but the notebook is {chosen}: graded as {chosen}")
    return chosen, warnings


def _layout(ids, parts):
    """{grade_id: part, "setup" or None} for the cells of an exercise in their generated order."""
    answer_of = {}
    for gid in ids:
        for p in parts:
            if gid == p or (gid or "").startswith(p + "-answer"):
                answer_of[gid] = p
    first = next((i for i, gid in enumerate(ids) if gid in answer_of), len(ids))
    owner, pending = {}, None
    for i in range(len(ids) - 1, -1, -1):
        gid = ids[i]
        if gid in parts:
            pending = gid
        if gid in answer_of:
            owner[gid] = answer_of[gid]
        elif i < first:
            owner[gid] = "setup"
        else:
            owner[gid] = pending
    return owner


def canonical_layout(exercise, parts):
    """The owner of each grade_id, from the course's generated exercise (None if it is not found)."""
    import nbformat

    try:
        from attnlab.grading.course import find_course

        path = find_course() / "exercises" / f"{exercise}.ipynb"
        nb = nbformat.read(str(path), as_version=4)
    except Exception:
        return None
    return _layout([_grade_id(c) for c in nb.cells], parts)


def owners(nb, parts, names, canonical):
    """The part (or "setup", or None) each cell of the submission belongs to.

    Known grade_ids keep their exercise's owner wherever the cell now is; a check or answer cell
    names its part; a cell the learner added belongs to the part whose function it defines, else
    to no part (its failure is reported, not charged).
    """
    from attnlab.grading.generate import check_ids
    from attnlab.grading.shortcuts import defines

    layout = canonical or _layout([_grade_id(c) for c in nb.cells], parts)
    out = []
    for cell in nb.cells:
        gid = _grade_id(cell)
        if gid in layout:
            out.append(layout[gid])
            continue
        found = None
        if cell.cell_type == "code":
            ids = [p for p in check_ids(cell.source) if p in parts]
            found = ids[0] if ids else next((p for p in parts if defines(cell.source, names[p])), None)
        out.append(found)
    return out


# ---------------------------------------------------------------------------------------
# one notebook
# ---------------------------------------------------------------------------------------


def grade_notebook(path, cell_timeout=DEFAULT_CELL_TIMEOUT, timeout=DEFAULT_TIMEOUT, memory_mb=DEFAULT_MEMORY_MB):
    """Grade one notebook in this process (which runs none of its code). Returns the report dict."""
    import shutil

    import nbformat

    from attnlab.grading.checks import PARTS, run_check
    from attnlab.grading.generate import check_ids
    from attnlab.grading.parts import MANUAL, all_forbidden, exercises, forbidden, points
    from attnlab.grading.shortcuts import uses

    EXERCISES, POINTS = exercises(), points()
    path = Path(path)
    report = {"path": str(path), "score": 0, "max_score": 0, "parts": [], "isolation": sandbox.isolation()}
    try:
        with sandbox.open_notebook(path) as f:  # never through a symbolic link
            nb = nbformat.reads(f.read(MAX_NOTEBOOK_BYTES + 1).decode("utf-8"), as_version=4)
        if len(nb.get("cells", [])) > 5000:
            raise ValueError("more than 5000 cells")
    except Exception as exc:
        report["error"] = f"could not read the notebook: {type(exc).__name__}: {exc}"
        return report
    exercise, warnings = identify(nb, path)
    if warnings:
        report["warnings"] = warnings
    if exercise is None:
        report["error"] = "not an attnlab exercise (no attnlab.exercise metadata, no grade_id of an exercise part, " \
                          "no NN_ file name)"
        return report
    report["exercise"] = exercise
    manual = [p for p in EXERCISES[exercise] if p in MANUAL]
    parts = [p for p in EXERCISES[exercise] if p not in MANUAL]
    report["max_score"] = sum(POINTS[p] for p in parts)
    names = {p: PARTS[p].names for p in parts}
    from attnlab.grading.generate import BEGIN_HIDDEN, END_HIDDEN, _strip_region

    for cell in nb.cells:  # nbgrader's hidden tests ask this grader; here it grades by itself
        if cell.cell_type == "code" and BEGIN_HIDDEN in cell.source:
            try:
                cell.source = _strip_region(cell.source, BEGIN_HIDDEN, END_HIDDEN, None)[0]
            except ValueError:
                pass
    owner = owners(nb, parts, names, canonical_layout(exercise, parts))
    code = [c.source for c in nb.cells if c.cell_type == "code"]

    # shortcuts, from the syntax of each part's answer cells (and of added cells defining its functions)
    shortcut = {}
    for p in parts:
        mine = [c.source for c, o in zip(nb.cells, owner) if c.cell_type == "code" and o == p
                and (str(_grade_id(c) or "").startswith(p + "-answer") or _grade_id(c) is None)]
        found = uses(mine, forbidden(p), code)
        if found:
            shortcut[p] = found

    check_cell = {}  # part -> the cell that calls its check (nbgrader's autograded cell)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            for q in check_ids(cell.source):
                if q in parts:
                    check_cell.setdefault(q, i)
    grade_at = {}
    for p, i in check_cell.items():
        grade_at.setdefault(i, []).append(p)

    problems = {p: [] for p in parts}
    setup_problems, notes = [], []
    results = {}
    salt = secrets.randbits(62)  # the inputs of this grading: never sent anywhere but as inputs
    deadline = time.monotonic() + timeout
    limits = sandbox.Limits(memory_mb=memory_mb, cpu_s=int(timeout) + 30)
    root = sandbox.temp_root()
    runner = None

    def grade(p):
        learner = RemoteLearner(runner)
        learner.forbidden = forbidden(p)
        try:
            result = run_check(p, learner, salt=salt)
            results[p] = {"passed": result.passed, "message": result.message, "diagnosis": result.diagnosis}
        except Exception as exc:  # an answer the checks cannot read is the notebook's, not the grader's
            results[p] = {"passed": False, "diagnosis": [],
                          "message": f"the grader could not read your function's results ({type(exc).__name__}: {exc})"}
        if learner.broke is not None:
            results[p]["message"] = f"the check of your code {learner.broke[1]}\n    " + results[p]["message"]
            if runner.remaining() > 1:
                runner.restart()

    try:
        work, runtime = root / "work", root / "runtime"
        runtime.mkdir()
        copy = sandbox.private_copy(path, root / "copy")
        runner = _Runner(nb, work, runtime, cell_timeout, deadline, limits, all_forbidden(), copy)
        try:
            runner.start()
        except Exception as exc:
            report["error"] = f"could not start a Jupyter kernel: {type(exc).__name__}: {exc}"
            return report
        for i, cell in enumerate(nb.cells[: runner.scratch]):
            if cell.cell_type != "code":
                continue
            problem = runner.run_cell(i)
            if i in runner.client.truncated:
                notes.append(f"{_describe_cell(i, cell)} printed more than {OUTPUT_LIMIT >> 20} MiB: the rest was not kept")
            if problem is not None:
                kind, text = problem
                reason = f"{_describe_cell(i, cell)} {text}"
                if kind == "total-timeout":
                    setup_problems.append(f"the notebook ran past the total time limit of {timeout:g} s")
                    break
                where = owner[i]
                if where == "setup":
                    setup_problems.append(reason)
                elif where in problems:
                    problems[where].append(reason)
                else:
                    notes.append(f"{reason} (a cell of no part: it costs no points itself)")
                if kind in ("timeout", "dead") and (runner.remaining() <= 1 or not runner.restart()):
                    setup_problems.append("grading stopped: a fresh kernel could not re-run the cells that "
                                          f"worked within the total time limit of {timeout:g} s")
                    break
            for p in grade_at.get(i, []):
                if p not in results and runner.alive:
                    grade(p)
        for p in parts:
            if p not in results and runner.remaining() > 1:
                if not runner.alive and not runner.restart():
                    break
                grade(p)
    finally:
        if runner is not None:
            runner.stop()
        sandbox.kill_descendants()
        shutil.rmtree(root, ignore_errors=True)

    for p in parts:
        r = results.get(p)
        reasons = setup_problems + problems[p]
        if r is None:
            feedback, passed = "not graded: " + ("; ".join(reasons) or "the notebook stopped before this part"), False
        elif p in shortcut:
            calls = ", ".join(f"`{n}` (line {line})" for n, line in shortcut[p])
            feedback, passed = (f"the answer uses {calls}, which this part does not allow: write the computation "
                                f"yourself (0 points)"), False
        else:
            passed = bool(r["passed"]) and not reasons
            feedback = r["message"]
            if reasons and r["passed"]:
                feedback = ("; ".join(reasons) + ": the function passes its check, but the part's cells must run "
                            "cleanly\n    " + feedback)
            elif reasons:
                feedback += "\n    also: " + "; ".join(reasons)
        if p not in check_cell and r is not None:
            feedback += "\n    (its check cell is missing: graded at the end of the notebook)"
        report["parts"].append({"name": p, "points": POINTS[p] if passed else 0, "max_points": POINTS[p],
                                "feedback": feedback, "diagnosis": [] if r is None else r.get("diagnosis", [])})
    for p in manual:  # graded by a person in nbgrader: reported with the learner's text, never scored here
        answer = _manual_answer(nb, p)
        state = "no answer written yet" if not answer else f"answered ({len(answer.split())} words)"
        report["parts"].append({"name": p, "points": 0, "max_points": 0, "manual": True, "diagnosis": [],
                                "answer": answer,
                                "feedback": f"graded by hand ({POINTS[p]} points in nbgrader's manual grading): "
                                            f"{state}"})
    if notes:
        report["notes"] = notes
    report["score"] = sum(part["points"] for part in report["parts"])
    return report


def _manual_answer(nb, part):
    """The learner's written answer of the manual part ``part`` ("" when none is written)."""
    from attnlab.grading.generate import MANUAL_MARK

    for cell in nb.cells:
        if cell.cell_type == "markdown" and (_grade_id(cell) == part or part in MANUAL_MARK.findall(cell.source)):
            text = MANUAL_MARK.sub("", cell.source).strip()
            return "" if text in ("", "YOUR ANSWER HERE") else text
    return ""


def _worker_main(argv):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--report-fd", type=int, required=True)
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    parser.add_argument("--memory", type=int, default=DEFAULT_MEMORY_MB)
    a = parser.parse_args(argv)
    sandbox.protect_grader()
    report = grade_notebook(a.path, a.cell_timeout, a.timeout, a.memory)
    with os.fdopen(a.report_fd, "w") as f:
        f.write(json.dumps(report))
    return 0


def grade_in_subprocess(path, cell_timeout=DEFAULT_CELL_TIMEOUT, timeout=DEFAULT_TIMEOUT, memory_mb=DEFAULT_MEMORY_MB):
    """Grade one notebook in a worker process of its own; the report dict.

    The report comes back through a pipe this process made and only the worker holds (the
    kernel inherits no file descriptor), never through a file a notebook could find.
    """
    import tempfile

    read_fd, write_fd = os.pipe()
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(_read_all(read_fd)), daemon=True)
    env = dict(os.environ, ATTNLAB_GRADING="0")
    env.pop("PYTHONPATH", None)
    root = str(Path(__file__).resolve().parents[2])
    # -I: no PYTHONPATH, no user site, not the current folder (a submission's nbformat/ never runs here);
    # the course's own code first, started from a folder of its own
    boot = f"import sys; sys.path.insert(0, {root!r}); from attnlab.grading.grade import _worker_main; " \
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
                return json.loads(data)
            except ValueError:
                pass
        if stderr is None:
            err.seek(0)
            stderr = err.read().decode(errors="replace")
    tail = "\n".join(stderr.strip().splitlines()[-5:])
    return {"path": str(path), "score": 0, "max_score": 0, "parts": [], "error": f"the grader's worker failed: {tail}"}


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


# ---------------------------------------------------------------------------------------
# the command: finding notebooks, reports
# ---------------------------------------------------------------------------------------


def format_report(report):
    lines = [f"{report['path']}"]
    for w in report.get("warnings", []):
        lines.append(f"  warning: {w}")
    if report.get("error"):
        lines.append(f"  could not grade: {report['error']}")
        return "\n".join(lines)
    width = max([len(p["name"]) for p in report["parts"]] + [4])
    lines.append(f"  {'part':<{width}}  points  feedback")
    for p in report["parts"]:
        pts = f"{p['points']}/{p['max_points']}"
        first, *rest = p["feedback"].split("\n")
        lines.append(f"  {p['name']:<{width}}  {pts:>6}  {first}")
        lines.extend(f"  {'':<{width}}          {r.strip()}" for r in rest)
    lines.append(f"  {'total':<{width}}  {report['score']:>3}/{report['max_score']:<2}")
    for n in report.get("notes", []):
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def add_arguments(parser):
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="exercise notebooks (.ipynb) or folders of them (searched recursively)")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE (updated per notebook)")
    parser.add_argument("--csv", metavar="FILE", help="also write one row per student and exercise to FILE")
    parser.add_argument("--gradescope", metavar="FILE",
                        help="also write Gradescope's autograder results (results.json) to FILE")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT, metavar="S",
                        help=f"seconds one cell may run (default {DEFAULT_CELL_TIMEOUT})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds a whole notebook may run (default {DEFAULT_TIMEOUT})")
    parser.add_argument("--memory", type=int, default=DEFAULT_MEMORY_MB, metavar="MB",
                        help=f"memory a notebook's kernel may allocate (default {DEFAULT_MEMORY_MB} MB)")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="notebooks graded at once (default 1)")


def _hidden(path):
    return any(part.startswith(".") for part in path.parts)


def discover(paths):
    """(notebooks to grade, [{"path", "reason"}] skipped) for files and folders (recursive)."""
    found, skipped, seen = [], [], set()

    def add(p):
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            found.append(p)

    for p in map(Path, paths):
        if not p.exists():
            skipped.append({"path": str(p), "reason": "does not exist"})
        elif p.is_dir():
            notebooks = []
            for q in sorted(p.rglob("*")):
                rel = q.relative_to(p)
                if not q.is_file():
                    continue
                if q.suffix != ".ipynb":
                    continue
                if ".ipynb_checkpoints" in rel.parts:
                    skipped.append({"path": str(q), "reason": "a Jupyter checkpoint copy, not a submission"})
                elif _hidden(rel):
                    skipped.append({"path": str(q), "reason": "inside a hidden folder"})
                else:
                    notebooks.append(q)
            if not notebooks:
                skipped.append({"path": str(p), "reason": "a folder with no notebook (.ipynb) in it"})
            for q in notebooks:
                add(q)
        elif p.suffix != ".ipynb":
            skipped.append({"path": str(p), "reason": "not a notebook (.ipynb)"})
        else:
            add(p)
    return found, skipped


def who(path):
    """(student, assignment) from nbgrader's submitted/<student>/<assignment>/ layout, else the folder."""
    parts = Path(path).resolve().parts
    for key in ("submitted", "autograded"):
        if key in parts:
            i = len(parts) - 1 - parts[::-1].index(key)
            if i + 3 < len(parts):  # .../submitted/<student>/<assignment>/<notebook>
                return parts[i + 1], parts[i + 2]
    return Path(path).resolve().parent.name, ""


def _write_atomic(path, text):
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _json_doc(reports, skipped):
    keys = ("path", "student", "assignment", "exercise", "score", "max_score", "parts", "warnings", "notes", "error",
            "isolation")
    return {"isolation": sandbox.isolation(),
            "notebooks": [{k: r[k] for k in keys if k in r} for r in reports], "skipped": skipped}


def csv_text(reports):
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["student", "assignment", "exercise", "score", "max_score", "path", "error"])
    for r in reports:
        w.writerow([r.get("student", ""), r.get("assignment", ""), r.get("exercise", ""), r.get("score", 0),
                    r.get("max_score", 0), r["path"], r.get("error", "")])
    return out.getvalue()


def gradescope_doc(reports, skipped):
    """Gradescope's autograder results: one test per part, the total as the score."""
    tests = []
    for r in reports:
        label = r.get("exercise") or Path(r["path"]).stem
        if r.get("error"):
            tests.append({"name": f"{label}: could not grade", "score": 0, "max_score": r.get("max_score", 0),
                          "output": r["error"], "visibility": "visible"})
            continue
        for p in r["parts"]:
            if p.get("manual"):
                continue
            tests.append({"name": f"{label}: {p['name']}", "score": p["points"], "max_score": p["max_points"],
                          "output": p["feedback"], "visibility": "visible"})
    lines = [f"skipped {s['path']}: {s['reason']}" for s in skipped]
    if not reports:
        lines.append("no notebook was graded: upload your exercise notebooks (.ipynb)")
    return {"score": sum(r.get("score", 0) for r in reports), "tests": tests, "output": "\n".join(lines),
            "visibility": "visible", "stdout_visibility": "hidden"}


def run(args):
    from concurrent.futures import ThreadPoolExecutor, as_completed

    sandbox.protect_grader()
    paths, skipped = discover(args.paths)
    for s in skipped:
        print(f"skipped {s['path']}: {s['reason']}", file=sys.stderr)
    reports, lock = [], threading.Lock()
    memory = getattr(args, "memory", DEFAULT_MEMORY_MB)

    def one(p):
        report = grade_in_subprocess(p, args.cell_timeout, args.timeout, memory)
        report["student"], report["assignment"] = who(p)
        return report

    if args.json:
        _write_atomic(args.json, json.dumps(_json_doc([], skipped), indent=2) + "\n")
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(one, p): p for p in paths}
        for future in as_completed(futures):
            report = future.result()
            with lock:
                reports.append(report)
                reports.sort(key=lambda r: str(r["path"]))
                print(format_report(report), flush=True)
                print(flush=True)
                if args.json:
                    _write_atomic(args.json, json.dumps(_json_doc(reports, skipped), indent=2) + "\n")
    sandbox.kill_descendants()
    graded = [r for r in reports if not r.get("error")]
    if len(reports) > 1:
        print(f"all notebooks: {sum(r['score'] for r in graded)}/{sum(r['max_score'] for r in graded)}")
    print(f"isolation: {sandbox.isolation()}")
    if getattr(args, "csv", None):
        _write_atomic(args.csv, csv_text(reports))
    if getattr(args, "gradescope", None):
        _write_atomic(args.gradescope, json.dumps(gradescope_doc(reports, skipped), indent=2) + "\n")
    if not graded:
        print("attnlab grade: nothing was graded" + (" (see the skipped files above)" if skipped else ""),
              file=sys.stderr)
        return 1
    return 0 if len(graded) == len(reports) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2:]))
    from attnlab.cli import main

    sys.exit(main(["grade", *sys.argv[1:]]))
