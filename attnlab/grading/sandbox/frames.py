"""The frames between the grader and a process that holds learner code: ``torch.save`` bytes of plain values, read
back with ``torch.load(weights_only=True)``, so that nothing in a frame can run code (the sandboxed processes, and a
rank's outcome to the process that forked it)."""

import io
import os
import struct

MAX_FRAME = 512 * 2**20
MAX_VALUES = 1_000_000  # lists, dicts and values in one frame, counted as visited (a shared list counts each time)


def _send(stream, obj):
    """One frame: the length, then ``torch.save`` of ``obj``'s plain form (:func:`_plain`)."""
    import torch

    buffer = io.BytesIO()
    torch.save(_plain(obj), buffer)
    data = buffer.getvalue()
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream, limit=MAX_FRAME):
    """One frame, read with ``torch.load(weights_only=True)``: nothing in it can run code."""
    import torch

    head = stream.read(8)
    if len(head) != 8:
        raise EOFError("the process closed its pipe")
    (size,) = struct.unpack("<Q", head)
    if size > limit:
        raise ValueError(f"a frame of {size >> 20} MiB (more than {limit >> 20} MiB)")
    data = stream.read(size)
    if len(data) != size:
        raise EOFError("the process stopped in the middle of a frame")
    return _restored(torch.load(io.BytesIO(data), weights_only=True))


def requests(stream):
    """The frames read from ``stream`` until the other end closes it."""
    while True:
        try:
            yield _receive(stream)
        except EOFError:
            return


def frames(in_fd, out_fd):
    """The process's side of the pipes (duplicated: no child it starts inherits them); says it is ready."""
    streams = os.fdopen(os.dup(in_fd), "rb"), os.fdopen(os.dup(out_fd), "wb")
    os.close(in_fd)
    os.close(out_fd)
    _send(streams[1], {"ready": True})
    return streams


class Unsupported:
    """A value the kernel could not send (its type's name): the checks report it as a wrong type."""

    def __init__(self, type_name):
        self.type_name = str(type_name)[:80]

    def __repr__(self):
        return f"<{self.type_name}>"


def _plain(x, depth=0):
    """``x`` as what ``torch.load(weights_only=True)`` reads: plain tensors, numbers, strings, None, lists,
    tuples and dicts with string keys; anything else becomes {"__unsupported__": its type's name}."""
    import torch

    if depth > 32:
        return {"__unsupported__": "a too deeply nested value"}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x if not isinstance(x, int) or isinstance(x, bool) or abs(x) < 2**63 else float(x)
    if type(x).__module__ == "numpy":
        import numpy as np

        if isinstance(x, np.ndarray) and x.dtype != object:
            return _plain(torch.from_numpy(np.ascontiguousarray(x)), depth)
        if isinstance(x, (np.bool_, np.integer, np.floating)):
            return _plain(x.item(), depth)
    if isinstance(x, torch.Tensor):
        return torch.Tensor.as_subclass(torch.Tensor.detach(x), torch.Tensor).cpu().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_plain(v, depth + 1) for v in x) if type(x) in (tuple, list) else \
            {"__unsupported__": type(x).__name__}
    if type(x) is dict and all(type(k) is str and not k.startswith("__") for k in x):
        return {k: _plain(v, depth + 1) for k, v in x.items()}
    return {"__unsupported__": type(x).__name__}


def _restored(x, seen=None, depth=0):
    """A frame's value as the checks read it. A tensor that holds no plain CPU data (``device="meta"`` has no data
    at all and compares equal to anything of its shape; sparse, quantized, nested) is not an answer; a value nested
    deeper than :func:`_plain` sends, or a few shared lists that unfold into more than ``MAX_VALUES``, is refused."""
    import torch

    seen = [0] if seen is None else seen
    seen[0] += 1
    if seen[0] > MAX_VALUES or depth > 40:
        raise ValueError("a frame that unfolds into too many values or nests too deeply")
    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor or x.device.type != "cpu" or x.layout != torch.strided or x.is_quantized \
                or x.is_nested:
            return Unsupported("a tensor on the meta device (a shape, no values)" if x.device.type == "meta" else
                               f"a {str(x.layout).replace('torch.', '')} tensor on {x.device.type} (only a dense "
                               f"CPU tensor of values is compared)")
        if x.numel() * x.element_size() > x.untyped_storage().nbytes():
            # a view that repeats its memory (stride 0: 4 bytes claiming 600 million values) would be materialised
            # by the first comparison in the grader's process; :func:`_plain` sends a copy, which never repeats
            return Unsupported(f"a tensor of {x.numel():,} values held in {x.untyped_storage().nbytes():,} bytes (a "
                               f"view that repeats its memory; only a tensor holding its own values is compared)")
        return x
    if isinstance(x, dict):
        if set(x) == {"__unsupported__"}:
            return Unsupported(x["__unsupported__"])
        return {k: _restored(v, seen, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_restored(v, seen, depth + 1) for v in x)
    return x
