"""``hint(part)`` for notebooks: the next of a part's hints, read from ``attnlab/course/hints/NN_name.md``.

Hints are course text, not grading: an instructor edits them as Markdown, one file per exercise, one
``## part-id`` section per part and its hints as a numbered list, in the order they are shown (from where to
start to nearly the answer's shape, never the answer).
"""

import re
from functools import lru_cache
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "hints"


def read(text):
    """{part id: [hint, ...]} of one hints file's text; a hint's wrapped lines are joined by single spaces."""
    hints, part = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            part = line[3:].strip()
            hints[part] = []
        elif part and re.match(r"\d+\. ", line):
            hints[part].append(line.split(". ", 1)[1].strip())
        elif part and line.startswith("   ") and hints[part]:
            hints[part][-1] += " " + line.strip()
    return hints


@lru_cache(maxsize=1)
def all_hints():
    """{part id: [hint, ...]} of every exercise."""
    return {part: texts for path in sorted(FOLDER.glob("*.md")) for part, texts in read(path.read_text()).items()}


_SHOWN = {}  # part id -> how many hints this kernel has shown


def hint(part_id):
    """Print the next hint of ``part_id`` (one more per call; the last again once all are shown); returns None.

    Wrapped at word boundaries to the width of the rest of the feedback (:func:`attnlab.grading.feedback.wrap`).
    """
    from attnlab.grading.feedback import wrap
    from attnlab.grading.parts import info

    row = info(part_id)  # ValueError naming part_id for an unknown part
    hints = all_hints().get(part_id, [])
    if not hints:
        print(f"{part_id}: no hints for this part")
        return None
    shown = _SHOWN.get(part_id, 0)
    if shown >= len(hints):
        print(wrap(f"{part_id}: all {len(hints)} hints shown; the last one again:\n  {shown}. {hints[-1]}"))
        return None
    _SHOWN[part_id] = shown + 1
    print(wrap(f"{part_id} ({row.title}), hint {shown + 1} of {len(hints)}:\n  {hints[shown]}"))
    return None
