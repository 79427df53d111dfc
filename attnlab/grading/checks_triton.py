"""Checks of exercises 06-08: the Triton primer, FlashAttention and block-sparse attention.

The Triton parts follow Triton-Puzzles: the spec fixes the kernel's signature, the
learner writes the kernel, and the check launches it itself (so it chooses the
grid, the block sizes and the memory layout). Every tensor the kernel sees lives
inside a larger buffer whose surroundings (padding after each row or head, and
guard regions before and after) are filled with a sentinel value:

- a store outside the tensor changes the sentinel: an **out-of-bounds store**;
- a load outside the tensor reads the sentinel, so running the kernel again with
  a different sentinel changes its output: an **out-of-bounds load**;
- elements of the output still holding the sentinel were never written.

In the interpreter every load is also recorded with the program that made it, so
the block-sparse check can fail a kernel that loads K/V blocks its mask leaves out
(right numbers, dense traffic); on a GPU that part is skipped, and the check says so.

Under Triton's interpreter (CPU) the buffers are real memory, so an access that
stays within the guards is caught here instead of corrupting the process. The
kernel runs on the GPU when there is one, else in the interpreter, whatever
``TRITON_INTERPRET`` was when the learner defined it.
"""

import math

import torch

from attnlab.grading import specs
from attnlab.grading.agent import device as _device
from attnlab.grading.checks import _gen, _randn, part
from attnlab.grading.core import Fail, Mistake, check_function, diagnose, learner_of, mismatch, present, value_of

SENTINELS = (7.25, -3.5)


