"""``attnlab lab``: open JupyterLab on the lessons, with the course's Lab and server settings installed.

Two files, read by JupyterLab and Notebook 7 of this environment whoever starts them
(``make lab``, ``attnlab lab``, ``jupyter lab`` or ``jupyter notebook`` typed by the learner):

- ``attnlab/lab_settings/attnlab.json`` -> ``{sys.prefix}/share/jupyter/lab/settings/overrides.d/``:
  the widget manager saves widget state in notebooks (a lesson that was run, saved and reopened
  still shows its widgets), and no "get notified about official Jupyter news?" pop-up;
- ``attnlab/lab_settings/jupyter_server_config.d/attnlab.json`` -> ``{sys.prefix}/etc/jupyter/jupyter_server_config.d/``:
  enables this module as a Jupyter server extension (:func:`_load_jupyter_server_extension`):
  the server starts as root too (containers, Colab's runtime, cloud VMs: ``allow_root``, unless
  the learner's own config sets it), and every save of a notebook goes through
  :func:`keep_widget_state` (registered beside any pre-save hook of the learner's).

A wheel install puts both files there itself; an editable install (``make env``) does not, so
``make env`` and ``attnlab lab`` write them (``attnlab lab --install-settings`` only writes them).

Why ``keep_widget_state``: the widget manager (``@jupyter-widgets/jupyterlab-manager`` 5.0)
rebuilds the widgets of a reopened notebook from its saved state as models without a kernel
behind them (``comm_live`` false); registering each one marks the notebook modified (its
``setDirty``), and the next save, the learner's or the autosave two minutes later, writes only
the *live* models (``get_state_sync`` skips the others): none, for a notebook whose kernel
has not re-run the cells. The outputs still show those widgets, so the following open says
"Error displaying widget: model not found". The hook puts back, from the file being
replaced, the state of every model that the saved outputs still show (and the models they
refer to) but the new widget state lacks. Models the kernel re-created are saved as usual.

Why :data:`BOOT` rather than ``python -m jupyterlab``: the server's event schemas are validated by
jsonschema with its format checkers, and importing those brings ``rfc3987_syntax``, which compiles
about forty Lark grammars (2.5 to 3 s here, python-jsonschema/jsonschema#1428) for the ``iri``
formats, which no Jupyter schema uses (they use ``uri`` and ``date-time``). :func:`jupyterlab_main`
marks it absent first (:func:`attnlab.notebook_format.without_iri_checker`), then runs JupyterLab's
own entry point: Lab answers 1 to 3 s sooner (to ``/api/status``: 5.1-6.2 s against 2.7-2.9 s on a cold 2-core
machine, 1.98 s against 0.9 s warm). ``jupyter lab`` typed directly still works, slower.

This module imports only the standard library: the server imports it to run the hook.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def lessons_dir():
    """The lessons folder of the checkout this attnlab comes from (None for a wheel without it)."""
    here = Path(__file__).resolve().parent.parent / "lessons"
    return here if here.is_dir() else None


SETTINGS = Path(__file__).resolve().parent / "lab_settings" / "attnlab.json"
SERVER_CONFIG = Path(__file__).resolve().parent / "lab_settings" / "jupyter_server_config.d" / "attnlab.json"
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"


def settings_path(prefix=None):
    """Where JupyterLab and Notebook 7 of the environment at ``prefix`` (default ``sys.prefix``) read attnlab's settings."""
    return Path(prefix or sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.d" / SETTINGS.name


def server_config_path(prefix=None):
    """Where the Jupyter server of the environment at ``prefix`` (default ``sys.prefix``) reads attnlab's config."""
    return Path(prefix or sys.prefix) / "etc" / "jupyter" / "jupyter_server_config.d" / SERVER_CONFIG.name


def install_settings(prefix=None):
    """Write attnlab's Lab settings and server config into the environment at ``prefix`` (default
    ``sys.prefix``) unless they are there.

    Touches only attnlab's own files in ``overrides.d/`` and ``jupyter_server_config.d/`` (a
    learner's ``overrides.json``, user settings and own config stay as they are, and win).
    Returns ``[(path, written), ...]``, one pair per file.
    """
    done = []
    for source, target in ((SETTINGS, settings_path(prefix)), (SERVER_CONFIG, server_config_path(prefix))):
        text = source.read_text(encoding="utf-8")
        if target.is_file() and target.read_text(encoding="utf-8") == text:
            done.append((target, False))
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        done.append((target, True))
    return done


def _model_refs(value, found):
    """Add to ``found`` every model id that a widget state value refers to (``"IPY_MODEL_<id>"``)."""
    if isinstance(value, str):
        if value.startswith("IPY_MODEL_"):
            found.append(value[len("IPY_MODEL_"):])
    elif isinstance(value, dict):
        for v in value.values():
            _model_refs(v, found)
    elif isinstance(value, list):
        for v in value:
            _model_refs(v, found)


def merge_widget_state(notebook, previous):
    """Put back into ``notebook`` (a notebook dict, changed in place) the saved widget models of
    ``previous`` that its outputs still show but its own widget state lacks.

    Starts from the ``model_id`` of every widget view in the outputs and follows the models'
    references (children, layouts, styles); a model missing from ``notebook``'s state is copied
    from ``previous``'s. Returns the number of models put back.

    >>> merge_widget_state(json.load(open("new.ipynb")), json.load(open("old.ipynb")))  # doctest: +SKIP
    """
    old = (((previous.get("metadata") or {}).get("widgets") or {}).get(WIDGET_STATE_MIME) or {})
    old_state = old.get("state") or {}
    if not old_state:
        return 0
    todo = [out["data"][WIDGET_VIEW_MIME].get("model_id")
            for cell in notebook.get("cells", []) for out in (cell.get("outputs") or [])
            if isinstance(out.get("data"), dict) and isinstance(out["data"].get(WIDGET_VIEW_MIME), dict)]
    meta = notebook.setdefault("metadata", {})
    widgets = meta.get("widgets") if isinstance(meta.get("widgets"), dict) else {}
    entry = widgets.get(WIDGET_STATE_MIME) if isinstance(widgets.get(WIDGET_STATE_MIME), dict) else {}
    state = dict(entry.get("state") or {})
    seen, added = set(), 0
    while todo:
        model_id = todo.pop()
        if not model_id or model_id in seen:
            continue
        seen.add(model_id)
        if model_id not in state:
            if model_id not in old_state:
                continue
            state[model_id] = old_state[model_id]
            added += 1
        _model_refs(state[model_id].get("state", {}), todo)
    if added:
        widgets[WIDGET_STATE_MIME] = {"version_major": entry.get("version_major", old.get("version_major", 2)),
                                      "version_minor": entry.get("version_minor", old.get("version_minor", 0)),
                                      "state": state}
        meta["widgets"] = widgets
    return added


def keep_widget_state(model, path, contents_manager, **kwargs):
    """A pre-save hook of the Jupyter server (``ContentsManager.register_pre_save_hook``): before a
    notebook is saved, :func:`merge_widget_state` from the file it replaces. Never stops a save."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    try:
        os_path = contents_manager._get_os_path(path)
        with open(os_path, encoding="utf-8") as f:
            previous = json.load(f)
    except (OSError, ValueError, AttributeError, TypeError):
        return  # a new file, or not a notebook on disk: nothing to keep
    added = merge_widget_state(model["content"], previous)
    if added:
        contents_manager.log.info("attnlab: kept the saved state of %d widget models in %s", added, path)


def _jupyter_server_extension_points():
    return [{"module": "attnlab.lab"}]


def _load_jupyter_server_extension(serverapp):
    """Jupyter server extension: allow root (unless configured otherwise) and keep saved widget state."""
    if "allow_root" not in serverapp.config.get("ServerApp", {}):
        serverapp.allow_root = True  # checked when the server starts, after extensions load
    serverapp.contents_manager.register_pre_save_hook(keep_widget_state)
    serverapp.log.info("attnlab: saves keep the widget state the outputs show; root allowed: %s", serverapp.allow_root)


def add_arguments(parser):
    parser.add_argument("--dir", default=None, help="folder to open (default: the course's lessons/)")
    parser.add_argument("--port", type=int, default=None, help="the server's port (default: Jupyter's, 8888 or the next free one)")
    parser.add_argument("--no-browser", action="store_true", help="start the server without opening a browser")
    parser.add_argument("--install-settings", action="store_true",
                        help="only install the course's JupyterLab settings and server config into this environment, then exit")
    parser.add_argument("jupyter_args", nargs=argparse.REMAINDER, metavar="-- JUPYTER OPTIONS",
                        help="anything after -- goes to JupyterLab as it is (e.g. -- --ip=0.0.0.0 --IdentityProvider.token=secret)")
    parser.epilog = ("Examples: attnlab lab --no-browser --port 8890; "
                     "attnlab lab --no-browser -- --ip=0.0.0.0 (a remote machine: open the printed URL)")


def run(args):
    if args.install_settings:
        try:
            done = install_settings()
        except OSError as exc:
            print(f"error: --install-settings: cannot write into {sys.prefix}: {exc}", file=sys.stderr)
            return 1
        for path, written in done:
            print(f"{'wrote' if written else 'up to date'}: {path}")
        return 0
    if args.port is not None and not 0 < args.port < 65536:
        print(f"error: --port: {args.port} is not a port number (1 to 65535)", file=sys.stderr)
        return 2
    folder = Path(args.dir) if args.dir else lessons_dir()
    if folder is None:
        print("error: --dir: no lessons folder found beside this attnlab; pass the course's lessons/ folder",
              file=sys.stderr)
        return 2
    if not folder.is_dir():
        print(f"error: --dir: {folder} is not a folder", file=sys.stderr)
        return 2
    if shutil.which("jupyter") is None and not Path(sys.executable).with_name("jupyter").exists():
        print("error: JupyterLab is not installed: fix: pip install -c attnlab/constraints.txt jupyterlab", file=sys.stderr)
        return 1
    try:
        install_settings()
    except OSError as exc:  # a read-only environment: Lab still runs, saved lessons lose their widgets
        print(f"warning: cannot write into {sys.prefix} ({exc}): widget state will not be saved in notebooks",
              file=sys.stderr)
    extra = list(getattr(args, "jupyter_args", None) or [])
    if "--" in extra:  # `attnlab lab -- OPTIONS`: the separator is attnlab's, not JupyterLab's
        extra.remove("--")
    return subprocess.call(command(folder, no_browser=args.no_browser, port=args.port, extra=extra), cwd=folder.parent)


BOOT = [sys.executable, "-c", "import sys; from attnlab.lab import jupyterlab_main; sys.exit(jupyterlab_main())"]


def jupyterlab_main():
    """``python -m jupyterlab``, without the iri format checker that nothing in Jupyter uses (see the module's text)."""
    from attnlab.notebook_format import without_iri_checker

    without_iri_checker()
    from jupyterlab.labapp import main

    return main()


def command(folder, no_browser=False, port=None, extra=()):
    """The JupyterLab command line for a lessons folder.

    The server's root is the course folder (the lessons' parent), so the lessons' links to
    ../exercises and the learner's my-work/ resolve; the browser opens on the first lesson.
    ``extra`` (a list of str) goes to JupyterLab as it is, after attnlab's own options.

    >>> command("lessons", no_browser=True, port=8890)[-3:]  # doctest: +SKIP
    ['--no-browser', '--port=8890', '--allow-root']
    """
    folder = Path(folder).resolve()
    start = folder / "00_start_here.ipynb"
    page = f"{folder.name}/{start.name}" if start.exists() else folder.name
    cmd = [*BOOT, f"--ServerApp.root_dir={folder.parent}",
           f"--LabApp.default_url=/lab/tree/{page}"]
    if no_browser:
        cmd.append("--no-browser")
    if port is not None:
        cmd.append(f"--port={int(port)}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # also in the server config; here for a config-less install
        cmd.append("--allow-root")
    return cmd + list(extra)
