"""Which exercise a notebook is, which part owns each cell, and which files a batch grades.

``identify`` reads the notebook's metadata and its cells' nbgrader ``grade_id`` s; ``owners`` gives each
cell its part ("setup", or None for a cell of no part); ``discover`` finds notebooks in folders; ``who``
reads nbgrader's ``submitted/<student>/<assignment>/`` layout. Nothing here runs a notebook.
"""

from pathlib import Path


def _first_line(source):
    for line in source.splitlines():
        if line.strip():
            text = line.strip()
            return text if len(text) <= 50 else text[:47] + "..."
    return "(empty)"


def _describe_cell(i, cell):
    return f"cell {i + 1} (`{_first_line(cell.source)}`)"


def _grade_id(cell):
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def _stem_guess(path, exercises):
    stem = Path(path).stem
    if stem in exercises:
        return stem
    for exercise in exercises:  # a renamed copy keeps its number: 02_mine.ipynb
        if stem[:3] == exercise[:3]:
            return exercise
    return None


def identify(nb, path):
    """(exercise or None, [warnings]) from the notebook's metadata and its cells' grade_ids.

    The cells decide when metadata and cells disagree; the file name is used only when neither
    says, and a file name that names another exercise gets a warning.
    """
    from attnlab.grading.parts import exercises

    EXERCISES = exercises()
    warnings = []
    meta = nb.get("metadata", {}).get("attnlab", {}).get("exercise")
    meta = meta if meta in EXERCISES else None
    ids = {_grade_id(c) for c in nb.cells} - {None}
    overlap = {ex: len(ids & set(parts)) + len({i for i in ids if any(i.startswith(p + "-answer") for p in parts)})
               for ex, parts in EXERCISES.items()}
    best = max(overlap, key=overlap.get)
    by_cells = best if overlap[best] > 0 else None
    by_name = _stem_guess(path, EXERCISES)
    chosen = by_cells or meta or by_name
    if meta and by_cells and meta != by_cells:
        warnings.append(f"its metadata says {meta} but its cells are those of {by_cells}: graded as {by_cells}")
    if chosen and by_name and by_name != chosen:
        warnings.append(f"the file name suggests {by_name}, but the notebook is {chosen}: graded as {chosen}")
    return chosen, warnings


def _layout(ids, parts):
    """{grade_id: part, "setup" or None} for the cells of an exercise in their generated order."""
    answer_of = {}
    for gid in ids:
        for p in parts:
            if gid == p or (gid or "").startswith(p + "-answer"):
                answer_of[gid] = p
    first = next((i for i, gid in enumerate(ids) if gid in answer_of), len(ids))
    owner, pending = {}, None
    for i in range(len(ids) - 1, -1, -1):
        gid = ids[i]
        if gid in parts:
            pending = gid
        if gid in answer_of:
            owner[gid] = answer_of[gid]
        elif i < first:
            owner[gid] = "setup"
        else:
            owner[gid] = pending
    return owner


def _course_exercise(exercise):
    import nbformat

    try:
        from attnlab.grading.course import find_course

        return nbformat.read(str(find_course() / "exercises" / f"{exercise}.ipynb"), as_version=4)
    except Exception:
        return None


def canonical_layout(exercise, parts):
    """The owner of each grade_id, from the course's generated exercise (None if it is not found)."""
    nb = _course_exercise(exercise)
    return None if nb is None else _layout([_grade_id(c) for c in nb.cells], parts)


def given_sources(exercise):
    """{grade_id: source} of the cells the course gives (not answer cells), from its generated exercise."""
    nb = _course_exercise(exercise)
    if nb is None:
        return {}
    return {_grade_id(c): c.source for c in nb.cells if _grade_id(c) and "-answer" not in _grade_id(c)}


def learner_cell(cell, part, given):
    """True for a cell whose code is the learner's: the part's answer cells, a cell with no or an unknown
    grade_id, and a given cell whose code was changed."""
    gid = _grade_id(cell)
    if gid is None or str(gid).startswith(part + "-answer"):
        return True
    return gid not in given or given[gid].strip() != cell.source.strip()


def owners(nb, parts, names, canonical):
    """The part (or "setup", or None) each cell of the submission belongs to.

    Known grade_ids keep their exercise's owner wherever the cell now is; a check or answer cell
    names its part; a cell the learner added belongs to the part whose function it defines, else
    to no part (its failure is reported, not charged).
    """
    from attnlab.grading.generate import check_ids
    from attnlab.grading.shortcuts import defines

    layout = canonical or _layout([_grade_id(c) for c in nb.cells], parts)
    out = []
    for cell in nb.cells:
        gid = _grade_id(cell)
        if gid in layout:
            out.append(layout[gid])
            continue
        found = None
        if cell.cell_type == "code":
            ids = [p for p in check_ids(cell.source) if p in parts]
            found = ids[0] if ids else next((p for p in parts if defines(cell.source, names[p])), None)
        out.append(found)
    return out


def _hidden(path):
    return any(part.startswith(".") for part in path.parts)


def discover(paths):
    """(notebooks to grade, [{"path", "reason"}] skipped) for files and folders (recursive)."""
    found, skipped, seen = [], [], set()

    def add(p):
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            found.append(p)

    for p in map(Path, paths):
        if not p.exists():
            skipped.append({"path": str(p), "reason": "does not exist"})
        elif p.is_dir():
            notebooks = []
            for q in sorted(p.rglob("*")):
                rel = q.relative_to(p)
                if not q.is_file():
                    continue
                if q.suffix != ".ipynb":
                    continue
                if ".ipynb_checkpoints" in rel.parts:
                    skipped.append({"path": str(q), "reason": "a Jupyter checkpoint copy, not a submission"})
                elif _hidden(rel):
                    skipped.append({"path": str(q), "reason": "inside a hidden folder"})
                else:
                    notebooks.append(q)
            if not notebooks:
                skipped.append({"path": str(p), "reason": "a folder with no notebook (.ipynb) in it"})
            for q in notebooks:
                add(q)
        elif p.suffix != ".ipynb":
            skipped.append({"path": str(p), "reason": "not a notebook (.ipynb)"})
        else:
            add(p)
    return found, skipped


def who(path):
    """(student, assignment) from nbgrader's submitted/<student>/<assignment>/ layout, else the folder.

    The first ``submitted`` (or ``autograded``) folder of the path decides: a submission cannot name
    another student by making folders of that name inside its own."""
    parts = Path(path).absolute().parts
    for i, part in enumerate(parts):
        if part in ("submitted", "autograded") and i + 3 < len(parts):  # .../submitted/<student>/<assignment>/...
            return parts[i + 1], parts[i + 2]
    return Path(path).absolute().parent.name, ""
