"""Decode time and bytes per generated token for MHA, GQA and MQA, paged and not (kernels/flash_decode.py).

One decoding step: batch 1, 32 query heads of head dim 64 in fp16 on a GPU (8 heads in fp32 on the
CPU, where the interpreter is slow), one new query against a cache of L tokens, with as many (MHA),
a quarter as many (GQA) or one (MQA) key/value heads, the cache contiguous or in pages of 16 tokens. For each row:

* ``flash_decode``: the kernel's wall-clock time per step (the minimum of a few runs; in Triton's
  interpreter on a CPU, compiled on a GPU), with ``num_splits=None`` (its own choice, printed);
* ``torch SDPA``: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` over the same
  contiguous cache, the fused PyTorch baseline;
* bytes per token: ``attnlab.iomodel.decode_io`` for that kernel launch (equal to the bytes the
  kernel moves, to the byte: tests/test_kernels_decode.py traces it), and its FLOP per byte;
* the KV cache's size per token for one layer (``iomodel.kv_cache_bytes``).

On the CPU the interpreter's time is dominated by its per-operation cost, not by memory: read the
bytes column for what a GPU would pay, and the time columns for what this machine does. The load
average is printed with the table: the machine may be shared.

Usage: ``python benchmarks/decode.py`` (contexts 1024 and 4096) or ``--quick`` (128 and 512).
``--device cuda`` on a GPU (the default when one is present).
"""

import argparse
import os

import torch
import torch.nn.functional as F

from attnlab.iomodel import decode_io, kv_cache_bytes
from attnlab.kernels.flash_decode import BLOCK_N, _parallel_units, choose_num_splits, flash_decode
from attnlab.kvcache import to_paged
from attnlab.measure import time_call

HEAD_DIM, PAGE = 64, 16


def rows(contexts, device, dtype, heads):
    g = torch.Generator().manual_seed(0)
    out = []
    repeats = 5 if device.type == "cuda" else 1
    for L in contexts:
        for name, kv in (("MHA", heads), ("GQA", heads // 4), ("MQA", 1)):
            q = torch.randn(1, heads, 1, HEAD_DIM, generator=g).to(device, dtype)
            k = torch.randn(1, kv, L, HEAD_DIM, generator=g).to(device, dtype)
            v = torch.randn(1, kv, L, HEAD_DIM, generator=g).to(device, dtype)
            lens = torch.tensor([L], dtype=torch.int32, device=device)
            t_sdpa = time_call(F.scaled_dot_product_attention, q, k, v, enable_gqa=kv != heads, repeats=5,
                               device=device, reduce="min")
            for paged in (False, True):
                table, kc, vc = None, k, v
                if paged:
                    kc, vc, table = to_paged(k, v, lens.cpu(), PAGE, generator=torch.Generator().manual_seed(1))
                    table = table.to(device)
                block = PAGE if paged else BLOCK_N
                splits = choose_num_splits(1, kv, L, block, _parallel_units(q.device))
                t = time_call(flash_decode, q, kc, vc, lens, block_table=table, repeats=repeats, device=device,
                              reduce="min")
                io = decode_io(1, heads, L, HEAD_DIM, q.element_size(), kv_heads=kv, num_splits=splits,
                               page_size=PAGE if paged else None)
                out.append(dict(L=L, layout=f"{name} ({heads}/{kv})", paged="paged" if paged else "contiguous",
                                splits=splits, t=t, t_sdpa=t_sdpa, bytes=io.total_bytes,
                                ai=io.arithmetic_intensity, cache=kv_cache_bytes(1, 1, kv, HEAD_DIM, q.element_size())))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="contexts 128 and 512 (a minute on a CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    contexts = (128, 512) if args.quick else (1024, 4096)
    heads = 32 if device.type == "cuda" else 8
    load0 = os.getloadavg()
    table = rows(contexts, device, dtype, heads)
    load1 = os.getloadavg()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"Decoding one token, batch 1, {heads} query heads, head dim {HEAD_DIM}, {str(dtype)[6:]}, on {name}\n")
    print("| context | heads (q/kv) | cache | splits | flash_decode (ms) | torch SDPA (ms) | bytes per token "
          "| FLOP/byte | KV cache per token per layer (B) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['L']} | {r['layout']} | {r['paged']} | {r['splits']} | {r['t'] * 1e3:.2f} | "
              f"{r['t_sdpa'] * 1e3:.3f} | {r['bytes']:,} | {r['ai']:.2f} | {r['cache']:,} |")
    print(f"\nLoad average before {load0[0]:.2f}, after {load1[0]:.2f} (1 min). Bytes are exact "
          "(iomodel.decode_io = the traced kernel); times are this machine's, under its load.")


if __name__ == "__main__":
    main()
