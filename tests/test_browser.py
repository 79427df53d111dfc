"""The widgets and the lessons in a real browser: JupyterLab and Notebook 7 on localhost, driven by headless Chromium.

Starts JupyterLab (random free port, no token) in a temporary folder, opens notebooks in
Debian's Chromium through Python Playwright and checks what a learner meets:

- the four widgets render and respond (no "Error displaying widget", no "model not found");
  at 1280 x 800 each fits the screen (bounding boxes asserted), at 1024 px wide with the file
  browser open each is still readable; sliders show their track, table columns stay apart,
  ``show_source`` listings scroll instead of wrapping mid-word;
- run, save, close, shut the kernel down and reopen; wait until the widget manager marks the
  reopened notebook modified, save (what the autosave would do), reopen in Notebook 7, save,
  reopen in JupyterLab: every widget still shows its picture each time, from the widget state
  the install makes Lab save and attnlab's server extension keeps (a notebook with all four
  widgets, and lessons 00 and 03 executed with their widget state); no broken-link icon on the
  controls, BlockMaskEditor's tiles in their 8 rows;
- at 1024 px wide every table column of a widget is in view;
- opening and saving an unrun lesson leaves the file byte for byte as it was
  (``attnlab.notebook_format``).

Screenshots go to test-artifacts/ (and, with ATTNLAB_UPDATE_DOCS_IMG=1, to docs/img/ for the
docs). Without Chromium or Playwright the tests are skipped with the reason, except when the
environment variable CI is set: then they fail.
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
    """\
