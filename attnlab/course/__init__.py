"""The course as a checkout: where its exercises/ and solutions/ are, and its tools that are not the grader:
``attnlab generate`` (:mod:`attnlab.course.generate`, instructors); the learner's working folder,
``attnlab start`` and ``attnlab progress`` (:mod:`attnlab.course.start`, :mod:`attnlab.course.progress`, which
grades it with ``attnlab grade``); and ``hint(part)`` (:mod:`attnlab.course.hints`, text in ``hints/``).

Where the course's exercises/ and solutions/ are
------------------------------------------------

Looked for in this order, so the commands work from a source checkout, a git
worktree and an installed package alike:

1. ``--course DIR`` on the command line;
2. the environment variable ``ATTNLAB_COURSE``;
3. the current folder or one above it that holds an ``exercises/`` or
   ``solutions/`` folder next to an ``attnlab/`` package or a ``pyproject.toml``;
4. the checkout the imported ``attnlab`` package lives in (editable installs, as ``make lab`` makes).

The notebooks are not shipped inside the package: the course is a checkout.
"""

import os
from pathlib import Path

import attnlab

PACKAGE_DIR = Path(attnlab.__file__).resolve().parent


def _is_course(folder):
    has_notebooks = (folder / "exercises").is_dir() or (folder / "solutions").is_dir()
    return has_notebooks and ((folder / "attnlab").is_dir() or (folder / "pyproject.toml").is_file())


def find_course(course=None, start=None):
    """The course folder (holding exercises/ and, in a checkout, solutions/).

    Raises FileNotFoundError saying where it looked when there is none.
    """
    if course:
        folder = Path(course).expanduser().resolve()
        if not ((folder / "exercises").is_dir() or (folder / "solutions").is_dir()):
            raise FileNotFoundError(f"--course {course}: no exercises/ or solutions/ folder there")
        return folder
    env = os.environ.get("ATTNLAB_COURSE")
    if env:
        return find_course(env)
    here = Path(start or os.getcwd()).resolve()
    for folder in [here, *here.parents]:
        if _is_course(folder):
            return folder
    if _is_course(PACKAGE_DIR.parent):
        return PACKAGE_DIR.parent
    raise FileNotFoundError(
        "could not find the course's exercises/ folder: run this inside the course checkout, "
        "or pass --course DIR (or set ATTNLAB_COURSE)"
    )


def add_course_argument(parser):
    parser.add_argument("--course", metavar="DIR", default=None,
                        help="the course folder holding exercises/ and solutions/ (default: found from here)")
