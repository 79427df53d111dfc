"""``attnlab doctor``: is this environment ready for the course, and if not, how to fix it.

Exit status 0 when the course can run (warnings allowed), 1 otherwise.
Nothing here imports torch or triton at module level, so the doctor runs even
when they are missing or broken.
"""

import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

CONSTRAINTS = Path(__file__).with_name("constraints.txt")
# what the doctor reports, in this order: (distribution, needed for the course to run?)
CHECKED = [
    ("torch", True),
    ("triton", True),
    ("numpy", True),
    ("ipywidgets", True),
    ("matplotlib", True),
    ("jupyterlab", False),
]


def tested_versions(path=CONSTRAINTS):
    """The tested set, ``{name: version}``, read from attnlab/constraints.txt."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def _installed(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _base(version):
    return version.split("+", 1)[0] if version else version


def diagnose():
    """Return ``(rows, problems, warnings)``: what was found, what blocks the course, what may surprise."""
    rows = [("python", platform.python_version())]
    problems, warnings = [], []
    pins = tested_versions()
    if sys.version_info[:2] != (3, 11):
        warnings.append(f"Python {platform.python_version()} is not the tested 3.11: "
                        "fix: create the environment with python3.11 (make lab does)")
    for name, required in CHECKED:
        version = _installed(name)
        rows.append((name, version or "missing"))
        pin = pins.get(name)
        fix = f"pip install -c attnlab/constraints.txt {name}=={pin}" if pin else f"pip install {name}"
        if version is None:
            (problems if required else warnings).append(f"{name} is not installed: fix: {fix}")
        elif pin and _base(version) != pin:
            warnings.append(f"{name} {version} is not the tested {pin}: fix: {fix}")
    gpu, mode = "unknown", "unknown"
    if _installed("torch"):
        try:
            import torch

            if torch.cuda.is_available():
                gpu = torch.cuda.get_device_name(0)
                mode = "native on the GPU (CPU tensors still run in Triton's interpreter)"
            else:
                gpu = "none"
                mode = "Triton's interpreter on the CPU (TRITON_INTERPRET is set by attnlab itself)"
        except Exception as exc:  # a broken torch install is exactly what the doctor is for
            problems.append(f"torch fails to import ({type(exc).__name__}: {exc}): "
                            f"fix: pip install --force-reinstall -c attnlab/constraints.txt torch=={pins.get('torch')}")
    rows.append(("gpu", gpu))
    rows.append(("kernels run", mode))
    if _installed("triton"):
        try:
            import triton  # noqa: F401
        except Exception as exc:
            problems.append(f"triton fails to import ({type(exc).__name__}: {exc}): "
                            f"fix: pip install --force-reinstall -c attnlab/constraints.txt triton=={pins.get('triton')}")
        else:
            if gpu != "unknown" and _installed("numpy"):  # torch imported: the hooks module can be
                from attnlab._interp_hooks import interpreter_problem

                problem = interpreter_problem(triton.__version__, _installed("numpy"))
                if problem is not None:
                    problems.append(f"the kernels cannot run in Triton's interpreter: {problem}")
    from attnlab.grading.sandbox import isolation

    rows.append(("grading", isolation()))   # how `attnlab grade` isolates a learner's kernel here
    tested = all(_base(_installed(n)) == pins.get(n) for n, _ in CHECKED if n in pins)
    rows.append(("tested set", "yes" if tested else "no (see warnings)"))
    if os.environ.get("TRITON_INTERPRET") not in (None, "", "0") and gpu not in ("none", "unknown"):
        warnings.append("TRITON_INTERPRET is set in your shell, so GPU tensors would be interpreted too: "
                        "fix: unset TRITON_INTERPRET (attnlab chooses the mode per tensor by itself)")
    saving, why = widget_state_saving()
    rows.append(("widgets", "state saved in notebooks" if saving else "state not saved in notebooks"))
    if not saving:
        warnings.append(f"{why}: a saved lesson reopened without its kernel shows \"model not found\" "
                        "instead of its widgets: fix: attnlab lab --install-settings")
    return rows, problems, warnings


def _says_false(path, key):
    """Whether the JSON (with comments) settings file at ``path`` sets ``key`` to false."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return False
    return re.search(rf'"{key}"\s*:\s*false', text) is not None


def widget_state_saving(prefix=None):
    """``(on, why_not)``: whether JupyterLab and Notebook 7 of this environment save widget state in
    notebooks (attnlab's settings override and server hook installed, and no settings file of the
    learner's turning ``saveState`` off)."""
    from attnlab.lab import server_config_path, settings_path

    if not settings_path(prefix).is_file():
        return False, f"attnlab's Lab settings are not installed at {settings_path(prefix)}"
    if not server_config_path(prefix).is_file():
        return False, f"attnlab's Jupyter server config is not installed at {server_config_path(prefix)}"
    config = Path(os.environ.get("JUPYTER_CONFIG_DIR") or Path.home() / ".jupyter")
    user = Path(os.environ.get("JUPYTERLAB_SETTINGS_DIR") or config / "lab" / "user-settings")
    for path in (user / "@jupyter-widgets" / "jupyterlab-manager" / "plugin.jupyterlab-settings",
                 settings_path(prefix).parent.parent / "overrides.json"):
        if _says_false(path, "saveState"):
            return False, f"{path} turns saveState off"
    return True, None


def add_arguments(parser):
    pass


def run(args=None):
    rows, problems, warnings = diagnose()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for w in warnings:
        print(f"warning: {w}")
    for p in problems:
        print(f"problem: {p}")
    print("the course can run" if not problems else "the course cannot run until the problems above are fixed")
    return 1 if problems else 0
