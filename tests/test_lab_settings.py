"""attnlab's JupyterLab settings: saveState on, installed where every Lab and Notebook 7 of the environment reads them."""

import json
import sys
from pathlib import Path

from attnlab import lab
from attnlab.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent


def test_settings_turn_on_saved_widget_state():
    settings = json.loads(lab.SETTINGS.read_text())
    assert settings == {"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": True}}


def test_wheel_installs_the_same_file_into_overrides_d():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert ('[tool.setuptools.data-files]\n"share/jupyter/lab/settings/overrides.d" = ["attnlab/lab_settings/attnlab.json"]'
            in pyproject)
    assert lab.settings_path("/p") == Path("/p/share/jupyter/lab/settings/overrides.d/attnlab.json")


def test_install_settings_writes_once_and_leaves_other_overrides_alone(tmp_path):
    own = tmp_path / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    own.parent.mkdir(parents=True)
    own.write_text('{"@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}')
    path, written = lab.install_settings(tmp_path)
    assert written and path.read_text() == lab.SETTINGS.read_text()
    assert lab.install_settings(tmp_path) == (path, False)
    assert "Dark" in own.read_text()


def test_install_settings_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert cli(["lab", "--install-settings"]) == 0
    assert "wrote:" in capsys.readouterr().out
    assert lab.settings_path().is_file()