from attnlab.show import show_source
import attnlab.tiled
show_source(attnlab.tiled._forward_reference)""",
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


def _data_dir(work):
    return work.parent / "data"


def _notebook(path):
    cells = [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [], "source": src}
             for i, src in enumerate(NOTEBOOK_CELLS)]
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))


@pytest.fixture
def jupyterlab(tmp_path):
    """(url, folder): a JupyterLab server (which also serves Notebook 7) on an empty folder, with the
    environment's own app settings (attnlab's overrides.d) and throwaway user settings."""
    reason = _reason_unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"browser test cannot run in CI: {reason}")
        pytest.skip(reason)
    from attnlab.lab import server_config_path, settings_path

    for path in (settings_path(), server_config_path()):
        if not path.is_file():
            pytest.fail(f"attnlab's Lab settings are not installed at {path}: run `make env` "
                        "(or `attnlab lab --install-settings`)")
    work = tmp_path / "lab"
    work.mkdir()
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # keep the learner's own Jupyter settings and workspaces out of it (and it out of them)
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                     ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                     ("IPYTHONDIR", "ipython")):
        env[var] = str(tmp_path / sub)
    # the notebook trust database (a lesson executed by the test is signed into it); the "get notified
    # about Jupyter news?" pop-up is off through attnlab's own settings override, as in a learner's Lab
    env["JUPYTER_DATA_DIR"] = str(_data_dir(work))
    log = open(tmp_path / "jupyterlab.log", "w")
    from attnlab.lab import BOOT  # how `attnlab lab` starts it

    cmd = [*BOOT, "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           "--IdentityProvider.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
           "--LabApp.extension_manager=readonly",
           f"--ServerApp.root_dir={work}", "--LabApp.expose_app_in_browser=True",
           "--JupyterNotebookApp.expose_app_in_browser=True", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    # no --allow-root: attnlab's server extension allows root (containers and CI runners often run as root)
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    log.flush()
                    pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url, work
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


CURRENT = "window.jupyterapp.shell.currentWidget"


def _open_in_lab(page, url, path):
    """Open ``path`` in JupyterLab and wait until its kernel is idle."""
    page.goto(f"{url}/lab/tree/{path}", timeout=90_000)
    page.wait_for_function(f"window.jupyterapp !== undefined && {CURRENT} && {CURRENT}.context !== undefined"
                           f" && {CURRENT}.context.isReady", timeout=90_000)
    _wait_idle(page)


def _wait_idle(page, timeout=90_000):
    page.wait_for_function(
        f"() => {{ const w = {CURRENT}; const k = w.sessionContext.session && w.sessionContext.session.kernel;"
        " return k && k.status === 'idle'; }", timeout=timeout)


def _lab_command(page, js):
    page.evaluate(f"async () => {{ await ({js}); return null; }}")


def _image_src(page, cls):
    return page.locator(f".{cls} img").first.get_attribute("src")


def _widget_report(page, cls):
    """Measurements of one widget's DOM: its box, its pictures (rendered vs natural CSS width), slider tracks,
    table cells that overflow, and whether it is wider than its output area."""
    return page.evaluate("""(cls) => {
        const node = document.querySelector('.' + cls);
        const r = node.getBoundingClientRect();
        const area = node.closest('.jp-OutputArea-output') || node.parentElement;
        const imgs = [...node.querySelectorAll('img')].filter(i => i.offsetParent !== null).map(i => ({
            shown: i.getBoundingClientRect().width, css: parseFloat(i.style.width) || i.naturalWidth / 2,
            natural: i.naturalWidth}));
        const tracks = [...node.querySelectorAll('.slider-container')].filter(t => t.offsetParent !== null)
            .map(t => t.getBoundingClientRect().width);
        const overflowing = [...node.querySelectorAll('td, th')].filter(c => c.scrollWidth > c.clientWidth + 1)
            .map(c => c.textContent);
        const tight = [...node.querySelectorAll('tr')].flatMap(tr => {
            const cells = [...tr.children];
            return cells.slice(0, -1).filter(c => c.textContent.trim() && parseFloat(getComputedStyle(c).paddingRight) < 4)
                .map(c => c.textContent);
        });
        // tables that do not fit their panel scroll sideways inside it: their last columns are cut
        const cut = [...node.querySelectorAll('table')].filter(t => t.offsetParent !== null).filter(t => {
            const right = t.getBoundingClientRect().right;
            for (let el = t.parentElement; el && el !== node.parentElement; el = el.parentElement) {
                if (getComputedStyle(el).overflowX !== 'visible' && right > el.getBoundingClientRect().right + 1) return true;
            }
            return right > node.getBoundingClientRect().right + 1;
        }).map(t => t.rows[0].textContent);
        return {x: r.x, y: r.y, width: r.width, height: r.height, area_width: area.getBoundingClientRect().width,
                scroll_overflow: node.scrollWidth - node.clientWidth, imgs, tracks, overflowing, tight, cut};
    }""", cls)


def _run_all(page):
    page.evaluate(f"{CURRENT}.content.activeCellIndex = 0")
    _lab_command(page, "window.jupyterapp.commands.execute('notebook:run-all-cells')")
    for cls in WIDGETS:
        page.locator(f".{cls} img").first.wait_for(state="visible", timeout=120_000)
    page.wait_for_function(f"() => {CURRENT}.sessionContext.session.kernel.status === 'idle'", timeout=120_000)


def _assert_no_widget_errors(text):
    assert "Error displaying widget" not in text, text[-2000:]
    assert "model not found" not in text, text[-2000:]
    assert "Traceback" not in text, text[-3000:]


def test_widgets_fit_the_screen_render_and_respond_in_jupyterlab(jupyterlab, browser):
    url, work = jupyterlab
    _notebook(work / "widgets.ipynb")
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    console = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    _open_in_lab(page, url, "widgets.ipynb")
    if not page.evaluate("window.jupyterapp.shell.leftCollapsed"):  # 1280 x 800 with the side bar closed
        _lab_command(page, "window.jupyterapp.commands.execute('application:toggle-left-area')")
    _run_all(page)
    _assert_no_widget_errors(page.locator(".jp-Notebook").inner_text())

    # 1280 x 800, side bar closed: every widget fits the screen at full size
    boxes = {}
    for cls in WIDGETS:
        node = page.locator(f".{cls}").first
        node.scroll_into_view_if_needed()
        rep = _widget_report(page, cls)
        boxes[cls] = rep
        node.screenshot(path=str(ARTIFACTS / f"{cls}-1280x800.png"))
        if os.environ.get("ATTNLAB_UPDATE_DOCS_IMG"):
            DOCS_IMG.mkdir(parents=True, exist_ok=True)
            node.screenshot(path=str(DOCS_IMG / f"{cls.removeprefix('attnlab-')}.png"))
        # (ipywidgets' 2 px margins around a 100%-wide child make a box 4 px wider than its content: allowed)
        assert 200 < rep["width"] <= rep["area_width"] + 1 and rep["scroll_overflow"] <= 4, (cls, rep)
        assert 150 < rep["height"] <= 720, (cls, rep)  # 800 less JupyterLab's menu, tool and status bars
        for img in rep["imgs"]:
            assert img["natural"] >= 2 * img["css"] - 2, (cls, img)       # twice the pixels ...
            assert abs(img["shown"] - img["css"]) <= 2, (cls, img)        # ... shown at CSS size
        assert all(w >= 100 for w in rep["tracks"]), (cls, rep["tracks"])  # the whole slider track, not a stub
        assert not rep["overflowing"] and not rep["tight"], (cls, rep)     # table columns stay apart
        assert _image_src(page, cls), f"{cls}: the picture has no source"

    # the show_source listing scrolls sideways instead of wrapping
    pre = page.locator(".jp-OutputArea-output pre").filter(has_text="def _forward_reference").first
    pre.scroll_into_view_if_needed()
    listing = pre.evaluate("""(p) => ({ws: getComputedStyle(p).whiteSpace, height: p.clientHeight,
                                       line: parseFloat(getComputedStyle(p).lineHeight), lines: p.textContent.split('\\n').length})""")
    assert listing["ws"] == "pre", listing
    assert listing["height"] <= (listing["lines"] + 1) * listing["line"], listing  # no line broke in two

    # 1024 px wide with the file browser open: nothing wider than the notebook, pictures still readable
    page.set_viewport_size({"width": 1024, "height": 800})
    _lab_command(page, "window.jupyterapp.commands.execute('filebrowser:activate')")
    page.wait_for_timeout(1500)
    assert not page.evaluate("window.jupyterapp.shell.leftCollapsed")
    for cls in WIDGETS:
        node = page.locator(f".{cls}").first
        node.scroll_into_view_if_needed()
        rep = _widget_report(page, cls)
        boxes[cls + "@1024"] = rep
        node.screenshot(path=str(ARTIFACTS / f"{cls}-1024-sidebar.png"))
        assert rep["width"] <= rep["area_width"] + 1 and rep["scroll_overflow"] <= 4, (cls, rep)
        for img in rep["imgs"]:
            assert img["shown"] >= 0.7 * img["css"], (cls, img)  # shrunk at most to 70%: text stays readable
        assert not rep["cut"], (cls, rep["cut"])  # every table column in view (MemoryTraffic's counters)
    (ARTIFACTS / "widget-boxes.json").write_text(json.dumps(boxes, indent=1))
    page.set_viewport_size({"width": 1280, "height": 800})

    # change a control as a learner would: pick head 2 in the attention map
    before = _image_src(page, "attnlab-attentionmap")
    page.locator(".attnlab-attentionmap select").nth(1).select_option(label="head 2")
    page.wait_for_function(
        "(before) => document.querySelector('.attnlab-attentionmap img').getAttribute('src') !== before",
        arg=before, timeout=30_000)
    # the query selector names position and token
    options = page.locator(".attnlab-attentionmap select").nth(2).evaluate("s => [...s.options].map(o => o.text)")
    assert "3: on" in [o.replace("\xa0", " ") for o in options], options
    # click a tile of the block-mask editor: its picture changes too
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
    # the SRAM study is folded away; one click opens it
    page.locator(".attnlab-memorytraffic .jupyter-widget-Collapse-header, .attnlab-memorytraffic .lm-AccordionPanel-title,"
                 " .attnlab-memorytraffic .widget-collapse-header, .attnlab-memorytraffic .p-Collapse-header").first.click()
    page.locator(".attnlab-memorytraffic img").nth(1).wait_for(state="visible", timeout=30_000)
    page.locator(".attnlab-memorytraffic").first.screenshot(path=str(ARTIFACTS / "memorytraffic-sram-open.png"))
    page.locator(".attnlab-attentionmap").first.screenshot(path=str(ARTIFACTS / "attentionmap-head2.png"))
    page.locator(".attnlab-blockmaskeditor").first.screenshot(path=str(ARTIFACTS / "blockmaskeditor-clicked.png"))
    for cls in WIDGETS:  # no redraw failed (a failing redraw writes "error:" in the widget's status line)
        assert "error:" not in page.locator(f".{cls}").first.inner_text(), cls


def _saved_state(path):
    nb = json.loads(path.read_text())
    return nb["metadata"].get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})


def _shown_models(path):
    """The model ids of the widget views in a notebook's stored outputs."""
    nb = json.loads(path.read_text())
    return [o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for c in nb["cells"]
            for o in c.get("outputs", []) if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]


