"""What every exercise part must have, and the machinery every check shares.

Each exercise (``attnlab/grading/exercises/eNN``) has at least 4 graded parts, one experiment part and
one manual (written) part; every automatically graded part has three hints and at least five known
mistakes that its tests (tests/test_every_mistake.py, tests/test_exercise_NN.py) show are diagnosed; its
reference passes its own check and is refused as an answer.
"""

import importlib

import pytest
import torch

from attnlab.course.hints import _SHOWN, all_hints, hint
from attnlab.grading import core
from attnlab.grading.checks import EXERCISES, PARTS, run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.parts import MANUAL, PACKAGE
from mistakes import reference_names

AUTO = [p for p in PARTS if p not in MANUAL]


def _wrong_counts():
    """{part: known mistakes shown diagnosed}: its checks' emulations (tests/test_every_mistake.py) and the wrong
    implementations of tests/test_exercise_NN.py."""
    from test_every_mistake import emulated

    counts = {}
    for part, _name, _mistake in emulated():
        counts[part] = counts.get(part, 0) + 1
    for exercise in EXERCISES:
        module = importlib.import_module(f"test_exercise_{exercise[:2]}")
        for param in getattr(module, "WRONG", []):
            counts[param.values[0]] = counts.get(param.values[0], 0) + 1
    return counts


def test_every_exercise_has_a_package_a_test_file_and_its_kinds_of_part():
    assert sorted(EXERCISES)[:8] == ["01_soft_alignment", "02_queries_keys_values", "03_scaled_dot_product",
                                     "04_multi_head", "05_quadratic_cost", "06_triton_primer", "07_flash_attention",
                                     "08_block_sparse"]
    for exercise, parts in EXERCISES.items():
        kinds = [PARTS[p].kind for p in parts]
        graded = [k for k in kinds if k != "manual"]
        assert len(graded) >= 4, (exercise, kinds)
        assert "experiment" in kinds and "manual" in kinds, (exercise, kinds)


def test_every_graded_part_has_at_least_five_diagnosed_mistakes():
    counts = _wrong_counts()
    assert set(counts) <= set(AUTO)
    short = {p: counts.get(p, 0) for p in AUTO if counts.get(p, 0) < 5}
    assert not short, short


def test_every_graded_part_has_three_hints_and_manual_parts_none():
    HINTS = all_hints()
    assert set(HINTS) <= set(PACKAGE), set(HINTS) - set(PACKAGE)  # a section named after no part is a typo
    assert {p: len(HINTS.get(p, [])) for p in AUTO if len(HINTS.get(p, [])) != 3} == {}
    assert not set(HINTS) & MANUAL


@pytest.mark.parametrize("part", [p for p in AUTO if set(reference_names(p)) == set(PARTS[p].names)])
def test_the_reference_itself_passes(part):
    result = run_check(part, LocalLearner(reference_names(part), forbidden=[]))
    assert result.passed, result.message


@pytest.mark.parametrize("part", [p for p in AUTO if set(reference_names(p)) == set(PARTS[p].names)])
def test_the_grader_s_reference_is_refused_as_an_answer(part):
    result = run_check(part, reference_names(part))
    assert not result.passed and "shortcut" in result.diagnosis, result.message
    assert "attnlab.grading.exercises." in result.message


def test_unknown_and_manual_parts_are_value_errors():
    with pytest.raises(ValueError, match="part_id"):
        run_check("no-such-part", {})
    for part in MANUAL:
        with pytest.raises(ValueError, match="by hand"):
            run_check(part, {})


def test_hints_come_one_per_call_and_stop_at_the_last(capsys):
    HINTS = all_hints()
    part = next(p for p in AUTO if HINTS.get(p))
    _SHOWN.pop(part, None)
    for i, text in enumerate(HINTS[part], 1):
        hint(part)
        out = capsys.readouterr().out
        assert f"hint {i} of {len(HINTS[part])}" in out and " ".join(text.split()) in " ".join(out.split())  # wrapped
    hint(part)
    assert "all 3 hints shown" in capsys.readouterr().out
    with pytest.raises(ValueError, match="part_id"):
        hint("no-such-part")


def test_a_failure_shows_a_counterexample_with_the_first_mismatch():
    want = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = want.clone()
    got[1, 0] = 9.0
    line = core.case_line("seed 3", (torch.ones(2), 5), {"mask": None}, spec=lambda x, n, mask=None: 0)
    assert line.startswith("counterexample (seed 3): x: tensor of shape (2,), float32 = [1.0, 1.0]; n: 5")
    assert "first mismatch at index (1, 0): expected 3, got 9" in core.mismatch(got, want)


def test_every_package_is_light():
    # the grader's CLI and `attnlab generate` read the tables without torch
    import subprocess
    import sys

    code = ("import sys, attnlab.grading.parts as p; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(len(p.PACKAGE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(PACKAGE)
