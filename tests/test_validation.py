"""One set of argument rules (attnlab.validate) behind every public attention entry point.

The same bad inputs go to every function that takes (q, k, v), and each must fail before any
work with the same kind of error (TypeError for a wrong type, ValueError for a wrong value) and
a message of one shape: ``<argument>: expected <what>, got <what came>``.
"""

import re

import pytest
import torch

from attnlab import approx, validate
from attnlab.attention import block_sparse_reference, naive_attention, scaled_dot_product_attention
from attnlab.kernels import BlockMask, block_sparse_attention, flash_attention, softmax, standard_attention
from attnlab.kernels.flash_steps import flash_forward_causal, flash_forward_loop, flash_forward_masked
from attnlab.tiled import tiled_attention

MESSAGE = re.compile(r"^[a-z_]+(, [a-z_]+)*: expected .+, got .+", re.S)
N, D = 32, 16


def _full_block_mask():
    return BlockMask(torch.ones(1, 1, 2, 2, dtype=torch.bool), (16, 16))


# every public function that takes (q, k, v): name -> call(q, k, v, **kw)
ENTRY_POINTS = {
    "scaled_dot_product_attention": scaled_dot_product_attention,
    "naive_attention": naive_attention,
    "tiled_attention": tiled_attention,
    "block_sparse_reference": lambda q, k, v, **kw: block_sparse_reference(q, k, v, _full_block_mask(), **kw),
    "local_window_attention": lambda q, k, v, **kw: approx.local_window_attention(q, k, v, window=4, **kw),
    "linformer_attention": lambda q, k, v, **kw: approx.linformer_attention(q, k, v, rank=8, **kw),
    "performer_attention": lambda q, k, v, **kw: approx.performer_attention(q, k, v, num_features=8, **kw),
    "flash_attention": flash_attention,
    "standard_attention": standard_attention,
    "block_sparse_attention": lambda q, k, v, **kw: block_sparse_attention(q, k, v, _full_block_mask(), **kw),
    "flash_forward_loop": lambda q, k, v, **kw: flash_forward_loop(q, k, v, block_m=16, block_n=16),
    "flash_forward_masked": lambda q, k, v, **kw: flash_forward_masked(q, k, v, block_m=16, block_n=16),
    "flash_forward_causal": lambda q, k, v, **kw: flash_forward_causal(q, k, v, block_m=16, block_n=16, **kw),
}
TAKES_SCALE = {"scaled_dot_product_attention", "naive_attention", "tiled_attention", "local_window_attention",
               "linformer_attention", "performer_attention", "flash_attention", "standard_attention",
               "block_sparse_attention", "block_sparse_reference"}
# the Triton kernels need at least one position; the plain references follow torch's SDPA there
# (no keys: every row outputs zeros), checked below
KERNELS = {"flash_attention", "standard_attention", "block_sparse_attention", "flash_forward_loop",
           "flash_forward_masked", "flash_forward_causal"}
TAKES_CAUSAL = {"scaled_dot_product_attention", "naive_attention", "tiled_attention", "flash_attention",
                "standard_attention", "block_sparse_attention", "flash_forward_causal", "local_window_attention",
                "performer_attention"}


def _qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, N, D, generator=g) for _ in range(3))


