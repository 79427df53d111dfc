"""A rank of exercise 11's process groups holds its own shard and nothing of another rank's.

The ranks are forked from the process that holds the learner's functions (attnlab/grading/sandbox/ranks.py). A learner set
on skipping the ring would look in that copy for the other ranks' shards and compute every rank's answer alone,
sending zeros round the ring so that the loopback still counts the ring's bytes. Three ways to look: (a) an
``os.register_at_fork(after_in_child=...)`` hook that scans the memory the fork copied; (b) ``gc.get_objects()``
scanned by the rank itself; (c) a module-level global filled in the parent by a profiler hook that reads every
frame's locals (the request the parent holds). Each is graded here by the real sandboxed grader: none may earn the
ring-group part, while the honest solution keeps it and the rest of the notebook.
"""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

from attnlab.distributed import group as ranks
from attnlab.grading.sandbox.ranks import serve

ROOT = Path(__file__).resolve().parents[1]

# finds a case of the ranks' request, [[q, k, v], kwargs] per rank, among objects, and forges every rank's answer
# from it: the learner's own ring_step over the shards found, and zeros sent round the ring for the loopback
_FORGE = '''import gc, os, sys
import torch
import torch.distributed as dist

SEEN = []   # cases of the request, as the process that forks the ranks held them


def _pairs(x):
    return (type(x) in (list, tuple) and len(x) > 0 and all(
        type(p) in (list, tuple) and len(p) == 2 and type(p[0]) in (list, tuple) and len(p[0]) == 3 and
        all(torch.is_tensor(t) for t in p[0]) and type(p[1]) is dict for p in x))


def _keep(x):
    if _pairs(x):
        SEEN.append([[list(p[0]), dict(p[1])] for p in x])   # copies: the lists are blanked after the fork


def _scan():
    for x in gc.get_objects():
        _keep(x)


def ring_forward(q, k, v, causal=False, layout="contiguous"):
    sys.setprofile(None)
    rank, P = dist.get_rank(), dist.get_world_size()
    shards = None
    for case in SEEN + ([] if os.environ.get("FORGE_SCAN") != "1" else
                        [[[list(p[0]), dict(p[1])] for p in x] for x in gc.get_objects() if _pairs(x)]):
        if len(case) == P and torch.equal(case[rank][0][0], q) and torch.equal(case[rank][0][1], k):
            shards = [p[0] for p in case]
    if shards is None:   # and no tensor of a shard's shape but its own q, k, v either
        loose = sum(1 for t in gc.get_objects() if torch.is_tensor(t) and t.shape == q.shape and
                    not any(t is mine for mine in (q, k, v)))
        raise RuntimeError(f"FORGE: no other rank's shard found, {loose} other tensors of its shape")
    o, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], float("-inf"))
    for step in range(P):
        src = (rank - step) % P
        o, lse, _ = ring_step(o, lse, q, shards[src][1], shards[src][2], rank, step, P, causal, layout)
    for step in range(P - 1):   # the ring's bytes, as zeros
        ops = [dist.P2POp(dist.isend, torch.zeros_like(k), (rank + 1) % P),
               dist.P2POp(dist.isend, torch.zeros_like(v), (rank + 1) % P),
               dist.P2POp(dist.irecv, torch.empty_like(k), (rank - 1) % P),
               dist.P2POp(dist.irecv, torch.empty_like(v), (rank - 1) % P)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return o, lse
'''

CHEATS = {
    # (a) a hook in every forked child, run before the grader's own code there: what did the fork copy?
    "11_at_fork_hook": _FORGE + 'os.register_at_fork(after_in_child=_scan)\n',
    # (b) the rank itself scans every object the interpreter tracks
    "11_gc_scan": _FORGE + 'os.environ["FORGE_SCAN"] = "1"\n',
    # (c) a global the parent fills: a profiler hook reads every frame's locals in the forking process (the request
    # and its cases as the parent's code holds them), and the fork hands the global to every rank
    "11_parent_global": _FORGE + '''

def _profile(frame, event, arg):
    if event == "call":
        for value in list(frame.f_locals.values()):
            if type(value) is dict and "cases" in value and type(value["cases"]) is list:
                for case in value["cases"]:
                    _keep(case)
            else:
                _keep(value)


sys.setprofile(_profile)
''',
}


