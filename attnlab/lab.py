"""``attnlab lab``: open JupyterLab on the lessons."""

import os
import shutil
import subprocess
import sys
from pathlib import Path


def lessons_dir():
    """The lessons folder of the checkout this attnlab comes from (None for a wheel without it)."""
    here = Path(__file__).resolve().parent.parent / "lessons"
    return here if here.is_dir() else None


def add_arguments(parser):
    parser.add_argument("--dir", default=None, help="folder to open (default: the course's lessons/)")
    parser.add_argument("--no-browser", action="store_true", help="start the server without opening a browser")


def run(args):
    folder = Path(args.dir) if args.dir else lessons_dir()
    if folder is None:
        print("error: --dir: no lessons folder found beside this attnlab; pass the course's lessons/ folder",
              file=sys.stderr)
        return 2
    if not folder.is_dir():
        print(f"error: --dir: {folder} is not a folder", file=sys.stderr)
        return 2
    if shutil.which("jupyter") is None and not Path(sys.executable).with_name("jupyter").exists():
        print("error: JupyterLab is not installed: fix: pip install -c attnlab/constraints.txt jupyterlab", file=sys.stderr)
        return 1
    return subprocess.call(command(folder, no_browser=args.no_browser), cwd=folder.parent)


def command(folder, no_browser=False):
    """The JupyterLab command line for a lessons folder.

    The server's root is the course folder (the lessons' parent), so the lessons' links to
    ../exercises and the learner's my-work/ resolve; the browser opens on the first lesson.
    """
    folder = Path(folder).resolve()
    start = folder / "00_start_here.ipynb"
    page = f"{folder.name}/{start.name}" if start.exists() else folder.name
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={folder.parent}",
           f"--LabApp.default_url=/lab/tree/{page}"]
    if no_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and cloud notebooks often run as root
        cmd.append("--allow-root")
    return cmd
