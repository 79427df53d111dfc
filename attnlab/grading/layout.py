"""Which exercise a notebook is (:func:`identify`), which part owns each cell (:func:`owners`), which cells the
grader runs (:func:`to_run`), and which files a batch grades (:func:`discover`, :func:`who`). Nothing here runs one.
"""

import ast
from pathlib import Path

from attnlab.grading.shortcuts import _changed, _defined, _parse


def _describe_cell(i, cell):
    text = next((line.strip() for line in cell.source.splitlines() if line.strip()), "(empty)")
    return f"cell {i + 1} (`{text if len(text) <= 50 else text[:47] + '...'}`)"


def _grade_id(cell):
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def _stem_guess(path, exercises):  # a renamed copy keeps its number: 02_mine.ipynb
    stem = Path(path).stem
    return stem if stem in exercises else next((exercise for exercise in exercises if stem[:3] == exercise[:3]), None)


def identify(nb, path):
    """(exercise or None, [warnings]) from the cells' grade_ids, else the metadata, else the file name; a file name
    or metadata that names another exercise gets a warning."""
    from attnlab.grading.parts import exercises

    EXERCISES, warnings = exercises(), []
    meta = nb.get("metadata", {}).get("attnlab", {}).get("exercise")
    meta = meta if meta in EXERCISES else None
    ids = {_grade_id(c) for c in nb.cells} - {None}
    # how many of each exercise's parts the cells name (a part counts once, however many cells carry its id)
    overlap = {ex: sum(p in ids or any(i.startswith(p + "-answer") for i in ids) for p in parts)
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


def slot_conflict(exercise, path):
    """Why a notebook holding ``exercise`` may not be credited in the slot its file name names (``05_x.ipynb``
    holding exercise 02's cells), or None. A file name of no exercise (``my answers.ipynb``) names no slot."""
    from attnlab.grading.parts import exercises

    slot = _stem_guess(path, exercises())
    if exercise and slot and slot != exercise:
        return (f"filed as {slot} (its file name) but it holds exercise {exercise}'s cells: not credited (submit "
                f"{slot}'s own notebook, or give this one {exercise}'s name)")
    return None


def manifest(names):
    """The exercises an instructor names (``--exercise 02`` or ``02_queries_keys_values``, repeatable or with
    commas) as full names; ValueError naming ``--exercise`` for a name of no exercise."""
    from attnlab.grading.parts import exercises

    known, out = list(exercises()), []
    for name in (n.strip() for item in names for n in item.split(",") if n.strip()):
        found = [ex for ex in known if ex == name or ex[:2] == name.zfill(2)[:2] and name.isdigit()]
        if len(found) != 1:
            raise ValueError(f"--exercise: {name!r} is no exercise of the course ({', '.join(known)})")
        out += [f for f in found if f not in out]
    return out


def _layout(ids, parts):
    """{grade_id: part, "setup" or None} for an exercise's cells in their generated order: a part's answer and check
    cells are its own, one above the first of them is setup, any other one the part of the next check cell."""
    answer_of = {gid: p for gid in ids for p in parts if gid == p or (gid or "").startswith(p + "-answer")}
    first = next((i for i, gid in enumerate(ids) if gid in answer_of), len(ids))
    owner, pending = {}, None
    for i in range(len(ids) - 1, -1, -1):
        gid = ids[i]
        pending = gid if gid in parts else pending
        owner[gid] = answer_of.get(gid) or ("setup" if i < first else pending)
    return owner


def _course_exercise(exercise):
    import nbformat

    try:
        from attnlab.course import find_course

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


def given_demos(exercise):
    """{grade_id: [statement index]}: the demos :func:`demo_marks` marked in the course's generated exercise."""
    nb = _course_exercise(exercise)
    return {} if nb is None else {_grade_id(c): list(c.metadata.get("attnlab", {}).get("demo", []))
                                  for c in nb.cells if c.metadata.get("attnlab", {}).get("demo")}


def learner_cell(cell, part, given):
    """Whether a cell's code is the learner's: the part's answer cells, no or an unknown grade_id, an edited one."""
    gid = _grade_id(cell)
    return gid is None or str(gid).startswith(part + "-answer") or gid not in given or \
        given[gid].strip() != cell.source.strip()


def _answer_part(gid, parts):
    return next((p for p in parts if (gid or "").startswith(p + "-answer")), None)


def owners(nb, parts, canonical):
    """The part (or "setup", or None) each cell belongs to: that of its ``grade_id`` in the exercise's layout,
    wherever it now is; for a cell of no known ``grade_id``, that of the nearest answer cell above it unless that
    part's check cell stands between them (None)."""
    layout = canonical or _layout([_grade_id(c) for c in nb.cells], parts)
    out, current = [], None
    for cell in nb.cells:
        gid = _grade_id(cell)
        out.append(layout[gid] if gid in layout else current)
        current = None if gid in parts and gid == current else _answer_part(gid, parts) or current
    return out


def _reads(node, loads=False):
    """The names a statement reads when it runs (not in the bodies of the functions it defines); ``loads``: less
    those it only assigns (``layout = "zigzag"`` reads nothing, ``n += 1`` reads ``n``)."""
    if isinstance(node, ast.Lambda):
        return set()
    if isinstance(node, ast.Name):
        return set() if loads and isinstance(node.ctx, ast.Store) else {node.id}
    children = ast.iter_child_nodes(node)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        children = node.decorator_list + node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
    augmented = loads and isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name)
    return ({node.target.id} if augmented else set()).union(*(_reads(child, loads) for child in children))


