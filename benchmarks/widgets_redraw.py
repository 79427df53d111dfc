"""How long the widgets take to redraw after a control changes (target: <= 200 ms for lesson-sized inputs).

Run: PYTHONPATH=. python benchmarks/widgets_redraw.py
Prints, per widget and control, the median wall time and the median CPU time of this
process over a few changes (on a shared machine the wall time includes other jobs' load;
the CPU time is what the redraw itself costs).
"""

import statistics
import time

import numpy as np
import torch


def measure(widget, control, values, repeats=2):
    wall, cpu = [], []
    for _ in range(repeats):
        for v in values:
            control.value = v
            wall.append(widget.last_redraw_ms)
            cpu.append(widget.last_redraw_cpu_ms)
    return statistics.median(wall), statistics.median(cpu), len(wall)


def main():
    from attnlab.kernels import block_sparse_attention, flash_attention, local_mask, standard_attention
    from attnlab.memory import trace
    from attnlab.widgets import AttentionMap, BlockMaskEditor, MemoryTraffic, ScalingExplorer

    torch.manual_seed(0)
    rows = []
    tokens = [f"t{i}" for i in range(16)]
    x = torch.randn(4, 8, 16, 32)
    w = torch.softmax(x @ x.transpose(-2, -1) / 32**0.5, -1)  # (layers 4, heads 8, 16, 16)
    t0 = time.perf_counter()
    amap = AttentionMap(w, query_tokens=tokens)
    rows.append(("AttentionMap 4x8 heads, 16 tokens", "build", 1000 * (time.perf_counter() - t0), None, 1))
    amap.head.value = 0
    rows.append(("AttentionMap", "head (one head)", *measure(amap, amap.head, [1, 2, 3, 4])))
    amap.query.value = 3
    rows.append(("AttentionMap", "query (one head)", *measure(amap, amap.query, [1, 5, 7, 9])))
    rows.append(("AttentionMap", "layer (all heads)", *measure(amap, amap.head, ["all"], 1)))
    rows.append(("AttentionMap", "layer (all heads)", *measure(amap, amap.layer, [1, 2, 3, 0])))

    t0 = time.perf_counter()
    se = ScalingExplorer()
    rows.append(("ScalingExplorer", "build", 1000 * (time.perf_counter() - t0), None, 1))
    rows.append(("ScalingExplorer", "d_k", *measure(se, se.d_k, [16, 256, 1024, 64])))
    rows.append(("ScalingExplorer", "temperature", *measure(se, se.temperature, [0.5, 2.0, 4.0, 1.0])))

    q, k, v = (torch.randn(1, 1, 64, 16) for _ in range(3))
    traces = [trace(standard_attention, q, k, v, block_m=16, block_n=16),
              trace(flash_attention, q, k, v, block_m=16, block_n=16),
              trace(block_sparse_attention, q, k, v, local_mask(64, 64, 16, (16, 16)))]
    t0 = time.perf_counter()
    mt = MemoryTraffic(*traces, labels=["standard", "flash", "block-sparse"])
    rows.append(("MemoryTraffic 3 traces N=64 d=16", "build (+SRAM study)", 1000 * (time.perf_counter() - t0), None, 1))
    rows.append(("MemoryTraffic", "step", *measure(mt, mt.step, [5, 20, 40, 60])))
    st = mt.sram_study
    wall = []
    for m in (16, 64, 256, 128):
        t0 = time.perf_counter()
        st.slider.value = m
        wall.append(1000 * (time.perf_counter() - t0))
    rows.append(("MemoryTraffic", "SRAM size", statistics.median(wall), None, len(wall)))

    t0 = time.perf_counter()
    ed = BlockMaskEditor(8, 8)
    rows.append(("BlockMaskEditor 8x8", "build", 1000 * (time.perf_counter() - t0), None, 1))
    rows.append(("BlockMaskEditor", "preset", *measure(ed, ed.preset, ["causal", "strided", "global", "local"])))
    rows.append(("BlockMaskEditor", "click a tile", *measure(ed, ed.buttons[0][5], [True, False])))

    print(f"{'widget':38s} {'control':22s} {'wall ms':>8s} {'cpu ms':>8s} {'n':>3s}")
    for name, ctl, wall_ms, cpu_ms, n in rows:
        cpu = f"{cpu_ms:8.0f}" if cpu_ms is not None else f"{'':8s}"
        print(f"{name:38s} {ctl:22s} {wall_ms:8.0f} {cpu} {n:3d}")


if __name__ == "__main__":
    main()
