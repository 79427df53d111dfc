"""Reproduce one figure in bytes: Dao et al. 2022's Fig. 2, standard vs FlashAttention HBM traffic.

Dao et al. 2022 (FlashAttention, Fig. 2, left; arXiv v1/v2) report, for GPT-2 medium's
attention (sequence length 1024, head dimension 64) on an A100, 40.3 GB of HBM reads and
writes for standard attention against 4.4 GB for FlashAttention (about 9x), forward plus
backward. The defaults batch 64 x 16 heads follow that figure's caption (GPT-2 medium has
16 heads, batch size 64).
:func:`gpt2_medium_comparison` measures the same thing from the course's own
kernels: it traces one head (batch 1, heads 1) of each kernel in Triton's interpreter with
:func:`attnlab.memory.trace`, checks the counts against :mod:`attnlab.iomodel`, and scales
them by batch x heads (every head moves the same bytes).

Two comparisons, kept apart:

* **the paper's bars, predicted**: :func:`attnlab.iomodel.fig2` counts Dao et al.'s own
  algorithms at the figure's shape: standard attention as a PyTorch baseline runs it (S, the
  causal mask, softmax, dropout and PV as separate kernels, and the backward through the saved
  P), and FlashAttention's Algorithm 1/2 forward and Algorithm 4 backward at the paper's block
  sizes B_c = ceil(M / 4d) = 384, B_r = min(B_c, d) = 64 for an A100's 192 KB of SRAM. Both bars
  come out within a few percent of 40.3 GB and 4.4 GB, term by term;
* **attnlab's kernels, traced**: the minimal unfused baseline (no mask or dropout pass) and the
  FlashAttention-2 kernels at 128 x 128 blocks. FA2 streams K and V once per *query* block
  where Algorithm 1 streams Q and O once per *key* block: fewer bytes per pass, but with
  128-row outer blocks it makes 8 passes where the paper's 384-key blocks make 3
  (``loop_order`` in the result says it in numbers).

The ratio does not depend on batch x heads, only the absolute gigabytes do.

Run ``python benchmarks/gpt2_traffic.py`` for the table; lesson 07 shows it.
"""

from __future__ import annotations

import torch

from attnlab import iomodel
from attnlab.memory import trace

__all__ = ["gpt2_medium_comparison", "format_comparison", "loop_order_rows", "PAPER_GB"]

PAPER_GB = {"standard": 40.3, "flash": 4.4}  # Dao et al. 2022, Fig. 2 (forward + backward, HBM R/W)


