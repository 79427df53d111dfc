"""Argument checks shared by every public function of attnlab and attnlab.kernels: one rule, one wording.

Every error names the argument, says what was expected and what came::

    q: expected a 4-D tensor (batch, heads, seq, head_dim), got shape (2, 3, 4)
    scale: expected a real number or None, got bool

A wrong *type* (not a tensor, a bool where a number belongs, an integer tensor where floats
belong, a dtype that differs from q's) raises ``TypeError``; a wrong *value* (a shape, a length,
a device, a range) raises ``ValueError``. The reference attention (``attention.py``,
``tiled.py``), the approximations (``approx.py``), the IO model (``iomodel.py``), the Triton
kernels (:func:`kernel_qkv`, :func:`kernel_blocks`, :func:`interpreter_dtypes`) and
``BlockMask`` all call these, so a rule changes in one place.

Example::

    from attnlab import validate
    validate.qkv(q, k, v)
    scale = validate.scale(scale, q.shape[-1])
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings

import torch

__all__ = ["tensor", "like", "qkv", "scale", "flag", "integer", "power_of_two", "number_in", "one_of", "bool_mask",
           "block_pair", "kernel_qkv", "kernel_blocks", "no_double_backward", "interpreter_dtypes", "KERNEL_HEAD_DIMS", "KERNEL_DTYPES",
           "renamed_keywords", "dim"]

# What the Triton attention kernels (attnlab.kernels) accept: one head dim of these for q, k and
# v (a power of two the tiles hold whole), in one of these dtypes (bfloat16 on a GPU only).
KERNEL_HEAD_DIMS = (16, 32, 64, 128)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _type_name(x):
    return type(x).__name__


def tensor(x, name, ndim=None, layout=None, *, floating=False, dtypes=None, nonempty=False):
    """``x`` is a torch.Tensor (of ``ndim`` dims named by ``layout``, floating point, one of
    ``dtypes``, with at least one element along every dim when ``nonempty``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {_type_name(x)}")
    if ndim is not None and x.dim() != ndim:
        layout = f" {layout}" if layout else ""
        raise ValueError(f"{name}: expected a {ndim}-D tensor{layout}, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {names}, got {x.dtype}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if nonempty and any(s == 0 for s in x.shape):
        raise ValueError(f"{name}: expected at least one element along every dim, got shape {tuple(x.shape)}")
    return x


def like(x, name, ref, ref_name):
    """``x`` has ``ref``'s dtype (else TypeError) and device (else ValueError)."""
    if x.dtype != ref.dtype:
        raise TypeError(f"{name}: expected dtype {ref.dtype} (the dtype of {ref_name}), got {x.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device} (the device of {ref_name}), got {x.device}")


def qkv(q, k, v, *, dtypes=None, same_head_dim=False, same_length=False, nonempty=False, gqa=False):
    """q (B, H, Nq, D), k (B, H, Nk, D), v (B, H, Nk, Dv): floating tensors of one dtype and device.
    ``same_head_dim``: Dv == D (the kernels); ``same_length``: Nq == Nk; ``nonempty``: every
    length at least 1; ``gqa``: k and v may have H_kv heads with H % H_kv == 0 (grouped-query
    attention; H_kv = 1 is multi-query attention)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        tensor(x, name, 4, "(batch, heads, seq, head_dim)", floating=True, dtypes=dtypes, nonempty=nonempty)
    for name, x in (("k", k), ("v", v)):
        like(x, name, q, "q")
    if gqa and k.shape[0] == q.shape[0] and k.shape[1] >= 1:
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"k: expected a number of heads that divides q's {q.shape[1]} (grouped-query attention: "
                             f"each KV head serves H_q / H_kv query heads), got shape {tuple(k.shape)}")
    elif k.shape[:2] != q.shape[:2]:
        raise ValueError(f"k: expected (batch, heads) = {tuple(q.shape[:2])} like q, got shape {tuple(k.shape)}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k: expected head_dim {q.shape[3]} like q, got shape {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: expected (batch, heads, seq) = {tuple(k.shape[:3])} like k, got shape {tuple(v.shape)}")
    if same_head_dim and v.shape[3] != q.shape[3]:
        raise ValueError(f"v: expected head_dim {q.shape[3]} like q (the kernels need them equal), "
                         f"got shape {tuple(v.shape)}")
    if same_length and k.shape[2] != q.shape[2]:
        raise ValueError(f"k: expected seq {q.shape[2]} like q, got shape {tuple(k.shape)}")


def scale(value, head_dim, *, positive=False):
    """The softmax scale as a float: ``1/sqrt(head_dim)`` for None, else a finite real number
    (not a bool; ``positive`` where the method needs ``sqrt(scale)``)."""
    if value is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"scale: expected a real number or None, got {_type_name(value)}")
    if not math.isfinite(value):
        raise ValueError(f"scale: expected a finite number, got {value}")
    if positive and not value > 0:
        raise ValueError(f"scale: expected a positive number, got {value}")
    return float(value)


def dim(value, x, name="dim"):
    """``value`` is an int (not a bool) that indexes a dimension of tensor ``x`` (negative counts
    from the end, as in torch)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {_type_name(value)}")
    n = max(x.dim(), 1)   # a 0-D tensor has dims -1 and 0, as in torch
    if not -n <= value < n:
        raise ValueError(f"{name}: expected an int in [{-n}, {n - 1}] for a tensor of shape {tuple(x.shape)}, "
                         f"got {value}")
    return int(value)


def flag(value, name):
    """``value`` is a bool (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {_type_name(value)}")
    return value


def integer(value, name, *, minimum=1, allow_none=False):
    """``value`` is an int (not a bool) of at least ``minimum`` (or None when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int{' or None' if allow_none else ''}, got {_type_name(value)}")
    if value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name}: expected {what}, got {value}")
    return int(value)


def power_of_two(value, name, minimum=16):
    """``value`` is an int power of two of at least ``minimum`` (a Triton block size)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int power of two >= {minimum}, got {_type_name(value)}")
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two >= {minimum}, got {value}")
    return int(value)


def number_in(value, name, low, high):
    """``value`` is a real number (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number in [{low}, {high}], got {_type_name(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name}: expected a number in [{low}, {high}], got {value}")
    return value


def one_of(value, name, choices):
    """``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")
    return value


def bool_mask(mask, name, shape, meaning="True = attend"):
    """A bool tensor that broadcasts to ``shape``."""
    tensor(mask, name)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name}: expected a bool tensor ({meaning}), got dtype {mask.dtype}")
    if mask.dim() > len(shape) or any(m not in (1, s) for m, s in zip(reversed(mask.shape), reversed(shape))):
        raise ValueError(f"{name}: expected a shape broadcastable to {tuple(shape)}, got {tuple(mask.shape)}")
    return mask


def block_pair(value, name="block_size", *, allowed=None, single_int=True):
    """A tile size ``(block_m, block_n)`` (query rows, key columns) as a tuple of two positive ints
    (an int means a square tile when ``single_int``); with ``allowed``, each must be one of those sizes."""
    if single_int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (value, value)
    what = "an int or a pair of ints (block_m, block_n)" if single_int else "a pair of ints (block_m, block_n)"
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or any(isinstance(b, bool) or not isinstance(b, numbers.Integral) for b in value)):
        raise TypeError(f"{name}: expected {what}, got {value!r}")
    if allowed is not None and any(b not in allowed for b in value):
        raise ValueError(f"{name}: expected sizes in {tuple(allowed)}, got {tuple(value)}")
    if any(b <= 0 for b in value):
        raise ValueError(f"{name}: expected positive sizes, got {tuple(value)}")
    return tuple(int(b) for b in value)


def interpreter_dtypes(interpreted, **tensors):
    """No tensor that will run in Triton's interpreter is bfloat16 (the interpreter computes with
    numpy, which has no bfloat16): ``TypeError`` naming the argument. ``interpreted(device)`` says
    whether a launch on that device is interpreted (``attnlab.kernels._runtime.use_interpreter``).
    None values are skipped."""
    for name, t in tensors.items():
        if t is not None and t.dtype == torch.bfloat16 and interpreted(t.device):
            raise TypeError(f"{name}: expected float32 or float16 in Triton's CPU interpreter (numpy has no "
                            f"bfloat16; bfloat16 runs on a CUDA GPU), got dtype {t.dtype}")


def kernel_qkv(q, k, v, sm_scale=None, causal=False, *, interpreted, gqa=False):
    """The checks every Triton attention wrapper makes before a launch; returns the scale as a float.

    :func:`qkv`'s rules, plus what the kernels need: one head dim for q, k and v, in
    ``KERNEL_HEAD_DIMS``; a dtype in ``KERNEL_DTYPES``; no empty dim; a CPU (interpreter) or CUDA
    tensor; a valid scale (``sm_scale``, named ``scale`` in errors as in the public functions) and
    a bool ``causal``; and no bfloat16 where the launch is
    interpreted (``interpreted(device)``, see :func:`interpreter_dtypes`).
    """
    qkv(q, k, v, dtypes=KERNEL_DTYPES, same_head_dim=True, nonempty=True, gqa=gqa)
    if q.shape[-1] not in KERNEL_HEAD_DIMS:
        raise ValueError(f"q: expected head_dim in {KERNEL_HEAD_DIMS}, got shape {tuple(q.shape)}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q: expected a CPU (interpreter) or CUDA tensor, got device {q.device}")
    sm_scale = scale(sm_scale, q.shape[-1])
    flag(causal, "causal")
    interpreter_dtypes(interpreted, q=q, k=k, v=v)
    return sm_scale


def no_double_backward(name):
    """Called at the top of a kernel's ``backward``: a ``RuntimeError`` when autograd asks for a
    graph of the gradients (``create_graph=True``, double backward), which the backward kernels
    cannot give, instead of returning first-order gradients without one. PyTorch's own fused
    attention kernels refuse it too ("derivative ... is not implemented")."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{name}: double backward (create_graph=True) is not supported: its backward is a "
                           f"Triton kernel with no derivative of its own; use attnlab.attention's reference or "
                           f"torch.nn.functional.scaled_dot_product_attention on the CPU for higher-order gradients")


def kernel_blocks(block_m, block_n):
    """A kernel's tile sizes: ``block_m`` query rows and ``block_n`` key columns per tile (Triton's
    BLOCK_M and BLOCK_N), each an int power of two >= 16 (``tl.dot`` needs 16)."""
    return power_of_two(block_m, "block_m"), power_of_two(block_n, "block_n")


def renamed_keywords(**renames):
    """Decorator for a public function whose keyword arguments were renamed (``old="new"``): the
    old name keeps working for one release, with a ``DeprecationWarning`` that names the new one
    (the README's "Changes" section lists each rename). Passing both names is a ``TypeError``.
    The wrapper keeps the function's name, signature and source (``functools.wraps``)."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{old}: expected only {new} (its new name), got both")
                    warnings.warn(f"{fn.__name__}: the keyword {old} is deprecated and will be removed after "
                                  f"attnlab 0.2; use {new}", DeprecationWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return wrapper
    return decorate
