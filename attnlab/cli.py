"""The ``attnlab`` command (also ``python -m attnlab``).

Each subcommand lives in its own module, which provides ``add_arguments(parser)``
and ``run(args) -> int`` (the exit status). The table below is the whole CLI.
"""

import argparse
import sys
from importlib import import_module

# name -> (module, one-line help)
COMMANDS = {
    "doctor": ("attnlab.doctor", "check the environment and say how to fix what is wrong"),
    "lab": ("attnlab.lab", "open JupyterLab on the lessons"),
    "generate": ("attnlab.grading.generate", "write exercises/ from solutions/ (instructors)"),
    "grade": ("attnlab.grading.grade", "grade exercise notebooks and print a score report"),
    "start": ("attnlab.grading.workspace", "copy the exercises into your own working folder"),
    "progress": ("attnlab.grading.progress", "show which exercise parts pass in your working folder"),
    "checkpoints": ("attnlab.pretrained", "retrain the small models that ship with the course"),
    "gpt-checkpoint": ("attnlab.capstone", "retrain lesson 09's GPT on the standard library's source"),
}


def build_parser():
    parser = argparse.ArgumentParser(prog="attnlab", description="The attention course's command line.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # every command module needs only the standard library and attnlab's required
        # dependencies (torch, numpy, tqdm), so an ImportError here is a broken install: let it show
        import_module(module).add_arguments(p)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    status = import_module(args._module).run(args)
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