def gpt2_medium_comparison(seq: int = 1024, head_dim: int = 64, batch: int = 64, heads: int = 16,
                           dtype: torch.dtype = torch.float16, flash_blocks=(128, 128),
                           standard_blocks=(128, 128, 128), seed: int = 0) -> dict:
    """Trace standard and FlashAttention kernels on one head and scale by ``batch * heads``.

    Returns {"rows": [...], "batch_heads": int, "flash_blocks": ..., ...}; each row is a dict with
    ``method`` ("standard" | "flash"), ``pass`` ("forward" | "forward+backward"),
    ``traced_bytes`` (one head, measured), ``model_bytes`` (one head, attnlab.iomodel),
    ``gb`` (traced x batch x heads / 1e9). Also ``fig2`` (:func:`attnlab.iomodel.fig2`: the paper's
    own algorithms at its shape, both bars, term by term), ``paper_block_sizes`` (B_r, B_c from an
    A100's 192 KB of SRAM), ``loop_order`` (rows: name, passes, gb, io: the paper's K/V-outer loop
    beside the FA2 loop order at several block sizes) and ``block_sweep_gb``.

    Example: ``format_comparison(gpt2_medium_comparison())``
    """
    from attnlab.kernels import flash_attention, standard_attention

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, seq, head_dim, generator=g).to(dtype) for _ in range(3))
    e = torch.empty((), dtype=dtype).element_size()
    bm, bn = flash_blocks
    rows = []

    def run(method, fn, model_fwd, model_bwd):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        fwd = trace(fn, qq, kk, vv)
        o = fwd.result
        bwd = trace(o.backward, torch.ones_like(o))
        for name, traced, model in (("forward", fwd.total_bytes, model_fwd.total_bytes),
                                    ("forward+backward", fwd.total_bytes + bwd.total_bytes,
                                     model_fwd.total_bytes + model_bwd.total_bytes)):
            rows.append({"method": method, "pass": name, "traced_bytes": traced, "model_bytes": model,
                         "gb": traced * batch * heads / 1e9})

    sb = standard_blocks
    run("standard",
        lambda a, b_, c: standard_attention(a, b_, c, block_m=sb[0], block_n=sb[1], block_k=sb[2]),
        iomodel.standard_forward_io(1, 1, seq, seq, head_dim, e, block_m=sb[0], score_bytes=4),  # S in float32
        iomodel.standard_backward_io(1, 1, seq, seq, head_dim, e, blocks=sb))
    run("flash",
        lambda a, b_, c: flash_attention(a, b_, c, block_m=bm, block_n=bn),
        iomodel.flash_forward_io(1, 1, seq, seq, head_dim, e, block_m=bm, block_n=bn, grad=True),  # a training step
        iomodel.flash_backward_io(1, 1, seq, seq, head_dim, e, block_m=bm, block_n=bn))
    # Dao et al. 2022's own algorithms at the paper's shape: the two bars of Fig. 2 (left), predicted
    fig2 = iomodel.fig2(batch, heads, seq, head_dim, e)
    loop_order = loop_order_rows(batch, heads, seq, head_dim, e, traced_blocks=(bm, bn))
    # what the block size changes: FlashAttention traffic (model, forward + backward) for square blocks
    sweep = {b: _fa2(batch, heads, seq, head_dim, e, b, b).total_bytes / 1e9 for b in (32, 64, 128, 256)}
    return {"rows": rows, "batch_heads": batch * heads, "block_sweep_gb": sweep, "seq": seq, "head_dim": head_dim,
            "dtype": str(dtype), "flash_blocks": tuple(flash_blocks), "standard_blocks": tuple(standard_blocks),
            "paper_block_sizes": fig2["blocks"], "fig2": fig2, "loop_order": loop_order, "paper_gb": dict(PAPER_GB)}


def loop_order_rows(batch=64, heads=16, seq=1024, head_dim=64, bytes_per_element=2, traced_blocks=(128, 128),
                    sram_bytes=iomodel.A100_SRAM_BYTES) -> list:
    """The paper's loop order (Algorithms 1 and 4: K/V outside) beside FlashAttention-2's (attnlab's
    kernels: Q outside in the forward and dQ kernels, K/V outside in the dK/dV kernel), forward +
    backward at batch x heads, from attnlab.iomodel. Each row: name, passes (how often the streamed
    operands are read, per kernel), gb, io.

    Example: ``[(r["name"], r["gb"]) for r in loop_order_rows()]``
    """
    e = bytes_per_element
    br, bc = iomodel.flash_block_sizes(sram_bytes, head_dim, e)
    paper = (iomodel.paper_flash_forward_io(batch, heads, seq, head_dim, e, sram_bytes=sram_bytes)
             + iomodel.paper_flash_backward_io(batch, heads, seq, head_dim, e, sram_bytes=sram_bytes))
    bm, bn = traced_blocks
    return [
        _loop_row(f"Algorithm 1 + 4 (paper), B_r={br}, B_c={bc}: K/V outside", (bc,), paper, seq),
        _loop_row(f"FA2 order (attnlab's kernels), blocks {bm} x {bn}", (bm, bn),
                  _fa2(batch, heads, seq, head_dim, e, bm, bn), seq),
        _loop_row(f"FA2 order at the paper's blocks B_r={br}, B_c={bc}", (br, bc),
                  _fa2(batch, heads, seq, head_dim, e, br, bc), seq),
        _loop_row(f"FA2 order, outer blocks of {bc} (the paper's passes)", (bc, bc),
                  _fa2(batch, heads, seq, head_dim, e, bc, bc), seq),
    ]


