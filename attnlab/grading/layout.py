"""Which exercise a notebook is, which part owns each cell, and which files a batch grades.

``identify`` reads the notebook's metadata and its cells' nbgrader ``grade_id`` s; ``owners`` gives each
cell its part ("setup", or None for a cell of no part); ``to_run`` says which cells the grader runs; ``discover`` finds notebooks in folders; ``who``
reads nbgrader's ``submitted/<student>/<assignment>/`` layout. Nothing here runs a notebook.
"""

import ast
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


def learner_cell(cell, part, given):
    """True for a cell whose code is the learner's: the part's answer cells, a cell with no or an unknown
    grade_id, and a given cell whose code was changed."""
    gid = _grade_id(cell)
    if gid is None or str(gid).startswith(part + "-answer"):
        return True
    return gid not in given or given[gid].strip() != cell.source.strip()


def _answer_part(gid, parts):
    return next((p for p in parts if (gid or "").startswith(p + "-answer")), None)


def owners(nb, parts, canonical):
    """The part (or "setup", or None) each cell of the submission belongs to.

    A cell belongs to the part of its nbgrader ``grade_id`` (its exercise's layout, wherever the cell now is);
    a cell with no or an unknown ``grade_id`` is the learner's and belongs to the part of the nearest answer
    cell above it, unless that part's check cell (``grade_id`` the part's id) stands between them: above the
    first answer cell, or after a part's check cell, it belongs to no part (None).
    """
    layout = canonical or _layout([_grade_id(c) for c in nb.cells], parts)
    out, current = [], None
    for cell in nb.cells:
        gid = _grade_id(cell)
        out.append(layout[gid] if gid in layout else current)
        current = None if gid in parts and gid == current else _answer_part(gid, parts) or current
    return out


class _Reads(ast.NodeVisitor):
    """The names a statement reads when it runs (not inside the bodies of the functions it defines)."""

    def __init__(self):
        self.names = set()

    def visit_Name(self, node):
        self.names.add(node.id)

    def visit_FunctionDef(self, node):
        for d in node.decorator_list + node.args.defaults + node.args.kw_defaults:
            if d is not None:
                self.visit(d)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        pass


class _Loads(_Reads):
    """The names a statement reads when it runs, less those it only assigns (``layout = "zigzag"`` reads nothing;
    ``n += 1`` reads ``n``)."""

    def visit_Name(self, node):
        if not isinstance(node.ctx, ast.Store):
            self.names.add(node.id)

    def visit_AugAssign(self, node):
        if isinstance(node.target, ast.Name):
            self.names.add(node.target.id)
        self.generic_visit(node)


def _names_in(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _defined(node):
    """The names a statement binds in the namespace it runs in, a ``def`` inside ``if``/``try``/``with`` included."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):  # and what it declares global
        return {node.name} | {n for g in ast.walk(node) if isinstance(g, ast.Global) for n in g.names}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, ast.Name):
        return {node.id} if isinstance(node.ctx, ast.Store) else set()
    bound = {getattr(node, "name", None) or getattr(node, "rest", None)} - {None} \
        if isinstance(node, (ast.MatchAs, ast.MatchStar, ast.MatchMapping, ast.ExceptHandler)) else set()  # case x:
    return bound.union(*(_defined(child) for child in ast.iter_child_nodes(node)))


def _base(node):
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _tree(source):
    """The syntax tree of a cell as IPython runs it (magics transformed), or None."""
    from IPython.core.inputtransformer2 import TransformerManager

    try:
        return ast.parse(TransformerManager().transform_cell(source))
    except SyntaxError:
        return None


def _filled(node):
    """What a statement fills in place (``runs[name] = ...``): a demo's too."""
    return {_base(n) for n in ast.walk(node) if isinstance(n, (ast.Subscript, ast.Attribute))
            and isinstance(n.ctx, ast.Store)} - {None}


def demo_marks(nb, parts, learner_names):
    """{cell index: [index of a top-level statement that is a demo]} for the given cells of an exercise (not its
    setup, answer or check cells), marked by ``attnlab generate`` in each cell's metadata (``attnlab.demo``).

    A demo is feedback: a top-level statement that reads one of the learner's functions, or a name defined from one
    (``matmul(a, b)`` in a print, ``o_parts, lse = split_partials(...)``). Definitions stay, even one that calls the
    learner's kernel (``def matmul(...)``). ``attnlab grade`` runs an unedited given cell without its marked demos,
    as the course's own copy of the exercise marks them (:func:`to_run`); the learner's copy is never read for this."""
    owner = owners(nb, parts, None)
    derived, out = set(learner_names), {}
    for i, cell in enumerate(nb.cells):
        gid = _grade_id(cell)
        if cell.cell_type != "code" or owner[i] == "setup" or gid in parts or _answer_part(gid, parts):
            continue
        tree = _tree(cell.source)
        for k, node in enumerate(tree.body if tree is not None else ()):
            if _names_in(node) & derived:
                derived |= _defined(node)
            reads = _Reads()
            reads.visit(node)
            if reads.names & derived:
                out.setdefault(i, []).append(k)
                derived |= _filled(node)
    return out


def given_demos(exercise):
    """{grade_id: [statement index]}: the demos :func:`demo_marks` marked in the course's generated exercise."""
    nb = _course_exercise(exercise)
    return {} if nb is None else {_grade_id(c): list(c.metadata.get("attnlab", {}).get("demo", []))
                                  for c in nb.cells if c.metadata.get("attnlab", {}).get("demo")}


def to_run(nb, owner, given, demos, parts, learner_names):
    """[(cell index, source)] that the grader's functions process runs, in notebook order.

    The learner's cells (answer cells, cells with no or an unknown ``grade_id``, given cells the learner edited)
    and the setup cells run whole. An unedited given cell runs without the statements ``demos`` marks
    ({grade_id: [statement index]}, :func:`given_demos`); a given check cell (``check("part")``) does not run. In
    the learner's own cells, a top-level statement that reads what only a demo that did not run defines
    (``print(o_parts.shape)`` after the demo ``o_parts, lse = split_partials(...)``) does not run either: it could
    only raise a NameError here, where it ran in Jupyter.
    """
    demo_only, out = set(), []  # the names only the demos that do not run here define
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        gid = _grade_id(cell)
        whole = owner[i] == "setup" or gid not in given or given[gid].strip() != cell.source.strip()
        if not whole and gid in parts:
            continue
        tree = _tree(cell.source)
        if tree is None:
            if whole:
                out.append((i, cell.source))
            continue
        kept, skip = [], set() if whole else set(demos.get(gid, ()))
        for k, node in enumerate(tree.body):
            if k in skip:
                demo_only |= (_defined(node) | _filled(node)) - set(learner_names)
                continue
            if whole and owner[i] != "setup":
                loads = _Loads()
                loads.visit(node)
                if loads.names & demo_only:
                    demo_only |= _defined(node)
                    continue
            kept.append(node)
            demo_only -= _defined(node)
        if whole and len(kept) == len(tree.body):
            out.append((i, cell.source))
        elif kept:
            out.append((i, ast.unparse(ast.Module(body=kept, type_ignores=[]))))
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
