"""Where and how ``attnlab grade`` runs a learner's code: the confinement, the boundary between grader and learner.

Here: the confinement (this module: bubblewrap's mounts and namespaces, ``setpriv`` to a user id of the sandbox's own,
``UID_BASE`` + the worker's pid, when the grader is root, rlimits, a memory and process :class:`Cgroup`);
:mod:`.runner`, the sandboxed processes and the grader's end of their pipes; :mod:`.frames`, the one wire format,
decoded on the trusted side; :mod:`.agent`, what the functions process does with a request; :mod:`.isolated`, the
kernel process for Triton parts; :mod:`.footprint`, memory measured around a call; :mod:`.ranks`, a process group's
shards delivered rank by rank. What each guarantees, as root and as any other user, is in docs/grading.md;
:func:`isolation` says which confinement is in use.
"""

import contextlib
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
MB = 2**20
LINUX = sys.platform.startswith("linux")


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
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_limit(which, value):
    """``setrlimit`` soft and hard to ``value``, never above the hard limit already set; ignored where refused."""
    with contextlib.suppress(ValueError, OSError):
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))


def kill(pids):
    """SIGKILL each of ``pids`` that still exists."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def protect_grader():
    """Not dumpable, and a child subreaper (orphans of the sandboxed processes become this process's children, so
    :func:`kill_descendants` finds them)."""
    if LINUX:
        _prctl(PR_SET_DUMPABLE, 0)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)


def as_root():
    return hasattr(os, "geteuid") and os.geteuid() == 0


@functools.lru_cache(maxsize=1)
def bwrap():
    """The path of a working bubblewrap (that can also drop to the sandbox's user), or None."""
    if not LINUX or os.environ.get("ATTNLAB_NO_BWRAP"):
        return None
    path = shutil.which("bwrap")
    if path is None or (as_root() and shutil.which("setpriv") is None):
        return None
    root = Path(tempfile.mkdtemp(prefix="attnlab-probe-"))
    try:
        cmd = _command(path, ["/bin/true"], root / "work", root, None, Limits(), probe=True)
        return path if subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None
    finally:
        shutil.rmtree(root, ignore_errors=True)


def isolation():
    """One line: how a learner's code is isolated on this machine."""
    if bwrap():
        who = ("as root: bubblewrap then setpriv to an unprivileged user id of its own, no capabilities"
               if as_root() else "bubblewrap in a user namespace, no capabilities, the grader's user id")
        limit = "a memory and process cgroup" if Cgroup.available() else "rlimits, RLIMIT_NPROC per user id"
        return (f"{who}; sees only Python, attnlab (without references) and a copy of the notebook; "
                f"tmpfs working folder, /tmp and /dev/shm; no network; {limit}")
    how = "no bubblewrap" if LINUX else f"no bubblewrap on {sys.platform}"
    return (f"rlimits only ({how}: install the Debian packages bubblewrap and util-linux for an unprivileged, "
            "private, offline sandbox); a temporary folder, own session, process tree killed")


def _readable_roots():
    """What a sandboxed process must read: the interpreter, the virtual environment, sys.path, the package."""
    import attnlab

    package = Path(attnlab.__file__).resolve().parent
    candidates = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *sys.path, str(package)}
    with contextlib.suppress(Exception):  # triton missing: nothing will need them
        import attnlab.kernels as kernels  # an editable install maps it to the course's kernels/

        candidates.add(str(Path(kernels.__file__).resolve().parent))
    found = set()
    for c in filter(None, candidates):
        for p in {Path(c).resolve(), Path(os.path.abspath(c))}:  # a linked virtual environment: both paths
            if p.exists() and p not in (Path("/"), package.parent, Path.cwd().resolve()):
                found.add(p)  # never the course checkout itself (solutions/), nor a folder a notebook came from
    return [p for p in sorted(found) if not any(q != p and p.is_relative_to(q) for q in found)]


def _exercise_mounts(empty):
    """bubblewrap's arguments for the exercise packages: a fresh read-only folder holding the ``__init__.py`` of the
    folder and of each package, and ``empty`` in place of every other file (the references and checks), with no
    ``__pycache__`` (a byte-compiling install or a checkout the grader wrote bytecode into holds them as ``.pyc``)."""
    from attnlab.grading import exercises

    root = Path(exercises.__file__).resolve().parent
    args = ["--size", str(MB), "--perms", "0755", "--tmpfs", str(root)]
    for p in sorted(root.rglob("*")):
        if "__pycache__" in p.relative_to(root).parts:
            continue
        if p.is_dir():
            args += ["--perms", "0755", "--dir", str(p)]
        else:
            shown = p.name == "__init__.py" and root in (p.parent, p.parent.parent)
            args += ["--ro-bind", str(p if shown else empty), str(p)]
    return args + ["--remount-ro", str(root)]


