"""What crosses between the grader and the learner's kernel: plain JSON, tensors as raw bytes.

The grader (the parent) sends a part's inputs to the kernel and receives the learner's outputs
back. Both directions use this format, never pickle: decoding runs in the parent on data the
learner's kernel produced, so it must not be able to run code. ``decode`` accepts only JSON
values, tuples, dicts with string keys and tensors of the dtypes below, and refuses anything
deeper than ``MAX_DEPTH`` or larger than ``MAX_BYTES``.

Example::

    text = encode({"x": torch.ones(2), "n": 3})
    decode(text)   # {"x": tensor([1., 1.]), "n": 3}
"""

import base64
import json
import math

MAX_DEPTH = 32
MAX_BYTES = 256 * 2**20

_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


class Unsupported:
    """A value the kernel could not send (its type's name): the checks report it as a wrong type."""

    def __init__(self, type_name):
        self.type_name = str(type_name)[:80]

    def __repr__(self):
        return f"<{self.type_name}>"


def _enc(x, depth):
    import torch

    if depth > MAX_DEPTH:
        return {"__unsupported__": "a too deeply nested value"}
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return x if abs(x) < 2**63 else {"__float__": repr(float(x))}
    if isinstance(x, float):
        return x if math.isfinite(x) else {"__float__": repr(x)}
    if type(x).__module__ == "numpy":
        import numpy as np

        if isinstance(x, np.ndarray):
            try:
                return _enc(torch.from_numpy(np.ascontiguousarray(x)), depth)
            except TypeError:
                return {"__unsupported__": f"numpy array of {x.dtype}"}
        if isinstance(x, np.bool_):
            return bool(x)
        if isinstance(x, np.integer):
            return _enc(int(x), depth)
        if isinstance(x, np.floating):
            return _enc(float(x), depth)
    if isinstance(x, torch.Tensor):
        t = torch.Tensor.detach(x)
        t = torch.Tensor.as_subclass(t, torch.Tensor).cpu().contiguous()
        name = str(t.dtype).replace("torch.", "")
        if name not in _DTYPES:
            return {"__unsupported__": f"a tensor of {t.dtype}"}
        raw = t.view(torch.int16) if name == "bfloat16" else t
        data = raw.numpy().tobytes()
        return {"__tensor__": name, "shape": list(t.shape), "data": base64.b64encode(data).decode("ascii")}
    if isinstance(x, tuple):
        return {"__tuple__": [_enc(v, depth + 1) for v in x]}
    if isinstance(x, list):
        return [_enc(v, depth + 1) for v in x]
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x) and not any(k.startswith("__") for k in x):
            return {k: _enc(v, depth + 1) for k, v in x.items()}
        return {"__unsupported__": "a dict with keys that are not plain strings"}
    return {"__unsupported__": type(x).__name__}


def encode(x):
    """``x`` as a JSON string (tensors, numbers, strings, None, lists, tuples, dicts)."""
    return json.dumps(_enc(x, 0), allow_nan=False)


def _dec(x, depth):
    import numpy as np
    import torch

    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [_dec(v, depth + 1) for v in x]
    if not isinstance(x, dict):
        raise ValueError(f"unexpected {type(x).__name__}")
    if "__tensor__" in x:
        name = x["__tensor__"]
        if name not in _DTYPES:
            raise ValueError(f"dtype {name!r} is not accepted")
        shape = x["shape"]
        if not (isinstance(shape, list) and all(isinstance(s, int) and 0 <= s for s in shape) and len(shape) <= 8):
            raise ValueError("bad tensor shape")
        data = base64.b64decode(x["data"], validate=True)
        if name == "bfloat16":
            t = torch.from_numpy(np.frombuffer(data, dtype=np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.frombuffer(data, dtype=np.dtype(name)).copy())
        if t.numel() != math.prod(shape):
            raise ValueError("tensor data does not match its shape")
        return t.reshape(shape)
    if "__tuple__" in x:
        return tuple(_dec(v, depth + 1) for v in x["__tuple__"])
    if "__float__" in x:
        value = float(x["__float__"])  # "nan", "inf", "-inf" or a huge int's float
        return value
    if "__unsupported__" in x:
        return Unsupported(x["__unsupported__"])
    return {str(k): _dec(v, depth + 1) for k, v in x.items()}


def decode(text):
    """The value ``encode`` wrote; ValueError for anything else."""
    if len(text) > MAX_BYTES:
        raise ValueError(f"more than {MAX_BYTES // 2**20} MiB")
    return _dec(json.loads(text), 0)
