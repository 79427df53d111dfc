"""Where and how ``attnlab grade`` runs a learner's kernel: a throwaway folder, limits, isolation.

- The notebook's folder is copied into a fresh temporary folder (:func:`working_copy`); the
  kernel runs there, never in the submission's own folder, and the copy is deleted afterwards.
- Limits (:class:`Limits`, set with ``setrlimit`` before the kernel starts): memory (the data
  segment, which counts every tensor), CPU seconds, the size of a file it writes, the number of
  processes, and no core files. The kernel gets its own session, inherits none of the grader's
  file descriptors, and its output goes to /dev/null.
- With bubblewrap (``bwrap``, Debian package ``bubblewrap``) on Linux the kernel also sees the
  whole filesystem read-only except its working copy and its connection files, gets a private
  ``/tmp``, its own process namespace (it cannot see or signal the grader, or reach the grader's
  ``/proc/<pid>/fd``) and no network; it dies with the grader, and every process it started dies
  with it. Without bubblewrap, the grader kills the kernel's whole process tree itself
  (:func:`kill_descendants`, with this process as the orphans' subreaper).

:func:`isolation` says which is in use; ``attnlab doctor`` and every report show it.
"""

import ctypes
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 1, 4, 36
COPY_LIMIT = 256 * 2**20  # a folder larger than this is not copied: only the notebook is


@dataclass
class Limits:
    memory_mb: int = 4096
    cpu_s: int = 900
    file_mb: int = 256
    processes: int = 512


def _prctl(option, value):
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def protect_grader():
    """Make this process hard to tamper with from a kernel running as the same user.

    Not dumpable: its /proc/<pid>/fd and memory need CAP_SYS_PTRACE; a child subreaper: orphans of
    the kernel (a double-forked daemon) become its children, so :func:`kill_descendants` finds them.
    """
    if sys.platform.startswith("linux"):
        _prctl(PR_SET_DUMPABLE, 0)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)


@functools.lru_cache(maxsize=1)
def bwrap():
    """The path of a working bubblewrap, or None."""
    if not sys.platform.startswith("linux") or os.environ.get("ATTNLAB_NO_BWRAP"):
        return None
    path = shutil.which("bwrap")
    if path is None:
        return None
    try:
        probe = subprocess.run([path, *_bwrap_base(), "--", "/bin/true"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return path if probe.returncode == 0 else None


def isolation():
    """One line: how a learner's kernel is isolated on this machine."""
    if bwrap():
        return ("bubblewrap: read-only filesystem but a temporary copy of the notebook's folder, no network, "
                "own process namespace, rlimits")
    how = "no bubblewrap" if sys.platform.startswith("linux") else f"no bubblewrap on {sys.platform}"
    return (f"rlimits only ({how}: install the Debian package bubblewrap for a read-only, offline sandbox); "
            "a temporary copy of the notebook's folder, own session, process tree killed")


def _bwrap_base():
    return ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session"]


def _needed_inside_private_tmp():
    """Folders the kernel must read that lie under /tmp or /dev/shm, which the sandbox replaces with
    empty private ones: the interpreter, the virtual environment, the course checkout (a CI clone or
    a course unpacked in /tmp), sys.path and Jupyter's runtime folder (the connection file)."""
    import attnlab

    candidates = {sys.prefix, sys.exec_prefix, sys.base_prefix, *sys.path,
                  str(Path(attnlab.__file__).resolve().parent.parent)}
    try:
        from jupyter_core.paths import jupyter_runtime_dir

        candidates.add(jupyter_runtime_dir())
    except Exception:  # pragma: no cover - jupyter_core is a dependency of the kernel machinery
        pass
    private = (Path("/tmp"), Path("/dev/shm"))
    found = set()
    for c in candidates:
        if not c:
            continue
        p = Path(c).resolve()
        if p.exists() and any(p != t and p.is_relative_to(t) for t in private):
            found.add(p)
    # the outermost folders only (a bind of a folder covers what is inside it)
    return [str(p) for p in sorted(found) if not any(q != p and p.is_relative_to(q) for q in found)]


def wrap_command(cmd, writable):
    """``cmd`` run inside bubblewrap with ``writable`` folders (the first is the working dir), or as is."""
    path = bwrap()
    if path is None:
        return list(cmd)
    args = [path, *_bwrap_base()]
    for folder in _needed_inside_private_tmp():  # the Python, venv and course the kernel runs from
        args += ["--ro-bind", folder, folder]
    for dev in sorted(Path("/dev").glob("nvidia*")):  # a GPU stays usable
        args += ["--dev-bind", str(dev), str(dev)]
    for folder in writable:
        args += ["--bind", str(folder), str(folder)]
    # in its own process namespace the kernel's parent is pid 1: tell ipykernel not to watch for the
    # grader's pid (which it cannot see); --die-with-parent does that job
    args += ["--setenv", "JPY_PARENT_PID", "1", "--chdir", str(writable[0]), "--"]
    return args + list(cmd)


def preexec(limits):
    """A function for Popen(preexec_fn=...): the limits, and death with the grader."""
    def apply():
        mb = 2**20
        for which, value in ((resource.RLIMIT_DATA, limits.memory_mb * mb), (resource.RLIMIT_CPU, limits.cpu_s),
                             (resource.RLIMIT_FSIZE, limits.file_mb * mb), (resource.RLIMIT_CORE, 0),
                             (resource.RLIMIT_NPROC, limits.processes)):
            try:
                hard = resource.getrlimit(which)[1]
                value = value if hard == resource.RLIM_INFINITY else min(value, hard)
                resource.setrlimit(which, (value, value))
            except (ValueError, OSError):
                pass
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return apply


def working_copy(notebook, dest):
    """Copy the notebook's folder (without other notebooks or hidden folders) into ``dest``; the copy's path."""
    notebook = Path(notebook).resolve()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    total = 0
    files = []
    for root, dirs, names in os.walk(notebook.parent):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in names:
            p = Path(root) / name
            if p.suffix == ".ipynb" or name.startswith(".") or p.is_symlink() or not p.is_file():
                continue
            total += p.stat().st_size
            files.append(p)
            if total > COPY_LIMIT:
                files = []
                break
        if total > COPY_LIMIT:
            break
    for p in files:
        target = dest / p.relative_to(notebook.parent)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, target)
    copy = dest / notebook.name
    shutil.copyfile(notebook, copy)
    return copy


def _children():
    """{pid: parent pid} of every process on this machine (Linux /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
            out[int(entry)] = int(text.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def descendants(root=None):
    """Pids of every process below ``root`` (default: this one)."""
    root = os.getpid() if root is None else root
    parents = _children()
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in found}
        found |= frontier
    return found


def kill_descendants(keep=(), rounds=20):
    """SIGKILL every process below this one except ``keep`` (and their own children) until none is left."""
    if not os.path.isdir("/proc"):
        return
    keep = set(keep)
    for _ in range(rounds):
        victims = descendants() - keep
        for pid in list(victims):
            kept_parent = False
            for k in keep:
                if pid in descendants(k):
                    kept_parent = True
                    break
            if kept_parent:
                victims.discard(pid)
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:  # reap the zombies re-parented to us
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.02)


def temp_root():
    return Path(tempfile.mkdtemp(prefix="attnlab-grade-"))
