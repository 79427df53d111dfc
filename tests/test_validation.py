"""One set of argument rules (attnlab.validate) behind every public function that takes tensors.

The same bad inputs go to every function that takes (q, k, v), and each must fail before any
work with the same kind of error (TypeError for a wrong type, ValueError for a wrong value) and
a message of one shape: ``<argument>: expected <what>, got <what came>``. Every other public
function that takes a tensor (or a block mask, or a function to run) has rows of its own below.

Which functions: every name in the ``__all__`` of ``PUBLIC_MODULES`` (the reference attention,
tiled, approx, iomodel, memory, measure, sparse, the decoding caches of lesson 10 (kvquant, streaming,
prefix, mla) and every module of ``attnlab.kernels``, found on disk).
Each must be a (q, k, v) entry point, have rows in ``OTHER_ROWS``, or be listed in
``NO_TENSORS`` with the reason, so a new public function without a row fails
``test_every_public_function_has_a_row``. (Models, data and widgets have their own tests.)
"""

import importlib
import inspect
import pkgutil
import re

import pytest
import torch

import attnlab.kernels
from attnlab import (approx, attention, iomodel, kvquant, mask_mods, measure, memory, prefix, sparse, streaming,
                     validate)
from attnlab.mla import MLA
from attnlab.attention import block_sparse_reference, naive_attention, scaled_dot_product_attention
from attnlab.kernels import (BlockMask, block_sparse_attention, flash_attention, full_mask, intersection, softmax,
                             standard_attention, union, vector_add)
from attnlab.kernels._runtime import Kernel
from attnlab.kernels.block_sparse_attention import prepare_block_mask
from attnlab.kernels.selected_attention import selected_attention
from attnlab.kernels.block_mask import create_block_mask
from attnlab.kernels.flash_steps import (flash_backward_minimal, flash_forward_causal, flash_forward_loop,
                                         flash_forward_masked)
from attnlab.kernels.softmax import naive_softmax
from attnlab.kernels.tutorial_softmax import tutorial_softmax
from attnlab.tiled import tiled_attention

MESSAGE = re.compile(r"^[a-z_]+(, [a-z_]+)*: expected .+, got .+", re.S)
N, D = 32, 16


def _full_block_mask():
    return BlockMask(torch.ones(1, 1, 2, 2, dtype=torch.bool), (16, 16))


def _selection():   # block_indices for N = 32 in blocks of 16: query block 1 selects both key blocks
    return torch.tensor([[[[0, -1], [0, 1]]]], dtype=torch.int32)


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
    "selected_attention": lambda q, k, v, **kw: selected_attention(q, k, v, _selection(), block_size=16, **kw),
    "selected_attention_reference":
        lambda q, k, v, **kw: sparse.selected_attention_reference(q, k, v, _selection(), block_size=16, **kw),
}
# the function behind each ENTRY_POINTS row (for the coverage test at the end)
QKV_FUNCTIONS = {
    "scaled_dot_product_attention": scaled_dot_product_attention, "naive_attention": naive_attention,
    "tiled_attention": tiled_attention, "block_sparse_reference": block_sparse_reference,
    "local_window_attention": approx.local_window_attention, "linformer_attention": approx.linformer_attention,
    "performer_attention": approx.performer_attention, "flash_attention": flash_attention,
    "standard_attention": standard_attention, "block_sparse_attention": block_sparse_attention,
    "flash_forward_loop": flash_forward_loop, "flash_forward_masked": flash_forward_masked,
    "flash_forward_causal": flash_forward_causal, "selected_attention": selected_attention,
    "selected_attention_reference": sparse.selected_attention_reference,
}
assert set(QKV_FUNCTIONS) == set(ENTRY_POINTS)
TAKES_SCALE = {"scaled_dot_product_attention", "naive_attention", "tiled_attention", "local_window_attention",
               "linformer_attention", "performer_attention", "flash_attention", "standard_attention",
               "block_sparse_attention", "block_sparse_reference", "selected_attention", "selected_attention_reference"}
