"""Grading one notebook from a process that runs none of its code (docs/grading.md says what is guaranteed).

The cells that define the learner's functions (:func:`attnlab.grading.layout.to_run`: not the given demos nor the
check cells) run in a fresh sandboxed process (:class:`attnlab.grading.sandbox.runner.Functions`), Triton kernels in
another (:mod:`attnlab.grading.sandbox.isolated`); each part is then checked from here on inputs from a secret salt,
against the references (:mod:`attnlab.grading.checks`), and its answer's syntax is read for what it may not call
(:mod:`attnlab.grading.shortcuts`). A part scores its points only when its check passes here, every cell of the part
and of the setup ran cleanly, and its syntax uses nothing forbidden. What the notebook prints is never read; a
process that lies that a cell failed loses points, one that lies that a cell ran changes nothing.
"""

import json
import os
import secrets
import time
from pathlib import Path

from attnlab.grading import sandbox
from attnlab.grading.layout import (_describe_cell, _grade_id, canonical_layout, given_demos, given_sources, identify,
                                    learner_cell, owners, slot_conflict, to_run)
from attnlab.grading.reports import plural
from attnlab.grading.sandbox.isolated import IsolatedKernels
from attnlab.grading.sandbox.runner import (DEFAULT_CELL_TIMEOUT, DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT, Dead, Functions,
                                            RemoteLearner)

MAX_NOTEBOOK_BYTES = 64 * 2**20


def grade_notebook(path, cell_timeout=DEFAULT_CELL_TIMEOUT, timeout=DEFAULT_TIMEOUT, memory_mb=DEFAULT_MEMORY_MB):
    """Grade one notebook in this process (which runs none of its code). Returns the report dict.

    In four steps: which exercise it is (:func:`_identify`); what each part's answer is made of, read from its
    syntax (:func:`_read_answers`); its cells run in a sandboxed process, each part checked from here
    (:func:`_run_and_check`); the score (:func:`_score`)."""
    from attnlab.grading.parts import MANUAL, exercises, points

    path = Path(path)
    report = {"path": str(path), "score": 0, "max_score": 0, "parts": [], "isolation": sandbox.isolation()}
    nb, exercise = _identify(path, report)
    if exercise is None:
        return report
    parts = [p for p in exercises()[exercise] if p not in MANUAL]
    report["max_score"] = sum(points()[p] for p in parts)
    owner = owners(nb, parts, canonical_layout(exercise, parts))
    given = given_sources(exercise)
    shortcut, unmet = _read_answers(nb, parts, owner, given)
    limits = sandbox.Limits(memory_mb=memory_mb, cpu_s=int(timeout) + 30)
    checked = _run_and_check(path, nb, exercise, parts, owner, given, limits, cell_timeout, timeout)
    return _score(report, nb, exercise, parts, shortcut, unmet, *checked)


def _identify(path, report):
    """(the notebook, its exercise), nbgrader's hidden tests taken out; (None, None), with ``report["error"]``,
    when it cannot be read, is no exercise, or is filed in another exercise's slot."""
    import nbformat

    from attnlab.course.generate import BEGIN_HIDDEN, END_HIDDEN, _strip_region

    try:
        with sandbox.open_notebook(path) as f:  # never through a symbolic link
            nb = nbformat.reads(f.read(MAX_NOTEBOOK_BYTES + 1).decode("utf-8"), as_version=4)
        if len(nb.get("cells", [])) > 5000:
            raise ValueError("more than 5000 cells")
    except Exception as exc:
        report["error"] = f"could not read the notebook: {type(exc).__name__}: {exc}"
        return None, None
    exercise, warnings = identify(nb, path)
    if warnings:
        report["warnings"] = warnings
    if exercise is None:
        report["error"] = "not an attnlab exercise (no attnlab.exercise metadata, no grade_id of an exercise part, " \
                          "no NN_ file name)"
        return None, None
    report["exercise"] = exercise
    conflict = slot_conflict(exercise, path)
    if conflict:   # an exercise-02 notebook filed in 05's slot is credited to neither
        report["error"] = conflict
        return None, None
    for cell in nb.cells:  # nbgrader's hidden tests ask this grader; here it grades by itself
        if cell.cell_type == "code" and BEGIN_HIDDEN in cell.source:
            try:
                cell.source = _strip_region(cell.source, BEGIN_HIDDEN, END_HIDDEN, None)[0]
            except ValueError:
                pass
    return nb, exercise


