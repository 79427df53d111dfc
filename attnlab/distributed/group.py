"""The learner's function called on every rank of a real ``torch.distributed`` process group.

:func:`run_group` is the learner's way to run a function on P processes (exercise 11) and :func:`call_on_ranks`
the inline ``check()``'s, in the process that holds the learner's names (the notebook's own kernel);
:func:`attnlab.grading.sandbox.ranks.serve` is the same for the sandboxed functions process under ``attnlab grade``
(:mod:`attnlab.grading.sandbox.runner`). The learner's functions live in that process's IPython namespace, so the ranks are
made with ``os.fork()``: a spawned Python could not import them. A child is a copy of the process that forked it,
so the ranks are forked *before* any of them has its arguments: each is then sent its own ``[args, kwargs]`` on a
pipe of its own, and nothing of another rank's shard is in its memory (an at-fork hook, ``gc.get_objects()`` or a
global of the notebook finds none). Under ``attnlab grade`` the shards do not even pass through the forking
process's objects: the grader sends the request without them, waits for ``{"send": case}`` (every rank forked),
then writes each rank's frame, which :func:`serve` moves into that rank's pipe with ``os.splice`` (kernel to kernel).

Each child, for one case:

1. asks the kernel to kill it when its parent dies, closes every other rank's pipes, reads its own arguments
   (one frame, :func:`attnlab.grading.sandbox.frames._receive`), and sets ``torch.set_num_threads(1)`` before any tensor
   work (a forked child must not enter the parent's OpenMP pool, and the ranks share this machine's cores);
2. joins a gloo group through a ``torch.distributed.FileStore`` in a temporary folder of its own (no TCP store,
   no port to pick; inside the sandbox's network namespace the ranks' sockets are on its loopback only), and waits
   on that store until every rank has joined (a rank that left at once would break a peer still connecting);
3. calls the function with its rank's ``[args, kwargs]``, its outcome written as :func:`agent._outcome` writes one;
4. sends the outcome to the parent as one frame (:func:`attnlab.grading.sandbox.frames._send`) on a pipe of its own, destroys
   the group and leaves with ``os._exit`` (nothing of the parent's, no buffered stream, no ``atexit``, runs twice).

The parent reads every rank's frame until ``timeout`` seconds have passed; a rank that sent nothing by then (a
deadlock: a send with no matching receive, a rank waiting on a peer that left) is reported as having hung, a rank
whose pipe closed without a frame as having died. Then every child is killed and reaped, its folder removed: none
outlives the call. What comes back is data, as in :func:`agent.handle`: the grader decides.

What a rank still sees: its own shard; what the forking process held before the fork (the notebook's names, the
earlier cases' outcomes, none of this case's inputs); the file descriptors it inherits (the grader's pipes, the
write ends of the ranks forked before it). Ranks are processes of one machine: files, shared memory or a socket are
channels between them that no fork can close (the bytes the grader reads on the sandbox's loopback count only the
sockets), and code the learner runs in the forking process itself during the call sees what passes through it.
"""

import ctypes
import datetime
import errno
import fcntl
import io
import os
import select
import shutil
import signal
import struct
import sys
import tempfile
import time

DEFAULT_TIMEOUT = 10.0  # seconds one case may take on all its ranks (gloo's own timeout: 5 s more, so a
#                        deadlock is found here, as a hang, before gloo raises on a rank)
MAX_RANKS = 8
MAX_CASES = 64
PIPE_SIZE = 2**20       # a rank's input pipe (Linux's default limit for an unprivileged process): a shard's frame
#                         fits in it whole, so the parent hands it over without waiting for the rank to read


def call_on_ranks(fn, cases, world_size, outcome=None, timeout=None):
    """For each case (a list of ``world_size`` [args, kwargs] pairs, rank 0 first) the list of the ranks'
    outcomes; stops after the first case where a rank did not return. ``outcome(body)``: how a rank writes its
    outcome (the agent passes its ``_outcome``; default :func:`_result`). The caller holds the cases, so a rank
    forked here could find them in its memory: the request's own list is blanked in each child (the grader's
    process uses :func:`serve`, where the forking process never holds them)."""
    _check_world_size(world_size)
    results = []
    for case in cases:
        if not isinstance(case, (list, tuple)) or len(case) != world_size:
            raise ValueError(f"ranks: each case needs one [args, kwargs] per rank ({world_size}), got "
                             f"{len(case) if isinstance(case, (list, tuple)) else type(case).__name__}")

        def feed(rank, fd, deadline, case=case):
            stream = io.BytesIO()
            _send(stream, list(case[rank]))
            return _write_all(fd, stream.getvalue(), deadline)

        results.append(_group(fn, world_size, feed, timeout, outcome, forget=case))
        if any("ok" not in outcome for outcome in results[-1]):
            break  # the grader stops at the first failure
    return results


