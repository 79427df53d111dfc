"""The course as a website (``make site``) and the Colab install cell of every lesson.

- site/build.py builds the site with warnings as errors, from the stored outputs;
- the home page is README.md's course table, each lesson page links its notebook and
  Colab (with the one ATTNLAB_REPO_URL setting), widgets show their stored PNG, exercise
  pages carry no solution, the API pages document every name attnlab exports;
- no page loads anything from another host: checked in the HTML and CSS, and in headless
  Chromium, which also checks that the figures and the math of four pages load;
- every lesson's first code cell is the Colab install cell, which does nothing elsewhere.

The build runs in a subprocess, as ``make site`` runs it. Without Sphinx (the docs extra)
or Chromium the tests that need them are skipped with the reason, except when the
environment variable CI is set: then they fail.
"""

import base64
import functools
import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SITE = REPO / "site"
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = os.environ.get("ATTNLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]
TEST_REPO_URL = "https://github.com/example-org/attnlab-course"
LESSONS = sorted((REPO / "lessons").glob("*.ipynb"))
EXERCISES = sorted((REPO / "exercises").glob("*.ipynb"))


def _load(name):
    """Import site/<name>.py (site/ is a folder of scripts, not a package)."""
    if str(SITE) not in sys.path:
        sys.path.insert(0, str(SITE))
    spec = importlib.util.spec_from_file_location(name, SITE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _unavailable(reason):
    if os.environ.get("CI"):
        pytest.fail(f"the site test cannot run in CI: {reason}")
    pytest.skip(reason)


# --- the Colab install cell (fast: no Sphinx) -------------------------------------------------

colab_cell = _load("colab_cell")
course_site = _load("course_site")


def _code_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_lesson_starts_with_the_colab_install_cell(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    first = _code_cells(nb)[0]
    source = "".join(first["source"])
    assert first.get("id") == colab_cell.CELL_ID, f"{path.name}: run python site/colab_cell.py"
    assert 'if "google.colab" in sys.modules:' in source
    assert sum(colab_cell._is_install_cell(c) for c in nb["cells"]) == 1
    # a repository to clone only when ATTNLAB_REPO_URL was set at build time; else the learner's upload
    cloned = re.search(r'"git", "clone", "--depth", "1", "(\S+)", "attnlab"', source)
    url = cloned.group(1) if cloned else None
    assert url != course_site.PLACEHOLDER_URL and (cloned or "files.upload()" in source)
    # current with the script (for the URL it was written with): the script would change nothing
    assert not colab_cell.process(path, repo_url=url, check=True), f"{path.name}: run python site/colab_cell.py"
    # and it installs as the README's Colab cell does
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert 'pip install -q -c attnlab/attnlab/constraints.txt -e "./attnlab[lab]"' in readme
    assert "pip install -q -c attnlab/attnlab/constraints.txt -e './attnlab[lab]'" in source
    assert "%cd attnlab/lessons" in readme and 'os.chdir("/content/attnlab/lessons")' in source


def test_colab_cell_does_nothing_outside_colab(tmp_path):
    code = colab_cell.cell_source(TEST_REPO_URL) + "\nimport os\nprint(os.getcwd())\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path)  # printed nothing of its own, stayed where it was
    assert list(tmp_path.iterdir()) == []       # cloned nothing


def test_colab_cell_without_a_repository_installs_the_uploaded_zip(tmp_path):
    # Colab faked: google.colab.files.upload() "uploads" a zip of a course folder (GitHub's layout:
    # one top folder); /content is a temporary folder, and pip and the restart are stubbed
    course = tmp_path / "src" / "attnlab-main"
    (course / "lessons").mkdir(parents=True)
    (course / "pyproject.toml").write_text("[project]\nname = 'attnlab'\n")
    content = tmp_path / "content"
    content.mkdir()
    shutil.make_archive(str(tmp_path / "attnlab"), "zip", tmp_path / "src")
    fake = tmp_path / "fake" / "google"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "colab.py").write_text(
        "import shutil\nclass files:\n    @staticmethod\n    def upload():\n"
        f"        shutil.copy({str(tmp_path / 'attnlab.zip')!r}, '.')\n"   # Colab saves into the working folder
        "        return {'attnlab.zip': b''}\n")
    code = colab_cell.cell_source()
    assert "files.upload()" in code and "git" not in code.split("pip install")[0].replace("git archive", "")
    code = (code.replace("/content", str(content)).replace("pip install -q", "true pip install -q")
            .replace("os.kill(os.getpid(), 9)", "pass"))
    code = "import google.colab\n" + code + "\nprint(os.getcwd())\n"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    out = subprocess.run([sys.executable, "-c", code], cwd=content, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(content / "attnlab" / "lessons")
    assert (content / "attnlab" / "pyproject.toml").is_file()


def test_colab_cell_script_inserts_updates_and_is_idempotent(tmp_path):
    lesson = LESSONS[-1]
    nb = json.loads(lesson.read_text(encoding="utf-8"))
    others = [c for c in nb["cells"] if not colab_cell._is_install_cell(c)]
    nb["cells"] = others
    path = tmp_path / lesson.name
    path.write_text(colab_cell._dump(nb), encoding="utf-8")

    assert colab_cell.main([str(path)]) == 0
    written = json.loads(path.read_text(encoding="utf-8"))
    first_code = _code_cells(written)[0]
    assert first_code["id"] == colab_cell.CELL_ID and TEST_REPO_URL not in "".join(first_code["source"])
    assert [c for c in written["cells"] if c is not first_code and c.get("id") != colab_cell.CELL_ID] == others
    before = path.read_bytes()
    assert not colab_cell.process(path)            # a second run changes nothing
    assert path.read_bytes() == before
    assert colab_cell.main([str(path), "--check"]) == 0

    # another repository URL: the cell is rewritten in place, never duplicated
    assert colab_cell.process(path, repo_url=TEST_REPO_URL)
    updated = json.loads(path.read_text(encoding="utf-8"))
    assert len(updated["cells"]) == len(written["cells"])
    assert TEST_REPO_URL in "".join(_code_cells(updated)[0]["source"])
    assert colab_cell.main([str(path), "--check"]) == 1  # the default URL's cell differs: --check says so


def test_repo_url_setting_makes_colab_links_or_names_itself():
    assert (course_site.colab_url("lessons/07_flash_attention.ipynb", url=TEST_REPO_URL, branch="main")
            == "https://colab.research.google.com/github/example-org/attnlab-course/blob/main/"
               "lessons/07_flash_attention.ipynb")
    assert course_site.github_owner_repo("https://github.com/a/b.git") == ("a", "b")
    with pytest.raises(ValueError, match="ATTNLAB_REPO_URL"):
        course_site.colab_url("lessons/x.ipynb", url="https://gitlab.com/a/b")


def test_home_page_is_generated_from_the_readme():
    readme = "# course\n\nIntro line.\n\nMore.\n\n## Quick start\n\nx\n\n## The course\n\n| a |\n|---|\n| [l](lessons/01_x.ipynb) |\n\n## After\n\ny\n"
    page = course_site.home_page(readme, ["lessons/01_x"], ["exercises/01_x"])
    assert page.splitlines()[1] == "# course" and "Intro line." in page and "More." not in page
    assert "| [l](lessons/01_x.ipynb) |" in page and "Quick start" not in page and "After" not in page
    with pytest.raises(ValueError, match="The course"):
        course_site.home_page("# t\n\nno table\n", [], [])


def test_a_site_built_without_a_repository_address_links_to_no_placeholder(monkeypatch):
    # `make site` on a fresh clone, ATTNLAB_REPO_URL unset: no link to github.com/OWNER/attnlab (the Colab button,
    # the source link, the header icon), and build.py says why they are missing
    env = {k: v for k, v in os.environ.items() if k not in ("ATTNLAB_REPO_URL", "ATTNLAB_REPO_BRANCH")}
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'site'); import conf, course_site; "
                          "print(course_site.PUBLISHED, conf.html_theme_options)"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("False") and "repository" not in out.stdout, out.stdout
    conf = _load("conf")
    monkeypatch.setattr(conf.course_site, "PUBLISHED", False)
    source = [json.dumps({"cells": [{"cell_type": "markdown", "source": "# Lesson\ntext", "metadata": {}}],
                          "metadata": {}})]
    conf._prepare_notebook(None, "lessons/07_flash_attention", source)
    page = json.loads(source[0])["cells"][0]["source"]
    assert "download the notebook" in page and "OWNER" not in page and "Colab" not in page and "source" not in page
    assert "ATTNLAB_REPO_URL" in conf.course_site.UNPUBLISHED_NOTE


def test_widget_outputs_become_their_picture_on_the_site():
    conf = _load("conf")
    view = {"model_id": "abc", "version_major": 2, "version_minor": 0}
    nb = {"metadata": {"widgets": {"application/vnd.jupyter.widget-state+json": {"state": {"abc": {}}}}},
          "cells": [{"cell_type": "code", "outputs": [
              {"output_type": "display_data", "metadata": {},
               "data": {conf.WIDGET_VIEW: view, "image/png": "iVBO", "text/html": "<div>", "text/plain": "VBox()"}},
              {"output_type": "execute_result", "metadata": {}, "data": {"text/html": "<table>", "text/plain": "t"}}]}]}
    conf._widgets_as_pictures(nb)
    widget, table = nb["cells"][0]["outputs"]
    assert widget["data"] == {"image/png": "iVBO", "text/plain": "VBox()"}
    assert table["data"] == {"text/html": "<table>", "text/plain": "t"}  # other outputs as they are
    assert "widgets" not in nb["metadata"]


# --- the built site ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    for module in ("sphinx", "myst_nb", "sphinx_book_theme", "mathjax"):
        if importlib.util.find_spec(module) is None:
            _unavailable(f"{module} is not installed (make docs-env, or pip install -e '.[docs]')")
    dest = tmp_path_factory.mktemp("site")
    env = dict(os.environ, ATTNLAB_REPO_URL=TEST_REPO_URL, ATTNLAB_REPO_BRANCH="main")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(SITE / "build.py"), "--dir", str(dest), "--strict"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    assert out.returncode == 0, f"the site build failed (warnings are errors):\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    print(f"site built in {seconds:.1f} s")
    return dest / "html"


def _pages(root):
    return sorted(root.rglob("*.html"))


class _Resources(HTMLParser):
    """Every URL a page loads by itself (not the links a reader may follow)."""

    LOADING = {"script": ["src"], "img": ["src", "srcset"], "iframe": ["src"], "source": ["src", "srcset"],
               "video": ["src", "poster"], "audio": ["src"], "embed": ["src"], "object": ["data"],
               "track": ["src"], "input": ["src"]}

    def __init__(self):
        super().__init__()
        self.urls, self.images, self.anchors = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "link" and attrs.get("href"):  # stylesheets, preloads, icons, fonts
            self.urls.append(attrs["href"])
        for name in self.LOADING.get(tag, []):
            if attrs.get(name):
                self.urls += [part.strip().split(" ")[0] for part in attrs[name].split(",")]
        if tag == "img":
            self.images.append(attrs.get("src"))
        if tag == "a" and attrs.get("href"):
            self.anchors.append(attrs["href"])
        if "style" in attrs:
            self.urls += re.findall(r"url\(\s*['\"]?([^'\")]+)", attrs["style"])


def _parse(path):
    parser = _Resources()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _external(url):
    return bool(re.match(r"^(https?:)?//", url.strip(), re.I))


@pytest.mark.slow  # builds the site once for the module (about 15 s of CPU)
def test_site_has_every_lesson_exercise_guide_and_api_page(site):
    for path in LESSONS:
        assert (site / "lessons" / f"{path.stem}.html").exists(), path.name
    for path in EXERCISES:
        assert (site / "exercises" / f"{path.stem}.html").exists(), path.name
    for path in (REPO / "docs").glob("*.md"):
        assert (site / "docs" / f"{path.stem}.html").exists(), path.name
    for name, _, _ in course_site.API_PAGES:
        assert (site / "api" / f"{name}.html").exists(), name
    assert not (site / "solutions").exists()


@pytest.mark.slow  # builds the site once for the module (about 15 s of CPU)
def test_home_page_is_the_readme_course_table(site):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    _, sections = course_site.readme_sections(readme)
    index = (site / "index.html").read_text(encoding="utf-8")
    text = html.unescape(re.sub(r"<[^>]+>", "", index)).replace("\u2019", "'")  # Sphinx's smart quotes
    anchors = _parse(site / "index.html").anchors
    rows = re.findall(r"^\| (\d\d) \| \[([^]]+)\]\(lessons/([^)]+)\.ipynb\) \| ([^|]+) \|", sections["The course"], re.M)
    assert len(rows) == len(LESSONS)
    for number, title, stem, what in rows:
        assert f"lessons/{stem}.html" in anchors, f"the home page does not link lesson {number}"
        # the row's text as written in the README (markup stripped)
        assert re.sub(r"`", "", what.strip()) in text, what


@pytest.mark.slow  # builds the site once for the module (about 15 s of CPU)
def test_lesson_pages_link_their_notebook_and_colab(site):
    for path in LESSONS:
        page = site / "lessons" / f"{path.stem}.html"
        anchors = _parse(page).anchors
        colab = course_site.colab_url(f"lessons/{path.name}", url=TEST_REPO_URL, branch="main")
        assert colab in anchors, f"{page.name} has no open-in-Colab link {colab}"
        downloads = [a for a in anchors if a.endswith(f"/{path.name}") and "_downloads/" in a]
        assert downloads, f"{page.name} does not link its notebook"
        # the notebook offered is the lesson as stored, Colab cell included
        assert (page.parent / downloads[0]).resolve().read_bytes() == path.read_bytes()


def _pngs(nb):
    return [o["data"]["image/png"] for c in nb["cells"] for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})]


