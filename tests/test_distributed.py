"""attnlab.distributed: ring (both layouts) and Ulysses attention equal single-device attention in O, dQ, dK
and dV on 2, 3 and 4 gloo processes, causal and not; bytes equal iomodel's formulas; launch stops every rank
when one fails and leaves no process behind. Sizes are tiny: the ranks share two cores."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from attnlab import iomodel
from attnlab.distributed import (attention_lse, experiments, launch, merge_partials, ring_attention, shard,
                                 shard_indices, ulysses_attention, unshard)

TOL = 1e-5   # float32: a different order of additions


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _children():
    """Live (non-zombie) processes whose parent is this one, read from /proc."""
    me, kids = os.getpid(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and b"resource_tracker" not in _cmdline(pid):
            kids.append(int(pid))   # (multiprocessing's resource tracker lives as long as this process, by design)
    return kids


@pytest.fixture
def no_orphans():
    before = set(_children())
    yield
    deadline = time.monotonic() + 5
    while set(_children()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(_children()) - before == set(), "launch left child processes behind"


# ------------------------------------------------------------------------------------------
# rank functions the tests launch (top level: the spawned processes import them)
# ------------------------------------------------------------------------------------------

def fail_on_rank(bad):
    if dist.get_rank() == bad:
        raise ValueError(f"boom on rank {bad}")
    dist.barrier()           # the others would wait here for ever: launch must stop them
    return "unreachable"


def ragged_ring():
    n = 4 if dist.get_rank() == 0 else 3
    q = torch.randn(1, 2, n, 8)
    return ring_attention(q, q, q, attn_fn=attention_lse)


def ulysses_odd_heads():
    q = torch.randn(1, 3, 4, 8)
    return ulysses_attention(q, q, q, attn_fn=attention_lse)


def group_info():
    return dist.get_rank(), dist.get_world_size(), dist.get_backend(), torch.get_num_threads()


# ------------------------------------------------------------------------------------------
# exactness and bytes, on real process groups
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_against_sdpa_and_bytes_equal_the_formulas(world, no_orphans):
    n, heads, d = 24, 12, 8            # 24 positions: 2P equal chunks for P = 2, 3, 4; 12 heads divide by each
    results = launch(experiments.exactness, world, n, heads, d)
    assert len(results) == world
    expected = {("ring-contiguous", c) for c in (False, True)} | {("ring-zigzag", c) for c in (False, True)} \
        | {("ulysses", c) for c in (False, True)}
    for rank, res in enumerate(results):
        assert set(res) == expected
        for (method, causal), got in res.items():
            for name in ("O", "dQ", "dK", "dV"):
                assert got[name] < TOL, (rank, method, causal, name, got[name])
            if method.startswith("ring"):
                fwd = iomodel.ring_attention_bytes(1, heads, n, d, world, 4)
                bwd = iomodel.ring_attention_bytes(1, heads, n, d, world, 4, backward=True)
            else:
                fwd = bwd = iomodel.ulysses_attention_bytes(1, heads, n, d, world, 4)
            assert (got["sent_forward"], got["received_forward"]) == (fwd, fwd), (method, rank)
            assert (got["sent_backward"], got["received_backward"]) == (bwd, bwd), (method, rank)


def test_the_triton_kernel_as_the_per_shard_attention(no_orphans):
    # the default attn_fn: attnlab.kernels.flash_attention with its L, in Triton's interpreter in every rank
    results = launch(experiments.exactness, 2, 32, 2, 16, 1, "flash", ("ring-contiguous", "ring-zigzag", "ulysses"))
    for res in results:
        assert len(res) == 6
        for key, got in res.items():
            assert max(got[name] for name in ("O", "dQ", "dK", "dV")) < 1e-4, (key, got)


# ------------------------------------------------------------------------------------------
# launch: results, failures, no orphans
# ------------------------------------------------------------------------------------------

def test_launch_returns_every_rank_result(no_orphans):
    assert launch(group_info, 3) == [(r, 3, "gloo", 1) for r in range(3)]


def test_an_error_on_one_rank_stops_the_others_and_is_raised_with_its_traceback(no_orphans):
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 1") as info:
        launch(fail_on_rank, 3, 1, timeout=120)
    assert time.monotonic() - start < 60        # the barrier-blocked ranks were stopped, not waited for
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "rank 1 of 3" in notes and "fail_on_rank" in notes and "Traceback" in notes


def test_ragged_shards_are_refused_on_every_rank(no_orphans):
    with pytest.raises(ValueError, match="one shape"):
        launch(ragged_ring, 2)


def test_ulysses_needs_heads_divisible_by_the_world_size(no_orphans):
    with pytest.raises(ValueError, match="heads must divide"):
        launch(ulysses_odd_heads, 2)


def test_launch_refuses_functions_the_ranks_cannot_import():
    with pytest.raises(TypeError, match="fn"):
        launch(lambda: 1, 2)
    with pytest.raises(ValueError, match="backend"):
        launch(group_info, 2, backend="mpi")
    with pytest.raises(ValueError, match="world_size"):
        launch(group_info, 0)


def test_no_process_group_is_a_clear_error():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="launch"):
        ring_attention(q, q, q)
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, q, q, layout="striped")
    with pytest.raises(TypeError, match="attn_fn"):
        ring_attention(q, q, q, attn_fn=3)


# ------------------------------------------------------------------------------------------
# the pieces, in one process
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_merging_two_partials_is_attention_over_all_keys(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=g, dtype=torch.float64) for _ in range(3))
    # keys split in two: the second half is entirely "late" for a causal mask on the first 5 queries
    o_all, l_all = attention_lse(q, k, v)
    o1, l1 = attention_lse(q, k[..., :4, :], v[..., :4, :])
    o2, l2 = attention_lse(q, k[..., 4:, :], v[..., 4:, :])
    o, lse = merge_partials(o1, l1, o2, l2)
    torch.testing.assert_close(o.double(), o_all, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse.double(), l_all.float().double(), atol=1e-5, rtol=0)
    empty = torch.full_like(l1, float("-inf"))
    o_e, l_e = merge_partials(torch.zeros_like(o1), empty, o1, l1)        # nothing merged with something
    torch.testing.assert_close(o_e.double(), o1, atol=1e-6, rtol=0)
    o_0, l_0 = merge_partials(torch.zeros_like(o1), empty, torch.zeros_like(o1), empty)
    assert torch.isneginf(l_0).all() and (o_0 == 0).all()


def test_layouts():
    assert shard_indices(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert shard_indices(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert shard_indices(6, 3, 2).tolist() == [4, 5]
    x = torch.randn(1, 2, 24, 4)
    for layout in ("contiguous", "zigzag"):
        parts = [shard(x, 4, r, layout) for r in range(4)]
        assert torch.equal(unshard(parts, layout), x)
        assert sorted(torch.cat([shard_indices(24, 4, r, layout) for r in range(4)]).tolist()) == list(range(24))
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_indices(12, 4, 0, "zigzag")
    with pytest.raises(ValueError, match="rank"):
        shard_indices(8, 2, 2)


def test_communication_formulas():
    assert iomodel.ring_attention_bytes(1, 8, 4096, 64, 4, 2) == 2 * 3 * 8 * 1024 * 64 * 2
    assert iomodel.ring_attention_bytes(1, 8, 4096, 64, 4, 2, backward=True) == \
        2 * 3 * 8 * 1024 * 64 * 2 + 2 * 4 * 8 * 1024 * 64 * 4
    assert iomodel.ulysses_attention_bytes(1, 8, 4096, 64, 4, 2) == 4 * 3 * 2 * 1024 * 64 * 2
    assert iomodel.ring_attention_bytes(1, 8, 4096, 64, 1, 2) == 0     # one rank sends nothing
    assert iomodel.ring_attention_bytes(1, 8, 4096, 64, 1, 2, backward=True) == 0
    # weak scaling (n grows with P): Ulysses' bytes per rank stay (P - 1) / P of a constant, the ring's grow as P
    uly = [iomodel.ulysses_attention_bytes(1, 8, 1024 * p, 64, p) * p / (p - 1) for p in (2, 4, 8)]
    ring = [iomodel.ring_attention_bytes(1, 8, 1024 * p, 64, p) for p in (2, 4, 8)]
    assert len(set(uly)) == 1 and ring[0] < ring[1] < ring[2]
    with pytest.raises(ValueError, match="heads"):
        iomodel.ulysses_attention_bytes(1, 3, 64, 8, 2)
    with pytest.raises(ValueError, match="n"):
        iomodel.ring_attention_bytes(1, 3, 63, 8, 2)


def test_the_benchmark_prints_bytes_equal_to_the_formulas(no_orphans):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "ring_attention.py"), "--quick",
                          "--world-sizes", "2"], capture_output=True, text=True, timeout=600, cwd=root)
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| 2 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["ring-contiguous", "ring-zigzag", "ulysses"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == cells[3], row          # measured bytes per rank == iomodel's formula
        assert float(cells[4]) > 0
