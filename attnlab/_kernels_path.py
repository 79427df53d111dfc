"""Make ``attnlab.kernels`` resolve to the top-level ``kernels/`` folder.

The Triton kernels have their own visible home, ``kernels/`` at the top of the
repository, and ship inside the wheel as ``attnlab.kernels`` (setuptools'
``package-dir`` mapping in pyproject.toml). An installed wheel therefore has a
real ``attnlab/kernels/`` folder and needs nothing from this module.

A source checkout does not: there ``attnlab/`` and ``kernels/`` are siblings.
This finder covers that case (``PYTHONPATH=.``, notebooks run from the repo,
editable installs, git worktrees): it maps ``attnlab.kernels`` to the
``kernels/`` folder beside the ``attnlab`` package that was actually imported,
so the kernels always come from the same tree as the library. It handles that
one name only; submodules are then found through the package's ``__path__``.
"""

import importlib.abc
import importlib.util
import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_INSTALLED = os.path.join(_PACKAGE_DIR, "kernels", "__init__.py")
_SOURCE_TREE = os.path.join(os.path.dirname(_PACKAGE_DIR), "kernels", "__init__.py")


class _KernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "attnlab.kernels":
            return None
        return importlib.util.spec_from_file_location(
            fullname, _SOURCE_TREE, submodule_search_locations=[os.path.dirname(_SOURCE_TREE)]
        )


if not os.path.exists(_INSTALLED) and os.path.exists(_SOURCE_TREE):
    # first in line, so an editable install's finder for another checkout cannot win
    if not any(isinstance(f, _KernelsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _KernelsFinder())