def _widget_outputs(nb):
    return sum("application/vnd.jupyter.widget-view+json" in o.get("data", {})
               for c in nb["cells"] for o in c.get("outputs", []))


@pytest.mark.slow  # builds the site once for the module (about 15 s of CPU)
def test_lessons_show_every_stored_figure_and_widget_pictures(site):
    widgets = 0
    for path in LESSONS:
        nb = json.loads(path.read_text(encoding="utf-8"))
        widgets += _widget_outputs(nb)
        page = site / "lessons" / f"{path.stem}.html"
        shown = [src for src in _parse(page).images if "_images/" in src]
        stored = _pngs(nb)
        assert len(shown) == len(stored), f"{page.name}: {len(shown)} pictures on the page, {len(stored)} stored"
        # the very pictures: each stored PNG is a file the page shows
        shown_bytes = {(page.parent / src).resolve().read_bytes() for src in shown}
        for png in stored:
            assert base64.b64decode(png) in shown_bytes
        text = page.read_text(encoding="utf-8")
        assert "widget-view+json" not in text and "embed-amd" not in text and "require.js" not in text
    assert widgets > 0  # the lessons do hold widget outputs, and their PNGs are among the pictures above


@pytest.mark.slow  # builds the site once for the module (about 15 s of CPU)
def test_no_page_loads_anything_from_another_host(site):
    found = []
    for page in _pages(site):
        found += [f"{page.relative_to(site)}: {url}" for url in _parse(page).urls if _external(url)]
    for css in site.rglob("*.css"):
        for url in re.findall(r"url\(\s*['\"]?([^'\")]+)", css.read_text(encoding="utf-8", errors="replace")):
            if _external(url):
                found.append(f"{css.relative_to(site)}: {url}")
        found += [f"{css.relative_to(site)}: @import {u}" for u in
                  re.findall(r"@import\s+['\"]((?:https?:)?//[^'\"]+)", css.read_text(errors="replace"))]
    assert not found, "resources from other hosts:\n" + "\n".join(found[:40])
    # MathJax is served by the site itself
    assert (site / "_static" / "mathjax" / "tex-mml-chtml.js").exists()
    scripts = [u for u in _parse(site / "lessons" / f"{LESSONS[-1].stem}.html").urls if "mathjax" in u.lower()]
    assert scripts == ["../_static/mathjax/tex-mml-chtml.js"]


