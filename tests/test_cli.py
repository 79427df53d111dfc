"""The ``attnlab`` command table: every subcommand's module loads with attnlab's required
dependencies alone, which is why ``build_parser`` imports them without an ImportError fallback."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from attnlab.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
# import names of the required dependencies (and what torch itself pulls in)
REQUIRED = {"attnlab", "torch", "torchgen", "triton", "numpy", "ipywidgets", "matplotlib", "tqdm", "nbformat",
            "nbclient", "ipykernel", "typing_extensions", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
            "filelock", "fsspec", "setuptools", "pkg_resources"}

_PROBE = """
import importlib, sys
before = set(sys.modules)
module = importlib.import_module({module!r})
assert callable(module.add_arguments) and callable(module.run)
tops = {{m.split(".")[0] for m in set(sys.modules) - before}}
print(" ".join(sorted(t for t in tops if t not in sys.stdlib_module_names and not t.startswith("_"))))
"""


def test_required_dependencies_are_the_ones_listed_here():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("<")[0].split("=")[0].strip().replace("-", "_") for d in deps}
    assert names <= REQUIRED, names - REQUIRED


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_module_needs_only_required_dependencies(name):
    module = COMMANDS[name][0]
    out = subprocess.run([sys.executable, "-c", _PROBE.format(module=module)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert set(out.stdout.split()) <= REQUIRED, f"{module} imports {set(out.stdout.split()) - REQUIRED}"


def test_the_parser_lists_every_command():
    help_text = build_parser().format_help()
    assert all(name in help_text for name in COMMANDS)
