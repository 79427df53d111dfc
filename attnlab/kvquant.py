"""A KV cache stored in 8 bits: int8 with per-block scales, or fp8 (e4m3), in plain PyTorch (lesson 10).

Decoding reads the whole cache at every step (lesson 10, section 1), so its bytes set the
speed and how many sequences fit in memory. Storing each cached element in one byte instead of
two halves both, at an error this module bounds and measures:

* **int8, symmetric, per block** (:func:`quantize_cache` with ``dtype="int8"``): a block is
  ``block_size`` consecutive tokens of one (sequence, KV head), all ``head_dim`` channels; its
  scale is ``absmax / 127`` and each element is stored as ``round(x / scale)`` in [-127, 127].
  Dequantized, every element is within ``scale / 2`` of the original (rounding to the nearest
  code; nothing is clipped since ``|x| <= absmax``).
* **fp8 e4m3** (``dtype="fp8"``): ``torch.float8_e4m3fn`` codes (4 exponent bits, 3 mantissa
  bits, largest value 448) of ``x / scale`` with ``scale = absmax / 448`` per block, so the
  block's range fills the format's. Rounding to 3 mantissa bits leaves a relative error of at
  most ``2**-4`` for the normal values (``|x / scale| >= 2**-6``) and an absolute one of at most
  ``2**-10 * scale`` for the subnormal ones.

Why blocks of tokens rather than one scale per token and head: a scale is a float32, 4 bytes.
Per token and head it costs ``4 / head_dim`` bytes per element: 25% of the int8 codes at the
capstone GPT's ``head_dim = 16``, 3% at 128. Over a block of 16 tokens (a page of the paged
cache) it costs 16 times less, and a block is written once, when it fills: :class:`QuantizedKVCache`
keeps the last, partly filled block in 16 bits (as KIVI does, Liu et al. 2024) and quantizes it
whole when its last token arrives, so no code is ever rewritten. The price of a coarser scale is
a larger one: the bound ``scale / 2`` grows with the block's largest element. ``block_size=1``
gives the per-token-per-head scheme.

Serving systems do this: vLLM's ``LLM(model, kv_cache_dtype="fp8")`` stores the cache in FP8
E4M3 with float32 scales per tensor (or per attention head), "to significantly reduce its memory
footprint" so that more tokens fit (vLLM documentation, "Quantized KV Cache",
docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/). Its scales are coarser than
these (one per layer's K or V), calibrated on data.

Functions: :func:`quantize_cache` -> :class:`QuantizedCache` (codes, scales, ``dequantize()``,
``nbytes``); :func:`dequantize`; :func:`error_bound` (the bound above, per element);
:func:`bytes_per_token` (16-bit against 8-bit with its scales); :func:`decode_quantized` (the
decoding reference on a dequantized cache); :class:`QuantizedKVCache` and :func:`decode_losses`
(a model decoding through an 8-bit cache, one token at a time, and its loss per position).

Shapes: a cache x (B, H_kv, S, D); scales (B, H_kv, ceil(S / block_size)) float32.

Example::

    kq = quantize_cache(k_cache, dtype="int8", block_size=16)
    (kq.dequantize() - k_cache).abs().max() <= kq.scales.max() / 2     # True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab import validate
from attnlab.iomodel import kv_cache_bytes
from attnlab.kvcache import KVCache, decode_reference

__all__ = ["FORMATS", "QuantizedCache", "quantize_cache", "dequantize", "error_bound", "bytes_per_token",
           "decode_quantized", "QuantizedKVCache", "decode_losses"]

# dtype name -> (storage dtype, largest code magnitude)
FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max))}
FP8_MANTISSA_BITS = 3
FP8_MIN_NORMAL = float(torch.finfo(torch.float8_e4m3fn).smallest_normal)     # 2**-6
SCALE_BYTES = 4                                                               # scales are float32


@dataclass
class QuantizedCache:
    """A cache in 8 bits: ``codes`` (B, H_kv, S, D) int8 or float8_e4m3fn, ``scales``
    (B, H_kv, n_blocks) float32, one per ``block_size`` tokens of a (sequence, KV head);
    ``dtype`` "int8" or "fp8"; ``out_dtype`` the dtype :meth:`dequantize` returns (the input's).

    Example: ``quantize_cache(k, dtype="fp8").nbytes``
    """

    codes: torch.Tensor
    scales: torch.Tensor
    block_size: int
    dtype: str
    out_dtype: torch.dtype

    def scale_per_token(self):
        """(B, H_kv, S, 1): the scale of each token's block, broadcast over head_dim."""
        S = self.codes.shape[2]
        return self.scales.repeat_interleave(self.block_size, dim=2)[:, :, :S, None]

    def dequantize(self):
        """(B, H_kv, S, D) in ``out_dtype``: ``codes * scale``. See :func:`dequantize`."""
        return dequantize(self)

    @property
    def code_bytes(self):
        return self.codes.numel() * self.codes.element_size()          # 1 byte per element

    @property
    def scale_bytes(self):
        return self.scales.numel() * self.scales.element_size()        # 4 bytes per block

    @property
    def nbytes(self):
        """Bytes of the codes and the scales together."""
        return self.code_bytes + self.scale_bytes

    def __repr__(self):
        return (f"QuantizedCache({self.dtype}, codes {tuple(self.codes.shape)}, scales {tuple(self.scales.shape)} "
                f"(one per {self.block_size} tokens), {self.nbytes:,} bytes)")


def quantize_cache(x, *, dtype="int8", block_size=16):
    """Quantize a cache x (B, H_kv, S, D) to 8 bits with one symmetric scale per block of
    ``block_size`` tokens of each (sequence, KV head) (the last block may be shorter).

    ``dtype="int8"``: codes ``round(x / scale)``, scale ``absmax / 127``; ``dtype="fp8"``: codes
    ``(x / scale).to(torch.float8_e4m3fn)`` (round to nearest), scale ``absmax / 448``. An
    all-zero block gets scale 0 and zero codes. Computed in float32 whatever x's dtype.
    Returns a :class:`QuantizedCache`.

    Example: ``kq = quantize_cache(k_cache, dtype="int8", block_size=16); kq.dequantize()``
    """
    validate.tensor(x, "x", 4, "(batch, kv_heads, seq, head_dim)", floating=True, nonempty=True)
    validate.one_of(dtype, "dtype", tuple(FORMATS))
    validate.integer(block_size, "block_size")
    storage, qmax = FORMATS[dtype]
    B, H, S, D = x.shape
    n_blocks = -(-S // block_size)
    xf = x.float()
    pad = n_blocks * block_size - S
    if pad:
        xf = torch.cat([xf, xf.new_zeros(B, H, pad, D)], dim=2)            # (B, H, n_blocks * bs, D)
    blocks = xf.view(B, H, n_blocks, block_size, D)                       # (B, H, nb, bs, D)
    scales = blocks.abs().amax(dim=(-2, -1)) / qmax                       # (B, H, nb) absmax -> the largest code
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))[..., None, None]   # (B, H, nb, 1, 1)
    scaled = blocks / safe                                                # (B, H, nb, bs, D) in [-qmax, qmax]
    if dtype == "int8":
        codes = scaled.round().clamp_(-qmax, qmax).to(storage)            # round to the nearest integer code
    else:
        codes = scaled.clamp_(-qmax, qmax).to(storage)                    # round to the nearest e4m3 value
    codes = codes.view(B, H, n_blocks * block_size, D)[:, :, :S]          # (B, H, S, D)
    return QuantizedCache(codes.contiguous(), scales.contiguous(), block_size, dtype, x.dtype)


