"""``attnlab grade PATH... [--json FILE]``: grade exercise notebooks.

Each notebook runs in a fresh Jupyter kernel (nbclient), driven from its own
worker process, one cell at a time with a per-cell and a total time limit. The
learner's file is only read, never written.

How a part is graded (so that it cannot be faked by what the notebook prints):
right after the part's check cell has run, the grader sends the kernel its own
code, which drops every ``attnlab.grading`` module from ``sys.modules``, imports
the checks afresh from disk and runs the part's check on the learner's functions
in the notebook's namespace; the result goes to a file only the grader knows.
Inside the graded kernel ``check()`` itself does nothing (``ATTNLAB_GRADING=1``).
A part scores its points only when

- the fresh check passes,
- no cell of the part raised (syntax error, exception, ``sys.exit``), timed out
  (an endless loop: the kernel is restarted and the cells that worked are run
  again) or killed the kernel, and no setup cell failed,
- the notebook's ``check`` is still attnlab's own (not redefined).

Every other case scores 0 for the parts it touches, with the reason. The exit
status is 0 whenever the notebooks could be graded, whatever the score, and 1
when one could not (missing, not a notebook, not an attnlab exercise).

Example: ``attnlab grade my-work/02_queries_keys_values.ipynb --json report.json``
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

DEFAULT_CELL_TIMEOUT = 120
DEFAULT_TIMEOUT = 600

# Runs inside the learner's kernel, in a namespace of its own.
_GRADER_CODE = r'''
import json as _json, os as _os, sys as _sys
for _name in [m for m in list(_sys.modules) if m == "attnlab.grading" or m.startswith("attnlab.grading.")]:
    del _sys.modules[_name]
from IPython import get_ipython as _get_ipython
from attnlab.grading import checks as _checks
_ns = _get_ipython().user_ns
_record = {"part": _PART}
try:
    _result = _checks.run_check(_PART, _ns)
    _record.update(passed=_result.passed, message=_result.message, diagnosis=_result.diagnosis)
except BaseException as _exc:  # a check must never take the grader down
    _record.update(passed=False, message=f"the check itself failed: {type(_exc).__name__}: {_exc}", diagnosis=[])
_check = _ns.get("check")
_code = getattr(_check, "__code__", None)
_genuine = (
    _check is None
    or (getattr(_check, "__module__", None) == "attnlab.grading.checks"
        and getattr(_check, "__qualname__", None) == "check"
        and _code is not None
        and _os.path.realpath(_code.co_filename) == _os.path.realpath(_checks.__file__))
)
_record["check_redefined"] = not _genuine
with open(_OUT, "w") as _f:
    _json.dump(_record, _f)
'''


def _first_line(source):
    for line in source.splitlines():
        if line.strip():
            text = line.strip()
            return text if len(text) <= 50 else text[:47] + "..."
    return "(empty)"


def _describe_cell(i, cell):
    return f"cell {i + 1} (`{_first_line(cell.source)}`)"


class _Runner:
    """One notebook in one kernel, restarted when it hangs or dies."""

    def __init__(self, nb, cwd, cell_timeout, deadline, env):
        from nbclient import NotebookClient

        self.nb, self.cwd, self.cell_timeout, self.deadline, self.env = nb, cwd, cell_timeout, deadline, env
        self.client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3", allow_errors=True,
                                     interrupt_on_timeout=False, record_timing=False, startup_timeout=120,
                                     resources={"metadata": {"path": str(cwd)}})
        self.ok_cells = []  # indices of cells that ran without error, replayed after a restart
        self.alive = False
        # nbclient writes an executed cell back into nb.cells[index]: the grader's own code runs
        # as an extra cell at the end, which the notebook's loop never reaches
        import nbformat

        self.scratch = len(nb.cells)
        nb.cells.append(nbformat.v4.new_code_cell(""))
        self.last_reply = None
        self.client.on_cell_executed = self._remember_reply

    def _remember_reply(self, cell=None, cell_index=None, execute_reply=None, **kwargs):
        self.last_reply = execute_reply

    def start(self):
        self.client.km = self.client.create_kernel_manager()
        self.client.start_new_kernel(env=self.env, cwd=str(self.cwd))
        self.client.start_new_kernel_client()
        self.alive = True

    def stop(self):
        if self.client.km is not None:
            try:
                if self.client.kc is not None:
                    self.client.kc.stop_channels()
                self.client.km.shutdown_kernel(now=True)  # no graceful wait: the kernel is done
            except Exception:
                pass
        self.client.kc = None
        self.client.km = None
        self.alive = False

    def restart(self):
        """A fresh kernel with the cells that worked run again. False when time ran out."""
        self.stop()
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
            return ("dead", "killed the kernel (it crashed, was killed, or called exit())")
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

    def grade_part(self, part, workdir):
        """Run the fresh check of ``part`` in the kernel; a dict, or None if it could not report."""
        import nbformat

        out = Path(workdir) / f"{uuid.uuid4().hex}.json"
        code = (f"import builtins as _b\n_b.exec(compile({_GRADER_CODE!r}, '<attnlab grader>', 'exec'), "
                f"{{'_PART': {part!r}, '_OUT': {str(out)!r}, '__name__': '__attnlab_grader__'}})\ndel _b")
        cell = nbformat.v4.new_code_cell(code)
        problem = self._execute(cell, self.scratch)
        if out.is_file():
            try:
                return json.loads(out.read_text())
            except ValueError:
                pass
        reason = problem[1] if problem else "it reported nothing"
        return {"part": part, "passed": False, "diagnosis": [], "check_redefined": False,
                "message": f"the check of your code {reason}", "broke_kernel": problem is not None
                and problem[0] in ("timeout", "dead")}


def _copy_cell(cell):
    import copy

    c = copy.deepcopy(cell)
    c.outputs = []
    return c


def _env(extra=None):
    """The kernel's environment: the same attnlab as the grader, check() deferred, no display."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["ATTNLAB_GRADING"] = "1"
    env.setdefault("MPLBACKEND", "Agg")
    env.update(extra or {})
    return env


