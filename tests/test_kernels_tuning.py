"""The GPU launch policy and the autotuner (attnlab.kernels._tuning), checked on the CPU."""

import pytest
import torch

from attnlab.kernels import _tuning


def test_tuner_picks_the_fastest_skips_failures_and_remembers(monkeypatch):
    monkeypatch.setattr(_tuning, "_tuned", {})
    monkeypatch.setattr(_tuning, "_tuning_log", [])
    launched = []
    times = {"a": 3.0, "b": 1.0, "c": 0.5}

    def launch(cfg):
        launched.append(cfg["name"])
        if cfg["name"] == "c":
            raise RuntimeError("out of resources: shared memory")

    def bench(fn):
        fn()
        return times[launched[-1]]

    cands = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
    assert _tuning.tuned_config("k", cands, launch, bench) == {"name": "b"}  # c was faster but failed
    assert launched == ["a", "b", "c"]
    assert _tuning.tuned_config("k", cands, launch, bench) == {"name": "b"} and len(launched) == 3  # cached
    log = _tuning.tuning_log()[-1]
    assert log["best"] == {"name": "b"} and log["timings"][2] == ({"name": "c"}, float("inf"), "RuntimeError")

    def broken(cfg):
        raise RuntimeError("no")

    assert _tuning.tuned_config("k2", cands, broken, bench) == {"name": "a"}  # all fail: the default


def test_gpu_launches_are_autotuned_unless_blocks_are_fixed(monkeypatch):
    # the routing of a native launch, checked on the CPU by pretending q is on a GPU
    seen = []

    def fake_tuned(key, candidates, launch):
        seen.append((key, candidates))
        return candidates[-1]

    monkeypatch.setattr(_tuning, "use_interpreter", lambda device: False)
    monkeypatch.setattr(_tuning, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(_tuning, "tuned_config", fake_tuned)
    q = torch.empty(1, 2, 1000, 64, dtype=torch.float16)
    for kernel in ("fwd", "dkdv", "dq"):
        cfg = _tuning.choose_config(kernel, q, 1000, 1000, True, None, None, launch=None)
        key, cands = seen[-1]
        assert key[:6] == (kernel, 64, torch.float16, True, 1024, 1024) and cfg == cands[-1]
        assert cands[0] == _tuning.gpu_config(64, torch.float16, (9, 0), backward=kernel != "fwd")
        assert len(cands) == len({tuple(sorted(c.items())) for c in cands}) >= 3
    # fixed block sizes (explicit, or a block mask's): only warps and stages are tuned
    fixed = _tuning.choose_config("fwd", q, 1000, 1000, True, 32, 64, launch=None)
    key, cands = seen[-1]
    assert key[-2:] == (32, 64) and all((c["block_m"], c["block_n"]) == (32, 64) for c in cands)
    assert fixed == cands[-1] and len({(c["num_warps"], c["num_stages"]) for c in cands}) == len(cands) == 4
    monkeypatch.setenv("ATTNLAB_AUTOTUNE", "0")
    assert _tuning.choose_config("dq", q, 1000, 1000, False, None, None, launch=None) == _tuning.gpu_config(
        64, torch.float16, (9, 0), backward=True)
    big = _tuning.choose_config("dkdv", q, 1000, 1000, False, 128, 128, launch=None)
    assert big == _tuning.fixed_block_candidates(128, 128, 64, torch.float16, (9, 0), backward=True)[0]
    assert big["num_warps"] == 8 and len(seen) == 4  # 4 warps spill at 128 x 128; nothing timed with tuning off


def test_fixed_block_candidates():
    small = _tuning.fixed_block_candidates(32, 32, 64, torch.float16)
    assert small[0] == {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 3}
    assert _tuning.fixed_block_candidates(128, 128, 64, torch.float16, backward=True)[0]["num_warps"] == 8
    assert _tuning.fixed_block_candidates(64, 64, 128, torch.float16)[0]["num_warps"] == 8
    turing = _tuning.fixed_block_candidates(64, 64, 64, torch.float16, (7, 5))
    assert [(c["num_warps"], c["num_stages"]) for c in turing] == [(8, 1), (4, 1)]


def test_out_of_shared_memory_names_what_to_change():
    from triton.runtime.errors import OutOfResources

    q = torch.empty(1, 1, 128, 64)

    def launch(config):
        raise OutOfResources(81920, 65536, "shared memory")

    with pytest.raises(ValueError, match=r"64 x 64 tiles, head_dim 64 and torch.float32 .* smaller block_m/block_n"):
        _tuning._launch_checked("dK/dV", launch, {"block_m": 64, "block_n": 64}, q)