def _notebook(source=None):
    nb = nbformat.read(str(ROOT / "solutions" / "11_across_devices.ipynb"), as_version=4)
    if source is not None:
        cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "ring-group-answer")
        cell.source = source
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The honest solution and the three cheats, graded by `attnlab grade` in one run: {name: {part: part}}."""
    folder = tmp_path_factory.mktemp("ranks-shards")
    nbformat.write(_notebook(), str(folder / "11_honest.ipynb"))
    for name, source in CHEATS.items():
        nbformat.write(_notebook(source), str(folder / f"{name}.ipynb"))
    out = folder / "report.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "attnlab", "grade", str(folder), "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.is_file(), run.stdout[-2000:] + run.stderr[-2000:]
    reports = json.loads(out.read_text())["notebooks"]
    return {Path(r["path"]).stem: {p["name"]: p for p in r["parts"]} for r in reports}


@pytest.mark.slow
def test_the_honest_ring_keeps_full_marks(graded):
    parts = graded["11_honest"]
    assert all(p["points"] == p["max_points"] for p in parts.values()), parts
    assert parts["ring-group"]["points"] == 3, parts["ring-group"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHEATS))
def test_a_rank_that_looks_for_another_rank_s_shard_earns_nothing(graded, name):
    parts = graded[name]
    group = parts["ring-group"]
    assert group["points"] == 0, group
    # what kept it from the points: it found no shard but its own (not some other failure of the forged ring)
    assert "FORGE: no other rank's shard found, 0 other tensors of its shape" in json.dumps(group), group
    # the rest of the notebook is the solution's and keeps its points
    assert all(p["points"] == p["max_points"] for n, p in parts.items() if n != "ring-group"), parts


# ---------------------------------------------------------------------------------------------
# ranks.serve in this process, with a thread playing the grader
# ---------------------------------------------------------------------------------------------

_BEFORE_FORK = []   # tensors of the shards' shape the forking process held at each fork (an at-fork hook)
_RECORDING = [False]


def _record_before_fork():
    if _RECORDING[0]:
        _BEFORE_FORK.append(sum(1 for t in gc.get_objects() if type(t) is torch.Tensor and t.shape == (3, 5)))


os.register_at_fork(before=_record_before_fork)

# the grader's side, in a process of its own (so that this one never holds the shards): two cases of 3 ranks
_GRADER = """import os, sys, torch
from attnlab.grading.sandbox.frames import _receive, _send
fin, fout = os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb")
cases = [[[[f"shard of rank {r}", torch.full((3, 5), 10.0 * c + r)], {}] for r in range(3)] for c in range(2)]
try:
    while True:
        reply = _receive(fin)
        print(reply["send"], flush=True)
        for pair in cases[reply["send"]]:
            _send(fout, pair)
except (EOFError, KeyError):
    pass
"""


def _peek(tag, x):
    """A rank's own arguments, and what a scan of its memory finds of the others' (tags, tensors)."""
    others = sorted({y[0] for y in gc.get_objects() if type(y) is list and len(y) == 1 and type(y[0]) is str
                     and y[0].startswith("shard of rank ")} - {tag})
    tensors = sum(1 for t in gc.get_objects() if type(t) is torch.Tensor and t.shape == (3, 5) and t is not x)
    return dist.get_rank(), tag, float(x.sum()), others, tensors   # (x itself would be an earlier case's outcome)


def test_serve_forks_every_rank_before_the_grader_sends_a_shard():
    grader_reads, process_writes = os.pipe()
    process_reads, grader_writes = os.pipe()
    grader = subprocess.Popen([sys.executable, "-c", _GRADER, str(grader_reads), str(grader_writes)],
                              pass_fds=(grader_reads, grader_writes), stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    os.close(grader_reads)
    os.close(grader_writes)
    _RECORDING[0] = True
    try:
        with os.fdopen(process_reads, "rb") as frames_in, os.fdopen(process_writes, "wb") as frames_out:
            reply = serve({"name": "peek", "ranks": 3, "cases": 2}, {"peek": _peek}, frames_in, frames_out)
    finally:
        _RECORDING[0] = False
        asked = grader.communicate(timeout=60)[0].split()
    assert asked == ["0", "1"], asked                       # each case asked for once every rank was forked
    assert _BEFORE_FORK == [0] * 6, _BEFORE_FORK            # no shard's tensor in the forking process at a fork
    assert len(reply["results"]) == 2, reply
    for c, outcomes in enumerate(reply["results"]):
        for r, outcome in enumerate(outcomes):
            rank, tag, x, others, tensors = outcome["ok"]
            assert (rank, tag, x) == (r, f"shard of rank {r}", 15 * (10.0 * c + r)), outcome
            assert others == [] and tensors == 0, (c, r, others, tensors)


def test_serve_answers_a_missing_name_without_asking_for_shards():
    to_process, from_grader = os.pipe()[::-1]
    from_process, to_grader = os.pipe()
    try:
        with os.fdopen(to_process, "rb") as frames_in, os.fdopen(to_grader, "wb") as frames_out:
            assert serve({"name": "ring_forward", "ranks": 2, "cases": 1}, {}, frames_in, frames_out) == \
                {"missing": True}
            assert serve({"name": "x", "ranks": 2, "cases": 1}, {"x": 3}, frames_in, frames_out) == \
                {"not_callable": "int"}
            with pytest.raises(ValueError, match="number of ranks"):
                serve({"name": "x", "ranks": 9, "cases": 1}, {"x": len}, frames_in, frames_out)
    finally:
        os.close(from_grader)
        os.close(from_process)


def _rank_times(x):
    import torch.distributed as dist

    return x * (dist.get_rank() + 1), dist.get_world_size()


def test_run_group_is_the_learner_s_tool_with_one_list_of_arguments_per_rank():
    # lesson and exercise 11 call run_group(fn, [[args, kwargs] per rank], timeout=...): each rank its own arguments
    import torch

    from attnlab.distributed.group import run_group

    x = torch.arange(3.0)
    outcomes = run_group(_rank_times, [[[x + r], {}] for r in range(3)], timeout=30)
    assert [len(o["ok"]) for o in outcomes] == [2, 2, 2], outcomes
    for r, out in enumerate(outcomes):
        assert torch.equal(out["ok"][0], (x + r) * (r + 1)) and out["ok"][1] == 3 and "written" in out
    with pytest.raises(TypeError, match="per_rank"):
        run_group(_rank_times, 3)
