"""``attnlab lab``: open JupyterLab on the lessons, with the course's Lab settings installed.

The settings (``attnlab/lab_settings/attnlab.json``: the widget manager saves widget state
in notebooks, so a lesson that was run, saved and reopened still shows its widgets) go to
``{sys.prefix}/share/jupyter/lab/settings/overrides.d/attnlab.json``, where JupyterLab and
Notebook 7 of this environment read them, whoever starts them. A wheel install puts the file
there itself; an editable install (``make env``) does not, so ``make env`` and
``attnlab lab`` write it (``attnlab lab --install-settings`` only writes it).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path


def lessons_dir():
    """The lessons folder of the checkout this attnlab comes from (None for a wheel without it)."""
    here = Path(__file__).resolve().parent.parent / "lessons"
    return here if here.is_dir() else None


SETTINGS = Path(__file__).resolve().parent / "lab_settings" / "attnlab.json"


def settings_path(prefix=None):
    """Where JupyterLab and Notebook 7 of the environment at ``prefix`` (default ``sys.prefix``) read attnlab's settings."""
    return Path(prefix or sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.d" / SETTINGS.name


def install_settings(prefix=None):
    """Write attnlab's Lab settings into the environment at ``prefix`` (default ``sys.prefix``) unless they are there.

    Touches only attnlab's own file in ``overrides.d/`` (a learner's ``overrides.json`` and
    user settings stay as they are, and win). Returns ``(path, written)``.
    """
    target = settings_path(prefix)
    text = SETTINGS.read_text(encoding="utf-8")
    if target.is_file() and target.read_text(encoding="utf-8") == text:
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    return target, True


def add_arguments(parser):
    parser.add_argument("--dir", default=None, help="folder to open (default: the course's lessons/)")
    parser.add_argument("--no-browser", action="store_true", help="start the server without opening a browser")
    parser.add_argument("--install-settings", action="store_true",
                        help="only install the course's JupyterLab settings into this environment, then exit")


def run(args):
    if args.install_settings:
        try:
            path, written = install_settings()
        except OSError as exc:
            print(f"error: --install-settings: cannot write {settings_path()}: {exc}", file=sys.stderr)
            return 1
        print(f"{'wrote' if written else 'up to date'}: {path}")
        return 0
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
    try:
        install_settings()
    except OSError as exc:  # a read-only environment: Lab still runs, saved lessons lose their widgets
        print(f"warning: cannot write {settings_path()} ({exc}): widget state will not be saved in notebooks",
              file=sys.stderr)
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
