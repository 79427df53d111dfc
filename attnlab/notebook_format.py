"""The course's notebooks are stored exactly as JupyterLab writes them, so opening one changes nothing.

JupyterLab 4.6 (with the widget manager's ``saveState`` on, as attnlab's install sets it:
``share/jupyter/lab/settings/overrides.d/attnlab.json``) rewrites three things when it opens
and saves a notebook that was never run, found by doing it in headless Chromium for every
notebook of the course (``tests/test_browser.py`` repeats it for one lesson):

- ``metadata.kernelspec``: the kernel's own spec, ``display_name`` "Python 3 (ipykernel)";
- ``metadata.language_info``: the kernel's full ``language_info`` (codemirror mode, lexer,
  exporter, file extension, mime type, Python version), not just ``{"name": "python"}``;
- ``metadata.widgets``: the saved widget state, empty for a notebook that was not run.

Everything else (cells, ids, outputs, other metadata) it writes back as it found it, through
``nbformat.write`` (one-space indent, sorted keys, final newline). :func:`normalise` puts a
notebook in that form; it is idempotent. The Python version written is the notebook's own
if it has one (a kernel on another patch release writes its own; nothing here can avoid
that), else this interpreter's.

Usage::

    python -m attnlab.notebook_format            # rewrite lessons/, exercises/, solutions/
    python -m attnlab.notebook_format --check    # list notebooks not in this form, exit 1
    python -m attnlab.notebook_format a.ipynb    # just these
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import re
import sys
from pathlib import Path

__all__ = ["normalise", "normal_text", "course_notebooks", "KERNELSPEC", "WIDGET_STATE_MIME"]

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
# what ipykernel's kernel_info reply says, and JupyterLab copies into the notebook
LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
}
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
EMPTY_WIDGET_STATE = {"state": {}, "version_major": 2, "version_minor": 0}
FOLDERS = ("lessons", "exercises", "solutions")
_VERSION = re.compile(r"^\d+\.\d+\.\d+$")
_CELL_ID = re.compile(r"^[a-zA-Z0-9-_]{1,64}$")


def without_iri_checker():
    """Make ``import nbformat`` take a quarter second instead of three and a half, for a process that only reads
    and writes notebooks (the grader's worker and the ``attnlab`` command; call it before nbformat is imported).

    nbformat validates with jsonschema, whose ``format-nongpl`` extra brings ``rfc3987_syntax``; jsonschema imports
    it for the ``iri`` format checker, and it builds about forty Lark grammars when imported (python-jsonschema/
    jsonschema#1428). No notebook schema has a ``format`` keyword and nbformat validates without a format checker,
    so marking the module absent changes nothing that is checked; it is done only where nothing else will run.
    """
    sys.modules.setdefault("rfc3987_syntax", None)


def normalise(nb):
    """Put a notebook (an ``nbformat.NotebookNode`` or plain dict, nbformat 4) in the form JupyterLab saves; returns it.

    Changed in place: kernelspec, language_info and an empty widget state (any stored
    widget state is dropped: the outputs keep their PNG); nbformat_minor 5; a cell id for
    every cell that lacks a valid, unique one (derived from the cell's position and source,
    so the result does not depend on when it runs).
    """
    if not isinstance(nb, dict) or "cells" not in nb or "metadata" not in nb:
        raise TypeError(f"nb: expected a notebook (a dict with cells and metadata), got {type(nb).__name__}")
    if nb.get("nbformat") != 4:
        raise ValueError(f"nb: expected an nbformat 4 notebook, got nbformat {nb.get('nbformat')!r}")
    meta = nb["metadata"]
    meta["kernelspec"] = dict(KERNELSPEC)
    version = meta.get("language_info", {}).get("version")
    if not (isinstance(version, str) and _VERSION.match(version)):
        version = platform.python_version()
    meta["language_info"] = {**LANGUAGE_INFO, "codemirror_mode": dict(LANGUAGE_INFO["codemirror_mode"]),
                             "version": version}
    meta["widgets"] = {WIDGET_STATE_MIME: {**EMPTY_WIDGET_STATE, "state": {}}}
    nb["nbformat_minor"] = max(5, int(nb.get("nbformat_minor", 5)))
    seen = set()
    for i, cell in enumerate(nb["cells"]):
        cid = cell.get("id")
        if not (isinstance(cid, str) and _CELL_ID.match(cid)) or cid in seen:
            source = cell.get("source", "")
            source = "".join(source) if isinstance(source, list) else source
            digest = hashlib.sha1(f"{i}\0{cell.get('cell_type')}\0{source}".encode()).hexdigest()
            cid = digest[:8]
            while cid in seen:
                digest = hashlib.sha1(digest.encode()).hexdigest()
                cid = digest[:8]
            cell["id"] = cid
        seen.add(cid)
    return nb


def normal_text(text):
    """The text a notebook file should hold: ``text`` (a notebook's JSON) normalised and written as nbformat writes it."""
    import nbformat

    nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
    return nbformat.writes(normalise(nb), version=nbformat.NO_CONVERT) + "\n"


def course_notebooks(root=None):
    """Every stored notebook of the course: ``lessons/``, ``exercises/``, ``solutions/`` under ``root`` (default: this checkout)."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent.parent
    return sorted(p for folder in FOLDERS for p in (root / folder).glob("*.ipynb"))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m attnlab.notebook_format", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", help="notebooks (default: every notebook in lessons/, exercises/, solutions/)")
    parser.add_argument("--check", action="store_true", help="change nothing; list the notebooks not in normal form, exit 1 if any")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.paths] if args.paths else course_notebooks()
    if not paths:
        print("error: paths: no notebooks found", file=sys.stderr)
        return 2
    stale = []
    for path in paths:
        if not path.is_file():
            print(f"error: paths: {path} is not a file", file=sys.stderr)
            return 2
        text = path.read_text(encoding="utf-8")
        want = normal_text(text)
        if want != text:
            stale.append(path)
            if not args.check:
                path.write_text(want, encoding="utf-8")
    verb = "not in JupyterLab's form" if args.check else "rewritten"
    for path in stale:
        print(f"{verb}: {path}")
    print(f"{len(stale)} of {len(paths)} notebooks {verb}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