def _read_answers(nb, parts, owner, given):
    """({part: [(forbidden name, where)]}, {part: what its answer never reads}), from the syntax of what each part's
    answer is made of: the statements of its learner cells, and of every other learner cell, that define its
    functions or a name they read (``_sm = torch.softmax`` above the first answer cell, a helper's helper, a
    relabelled answer), never a scratch comparison with torch.softmax."""
    from attnlab.grading.checks import PARTS
    from attnlab.grading.parts import either, forbidden, required
    from attnlab.grading.shortcuts import missing, names, part_code, rebound, uses

    code = [c.source for c in nb.cells if c.cell_type == "code"]
    learners = [c.source for c in nb.cells if c.cell_type == "code" and learner_cell(c, "", given)]
    changed = rebound(learners, list(given.values()))  # a given name bound otherwise: not the given one
    shortcut, unmet = {}, {}
    for p in parts:
        mine = [c.source for c, o in zip(nb.cells, owner) if c.cell_type == "code" and o == p
                and learner_cell(c, p, given)]
        read = part_code(learners, PARTS[p].names, mine)
        found = [(name, f"line {line}" if own else f"line {line} of another cell of yours, which defines "
                  f"{', '.join(f'`{n}`' for n in sorted(names(text, 'defined')))}")
                 for text, own in read for name, line in uses([text], forbidden(p), code)]
        if found:
            shortcut[p] = found
        needs = required(p)
        lacking = missing([text for text, _own in read], needs, code, changed) if needs else []
        if lacking:
            unmet[p] = "; ".join(f"the answer never uses {either(n)}: {needs[n]}" for n in lacking)
    return shortcut, unmet


def _run_and_check(path, nb, exercise, parts, owner, given, limits, cell_timeout, timeout):
    """Run the cells :func:`attnlab.grading.layout.to_run` picks in a fresh sandboxed process, and check each part
    from here when its check cell is reached (the rest at the end), on inputs from a secret salt. Returns (results,
    problems, setup_problems, notes, check_cell): {part: its check's outcome}, {part: what went wrong in its
    cells}, what went wrong in the setup, notes on other cells, {part: the cell that calls its check}."""
    import shutil

    from attnlab.grading.checks import PARTS, run_check
    from attnlab.course.generate import check_ids

    check_cell, grade_at = {}, {}  # part -> the cell that calls its check (nbgrader's autograded cell), and back
    for i, cell in enumerate(nb.cells):
        for q in check_ids(cell.source) if cell.cell_type == "code" else ():
            if q in parts and q not in check_cell:
                check_cell[q] = i
                grade_at.setdefault(i, []).append(q)
    problems, setup_problems, notes, results = {p: [] for p in parts}, [], [], {}
    salt = secrets.randbits(62)  # the inputs of this grading: never sent anywhere but as inputs
    deadline = time.monotonic() + timeout
    root = sandbox.temp_root()
    functions = kernels = None

    def grade(p):
        learner = RemoteLearner(functions, kernels)
        try:
            result = run_check(p, learner, salt=salt)
            results[p] = {"passed": result.passed, "message": result.message, "diagnosis": result.diagnosis}
        except Exception as exc:  # an answer the checks cannot read is the notebook's, not the grader's
            results[p] = {"passed": False, "diagnosis": [],
                          "message": f"the grader could not read your function's results ({type(exc).__name__}: {exc})"}
        if learner.broke is not None:  # the process is gone: the next part gets a fresh one
            results[p]["message"] = f"the check of your code {learner.broke}\n    " + results[p]["message"]

    code = [c.source for c in nb.cells if c.cell_type == "code"]
    runs = dict(to_run(nb, owner, given, given_demos(exercise), parts, {n for p in parts for n in PARTS[p].names}))
    try:
        copy = sandbox.private_copy(path, root / "copy")
        functions = Functions(root, cell_timeout, deadline, limits, copy)
        kernels = IsolatedKernels(code, root, limits, cell_timeout)
        for i, cell in enumerate(nb.cells):
            if i in runs:
                if functions.remaining() <= 1:
                    setup_problems.append(f"the notebook ran past the total time limit of {timeout:g} s")
                    break
                try:
                    status = functions.run(i, runs[i])
                except Dead as exc:
                    status = {"status": "dead", "evalue": str(exc)}
                problem = _problem(status)
                if problem is not None:
                    reason = f"{_describe_cell(i, cell)} {problem}"
                    where = owner[i]
                    if where != "setup" and not learner_cell(cell, "", given):
                        notes.append(f"{reason} (a given cell, run for its definitions: it costs no points itself)")
                    elif where == "setup":
                        setup_problems.append(reason)
                    elif where in problems:
                        problems[where].append(reason)
                    else:
                        notes.append(f"{reason} (a cell of no part: it costs no points itself)")
            for p in grade_at.get(i, []):
                if p not in results and functions.remaining() > 1:
                    grade(p)
        for p in parts:
            if p not in results and functions.remaining() > 1:
                grade(p)
    finally:
        if kernels is not None:
            kernels.stop()
        if functions is not None:
            functions.stop()
        sandbox.kill_descendants()
        shutil.rmtree(root, ignore_errors=True)
    return results, problems, setup_problems, notes, check_cell