def _broken_link_icons(page):
    """Controls inside attnlab's widgets that show ipywidgets' broken-link icon (a view without a kernel)."""
    return page.evaluate("""() => [...document.querySelectorAll('.attnlab-widget .jupyter-widgets-disconnected')]
        .filter(e => getComputedStyle(e, '::before').display !== 'none').length""")


def _open_saved(page, url, where, path, n_widgets):
    """Open a saved notebook in JupyterLab or Notebook 7 and wait until its ``n_widgets`` widgets show a picture."""
    page.goto(f"{url}/{'lab/tree' if where == 'jupyterlab' else 'notebooks'}/{path}", timeout=90_000)
    try:
        page.wait_for_function("(n) => [...document.querySelectorAll('.attnlab-widget img')]"
                               ".filter(i => i.getAttribute('src')).length >= n", arg=n_widgets, timeout=180_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / f"timeout-{where}-{Path(path).stem}.png"))
        raise


def _reopen_save_reopen(browser, url, work, name, n_widgets, shot):
    """Open a saved notebook (kernel gone), wait until the widget manager marks it modified, save it, then
    reopen it in Notebook 7 (save again) and in JupyterLab: every widget each time, no "model not found"."""
    path = work / name
    shown = set(_shown_models(path))
    assert shown and shown <= set(_saved_state(path)), "the notebook's outputs show widgets its state lacks"
    for i, where in enumerate(("jupyterlab", "notebook7", "jupyterlab")):
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        _open_saved(page, url, where, name, n_widgets)
        if i < 2:
            # the widget manager marks the notebook modified as it restores each saved model (its
            # setDirty); the next save, the learner's or the autosave, then writes only live models
            page.wait_for_function(f"() => {CURRENT} && {CURRENT}.context && {CURRENT}.context.model.dirty",
                                   timeout=60_000)
            page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
            before = path.stat().st_mtime_ns
            page.keyboard.press("Control+s")
            deadline = time.time() + 60
            while path.stat().st_mtime_ns == before and time.time() < deadline:
                time.sleep(0.5)
            assert path.stat().st_mtime_ns != before, f"{where}: Ctrl+S did not save {name}"
            assert shown <= set(_saved_state(path)), f"{where}: the save dropped the widget state of {name}"
        text = page.locator(".jp-Notebook").first.inner_text()
        page.screenshot(path=str(ARTIFACTS / f"{shot}-open{i}-{where}.png"), full_page=True)
        _assert_no_widget_errors(text)
        assert _broken_link_icons(page) == 0, f"{where}: broken-link icons on the controls of {name}"
        page.close()


