"""Where and how ``attnlab grade`` runs a learner's code: an unprivileged user, a private filesystem, limits.

This package is the boundary between the grader and the learner's code. Here: the confinement (this module);
:mod:`.runner`, the sandboxed processes and the grader's end of their pipes; :mod:`.frames`, the one wire format,
decoded and checked on the trusted side; :mod:`.agent`, what the functions process does with a request (calls,
guarded launches); :mod:`.isolated`, the kernel process for Triton parts; :mod:`.footprint`, memory measured
around a call; :mod:`.ranks`, a process group's shards delivered rank by rank. The engine that decides a part
(:mod:`attnlab.grading.engine`) runs outside it, on what came back.

With bubblewrap (``bwrap``, Debian package ``bubblewrap``) on Linux a sandboxed process sees only:

- read-only: the Python it runs (the interpreter's prefix and the virtual environment) and the
  installed ``attnlab`` package, with every exercise package's references and checks replaced by
  empty files (only each package's ``__init__.py``, the parts table, stays);
- a private copy of the one notebook it runs, read-only, in a working folder that is a tmpfs of
  ``Limits.work_mb``; a private ``/tmp`` of ``Limits.tmp_mb`` and ``/dev/shm`` of ``Limits.shm_mb``.

Nothing else of ``/`` exists in it: no ``solutions/``, no other submission, no report, none of the
grader's files. It has its own process, network (none), IPC and UTS namespaces, dies with the grader
and has no capabilities:

- started by root (Gradescope, a container): bubblewrap builds the mounts, then ``setpriv`` drops
  to a user id of its own (:func:`sandbox_uid`, no passwd entry, no groups), clears every capability
  (bounding set too) and sets no-new-privileges before Python starts. The mounts are locked: a
  process without ``CAP_SYS_ADMIN`` in their namespace cannot remount them;
- started by anyone else: bubblewrap in a user namespace of its own, ``--cap-drop ALL``; the process
  keeps the user's id (it cannot become anyone else), but still sees only what is listed above.

Limits (:class:`Limits`): per process (``setrlimit``): memory (the data segment), CPU seconds, file
size, no core files; for the whole submission: a memory and process cgroup (:class:`Cgroup`,
version 1 or 2, where this machine lets one be made: root, or a delegated v2 subtree) holding the
process, its children and its tmpfs pages; otherwise the process count per user id (``RLIMIT_NPROC``,
which as root is the sandbox's own id: every process of the submission counts) and the tmpfs sizes.

Without bubblewrap only the rlimits hold (the process runs as the grader's user in a temporary
folder): :func:`isolation` says which is in use; ``attnlab doctor`` and every report show it.
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
UID_BASE = 2_000_000  # sandbox user ids: UID_BASE + the worker's pid (unique while it runs), never a real user


@dataclass
class Limits:
    memory_mb: int = 4096     # the whole submission (cgroup), and each process's data segment
    cpu_s: int = 900
    file_mb: int = 256
    processes: int = 256      # processes and threads of the whole submission
    work_mb: int = 256        # the working folder (tmpfs)
    tmp_mb: int = 256         # /tmp (tmpfs)
    shm_mb: int = 64          # /dev/shm (tmpfs)


def _prctl(option, value):
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def protect_grader():
    """Make this process hard to tamper with: not dumpable, and a child subreaper (orphans of the
    sandboxed processes become its children, so :func:`kill_descendants` finds them)."""
    if sys.platform.startswith("linux"):
        _prctl(PR_SET_DUMPABLE, 0)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)


def as_root():
    return hasattr(os, "geteuid") and os.geteuid() == 0


def sandbox_uid():
    """The user id a sandboxed process runs as when the grader is root (its own, unused by anyone else)."""
    return UID_BASE + os.getpid()


@functools.lru_cache(maxsize=1)
def bwrap():
    """The path of a working bubblewrap (that can also drop to the sandbox's user), or None."""
    if not sys.platform.startswith("linux") or os.environ.get("ATTNLAB_NO_BWRAP"):
        return None
    path = shutil.which("bwrap")
    if path is None or (as_root() and shutil.which("setpriv") is None):
        return None
    root = tempfile.mkdtemp(prefix="attnlab-probe-")
    try:
        cmd = _command(path, ["/bin/true"], Path(root) / "work", Path(root), None, Limits(), probe=True)
        probe = subprocess.run(cmd, capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return path if probe.returncode == 0 else None


def isolation():
    """One line: how a learner's code is isolated on this machine."""
    if bwrap():
        who = ("as root: bubblewrap then setpriv to an unprivileged user id of its own, no capabilities"
               if as_root() else "bubblewrap in a user namespace, no capabilities, the grader's user id")
        limit = "a memory and process cgroup" if Cgroup.available() else "rlimits, RLIMIT_NPROC per user id"
        return (f"{who}; sees only Python, attnlab (without references) and a copy of the notebook; "
                f"tmpfs working folder, /tmp and /dev/shm; no network; {limit}")
    how = "no bubblewrap" if sys.platform.startswith("linux") else f"no bubblewrap on {sys.platform}"
    return (f"rlimits only ({how}: install the Debian packages bubblewrap and util-linux for an unprivileged, "
            "private, offline sandbox); a temporary folder, own session, process tree killed")


def _readable_roots():
    """What a sandboxed process must read: the interpreter, the virtual environment, sys.path, the package."""
    import attnlab

    package = Path(attnlab.__file__).resolve().parent
    candidates = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *sys.path, str(package)}
    try:
        import attnlab.kernels as kernels  # an editable install maps it to the course's kernels/

        candidates.add(str(Path(kernels.__file__).resolve().parent))
    except Exception:  # pragma: no cover - triton missing: nothing will need them
        pass
    course = package.parent
    found = set()
    for c in candidates:
        if not c:
            continue
        for p in {Path(c).resolve(), Path(os.path.abspath(c))}:  # a linked virtual environment: both paths
            if not p.exists() or p in (Path("/"), course) or p == Path.cwd().resolve():
                continue  # never the course checkout itself (solutions/), nor a folder a notebook came from
            found.add(p)
    return [p for p in sorted(found) if not any(q != p and p.is_relative_to(q) for q in found)]


def _exercise_files():
    """(the exercise packages' folder, [(path, shown)]): every file and folder of it but bytecode caches;
    ``shown`` for the ``__init__.py`` of the folder and of each exercise package, None for a folder. The
    references and checks (``shown`` False) are what a sandboxed process never gets, as source or as a
    ``__pycache__`` ``.pyc`` (which a byte-compiling install or a writable checkout holds)."""
    from attnlab.grading import exercises

    root = Path(exercises.__file__).resolve().parent
    entries = []
    for p in sorted(root.rglob("*")):
        if "__pycache__" in p.relative_to(root).parts:
            continue
        shown = None if p.is_dir() else p.name == "__init__.py" and root in (p.parent, p.parent.parent)
        entries.append((p, shown))
    return root, entries


def _command(path, cmd, work, runtime, notebook, limits, probe=False):
    mb = 2**20
    args = [path, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
            "--new-session", "--proc", "/proc", "--dev", "/dev",
            "--size", str(limits.tmp_mb * mb), "--perms", "1777", "--tmpfs", "/tmp",
            "--size", str(limits.shm_mb * mb), "--perms", "1777", "--tmpfs", "/dev/shm"]
    if not as_root():
        args += ["--unshare-user", "--cap-drop", "ALL"]
    for folder in ("/usr", "/bin", "/lib", "/lib64", "/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"):
        if os.path.lexists(folder):
            args += ["--ro-bind", folder, folder]
    made = set()

    def parents(folder):  # made 0755 (bubblewrap would make them 0700: the sandbox's user could not pass)
        out = []
        for parent in reversed(Path(folder).parents[:-1]):
            if parent not in made:
                made.add(parent)
                out += ["--perms", "0755", "--dir", str(parent)]
        return out

    if not probe:
        for folder in _readable_roots():
            args += parents(folder) + ["--ro-bind", str(folder), str(folder)]
        # the exercise packages: a fresh read-only folder holding their __init__.py and an empty file for each other
        empty = Path(runtime) / "empty.py"
        empty.touch()
        root, entries = _exercise_files()
        args += ["--size", str(mb), "--perms", "0755", "--tmpfs", str(root)]
        for p, shown in entries:
            args += ["--perms", "0755", "--dir", str(p)] if shown is None else ["--ro-bind", str(p if shown else empty), str(p)]
        args += ["--remount-ro", str(root)]
        for dev in sorted(Path("/dev").glob("nvidia*")):  # a GPU stays usable
            args += ["--dev-bind", str(dev), str(dev)]
    args += parents(work)
    args += ["--size", str(limits.work_mb * mb), "--perms", "1777", "--tmpfs", str(work)]
    if notebook is not None:
        args += ["--ro-bind", str(notebook), str(Path(work) / Path(notebook).name)]
    args += ["--remount-ro", "/", "--chdir", str(work), "--"]
    if as_root():
        uid = str(sandbox_uid())
        args += [shutil.which("setpriv"), "--reuid", uid, "--regid", uid, "--clear-groups", "--inh-caps=-all",
                 "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return args + list(cmd)


def wrap_command(cmd, work, runtime, notebook=None, limits=None):
    """``cmd`` run in the sandbox (working folder ``work``, the grader's files for it in ``runtime``), or as is."""
    path = bwrap()
    if path is None:
        return list(cmd)
    return _command(path, cmd, work, runtime, notebook, limits or Limits())


class Cgroup:
    """A memory and process cgroup for one submission (v2, else v1's memory and pids hierarchies)."""

    V2 = Path("/sys/fs/cgroup")

    def __init__(self, limits):
        self.paths = []
        name = f"attnlab-grade-{os.getpid()}"
        mb = 2**20
        if (self.V2 / "cgroup.controllers").exists():
            base = self.V2 / _own_cgroup("")
            folder = base / name
            folder.mkdir()
            self.paths.append(folder)
            _write(folder / "memory.max", limits.memory_mb * mb)
            _write(folder / "memory.swap.max", 0, missing_ok=True)
            _write(folder / "pids.max", limits.processes)
        else:
            for controller, settings in (("memory", {"memory.limit_in_bytes": limits.memory_mb * mb,
                                                     "memory.memsw.limit_in_bytes": limits.memory_mb * mb}),
                                         ("pids", {"pids.max": limits.processes})):
                folder = self.V2 / controller / _own_cgroup(controller).lstrip("/") / name
                folder.mkdir()
                self.paths.append(folder)
                for key, value in settings.items():
                    _write(folder / key, value, missing_ok=key.startswith("memory.memsw"))

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def available():
        if not sys.platform.startswith("linux"):
            return False
        try:
            Cgroup(Limits()).remove()
            return True
        except OSError:
            return False

    @classmethod
    def make(cls, limits):
        """A cgroup, or None where none can be made here."""
        if not cls.available():
            return None
        try:
            return cls(limits)
        except OSError:
            return None

    def enter(self):
        """Move the calling process in (from the child, before it runs the sandbox)."""
        for folder in self.paths:
            _write(folder / "cgroup.procs", os.getpid())

    def kill(self):
        for _ in range(20):
            pids = set()
            for folder in self.paths:
                try:
                    pids |= {int(p) for p in (folder / "cgroup.procs").read_text().split()}
                except (OSError, ValueError):
                    pass
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.05)

    def remove(self):
        self.kill()
        for folder in self.paths:
            for _ in range(50):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


def _own_cgroup(controller):
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller == "" and names == "") or controller in names.split(","):
            return path.lstrip("/")
    raise OSError(f"no {controller or 'v2'} cgroup")