def _check_world_size(world_size):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_RANKS:
        raise ValueError(f"ranks: expected a number of ranks from 1 to {MAX_RANKS}, got {world_size!r}")


def _send(stream, obj):
    from attnlab.grading.sandbox.frames import _send as send

    send(stream, obj)


def _max_frame():
    from attnlab.grading.sandbox.frames import MAX_FRAME

    return MAX_FRAME


def _result(body):
    """{"ok": value} or {"raised": the error in words}: a rank's outcome where no agent gives its own form."""
    try:
        return {"ok": body()}
    except BaseException as exc:  # noqa: BLE001 (the learner's error, reported)
        from attnlab.grading.feedback import describe_exception

        return {"raised": describe_exception(exc), "not_implemented": isinstance(exc, NotImplementedError)}


def run_group(fn, per_rank, timeout=None, outcome=None):
    """The outcomes of ``fn`` on the ranks of one fresh gloo group, rank r called as ``fn(*args, **kwargs)`` with
    ``per_rank[r] = [args, kwargs]``: each ``{"ok": value, "written": bytes}``, or how the rank failed. The learner's
    way to run a function on P processes (exercise 11), as the grader does (:func:`call_on_ranks`)."""
    if not isinstance(per_rank, (list, tuple)):
        raise TypeError(f"per_rank: expected a list of [args, kwargs], one per rank, got {type(per_rank).__name__}")
    return call_on_ranks(fn, [list(per_rank)], len(per_rank), outcome, timeout)[0]


def _group(fn, world_size, feed, timeout=None, outcome=None, ready=None, forget=None, close=()):
    """The outcomes of ``fn(*args, **kwargs)`` on the ranks of one fresh gloo group.

    Every rank is forked first; then ``ready()`` (where given) and ``feed(rank, fd, deadline)`` for each rank in
    turn, which writes that rank's [args, kwargs] frame into ``fd``, its pipe (False: the rank did not take it). A
    child closes ``close`` (the grader's pipes) and the other ranks' pipes, and blanks the list ``forget``."""
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    folder = tempfile.mkdtemp(prefix="attnlab-ranks-")
    children = []  # (pid, write end of its input pipe or None once fed, read end of its outcome pipe)
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        for rank in range(world_size):
            in_read, in_write = os.pipe()
            out_read, out_write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns
                _close(in_write, out_read, *close, *(fd for _, w, r in children for fd in (w, r)))
                if isinstance(forget, list):
                    forget[:] = [None] * len(forget)
                _rank_main(fn, rank, world_size, in_read, os.path.join(folder, "store"), out_write, timeout,
                           parent, outcome or _result)
            os.close(in_read)  # a rank forked later never holds this one's input
            os.close(out_write)
            children.append([pid, in_write, out_read])
        # every rank exists: only now does any of them get its arguments, each on its own pipe
        if ready is not None:
            ready()
        deadline = time.monotonic() + timeout
        for rank, child in enumerate(children):
            try:
                fcntl.fcntl(child[1], fcntl.F_SETPIPE_SZ, PIPE_SIZE)
            except (OSError, AttributeError):
                pass
            os.set_blocking(child[1], False)
            feed(rank, child[1], deadline)
            os.close(child[1])
            child[1] = None
        return _collect([(pid, out_read) for pid, _, out_read in children], timeout)
    finally:
        for pid, in_write, out_read in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            _close(out_read, in_write)
        shutil.rmtree(folder, ignore_errors=True)


def _close(*fds):
    for fd in fds:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _read_exact(fd, size):
    """``size`` bytes from the pipe ``fd`` (blocking: the grader writes them); EOFError if it closes first."""
    out = b""
    while len(out) < size:
        block = os.read(fd, size - len(out))
        if not block:
            raise EOFError("the grader closed its pipe in the middle of a rank's frame")
        out += block
    return out


def _wait_writable(fd, deadline):
    left = deadline - time.monotonic()
    return left > 0 and bool(select.select([], [fd], [], left)[1])


def _write_all(fd, data, deadline):
    """Write ``data`` into the non-blocking pipe ``fd`` by ``deadline``; False where the rank left or never read."""
    view = memoryview(data)
    while view:
        if not _wait_writable(fd, deadline):
            return False
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue
        except OSError:  # EPIPE: the rank is gone
            return False
    return True


