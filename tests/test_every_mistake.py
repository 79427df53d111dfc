"""Every known mistake fails its part's check with its own name.

Each exercise's checks (``attnlab/grading/exercises/eNN/checks.py``) list the known mistakes of a part as
module-level lists of ``Mistake(key, message, emulation)``; the emulation is the wrong computation, with the
signature of the learner's function it stands for. For every graded part, this test puts each emulation in the
notebook's namespace in place of that function (the part's other functions are the references,
:func:`mistakes.reference_names`), runs the part's check in-process, and asserts that the check fails and that
its diagnosis names the mistake's key. A mistake that the check cannot tell from another, or from a right answer,
fails here.

How the lists are found: the module-level lists of Mistakes that the part's check body reads (directly, or through
the functions of its module that it calls); each list stands for the one function of the part whose reference has
its signature (as many parameters required, no more in all). Where two of the part's functions share a
signature, :data:`FUNCTION_OF` says which function a list is for; a list that stands for none of the part's
functions (it emulates a helper, or every rank of a process group at once) is named in :data:`NOT_A_STAND_IN`, with
why. Both tables are checked against what is found, so neither can go stale.

Kernel parts (a part whose answer includes a ``@triton.jit`` kernel, named ``*_kernel``) are not here: their
emulations compute in PyTorch what a wrong kernel outputs, and the check launches the learner's kernel, which a
PyTorch function cannot stand in for. Their mistakes are proven by the real wrong kernels of
tests/test_exercise_NN.py (:func:`mistakes.variant`). Mistakes without an emulation (a measured technique, an error
raised, a shape) are proven by the hand-written wrong implementations there too.
"""

import importlib
import inspect
import types
from collections import Counter
from functools import lru_cache

import pytest

from attnlab.grading import engine
from attnlab.grading.checks import PARTS, run_check, table_of
from attnlab.grading.core import LocalLearner, Mistake
from attnlab.grading.parts import MANUAL, PACKAGE
from mistakes import GENERIC, reference_names, spec_of

# (part, list) -> the function a list stands for, where more than one of the part's functions has its signature
FUNCTION_OF = {
}

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


def checks_of(part):
    return importlib.import_module(f"attnlab.grading.exercises.{PACKAGE[part]}.checks")


def _codes(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _read_by(fn, module, seen):
    """The global names ``fn`` reads, and those read by the functions of ``module`` it reads, in order."""
    found = []
    for code in _codes(fn.__code__):
        for name in code.co_names:
            if name in seen:
                continue
            seen.add(name)
            found.append(name)
            value = getattr(module, name, None)
            if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
                found += _read_by(value, module, seen)
    return found


def mistake_lists(part):
    """{list name: [Mistake with an emulation]}: the lists of Mistakes of ``part``'s table (keyed by the learner's
    function each stands for), or the module-level lists that a check written as code reads."""
    table = table_of(part)
    if not callable(table):
        return {name: [m for m in ms if m.impl is not None] for name, ms in engine.mistakes(table).items()
                if any(m.impl is not None for m in ms)}
    module = checks_of(part)
    lists = {}
    for name in _read_by(module.CHECKS[part], module, set()):
        value = getattr(module, name, None)
        if isinstance(value, (list, tuple)) and value and all(isinstance(m, Mistake) for m in value):
            emulated = [m for m in value if m.impl is not None]
            if emulated:
                lists[name] = emulated
    return lists


def _shape(fn):
    """(parameters, required parameters) of ``fn``, or None when it takes *args."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return len(params), sum(p.default is p.empty for p in params)


def _fits(emulation, reference):
    """Whether ``emulation`` takes the calls ``reference`` takes: as many required parameters, no more in all."""
    mine, theirs = _shape(emulation), _shape(reference)
    return mine is None or (theirs is not None and mine[1] == theirs[1] and mine[0] <= theirs[0])


def stand_ins(part, mistakes):
    """The names of ``part``'s functions (with a reference) whose calls ``mistakes``' emulations all take."""
    spec = spec_of(part)
    return [name for name in PARTS[part].names if callable(getattr(spec, name, None))
            and all(_fits(m.impl, getattr(spec, name)) for m in mistakes)]


def function_of(part, list_name, mistakes):
    """The learner's function that the emulations of ``list_name`` stand for, or None (see NOT_A_STAND_IN)."""
    if (part, list_name) in FUNCTION_OF:
        return FUNCTION_OF[(part, list_name)]
    if not callable(table_of(part)):  # a table says which function a list stands for
        return list_name if list_name in PARTS[part].names else None
    names = stand_ins(part, mistakes)
    return names[0] if len(names) == 1 else None


def graded_parts():
    return [p for p in PARTS if p not in MANUAL and not is_kernel_part(p)]


@lru_cache(maxsize=None)
def emulated():
    """[(part, function name, Mistake)] for every emulated mistake of every graded part that is not a kernel part."""
    out = []
    for part in graded_parts():
        for list_name, mistakes in mistake_lists(part).items():
            name = function_of(part, list_name, mistakes)
            if name is not None:
                out += [(part, name, m) for m in mistakes]
    return out


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
    """Each list found is for one function of its part (by signature, else FUNCTION_OF) or named in
    NOT_A_STAND_IN; and neither table names a list that is not found, or that the signatures settle alone."""
    found, unplaced = set(), set()
    for part in graded_parts():
        for list_name, mistakes in mistake_lists(part).items():
            found.add((part, list_name))
            if not callable(table_of(part)):
                if list_name not in PARTS[part].names:
                    unplaced.add((part, list_name))
                continue
            names = stand_ins(part, mistakes)
            if (part, list_name) in FUNCTION_OF:
                assert len(names) > 1 and FUNCTION_OF[(part, list_name)] in names, (part, list_name, names)
            elif len(names) != 1:
                unplaced.add((part, list_name))
    assert unplaced == set(NOT_A_STAND_IN), "lists that stand for no single function of their part"
    assert set(FUNCTION_OF) <= found, "FUNCTION_OF names lists that no check reads"


def test_every_graded_part_that_is_not_a_kernel_part_has_an_emulated_mistake():
    covered = {part for part, _, _ in emulated()}
    assert set(graded_parts()) - covered == NO_EMULATION
    assert len(emulated()) > 250  # the lists were found at all
