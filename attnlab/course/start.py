"""``attnlab start [DIR]``: copy the exercises into your own working folder.

The folder (default ``./my-work``, which git ignores) gets a copy of every
notebook of the course's ``exercises/``. A copy that already exists is never
overwritten, so running ``attnlab start`` again after the course is updated only
adds the exercises you do not have yet: your work is never touched. To take a
fresh copy of one exercise, rename or delete yours and run it again.

Example: ``attnlab start`` then open ``my-work/01_soft_alignment.ipynb``.
"""

import shlex
import shutil
import sys
from pathlib import Path

from attnlab.course import add_course_argument, find_course

DEFAULT_DIR = "my-work"


def start(dest, course):
    """Copy course/exercises/*.ipynb into dest; returns (copied, kept) lists of file names."""
    source = Path(course) / "exercises"
    notebooks = sorted(source.glob("*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no exercise notebooks in {source}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    copied, kept = [], []
    for nb in notebooks:
        target = dest / nb.name
        if target.exists():
            kept.append(nb.name)
            continue
        shutil.copyfile(nb, target)
        copied.append(nb.name)
    return copied, kept


def add_arguments(parser):
    parser.add_argument("dir", nargs="?", default=DEFAULT_DIR, metavar="DIR",
                        help=f"your working folder (default ./{DEFAULT_DIR})")
    add_course_argument(parser)


def run(args):
    try:
        course = find_course(args.course)
        copied, kept = start(args.dir, course)
    except (FileNotFoundError, OSError) as exc:
        print(f"attnlab start: {exc}", file=sys.stderr)
        return 2
    for name in copied:
        print(f"copied  {name}")
    for name in kept:
        print(f"kept    {name} (your copy exists: not overwritten)")
    print(f"{len(copied)} copied, {len(kept)} kept in {Path(args.dir).resolve()}")
    where = shlex.quote(str(args.dir))  # `attnlab lab` alone serves the course's lessons/, not this folder
    print(f"open them with `attnlab lab --dir {where}` (or JupyterLab in that folder); check your progress with "
          f"`attnlab progress {where}`")
    return 0
