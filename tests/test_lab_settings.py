"""attnlab's JupyterLab settings and Jupyter server extension: saveState on, no news pop-up, root allowed,
saved widget state kept through every save; installed where every Lab and Notebook 7 of the environment reads them."""

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from attnlab import lab
from attnlab.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
STATE = lab.WIDGET_STATE_MIME
VIEW = lab.WIDGET_VIEW_MIME


def test_settings_turn_on_saved_widget_state_and_off_the_news_pop_up():
    settings = json.loads(lab.SETTINGS.read_text())
    assert settings["@jupyter-widgets/jupyterlab-manager:plugin"] == {"saveState": True}
    assert settings["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"  # "Never", not "Ask"


def test_server_config_enables_the_extension_that_the_module_provides():
    config = json.loads(lab.SERVER_CONFIG.read_text())
    assert config == {"ServerApp": {"jpserver_extensions": {"attnlab.lab": True}}}
    assert lab._jupyter_server_extension_points() == [{"module": "attnlab.lab"}]


def test_wheel_installs_the_same_files():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert ('[tool.setuptools.data-files]\n"share/jupyter/lab/settings/overrides.d" = ["attnlab/lab_settings/attnlab.json"]\n'
            '"etc/jupyter/jupyter_server_config.d" = ["attnlab/lab_settings/jupyter_server_config.d/attnlab.json"]'
            in pyproject)
    assert lab.settings_path("/p") == Path("/p/share/jupyter/lab/settings/overrides.d/attnlab.json")
    assert lab.server_config_path("/p") == Path("/p/etc/jupyter/jupyter_server_config.d/attnlab.json")


def test_install_settings_writes_once_and_leaves_other_overrides_alone(tmp_path):
    own = tmp_path / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    own.parent.mkdir(parents=True)
    own.write_text('{"@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"}}')
    done = lab.install_settings(tmp_path)
    assert [w for _, w in done] == [True, True]
    assert done[0][0].read_text() == lab.SETTINGS.read_text()
    assert done[1][0].read_text() == lab.SERVER_CONFIG.read_text()
    assert lab.install_settings(tmp_path) == [(p, False) for p, _ in done]
    assert "Dark" in own.read_text()


def test_install_settings_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert cli(["lab", "--install-settings"]) == 0
    assert capsys.readouterr().out.count("wrote:") == 2
    assert lab.settings_path().is_file() and lab.server_config_path().is_file()


# --- the saved widget state that a reopened notebook's next save would drop ---------------------------

def _model(name, **state):
    return {"model_name": name, "model_module": "@jupyter-widgets/controls", "model_module_version": "2.0.0",
            "state": state}


def _notebook(state, shown):
    """A notebook whose outputs show the models ``shown`` and whose saved widget state is ``state``."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("w", outputs=[nbformat.v4.new_output(
        "display_data", data={VIEW: {"model_id": m, "version_major": 2, "version_minor": 0}, "text/plain": "w"})])
        for m in shown]
    nb.metadata["widgets"] = {STATE: {"version_major": 2, "version_minor": 0, "state": state}}
    return nb


SAVED = {  # a VBox (shown) with a slider child and its own layout; a model no output shows
    "box": _model("VBoxModel", children=["IPY_MODEL_slider"], layout="IPY_MODEL_box_layout"),
    "slider": _model("IntSliderModel", value=3, layout="IPY_MODEL_slider_layout", style="IPY_MODEL_style"),
    "box_layout": _model("LayoutModel"), "slider_layout": _model("LayoutModel"), "style": _model("SliderStyleModel"),
    "orphan": _model("IntSliderModel", value=9),
}


def test_merge_puts_back_every_model_the_outputs_show_and_their_references():
    previous = _notebook(SAVED, ["box"])
    new = _notebook({}, ["box"])  # what the widget manager saves after a reopen: no live model, no state
    assert lab.merge_widget_state(new, previous) == 5
    assert new.metadata["widgets"][STATE]["state"] == {k: v for k, v in SAVED.items() if k != "orphan"}


def test_merge_keeps_what_the_kernel_saved_and_drops_what_no_output_shows():
    live = {"box": _model("VBoxModel", children=["IPY_MODEL_slider"], layout="IPY_MODEL_box_layout"),
            "slider": _model("IntSliderModel", value=5, layout="IPY_MODEL_slider_layout", style="IPY_MODEL_style"),
            "new": _model("IntSliderModel", value=1)}
    new = _notebook(dict(live), ["box", "new"])
    assert lab.merge_widget_state(new, _notebook(SAVED, ["box"])) == 3  # the two layouts and the style
    state = new.metadata["widgets"][STATE]["state"]
    assert state["slider"]["state"]["value"] == 5 and "new" in state and "orphan" not in state
    rerun = _notebook({"x": _model("IntSliderModel")}, ["x"])  # cells re-run: other models entirely
    assert lab.merge_widget_state(rerun, _notebook(SAVED, ["box"])) == 0
    assert set(rerun.metadata["widgets"][STATE]["state"]) == {"x"}


@pytest.mark.parametrize("previous", [None, "not json", {"cells": [], "metadata": {}}])
def test_merge_leaves_a_notebook_alone_without_saved_state(tmp_path, previous):
    from jupyter_server.services.contents.filemanager import FileContentsManager

    manager = FileContentsManager(root_dir=str(tmp_path))
    manager.register_pre_save_hook(lab.keep_widget_state)
    if previous is not None:
        (tmp_path / "n.ipynb").write_text(previous if isinstance(previous, str) else json.dumps(previous))
    manager.save({"type": "notebook", "format": "json", "content": _notebook({}, ["box"])}, "n.ipynb")
    assert json.loads((tmp_path / "n.ipynb").read_text())["metadata"]["widgets"][STATE]["state"] == {}


def test_a_save_through_the_jupyter_server_keeps_the_saved_widget_state(tmp_path):
    """The server's own contents manager, with the hook the extension registers: the reopened notebook's
    save (no live model) keeps the widgets its outputs show; a text file saves as usual."""
    from jupyter_server.services.contents.filemanager import FileContentsManager

    manager = FileContentsManager(root_dir=str(tmp_path))
    manager.register_pre_save_hook(lab.keep_widget_state)
    nbformat.write(_notebook(SAVED, ["box"]), tmp_path / "lesson.ipynb")
    manager.save({"type": "notebook", "format": "json", "content": _notebook({}, ["box"])}, "lesson.ipynb")
    saved = json.loads((tmp_path / "lesson.ipynb").read_text())["metadata"]["widgets"][STATE]["state"]
    assert set(saved) == set(SAVED) - {"orphan"}
    manager.save({"type": "file", "format": "text", "content": "hello"}, "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "hello"


class _FakeServer:
    def __init__(self, config):
        from jupyter_server.services.contents.filemanager import FileContentsManager
        from traitlets.config import Config

        self.config = Config(config)
        self.allow_root = False
        self.contents_manager = FileContentsManager()
        self.log = self.contents_manager.log


def test_extension_allows_root_unless_configured_and_registers_the_hook():
    server = _FakeServer({})
    lab._load_jupyter_server_extension(server)
    assert server.allow_root and lab.keep_widget_state in server.contents_manager._pre_save_hooks
    strict = _FakeServer({"ServerApp": {"allow_root": False}})  # the learner's own config wins
    lab._load_jupyter_server_extension(strict)
    assert strict.allow_root is False


# --- the README's routes start as root and not as root ---------------------------------------------------

def _start(route, user, tmp_path):
    """Start ``jupyter notebook`` or ``jupyter lab`` of this environment as the README types them (no
    --allow-root), as ``user`` ("me" or "nobody"); returns (process, url, log path)."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if user == "nobody":  # pytest's tmp_path sits in a folder only root may enter
        import tempfile

        tmp_path = Path(tempfile.mkdtemp(prefix="attnlab-route-"))
    home = tmp_path / f"{route}-{user}"
    (home / "lessons").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "IPYTHON"))}
    env.update(HOME=str(home), JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_CONFIG_DIR=str(home / "config"))
    cmd = [str(Path(sys.executable).with_name("jupyter")), route, "lessons/", "--no-browser", f"--port={port}",
           "--ip=127.0.0.1"]
    if user == "nobody":
        os.chmod(tmp_path, 0o777)
        for p in [home, *home.rglob("*")]:
            os.chmod(p, 0o777)
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    log = home / "log"
    proc = subprocess.Popen(cmd, cwd=home, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


def test_jupyter_notebook_and_lab_start_as_root_and_not_as_root(tmp_path):
    import os
    import shutil
    import time
    import urllib.error
    import urllib.request

    if not lab.server_config_path().is_file():
        pytest.fail(f"attnlab's server config is not installed at {lab.server_config_path()}: run `make env`")
    import subprocess

    users = ["me"]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("setpriv"):
        # root here: also start them as an ordinary user, where that user can run this environment's
        # Python (not where it lives in root's home, as pyenv's does)
        probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                str(Path(sys.executable).with_name("jupyter")), "notebook", "--version"],
                               capture_output=True, cwd="/")
        if probe.returncode == 0:
            users.append("nobody")
    started = {(route, user): _start(route, user, tmp_path) for route in ("notebook", "lab") for user in users}
    try:
        for (route, user), (proc, url, log) in started.items():
            deadline = time.time() + 120
            while True:
                try:
                    urllib.request.urlopen(f"{url}/api/status", timeout=2)
                    break
                except urllib.error.HTTPError:  # 403 without the token: the server is up
                    break
                except OSError:
                    assert proc.poll() is None and time.time() < deadline, \
                        f"jupyter {route} as {user} did not start:\n{log.read_text()[-3000:]}"
                    time.sleep(0.5)
            text = log.read_text()
            assert "Running as root is not recommended" not in text
            assert "attnlab.lab | extension was successfully loaded" in text, text[-3000:]
    finally:
        for proc, _, _ in started.values():
            proc.terminate()
        for proc, _, _ in started.values():
            try:
                proc.wait(timeout=20)
            except Exception:
                proc.kill()


def test_make_tests_nbgrader_extra_leaves_the_learners_lab_as_make_lab_opens_it():
    # after `make test`, Lab showed nbgrader's menu, Validate button and Create Assignment panel, and the server
    # warned of a missing nbgrader_config.py: the Makefile installs nbgrader with its extensions switched off
    import importlib.util

    if importlib.util.find_spec("nbgrader") is None or not (Path(sys.prefix) / ".nbgrader-installed").exists():
        pytest.skip("nbgrader was not installed by the Makefile's nbgrader-env (make test)")
    jupyter = str(Path(sys.executable).with_name("jupyter"))
    lab = subprocess.run([jupyter, "labextension", "list"], capture_output=True, text=True, timeout=120)
    server = subprocess.run([jupyter, "server", "extension", "list"], capture_output=True, text=True, timeout=120)
    lines = [line for line in (lab.stdout + lab.stderr + server.stdout + server.stderr).splitlines()
             if "nbgrader" in line and "abled" in line]
    assert lines and all("disabled" in line for line in lines), "\n".join(lines)
