"""What every exercise's test file shares: wrong implementations, written the way a learner would,
must fail their part's check with the matching diagnosis.

A known mistake whose check emulates it (``Mistake(key, message, emulation)``) is proven by
tests/test_every_mistake.py. What stays here is what an emulation cannot show: a wrong Triton kernel
(:func:`variant`), a mistake only a measurement shows (memory held, traffic), an experiment measured the wrong
way, or a failure path of its own (no gradients, a wrong other part).

In tests/test_exercise_NN.py::

    from mistakes import Wrong
    WRONG = Wrong()
    WRONG.add("padding-mask", "off-by-one", padding_mask=lambda lengths, max_len: ...)
    test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()

The check runs in-process on a namespace holding the wrong function and, for the part's other
functions, the reference (what ``check("part")`` does with the notebook's globals).
"""

import importlib

import pytest

from attnlab.grading.checks import PARTS, run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.parts import PACKAGE

GENERIC = "no common mistake matches"  # what core.run_part says when no known mistake matches


def spec_of(part):
    return importlib.import_module(f"attnlab.grading.exercises.{PACKAGE[part]}.spec")


def reference_names(part):
    """{name: reference function} for those of the part's functions that have a reference."""
    spec = spec_of(part)
    return {n: getattr(spec, n) for n in PARTS[part].names if hasattr(spec, n)}


def variant(body, **flags):
    """A real @triton.jit kernel: the kernel ``body`` with its mistake switches (globals of its code, e.g.
    RESCALE) set to ``flags``. One kernel source gives the right kernel and each wrong one."""
    import types

    import triton
    import triton.language

    fn = body.fn
    flags = {k: triton.language.constexpr(v) for k, v in flags.items()}  # globals Triton's compiler accepts
    out = types.FunctionType(fn.__code__, {**fn.__globals__, **flags}, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__annotations__ = dict(fn.__annotations__)
    return triton.jit(out)


class Wrong(list):
    def add(self, part, key, **names):
        """A wrong implementation of ``part`` that must be diagnosed as ``key``."""
        self.append(pytest.param(part, names, key, id=f"{part}-{key}"))

    def test(self):
        @pytest.mark.parametrize("part, names, key", list(self))
        def test_wrong_implementation_fails_with_its_diagnosis(part, names, key):
            ns = {**reference_names(part), **names}
            result = run_check(part, LocalLearner(ns, forbidden=[]))  # diagnosis only: shortcuts are tested apart
            assert not result.passed, result.message
            assert key in result.diagnosis, result.message
            assert "likely mistake" in result.message
            assert GENERIC not in result.message, result.message

        return test_wrong_implementation_fails_with_its_diagnosis
