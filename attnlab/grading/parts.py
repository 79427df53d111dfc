"""The exercises and their graded parts: names, titles, points, kinds and what each may not call.

Read from the exercise packages' light modules (``attnlab/grading/exercises/eNN/__init__.py``), which import nothing
heavy, so the grader and ``attnlab generate`` can use this without torch. An instructor sets points there.
"""

import importlib

from attnlab.grading.exercises import KINDS, PACKAGES, Part


def _load():
    table, package, forbidden, allowed, required = {}, {}, {}, {}, {}
    for name in PACKAGES:
        try:
            mod = importlib.import_module(f"attnlab.grading.exercises.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"attnlab.grading.exercises.{name}":
                continue  # an exercise not written yet
            raise
        rows = [Part(*row) for row in mod.PARTS]
        rows = [row._replace(names=tuple(row.names)) for row in rows]
        for row in rows:
            if row.kind not in KINDS:
                raise ValueError(f"{mod.EXERCISE}: part {row.id!r} has kind {row.kind!r}; expected one of {KINDS}")
            if row.id in package:
                raise ValueError(f"part id {row.id!r} is used by two exercises")
            package[row.id] = name
        table[mod.EXERCISE] = rows
        forbidden.update(getattr(mod, "FORBIDDEN", {}))
        allowed.update(getattr(mod, "ALLOWED", {}))
        required.update(getattr(mod, "REQUIRED", {}))
    return table, package, forbidden, allowed, required


# exercise -> [Part, ...] in notebook order; part id -> its package; part id -> forbidden patterns /
# library patterns the part may use after all (an experiment that trains the course's model: "attnlab.models.*");
# part id -> {name: why}, the names its answer must read (the technique the part asks for: exercise 09's training
# run through the given kernel_attention, an experiment that measures with trace rather than writing the formula)
TABLE, PACKAGE, FORBIDDEN, ALLOWED, REQUIRED = _load()

# Parts graded by a person, not by `attnlab grade` (an nbgrader manually graded cell: a short written
# explanation): reported as "manual" with no points, and left out of the score.
MANUAL = {row.id for rows in TABLE.values() for row in rows if row.kind == "manual"}


def exercises():
    """{exercise: [part id, ...]}"""
    return {ex: [p.id for p in parts] for ex, parts in TABLE.items()}


def points():
    """{part id: points}"""
    return {p.id: p.points for parts in TABLE.values() for p in parts}


def info(part_id):
    """The Part row of ``part_id``; ValueError naming the argument for an unknown id."""
    for rows in TABLE.values():
        for row in rows:
            if row.id == part_id:
                return row
    known = ", ".join(sorted(PACKAGE))
    raise ValueError(f"part_id: unknown exercise part {part_id!r}; known parts: {known}")


# What a part's answer may not call: the grader and the inline check read the answer's syntax for these names
# (attnlab/grading/shortcuts.py). Every part forbids the grader's own references and the library.
REFERENCES = ["attnlab.grading.exercises.*"]
LIBRARY = ["attnlab.attention.*", "attnlab.tiled.*", "attnlab.iomodel.*", "attnlab.traffic.*", "attnlab.approx.*",
           "attnlab.kernels.*", "attnlab.models.*"]


def required(part_id):
    """{name: why}: what ``part_id``'s answer must read (:func:`attnlab.grading.shortcuts.missing`)."""
    return dict(REQUIRED.get(part_id, {}))


def either(key):
    """How a REQUIRED key reads in feedback: "a|b|c" -> `a` (or `b`, `c`)."""
    first, *others = key.split("|")
    return f"`{first}`" + (f" (or {', '.join(f'`{o}`' for o in others)})" if others else "")


def forbidden(part_id):
    """The patterns of what ``part_id``'s answer may not call (the library less what the part's ALLOWED lists)."""
    return REFERENCES + [p for p in LIBRARY if p not in ALLOWED.get(part_id, ())] + FORBIDDEN.get(part_id, [])
