"""Sphinx configuration of the course website (``make site``; see site/build.py).

The sources are staged by site/build.py into build/site/src (copies of lessons/,
exercises/, docs/ and pages generated from README.md and the docstrings); this file is
read from site/ with ``sphinx-build -c site``. Notebooks are rendered from their stored
outputs and never executed. Nothing is fetched from another host when a page is viewed:
widgets show the PNG stored beside their widget view, MathJax is served from _static.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the attnlab in this checkout, for autodoc

import course_site  # noqa: E402

project = "attnlab"
author = "the attnlab authors"
copyright = "the attnlab authors, MIT licence"
root_doc = "index"

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.viewcode"]
exclude_patterns = ["**/.ipynb_checkpoints", "_static"]

# --- notebooks: stored outputs only ---------------------------------------------------------
nb_execution_mode = "off"
nb_merge_streams = True
# a widget output holds its widget view and an image/png of the widget: never render the view
# (it would need the widget manager's JavaScript from a CDN), so the PNG is shown
nb_mime_priority_overrides = [(builder, "application/vnd.jupyter.widget-view+json", None)
                              for builder in ("html", "dirhtml", "singlehtml")]
nb_ipywidgets_js = {}
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# --- math: MathJax 3 served from this site (copied from the django-static-mathjax wheel) ------
mathjax_path = "mathjax/tex-mml-chtml.js"  # in _static; see _copy_mathjax below

# --- API from docstrings ----------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_default_options = {"undoc-members": False}
autodoc_typehints = "none"  # signatures stay as written; types are in the docstrings

# --- HTML -----------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "attnlab: the attention course"
html_theme_options = {"show_toc_level": 2}
if course_site.PUBLISHED:   # else no repository button: it would open github.com/OWNER/attnlab
    html_theme_options.update(repository_url=course_site.REPO_URL, repository_branch=course_site.REPO_BRANCH,
                              use_repository_button=True)
# the lessons' figures are drawn for a white page (matplotlib's defaults); a reader can still
# switch to dark in the header
html_context = {"default_mode": "light"}
html_show_sphinx = False


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _widgets_as_pictures(nb):
    """A widget output shows its stored PNG and nothing else (the bundle may also carry text/html,
    which myst-nb would rank above the PNG); saved widget state is dropped (no widget manager
    runs on the site, and the state would be embedded in the page)."""
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW in data and "image/png" in data:
                output["data"] = {k: v for k, v in data.items() if k in ("image/png", "text/plain")}


def _prepare_notebook(app, docname, source):
    """Lessons and exercises as the site shows them: widgets as their pictures, and under the
    title the notebook's download and "open in Colab" links (exercise pages: how to grade).

    Done to the page while it is read; the staged notebook (and so the downloaded file) is
    the notebook exactly as stored.
    """
    import json

    folder, _, name = docname.partition("/")
    if folder not in ("lessons", "exercises") or not source or not source[0].lstrip().startswith("{"):
        return
    nb = json.loads(source[0])
    _widgets_as_pictures(nb)
    path = f"{folder}/{name}.ipynb"
    links = [f"[download the notebook](path:{name}.ipynb)"]
    if folder == "lessons" and course_site.PUBLISHED:
        links.append(f"[open in Colab]({course_site.colab_url(path)}) (its first code cell installs the course "
                     "there, as the README's Colab cell does)")
    elif folder != "lessons":
        links.append("run it with `attnlab start` (copies the exercises to my-work/) and check it with "
                     "`attnlab grade`: see [grading](../docs/grading.md)")
    if course_site.PUBLISHED:
        links.append(f"[source]({course_site.source_url(path)})")
    note = "\n\n:::{note}\n**Run it yourself:** " + " · ".join(links) + "\n:::\n\n"
    cells = nb["cells"]
    first = cells[0] if cells else None
    text = "".join(first["source"]) if first and first["cell_type"] == "markdown" else ""
    if text.startswith("# "):  # right under the title
        title, _, rest = text.partition("\n")
        first["source"] = title + note + rest
    else:
        cells.insert(0, {"cell_type": "markdown", "id": "attnlab-site-links", "metadata": {}, "source": note})
    source[0] = json.dumps(nb)


def _copy_mathjax(app, exception):
    if exception is None and app.builder.format == "html":
        course_site.copy_mathjax(Path(app.outdir) / "_static" / "mathjax")


def setup(app):
    app.connect("source-read", _prepare_notebook)
    app.connect("build-finished", _copy_mathjax)