def _statements(source):
    """The top-level statements of a cell as IPython runs it, or None when it is not Python."""
    tree = _parse(source)
    return None if tree is None else tree.body[:tree.magic_from]


def demo_marks(nb, parts, learner_names):
    """{cell index: [top-level statement index]} of the demos in an exercise's given cells (not setup, answer or
    check cells), which ``attnlab generate`` marks (``attnlab.demo``): a statement that reads one of the learner's
    functions or a name defined from one (``o_parts, lse = split_partials(...)``); a ``def`` is never one."""
    owner = owners(nb, parts, None)
    derived, out = set(learner_names), {}
    for i, cell in enumerate(nb.cells):
        gid = _grade_id(cell)
        if cell.cell_type != "code" or owner[i] == "setup" or gid in parts or _answer_part(gid, parts):
            continue
        for k, node in enumerate(_statements(cell.source) or ()):
            if {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & derived:
                derived |= _defined(node)
            if _reads(node) & derived:
                out.setdefault(i, []).append(k)
                derived |= _changed(node, calls=False)
    return out


def to_run(nb, owner, given, demos, parts, learner_names):
    """[(cell index, source)] that the grader's functions process runs, in order: the learner's cells and the setup
    cells whole, an unedited given cell without the statements ``demos`` marks (:func:`given_demos`), no given check
    cell. A learner's statement that reads what only a demo that did not run defines (``print(o_parts.shape)``) does
    not run either: here it could only raise a NameError."""
    demo_only, out = set(), []  # the names only the demos that do not run here define
    for i, cell in enumerate(nb.cells):
        gid = _grade_id(cell)
        whole = owner[i] == "setup" or gid not in given or given[gid].strip() != cell.source.strip()
        if cell.cell_type != "code" or not whole and gid in parts:
            continue
        body = _statements(cell.source)
        if body is None:
            out += [(i, cell.source)] if whole else []
            continue
        kept, skip = [], set() if whole else set(demos.get(gid, ()))
        for k, node in enumerate(body):
            if k in skip:
                demo_only |= (_defined(node) | _changed(node, calls=False)) - set(learner_names)
            elif whole and owner[i] != "setup" and _reads(node, loads=True) & demo_only:
                demo_only |= _defined(node)
            else:
                kept.append(node)
                demo_only -= _defined(node)
        if whole and len(kept) == len(body):
            out.append((i, cell.source))
        elif kept:
            out.append((i, ast.unparse(ast.Module(body=kept, type_ignores=[]))))
    return out


def discover(paths):
    """(notebooks to grade, [{"path", "reason"}] skipped) for files and folders (recursive)."""
    found, skipped = [], []
    for p in map(Path, paths):
        if not p.exists():
            skipped.append({"path": str(p), "reason": "does not exist"})
        elif p.is_dir():
            notebooks = []
            for q in sorted(q for q in p.rglob("*") if q.is_file() and q.suffix == ".ipynb"):
                rel = q.relative_to(p).parts
                if ".ipynb_checkpoints" in rel:
                    skipped.append({"path": str(q), "reason": "a Jupyter checkpoint copy, not a submission"})
                elif any(part.startswith(".") for part in rel):
                    skipped.append({"path": str(q), "reason": "inside a hidden folder"})
                else:
                    notebooks.append(q)
            if not notebooks:
                skipped.append({"path": str(p), "reason": "a folder with no notebook (.ipynb) in it"})
            found += notebooks
        elif p.suffix != ".ipynb":
            skipped.append({"path": str(p), "reason": "not a notebook (.ipynb)"})
        else:
            found.append(p)
    unique = {}
    for p in found:
        unique.setdefault(p.resolve(), p)
    return list(unique.values()), skipped


def who(path):
    """(student, assignment) from nbgrader's submitted/<student>/<assignment>/ layout, else the folder. The first
    ``submitted`` (or ``autograded``) folder decides: a submission's own folders cannot name another student."""
    parts = Path(path).absolute().parts
    for i, part in enumerate(parts):
        if part in ("submitted", "autograded") and i + 3 < len(parts):  # .../submitted/<student>/<assignment>/...
            return parts[i + 1], parts[i + 2]
    return Path(path).absolute().parent.name, ""