def _write(path, value, missing_ok=False):
    try:
        with open(path, "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise


def preexec(limits, cgroup=None):
    """A function for Popen(preexec_fn=...): the limits, the cgroup, and death with the grader."""
    def apply():
        if cgroup is not None:
            cgroup.enter()
        mb = 2**20
        # as root the count is the sandbox's own user id's: the submission's processes and threads alone;
        # otherwise it is the grader's user's, shared with everything else that user runs
        processes = limits.processes if as_root() else 4 * limits.processes
        for which, value in ((resource.RLIMIT_DATA, limits.memory_mb * mb), (resource.RLIMIT_CPU, limits.cpu_s),
                             (resource.RLIMIT_FSIZE, limits.file_mb * mb), (resource.RLIMIT_CORE, 0),
                             (resource.RLIMIT_NPROC, processes)):
            try:
                hard = resource.getrlimit(which)[1]
                value = value if hard == resource.RLIM_INFINITY else min(value, hard)
                resource.setrlimit(which, (value, value))
            except (ValueError, OSError):
                pass
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return apply


def private_copy(notebook, dest):
    """A copy of the notebook alone in ``dest`` (refusing a symbolic link); the copy's path."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    copy = dest / Path(notebook).name
    with open_notebook(notebook) as src, open(copy, "wb") as out:
        shutil.copyfileobj(src, out)
    os.chmod(copy, 0o644)
    return copy


def open_notebook(path):
    """The notebook file opened for reading, never through a symbolic link (OSError then)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    if not os.path.isfile(f"/proc/self/fd/{fd}") and not Path(path).is_file():
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


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


def kill_descendants(rounds=20):
    """SIGKILL every process below this one until none is left (reaping the orphans re-parented here)."""
    if not os.path.isdir("/proc"):
        return
    for _ in range(rounds):
        victims = descendants()
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.02)


def temp_root():
    return Path(tempfile.mkdtemp(prefix="attnlab-grade-"))
