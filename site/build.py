"""Build the course website: ``python site/build.py [--dir DIR] [--strict]`` (``make site``).

Stages the sources (site/course_site.py: copies of lessons/, exercises/, docs/, the home page
generated from README.md, the API pages) in DIR/src and runs Sphinx with site/conf.py into
DIR/html (DIR/doctrees and DIR/jupyter_execute are Sphinx's and myst-nb's working files, kept
so that a rebuild reads only what changed). Renders the stored outputs; executes no notebook.
Open DIR/html/index.html in a browser (nothing is fetched from another host), or serve it:
``python -m http.server -d DIR/html``.
"""

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import course_site  # noqa: E402


def build(dest, strict=False, jobs=1, quiet=True):
    """Build the HTML site into ``dest/html`` (see above). Returns Sphinx's exit status."""
    from sphinx.cmd.build import build_main

    dest = Path(dest)
    src = course_site.stage(dest / "src")
    out = dest / "html"
    args = ["-b", "html", "-c", str(HERE), "-d", str(dest / "doctrees"), "-j", str(jobs)]
    if strict:
        args += ["-W", "--keep-going"]
    if quiet:
        args += ["-q"]
    return build_main(args + [str(src), str(out)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=str(course_site.ROOT / "build" / "site"),
                        help="build folder; the site goes to DIR/html (default: build/site)")
    parser.add_argument("--strict", action="store_true", help="treat warnings as errors (as CI does)")
    parser.add_argument("-j", "--jobs", default="1", help="Sphinx's parallel jobs (default 1)")
    args = parser.parse_args(argv)
    if not course_site.PUBLISHED:
        print(course_site.UNPUBLISHED_NOTE, file=sys.stderr)
    start = time.perf_counter()
    status = build(args.dir, strict=args.strict, jobs=args.jobs, quiet=False)
    if status == 0:
        print(f"site built in {time.perf_counter() - start:.1f} s: open {Path(args.dir) / 'html' / 'index.html'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