# the Triton kernels need at least one position; the plain references follow torch's SDPA there
# (no keys: every row outputs zeros), checked below
KERNELS = {"flash_attention", "standard_attention", "block_sparse_attention", "selected_attention", "flash_forward_loop",
           "flash_forward_masked", "flash_forward_causal"}
TAKES_CAUSAL = {"scaled_dot_product_attention", "naive_attention", "tiled_attention", "flash_attention",
                "standard_attention", "block_sparse_attention", "flash_forward_causal", "local_window_attention",
                "performer_attention", "selected_attention", "selected_attention_reference"}


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


# ---------------------------------------------------------------------------------------------
# every other public function that takes a tensor: its own bad inputs, the same message shape
# ---------------------------------------------------------------------------------------------
def _q16():
    return torch.randn(1, 1, 64, 16)


def _lse():
    return torch.zeros(1, 1, 64)


def _cache():   # a KV cache (batch, kv_heads, seq, head_dim)
    return torch.randn(1, 2, 20, 16)


def _pool_with_sequence():
    pool = prefix.PagedKVPool(4, 2, 16, 16)
    pool.new_sequence()                     # id 0
    return pool


def _mla(d_rope=16):
    return MLA(64, 4, d_head=16, d_latent=48, d_rope=d_rope, max_positions=32, seed=0)


