"""The sandboxed functions process's end of a process-group part (:mod:`attnlab.distributed.group` runs the group):
the grader sends each rank's shard as a frame of its own, which :func:`serve` moves into that rank's pipe with
``os.splice``, so the shards never become objects in the process that forks the ranks."""

import struct

from attnlab.distributed.group import MAX_CASES, _check_world_size, _group, _max_frame, _pour, _read_exact


def serve(req, ns, frames_in, frames_out, outcome=None, timeout=None):
    """The functions process's answer to ``{"op": "ranks", "name", "ranks": P, "cases": count}``: for each case,
    the P ranks are forked, ``{"send": case}`` asks the grader for its frames, and each of the P frames that follow
    on ``frames_in`` (rank 0 first, one ``[args, kwargs]`` each) is moved into its rank's pipe without being read
    here. Then ``{"results": [the ranks' outcomes per case]}`` as :func:`call_on_ranks`; ``{"missing": True}`` or
    ``{"not_callable": type}`` where the name is not a function (nothing asked for)."""
    name, world_size, count = req.get("name"), req.get("ranks"), req.get("cases")
    _check_world_size(world_size)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_CASES:
        raise ValueError(f"ranks: expected a number of cases from 0 to {MAX_CASES}, got {count!r}")
    if name not in ns:
        return {"missing": True}
    fn = ns[name]
    if not callable(fn):
        return {"not_callable": type(fn).__name__}
    source = frames_in.fileno()  # read raw: the grader sends a case's frames only once asked, so nothing of them
    #                              was read ahead into frames_in's buffer
    results = []
    for index in range(count):
        def ready(index=index):
            from attnlab.grading.sandbox.frames import _send

            _send(frames_out, {"send": index})

        def feed(rank, fd, deadline):
            (size,) = struct.unpack("<Q", _read_exact(source, 8))
            if size > _max_frame():
                raise ValueError(f"ranks: a frame of {size >> 20} MiB")
            return _pour(source, fd, size, struct.pack("<Q", size), deadline)

        results.append(_group(fn, world_size, feed, timeout, outcome, ready=ready,
                                 close=(frames_in.fileno(), frames_out.fileno())))
        if any("ok" not in outcome for outcome in results[-1]):
            break  # the grader stops at the first failure (and sends no later case)
    return {"results": results}
