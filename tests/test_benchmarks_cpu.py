"""benchmarks/cpu_attention.py --quick runs and prints a well-formed markdown table."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "cpu_attention.py")


def test_quick_benchmark_prints_the_table():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, SCRIPT, "--quick"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("|")]
    header, rule, rows = lines[0], lines[1], lines[2:]
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols == ["N", "method", "time (s)", "peak extra memory (MB)", "speed-up vs naive",
                    "memory saving vs naive"]
    assert re.fullmatch(r"\|(---\|){6}", rule)
    assert len(rows) == 2 * 3                                  # two sizes x three methods
    seen = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6
        n, method, t, mem = int(cells[0]), cells[1], float(cells[2]), float(cells[3])
        assert t > 0 and mem >= 0
        seen.add((n, method.split()[0]))
        if method.startswith("naive"):
            assert cells[4] == "1.00x"
            # the measured peak must at least hold S and P (B=1, H=4, fp32): memory is really measured
            assert mem * 1e6 >= 0.9 * 2 * 4 * n * n * 4
    assert seen == {(n, m) for n in (128, 512) for m in ("naive", "torch", "attnlab")}
    assert "Load average" in res.stdout