# (function, what is wrong, call, error type, the argument the message names)
OTHER_ROWS = [
    (attention.softmax, "non-tensor", lambda: attention.softmax([1.0]), TypeError, "x"),
    (attention.softmax, "integer dtype", lambda: attention.softmax(torch.ones(3, dtype=torch.long)), TypeError, "x"),
    (attention.softmax, "dim out of range", lambda: attention.softmax(torch.ones(2, 3), dim=2), ValueError, "dim"),
    (attention.masked_softmax, "non-tensor", lambda: attention.masked_softmax([1.0], None), TypeError, "x"),
    (attention.masked_softmax, "float mask", lambda: attention.masked_softmax(torch.ones(2, 3), torch.ones(2, 3)),
     TypeError, "mask"),
    (attention.masked_softmax, "mask shape",
     lambda: attention.masked_softmax(torch.ones(2, 3), torch.ones(4, 3, dtype=torch.bool)), ValueError, "mask"),
    (attention.masked_softmax, "bool dim",
     lambda: attention.masked_softmax(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), dim=True),
     TypeError, "dim"),
    (attention.padding_mask, "float lengths", lambda: attention.padding_mask(torch.tensor([1.0, 2.0])),
     TypeError, "lengths"),
    (attention.padding_mask, "wrong rank", lambda: attention.padding_mask(torch.ones(2, 2, dtype=torch.long)),
     ValueError, "lengths"),
    (attention.causal_mask, "tensor length", lambda: attention.causal_mask(torch.tensor(3)), TypeError, "n_q"),
    (attention.AdditiveAttention, "non-tensor query",
     lambda: attention.AdditiveAttention(4, 4, 8)([1.0], torch.randn(1, 3, 4)), TypeError, "query"),
    (attention.AdditiveAttention, "wrong rank",
     lambda: attention.AdditiveAttention(4, 4, 8)(torch.randn(4), torch.randn(1, 3, 4)), ValueError, "query"),
    (attention.MultiHeadAttention, "non-tensor query", lambda: attention.MultiHeadAttention(8, 2)([1.0]),
     TypeError, "query"),
    (attention.MultiHeadAttention, "wrong rank", lambda: attention.MultiHeadAttention(8, 2)(torch.randn(8)),
     ValueError, "query"),
    (approx.path_length, "non-tensor", lambda: approx.path_length([[True]]), TypeError, "mask"),
    (approx.path_length, "float mask", lambda: approx.path_length(torch.ones(3, 3)), TypeError, "mask"),
    (approx.relative_error, "non-tensor", lambda: approx.relative_error([1.0], torch.ones(1)), TypeError, "approx"),
    (approx.relative_error, "shapes differ", lambda: approx.relative_error(torch.ones(2), torch.ones(1)),
     ValueError, "approx"),
    (softmax, "non-tensor", lambda: softmax([1.0]), TypeError, "x"),
    (softmax, "integer dtype", lambda: softmax(torch.ones(2, 2, dtype=torch.long)), TypeError, "x"),
    (naive_softmax, "non-tensor", lambda: naive_softmax([1.0]), TypeError, "x"),
    (naive_softmax, "wrong rank", lambda: naive_softmax(torch.ones(2, 2, 2)), ValueError, "x"),
    (tutorial_softmax, "non-tensor", lambda: tutorial_softmax([1.0]), TypeError, "x"),
    (tutorial_softmax, "wrong rank", lambda: tutorial_softmax(torch.ones(2, 2, 2)), ValueError, "x"),
    (vector_add, "non-tensor", lambda: vector_add([1.0], torch.ones(1)), TypeError, "x"),
    (vector_add, "wrong rank", lambda: vector_add(torch.ones(2, 2), torch.ones(2, 2)), ValueError, "x"),
    (flash_backward_minimal, "non-tensor q",
     lambda: flash_backward_minimal([1.0], _q16(), _q16(), _q16(), _lse(), _q16(), 16, 16), TypeError, "q"),
    (flash_backward_minimal, "non-tensor o",
     lambda: flash_backward_minimal(_q16(), _q16(), _q16(), [1.0], _lse(), _q16(), 16, 16), TypeError, "o"),
    (flash_backward_minimal, "lse shape",
     lambda: flash_backward_minimal(_q16(), _q16(), _q16(), _q16(), _lse()[..., :-1], _q16(), 16, 16),
     ValueError, "lse"),
    (flash_backward_minimal, "block not a power of two",
     lambda: flash_backward_minimal(_q16(), _q16(), _q16(), _q16(), _lse(), _q16(), 24, 16), ValueError, "block_m"),
    (prepare_block_mask, "not a mask", lambda: prepare_block_mask("x", None, 16, 16, 1, 1), TypeError, "block_mask"),
    (BlockMask, "non-tensor", lambda: BlockMask([[True]], (16, 16)), TypeError, "mask"),
    (create_block_mask, "not a mask_mod", lambda: create_block_mask("x", None, None, 16, 16, 16), TypeError, "mask_mods"),
    (create_block_mask, "bad block size", lambda: create_block_mask(mask_mods.causal, None, None, 16, 16, 24), ValueError,
     "block_size"),
    (BlockMask, "float mask", lambda: BlockMask(torch.ones(1, 1, 2, 2), (16, 16)), TypeError, "mask"),
    (union, "not a BlockMask", lambda: union("x"), TypeError, "masks"),
    (intersection, "not a BlockMask", lambda: intersection(full_mask(16, 16, (16, 16)), "x"), TypeError, "masks"),
    (iomodel.block_sparse_forward_io, "not a mask", lambda: iomodel.block_sparse_forward_io(1, 1, 16, block_mask="x"),
     TypeError, "block_mask"),
    (iomodel.block_sparse_backward_io, "float mask",
     lambda: iomodel.block_sparse_backward_io(1, 1, 64, block_mask=torch.ones(1, 1, 1, 1)), TypeError, "block_mask"),
    (iomodel.selected_attention_forward_io, "int64 block_indices",
     lambda: iomodel.selected_attention_forward_io(1, 1, 32, d=16, block_indices=_selection().long(), block_size=16),
     TypeError, "block_indices"),
    (iomodel.selected_attention_backward_io, "id out of range",
     lambda: iomodel.selected_attention_backward_io(1, 1, 32, d=16, block_indices=_selection() + 1, block_size=16),
     ValueError, "block_indices"),
    (sparse.indexer_scores, "non-tensor k_idx", lambda: sparse.indexer_scores(torch.randn(1, 2, 8, 4), [1.0]),
     TypeError, "k_idx"),
    (sparse.indexer_scores, "k_idx index_dim",
     lambda: sparse.indexer_scores(torch.randn(1, 2, 8, 4), torch.randn(1, 8, 3)), ValueError, "k_idx"),
    (sparse.indexer_block_scores, "weights shape",
     lambda: sparse.indexer_block_scores(torch.randn(1, 2, 8, 4), torch.randn(1, 8, 4), torch.ones(3), block_size=4),
     ValueError, "weights"),
    (sparse.select_blocks, "integer scores", lambda: sparse.select_blocks(torch.ones(1, 2, 2, dtype=torch.long), 1),
     TypeError, "block_scores"),
    (sparse.select_blocks, "topk 0", lambda: sparse.select_blocks(torch.ones(1, 2, 2), 0), ValueError, "topk"),
    (sparse.check_block_indices, "float ids", lambda: sparse.check_block_indices(_selection().float(), 16, 32, 32),
     TypeError, "block_indices"),
    (sparse.check_block_indices, "repeated id",
     lambda: sparse.check_block_indices(torch.zeros(1, 1, 2, 2, dtype=torch.int32), 16, 32, 32), ValueError,
     "block_indices"),
    (sparse.selected_tiles, "block_size 8", lambda: sparse.selected_tiles(_selection(), 32, 32, 8), ValueError,
     "block_size"),
    (sparse.selected_mask, "too few query blocks", lambda: sparse.selected_mask(_selection(), 64, 32, 16), ValueError,
     "block_indices"),
    (sparse.attention_mass_kept, "non-tensor q",
     lambda: sparse.attention_mass_kept([1.0], torch.randn(1, 1, 32, 16), _selection(), block_size=16), TypeError, "q"),
    (memory.trace, "not callable", lambda: memory.trace(3), TypeError, "fn"),
    (memory.trace_ops, "not callable", lambda: memory.trace_ops(3), TypeError, "fn"),
    (measure.peak_memory, "not callable", lambda: measure.peak_memory(3), TypeError, "fn"),
    (measure.time_call, "not callable", lambda: measure.time_call(3), TypeError, "fn"),
    (measure.scaling_sweep, "not callable", lambda: measure.scaling_sweep({"x": 3}, [16]), TypeError, "methods"),
    (measure.scaling_sweep, "not a dict", lambda: measure.scaling_sweep([torch.exp], [16]), TypeError, "methods"),
    (measure.scaling_sweep, "no methods", lambda: measure.scaling_sweep({}, [16]), ValueError, "methods"),
    (measure.longest_sequence, "not callable", lambda: measure.longest_sequence(3, 2**20), TypeError, "fn"),
    # cost formulas of decoding and context parallelism (lessons 10, 11)
    (iomodel.allgather_attention_bytes, "kv_heads not a divisor",
     lambda: iomodel.allgather_attention_bytes(1, 4, 64, 16, 2, kv_heads=3), ValueError, "kv_heads"),
    (iomodel.allgather_attention_bytes, "bool world_size",
     lambda: iomodel.allgather_attention_bytes(1, 4, 64, 16, True), TypeError, "world_size"),
    (iomodel.queries_per_read, "n_q 0", lambda: iomodel.queries_per_read(4, 64, 16, n_q=(1, 0)), ValueError,
     "n_q"),
    (iomodel.queries_per_read, "no n_q", lambda: iomodel.queries_per_read(4, 64, 16, n_q=()), ValueError, "n_q"),
    (iomodel.queries_per_read, "more queries than cached", lambda: iomodel.queries_per_read(4, 8, 16, n_q=16),
     ValueError, "seqlens"),
    (iomodel.mixed_batch_io, "not a pair", lambda: iomodel.mixed_batch_io([(1,)], 4, 16), ValueError, "requests"),
    (iomodel.mixed_batch_io, "fractional n_q", lambda: iomodel.mixed_batch_io([(1.5, 10)], 4, 16), TypeError,
     "requests"),
    (iomodel.mixed_batch_io, "no requests", lambda: iomodel.mixed_batch_io([], 4, 16), ValueError, "requests"),
    (iomodel.mla_cache_bytes, "d_latent 0", lambda: iomodel.mla_cache_bytes(1, d_latent=0), ValueError, "d_latent"),
    (iomodel.mla_cache_bytes, "negative d_rope", lambda: iomodel.mla_cache_bytes(1, d_rope=-2), ValueError, "d_rope"),
    (iomodel.decode_step_bytes, "negative params",
     lambda: iomodel.decode_step_bytes(1, 10, params=-1, layers=1, heads=1, d=16), ValueError, "params"),
    (iomodel.decode_step_bytes, "kv_heads not a divisor",
     lambda: iomodel.decode_step_bytes(1, 10, params=1e6, layers=1, heads=4, d=16, kv_heads=3), ValueError,
     "kv_heads"),
    (iomodel.decode_crossover_tokens, "layers 0",
     lambda: iomodel.decode_crossover_tokens(params=1e9, layers=0, d=16, kv_heads=1), ValueError, "layers"),
    (iomodel.decode_crossover_tokens, "string params",
     lambda: iomodel.decode_crossover_tokens(params="7B", layers=1, d=16, kv_heads=1), ValueError, "params"),
    # an 8-bit KV cache (lesson 10, C37)
    (kvquant.quantize_cache, "non-tensor", lambda: kvquant.quantize_cache([1.0]), TypeError, "x"),
    (kvquant.quantize_cache, "int4", lambda: kvquant.quantize_cache(_cache(), dtype="int4"), ValueError, "dtype"),
    (kvquant.quantize_cache, "block_size 0", lambda: kvquant.quantize_cache(_cache(), block_size=0), ValueError,
     "block_size"),
    (kvquant.dequantize, "a plain tensor", lambda: kvquant.dequantize(_cache()), TypeError, "cache"),
    (kvquant.error_bound, "a plain tensor", lambda: kvquant.error_bound(_cache(), _cache()), TypeError, "cache"),
    (kvquant.error_bound, "x of another shape",
     lambda: kvquant.error_bound(kvquant.quantize_cache(_cache()), _cache()[:, :, :5]), ValueError, "x"),
    (kvquant.bytes_per_token, "int4", lambda: kvquant.bytes_per_token(1, 1, 16, dtype="int4"), ValueError, "dtype"),
    (kvquant.bytes_per_token, "layers 0", lambda: kvquant.bytes_per_token(0, 1, 16, dtype="int8"), ValueError,
     "layers"),
    (kvquant.decode_quantized, "float cache",
     lambda: kvquant.decode_quantized(torch.randn(1, 2, 1, 16), _cache(), _cache(), torch.tensor([20])), TypeError,
     "k_cache"),
    (kvquant.QuantizedKVCache, "int4", lambda: kvquant.QuantizedKVCache(1, 2, 32, 16, quant="int4"), ValueError,
     "quant"),
    (kvquant.decode_losses, "not a GPT",
     lambda: kvquant.decode_losses("x", torch.zeros(1, 5, dtype=torch.long), []), TypeError, "model"),
    # StreamingLLM's rolling cache (lesson 10, C28)
    (streaming.StreamingCache, "negative sinks", lambda: streaming.StreamingCache(1, 2, 16, sinks=-1, window=4),
     ValueError, "sinks"),
    (streaming.streaming_attend, "non-tensor q",
     lambda: streaming.streaming_attend([1.0], streaming.StreamingCache(1, 2, 16, sinks=1, window=4)), TypeError,
     "q"),
    (streaming.streaming_attend, "not a StreamingCache",
     lambda: streaming.streaming_attend(torch.randn(1, 2, 1, 16), "x"), TypeError, "cache"),
    (streaming.streaming_losses, "not a GPT", lambda: streaming.streaming_losses("x", torch.zeros(1, 5).long()),
     TypeError, "model"),
    # prefix sharing on a paged cache (lesson 10, C36)
    (prefix.PagedKVPool, "num_blocks 0", lambda: prefix.PagedKVPool(0, 1, 16, 16), ValueError, "num_blocks"),
    (prefix.PagedKVPool, "non-tensor k_new", lambda: _pool_with_sequence().append(0, [1.0], _cache()[0]), TypeError,
     "k_new"),
    (prefix.PagedKVPool, "unknown sequence", lambda: _pool_with_sequence().fork(7), ValueError, "seq"),
    (prefix.prefix_sharing_blocks, "negative prefix", lambda: prefix.prefix_sharing_blocks(-1, [3], 16), ValueError,
     "prefix_len"),
    (prefix.prefix_sharing_blocks, "an int of suffixes", lambda: prefix.prefix_sharing_blocks(3, 5, 16), TypeError,
     "suffix_lens"),
    (prefix.prefix_sharing_blocks, "no suffixes", lambda: prefix.prefix_sharing_blocks(3, [], 16), ValueError,
     "suffix_lens"),
    # multi-head latent attention (lesson 10, C34)
    (MLA, "odd d_rope", lambda: _mla(d_rope=15), ValueError, "d_rope"),
    (MLA, "non-tensor x", lambda: _mla()([1.0]), TypeError, "x"),
    (MLA, "2-D x", lambda: _mla()(torch.randn(2, 64)), ValueError, "x"),
    (MLA, "wrong width", lambda: _mla()(torch.randn(1, 3, 32)), ValueError, "x"),
]