def dequantize(cache, dtype=None):
    """The values a :class:`QuantizedCache` stands for: ``codes * scale`` (B, H_kv, S, D), in
    ``dtype`` (default: the dtype that was quantized).

    Example: ``dequantize(quantize_cache(k, dtype="fp8"))``
    """
    if not isinstance(cache, QuantizedCache):
        raise TypeError(f"cache: expected a QuantizedCache (from quantize_cache), got {type(cache).__name__}")
    out = cache.codes.float() * cache.scale_per_token()                   # (B, H, S, D) float32
    return out.to(cache.out_dtype if dtype is None else dtype)


def error_bound(cache, x):
    """The largest error quantization may leave on each element of x (B, H_kv, S, D), given its
    :class:`QuantizedCache`: int8 ``scale / 2``; fp8 ``2**-4 |x|`` for normal values
    (``|x| >= 2**-6 scale``), ``2**-10 scale`` below (e4m3's subnormal step is ``2**-9``).

    Example: ``((kq.dequantize() - k).abs() <= error_bound(kq, k) * (1 + 1e-5)).all()``
    """
    if not isinstance(cache, QuantizedCache):
        raise TypeError(f"cache: expected a QuantizedCache (from quantize_cache), got {type(cache).__name__}")
    validate.tensor(x, "x", 4, "(batch, kv_heads, seq, head_dim)", floating=True)
    if x.shape != cache.codes.shape:
        raise ValueError(f"x: expected the quantized cache's shape {tuple(cache.codes.shape)}, got {tuple(x.shape)}")
    scale = cache.scale_per_token()                                       # (B, H, S, 1)
    if cache.dtype == "int8":
        return (scale / 2).expand(x.shape)
    ax = x.float().abs()
    normal = ax >= FP8_MIN_NORMAL * scale
    return torch.where(normal, ax * 2.0 ** -(FP8_MANTISSA_BITS + 1), scale * 2.0 ** -10)


