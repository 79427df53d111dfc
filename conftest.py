"""Hooks for every test path (tests/, and the notebooks of lessons/ and solutions/ that nbval runs).

nbval runs with ``--nbval-lax``: a cell fails when it raises, and no stored output is compared (the
numbers of a run differ from machine to machine). A ``check()`` cell prints ``[FAIL] ...`` and raises
nothing, so without the hook below a solution whose check refuses a correct answer would pass the
suite: every cell of a solution notebook that prints a line starting with ``[FAIL]`` fails here, with that line.
(Lessons may show a failing check on purpose: lesson 00 demonstrates what one looks like.)
"""

from pathlib import Path

import pytest


def failed_checks(outputs):
    """The ``[FAIL]`` lines among a cell's outputs (nbformat output dicts)."""
    lines = []
    for out in outputs or ():
        if out.get("output_type") == "stream":
            lines += [line for line in out.get("text", "").splitlines() if line.lstrip().startswith("[FAIL]")]
    return lines


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    if Path(str(item.fspath)).parent.name != "solutions":
        return result
    failed = failed_checks(getattr(item, "test_outputs", None))   # nbval's cell items keep what the cell printed
    if failed:
        pytest.fail(f"{item.nodeid} printed a failing check:\n" + "\n".join(failed), pytrace=False)
    return result