@pytest.mark.parametrize("fn,what,call,err,arg", OTHER_ROWS,
                         ids=[f"{fn.__name__}-{what}" for fn, what, *_ in OTHER_ROWS])
def test_every_other_tensor_function_rejects_bad_input_the_same_way(fn, what, call, err, arg):
    with pytest.raises(err) as info:
        call()
    message = str(info.value)
    assert MESSAGE.match(message), message
    assert message.split(":")[0].split(", ")[0] == arg, message


# public names that take no tensor (sizes, numbers, dtypes, a device, results to print), with why;
# the raw @triton.jit kernels (Kernel objects) are launched as kernel[grid](...) and, as in Triton's
# tutorials, check nothing: their wrappers above do
NO_TENSORS = {
    "attnlab.approx.local_window_mask": "sizes and a window",
    "attnlab.approx.local_window_block_mask": "sizes, a window and a tile size",
    "attnlab.approx.local_window_path_length": "sizes and a window",
    "attnlab.approx.linformer_projection": "sizes; it makes the projection tensor",
    "attnlab.approx.performer_features": "sizes; it makes the feature matrix",
    "attnlab.approx.local_window_io": "sizes: a cost formula",
    "attnlab.approx.linformer_io": "sizes: a cost formula",
    "attnlab.approx.performer_io": "sizes: a cost formula",
    "attnlab.iomodel.IO": "a result (byte and FLOP counts)",
    "attnlab.iomodel.Machine": "a machine's peak numbers",
    "attnlab.iomodel.Roofline": "a result",
    "attnlab.iomodel.roofline": "numbers and a machine name",
    "attnlab.iomodel.flash_block_sizes": "sizes",
    "attnlab.iomodel.softmax_io": "sizes: a cost formula",
    "attnlab.iomodel.decode_io": "sizes: a cost formula",
    "attnlab.iomodel.kv_cache_bytes": "sizes: a cost formula",
    "attnlab.iomodel.ring_attention_bytes": "sizes: a cost formula (errors in tests/test_distributed.py)",
    "attnlab.iomodel.ulysses_attention_bytes": "sizes: a cost formula (errors in tests/test_distributed.py)",
    "attnlab.kernels.flash_decode.flash_decode": "its argument errors are tested in tests/test_kernels_decode.py",
    "attnlab.kernels.flash_decode.choose_num_splits": "sizes (called by flash_decode after its checks)",
    "attnlab.kernels.delta_rule.chunked_delta_rule": "its argument errors are tested in tests/test_linear_attention.py",
    "attnlab.iomodel.matmul_io": "sizes: a cost formula",
    "attnlab.iomodel.attention_flops": "sizes: a cost formula",
    "attnlab.iomodel.standard_forward_io": "sizes: a cost formula",
    "attnlab.iomodel.standard_backward_io": "sizes: a cost formula",
    "attnlab.iomodel.flash_forward_io": "sizes (a block mask is checked in block_sparse_*_io's rows)",
    "attnlab.iomodel.flash_backward_io": "sizes (a block mask is checked in block_sparse_*_io's rows)",
    "attnlab.iomodel.theorem2": "sizes: a cost formula",
    "attnlab.iomodel.fig2": "sizes: the paper's figure",
    "attnlab.iomodel.paper_flash_forward_io": "sizes: a cost formula",
    "attnlab.iomodel.paper_flash_backward_io": "sizes: a cost formula",
    "attnlab.iomodel.paper_standard_forward_io": "sizes: a cost formula",
    "attnlab.iomodel.paper_standard_backward_io": "sizes: a cost formula",
    "attnlab.memory.MemoryTrace": "a result of trace",
    "attnlab.memory.MemoryEvent": "a result of trace",
    "attnlab.memory.TensorInfo": "a result of trace",
    "attnlab.measure.random_qkv": "sizes; it makes q, k, v",
    "attnlab.memory.format_bytes": "a number",
    "attnlab.kernels.standard_attention.standard_block_sizes": "a head dim, a dtype and a device",
    "attnlab.kernels.softmax.softmax_block_size": "a row length",
    "attnlab.kernels.softmax.rows_per_program": "a block size and a device",
    "attnlab.kernels.block_mask.local_mask": "sizes and a window",
    "attnlab.kernels.block_mask.strided_mask": "sizes and a stride",
    "attnlab.kernels.block_mask.global_mask": "sizes",
    "attnlab.kernels.block_mask.causal_block_mask": "sizes",
    "attnlab.kernels.block_mask.random_mask": "sizes, a density and a seed",
    "attnlab.kernels.block_mask.full_mask": "sizes",
    "attnlab.sparse.n_blocks": "two ints (a ceil division)",
    "attnlab.kvquant.QuantizedCache": "a result of quantize_cache (its functions check what they are given)",
}

