"""Start a process group the way users start one: ``launch`` from a notebook or a script, or ``torchrun``.

``launch(fn, world_size, *args)`` spawns ``world_size`` processes on this machine, joins them into one
``torch.distributed`` group (gloo on CPUs, NCCL when there is a GPU per rank), runs ``fn(*args)`` in each
and returns the ranks' results as a list. A free TCP port is picked for the rendezvous; when one rank
raises, the others are stopped and its exception is raised again here with that rank's traceback
attached; every child is gone when ``launch`` returns or raises (also on a timeout or a Ctrl-C).

Spawned processes start a fresh Python and import ``fn`` by its module and name, so ``fn`` must live in
a module (a ``.py`` file), never in a notebook cell: the course's rank functions are in
:mod:`attnlab.distributed.experiments`. Under ``torchrun`` the environment already names the rank, the
world size and the rendezvous; :func:`init_from_env` joins that group.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnlab import validate

__all__ = ["launch", "init_from_env", "pick_backend", "rank_device"]


def pick_backend(world_size=None):
    """``"nccl"`` when CUDA has a GPU for every rank (all of them when ``world_size`` is None), else ``"gloo"``."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if n_gpus and (world_size is None or n_gpus >= world_size) else "gloo"


def rank_device():
    """The device this rank computes on: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_from_env(backend=None):
    """Join the group that ``torchrun`` (or ``launch``) described in the environment; returns (rank, world_size).

    Example (a script started by ``torchrun --nproc-per-node 4 script.py``): ``rank, world = init_from_env()``
    """
    if not dist.is_initialized():
        world = int(os.environ["WORLD_SIZE"])
        backend = backend or pick_backend(world)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    return dist.get_rank(), dist.get_world_size()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_importable(fn):
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    main = sys.modules.get("__main__")
    interactive = module == "__main__" and not hasattr(main, "__file__")
    if "<lambda>" in qualname or "<locals>" in qualname or interactive:
        raise TypeError(f"fn: {qualname or fn!r} cannot be imported by the spawned processes (a lambda, a nested "
                        "function or one defined in a notebook); define it at the top level of a .py module, or use "
                        "one of attnlab.distributed.experiments")


def _die_with_parent():
    """Linux: ask the kernel to SIGKILL this rank if the launching process dies (killed, not just failed),
    so that even a parent that could not run its cleanup leaves no orphan behind."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass


def _worker(rank, fn, args, kwargs, world_size, port, backend, threads, folder):
    _die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    folder = Path(folder)
    try:
        init_from_env(backend)
        result = fn(*args, **kwargs)
        torch.save(result, folder / f"result{rank}.pt")
    except BaseException as exc:  # noqa: BLE001 (re-raised: the parent reads this file, spawn sees the exit)
        record = {"time": time.time(), "traceback": traceback.format_exc()}
        try:
            record["exception"] = pickle.loads(pickle.dumps(exc))
        except Exception:  # an exception that does not pickle travels as its text
            record["exception"] = RuntimeError(f"{type(exc).__name__}: {exc}")
        with open(folder / f"error{rank}.pkl", "wb") as f:
            pickle.dump(record, f)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _first_error(folder, world_size):
    records = []
    for r in range(world_size):
        path = Path(folder) / f"error{r}.pkl"
        if path.exists():
            with open(path, "rb") as f:
                records.append((pickle.load(f), r))
    if not records:
        return None
    record, r = min(records, key=lambda x: x[0]["time"])   # the rank that failed first caused the rest
    exc = record["exception"]
    exc.add_note(f"(raised on rank {r} of {world_size}; that rank's traceback:)\n{record['traceback']}")
    return exc


def _stop(processes, grace=5.0):
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn, world_size, *args, kwargs=None, backend=None, timeout=300.0, threads=1):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` local processes in one process group; return their results.

    fn: a top-level function of an importable module (see the module's docstring), called with ``args`` and
    ``kwargs`` (a dict); inside it ``torch.distributed.get_rank()`` says which rank it is. backend: ``"gloo"`` or ``"nccl"``
    (default: :func:`pick_backend`). timeout: seconds before every rank is stopped and TimeoutError
    raised. threads: torch threads per rank (1: the ranks share this machine's cores).
    Returns ``[result of rank 0, ..., result of rank world_size - 1]`` (returned values must pickle;
    tensors come back as they were, so keep them on the CPU).

    Example: ``launch(attnlab.distributed.experiments.exactness, 2, 64)``
    """
    _check_importable(fn)
    validate.integer(world_size, "world_size")
    validate.integer(threads, "threads")
    backend = pick_backend(world_size) if backend is None else validate.one_of(backend, "backend", ("gloo", "nccl"))
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    with tempfile.TemporaryDirectory(prefix="attnlab-launch-") as folder:
        context = mp.start_processes(_worker, args=(fn, args, dict(kwargs or {}), world_size, _free_port(), backend, threads, folder),
                                     nprocs=world_size, join=False, start_method="spawn")
        try:
            deadline = time.monotonic() + timeout
            while not context.join(timeout=0.05):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"launch: the {world_size} ranks did not finish within timeout={timeout} s; "
                                       "all were stopped")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as failure:
            exc = _first_error(folder, world_size)
            if exc is None:
                raise RuntimeError(f"launch: a rank died without raising ({failure})") from None
            raise exc from None
        finally:
            _stop(context.processes)
        return [torch.load(Path(folder) / f"result{r}.pt", weights_only=False) for r in range(world_size)]
