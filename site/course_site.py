"""The course website: one home for its settings and for the pages generated at build time.

Used by ``site/build.py`` (``make site``), ``site/conf.py`` (Sphinx) and
``site/colab_cell.py`` (the install cell of every lesson). Run nothing from here.

Settings (environment variables, read once at import):

* ``ATTNLAB_REPO_URL``: the repository the course is published from, a
  ``https://github.com/OWNER/REPO`` URL. Used by the lessons' "open in Colab" links and by
  the Colab install cell. Without it the site links to no repository at all (no Colab button, no source links,
  no header icon: a placeholder address would be a dead link), and ``site/build.py`` says so.
* ``ATTNLAB_REPO_BRANCH``: the branch those links open (default ``main``).
"""

import os
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER_URL = "https://github.com/OWNER/attnlab"
REPO_URL = os.environ.get("ATTNLAB_REPO_URL", "").strip().rstrip("/") or PLACEHOLDER_URL
REPO_BRANCH = os.environ.get("ATTNLAB_REPO_BRANCH", "").strip() or "main"
PUBLISHED = REPO_URL != PLACEHOLDER_URL   # the site links to the repository only when it has an address
UNPUBLISHED_NOTE = ("ATTNLAB_REPO_URL is not set: the site has no 'open in Colab', source or repository links. "
                    "Set it to the course's https://github.com/OWNER/REPO to have them.")

# the library API pages: (page name, title, modules documented on it)
API_PAGES = [
    ("attention", "Reference attention in PyTorch",
     ["attnlab.attention", "attnlab.tiled", "attnlab.approx", "attnlab.linear_attention"]),
    ("kernels", "Triton kernels: attnlab.kernels",
     ["attnlab.kernels", "attnlab.kernels.vector_add", "attnlab.kernels.softmax",
      "attnlab.kernels.standard_attention", "attnlab.kernels.flash_attention",
      "attnlab.kernels.block_mask", "attnlab.kernels.block_sparse_attention", "attnlab.kernels.flash_decode",
      "attnlab.kernels.delta_rule", "attnlab.kernels.selected_attention"]),
    ("memory", "Memory traffic: tracing and the IO model", ["attnlab.memory", "attnlab.iomodel", "attnlab.traffic"]),
    ("widgets", "Widgets", ["attnlab.widgets", "attnlab.widgets.attention_map", "attnlab.widgets.scaling",
                            "attnlab.widgets.memory_traffic", "attnlab.widgets.block_mask_editor"]),
    ("models", "Models and data", ["attnlab.models.transformer", "attnlab.models.seq2seq", "attnlab.data.toy",
                                   "attnlab.data.translation", "attnlab.pretrained", "attnlab.train", "attnlab.bleu"]),
    ("measure", "Measuring and showing", ["attnlab.measure", "attnlab.show"]),
    ("grading", "Grading", ["attnlab.grading", "attnlab.grading.checks"]),
]

PACKAGES_THAT_REEXPORT = {"attnlab.kernels", "attnlab.widgets", "attnlab.grading"}

# what of MathJax's es5 tree the site serves from _static/mathjax (the rest is unused):
# the combined TeX component, the fonts it loads, and what it loads on demand
MATHJAX_PARTS = ["tex-mml-chtml.js", "input/tex/extensions", "output/chtml/fonts/woff-v2", "ui", "a11y"]


def github_owner_repo(url=None):
    """``(owner, repo)`` of a github.com repository URL, or a ValueError naming ATTNLAB_REPO_URL."""
    url = REPO_URL if url is None else url
    m = re.fullmatch(r"https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?", url)
    if not m:
        raise ValueError(f"ATTNLAB_REPO_URL must be a https://github.com/OWNER/REPO URL (Colab opens notebooks "
                         f"from GitHub), got {url!r}")
    return m.group(1), m.group(2)


def colab_url(path, url=None, branch=None):
    """The "open in Colab" URL of ``path`` (relative to the repository root, e.g. ``lessons/07_x.ipynb``)."""
    owner, repo = github_owner_repo(url)
    return f"https://colab.research.google.com/github/{owner}/{repo}/blob/{branch or REPO_BRANCH}/{path}"


def source_url(path, url=None, branch=None):
    """The page of ``path`` in the repository."""
    owner, repo = github_owner_repo(url)
    return f"https://github.com/{owner}/{repo}/blob/{branch or REPO_BRANCH}/{path}"