def identify(nb, path):
    """The exercise a notebook is: its metadata, else its file name. None if unknown."""
    from attnlab.grading.parts import exercises

    EXERCISES = exercises()
    name = nb.get("metadata", {}).get("attnlab", {}).get("exercise")
    if name in EXERCISES:
        return name
    stem = Path(path).stem
    if stem in EXERCISES:
        return stem
    for exercise in EXERCISES:  # a renamed copy keeps its number: 02_mine.ipynb
        if stem[:3] == exercise[:3]:
            return exercise
    return None


def grade_notebook(path, cell_timeout=DEFAULT_CELL_TIMEOUT, timeout=DEFAULT_TIMEOUT):
    """Grade one notebook in this process. Returns the report dict (see the module doc)."""
    import nbformat

    from attnlab.grading.generate import check_ids
    from attnlab.grading.parts import exercises, points

    EXERCISES, POINTS = exercises(), points()

    path = Path(path)
    report = {"path": str(path), "score": 0, "max_score": 0, "parts": []}
    try:
        nb = nbformat.read(str(path), as_version=4)
    except Exception as exc:
        report["error"] = f"could not read the notebook: {type(exc).__name__}: {exc}"
        return report
    exercise = identify(nb, path)
    if exercise is None:
        report["error"] = "not an attnlab exercise (no attnlab.exercise metadata, no NN_ name)"
        return report
    report["exercise"] = exercise
    parts = EXERCISES[exercise]
    report["max_score"] = sum(POINTS[p] for p in parts)

    # which cells belong to which part: a part ends with its check cell
    grade_after, owner, setup = {}, {}, set()
    first_answer = next((i for i, c in enumerate(nb.cells)
                         if c.get("metadata", {}).get("nbgrader", {}).get("solution")), None)
    current = 0
    for i, cell in enumerate(nb.cells):
        if first_answer is not None and i < first_answer:
            setup.add(i)
        ids = [p for p in check_ids(cell.source) if p in parts] if cell.cell_type == "code" else []
        owner[i] = parts[min(current, len(parts) - 1)]
        if ids:
            for p in ids:
                grade_after.setdefault(i, []).append(p)
            owner[i] = ids[0]
            current = max(current, max(parts.index(p) for p in ids) + 1)
    graded_somewhere = {p for ps in grade_after.values() for p in ps}

    problems = {p: [] for p in parts}  # part -> reasons
    setup_problems = []
    results = {}
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="attnlab-grade-") as workdir:
        runner = _Runner(nb, path.parent.resolve(), cell_timeout, deadline, _env())
        try:
            runner.start()
        except Exception as exc:
            report["error"] = f"could not start a Jupyter kernel: {type(exc).__name__}: {exc}"
            return report
        try:
            for i, cell in enumerate(nb.cells[: runner.scratch]):
                if cell.cell_type != "code":
                    continue
                problem = runner.run_cell(i)
                if problem is not None:
                    kind, text = problem
                    reason = f"{_describe_cell(i, cell)} {text}"
                    if kind == "total-timeout":
                        setup_problems.append(f"the notebook ran past the total time limit of {timeout:g} s")
                        break
                    (setup_problems if i in setup else problems[owner[i]]).append(reason)
                    if kind in ("timeout", "dead") and (runner.remaining() <= 1 or not runner.restart()):
                        setup_problems.append("grading stopped: a fresh kernel could not re-run the cells that "
                                              f"worked within the total time limit of {timeout:g} s")
                        break
                for p in grade_after.get(i, []):
                    if p not in results:
                        results[p] = runner.grade_part(p, workdir)
                        if results[p].get("broke_kernel"):
                            runner.restart()  # if this runs out of time, the next cell reports it
            for p in parts:
                if p not in results and runner.remaining() > 1:
                    if not runner.alive and not runner.restart():
                        break
                    results[p] = runner.grade_part(p, workdir)
                    if results[p].get("broke_kernel"):
                        runner.restart()
        finally:
            runner.stop()

    for p in parts:
        r = results.get(p)
        reasons = setup_problems + problems[p]
        if r is None:
            feedback, passed = "not graded: " + ("; ".join(reasons) or "the notebook stopped before this part"), False
        elif r.get("check_redefined"):
            feedback, passed = "`check` was redefined or replaced in the notebook: this part is not graded (0 points)", False
            if reasons:
                feedback += "\n    also: " + "; ".join(reasons)
        else:
            passed = bool(r["passed"]) and not reasons
            feedback = r["message"]
            if reasons and r["passed"]:
                feedback = ("; ".join(reasons) + ": the function passes its check, but the part's cells must run "
                            "cleanly\n    " + feedback)
            elif reasons:
                feedback += "\n    also: " + "; ".join(reasons)
        if p not in graded_somewhere and r is not None:
            feedback += "\n    (its check cell is missing: graded at the end of the notebook)"
        report["parts"].append({"name": p, "points": POINTS[p] if passed else 0, "max_points": POINTS[p], "feedback": feedback,
                                "diagnosis": [] if r is None else r.get("diagnosis", [])})
    report["score"] = sum(part["points"] for part in report["parts"])
    return report


