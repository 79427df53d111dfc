"""Every known mistake fails its part's check with its own name.

Each part's table (``TABLES`` of ``attnlab/grading/exercises/eNN/checks.py``, :mod:`attnlab.grading.engine`) lists
its known mistakes, ``Mistake(key, message, emulation)``, by the learner's function each stands for; the emulation
is the wrong computation, with that function's signature. For every graded part, this test puts each emulation in
the notebook's namespace in place of that function (the part's other functions are the references,
:func:`mistakes.reference_names`), runs the part's check in-process, and asserts that the check fails and that
its diagnosis names the mistake's key. A mistake that the check cannot tell from another, or from a right answer,
fails here. A list a table keys by a label in parentheses stands for none of the part's functions (it emulates a
helper's number, or every rank of a process group at once): :data:`NOT_A_STAND_IN` names each, with why, and is
checked against the tables, so it cannot go stale.

Kernel parts (a part whose answer includes a ``@triton.jit`` kernel, named ``*_kernel``) are not here: their
emulations compute in PyTorch what a wrong kernel outputs, and the check launches the learner's kernel, which a
PyTorch function cannot stand in for. Their mistakes are proven by the real wrong kernels of
tests/test_exercise_NN.py (:func:`mistakes.variant`). Mistakes without an emulation (a measured technique, an error
raised, a shape) are proven by the hand-written wrong implementations there too.
"""

from collections import Counter
from functools import lru_cache

import pytest

from attnlab.grading import engine
from attnlab.grading.checks import PARTS, run_check, table_of
from attnlab.grading.core import LocalLearner
from attnlab.grading.parts import MANUAL
from mistakes import GENERIC, reference_names

# (part, list) -> why its emulations cannot stand in for the part's function
NOT_A_STAND_IN = {
    ("naive-time-experiment", "(predicted_seconds)"): "predict_naive_time's mistakes, matched against the "
                                                      "experiment's predicted_seconds from the learner's own rates",
    ("naive-time-experiment", "(flop_rate)"): "each the flop_rate it gives from the learner's own matmul_seconds",
    ("naive-time-experiment", "(bandwidth)"): "each the bandwidth it gives from the learner's own copy_seconds",
    ("naive-time-experiment", "(timings)"): "each the learner's timing in a wrong unit, from the grader's own "
                                            "measurement in seconds",
    ("ring-group", "(every rank at once)"): "each plays every rank of the group at once (shards -> one (O, L) per "
                                            "rank); the learner's ring_forward is one rank, run in a process group",
}

# graded parts that are not kernel parts and have no emulated mistake: their mistakes are judged from
# measurements (times, a process group), proven by the wrong implementations in tests/test_exercise_NN.py
NO_EMULATION = {"naive-time-experiment", "ring-group"}

# mistakes that their part's check does not catch on its cases, as the checks stand (test id -> why): strict, so
# that a check that comes to catch one says so here
GAPS = {}   # (part-list-wrong-i: why its check cannot tell it); none today: decode-step's cases were widened

# parts whose check trains a model or times code: their mistakes are left out of `make test-fast`
SLOW_PARTS = {"alignment-crossing", "variance-experiment", "head-specialisation", "capstone-train",
              "capstone-local-global", "traffic-experiment", "matmul-traffic-experiment"}


def is_kernel_part(part):
    """Whether ``part``'s answer includes a Triton kernel (the course names every kernel ``*_kernel``)."""
    return any(name.endswith("_kernel") for name in PARTS[part].names)


def mistake_lists(part):
    """{the learner's function (or a label in parentheses): [Mistake with an emulation]} of ``part``'s table."""
    return {name: [m for m in ms if m.impl is not None] for name, ms in engine.mistakes(table_of(part)).items()
            if any(m.impl is not None for m in ms)}


def graded_parts():
    return [p for p in PARTS if p not in MANUAL and not is_kernel_part(p)]


@lru_cache(maxsize=None)
def emulated():
    """[(part, function name, Mistake)] for every emulated mistake of every graded part that is not a kernel part."""
    return [(part, name, m) for part in graded_parts() for name, mistakes in mistake_lists(part).items()
            if name in PARTS[part].names for m in mistakes]


def _params():
    seen = Counter()
    params = []
    for part, name, mistake in emulated():
        seen[(part, mistake.key)] += 1
        n = seen[(part, mistake.key)]
        test_id = f"{part}-{mistake.key}" + (f"-{n}" if n > 1 else "")
        marks = [pytest.mark.slow] if part in SLOW_PARTS else []
        if test_id in GAPS:
            marks.append(pytest.mark.xfail(reason=GAPS[test_id], strict=True))
        params.append(pytest.param(part, name, mistake, marks=marks, id=test_id))
    return params


@pytest.mark.parametrize("part, name, mistake", _params())
def test_each_emulated_mistake_fails_with_its_own_name(part, name, mistake):
    ns = {**reference_names(part), name: mistake.impl}
    result = run_check(part, LocalLearner(ns, forbidden=[]))  # diagnosis only: shortcuts are tested apart
    assert not result.passed, f"{mistake.key} passes {part}'s check: {result.message}"
    assert mistake.key in result.diagnosis, result.message
    assert "likely mistake" in result.message and GENERIC not in result.message, result.message


def test_every_list_of_mistakes_stands_for_one_function():
    """Each list of a table is keyed by one of its part's functions, or by a label that NOT_A_STAND_IN names."""
    labelled = {(part, name) for part in graded_parts() for name in mistake_lists(part) if name not in PARTS[part].names}
    assert labelled == set(NOT_A_STAND_IN), "lists that stand for no single function of their part"


def test_every_graded_part_that_is_not_a_kernel_part_has_an_emulated_mistake():
    covered = {part for part, _, _ in emulated()}
    assert set(graded_parts()) - covered == NO_EMULATION
    assert len(emulated()) > 250  # the lists were found at all
