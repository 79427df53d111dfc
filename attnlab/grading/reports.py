"""What ``attnlab grade`` prints and writes: the terminal report, JSON, CSV and Gradescope's results.

Every string that reaches a terminal or a file passes :func:`safe_text` first (:func:`sanitize` on a whole report):
a learner's names, exceptions and printed text are untrusted, and control characters (an escape sequence, a carriage
return, a newline in a one-line field) could rewrite what a grader reads. CSV cells that a spreadsheet would run as
a formula are escaped (:func:`csv_cell`).
"""

import csv
import io
import os
import unicodedata
from pathlib import Path

from attnlab.grading import sandbox


def safe_text(text, newlines=False):
    """``text`` without control or bidirectional-format characters (newlines kept only if ``newlines``)."""
    out = []
    for ch in str(text):
        if ch == "\n" and newlines:
            out.append(ch)
        elif ch in "\n\r\t":
            out.append(" ")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp"):
            continue
        else:
            out.append(ch)
    return "".join(out)


_MULTILINE = {"feedback", "answer", "output"}


def sanitize(value, key=None):
    """A copy of a report (dicts, lists, strings, numbers) with every string passed through :func:`safe_text`."""
    if isinstance(value, dict):
        return {safe_text(k): sanitize(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitize(v, key) for v in value]
    if isinstance(value, str):
        return safe_text(value, newlines=key in _MULTILINE)
    return value


def csv_cell(value):
    """A CSV cell a spreadsheet shows as text: one starting with = + - @ (or a tab or carriage return) gets a '."""
    text = safe_text(value) if isinstance(value, str) else value
    if isinstance(text, str) and text[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + text
    return text


def plural(n, word):
    return f"{n} {word}" + ("" if n == 1 else "s")


def format_report(report):
    """The report of one notebook as the terminal shows it (every line made safe)."""
    report = sanitize(report)
    lines = [f"{report['path']}"]
    for w in report.get("warnings", []):
        lines.append(f"  warning: {w}")
    if report.get("error"):
        lines.append(f"  could not grade: {report['error']}")
        return "\n".join(lines)
    width = max([len(p["name"]) for p in report["parts"]] + [4])
    lines.append(f"  {'part':<{width}}  points  feedback")
    for p in report["parts"]:
        pts = f"{p['points']}/{p['max_points']}"
        first, *rest = p["feedback"].split("\n")
        lines.append(f"  {p['name']:<{width}}  {pts:>6}  {first}")
        lines.extend(f"  {'':<{width}}          {r.strip()}" for r in rest)
    lines.append(f"  {'total':<{width}}  {report['score']:>3}/{report['max_score']:<2}")
    for n in report.get("notes", []):
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def _write_atomic(path, text):
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _json_doc(reports, skipped):
    keys = ("path", "student", "assignment", "exercise", "score", "max_score", "parts", "warnings", "notes", "error",
            "isolation")
    return {"isolation": sandbox.isolation(),
            "notebooks": [{k: r[k] for k in keys if k in r} for r in reports], "skipped": skipped}


def csv_text(reports):
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["student", "assignment", "exercise", "score", "max_score", "path", "error"])
    for r in reports:
        w.writerow([csv_cell(v) for v in (r.get("student", ""), r.get("assignment", ""), r.get("exercise", ""),
                                          r.get("score", 0), r.get("max_score", 0), r["path"], r.get("error", ""))])
    return out.getvalue()


def gradescope_doc(reports, skipped, expected=None):
    """Gradescope's autograder results: one test per part, the total as the score.

    ``expected``: the exercises the assignment grades (``attnlab grade --exercise``, which ``--gradescope``
    requires): only those count, a notebook of another exercise is listed and not added (a solved 02 beside a
    partial 03 scored 11 of 8), and an expected exercise with no notebook is a test of 0 points. Each exercise
    counts once: when a submission holds several notebooks of one exercise, the one with the exercise's own file
    name (else the first by path) is scored and the others are listed as duplicates, never added.
    """
    from attnlab.grading.parts import MANUAL, exercises, points

    tests, counted, duplicates = [], {}, []
    for r in sorted(reports, key=lambda r: (Path(r["path"]).stem != r.get("exercise"), str(r["path"]))):
        label = r.get("exercise") or Path(r["path"]).stem
        if expected is not None and r.get("exercise") and r["exercise"] not in expected:
            duplicates.append(f"{r['path']}: exercise {label}, not one this assignment grades "
                              f"({', '.join(expected)}); not counted")
            continue
        if r.get("exercise") in counted:
            duplicates.append(f"{r['path']}: another notebook of {label} (graded: {counted[label]}); not counted")
            continue
        if r.get("exercise"):
            counted[label] = r["path"]
        if r.get("error"):
            tests.append({"name": f"{label}: could not grade", "score": 0, "max_score": r.get("max_score", 0),
                          "output": r["error"], "visibility": "visible"})
            continue
        for p in r["parts"]:
            if p.get("manual"):
                continue
            tests.append({"name": f"{label}: {p['name']}", "score": p["points"], "max_score": p["max_points"],
                          "output": p["feedback"], "visibility": "visible"})
    for exercise in [e for e in expected or () if e not in counted]:
        most = sum(points()[p] for p in exercises()[exercise] if p not in MANUAL)
        tests.append({"name": f"{exercise}: no notebook", "score": 0, "max_score": most,
                      "output": f"no notebook of {exercise} was found in the submission", "visibility": "visible"})
    lines = [f"skipped {s['path']}: {s['reason']}" for s in skipped] + duplicates
    if not reports:
        lines.append("no notebook was graded: upload your exercise notebooks (.ipynb)")
    doc = {"score": sum(t["score"] for t in tests), "tests": tests, "output": "\n".join(lines),
           "visibility": "visible", "stdout_visibility": "hidden"}
    return sanitize(doc)