def bytes_per_token(layers=1, kv_heads=1, head_dim=64, *, dtype="fp16", block_size=16):
    """Bytes the cache holds per token: ``dtype="fp16"`` (or "bf16") 2 bytes per element, via
    ``attnlab.iomodel.kv_cache_bytes``; "int8" or "fp8" 1 byte per element plus a float32
    scale per ``block_size`` tokens of each layer's K and V per KV head,
    ``2 * layers * kv_heads * 4 / block_size`` (a float: the scales are shared by a block).

    Example: ``bytes_per_token(32, 8, 128, dtype="fp8") / bytes_per_token(32, 8, 128)  # 0.5005``
    """
    validate.one_of(dtype, "dtype", ("fp16", "bf16", "fp32") + tuple(FORMATS))
    validate.integer(block_size, "block_size")
    if dtype in ("fp16", "bf16", "fp32"):
        return float(kv_cache_bytes(1, layers, kv_heads, head_dim, 4 if dtype == "fp32" else 2))
    codes = kv_cache_bytes(1, layers, kv_heads, head_dim, 1)
    return codes + 2 * layers * kv_heads * SCALE_BYTES / block_size


def decode_quantized(q, k_cache, v_cache, cache_seqlens, block_table=None, scale=None):
    """Decoding attention over an 8-bit cache: ``attnlab.kvcache.decode_reference`` on the
    dequantized k_cache and v_cache (:class:`QuantizedCache` of (B, H_kv, S, D) or a paged pool).
    A fused kernel would dequantize each tile as it loads it; the arithmetic is the same.

    Example: ``decode_quantized(q, quantize_cache(k), quantize_cache(v), lens)``
    """
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, QuantizedCache):
            raise TypeError(f"{name}: expected a QuantizedCache (from quantize_cache), got {type(c).__name__}")
    return decode_reference(q, dequantize(k_cache, q.dtype), dequantize(v_cache, q.dtype), cache_seqlens,
                            block_table=block_table, scale=scale)


class QuantizedKVCache(KVCache):
    """A :class:`attnlab.kvcache.KVCache` whose full blocks are stored in 8 bits: ``append``
    writes the new tokens, and each block of ``block_size`` tokens that fills is quantized
    (:func:`quantize_cache`) once and kept as its dequantized values, the numbers an 8-bit kernel
    would compute with; the last, partly filled block stays in the cache's dtype until it
    fills. ``quantized`` counts the tokens stored in 8 bits. A drop-in for ``GPT.new_caches``.

    Example: ``caches = [QuantizedKVCache(1, 4, 128, 16, dtype="int8") for _ in model.blocks]``
    """

    def __init__(self, batch, kv_heads, capacity, head_dim, *, quant="int8", block_size=16,
                 dtype=torch.float32, device="cpu"):
        validate.one_of(quant, "quant", tuple(FORMATS))
        validate.integer(block_size, "block_size")
        super().__init__(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.quant, self.block_size = quant, block_size
        self.quantized = 0            # tokens [0, quantized) are stored in 8 bits

    def append(self, k_new, v_new):
        k, v = super().append(k_new, v_new)                               # (B, H_kv, length, D), float
        full = self.length // self.block_size * self.block_size           # tokens in full blocks
        if full > self.quantized:                                         # blocks that just filled
            lo = self.quantized
            for buf in (self.k, self.v):
                buf[:, :, lo:full] = quantize_cache(buf[:, :, lo:full], dtype=self.quant,
                                                    block_size=self.block_size).dequantize()
            self.quantized = full
        return k, v


@torch.no_grad()
def decode_losses(model, idx, caches):
    """Feed ``idx`` (B, T) long to ``model`` (an ``attnlab.models.gpt.GPT``) one token at a time
    through ``caches`` (one per layer, e.g. :class:`QuantizedKVCache` or ``model.new_caches``),
    and return the loss of each next-token prediction, (B, T - 1) nats.

    Example: ``decode_losses(model, idx, [QuantizedKVCache(1, 4, 128, 16) for _ in model.blocks]).mean()``
    """
    from attnlab.models.gpt import GPT

    if not isinstance(model, GPT):
        raise TypeError(f"model: expected an attnlab.models.gpt.GPT, got {type(model).__name__}")
    model._check_idx(idx)
    if idx.shape[1] < 2:
        raise ValueError(f"idx: expected at least 2 positions (a token and its successor), "
                         f"got shape {tuple(idx.shape)}")
    losses = []
    for t in range(idx.shape[1] - 1):
        logits = model.decode_step(idx[:, t:t + 1], caches)[:, -1]        # (B, V)
        losses.append(torch.nn.functional.cross_entropy(logits, idx[:, t + 1], reduction="none"))   # (B,)
    return torch.stack(losses, dim=1)                                     # (B, T - 1)
