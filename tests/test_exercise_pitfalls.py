"""Every known mistake of every graded part is tested, and none is left to the generic message.

Each exercise's checks name the mistakes they recognise (``Mistake`` objects in ``eNN/checks.py``). A mistake
with an emulation is proven by ``tests/test_every_mistake.py``, which runs the emulation as the learner's answer;
the others (wrong Triton kernels, what only a measurement shows, failure paths of their own) by learner-style
wrong answers in ``tests/test_exercise_NN.py`` (``WRONG``). Both must fail with their diagnosis and never with "no
common mistake matches". This file checks, without running them again, that together they cover every graded
part and every mistake a check knows.
"""

import importlib

import pytest

from attnlab.grading.core import Mistake
from attnlab.grading.parts import TABLE
from mistakes import GENERIC, Wrong

# mistakes no test on this machine can show, each with the reason
UNTESTABLE = {
    "tf32-dot": "tl.dot in TF32 happens on an NVIDIA GPU only; the interpreter multiplies in float32",
    "additive-score-wrong": "decode-step's diagnosis of a wrong part 1 called from a right decode_step: a wrong "
                            "additive_scores is tested in additive-score itself",
    "context-vector-wrong": "decode-step's diagnosis of a wrong part 2 called from a right decode_step: a wrong "
                            "context_vector is tested in context-vector itself",
}

EXERCISES = sorted(TABLE)


def _wrong(exercise):
    """(part, key) of every wrong answer of ``exercise``: hand-written (WRONG) and emulated (test_every_mistake)."""
    import test_every_mistake

    module = importlib.import_module(f"test_exercise_{exercise[:2]}")
    wrong = getattr(module, "WRONG", [])
    assert isinstance(wrong, (Wrong, list)), f"tests/test_exercise_{exercise[:2]}.py: WRONG is not a Wrong list"
    parts = {row.id for row in TABLE[exercise]}
    emulated = [(p.values[0], p.values[2].key) for p in test_every_mistake._params()
                if p.values[0] in parts and p.id not in test_every_mistake.GAPS]
    return [(part, key) for part, _names, key in (p.values for p in wrong)] + emulated


def _known(exercise):
    checks = importlib.import_module(f"attnlab.grading.exercises.e{exercise[:2]}.checks")
    keys = set()
    for value in vars(checks).values():
        for m in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(m, Mistake) and m.key != "shortcut":
                keys.add(m.key)
    return keys


@pytest.mark.parametrize("exercise", EXERCISES)
def test_every_graded_part_has_wrong_answers(exercise):
    parts = {part for part, _key in _wrong(exercise)}
    graded = [row.id for row in TABLE[exercise] if row.kind != "manual"]
    missing = [p for p in graded if p not in parts]
    assert not missing, f"graded parts of {exercise} with no learner-style wrong answer: {missing}"


@pytest.mark.parametrize("exercise", EXERCISES)
def test_every_known_mistake_has_a_wrong_answer_that_asserts_it(exercise):
    tested = {key for _part, key in _wrong(exercise)}
    untested = sorted(_known(exercise) - tested - set(UNTESTABLE))
    assert not untested, f"mistakes {exercise}'s checks know, with no wrong answer in its tests: {untested}"


def test_a_wrong_answer_never_passes_with_the_generic_message():
    """What Wrong's test asserts of every wrong answer (run in each test_exercise_NN.py)."""
    import inspect

    source = inspect.getsource(Wrong.test)
    assert "GENERIC not in result.message" in source and "key in result.diagnosis" in source
    from attnlab.grading import core

    assert GENERIC in inspect.getsource(core.run_part)   # the words Wrong looks for are the ones run_part writes