PUBLIC_MODULES = ["attnlab.attention", "attnlab.tiled", "attnlab.approx", "attnlab.iomodel", "attnlab.memory",
                  "attnlab.measure", "attnlab.sparse", "attnlab.kvquant", "attnlab.streaming", "attnlab.prefix",
                  "attnlab.mla", "attnlab.kernels"] + [
    f"attnlab.kernels.{m.name}" for m in pkgutil.iter_modules(attnlab.kernels.__path__) if not m.name.startswith("_")]


def _qualified(obj):
    obj = inspect.unwrap(obj)
    return f"{obj.__module__}.{obj.__qualname__}"


def _public_callables():
    found = {}
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        assert hasattr(module, "__all__"), f"{name} has no __all__: its public API is not listed"
        for attr in module.__all__:
            obj = getattr(module, attr)
            if isinstance(obj, Kernel) or not callable(obj):
                continue                       # a raw Triton kernel, or a constant
            found[_qualified(obj)] = obj
    return found


def test_every_public_function_has_a_row():
    covered = ({_qualified(fn) for fn in QKV_FUNCTIONS.values()} | {_qualified(row[0]) for row in OTHER_ROWS}
               | set(NO_TENSORS))
    public = _public_callables()
    missing = sorted(set(public) - covered)
    assert not missing, f"public functions without a row in tests/test_validation.py: {missing}"
    stale = sorted(set(NO_TENSORS) - set(public))
    assert not stale, f"NO_TENSORS names that are no longer public: {stale}"