def _solution_lines(path):
    """Lines of the solution regions of a solutions/ notebook (what the exercises leave out)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    lines, inside = [], False
    for cell in _code_cells(nb):
        for line in "".join(cell["source"]).splitlines():
            if "BEGIN SOLUTION" in line:
                inside = True
            elif "END SOLUTION" in line:
                inside = False
            elif inside:
                lines.append(line.strip())
    return lines


@pytest.mark.slow  # builds the site once for the module (about 15 s of CPU)
def test_exercise_pages_hold_no_solution(site):
    everything = "\n".join(html.unescape(re.sub(r"<[^>]+>", "", p.read_text(encoding="utf-8")))
                           for p in _pages(site / "exercises"))
    checked = 0
    # a line that some exercise gives the learner (e.g. `with torch.no_grad():` in a given helper) is public
    public = "\n".join(path.read_text(encoding="utf-8") for path in EXERCISES)
    for path in EXERCISES:
        page = (site / "exercises" / f"{path.stem}.html").read_text(encoding="utf-8")
        assert "YOUR CODE HERE" in page
        for line in _solution_lines(REPO / "solutions" / path.name):
            if len(line) > 20 and not line.startswith("#") and json.dumps(line)[1:-1] not in public:
                checked += 1
                assert line not in everything, f"{path.name}: a solution line is on the site: {line!r}"
    assert checked > 0


@pytest.mark.slow  # builds the site once for the module (about 15 s of CPU)
def test_api_pages_document_every_exported_name(site):
    import attnlab
    import attnlab.kernels as kernels

    text = "".join(p.read_text(encoding="utf-8") for p in (site / "api").glob("*.html"))
    names = [(n, getattr(attnlab, n)) for n in attnlab._EXPORTS] + [(n, getattr(kernels, n)) for n in kernels.__all__]
    missing = [f"{obj.__module__}.{obj.__qualname__}" for _, obj in names
               if f'id="{obj.__module__}.{obj.__qualname__}"' not in text]
    assert not missing, f"not in the API pages: {missing}"


# --- the site in a browser --------------------------------------------------------------------

@pytest.fixture
def served(site):
    reason = None
    if not Path(CHROMIUM).exists():
        reason = f"no Chromium at {CHROMIUM} (install it: apt-get install chromium)"
    elif importlib.util.find_spec("playwright") is None:
        reason = "Python Playwright is not installed (pip install playwright)"
    if reason:
        _unavailable(reason)

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", site
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
@pytest.mark.browser
def test_pages_load_their_figures_and_math_from_this_site_only(served):
    """Four pages served over HTTP on localhost, and a lesson opened as a file, as a reader of
    build/site/html may: every picture loads, all math is typeset with fonts from the site, no
    request goes elsewhere, nothing fails, the console shows no error."""
    from playwright.sync_api import sync_playwright

    served, site = served
    local = (served + "/", site.as_uri() + "/")
    lesson07 = next(p for p in LESSONS if p.name.startswith("07_"))
    figures07 = len(_pngs(json.loads(lesson07.read_text(encoding="utf-8"))))
    pages = {  # page -> how many pictures it must show at least
        f"{served}/index.html": 0,
        f"{served}/lessons/{lesson07.stem}.html": figures07,
        f"{served}/docs/widgets.html": len(list((REPO / "docs" / "img").glob("*.png"))),
        f"{served}/api/kernels.html": 0,
        (site / "lessons" / f"{lesson07.stem}.html").as_uri(): figures07,
    }
    ARTIFACTS.mkdir(exist_ok=True)
    outside, failed, errors = [], [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 800})

            def route(r):  # record and refuse anything not from this site
                url = r.request.url
                if url.startswith(local) or url.startswith(("data:", "blob:", "about:")):
                    r.continue_()
                else:
                    outside.append(url)
                    r.abort()

            context.route("**/*", route)
            page = context.new_page()
            page.on("requestfailed", lambda req: failed.append(f"{req.url}: {req.failure}"))
            page.on("response", lambda res: res.status >= 400 and failed.append(f"{res.url}: HTTP {res.status}"))
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(str(e)))
            for url, at_least in pages.items():
                name = url.split("/html/")[-1] if url.startswith("file:") else url.removeprefix(served + "/")
                page.goto(url, wait_until="load", timeout=60_000)
                page.evaluate("document.querySelectorAll('img[loading=lazy]').forEach(i => i.loading = 'eager')")
                page.wait_for_function("Array.from(document.images).every(i => i.complete)", timeout=30_000)
                images = page.evaluate(
                    "Array.from(document.images).map(i => [i.getAttribute('src'), i.naturalWidth])")
                assert len(images) >= at_least, (name, images)
                broken = [src for src, width in images if width == 0]
                assert not broken, f"{name}: pictures that did not load: {broken}"
                maths = page.evaluate("document.querySelectorAll('.math').length")
                assert maths > 0 or not name.startswith("lessons/"), f"{name}: no math found"
                if maths:
                    page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=30_000)
                    page.evaluate("MathJax.startup.promise")
                    typeset = page.evaluate(
                        "[document.querySelectorAll('.math').length, document.querySelectorAll('.math mjx-container').length,"
                        " document.querySelectorAll('mjx-merror').length]")
                    assert typeset[0] == typeset[1] and typeset[2] == 0, f"{name}: math not typeset: {typeset}"
                page.wait_for_load_state("networkidle", timeout=30_000)
                page.evaluate("document.fonts.ready.then(() => true)")
                bad_fonts = page.evaluate(
                    "Array.from(document.fonts).filter(f => f.status === 'error').map(f => f.family)")
                assert not bad_fonts, f"{name}: fonts that did not load: {bad_fonts}"
                kind = "file-" if url.startswith("file:") else ""
                page.screenshot(path=str(ARTIFACTS / f"site-{kind}{Path(name).stem}.png"))
        finally:
            browser.close()
    assert not outside, f"requests to other hosts: {outside}"
    assert not failed, f"requests that failed: {failed}"
    assert not errors, f"errors in the browser console: {errors}"
