"""The learner's function called on every rank of a real ``torch.distributed`` process group.

:func:`call_on_ranks` runs in the process that holds the learner's names (under ``attnlab grade`` the sandboxed
functions process, :mod:`attnlab.grading.runner`; for the inline ``check()`` the notebook's own kernel). The
learner's functions live in that process's IPython namespace, so the ranks are made with ``os.fork()``: a spawned
Python could not import them. Each child, for one case:

1. asks the kernel to kill it when its parent dies, and sets ``torch.set_num_threads(1)`` before any tensor work
   (a forked child must not enter the parent's OpenMP pool, and the ranks share this machine's cores);
2. joins a gloo group through a ``torch.distributed.FileStore`` in a temporary folder of its own (no TCP store,
   no port to pick; inside the sandbox's network namespace the ranks' sockets are on its loopback only), and waits
   on that store until every rank has joined (a rank that left at once would break a peer still connecting);
3. calls the function with its rank's ``[args, kwargs]``, its outcome written as :func:`agent._outcome` writes one;
4. sends the outcome to the parent as one frame (:func:`attnlab.grading.frames._send`) on a pipe of its own, destroys the group and
   leaves with ``os._exit`` (nothing of the parent's, no buffered stream, no ``atexit``, runs twice).

The parent reads every rank's frame until ``timeout`` seconds have passed; a rank that sent nothing by then (a
deadlock: a send with no matching receive, a rank waiting on a peer that left) is reported as having hung, a rank
whose pipe closed without a frame as having died. Then every child is killed and reaped, its folder removed: none
outlives the call. What comes back is data, as in :func:`agent.handle`: the grader decides.

A child is a copy of the process that holds the request: before it calls the function it blanks the request's list
of the ranks' arguments, so that a rank reaches no other rank's shard as a Python object (its memory is still
there to be read by a learner set on it; the grader's bytes, read from outside, see a rank that fetched the other
shards so and sent nothing).
"""

import ctypes
import datetime
import os
import select
import shutil
import signal
import sys
import tempfile
import time

DEFAULT_TIMEOUT = 10.0  # seconds one case may take on all its ranks (gloo's own timeout: 5 s more, so a
#                        deadlock is found here, as a hang, before gloo raises on a rank)
MAX_RANKS = 8


def call_on_ranks(fn, cases, world_size, outcome=None, timeout=None):
    """For each case (a list of ``world_size`` [args, kwargs] pairs, rank 0 first) the list of the ranks'
    outcomes; stops after the first case where a rank did not return. ``outcome(body)``: how a rank writes its
    outcome (the agent passes its ``_outcome``; default :func:`_result`)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_RANKS:
        raise ValueError(f"ranks: expected a number of ranks from 1 to {MAX_RANKS}, got {world_size!r}")
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    results = []
    for case in cases:
        if not isinstance(case, (list, tuple)) or len(case) != world_size:
            raise ValueError(f"ranks: each case needs one [args, kwargs] per rank ({world_size}), got "
                             f"{len(case) if isinstance(case, (list, tuple)) else type(case).__name__}")
        results.append(run_group(fn, case, timeout, outcome))
        if any("ok" not in outcome for outcome in results[-1]):
            break  # the grader stops at the first failure
    return results


def _result(body):
    """{"ok": value} or {"raised": the error in words}: a rank's outcome where no agent gives its own form."""
    try:
        return {"ok": body()}
    except BaseException as exc:  # noqa: BLE001 (the learner's error, reported)
        from attnlab.grading.feedback import describe_exception

        return {"raised": describe_exception(exc), "not_implemented": isinstance(exc, NotImplementedError)}


def run_group(fn, per_rank, timeout=None, outcome=None):
    """The outcomes of ``fn(*args, **kwargs)`` on the ranks of one fresh gloo group, one per [args, kwargs]."""
    world_size = len(per_rank)
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    folder = tempfile.mkdtemp(prefix="attnlab-ranks-")
    children = []  # (pid, read end of its pipe)
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        for rank, (args, kwargs) in enumerate(per_rank):
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns
                os.close(read_fd)
                for _, other in children:
                    os.close(other)
                if isinstance(per_rank, list):  # the other ranks' shards, out of this rank's reach (it has its own)
                    per_rank[:] = [None] * world_size
                _rank_main(fn, rank, world_size, args, kwargs, os.path.join(folder, "store"), write_fd, timeout,
                           parent, outcome or _result)
            os.close(write_fd)
            children.append((pid, read_fd))
        return _collect(children, timeout)
    finally:
        for pid, read_fd in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            os.close(read_fd)
        shutil.rmtree(folder, ignore_errors=True)


def _rank_main(fn, rank, world_size, args, kwargs, store_path, write_fd, timeout, parent, outcome_of):
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

        from attnlab.grading.frames import _send

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
    from attnlab.grading.frames import _receive

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
