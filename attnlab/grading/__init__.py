"""Grading: inline checks and the grader (exercises generated from solutions, working copies and hints:
:mod:`attnlab.course`).

In an exercise notebook::

    from attnlab.grading import check, hint
    hint("attention-masks")    # the next of up to three hints
    check("attention-masks")   # PASS, or FAIL with a counterexample and the likely mistake

Instructors: ``attnlab generate`` writes exercises/ from solutions/; learners:
``attnlab start``, ``attnlab grade PATH``, ``attnlab progress``.
"""

__all__ = ["check", "hint", "run_check"]


def __getattr__(name):
    # imported on first use: the CLI (grade, start, progress) must not pay for torch
    if name == "hint":  # course text, not grading: attnlab/course/hints/
        from attnlab.course.hints import hint

        return hint
    if name in ("check", "run_check"):
        from attnlab.grading import checks

        return getattr(checks, name)
    raise AttributeError(f"module 'attnlab.grading' has no attribute {name!r}")
