"""The ``attnlab`` command (also ``python -m attnlab``).

Each subcommand lives in its own module, which provides ``add_arguments(parser)``
and ``run(args) -> int`` (the exit status). The table below is the whole CLI.

A command's module is imported only when that command runs (``attnlab --help`` and
``attnlab --version`` import none): ``attnlab doctor`` must work where torch is missing
or broken, which is what it is there to say.
"""

import argparse
import sys
from importlib import import_module

# name -> (module, one-line help)
COMMANDS = {
    "doctor": ("attnlab.doctor", "check the environment and say how to fix what is wrong"),
    "lab": ("attnlab.lab", "open JupyterLab on the lessons"),
    "generate": ("attnlab.course.generate", "write exercises/ from solutions/ (instructors)"),
    "grade": ("attnlab.grading.commands.grade", "grade exercise notebooks and print a score report"),
    "start": ("attnlab.course.start", "copy the exercises into your own working folder"),
    "progress": ("attnlab.course.progress", "show which exercise parts pass in your working folder"),
    "checkpoints": ("attnlab.pretrained", "retrain the small models that ship with the course"),
    "gpt-checkpoint": ("attnlab.capstone", "retrain lesson 09's GPT on the standard library's source"),
}
# commands that hand options they do not know to the program they start (lab: to JupyterLab)
PASS_THROUGH = {"lab"}


def _version():
    from attnlab import __version__

    return __version__


def build_parser(load=None):
    """The argument parser. ``load``: names of the commands whose module is imported to add its
    options (default: all of them); the others are listed with their help line only."""
    parser = argparse.ArgumentParser(prog="attnlab", description="The attention course's command line.",
                                     epilog="Run `attnlab COMMAND --help` for a command's options; "
                                            "`attnlab doctor` first if something does not work.")
    parser.add_argument("--version", action="version", version=f"attnlab {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if load is None or name in load:
            # every command module needs only the standard library and attnlab's required
            # dependencies (torch, numpy, tqdm), so an ImportError here is a broken install: let it show
            import_module(module).add_arguments(p)
    return parser


def _command_name(argv):
    """The subcommand named in ``argv`` (the first word that is not an option), or None."""
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    from attnlab.notebook_format import without_iri_checker

    without_iri_checker()  # before a command imports nbformat (`lab` starts JupyterLab in a process of its own)
    name = _command_name(argv)
    parser = build_parser(load={name} if name in COMMANDS else set())
    if name in PASS_THROUGH:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            args.jupyter_args = unknown + list(getattr(args, "jupyter_args", None) or [])
    else:
        args = parser.parse_args(argv)
    if args.command is None:  # a bare `attnlab`: say what there is
        parser.print_help()
        return 0
    status = import_module(args._module).run(args)
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
