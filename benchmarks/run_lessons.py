"""Run lessons top to bottom in a fresh kernel each and say how long each took and where one failed.

Usage: python benchmarks/run_lessons.py [--out DIR] [--timeout 300] lessons/05_quadratic_cost.ipynb ...

This is how the course checks that the lessons "run unchanged" somewhere new (a GPU machine,
another CPU): the notebooks are executed as they are, nothing is compared against the stored
outputs (a GPU prints other numbers), and each executed copy is written to DIR (never over
the lesson itself). Exit status 1 if any lesson raised. Needs nbclient and ipykernel.
"""

import argparse
import pathlib
import sys
import time


def execute(path, timeout):
    """One Run All of ``path`` in a fresh kernel -> (seconds, None or (cell index, error line), executed notebook)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    failure = None
    try:
        client.execute()
    except CellExecutionError as exc:
        lines = str(exc).strip().splitlines()
        failure = (_failed_cell(nb), lines[-1] if lines else type(exc).__name__)
    except Exception as exc:  # a dead kernel or a timeout: report it and go on with the next lesson
        failure = (_failed_cell(nb), f"{type(exc).__name__}: {exc}".splitlines()[0])
    return time.perf_counter() - start, failure, nb


def _failed_cell(nb):
    """Index of the first code cell whose output is an error (None if none is)."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return i
    return None


def run_one(path, out_dir, timeout):
    import nbformat

    seconds, failure, nb = execute(path, timeout)
    if out_dir is not None:
        nbformat.write(nb, out_dir / path.name)
    return seconds, None if failure is None else failure[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lessons", nargs="+", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="folder for the executed copies")
    ap.add_argument("--timeout", type=int, default=300, help="seconds one cell may take")
    args = ap.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        if any(args.out.resolve() == p.resolve().parent for p in args.lessons):
            ap.error("--out must not be the lessons' own folder: the executed copies would overwrite the lessons")
    failed = 0
    print(f"{'lesson':<32} {'seconds':>8}  result")
    for path in args.lessons:
        seconds, error = run_one(path, args.out, args.timeout)
        failed += error is not None
        print(f"{path.name:<32} {seconds:>8.1f}  {'ok' if error is None else 'FAILED: ' + error}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
