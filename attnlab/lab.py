"""``attnlab lab``: open JupyterLab on the lessons."""

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
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={folder.parent}", str(folder.name)]
    if args.no_browser:
        cmd.append("--no-browser")
    return subprocess.call(cmd, cwd=folder.parent)
