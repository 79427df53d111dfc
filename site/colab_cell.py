"""Give every lesson a first code cell that installs the course in Google Colab, and does nothing elsewhere.

    python site/colab_cell.py            # insert or update the cell in lessons/*.ipynb
    python site/colab_cell.py --check    # exit 1 (and say which) if a lesson lacks it or has an old one
    python site/colab_cell.py PATH...    # other notebooks

The cell installs the course when ``google.colab`` is imported, i.e. only in Colab (get the
course's folder, pip install the tested versions, cd into lessons/); anywhere else it returns
at once, prints nothing and touches nothing. How it gets the folder depends on the one setting
ATTNLAB_REPO_URL (see site/course_site.py), the same the site's "open in Colab" links use: set
at build time, the cell clones that repository; unset, there is no public address to clone,
and the cell unzips a zip of the course folder that the learner uploads (it asks for one). Idempotent: the cell is found by its id (``colab-install``) and rewritten only
when its text differs; the rest of the notebook is written back byte for byte as read.
"""

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import course_site  # noqa: E402

CELL_ID = "colab-install"
MARKER = "# Colab only:"


def cell_source(repo_url=None):
    """The install cell's code. With a repository URL (``repo_url``, else ATTNLAB_REPO_URL set at
    build time) it clones that repository; without one (the placeholder) it installs the course
    from a zip of its folder that the learner uploads, since there is no public address to clone."""
    url = repo_url or course_site.REPO_URL
    if url == course_site.PLACEHOLDER_URL:
        fetch = f'''\
        # No public address yet: upload the course folder as a zip (attnlab.zip; in a clone of it,
        # `git archive -o attnlab.zip HEAD` makes one) to Colab's Files panel, or pick it when asked.
        import glob
        import zipfile

        zips = sorted(glob.glob("/content/attnlab*.zip"))
        if not zips:
            from google.colab import files
            print("Choose the course's zip (attnlab.zip: the course folder, zipped) to upload.")
            zips = [os.path.abspath(name) for name in files.upload()]   # saved in the working folder
        zipfile.ZipFile(zips[0]).extractall("/content/attnlab-upload")
        top = [os.path.dirname(p) for p in glob.glob("/content/attnlab-upload/**/pyproject.toml", recursive=True)]
        if not top:
            raise FileNotFoundError(f"{{zips[0]}} holds no course folder (no pyproject.toml in it)")
        os.rename(min(top, key=len), "/content/attnlab")'''
    else:
        fetch = f'''\
        subprocess.run(["git", "clone", "--depth", "1", "{url}", "attnlab"], check=True, cwd="/content")'''
    return f'''\
{MARKER} install the course. Elsewhere this cell does nothing.
import sys

if "google.colab" in sys.modules:
    import os
    import subprocess

    if not os.path.isdir("/content/attnlab"):
{fetch}
        subprocess.run("pip install -q -c attnlab/attnlab/constraints.txt -e './attnlab[lab]'",
                       shell=True, check=True, cwd="/content")
        # Colab's preinstalled torch was replaced by the tested one: restart the runtime once
        print("attnlab is installed; the runtime restarts now. Then run the notebook again (Runtime > Run all).")
        os.kill(os.getpid(), 9)
    os.chdir("/content/attnlab/lessons")'''


def _is_install_cell(cell):
    return cell.get("id") == CELL_ID or (
        cell["cell_type"] == "code" and "".join(cell["source"]).startswith(MARKER))


def update(nb, repo_url=None):
    """Insert or refresh the install cell in notebook dict ``nb`` (in place): one cell, with the
    current text, first among the code cells. Returns True if anything changed."""
    source = cell_source(repo_url).splitlines(keepends=True)  # as Jupyter stores it: a list of lines
    cells = nb["cells"]
    found = [i for i, c in enumerate(cells) if _is_install_cell(c)]
    first_code = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"), len(cells))
    if found == [first_code]:
        cell = cells[first_code]
        if cell["source"] == source and cell.get("id") == CELL_ID and not cell.get("outputs"):
            return False
        cell.update(source=source, outputs=[], execution_count=None, id=CELL_ID)
        return True
    for i in reversed(found):  # a stray copy (moved or duplicated) goes; the one cell is inserted anew
        del cells[i]
    first_code = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"), len(cells))
    cells.insert(first_code, {"cell_type": "code", "execution_count": None, "id": CELL_ID, "metadata": {},
                              "outputs": [], "source": source})
    return True


def _dump(nb):
    # as nbformat and JupyterLab write notebooks: one-space indent, sorted keys, UTF-8, final newline
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def process(path, repo_url=None, check=False):
    """Update the notebook at ``path``; returns True if it changed (or, with ``check``, would)."""
    path = Path(path)
    nb = json.loads(path.read_text(encoding="utf-8"))
    changed = update(nb, repo_url)
    if changed and not check:
        path.write_text(_dump(nb), encoding="utf-8")
    return changed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", help="default: lessons/*.ipynb")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook needs the cell")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((course_site.ROOT / "lessons").glob("*.ipynb"))
    changed = [p for p in paths if process(p, check=args.check)]
    for p in changed:
        print(f"{'needs the Colab cell' if args.check else 'Colab cell written'}: {p}")
    if args.check and changed:
        print("run: python site/colab_cell.py", file=sys.stderr)
        return 1
    if not changed:
        print(f"{len(paths)} notebooks already have the current Colab cell ({course_site.REPO_URL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