def _pour(source, fd, size, head, deadline):
    """Move the ``size`` bytes that follow on the pipe ``source`` into the non-blocking pipe ``fd``, after ``head``,
    with ``os.splice``: from pipe to pipe in the kernel, never through this process's memory (where the kernel has no
    splice, copied through it: every rank is forked already). What the rank does not take by ``deadline`` (it left,
    or never reads) is read off ``source`` and dropped, so that the next frame starts where it should."""
    delivered, splice = _write_all(fd, head, deadline), hasattr(os, "splice")
    left = size
    while left:
        select.select([source], [], [])  # the grader writes the frame at once
        if delivered and _wait_writable(fd, deadline):
            if splice:
                try:
                    moved = os.splice(source, fd, left, flags=os.SPLICE_F_NONBLOCK)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                        splice = False  # no splice between these pipes (a seccomp filter): copied instead
                        continue
                    delivered = False   # EPIPE: the rank is gone
                    continue
            else:
                block = os.read(source, min(left, 1 << 16))
                delivered = _write_all(fd, block, deadline)
                moved = len(block)
        else:
            delivered = False
            moved = len(os.read(source, min(left, 1 << 16)))
        if not moved:
            raise EOFError("the grader closed its pipe in the middle of a rank's frame")
        left -= moved
    return delivered


def _rank_main(fn, rank, world_size, in_fd, store_path, write_fd, timeout, parent, outcome_of):
    """One rank, in the forked child."""
    code = 1
    try:
        try:
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: die with the parent
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:  # the parent died before the request to die with it was made
            os._exit(1)
        import torch
        import torch.distributed as dist

        from attnlab.grading.sandbox.frames import _receive, _send

        with os.fdopen(in_fd, "rb") as stream:  # this rank's own [args, kwargs], sent once every rank was forked
            args, kwargs = _receive(stream)
        if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
            raise TypeError("a rank's arguments are [args, kwargs]")
        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the loopback: the only interface inside the sandbox
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))

        written = [None]

        def body():
            if dist.is_initialized():  # a group the notebook made, inherited through the fork: not this one
                raise RuntimeError("a process group is already initialised in your notebook; the grader makes its "
                                   "own: do not call torch.distributed.init_process_group in your function")
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout + 5))
            # every rank has its connections before any calls the function: gloo's full mesh is made pair by pair,
            # and a rank that returned and left at once broke a peer still connecting (a load-dependent "Gloo
            # connectFullMesh failed" on that peer, in CI). The store is a file, so the loopback's bytes are unchanged.
            store.set(f"joined/{rank}", "1")
            store.wait([f"joined/{other}" for other in range(world_size)], datetime.timedelta(seconds=timeout))
            before = _written()
            try:
                return fn(*args, **kwargs)
            finally:
                after = _written()
                written[0] = None if before is None or after is None else after - before

        outcome = outcome_of(body)
        outcome["written"] = written[0]  # what this rank says it wrote (its sockets: the sends), feedback only
        with os.fdopen(write_fd, "wb") as stream:
            _send(stream, outcome)
        code = 0
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (the parent reads a missing frame as a rank that died)
        pass
    finally:
        os._exit(code)
def _written():
    """Bytes this process has written through write(2)/writev(2) so far (``wchar`` of /proc/self/io, all its threads:
    gloo's sockets are written there), or None where the kernel does not count them."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def _collect(children, timeout):
    """Every child's outcome, read from its pipe; a rank that sends nothing within ``timeout`` s has hung."""
    from attnlab.grading.sandbox.frames import _receive

    outcomes = [None] * len(children)
    waiting = {read_fd: rank for rank, (_, read_fd) in enumerate(children)}
    deadline = time.monotonic() + timeout
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select(list(waiting), [], [], left)
        for read_fd in ready:
            rank = waiting.pop(read_fd)
            try:
                with os.fdopen(os.dup(read_fd), "rb") as stream:
                    outcome = _receive(stream)
                if not isinstance(outcome, dict):
                    raise TypeError("the outcome is not a dict")
            except Exception as exc:  # the pipe closed: the rank died before it answered
                outcome = {"raised": f"rank {rank} of {len(children)} died without an answer ({type(exc).__name__}: "
                                     f"{exc}; os._exit, a signal, out of memory?)", "died": True}
            outcomes[rank] = outcome
    for read_fd, rank in waiting.items():
        outcomes[rank] = {"raised": f"rank {rank} of {len(children)} did not finish within {timeout:.0f} s (a "
                                    "deadlock? every send needs a matching receive on the peer)", "hung": True}
    return outcomes
