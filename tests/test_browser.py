"""The four widgets in a real browser: JupyterLab on localhost, driven by headless Chromium.

Starts JupyterLab (random free port, no token) in a temporary folder with a
notebook that shows all four widgets, opens it in Debian's Chromium through
Python Playwright, runs all cells, checks that every widget rendered (no "Error
displaying widget", no "model not found"), changes a control and sees the
picture change. Screenshots go to test-artifacts/ (and, with
ATTNLAB_UPDATE_DOCS_IMG=1, to docs/img/ for the README).

Without Chromium or Playwright the test is skipped with the reason, except when
the environment variable CI is set: then it fails.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"
DOCS_IMG = REPO / "docs" / "img"
CHROMIUM = os.environ.get("ATTNLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]

# class name of each widget's DOM node (attnlab-<class name in lower case>) -> notebook variable
WIDGETS = {
    "attnlab-attentionmap": "amap",
    "attnlab-scalingexplorer": "scaling",
    "attnlab-memorytraffic": "traffic",
    "attnlab-blockmaskeditor": "editor",
}

NOTEBOOK_CELLS = [
    """\
import torch
from attnlab.widgets import AttentionMap, ScalingExplorer, MemoryTraffic, BlockMaskEditor
from attnlab.memory import trace
from attnlab.kernels import standard_attention, flash_attention, block_sparse_attention, local_mask
torch.manual_seed(0)""",
    """\
tokens = "the cat sat on the mat because it was warm".split()
x = torch.randn(2, 4, len(tokens), 16)  # (layers, heads, N, d)
weights = torch.softmax(x @ x.transpose(-2, -1) / 4, dim=-1)
amap = AttentionMap(weights, query_tokens=tokens)
amap""",
    """\
scaling = ScalingExplorer(d_k=64)
scaling""",
    """\
q, k, v = (torch.randn(1, 1, 64, 16) for _ in range(3))
traffic = MemoryTraffic(
    trace(standard_attention, q, k, v, block_m=16, block_n=16),
    trace(flash_attention, q, k, v, block_m=16, block_n=16),
    trace(block_sparse_attention, q, k, v, local_mask(64, 64, 16, (16, 16))),
    labels=["standard", "flash", "block-sparse"])
traffic.step.value = 40
traffic""",
    """\
editor = BlockMaskEditor(8, 8, preset="local")
editor""",
]


def _reason_unavailable():
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (install it: apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python Playwright is not installed (pip install playwright)"
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook(path):
    cells = [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [], "source": src}
             for i, src in enumerate(NOTEBOOK_CELLS)]
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))


@pytest.fixture
def jupyterlab(tmp_path):
    reason = _reason_unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"browser test cannot run in CI: {reason}")
        pytest.skip(reason)
    work = tmp_path / "lab"
    work.mkdir()
    _notebook(work / "widgets.ipynb")
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # keep the learner's own Jupyter settings and workspaces out of it (and it out of them)
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                     ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                     ("IPYTHONDIR", "ipython")):
        env[var] = str(tmp_path / sub)
    # no "get notified about Jupyter news?" toast over the widgets, no update check (and no network)
    notification = tmp_path / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notification.parent.mkdir(parents=True)
    notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    log = open(tmp_path / "jupyterlab.log", "w")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           "--IdentityProvider.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
           "--LabApp.extension_manager=readonly",
           f"--ServerApp.root_dir={work}", "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI runners often run as root
        cmd.append("--allow-root")
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    log.flush()
                    pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _image_src(page, cls):
    return page.locator(f".{cls} img").first.get_attribute("src")


def test_widgets_render_and_respond_in_jupyterlab(jupyterlab):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 2400})
            console = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.goto(f"{jupyterlab}/lab/tree/widgets.ipynb", timeout=60_000)
            page.wait_for_function("window.jupyterapp !== undefined && window.jupyterapp.shell.currentWidget"
                                   " && window.jupyterapp.shell.currentWidget.context !== undefined", timeout=60_000)
            # wait for the kernel, then run everything
            page.wait_for_function(
                "() => { const w = window.jupyterapp.shell.currentWidget;"
                " const k = w.sessionContext.session && w.sessionContext.session.kernel;"
                " return k && k.status === 'idle'; }", timeout=60_000)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            for cls in WIDGETS:
                page.locator(f".{cls} img").first.wait_for(state="visible", timeout=90_000)
            page.wait_for_function(
                "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'",
                timeout=60_000)
            text = page.locator(".jp-Notebook").inner_text()
            page.screenshot(path=str(ARTIFACTS / "notebook.png"), full_page=True)
            assert "Error displaying widget" not in text, text[-2000:]
            assert "model not found" not in text, text[-2000:]
            assert "Traceback" not in text, text[-3000:]
            for cls in WIDGETS:
                node = page.locator(f".{cls}").first
                node.scroll_into_view_if_needed()
                box = node.bounding_box()
                assert box and box["width"] > 200 and box["height"] > 150, (cls, box)
                src = _image_src(page, cls)
                assert src, f"{cls}: the picture has no source"
                node.screenshot(path=str(ARTIFACTS / f"{cls}.png"))
                if os.environ.get("ATTNLAB_UPDATE_DOCS_IMG"):
                    DOCS_IMG.mkdir(parents=True, exist_ok=True)
                    node.screenshot(path=str(DOCS_IMG / f"{cls.removeprefix('attnlab-')}.png"))

            # change a control as a learner would: pick head 2 in the attention map
            before = _image_src(page, "attnlab-attentionmap")
            page.locator(".attnlab-attentionmap select").nth(1).select_option(label="head 2")
            page.wait_for_function(
                "(before) => document.querySelector('.attnlab-attentionmap img').getAttribute('src') !== before",
                arg=before, timeout=30_000)
            # and click a tile of the block-mask editor: its picture changes too
            before = _image_src(page, "attnlab-blockmaskeditor")
            page.locator(".attnlab-blockmaskeditor .widget-toggle-button").nth(7).click()
            page.wait_for_function(
                "(before) => document.querySelector('.attnlab-blockmaskeditor img').getAttribute('src') !== before",
                arg=before, timeout=30_000)
            # the play button of the memory-traffic replay drives its step slider, and the kernel redraws
            before = _image_src(page, "attnlab-memorytraffic")
            page.locator(".attnlab-memorytraffic .widget-play button").first.click()
            page.wait_for_function(
                "(before) => document.querySelector('.attnlab-memorytraffic img').getAttribute('src') !== before",
                arg=before, timeout=30_000)
            page.locator(".attnlab-memorytraffic .widget-play button").nth(1).click()  # pause
            page.locator(".attnlab-attentionmap").first.screenshot(path=str(ARTIFACTS / "attentionmap-head2.png"))
            page.locator(".attnlab-blockmaskeditor").first.screenshot(path=str(ARTIFACTS / "blockmaskeditor-clicked.png"))
            for cls in WIDGETS:  # no redraw failed (a failing redraw writes "error:" in the widget's status line)
                assert "error:" not in page.locator(f".{cls}").first.inner_text(), cls
        finally:
            browser.close()