# name -> (make (args, kwargs) from good q, k, v; expected error type; the argument the message names)
BAD = {
    "non-tensor q": (lambda q, k, v: ((q.tolist(), k, v), {}), TypeError, "q"),
    "wrong rank": (lambda q, k, v: ((q[0], k, v), {}), ValueError, "q"),
    "integer dtype": (lambda q, k, v: ((q.long(), k.long(), v.long()), {}), TypeError, "q"),
    "mismatched dtype": (lambda q, k, v: ((q, k.double(), v), {}), TypeError, "k"),
    "mismatched device": (lambda q, k, v: ((q, k.to("meta"), v), {}), ValueError, "k"),
    "mismatched head dim": (lambda q, k, v: ((q, k[..., :8], v), {}), ValueError, "k"),
    "mismatched batch": (lambda q, k, v: ((q, k.expand(2, 2, N, D), v), {}), ValueError, "k"),
    "v shorter than k": (lambda q, k, v: ((q, k, v[:, :, :N // 2]), {}), ValueError, "v"),
    "zero length": (lambda q, k, v: ((q[:, :, :0], k, v), {}), ValueError, "q"),
    "bool scale": (lambda q, k, v: ((q, k, v), {"scale": True}), TypeError, "scale"),
    "NaN scale": (lambda q, k, v: ((q, k, v), {"scale": float("nan")}), ValueError, "scale"),
    "string scale": (lambda q, k, v: ((q, k, v), {"scale": "0.1"}), TypeError, "scale"),
    "non-bool causal": (lambda q, k, v: ((q, k, v), {"causal": 1}), TypeError, "causal"),
}


def _cases():
    for fn_name in ENTRY_POINTS:
        for bad_name, (make, err, arg) in BAD.items():
            if "scale" in bad_name and fn_name not in TAKES_SCALE:
                continue
            if "causal" in bad_name and fn_name not in TAKES_CAUSAL:
                continue
            if bad_name == "zero length" and fn_name not in KERNELS:
                continue
            yield pytest.param(fn_name, bad_name, id=f"{fn_name}-{bad_name}")


@pytest.mark.parametrize("fn_name,bad_name", list(_cases()))
def test_every_entry_point_rejects_the_same_bad_input_the_same_way(fn_name, bad_name):
    make, err, arg = BAD[bad_name]
    args, kwargs = make(*_qkv())
    with pytest.raises(err) as info:
        ENTRY_POINTS[fn_name](*args, **kwargs)
    message = str(info.value)
    assert MESSAGE.match(message), message
    assert message.split(":")[0].split(", ")[0] == arg, message


@pytest.mark.parametrize("fn", [softmax, approx.relative_error.__call__], ids=["kernels.softmax", "relative_error"])
def test_non_tensors_are_type_errors(fn):
    with pytest.raises(TypeError) as info:
        fn([1.0, 2.0]) if fn is softmax else fn([1.0], torch.ones(1))
    assert MESSAGE.match(str(info.value)), str(info.value)


@pytest.mark.parametrize("call,err,arg", [
    (lambda: validate.integer(True, "n"), TypeError, "n"),
    (lambda: validate.integer(0, "n"), ValueError, "n"),
    (lambda: validate.integer(-1, "window", minimum=0), ValueError, "window"),
    (lambda: validate.power_of_two(24, "block_m"), ValueError, "block_m"),
    (lambda: validate.number_in(1.5, "density", 0, 1), ValueError, "density"),
    (lambda: validate.block_pair((16, 24), allowed=(16, 32)), ValueError, "block_size"),
    (lambda: validate.block_pair("64"), TypeError, "block_size"),
    (lambda: validate.scale(-1.0, 64, positive=True), ValueError, "scale"),
    (lambda: BlockMask(torch.ones(1, 1, 2, 2), (16, 16)), TypeError, "mask"),
    (lambda: BlockMask(torch.ones(1, 1, 2, 2, dtype=torch.bool), (16, 24)), ValueError, "block_size"),
])
def test_the_rules_themselves(call, err, arg):
    with pytest.raises(err) as info:
        call()
    assert MESSAGE.match(str(info.value)) and str(info.value).startswith(arg + ":"), str(info.value)


def test_a_negative_scale_is_allowed_except_where_the_method_needs_its_root():
    q, k, v = _qkv()
    scaled_dot_product_attention(q, k, v, scale=-0.1)   # the maths is defined: softmax of -0.1 q.k
    flash_attention(q, k, v, scale=-0.1)
    with pytest.raises(ValueError, match="scale: expected a positive number"):
        approx.performer_attention(q, k, v, num_features=8, scale=-0.1)   # its features use sqrt(scale)


@pytest.mark.parametrize("fn", [scaled_dot_product_attention, naive_attention, tiled_attention])
def test_the_references_follow_sdpa_when_there_are_no_keys(fn):
    q, k, v = _qkv()
    out = fn(q, k[:, :, :0], v[:, :, :0])
    out = out[0] if isinstance(out, tuple) else out          # naive_attention also returns its matrix bytes
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :0], v[:, :, :0]))
    assert (out == 0).all()