def readme_sections(text):
    """README.md as ``(preamble, {heading: body})``, split at its ``## `` headings (code blocks respected)."""
    preamble, sections, current, lines, fenced = None, {}, None, [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            if current is None:
                preamble = "\n".join(lines)
            else:
                sections[current] = "\n".join(lines)
            current, lines = line[3:].strip(), []
        else:
            lines.append(line)
    if current is None:
        preamble = "\n".join(lines)
    else:
        sections[current] = "\n".join(lines)
    return preamble, sections


def home_page(readme, lessons, exercises):
    """The site's index.md: README's title and introduction and its course table, then the navigation."""
    preamble, sections = readme_sections(readme)
    if "The course" not in sections:
        raise ValueError("README.md has no '## The course' section to make the home page from")
    title, _, intro = preamble.strip().partition("\n")
    if not title.startswith("# "):
        raise ValueError("README.md must start with a '# ' title")
    # the first paragraph of the introduction is the course in a nutshell
    intro = intro.strip().split("\n\n")[0]
    out = [
        "<!-- generated from README.md by site/course_site.py at build time: edit README.md, not this -->",
        title, "", intro, "",
        "## The course", "", sections["The course"].strip(), "",
        "Read the lessons here with their stored outputs, or run them: each lesson page links its notebook "
        "and opens it in Colab; on your own machine `make lab` installs the tested versions and opens "
        "JupyterLab on the lessons.", "",
    ]
    toc = [("Lessons", lessons), ("Exercises", exercises), ("Guides", ["docs/grading", "docs/widgets"]),
           ("Library", ["api/index"])]
    for caption, docs in toc:
        out += [f"```{{toctree}}", f":caption: {caption}", ":maxdepth: 1", "", *docs, "```", ""]
    return "\n".join(out)


def api_index():
    lines = ["# The library: attnlab", "",
             "Generated from the docstrings. Tensors are `(batch, heads, seq, head_dim)` everywhere.", "",
             "```{eval-rst}", ".. automodule:: attnlab", "```", "",
             "```{toctree}", ":maxdepth: 2", "", *[name for name, _, _ in API_PAGES], "```", ""]
    return "\n".join(lines)


def api_page(title, modules):
    lines = [f"# {title}", ""]
    for mod in modules:
        # a package that re-exports its submodules' names (attnlab.kernels, .widgets, .grading) gets
        # its docstring only: the names are documented once, in the submodule that defines them
        options = [] if mod in PACKAGES_THAT_REEXPORT else ["   :members:", "   :show-inheritance:"]
        lines += [f"## `{mod}`", "", "```{eval-rst}", f".. automodule:: {mod}", *options, "```", ""]
    return "\n".join(lines)


def _write_if_changed(path, data):
    """Write ``data`` (str or bytes) unless the file already holds it: unchanged files keep their
    modification time, so Sphinx rebuilds only what changed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = data.encode() if isinstance(data, str) else data
    if path.exists() and path.read_bytes() == data:
        return False
    path.write_bytes(data)
    return True


def _sync(files, dest, keep=()):
    """Make folder ``dest`` hold exactly ``files`` (by name) plus the names in ``keep``."""
    dest.mkdir(parents=True, exist_ok=True)
    names = set()
    for f in files:
        names.add(f.name)
        _write_if_changed(dest / f.name, f.read_bytes())
    for old in dest.iterdir():
        if old.name not in names and old.name not in keep:
            shutil.rmtree(old) if old.is_dir() else old.unlink()


def stage(srcdir, root=ROOT):
    """Lay out the site's sources in ``srcdir``: copies of lessons/, exercises/, docs/ and the
    generated home and API pages. The repository itself is never written."""
    srcdir = Path(srcdir)
    lessons = sorted((root / "lessons").glob("*.ipynb"))
    exercises = sorted((root / "exercises").glob("*.ipynb"))
    docs = sorted((root / "docs").glob("*.md"))
    _sync(lessons, srcdir / "lessons")
    _sync(exercises, srcdir / "exercises")
    _sync(docs, srcdir / "docs", keep={"img"})
    _sync(sorted((root / "docs" / "img").glob("*")), srcdir / "docs" / "img")
    _write_if_changed(srcdir / "index.md", home_page(
        (root / "README.md").read_text(encoding="utf-8"),
        [f"lessons/{p.stem}" for p in lessons], [f"exercises/{p.stem}" for p in exercises]))
    _write_if_changed(srcdir / "api" / "index.md", api_index())
    for name, title, modules in API_PAGES:
        _write_if_changed(srcdir / "api" / f"{name}.md", api_page(title, modules))
    return srcdir


def mathjax_dir():
    """MathJax 3's es5 folder from the pip package django-static-mathjax (only static files: the
    package needs no Django to be read from)."""
    import importlib.util

    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("MathJax is not installed: pip install -c attnlab/constraints.txt -e '.[docs]'")
    es5 = Path(list(spec.submodule_search_locations)[0]) / "static" / "mathjax" / "es5"
    if not (es5 / "tex-mml-chtml.js").exists():
        raise RuntimeError(f"no MathJax es5 build at {es5}: reinstall the docs extra")
    return es5


def copy_mathjax(dest):
    """Copy the parts of MathJax the pages use to ``dest`` (served locally: nothing from a CDN)."""
    es5 = mathjax_dir()
    for part in MATHJAX_PARTS:
        src = es5 / part
        if src.is_dir():
            shutil.copytree(src, dest / part, dirs_exist_ok=True)
        else:
            (dest / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / part)
    shutil.copy2(es5.parent / "LICENSE", dest / "LICENSE")
