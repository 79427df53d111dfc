"""Every solution notebook, run top to bottom in one fresh kernel as a learner's JupyterLab runs it, prints only
``[PASS]`` from its checks and raises nothing.

nbval also runs the solutions (with the root conftest.py failing any ``[FAIL]`` line), but it executes cells with
``store_history=False``, so IPython's ``In`` holds none of them and the inline check reads each function's code
instead of the cells; a learner's kernel stores history, and the check then reads the cells. This runs them the
learner's way (nbclient stores history), so both ways of reading are held to PASS.
"""

import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("attnlab_root_conftest", ROOT / "conftest.py")
_root = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_root)
failed_checks = _root.failed_checks   # the root conftest.py's reading of [FAIL] lines: one rule for both runs
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_a_solution_run_as_a_learner_runs_it_prints_only_pass(path):
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    printed = [line for cell in nb.cells if cell.cell_type == "code" for line in failed_checks(cell.outputs)]
    passed = sum(line.lstrip().startswith("[PASS]") for cell in nb.cells if cell.cell_type == "code"
                 for out in cell.outputs if out.get("output_type") == "stream" for line in out.get("text", "").splitlines())
    assert not printed, "\n".join(printed)
    assert passed > 0, "no check printed [PASS]"
