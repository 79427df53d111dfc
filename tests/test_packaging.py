"""The package, its pinned environment and its command line.

- the tested set in attnlab/constraints.txt agrees with pyproject.toml and environment.yml;
- the wheel ships the top-level kernels/ folder as attnlab.kernels, proven in a fresh
  virtual environment outside the repository;
- `attnlab doctor` tells the truth, and its exit status says whether the course can run.
"""

import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from attnlab import doctor

ROOT = Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_constraints_pin_the_design_card_packages():
    pins = doctor.tested_versions()
    for name in ["torch", "triton", "numpy", "jupyterlab", "ipywidgets", "matplotlib", "nbval"]:
        assert name in pins, f"{name} is not pinned in attnlab/constraints.txt"


def test_pyproject_ranges_admit_the_tested_set():
    project = _pyproject()["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    pins = doctor.tested_versions()
    seen = set()
    for line in reqs:
        req = Requirement(line)
        name = req.name.lower()
        if name in pins:
            seen.add(name)
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"pyproject.toml asks for {line!r} but the tested set pins {name}=={pins[name]}")
    # torch, triton and numpy must be listed explicitly: the CPU torch does not pull in triton,
    # and Triton's interpreter needs numpy
    assert {"torch", "triton", "numpy", "ipywidgets", "matplotlib", "jupyterlab", "nbval"} <= seen


def test_environment_yml_installs_the_same_set():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pins = doctor.tested_versions()
    listed = {}
    for dep in env["dependencies"]:
        items = dep["pip"] if isinstance(dep, dict) else [dep]
        for item in items:
            if item.startswith("-e") or item in ("pip",):
                continue
            if "==" in item:
                name, version = item.split("==")
            elif "=" in item:
                name, version = item.split("=")
            else:
                continue
            listed[name.strip().lower().replace("pytorch", "torch")] = version.strip()
    listed.pop("python", None)
    assert listed == pins, "environment.yml and attnlab/constraints.txt disagree"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make lab" in readme and "make test" in readme
    assert "\nmake test" in ci


@pytest.mark.slow
def test_wheel_ships_kernels_as_attnlab_kernels(tmp_path):
    """Build the wheel, install it into a fresh venv outside the repo, import attnlab.kernels there."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(ROOT)], check=True)
    (wheel,) = dist.glob("attnlab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "attnlab/kernels/__init__.py" in names
    assert "attnlab/constraints.txt" in names
    assert "attnlab/course/hints/01_soft_alignment.md" in names  # hint() reads them from the package
    assert not any(n.startswith("kernels/") for n in names), "kernels/ must ship inside attnlab/"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # torch, triton, ... come from the test environment (no download); attnlab only from the wheel
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    out = subprocess.run(
        [py, "-c", "import attnlab, attnlab.kernels as k; print(attnlab.__file__); print(k.__file__); "
                   "from attnlab.kernels import flash_attention; print(flash_attention.__name__)"],
        cwd=tmp_path, check=True, capture_output=True, text=True).stdout.split()
    assert out[0].startswith(site) and out[1].startswith(site), out
    assert out[1].endswith("attnlab/kernels/__init__.py")


def test_source_checkout_maps_kernels_to_the_top_level_folder():
    out = subprocess.run([sys.executable, "-c", "import attnlab.kernels as k; print(k.__file__)"],
                         cwd=ROOT, check=True, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout.strip()
    assert out == str(ROOT / "kernels" / "__init__.py")


def test_doctor_reports_a_healthy_environment(capsys):
    status = doctor.run()
    out = capsys.readouterr().out
    assert status == 0, out
    for name in ["python", "torch", "triton", "numpy", "ipywidgets", "jupyterlab", "gpu", "kernels run"]:
        assert name in out
    assert "the course can run" in out


def test_doctor_fails_without_torch_and_says_how_to_fix(monkeypatch, capsys):
    real = doctor._installed
    monkeypatch.setattr(doctor, "_installed", lambda name: None if name == "torch" else real(name))
    status = doctor.run()
    out = capsys.readouterr().out
    assert status == 1
    assert "problem: torch is not installed: fix: pip install -c attnlab/constraints.txt torch==2.13.0" in out


def test_doctor_warns_on_untested_versions(monkeypatch, capsys):
    real = doctor._installed
    monkeypatch.setattr(doctor, "_installed", lambda name: "3.1.0" if name == "triton" else real(name))
    status = doctor.run()
    out = capsys.readouterr().out
    assert status == 0  # an untested triton may still work: a warning, not a failure
    assert "warning: triton 3.1.0 is not the tested 3.8.0" in out
    assert "tested set   no" in out


def test_cli_runs_as_module_and_lists_commands():
    out = subprocess.run([sys.executable, "-m", "attnlab", "--help"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    for command in ["doctor", "lab", "grade", "start", "progress", "generate", "checkpoints", "gpt-checkpoint"]:
        assert command in out
    status = subprocess.run([sys.executable, "-m", "attnlab", "doctor"], cwd=ROOT,
                            capture_output=True, text=True)
    assert status.returncode == 0, status.stdout + status.stderr


def test_lab_finds_the_lessons_and_names_a_bad_dir(capsys):
    from attnlab import cli, lab

    assert lab.lessons_dir() == ROOT / "lessons"
    cmd = lab.command(ROOT / "lessons", no_browser=True)
    assert f"--ServerApp.root_dir={ROOT}" in cmd  # exercises/ and my-work/ are reachable from the lessons
    assert "--LabApp.default_url=/lab/tree/lessons/00_start_here.ipynb" in cmd
    assert "--no-browser" in cmd
    status = cli.main(["lab", "--dir", str(ROOT / "no-such-folder")])
    assert status == 2
    assert "--dir" in capsys.readouterr().err


def test_every_python_package_of_attnlab_is_shipped():
    # a package missing from pyproject's list works in the editable checkout and is absent from a wheel
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "attnlab").rglob("__init__.py")}
    assert found - listed == set()