def _score(report, nb, exercise, parts, shortcut, unmet, results, problems, setup_problems, notes, check_cell):
    """``report`` with each part's points and feedback, the manual parts (never scored here) and the score."""
    from attnlab.grading.parts import MANUAL, exercises, points

    POINTS = points()
    for p in parts:
        r = results.get(p)
        reasons = setup_problems + problems[p]
        if r is None:
            feedback, passed = "not graded: " + ("; ".join(reasons) or "the notebook stopped before this part"), False
        elif p in shortcut:
            calls = ", ".join(f"`{n}` ({where})" for n, where in shortcut[p])
            feedback, passed = (f"the answer uses {calls}, which this part does not allow: write the computation "
                                f"yourself (0 points)"), False
        elif p in unmet and r["passed"]:  # only once it works: "not implemented yet" says more before that
            feedback, passed = f"{unmet[p]} (0 points)", False
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
    for p in [p for p in exercises()[exercise] if p in MANUAL]:  # graded by a person in nbgrader, never here
        answer = _manual_answer(nb, p)
        state = "no answer written yet" if not answer else f"answered ({len(answer.split())} words)"
        report["parts"].append({"name": p, "points": 0, "max_points": 0, "manual": True, "diagnosis": [],
                                "answer": answer, "feedback": f"graded by hand ({plural(POINTS[p], 'point')} in "
                                                              f"nbgrader's manual grading): {state}"})
    if notes:
        report["notes"] = notes
    report["score"] = sum(part["points"] for part in report["parts"])
    return report


def _problem(status):
    """What a cell's status says went wrong (None when it ran cleanly)."""
    kind, name, value = status.get("status"), str(status.get("ename", "an error")), str(status.get("evalue", ""))[:500]
    if kind == "ok":
        return None
    if kind == "exit":
        return "called exit(), which ends the process"
    if kind == "dead":
        return value
    if name == "SystemExit":
        return f"called sys.exit({value})"
    return f"raised {name}: {value}".rstrip(": ")


def _manual_answer(nb, part):
    """The learner's written answer of the manual part ``part`` ("" when none is written)."""
    from attnlab.course.generate import MANUAL_MARK

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
    import torch

    # The references are computed on this thread alone. On the 2-core CI machine, the first reference after a
    # launch's reply, computed with torch's second worker thread, was sometimes wrong in its last 4 digits
    # (e12's selected attention: ~1e-4 off in head 1, which that thread computed, in about 1 grading in 8;
    # the same call a moment later, or on one thread, was exact): a correct kernel lost 3 points.
    torch.set_num_threads(1)
    from attnlab.notebook_format import without_iri_checker

    without_iri_checker()  # three seconds of every notebook's grading, spent on a format check no notebook has
    report = grade_notebook(a.path, a.cell_timeout, a.timeout, a.memory)
    with os.fdopen(a.report_fd, "w") as f:
        f.write(json.dumps(report))
    return 0