def _command(path, cmd, work, runtime, notebook, limits, probe=False):
    args = [path, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
            "--new-session", "--proc", "/proc", "--dev", "/dev",
            "--size", str(limits.tmp_mb * MB), "--perms", "1777", "--tmpfs", "/tmp",
            "--size", str(limits.shm_mb * MB), "--perms", "1777", "--tmpfs", "/dev/shm"]
    if not as_root():
        args += ["--unshare-user", "--cap-drop", "ALL"]
    for folder in ("/usr", "/bin", "/lib", "/lib64", "/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"):
        if os.path.lexists(folder):
            args += ["--ro-bind", folder, folder]
    made = set()

    def parents(folder):  # made 0755 (bubblewrap would make them 0700: the sandbox's user could not pass)
        new = [p for p in reversed(Path(folder).parents[:-1]) if p not in made]
        made.update(new)
        return [a for p in new for a in ("--perms", "0755", "--dir", str(p))]

    if not probe:
        for folder in _readable_roots():
            args += parents(folder) + ["--ro-bind", str(folder), str(folder)]
        empty = Path(runtime) / "empty.py"
        empty.touch()
        args += _exercise_mounts(empty)
        for dev in sorted(Path("/dev").glob("nvidia*")):  # a GPU stays usable
            args += ["--dev-bind", str(dev), str(dev)]
    args += parents(work) + ["--size", str(limits.work_mb * MB), "--perms", "1777", "--tmpfs", str(work)]
    if notebook is not None:
        args += ["--ro-bind", str(notebook), str(Path(work) / Path(notebook).name)]
    args += ["--remount-ro", "/", "--chdir", str(work), "--"]
    if as_root():
        uid = str(UID_BASE + os.getpid())
        args += [shutil.which("setpriv"), "--reuid", uid, "--regid", uid, "--clear-groups", "--inh-caps=-all",
                 "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return args + list(cmd)


def wrap_command(cmd, work, runtime, notebook=None, limits=None):
    """``cmd`` run in the sandbox (working folder ``work``, the grader's files for it in ``runtime``), or as is."""
    path = bwrap()
    return list(cmd) if path is None else _command(path, cmd, work, runtime, notebook, limits or Limits())


class Cgroup:
    """A memory and process cgroup for one submission (v2, else v1's memory and pids hierarchies)."""

    V2 = Path("/sys/fs/cgroup")

    def __init__(self, limits):
        self.paths = []
        name, memory = f"attnlab-grade-{os.getpid()}", limits.memory_mb * MB
        if (self.V2 / "cgroup.controllers").exists():
            layout = [("", {"memory.max": memory, "memory.swap.max": 0, "pids.max": limits.processes})]
        else:
            layout = [("memory", {"memory.limit_in_bytes": memory, "memory.memsw.limit_in_bytes": memory}),
                      ("pids", {"pids.max": limits.processes})]
        for controller, settings in layout:
            folder = self.V2 / controller / _own_cgroup(controller) / name
            folder.mkdir()
            self.paths.append(folder)
            for key, value in settings.items():
                try:
                    (folder / key).write_text(str(value))
                except FileNotFoundError:  # no swap accounting on this kernel: there is no swap to limit
                    if key not in ("memory.swap.max", "memory.memsw.limit_in_bytes"):
                        raise

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def available():
        with contextlib.suppress(OSError):
            if LINUX:
                Cgroup(Limits()).remove()
                return True
        return False

    @classmethod
    def make(cls, limits):
        """A cgroup, or None where none can be made here."""
        try:
            return cls(limits) if cls.available() else None
        except OSError:
            return None

    def enter(self):
        """Move the calling process in (from the child, before it runs the sandbox)."""
        for folder in self.paths:
            (folder / "cgroup.procs").write_text(str(os.getpid()))

    def _procs(self):
        pids = set()
        for folder in self.paths:
            with contextlib.suppress(OSError, ValueError):
                pids |= {int(p) for p in (folder / "cgroup.procs").read_text().split()}
        return pids

    def remove(self):
        _kill_until_gone(self._procs, lambda: time.sleep(0.05))
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


def preexec(limits, cgroup=None):
    """A function for Popen(preexec_fn=...): the limits, the cgroup, and death with the grader."""
    def apply():
        if cgroup is not None:
            cgroup.enter()
        # as root the count is the sandbox's own user id's: the submission's processes and threads alone;
        # otherwise it is the grader's user's, shared with everything else that user runs
        for which, value in ((resource.RLIMIT_DATA, limits.memory_mb * MB), (resource.RLIMIT_CPU, limits.cpu_s),
                             (resource.RLIMIT_FSIZE, limits.file_mb * MB), (resource.RLIMIT_CORE, 0),
                             (resource.RLIMIT_NPROC, limits.processes * (1 if as_root() else 4))):
            set_limit(which, value)
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
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def below(root):
    """Pids of every process below ``root``, nearest first."""
    parents, found, level = _children(), set(), {root}
    while level:
        level = {pid for pid, ppid in parents.items() if ppid in level and pid not in found}
        found |= level
        yield from sorted(level)


def descendants(root=None):
    """Pids of every process below ``root`` (default: this one)."""
    return set(below(os.getpid() if root is None else root))


def _kill_until_gone(find, wait):
    for _ in range(20):
        pids = find()
        if not pids:
            return
        kill(pids)
        wait()


def _reap():
    """Reap this process's dead children (the orphans re-parented here too) for up to a second."""
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.02)


def kill_descendants():
    """SIGKILL every process below this one until none is left."""
    if os.path.isdir("/proc"):
        _kill_until_gone(descendants, _reap)


def temp_root():
    return Path(tempfile.mkdtemp(prefix="attnlab-grade-"))