def _fa2(batch, heads, seq, d, e, bm, bn):
    """attnlab's FlashAttention-2 kernels (forward + backward) as modelled by attnlab.iomodel."""
    return (iomodel.flash_forward_io(batch, heads, seq, seq, d, e, block_m=bm, block_n=bn, grad=True)
            + iomodel.flash_backward_io(batch, heads, seq, seq, d, e, block_m=bm, block_n=bn))


def _loop_row(name, blocks, io, seq):
    """passes: how often the streamed operands are re-read, per kernel (forward; dK/dV; dQ).
    The paper's Algorithm 1 and 4 stream Q, O (and dO, dQ) once per key block: seq / B_c passes each.
    FA2 streams K, V once per query block (forward, dQ) and Q, dO once per key block (dK/dV)."""
    import math

    if len(blocks) == 1:
        passes = (math.ceil(seq / blocks[0]),) * 2
    else:
        bm, bn = blocks
        passes = (math.ceil(seq / bm), math.ceil(seq / bn), math.ceil(seq / bm))
    return {"name": name, "passes": passes, "gb": io.total_bytes / 1e9, "io": io}


def format_comparison(result: dict) -> str:
    """A text table of :func:`gpt2_medium_comparison`'s result."""
    bh = result["batch_heads"]
    lines = [f"GPT-2 medium attention: seq {result['seq']}, head dim {result['head_dim']}, {result['dtype']}, "
             f"scaled by batch x heads = {bh}",
             f"{'method':<10} {'pass':<17} {'traced/head':>13} {'model/head':>13} {'total GB':>9}"]
    for r in result["rows"]:
        lines.append(f"{r['method']:<10} {r['pass']:<17} {r['traced_bytes'] / 1e6:>10.2f} MB {r['model_bytes'] / 1e6:>10.2f} MB "
                     f"{r['gb']:>9.2f}")
    by = {(r["method"], r["pass"]): r["gb"] for r in result["rows"]}
    for p in ("forward", "forward+backward"):
        lines.append(f"standard / flash, {p}: {by[('standard', p)] / by[('flash', p)]:.1f}x")
    pg = result["paper_gb"]
    lines.append(f"Dao et al. 2022, Fig. 2 (forward+backward): {pg['standard']} GB vs {pg['flash']} GB = "
                 f"{pg['standard'] / pg['flash']:.1f}x")
    f2 = result["fig2"]
    br, bc = f2["blocks"]
    lines.append(f"Dao et al.'s own algorithms (attnlab.iomodel.fig2: B_r={br}, B_c={bc} from an A100's 192 KB SRAM): "
                 f"standard {f2['model_gb']['standard']:.2f} GB ({f2['relative_error']['standard']:+.1%} vs the paper), "
                 f"FlashAttention {f2['model_gb']['flash']:.2f} GB ({f2['relative_error']['flash']:+.1%})")
    for name, bar in (("standard", "standard"), ("flash", "flash")):
        for part, io in (f2[f"{bar}_forward"] + f2[f"{bar}_backward"]).parts.items():
            lines.append(f"    {name:<8} {part:<52} {io.total_bytes / 1e9:>7.3f} GB")
    lines.append("loop order (forward + backward; passes = how often the streamed operands are read: fwd, [dK/dV,] dQ):")
    for r in result["loop_order"]:
        lines.append(f"    {r['name']:<64} passes {str(r['passes']):<13} {r['gb']:>6.2f} GB")
    lines.append("flash forward+backward (model) for square blocks B_r = B_c: " + ", ".join(
        f"{b}: {gb:.2f} GB" for b, gb in result["block_sweep_gb"].items()))
    return "\n".join(lines)
