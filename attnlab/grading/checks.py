"""``check(part)`` for notebooks, and ``run_check`` for the grader (``hint(part)``: :mod:`attnlab.course.hints`).

``check("attention-masks")`` finds the learner's function in the notebook (the caller's
namespace), runs it against the exercise's reference (``attnlab/grading/exercises/eNN/spec.py``)
on randomized inputs and edge cases, and prints PASS or FAIL with a counterexample and the likely
mistake. ``attnlab grade`` runs the same checks itself, in its own process, after the notebook has
run: what a notebook prints is never trusted.

Example (in an exercise notebook)::

    from attnlab.grading import check, hint
    hint("attention-masks")    # the first hint; call again for the next one
    check("attention-masks")   # PASS, or FAIL with a counterexample and the likely mistake
"""

import importlib
import os
import sys

from attnlab.grading import core, engine
from attnlab.grading.core import LocalLearner, learner_of, run_part
from attnlab.grading.parts import MANUAL, PACKAGE, TABLE, either, exercises, forbidden, info, required


# part id -> its row of the exercise package's table (id, title, points, names, kind), in notebook order
PARTS = {row.id: row for rows in TABLE.values() for row in rows}
EXERCISES = exercises()


def body_of(part_id):
    """The check of ``part_id``, ``body(learner) -> message``: its table run by the engine."""
    info(part_id)  # ValueError naming part_id for an unknown part
    if part_id in MANUAL:
        raise ValueError(f"part_id: {part_id!r} is graded by hand (a written answer), not by a check")
    return engine.body(table_of(part_id))


def table_of(part_id):
    """The table of ``part_id`` (:mod:`attnlab.grading.engine`), from its exercise's checks module."""
    module = importlib.import_module(f"attnlab.grading.exercises.{PACKAGE[part_id]}.checks")
    try:
        return module.TABLES[part_id]
    except KeyError:
        raise KeyError(f"{module.__name__} has no check for part {part_id!r}") from None


def _unless_passing(body, why):
    """``body``, failing with ``why`` where it would pass (a part whose answer skips the technique it asks for)."""
    def checked(learner):
        message = body(learner)
        raise core.Fail(f"the outputs match ({message}), but not by the technique the part asks for",
                        [core.Mistake("technique-skipped", why, None)])
    return checked


def run_check(part_id, ns, salt=0):
    """Run the check of ``part_id``; returns a CheckResult.

    ``ns``: the learner's names (a dict or a LocalLearner: checked in this process, its code read for what the
    part forbids by :func:`attnlab.grading.shortcuts.in_namespace`), or the grader's learner, whose calls run in
    a sandboxed process (``attnlab grade`` reads the notebook's cells itself). ``salt``
    shifts every random input: the grader draws it from a secret, so a notebook cannot know
    the inputs in advance; 0 (the inline check) gives the same inputs every time.
    """
    body = body_of(part_id)
    learner = learner_of(ns)
    if isinstance(learner, LocalLearner):
        from attnlab.grading.layout import given_sources
        from attnlab.grading.shortcuts import in_namespace, missing_in_namespace

        patterns = forbidden(part_id) if learner.forbidden is None else learner.forbidden
        given = given_sources(next(ex for ex, parts in EXERCISES.items() if part_id in parts)).values()
        found = in_namespace(learner.ns, PARTS[part_id].names, patterns, given) if patterns else []
        if found:
            calls = ", ".join(f"`{n}`" + (f" (line {line})" if line else "") for n, line in found)
            return core.CheckResult(part_id, False, f"your code uses {calls}, which this part does not allow: "
                                    f"write the computation yourself\n    likely mistake (shortcut): "
                                    f"{core.SHORTCUT.message}", ["shortcut"])
        needs = required(part_id) if learner.forbidden is None else {}  # forbidden=[]: the code is not read
        lacking = missing_in_namespace(learner.ns, PARTS[part_id].names, needs, given) if needs else []
        if lacking:  # said once the answer works: "not implemented yet" says more before that
            body = _unless_passing(body, "; ".join(f"your code never uses {either(n)}: {needs[n]}" for n in lacking))
    core._SALT[0] = int(salt) % (2**62)
    try:
        return run_part(part_id, body, learner)
    finally:
        core._SALT[0] = 0


def check(part_id, namespace=None):
    """Check one exercise part against its reference and print what was found.

    Looks the learner's functions up in ``namespace`` (default: the caller's globals, i.e. the notebook). Under
    nbgrader's autograder a failure raises AssertionError, so nbgrader can award the cell's points. Returns None.
    """
    if os.environ.get("ATTNLAB_GRADING") == "1":
        print(f"[....] {part_id}: checked by `attnlab grade` itself, in its own process")
        return None
    ns = namespace if namespace is not None else sys._getframe(1).f_globals
    result = run_check(part_id, ns)
    print(result.report())
    if not result.passed and (os.environ.get("NBGRADER_EXECUTION") or os.environ.get("NBGRADER_VALIDATING")):
        raise AssertionError(result.report())
    return None