def test_saved_lesson_keeps_its_widgets_in_jupyterlab_and_notebook_7(jupyterlab, browser):
    """Run, save, close, shut the kernel down; reopen, let it turn modified, save, reopen twice (Notebook 7
    and JupyterLab): the widgets come back from the saved widget state every time."""
    url, work = jupyterlab
    _notebook(work / "widgets.ipynb")
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    _open_in_lab(page, url, "widgets.ipynb")
    _run_all(page)
    _lab_command(page, f"{CURRENT}.context.save()")
    assert len(_saved_state(work / "widgets.ipynb")) > 10, \
        "JupyterLab saved no widget state: is attnlab's overrides.d/attnlab.json installed?"
    _lab_command(page, f"{CURRENT}.sessionContext.shutdown()")
    _lab_command(page, "window.jupyterapp.commands.execute('application:close-all')")
    page.close()
    _reopen_save_reopen(browser, url, work, "widgets.ipynb", len(WIDGETS), "reopened")
    # BlockMaskEditor's 8 x 8 tiles stay 8 rows (a broken-link icon on each tile wrapped them onto a ninth)
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    _open_saved(page, url, "jupyterlab", "widgets.ipynb", len(WIDGETS))
    page.wait_for_function("() => document.querySelectorAll('.attnlab-blockmaskeditor .widget-toggle-button').length"
                           " >= 64", timeout=60_000)  # the tiles' views come after the pictures
    rows = page.evaluate("""() => new Set([...document.querySelectorAll('.attnlab-blockmaskeditor .widget-toggle-button')]
        .map(b => Math.round(b.getBoundingClientRect().top))).size""")
    assert rows == 8, f"BlockMaskEditor's tiles wrap onto {rows} rows"
    for cls in WIDGETS:
        assert _image_src(page, cls), f"{cls} shows no picture after reopening"
    page.close()