def _cdiv(a, b):
    return -(-a // b)


def _next_power_of_2(n):
    return 1 << max(0, (n - 1).bit_length())


OOB_LOAD = Mistake("out-of-bounds-load", "an out-of-bounds load: the kernel reads memory past the end of a row or "
                   "block (its output depends on what lies there); mask the load, e.g. "
                   "tl.load(ptr + offs, mask=offs < n, other=...)", None)
OOB_STORE = Mistake("out-of-bounds-store", "an out-of-bounds store: the kernel writes past the end of the output; "
                    "pass mask=offs < n to tl.store", None)
OFF_BY_ONE = Mistake("off-by-one-block-edge", "off by one at the block edge: exactly one element past the end is "
                     "touched; the mask is offs < n, not offs <= n", None)
NOT_STORED = Mistake("not-stored-by-kernel", "the output must be written by the kernel's own tl.store: elements of it "
                     "were written some other way (PyTorch code inside or around the kernel)", None)


def run_guarded(learner, name, label, buffers, grid, args, kwargs, outputs, loads=None):
    """Have the learner's kernel launched twice with different sentinels; detect stray accesses.

    buffers: {name: {"data": tensor, "pad_rows": r, "pad_cols": c}} for inputs,
    {name: {"shape": [...], "output": True, ...}} for outputs (they start as the sentinel);
    args: the kernel's arguments as :func:`attnlab.grading.agent.build_args` reads them;
    outputs: names of the output buffers. Returns {name: output tensor} of the first run.
    loads: optional {buffer name: None}; in the interpreter each entry is set to what the first
    run's programs loaded from that buffer ({program: bool tensor}); on a GPU it stays None.
    """
    learner = learner_of(learner)
    request = {"name": name, "grid": list(grid), "buffers": buffers, "args": args, "kwargs": kwargs,
               "sentinels": list(SENTINELS), "loads": sorted(loads or {})}
    reply = learner.launch(request)
    present(reply, name)
    if "result" not in reply:
        raise Fail(f"`{name}`: the grader got no result for {label}")
    runs = value_of(reply["result"], name, f"launching it on {label}")
    shapes = {k: tuple(b["data"].shape) if "data" in b else tuple(b["shape"]) for k, b in buffers.items()}
    if not isinstance(runs, list) or len(runs) != len(SENTINELS):
        raise Fail(f"`{name}` on {label}: the kernel's launch reported nothing the grader can read")
    values = []
    for run in runs:
        changed = run["outside_changed"]
        bad = {k: int(n) for k, n in changed.items() if n}
        if bad:
            where = ", ".join(f"{n} element(s) around `{k}`" for k, n in bad.items())
            found = [OFF_BY_ONE] if sum(bad.values()) <= max(1, len(bad)) * _rows_of(shapes, bad) else []
            raise Fail(f"`{name}` on {label}: wrote outside its tensors ({where})", [OOB_STORE, *found])
        bad_loads = {k: int(n) for k, n in run.get("loads_outside", {}).items() if n}
        if bad_loads:
            where = ", ".join(f"{n} element(s) outside `{k}`" for k, n in bad_loads.items())
            found = [OFF_BY_ONE] if sum(bad_loads.values()) <= len(bad_loads) * _rows_of(shapes, bad_loads) else []
            raise Fail(f"`{name}` on {label}: loaded {where}", [OOB_LOAD, *found])
        for k in outputs:
            unwritten = int(run["never_written"][k])
            if unwritten:
                raise Fail(f"`{name}` on {label}: {unwritten} element(s) of `{k}` were never written; "
                           f"does the grid (or the offsets) cover the whole tensor?")
            not_stored = int(run.get("not_stored", {}).get(k, 0))
            if not_stored:
                raise Fail(f"`{name}` on {label}: {not_stored} element(s) of `{k}` hold values no tl.store of the "
                           f"kernel wrote", [NOT_STORED])
        out = {}
        for k in outputs:
            v = run["values"][k]
            if not torch.is_tensor(v) or tuple(v.shape) != shapes[k]:
                raise Fail(f"`{name}` on {label}: the kernel's launch reported an output the grader cannot read")
            out[k] = v
        values.append(out)
    for k in outputs:
        a, b = values[0][k], values[1][k]
        if not torch.equal(torch.nan_to_num(a, nan=1.5), torch.nan_to_num(b, nan=1.5)):
            raise Fail(f"`{name}` on {label}: the output depends on memory outside the input tensors", [OOB_LOAD])
    if loads is not None and runs[0].get("traced"):
        for k in loads:
            seen = {}
            for program, flat in runs[0]["loaded"][k]:
                mask = torch.zeros(math.prod(shapes[k]), dtype=torch.bool)
                mask[flat.long()] = True
                seen[tuple(int(i) for i in program)] = mask.view(shapes[k])
            loads[k] = seen
    return values[0]


def _rows_of(shapes, bad):
    # one stray element per row (or per slice) is the signature of an off-by-one mask
    return max(math.prod(shapes[k][:-1]) for k in bad)


def _kernel_failure(label, name, got, want, mistakes, args, kwargs, uses_dot=False):
    # On an NVIDIA GPU tl.dot multiplies float32 in TF32 by default (10 mantissa bits): a correct
    # kernel is then ~1e-3 from the float32 spec. Every mistake the checks name is off by far more.
    tol = 5e-3 if (uses_dot and _device() == "cuda") else None
    rtol, atol = (tol, tol) if tol else (1e-4, 1e-5)
    why = mismatch(got, want, rtol, atol)
    if why:
        raise Fail(f"`{name}` on {label}: {why}", diagnose(got, mistakes, args, kwargs, rtol, atol))


# ---------------------------------------------------------------------------
# 06 Triton primer
# ---------------------------------------------------------------------------


_TRAFFIC_CASES = [(f"{m} x {n}, element_size={es}", (m, n, es), {}) for m, n, es in
                  [(4096, 1024, 4), (1, 1, 2), (1823, 781, 2)]]

_TRAFFIC_MISTAKES = [
    Mistake("elements-not-bytes", "these are elements: multiply by element_size",
            lambda m, n, es=4: specs.softmax_traffic(m, n, 1)),
    Mistake("reads-only", "only the reads are counted: writes move bytes too",
            lambda m, n, es=4: ((5 * m * n + 2 * m) * es, m * n * es)),
    Mistake("row-vectors-forgotten", "the M-element row maxima and sums are HBM traffic too (4M elements)",
            lambda m, n, es=4: (8 * m * n * es, 2 * m * n * es)),
]


@part("softmax-traffic")
def _check_traffic(ns):
    n = check_function(ns, "softmax_traffic", specs.softmax_traffic, _TRAFFIC_CASES, _TRAFFIC_MISTAKES)
    return f"{n} sizes match the spec"


def _scale_cases():
    out = []
    for seed, (n, block) in enumerate([(1000, 128), (64, 64), (1, 32), (257, 64)]):
        g = _gen(1100 + seed)
        out.append((f"n={n}, BLOCK_SIZE={block}", _randn(g, n), 0.5 + seed, block))
    return out


@part("masked-scale")
def _check_scale(ns):
    cases = _scale_cases()
    for label, x, alpha, block in cases:
        n = x.numel()
        buffers = {"x": {"data": x[None, :]}, "y": {"shape": [1, n], "output": True}}
        args = [["buf", "x", 0], ["buf", "y", 0], ["val", n], ["val", alpha]]
        got = run_guarded(ns, "scale_kernel", label, buffers, (_cdiv(n, block),), args, {"BLOCK_SIZE": block},
                          ["y"])["y"][0]
        _kernel_failure(label, "scale_kernel", got, specs.scale(x, alpha), [], (x, alpha), {})
    return f"{len(cases)} launches match the spec, with no access outside the tensors"


def _softmax_kernel_cases():
    out = []
    for seed, (rows, cols, scale) in enumerate([(4, 8, 1.0), (3, 100, 1.0), (5, 1, 1.0), (2, 130, 1.0),
                                                 (3, 20, 500.0)]):
        g = _gen(1200 + seed)
        label = f"a ({rows}, {cols}) input" + (" with large logits (~1000)" if scale > 1 else "")
        out.append((label, _randn(g, rows, cols, scale=scale)))
    return out


def _zero_padded_softmax(x):
    # masked-off lanes loaded as 0 join the row: what `other=0` computes
    block = 1 << (x.shape[-1] - 1).bit_length()
    padded = torch.cat([x, x.new_zeros(x.shape[0], block - x.shape[-1])], dim=-1)
    return torch.softmax(padded, dim=-1)[:, : x.shape[-1]]


def _naive_softmax(x):
    e = torch.exp(x)
    return e / e.sum(-1, keepdim=True)


_SOFTMAX_KERNEL_MISTAKES = [
    Mistake("masked-lanes-zero", "masked-off lanes are loaded as 0, which still adds exp(0 - max) to the sum: "
            "load them with other=-float('inf')", _zero_padded_softmax),
    Mistake("no-max-subtraction", "exp overflows on large logits: subtract the row's max before tl.exp",
            _naive_softmax),
]


@part("softmax-kernel")
def _check_softmax_kernel(ns):
    cases = _softmax_kernel_cases()
    for label, x in cases:
        rows, cols = x.shape
        block = _next_power_of_2(cols)
        # rows are 3 elements further apart than they are long: the kernel must use the stride
        buffers = {"x": {"data": x, "pad_cols": 3}, "y": {"shape": list(x.shape), "output": True, "pad_cols": 5}}
        args = [["buf", "y", None], ["buf", "x", None], ["stride", "x", 0], ["stride", "y", 0], ["val", cols]]
        got = run_guarded(ns, "softmax_kernel", label, buffers, (rows,), args, {"BLOCK_SIZE": block}, ["y"])["y"]
        _kernel_failure(label, "softmax_kernel", got, specs.softmax(x), _SOFTMAX_KERNEL_MISTAKES, (x,), {})
    return f"{len(cases)} inputs (odd widths, one column, large logits) match the spec, with no stray access"


# ---------------------------------------------------------------------------
# 07 FlashAttention
# ---------------------------------------------------------------------------


def _online_cases():
    cases = []
    for seed, (m_rows, nb, dv, first) in enumerate([(4, 8, 5, True), (3, 16, 4, False), (6, 5, 8, False),
                                                      (2, 4, 3, False)]):
        g = _gen(1300 + seed)
        scale = 30.0 if seed == 3 else 1.0
        s_block, v_block = _randn(g, m_rows, nb, scale=scale), _randn(g, nb, dv)
        if first:
            m = torch.full((m_rows,), float("-inf"))
            l, acc = torch.zeros(m_rows), torch.zeros(m_rows, dv)
            label = f"the first block (m = -inf, l = 0, acc = 0), M={m_rows}, Nb={nb}"
        else:
            m, l, acc = _randn(g, m_rows) * 2 * scale, torch.rand(m_rows, generator=g) + 0.5, _randn(g, m_rows, dv)
            label = f"a later block, M={m_rows}, Nb={nb}" + (", scores ~ 30" if scale > 1 else "")
        cases.append((label, (m, l, acc, s_block, v_block), {}))
    return cases


def _online_with(rescale_acc=True, rescale_l=True, update_max=True, inverted=False):
    def impl(m, l, acc, s_block, v_block):
        m_new = torch.maximum(m, s_block.amax(-1)) if update_max else m
        alpha = torch.exp(m_new - m) if inverted else torch.exp(m - m_new)
        p = torch.exp(s_block - m_new[:, None])
        l_new = (alpha * l if rescale_l else l) + p.sum(-1)
        acc_new = (alpha[:, None] * acc if rescale_acc else acc) + p @ v_block
        return m_new, l_new, acc_new
    return impl


_ONLINE_MISTAKES = [
    Mistake("acc-not-rescaled", "the accumulator is not rescaled: multiply acc by exp(m_old - m_new) before adding "
            "the new block", _online_with(rescale_acc=False)),
    Mistake("l-not-rescaled", "the running sum l is not rescaled by exp(m_old - m_new)", _online_with(rescale_l=False)),
    Mistake("max-not-updated", "the running max is not updated with the new block's max",
            _online_with(update_max=False)),
    Mistake("rescale-inverted", "the rescale factor is inverted: it is exp(m_old - m_new) <= 1",
            _online_with(inverted=True)),
]


@part("online-softmax-update")
def _check_online(ns):
    n = check_function(ns, "online_softmax_update", specs.online_softmax_update, _online_cases(), _ONLINE_MISTAKES)
    return f"{n} cases match the spec, including the first block"


def _tiled_cases():
    cases = []
    for seed, (m, n, d, bk) in enumerate([(5, 32, 8, 16), (4, 37, 8, 16), (3, 7, 4, 8), (6, 50, 16, 16)]):
        g = _gen(1400 + seed)
        cases.append((f"M={m}, N={n}, d={d}, block_k={bk}", (_randn(g, m, d), _randn(g, n, d), _randn(g, n, d)),
                       {"block_k": bk}))
    return cases


def _tiled_with(update=specs.online_softmax_update, drop_tail=False, use_scale=True, normalise=True):
    def impl(q, k, v, block_k=16, scale=None):
        sc = (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale) if use_scale else 1.0
        m = torch.full((q.shape[0],), float("-inf"))
        l, acc = torch.zeros(q.shape[0]), torch.zeros(q.shape[0], v.shape[-1])
        stop = (k.shape[0] // block_k) * block_k if drop_tail else k.shape[0]
        if stop == 0:
            return torch.full((q.shape[0], v.shape[-1]), float("nan"))
        for start in range(0, stop, block_k):
            m, l, acc = update(m, l, acc, q @ k[start:start + block_k].T * sc, v[start:start + block_k])
        return acc / l[:, None] if normalise else acc
    return impl


_TILED_MISTAKES = [
    Mistake("acc-not-rescaled", "the accumulator is not rescaled when the running max grows",
            _tiled_with(update=_online_with(rescale_acc=False))),
    Mistake("off-by-one-block-edge", "the last, partial block of keys is skipped: loop over range(0, N, block_k)",
            _tiled_with(drop_tail=True)),
    Mistake("scale-forgotten", "the 1/sqrt(d) scale is forgotten", _tiled_with(use_scale=False)),
    Mistake("not-normalised", "the result is not divided by the running sum l at the end", _tiled_with(normalise=False)),
]


@part("tiled-forward")
def _check_tiled(ns):
    n = check_function(ns, "tiled_attention_forward", specs.tiled_attention_forward, _tiled_cases(), _TILED_MISTAKES)
    return f"{n} cases match the spec, including partial last blocks"


def _kernel_reference(q, k, v, scale, block_n, block_mask=None, block_m=None, rescale_acc=True, use_scale=True,
                      mask_tail=True, mask_ignored=False, mask_transposed=False, nan_empty=False):
    """The Triton loop in PyTorch, with switches for the mistakes (q, k, v: (BH, N, D))."""
    bh, n, d = q.shape
    sc = scale if use_scale else 1.0
    kp, vp = k, v
    if not mask_tail:  # keys past n_ctx loaded as 0 and not masked: they join the softmax with score 0
        pad = (-n) % block_n
        kp = torch.cat([k, k.new_zeros(bh, pad, d)], dim=1)
        vp = torch.cat([v, v.new_zeros(bh, pad, d)], dim=1)
    s = q @ kp.transpose(-2, -1) * sc  # (BH, N, Nk')
    mask = None
    if block_mask is not None and not mask_ignored:
        bm = block_mask.transpose(-2, -1) if mask_transposed else block_mask
        mask = specs.block_to_element_mask(bm, (block_m, block_n), n, kp.shape[1])
    if not rescale_acc:
        out = torch.zeros(bh, n, d)
        m = torch.full((bh, n), float("-inf"))
        l = torch.zeros(bh, n)
        for start in range(0, kp.shape[1], block_n):
            sb = s[:, :, start:start + block_n]
            if mask is not None:
                sb = sb.masked_fill(~mask[:, :, start:start + block_n], float("-inf"))
            m_new = torch.maximum(m, sb.amax(-1))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = torch.exp(sb - m_safe[..., None])
            l = torch.exp(torch.where(torch.isfinite(m), m - m_safe, torch.full_like(m, float("-inf")))) * l + p.sum(-1)
            out = out + p @ vp[:, start:start + block_n]
            m = m_new
        return out / torch.where(l > 0, l, torch.ones_like(l))[..., None]
    out = specs.attention(q, kp, vp, scale=sc, mask=mask)
    if nan_empty and mask is not None:
        empty = ~mask.any(-1)
        out = out.masked_fill(empty[..., None], float("nan"))
    return out


def _flash_cases():
    cases = []
    for seed, (bh, n, d, bm, bn, amp) in enumerate([(2, 32, 16, 16, 16, 1.0), (2, 40, 16, 16, 16, 1.0),
                                                    (1, 7, 16, 16, 16, 1.0), (2, 48, 16, 16, 16, 8.0)]):
        g = _gen(1500 + seed)
        q, k, v = _randn(g, bh, n, d, scale=amp), _randn(g, bh, n, d, scale=amp), _randn(g, bh, n, d)
        label = f"BH={bh}, N={n}, D={d}, BLOCK_M={bm}, BLOCK_N={bn}" + (" with large scores" if amp > 1 else "")
        cases.append((label, q, k, v, bm, bn))
    return cases


def _attention_buffers(q, k, v, pad_rows):
    return {"q": {"data": q, "pad_rows": pad_rows}, "k": {"data": k, "pad_rows": pad_rows},
            "v": {"data": v, "pad_rows": pad_rows}, "o": {"shape": list(q.shape), "output": True, "pad_rows": pad_rows}}


_ATTENTION_ARGS = [["buf", "q", None], ["buf", "k", None], ["buf", "v", None], ["buf", "o", None]]


_FLASH_MISTAKES = [
    Mistake("acc-not-rescaled", "the accumulator is not rescaled: acc = acc * alpha[:, None] + tl.dot(p, v)",
            lambda q, k, v, sc, bm, bn: _kernel_reference(q, k, v, sc, bn, rescale_acc=False)),
    Mistake("scale-forgotten", "the scale is not applied to the scores",
            lambda q, k, v, sc, bm, bn: _kernel_reference(q, k, v, sc, bn, use_scale=False)),
    Mistake("off-by-one-block-edge", "keys past n_ctx in the last block are not masked out: set their scores to "
            "-inf (offs_n < n_ctx) so they get no weight",
            lambda q, k, v, sc, bm, bn: _kernel_reference(q, k, v, sc, bn, mask_tail=False)),
]


@part("flash-kernel-loop")
def _check_flash(ns):
    cases = _flash_cases()
    for label, q, k, v, bm, bn in cases:
        bh, n, d = q.shape
        scale = d ** -0.5
        args = _ATTENTION_ARGS + [["stride", "o", 0], ["stride", "o", 1], ["val", n], ["val", scale]]
        got = run_guarded(ns, "flash_fwd_kernel", label, _attention_buffers(q, k, v, pad_rows=16),
                          (_cdiv(n, bm), bh), args, {"HEAD_DIM": d, "BLOCK_M": bm, "BLOCK_N": bn}, ["o"])["o"]
        want = specs.attention(q, k, v, scale=scale)
        _kernel_failure(label, "flash_fwd_kernel", got, want, _FLASH_MISTAKES, (q, k, v, scale, bm, bn), {},
                        uses_dot=True)
    return f"{len(cases)} launches match the spec (partial blocks, N < BLOCK, large scores), with no stray access"


# ---------------------------------------------------------------------------
# 08 block-sparse attention
# ---------------------------------------------------------------------------

_WINDOW_CASES = [(f"n_blocks={n}, window={w}, causal={c}", (n, w), {"causal": c})
                 for n, w, c in [(6, 1, False), (6, 2, True), (5, 0, False), (8, 3, True), (4, 1, True)]]


def _window_with(strict=False, honour_causal=True, reverse=False):
    def impl(n_blocks, window, causal=False):
        i, j = torch.arange(n_blocks)[:, None], torch.arange(n_blocks)[None, :]
        keep = (i - j).abs() < window if strict else (i - j).abs() <= window
        if causal and honour_causal:
            keep = keep & ((j >= i) if reverse else (j <= i))
        return keep
    return impl


_WINDOW_MISTAKES = [
    Mistake("off-by-one-window", "off by one: block j is inside the window when |i - j| <= window",
            _window_with(strict=True)),
    Mistake("causal-ignored", "causal=True is ignored: keep only key blocks j <= i", _window_with(honour_causal=False)),
    Mistake("causal-reversed", "the causal condition is reversed: a query block sees key blocks j <= i",
            _window_with(reverse=True)),
]


@part("block-mask-builder")
def _check_window(ns):
    n = check_function(ns, "sliding_window_block_mask", specs.sliding_window_block_mask, _WINDOW_CASES,
                       _WINDOW_MISTAKES)
    return f"{n} cases match the spec"


def _expand_cases():
    cases = []
    for seed, (lead, nqb, nkb, bq, bk, n_q, n_k) in enumerate([((), 4, 4, 4, 2, 6, 6), ((), 3, 4, 4, 2, 12, 8), ((2,), 2, 3, 4, 8, 7, 20),
                                                             ((1, 2), 3, 3, 2, 2, 5, 6), ((), 2, 2, 4, 4, 8, 8)]):
        g = _gen(1600 + seed)
        bmask = torch.rand(*lead, nqb, nkb, generator=g) < 0.5
        cases.append((f"a {tuple(bmask.shape)} block mask, block_size=({bq}, {bk}), n_q={n_q}, n_k={n_k}",
                      (bmask, (bq, bk), n_q, n_k), {}))
    return cases


def _expand_with(crop=True, swap=False, shift=False):
    def impl(block_mask, block_size, n_q, n_k):
        bq, bk = block_size[::-1] if swap else block_size
        full = block_mask.repeat_interleave(bq, dim=-2).repeat_interleave(bk, dim=-1)
        if shift:  # element i mapped to block (i + 1) // BQ
            full = torch.cat([full[..., 1:, :], full[..., -1:, :]], dim=-2)
            full = torch.cat([full[..., :, 1:], full[..., :, -1:]], dim=-1)
        return full[..., :n_q, :n_k] if crop else full
    return impl


_EXPAND_MISTAKES = [
    Mistake("not-cropped", "the expanded mask is not cropped to (n_q, n_k): the last blocks may be partial",
            _expand_with(crop=False)),
    Mistake("swapped-block-size", "BQ and BK are swapped: block_size = (BQ, BK), rows are queries",
            _expand_with(swap=True)),
    Mistake("off-by-one-block-edge", "off by one at the block edge: element i belongs to block i // BQ",
            _expand_with(shift=True)),
]


@part("block-mask-to-elements")
def _check_expand(ns):
    n = check_function(ns, "block_to_element_mask", specs.block_to_element_mask, _expand_cases(), _EXPAND_MISTAKES)
    return f"{n} cases match the spec, with partial last blocks"


def _sparse_cases():
    cases = []
    for seed, (bh, n, d, bm, bn, kind) in enumerate([(2, 32, 16, 16, 16, "random"), (2, 48, 16, 16, 16, "window"),
                                                     (1, 40, 16, 16, 16, "empty-row"), (2, 40, 16, 16, 8, "random")]):
        g = _gen(1700 + seed)
        q, k, v = _randn(g, bh, n, d), _randn(g, bh, n, d), _randn(g, bh, n, d)
        nqb, nkb = -(-n // bm), -(-n // bn)
        if kind == "window":
            bmask = specs.sliding_window_block_mask(nqb, 1, causal=True).expand(bh, nqb, nkb).clone()
        else:
            bmask = torch.rand(bh, nqb, nkb, generator=g) < 0.5
            bmask[:, 0, 0] = True
            if kind == "empty-row":
                bmask[:, 1, :] = False  # query block 1 attends to nothing: its rows must be zeros
            else:
                bmask[:, :, 0] = True
        label = f"BH={bh}, N={n}, BLOCK_M={bm}, BLOCK_N={bn}, {kind} block mask"
        cases.append((label, q, k, v, bmask, bm, bn))
    return cases


_SPARSE_MISTAKES = [
    Mistake("mask-ignored", "the block mask is ignored: skip key blocks whose mask entry is 0",
            lambda q, k, v, sc, bmask, bm, bn: _kernel_reference(q, k, v, sc, bn, bmask, bm, mask_ignored=True)),
    Mistake("mask-transposed", "the block mask is read transposed: entry [query block, key block]",
            lambda q, k, v, sc, bmask, bm, bn: _kernel_reference(q, k, v, sc, bn, bmask, bm, mask_transposed=True)),
    Mistake("acc-not-rescaled", "the accumulator is not rescaled when the running max grows",
            lambda q, k, v, sc, bmask, bm, bn: _kernel_reference(q, k, v, sc, bn, bmask, bm, rescale_acc=False)),
    Mistake("fully-masked-row", "a query block with no key block gives NaN (0/0): its rows must be zeros",
            lambda q, k, v, sc, bmask, bm, bn: _kernel_reference(q, k, v, sc, bn, bmask, bm, nan_empty=True)),
]


LOADS_SKIPPED = Mistake(
    "loads-skipped-blocks", "the kernel loads K/V blocks that the block mask leaves out: the output is right, but a "
    "kernel that loads every block and masks the scores afterwards moves as many bytes as dense attention. Read the "
    "mask entry first and load K and V only inside `if keep != 0:`, so a skipped block costs no loads", None)


def _skipped_blocks_loaded(loaded, bmask, bn):
    """None when no program loaded K or V outside its query block's kept key blocks, else what it loaded.

    loaded: {"k": {program: bool (BH, N, D)}, "v": ...} from run_guarded; the grid is (n_qb, BH),
    so program (pid_m, pid_h, 0) may read rows of key block j of head pid_h only where
    bmask[pid_h, pid_m, j] is True.
    """
    for name in ("k", "v"):
        for (pid_m, pid_h, _), seen in sorted(loaded[name].items()):
            bh, n, _d = seen.shape
            allowed = torch.zeros(bh, n, dtype=torch.bool)
            allowed[pid_h] = bmask[pid_h, pid_m].repeat_interleave(bn)[:n]
            extra = seen & ~allowed[..., None]
            if extra.any():
                rows = extra[pid_h].any(-1).nonzero().flatten()
                blocks = sorted({int(r) // bn for r in rows})
                where = (f"from key block(s) {', '.join(map(str, blocks))}, which block_mask[{pid_h}, {pid_m}] "
                         f"leaves out" if blocks else "")
                if extra.sum() > extra[pid_h].sum():
                    where += (" and " if where else "") + "from other heads"
                return (f"program (pid_m={pid_m}, pid_h={pid_h}) loaded {int(extra.sum())} element(s) of "
                        f"`{name.upper()}` {where}")
    return None


@part("block-sparse-loop")
def _check_sparse(ns):
    cases = _sparse_cases()
    for label, q, k, v, bmask, bm, bn in cases:
        bh, n, d = q.shape
        nqb, nkb = bmask.shape[-2:]
        scale = d ** -0.5
        mask_i32 = bmask.to(torch.int32).contiguous()
        args = _ATTENTION_ARGS + [["dev", mask_i32], ["stride", "o", 0], ["stride", "o", 1], ["val", n], ["val", nqb],
                                  ["val", nkb], ["val", scale]]
        loads = {"k": None, "v": None}
        got = run_guarded(ns, "block_sparse_fwd_kernel", label, _attention_buffers(q, k, v, pad_rows=16), (nqb, bh),
                          args, {"HEAD_DIM": d, "BLOCK_M": bm, "BLOCK_N": bn}, ["o"], loads=loads)["o"]
        want = specs.attention(q, k, v, scale=scale, mask=specs.block_to_element_mask(bmask, (bm, bn), n, n))
        _kernel_failure(label, "block_sparse_fwd_kernel", got, want, _SPARSE_MISTAKES,
                        (q, k, v, scale, bmask, bm, bn), {}, uses_dot=True)
        if loads["k"] is not None:  # the interpreter recorded every load (no such record on a GPU)
            why = _skipped_blocks_loaded(loads, bmask, bn)
            if why:
                raise Fail(f"`block_sparse_fwd_kernel` on {label}: {why}", [LOADS_SKIPPED])
    done = f"{len(cases)} launches match the spec (random, windowed and empty block rows), with no stray access"
    if _device() == "cuda":
        return done + "; that skipped blocks are never loaded is checked only in Triton's interpreter (CPU), " \
                      "skipped on this GPU"
    return done + ", and no K or V load from a block the mask leaves out"