def _worker_main(argv):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    a = parser.parse_args(argv)
    report = grade_notebook(a.path, a.cell_timeout, a.timeout)
    Path(a.out).write_text(json.dumps(report))
    return 0


def grade_in_subprocess(path, cell_timeout=DEFAULT_CELL_TIMEOUT, timeout=DEFAULT_TIMEOUT):
    """Grade one notebook in a worker process of its own; the report dict."""
    with tempfile.TemporaryDirectory(prefix="attnlab-grade-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "attnlab.grading.grade", "--worker", str(path), str(out),
               "--cell-timeout", str(cell_timeout), "--timeout", str(timeout)]
        try:
            proc = subprocess.run(cmd, env=_env({"ATTNLAB_GRADING": "0"}), capture_output=True, text=True,
                                  timeout=timeout + 120)
            stderr = proc.stderr
        except subprocess.TimeoutExpired:
            stderr = "the grader's worker did not finish in time"
        if out.is_file():
            return json.loads(out.read_text())
        tail = "\n".join(stderr.strip().splitlines()[-5:])
        return {"path": str(path), "score": 0, "max_score": 0, "parts": [],
                "error": f"the grader's worker failed: {tail}"}


def format_report(report):
    lines = [f"{report['path']}"]
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
    return "\n".join(lines)


def add_arguments(parser):
    parser.add_argument("paths", nargs="+", metavar="PATH", help="exercise notebooks (.ipynb) or folders of them")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT, metavar="S",
                        help=f"seconds one cell may run (default {DEFAULT_CELL_TIMEOUT})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds a whole notebook may run (default {DEFAULT_TIMEOUT})")
    parser.add_argument("--jobs", "-j", type=int, default=1, help="notebooks graded at once (default 1)")


def expand(paths):
    out = []
    for p in map(Path, paths):
        out.extend(sorted(p.glob("[0-9][0-9]_*.ipynb")) if p.is_dir() else [p])
    return out


def run(args):
    from concurrent.futures import ThreadPoolExecutor

    paths = expand(args.paths)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        reports = list(pool.map(lambda p: grade_in_subprocess(p, args.cell_timeout, args.timeout), paths))
    for report in reports:
        print(format_report(report))
        print()
    graded = [r for r in reports if not r.get("error")]
    if len(reports) > 1:
        print(f"all notebooks: {sum(r['score'] for r in graded)}/{sum(r['max_score'] for r in graded)}")
    if args.json:
        doc = {"notebooks": [{k: r[k] for k in ("path", "score", "max_score", "parts", "error") if k in r}
                             for r in reports]}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if len(graded) == len(reports) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2:]))
    from attnlab.cli import main

    sys.exit(main(["grade", *sys.argv[1:]]))
