"""benchmarks/decode.py: its rows time the kernel and carry the IO model's exact bytes (a tiny run), and the script
prints a well-formed table."""

import importlib.util
import os
import re
import subprocess
import sys

import torch

from attnlab import iomodel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "decode.py")


def _module():
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_cover_mha_gqa_mqa_paged_and_not_with_exact_bytes():
    rows = _module().rows((32,), torch.device("cpu"), torch.float32, heads=4)
    assert [(r["layout"], r["paged"]) for r in rows] == [
        (f"{name} (4/{kv})", p) for name, kv in (("MHA", 4), ("GQA", 1), ("MQA", 1)) for p in ("contiguous", "paged")]
    for r in rows:
        kv = int(r["layout"].split("/")[1].rstrip(")"))
        io = iomodel.decode_io(1, 4, 32, 64, 4, kv_heads=kv, num_splits=r["splits"],
                               page_size=16 if r["paged"] == "paged" else None)
        assert r["bytes"] == io.total_bytes and r["t"] > 0 and r["t_sdpa"] > 0


def test_help_runs_and_the_table_header_is_markdown():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and "--quick" in res.stdout
    src = open(SCRIPT).read()
    assert re.search(r'"\|---\|---\|---\|---\|---\|---\|---\|---\|---\|"', src)
