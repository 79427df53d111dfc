"""Every stored notebook is in the form JupyterLab saves (attnlab.notebook_format), so opening one changes nothing.

Re-run ``python -m attnlab.notebook_format`` after adding or executing a notebook.
tests/test_browser.py checks the form itself against a real JupyterLab.
"""

import json

import nbformat
import pytest

from attnlab import notebook_format
from attnlab.notebook_format import KERNELSPEC, WIDGET_STATE_MIME, course_notebooks, normal_text, normalise

NOTEBOOKS = course_notebooks()


def test_the_course_has_notebooks_in_every_folder():
    folders = {p.parent.name for p in NOTEBOOKS}
    assert folders == {"lessons", "exercises", "solutions"}, folders


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stored_notebook_is_as_jupyterlab_saves_it(path):
    text = path.read_text(encoding="utf-8")
    assert normal_text(text) == text, f"run: python -m attnlab.notebook_format {path.parent.name}/{path.name}"
    meta = json.loads(text)["metadata"]
    assert meta["kernelspec"] == KERNELSPEC
    assert meta["widgets"][WIDGET_STATE_MIME]["state"] == {}, "stored notebooks carry no widget state"


def _raw(**meta):
    return {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": "x = 1"},
                      {"cell_type": "markdown", "metadata": {}, "source": "# hi", "id": "keep-me"},
                      {"cell_type": "markdown", "metadata": {}, "source": "dup", "id": "keep-me"}],
            "metadata": meta, "nbformat": 4, "nbformat_minor": 4}


def test_normalise_writes_what_jupyterlab_writes_and_is_idempotent():
    text = json.dumps(_raw(kernelspec={"display_name": "Python 3", "language": "python", "name": "python3"},
                           language_info={"name": "python", "version": "3.11.2"}, attnlab={"exercise": "x"}))
    once = normal_text(text)
    assert normal_text(once) == once
    nb = json.loads(once)
    assert nb["nbformat_minor"] == 5
    assert nb["metadata"]["kernelspec"]["display_name"] == "Python 3 (ipykernel)"
    assert nb["metadata"]["language_info"]["version"] == "3.11.2"  # a notebook's own version is kept
    assert nb["metadata"]["language_info"]["pygments_lexer"] == "ipython3"
    assert nb["metadata"]["attnlab"] == {"exercise": "x"}  # other metadata untouched
    ids = [c["id"] for c in nb["cells"]]
    assert ids[1] == "keep-me" and len(set(ids)) == 3
    assert once.endswith("}\n") and once.startswith('{\n "cells": [\n')
    nbformat.validate(nbformat.reads(once, as_version=4))


def test_normalise_drops_stored_widget_state():
    nb = _raw(widgets={WIDGET_STATE_MIME: {"state": {"abc": {"model_name": "x"}}, "version_major": 2, "version_minor": 0}})
    assert normalise(nb)["metadata"]["widgets"][WIDGET_STATE_MIME]["state"] == {}


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="nb:"):
        normalise([1, 2])
    with pytest.raises(ValueError, match="nb:"):
        normalise({"cells": [], "metadata": {}, "nbformat": 3})


def test_command_line_checks_and_rewrites(tmp_path, capsys):
    path = tmp_path / "a.ipynb"
    path.write_text(json.dumps(_raw()))
    assert notebook_format.main(["--check", str(path)]) == 1
    assert "not in JupyterLab's form" in capsys.readouterr().out
    assert notebook_format.main([str(path)]) == 0
    assert notebook_format.main(["--check", str(path)]) == 0
    assert notebook_format.main([str(tmp_path / "missing.ipynb")]) == 2


def test_without_the_iri_checker_nbformat_validates_as_before():
    # the grader's worker and the `attnlab` command mark rfc3987_syntax absent before importing nbformat (3 s of
    # Lark grammars for a format no notebook schema uses): a notebook nbformat rejects is still rejected
    import subprocess
    import sys

    probe = ("import json, sys\n"
             "from attnlab.notebook_format import without_iri_checker\n"
             "without_iri_checker()\n"
             "import nbformat\n"
             "assert 'rfc3987_syntax' not in {n for n, m in sys.modules.items() if m is not None}\n"
             f"good = nbformat.reads(open({str(NOTEBOOKS[0])!r}).read(), as_version=4)\n"
             "nbformat.validate(good)\n"
             "bad = json.loads(nbformat.writes(good))\n"
             "bad['cells'][0]['cell_type'] = 'not-a-type'\n"
             "try:\n"
             "    nbformat.validate(nbformat.from_dict(bad))\n"
             "except nbformat.ValidationError:\n"
             "    print('rejected')\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "rejected"
