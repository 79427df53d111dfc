"""HBM traffic of standard attention against FlashAttention at GPT-2 medium's attention shape.

Dao et al. 2022 (FlashAttention, Fig. 2, left; arXiv v1/v2) report, for GPT-2 medium's
attention (sequence length 1024, head dimension 64) on an A100, 40.3 GB of HBM reads and
writes for standard attention against 4.4 GB for FlashAttention (about 9x), forward plus
backward. The defaults batch 64 x 16 heads follow that figure's caption (GPT-2 medium has
16 heads; batch 64 as we read the caption of arXiv v2; check the paper before quoting the
absolute gigabytes: the *ratio* does not depend on batch x heads).
:func:`gpt2_medium_comparison` measures the same thing from the course's own
kernels: it traces one head (batch 1, heads 1) of each kernel in Triton's interpreter with
:func:`attnlab.memory.trace`, checks the counts against :mod:`attnlab.iomodel`, and scales
them by batch x heads (every head moves the same bytes).

What changes the numbers:

* the ratio does not depend on batch x heads, only the absolute gigabytes do;
* the FlashAttention block sizes: K and V are read once per block of B_r queries, so the
  traffic falls as B_r grows (bigger SRAM -> bigger blocks, Theorem 2's N^2 d^2 / M). The
  paper's rule B_c = ceil(M / 4d), B_r = min(B_c, d) gives B_r = 64 for d = 64 on an A100;
  real kernels use 128-row query blocks;
* the standard side is dominated by the N x N matrices S, P (forward) and dP, dS (backward),
  written and read in fp16: ~ 4 N^2 forward, ~ 10 N^2 forward plus backward;
* the paper's standard implementation also applies dropout and masking as separate kernels
  (more N x N passes) and counts fp32 softmax statistics; ours is the minimal unfused
  baseline, so our standard number and hence the ratio come out somewhat lower.

Run ``python benchmarks/gpt2_traffic.py`` for the table; lesson 07 shows it.
"""

from __future__ import annotations

import torch

from attnlab import iomodel
from attnlab.memory import trace

__all__ = ["gpt2_medium_comparison", "format_comparison", "PAPER_GB"]

PAPER_GB = {"standard": 40.3, "flash": 4.4}  # Dao et al. 2022, Fig. 2 (forward + backward, HBM R/W)


def gpt2_medium_comparison(seq: int = 1024, head_dim: int = 64, batch: int = 64, heads: int = 16,
                           dtype: torch.dtype = torch.float16, flash_blocks=(128, 128),
                           standard_blocks=(128, 128, 128), seed: int = 0) -> dict:
    """Trace standard and FlashAttention kernels on one head and scale by ``batch * heads``.

    Returns {"rows": [...], "batch_heads": int, "flash_blocks": ..., ...}; each row is a dict with
    ``method`` ("standard" | "flash"), ``pass`` ("forward" | "forward+backward"),
    ``traced_bytes`` (one head, measured), ``model_bytes`` (one head, attnlab.iomodel),
    ``gb`` (traced x batch x heads / 1e9). Also ``paper_block_sizes`` (B_r, B_c from an A100's
    192 KB of SRAM) with ``paper_flash_gb`` (the model at those block sizes).

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
        iomodel.standard_forward_io(1, 1, seq, seq, head_dim, e, block_m=sb[0]),
        iomodel.standard_backward_io(1, 1, seq, seq, head_dim, e, blocks=sb))
    run("flash",
        lambda a, b_, c: flash_attention(a, b_, c, block_m=bm, block_n=bn),
        iomodel.flash_forward_io(1, 1, seq, seq, head_dim, e, block_m=bm, block_n=bn),
        iomodel.flash_backward_io(1, 1, seq, seq, head_dim, e, block_m=bm, block_n=bn))
    paper_blocks = iomodel.flash_block_sizes(iomodel.MACHINES["A100"].sram_per_sm, head_dim, e)
    alg1 = iomodel.flash_forward_io(batch, heads, seq, seq, head_dim, e, block_m=paper_blocks[0],
                                    block_n=paper_blocks[1], loop_order="kv_outer")
    fa2 = (iomodel.flash_forward_io(batch, heads, seq, seq, head_dim, e, block_m=paper_blocks[0], block_n=paper_blocks[1])
           + iomodel.flash_backward_io(batch, heads, seq, seq, head_dim, e, block_m=paper_blocks[0], block_n=paper_blocks[1]))
    # what the block size changes: FlashAttention traffic (model, forward + backward) for square blocks
    sweep = {}
    for b in (32, 64, 128, 256):
        io = (iomodel.flash_forward_io(batch, heads, seq, seq, head_dim, e, block_m=b, block_n=b)
              + iomodel.flash_backward_io(batch, heads, seq, seq, head_dim, e, block_m=b, block_n=b))
        sweep[b] = io.total_bytes / 1e9
    return {"rows": rows, "batch_heads": batch * heads, "block_sweep_gb": sweep, "seq": seq, "head_dim": head_dim, "dtype": str(dtype),
            "flash_blocks": tuple(flash_blocks), "standard_blocks": tuple(standard_blocks),
            "paper_block_sizes": paper_blocks, "paper_flash_gb": fa2.total_bytes / 1e9,
            "paper_alg1_forward_gb": alg1.total_bytes / 1e9, "paper_gb": dict(PAPER_GB)}


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
    br, bc = result["paper_block_sizes"]
    lines.append(f"model at the paper's block sizes for an A100's 192 KB SRAM (B_r={br}, B_c={bc}): "
                 f"our kernels {result['paper_flash_gb']:.2f} GB forward+backward; "
                 f"Algorithm 1 (K/V outer loop) forward {result['paper_alg1_forward_gb']:.2f} GB")
    lines.append("flash forward+backward (model) for square blocks B_r = B_c: " + ", ".join(
        f"{b}: {gb:.2f} GB" for b, gb in result["block_sweep_gb"].items()))
    return "\n".join(lines)
