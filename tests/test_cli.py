"""The ``attnlab`` command table: every subcommand's module loads with attnlab's required
dependencies alone, which is why ``build_parser`` imports them without an ImportError fallback."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from attnlab.cli import COMMANDS, build_parser, main

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


def _attnlab(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "attnlab", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def test_bare_attnlab_lists_the_commands_and_exits_0():
    out = _attnlab()
    assert out.returncode == 0, out.stderr
    assert all(name in out.stdout for name in COMMANDS)


def test_version():
    from attnlab import __version__

    out = _attnlab("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"attnlab {__version__}"


def test_help_and_version_import_no_command_module():
    probe = ("import sys, contextlib, io\nfrom attnlab.cli import main, COMMANDS\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n    main([])\n"
             "print(sorted(m for m, _ in COMMANDS.values() if m in sys.modules), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "[] False", out.stdout + out.stderr


def _broken_torch(tmp_path):
    """An environment in which `import torch` fails, as in a broken install (a torch package shadowing the real one)."""
    shim = tmp_path / "shim" / "torch"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: cannot open shared object file')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim.parent), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_doctor_runs_through_the_cli_where_torch_is_broken_and_names_the_fix(tmp_path):
    env = _broken_torch(tmp_path)
    check = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env, timeout=60)
    assert check.returncode != 0 and "libtorch_cpu.so" in check.stderr  # torch really is unimportable here
    out = _attnlab("doctor", env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("problem: torch fails to import"))
    assert "libtorch_cpu.so" in line and "fix: pip install --force-reinstall" in line and "torch==" in line
    assert "the course cannot run until the problems above are fixed" in out.stdout
    assert _attnlab("--help", env=env).returncode == 0  # and the command list still shows


def test_doctor_says_whether_widget_state_is_saved(tmp_path, monkeypatch):
    from attnlab import lab
    from attnlab.doctor import widget_state_saving

    monkeypatch.setenv("JUPYTERLAB_SETTINGS_DIR", str(tmp_path / "user"))
    on, why = widget_state_saving(tmp_path)
    assert not on and "not installed" in why
    lab.install_settings(tmp_path)
    assert widget_state_saving(tmp_path) == (True, None)
    own = tmp_path / "user" / "@jupyter-widgets" / "jupyterlab-manager" / "plugin.jupyterlab-settings"
    own.parent.mkdir(parents=True)
    own.write_text('{\n  // the learner turned it off in the settings editor\n  "saveState": false\n}')
    on, why = widget_state_saving(tmp_path)
    assert not on and str(own) in why


def test_doctor_warns_with_the_fix_when_widget_state_is_not_saved(monkeypatch, tmp_path, capsys):
    from attnlab import doctor

    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    doctor.run()
    out = capsys.readouterr().out
    assert "widgets      state not saved in notebooks" in out
    assert any(x.startswith("warning: attnlab's Lab settings are not installed") and
               x.endswith("fix: attnlab lab --install-settings") for x in out.splitlines()), out


def test_lab_passes_port_no_browser_and_other_options_to_jupyterlab(monkeypatch, tmp_path):
    from attnlab import lab

    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    (tmp_path / "lessons").mkdir()
    calls = []
    monkeypatch.setattr(lab.subprocess, "call", lambda cmd, cwd: calls.append((cmd, cwd)) or 0)
    assert main(["lab", "--dir", str(tmp_path / "lessons"), "--port", "8899", "--no-browser",
                 "--ip=0.0.0.0", "--IdentityProvider.token=secret"]) == 0
    assert main(["lab", "--dir", str(tmp_path / "lessons"), "--", "--ServerApp.base_url=/course/"]) == 0
    (first, cwd), (second, _) = calls
    assert first[:3] == lab.BOOT and cwd == tmp_path
    assert "--port=8899" in first and "--no-browser" in first
    assert first[-2:] == ["--ip=0.0.0.0", "--IdentityProvider.token=secret"]
    assert second[-1] == "--ServerApp.base_url=/course/" and "--" not in second
    assert main(["lab", "--port", "70000"]) == 2