# two lessons with widgets, short to execute (their widget cells: AttentionMap and ScalingExplorer)
SAVED_LESSONS = ["00_start_here.ipynb", "03_scaled_dot_product.ipynb"]


@pytest.mark.parametrize("name", SAVED_LESSONS)
def test_a_saved_lesson_keeps_its_widgets_through_every_save(jupyterlab, browser, name):
    """A lesson executed with its widget state stored (as a learner's Run All and save leaves it) and trusted:
    open, turn modified, save, reopen twice, in JupyterLab and Notebook 7: every widget, every time."""
    import nbclient
    import nbformat
    from nbformat.sign import NotebookNotary

    url, work = jupyterlab
    (work / "lessons").mkdir()
    nb = nbformat.read(REPO / "lessons" / name, as_version=4)
    env_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env_path
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", store_widget_state=True,
                                resources={"metadata": {"path": str(REPO / "lessons")}}).execute()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old
    NotebookNotary(data_dir=str(_data_dir(work))).sign(nb)
    nbformat.write(nb, work / "lessons" / name)
    n_widgets = len(_shown_models(work / "lessons" / name))
    assert n_widgets >= 1, f"{name} shows no widget"
    _reopen_save_reopen(browser, url, work, f"lessons/{name}", n_widgets, name.removesuffix(".ipynb"))


def test_opening_and_saving_an_unrun_lesson_changes_nothing(jupyterlab, browser):
    url, work = jupyterlab
    lesson = REPO / "lessons" / "00_start_here.ipynb"
    (work / "lessons").mkdir()
    copy = work / "lessons" / lesson.name
    shutil.copyfile(lesson, copy)
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    _open_in_lab(page, url, f"lessons/{lesson.name}")
    page.wait_for_timeout(2000)  # let Lab copy the kernel's spec and language_info into the model
    _lab_command(page, f"{CURRENT}.context.save()")
    page.close()
    assert copy.read_bytes() == lesson.read_bytes(), "JupyterLab rewrote the lesson: run python -m attnlab.notebook_format"
