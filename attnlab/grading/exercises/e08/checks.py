"""The checks of exercise 08_block_sparse: one table per graded part (:mod:`attnlab.grading.engine`), in ``TABLES``.

The expected values come from PyTorch's FlexAttention, run eagerly on the CPU: its
``create_block_mask`` for the block lists and its ``flex_attention`` for the outputs
(:func:`_torch_block_mask`, :func:`_flex_reference`), and from attnlab's
``block_sparse_reference`` for the block-skipping loop. The two kernel parts are ``Kernel`` rows whose launches
say which key blocks and MASK tiles each program may load (``Launch.allowed``), besides a byte budget per buffer.
"""

import dataclasses
import warnings

import torch

from attnlab.attention import block_sparse_reference, scaled_dot_product_attention
from attnlab.grading.core import (Fail, Mistake, case_line, clone, diagnose, each_result, gen as _gen, learner_of,
                                  mismatch, present, randn as _randn, value_of)
from attnlab.grading.engine import Kernel, Launch, Measured, launch
from attnlab.grading.exercises.e08 import spec as specs
from attnlab.grading.kernel_check import (attention_budget, attention_launch, block_rows, blocks_allowed, cdiv,
                                          run_guarded)
from attnlab.mask_mods import MASK_MODS


# ---------------------------------------------------------------------------------------
# PyTorch's FlexAttention, eager on the CPU: the references
# ---------------------------------------------------------------------------------------

def _flex():
    import torch.nn.attention.flex_attention as flex

    return flex


def _mask_mod(kind, arg):
    return MASK_MODS[kind](arg)


def _element_mask(kind, arg, B, H, Nq, Nk):
    """bool (B, H, Nq, Nk) from torch's create_mask (True = attend)."""
    return _flex().create_mask(_mask_mod(kind, arg), B, H, Nq, Nk, device="cpu").expand(B, H, Nq, Nk).clone()


def _torch_block_mask(kind, arg, B, H, Nq, Nk, block_size):
    """torch's create_block_mask (eager, CPU) for this mask."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _flex().create_block_mask(_mask_mod(kind, arg), B, H, Nq, Nk, device="cpu",
                                         BLOCK_SIZE=specs.block_sizes(block_size))


def _torch_lists(kind, arg, B, H, Nq, Nk, block_size):
    bm = _torch_block_mask(kind, arg, B, H, Nq, Nk, block_size)
    return bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices


def _flex_reference(q, k, v, kind, arg, block_size, scale):
    """torch's flex_attention (eager, CPU) under torch's block mask; q, k, v (B, H, N, D).

    Called without torch.compile, flex_attention warns and still runs its unfused implementation (the
    whole score matrix, masked), but first traces it with dynamo (eager backend): a second or more per
    new mask. The module flag ``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` (torch's own switch, documented
    at the top of torch/nn/attention/flex_attention.py) runs the same implementation directly; it
    only "doesn't work with the backwards pass", and this is a forward. tests/test_exercise_08.py
    checks that both paths give the same output.
    """
    flex = _flex()
    B, H, N, _ = q.shape
    bm = _torch_block_mask(kind, arg, B, H, N, N, block_size)
    before = flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex.flex_attention(q, k, v, block_mask=bm, scale=scale)
    finally:
        flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = before


# ---------------------------------------------------------------------------------------
# Part (a): create_block_mask
# ---------------------------------------------------------------------------------------

def _normalised(lists):
    """(kv_num, kv_idx, full_num, full_idx) with the padding past each count replaced by -1 (int64)."""
    kn, ki, fn, fi = (torch.as_tensor(t).long() for t in lists)
    cols = torch.arange(ki.shape[-1])
    return kn, torch.where(cols < kn[..., None], ki, -1), fn, torch.where(cols < fn[..., None], fi, -1)


def _read_lists(got, label):
    """The learner's four tensors, or Fail saying what the contract asks for."""
    what = ("create_block_mask must return (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices): "
            "integer tensors (B, H, n_qb), (B, H, n_qb, n_kb), (B, H, n_qb), (B, H, n_qb, n_kb)")
    if not isinstance(got, (tuple, list)) or len(got) != 4:
        raise Fail(f"`create_block_mask` on {label}: {what}; got {type(got).__name__}"
                   + (f" of {len(got)} values" if isinstance(got, (tuple, list)) else ""))
    for i, t in enumerate(got):
        if not torch.is_tensor(t) or t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            kind = f"a tensor of {t.dtype}" if torch.is_tensor(t) else type(t).__name__
            raise Fail(f"`create_block_mask` on {label}: value {i} is {kind}; {what}")
    kn, ki, fn, fi = got
    if kn.dim() != 3 or fn.dim() != 3 or ki.dim() != 4 or fi.dim() != 4 or ki.shape[:3] != kn.shape \
            or fi.shape[:3] != fn.shape:
        shapes = ", ".join(str(tuple(t.shape)) for t in got)
        raise Fail(f"`create_block_mask` on {label}: returned shapes {shapes}; {what}")
    return got


def _block_mask_cases():
    g = _gen(1800)
    # (kind, B, H, Nq, Nk, block_size): a square case first (so a transposed answer keeps its shape)
    rows = [("sliding_window", 1, 2, 40, 40, 8), ("sliding_window", 2, 1, 37, 50, (16, 8)),
            ("prefix_lm", 2, 2, 45, 45, (8, 16)), ("prefix_lm", 1, 1, 33, 20, 8),
            ("document", 2, 1, 45, 45, 8), ("document", 3, 2, 32, 32, (16, 8))]
    cases = []
    for kind, B, H, Nq, Nk, bs in rows:
        if kind == "sliding_window":
            arg = int(torch.randint(3, 12, (1,), generator=g))
        elif kind == "prefix_lm":
            arg = int(torch.randint(5, 20, (1,), generator=g))
        else:
            arg = _doc_ids(g, B, Nq)
        what = f"doc_ids {tuple(arg.shape)}" if kind == "document" else f"{arg}"
        label = f"{kind}({what}), B={B}, H={H}, Nq={Nq}, Nk={Nk}, block_size={bs}"
        cases.append((label, (kind, arg, B, H, Nq, Nk, bs), {}))
    return cases


def _doc_ids(g, B, N, padding=False):
    """Sorted document ids (B, N): a few documents of random lengths per row (-1: padding at the end)."""
    cuts = torch.rand(B, N, generator=g) < 0.12
    cuts[:, 0] = False
    ids = cuts.long().cumsum(-1)
    if padding:
        ids[:, N - 5:] = -1
    return ids


def _padded_mask(kind, arg, B, H, Nq, Nk, bq, bk, pad=False, transposed=False):
    e = _element_mask(kind, arg, B, H, Nq, Nk)
    if transposed:
        e = e.transpose(-2, -1)
    nqb, nkb = cdiv(e.shape[-2], bq), cdiv(e.shape[-1], bk)
    out = torch.full((B, H, nqb * bq, nkb * bk), pad, dtype=torch.bool)
    out[..., :e.shape[-2], :e.shape[-1]] = e
    return out


def _lists_with(pad=False, transposed=False, rule="right", floor=False, edge=False, ragged_full=False):
    """A wrong create_block_mask (normalised lists), from the element mask."""
    def impl(kind, arg, B, H, Nq, Nk, block_size):
        bq, bk = specs.block_sizes(block_size)
        if transposed and (Nq != Nk or bq != bk):
            raise ValueError("only square")
        m = _padded_mask(kind, arg, B, H, Nq, Nk, bq, bk, pad=pad, transposed=transposed)
        nqb, nkb = m.shape[-2] // bq, m.shape[-1] // bk
        if edge:  # tile (i, j) also takes row (i + 1) * BQ and column (j + 1) * BK of the next blocks
            count = torch.zeros(B, H, nqb, nkb, dtype=torch.long)
            size = torch.zeros(nqb, nkb, dtype=torch.long)
            for i in range(nqb):
                for j in range(nkb):
                    tile = m[..., i * bq:(i + 1) * bq + 1, j * bk:(j + 1) * bk + 1]
                    count[..., i, j] = tile.sum((-2, -1))
                    size[i, j] = tile.shape[-2] * tile.shape[-1]
            full_size = size
        else:
            count = m.view(B, H, nqb, bq, nkb, bk).sum((3, 5))
            full_size = bq * bk
        if ragged_full:  # a tile is "full" when all of its positions inside the sequence are allowed
            rows = torch.clamp(Nq - torch.arange(nqb) * bq, max=bq)
            cols = torch.clamp(Nk - torch.arange(nkb) * bk, max=bk)
            full_size = rows[:, None] * cols[None, :]
        if floor:
            count = count[..., :Nq // bq, :Nk // bk]
        anything = count > 0
        full = count == full_size
        partial, full = {"right": (anything & ~full, full), "full-means-any": (torch.zeros_like(full), anything),
                         "all-partial": (anything, torch.zeros_like(full)),
                         "full-dropped": (anything & ~full, torch.zeros_like(full)),
                         "partial-includes-full": (anything, full)}[rule]
        return _normalised((*specs.block_lists(partial), *specs.block_lists(full)))
    return impl


_BLOCK_MASK_MISTAKES = [
    Mistake("transposed-block-mask", "the block mask is transposed: rows are query blocks, columns key blocks; call "
            "mask_mod(b, h, q_idx, kv_idx) with q_idx varying along dim -2 and kv_idx along dim -1",
            _lists_with(transposed=True)),
    Mistake("off-by-one-block-edge", "off by one at the block edge: tile (i, j) holds rows i*BQ ... (i+1)*BQ - 1 "
            "and columns j*BK ... (j+1)*BK - 1, the next block's first row and column are not in it",
            _lists_with(edge=True)),
    Mistake("partial-treated-as-full", "a tile with at least one allowed element is not full: full means all BQ x BK "
            "elements are allowed; the others with some allowed element are partial",
            _lists_with(rule="full-means-any")),
    Mistake("full-treated-as-partial", "no block is full: a tile whose BQ x BK elements are all allowed goes into "
            "full_kv_num_blocks / full_kv_indices, not into the partial lists", _lists_with(rule="all-partial")),
    Mistake("full-treated-as-empty", "the full blocks are missing: a tile whose elements are all allowed is listed "
            "in full_kv_indices (it is not empty)", _lists_with(rule="full-dropped")),
    Mistake("partial-lists-include-full", "kv_num_blocks / kv_indices list only the partial blocks: a full block "
            "belongs to the full lists alone", _lists_with(rule="partial-includes-full")),
    Mistake("ragged-tail-full", "positions past Nq or Nk count as masked out: pad with False, so a ragged last "
            "block is partial (the kernel must bound-check it), never full", _lists_with(pad=True)),
    Mistake("ragged-tail-full", "a ragged last tile whose positions inside the sequence are all allowed is counted "
            "as full: the positions past Nq or Nk count as masked out, so that tile is partial (a full tile is "
            "visited with no mask at all, not even the bound on the sequence's end)", _lists_with(ragged_full=True)),
    Mistake("ragged-tail-dropped", "the number of blocks rounds up: n_qb = ceil(Nq / BQ), n_kb = ceil(Nk / BK); "
            "the last, ragged block counts", _lists_with(floor=True)),
]


_BLOCK_MASK_FOR = ("kind", "arg", "B", "H", "Nq", "Nk", "block_size")  # block_mask_for's parameters


def _measure_block_mask(learner):
    """block_mask_for (the learner's create_block_mask on each case's mask_mod) against torch's lists, compared
    up to each count (what lies past it is padding)."""
    learner = learner_of(learner)
    cases = _block_mask_cases()
    present(learner.call("create_block_mask", []), "create_block_mask")  # NotDone unless it is defined
    reply = learner.call("block_mask_for", [[clone(args), {}] for _, args, _ in cases])
    present(reply, "block_mask_for")
    results = reply.get("results", [])
    names = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"]
    for i, (label, args, _) in enumerate(cases):
        if i >= len(results):
            raise Fail(f"`create_block_mask`: the grader got no result for {label}")
        # what it returned, or raised, is create_block_mask's: block_mask_for is the notebook's given wrapper
        got = _normalised(_read_lists(value_of(results[i], "create_block_mask", label), label))
        want = _normalised(_torch_lists(*args))
        why = mismatch(got, want)
        if why:
            def in_order(lists):  # the indices of each row sorted: equal when only their order differs
                return [t.sort(-1).values if t.dim() == 4 else t for t in lists]
            if all(g.shape == w.shape for g, w in zip(got, want)) and not mismatch(in_order(got), in_order(want)):
                raise Fail(f"`create_block_mask` on {label}: the right blocks, in another order: list each query "
                           f"block's key blocks in increasing order, as FlexAttention does")
            which = next(n for n, g, w in zip(names, got, want) if mismatch(g, w))
            raise Fail(f"`create_block_mask` on {label}: {why} ({which}; entries past each count are shown as -1 "
                       f"and not compared)\n    " + case_line(label, args, {}, names=_BLOCK_MASK_FOR),
                       diagnose(got, _BLOCK_MASK_MISTAKES, args, {}))
    return (f"{len(cases)} block masks (sliding window, prefix-LM, document; ragged lengths, Nq != Nk, "
            f"BQ != BK) equal torch's create_block_mask")


# ---------------------------------------------------------------------------------------
# Kernels: one launch, what each program may load, byte budgets
# ---------------------------------------------------------------------------------------

def _attention_launch(label, q, k, v, lists, scale, bm, bn, want, inputs, names, visit, mask=None, partial=None):
    """One launch of a block-sparse kernel on (BH, N, D) inputs and its int32 block lists ``lists`` (BH, n_qb[,
    n_kb]), each tensor inside sentinel memory with 16 extra rows per head (so stride_h is not N * D). ``visit``
    (BH, n_qb, n_kb): the key blocks the lists name, the only ones whose K and V a program may load (Q read once,
    each listed K/V block once per query block, O written once). ``mask``: flex_fwd_kernel's element mask (BH, N,
    N), its rows 3 rows and 5 columns further apart than they are long, readable in the ``partial`` blocks only
    (int8: one byte per element)."""
    bh, n, d = q.shape
    nqb, nkb = lists[1].shape[-2:]
    tensors, strides = {"q": q, "k": k, "v": v, "o": q.shape}, ["o"]
    allowed = dict.fromkeys("kv", blocks_allowed(visit, bn, q.shape))
    budget = attention_budget(q.shape, sum(block_rows(j, bn, n) for j in visit.nonzero()[:, 2].tolist()))
    if mask is not None:
        tensors["mask"], strides = mask.to(torch.int8), ["o", "mask"]
        allowed["mask"] = _mask_allowed(partial, bm, bn, n)
        budget["mask"] = (int(_tiles(partial, bm, bn, n, n).sum()), 0)
    buffers, args = attention_launch(tensors, {**dict.fromkeys("qkvo", 16), "mask": (3, 5)}, strides,
                                     [n, nqb, nkb, scale], lists)
    return Launch(label, buffers, (nqb, bh), args, {"HEAD_DIM": d, "BLOCK_M": bm, "BLOCK_N": bn}, {"o": want},
                  inputs, names, budget, allowed)


def _mask_allowed(partial, bm, bn, n):
    """allowed(program) of MASK (BH, N, N): program (pid_m, pid_h) may read its own rows of its partial blocks."""
    def allowed(program):
        pid_m, pid_h = program[:2]
        out = torch.zeros(partial.shape[0], n, n, dtype=torch.bool)
        out[pid_h, pid_m * bm:(pid_m + 1) * bm] = partial[pid_h, pid_m].repeat_interleave(bn)[:n]
        return out
    return allowed


def _tiles(x, bm, bn, n_q, n_k):
    """Expand a bool (..., n_qb, n_kb) to (..., n_q, n_k)."""
    return specs.block_to_element_mask(x, (bm, bn), n_q, n_k)


LOADS_SKIPPED = Mistake(
    "loads-skipped-blocks", "the kernel loads K/V blocks its lists leave out: the output is right, but a kernel that "
    "loads every block and masks the scores afterwards moves as many bytes as dense attention. Loop over the list "
    "(for i in range(0, num): j = tl.load(indices + ...)) and load K and V of block j only", None)


# ---------------------------------------------------------------------------------------
# Part (b): the block-skipping loop
# ---------------------------------------------------------------------------------------

def _sparse_with(use_list=True, counter_as_index=False, head_zero=False, rescale=True, nan_empty=False,
                 mask_tail=True, drop_last=False, scale_ignored=False):
    """A wrong block-skipping loop, in PyTorch: q, k, v (BH, N, D), visit (BH, n_qb, n_kb)."""
    def impl(q, k, v, scale, visit, bm, bn):
        bh, n, d = q.shape
        if scale_ignored:
            scale = d ** -0.5
        vis = visit.clone()
        if not use_list:
            vis[:] = True
        if head_zero:
            vis = vis[:1].expand_as(vis)
        if counter_as_index or drop_last:
            num = vis.sum(-1)
            if drop_last:
                num = (num - 1).clamp(min=0)
            order = torch.sort((~vis).to(torch.int8), dim=-1, stable=True).indices
            cols = torch.arange(vis.shape[-1])
            vis = torch.zeros_like(vis)
            if counter_as_index:
                vis = cols < num[..., None]
            else:
                vis.scatter_(-1, order, cols < num[..., None])
        kp, vp = k, v
        n_k = n
        if not mask_tail:  # keys past N loaded as 0 and scored 0: they join the softmax
            n_k = cdiv(n, bn) * bn
            kp = torch.cat([k, k.new_zeros(bh, n_k - n, d)], dim=1)
            vp = torch.cat([v, v.new_zeros(bh, n_k - n, d)], dim=1)
        mask = _tiles(vis, bm, bn, n, n_k)
        if not rescale:
            return _unrescaled(q, kp, vp, scale, mask, bn)
        out = scaled_dot_product_attention(q[None], kp[None], vp[None], mask=mask[None], scale=scale)[0]
        if nan_empty:
            out = out.masked_fill(~mask.any(-1)[..., None], float("nan"))
        return out
    return impl


def _unrescaled(q, k, v, scale, mask, bn):
    """The online softmax without rescaling acc when the running max grows."""
    bh, n, d = q.shape
    s = (q @ k.transpose(-2, -1)) * scale
    out = torch.zeros(bh, n, v.shape[-1])
    m = torch.full((bh, n), float("-inf"))
    l = torch.zeros(bh, n)
    for start in range(0, k.shape[1], bn):
        sb = s[:, :, start:start + bn].masked_fill(~mask[:, :, start:start + bn], float("-inf"))
        m_new = torch.maximum(m, sb.amax(-1))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(sb - m_safe[..., None])
        l = torch.exp(torch.where(torch.isfinite(m), m - m_safe, torch.full_like(m, float("-inf")))) * l + p.sum(-1)
        out = out + p @ v[:, start:start + bn]
        m = m_new
    return out / torch.where(l > 0, l, torch.ones_like(l))[..., None]


_SPARSE_MISTAKES = [
    Mistake("list-ignored", "the lists are ignored: every key block is visited (dense attention); visit only the "
            "kv_num_blocks[row] blocks of kv_indices[row]", _sparse_with(use_list=False)),
    Mistake("counter-as-block-index", "the loop counter is used as the block index: block i is visited instead of "
            "j = kv_indices[row, i]; load j from the list", _sparse_with(counter_as_index=True)),
    Mistake("head-offset-forgotten", "every head reads head 0's lists: row (pid_h, pid_m) of the lists is "
            "pid_h * n_qb + pid_m", _sparse_with(head_zero=True)),
    Mistake("acc-not-rescaled", "the accumulator is not rescaled when the running max grows: "
            "acc = acc * alpha[:, None] + tl.dot(p, v)", _sparse_with(rescale=False)),
    Mistake("fully-masked-row", "a query block with an empty list gives NaN (0 / 0): its rows must be zeros, "
            "divide by tl.where(l_i > 0, l_i, 1.0)", _sparse_with(nan_empty=True)),
    Mistake("tail-not-masked", "keys past n_ctx join the softmax: in the ragged last block set their scores to -inf "
            "(tl.where(offs_n[None, :] < n_ctx, s, float('-inf')))", _sparse_with(mask_tail=False)),
    Mistake("count-off-by-one", "the last listed block is skipped: visit i = 0 ... kv_num_blocks[row] - 1, "
            "range(0, num)", _sparse_with(drop_last=True)),
    Mistake("scale-argument-ignored", "the kernel ignores its `scale` argument (1/sqrt(HEAD_DIM) written in "
            "instead?): the caller chooses the scale, so multiply the scores by `scale`",
            _sparse_with(scale_ignored=True)),
]


def _sparse_launches():
    out = []
    for seed, (bh, n, d, bm, bn, kind) in enumerate([(2, 48, 16, 16, 16, "random"), (2, 40, 16, 32, 16, "window"),
                                                     (2, 40, 16, 16, 16, "empty row"),
                                                     (1, 64, 16, 16, 16, "large scores")]):
        g = _gen(1700 + seed)
        amp = 6.0 if kind == "large scores" else 1.0
        q, k, v = _randn(g, bh, n, d, scale=amp), _randn(g, bh, n, d, scale=amp), _randn(g, bh, n, d)
        nqb, nkb = cdiv(n, bm), cdiv(n, bn)
        if kind == "window":
            i, j = torch.arange(nqb)[:, None] * bm, torch.arange(nkb)[None, :] * bn
            visit = ((j <= i + bm - 1) & (j + bn - 1 >= i - 8)).expand(bh, nqb, nkb).clone()
        else:
            visit = torch.rand(bh, nqb, nkb, generator=g) < 0.5
            visit[:, :, -1] |= torch.rand(bh, nqb, generator=g) < 0.7  # the ragged last block, often
            visit[:, 0, 0] = True
            if bh > 1:
                visit[1, 0, 1] = ~visit[0, 0, 1]  # the heads' lists differ
            if kind == "empty row":
                visit[:, 1, :] = False  # query block 1 visits nothing: its rows must be zeros
        scale = (0.25, 0.6, 0.4, 0.15)[seed]  # not only 1/sqrt(D): the kernel must use its argument
        want = block_sparse_reference(q[None], k[None], v[None], visit[None], (bm, bn), scale=scale)[0]
        out.append(_attention_launch(f"BH={bh}, N={n}, D={d}, BLOCK_M={bm}, BLOCK_N={bn}, {kind} block lists, "
                                     f"scale={scale}", q, k, v, specs.block_lists(visit), scale, bm, bn, want,
                                     (q, k, v, scale, visit, bm, bn),
                                     ("Q", "K", "V", "scale", "visited blocks", "BLOCK_M", "BLOCK_N"), visit))
    return out


_SPARSE = Kernel("block_sparse_fwd_kernel", _sparse_launches, _SPARSE_MISTAKES, uses_dot=True,
                 says="{n} launches match block_sparse_reference (random, windowed and empty lists, ragged N)",
                 budget_says="Q read once, each listed K/V block once per query block that lists it, O written once",
                 stray_loads=dict.fromkeys("kv", LOADS_SKIPPED), loads_says="K and V of the blocks its lists name only")


# ---------------------------------------------------------------------------------------
# Part (c): partial blocks with the element mask
# ---------------------------------------------------------------------------------------

def _flex_with(rule="right", after_softmax=False, transposed=False):
    """A wrong flex forward in PyTorch: q, k, v (BH, N, D); e (BH, N, N) element mask; partial/full (BH, n_qb, n_kb)."""
    def impl(q, k, v, scale, e, partial, full, bm, bn):
        bh, n, d = q.shape
        tp, tf = _tiles(partial, bm, bn, n, n), _tiles(full, bm, bn, n, n)
        inner = e.transpose(-2, -1) if transposed else e
        mask = {"right": (inner & tp) | tf, "partial-as-full": tp | tf, "full-as-empty": inner & tp,
                "partial-skipped": tf}[rule]
        if after_softmax:  # the normaliser sums over every visited element, the masked ones too
            visited = tp | tf
            s = (q @ k.transpose(-2, -1)) * scale
            s = s.masked_fill(~visited, float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = torch.exp(s - m)
            den = p.sum(-1, keepdim=True)
            return (p * mask) @ v / torch.where(den > 0, den, torch.ones_like(den))
        return scaled_dot_product_attention(q[None], k[None], v[None], mask=mask[None], scale=scale)[0]
    return impl


_FLEX_MISTAKES = [
    Mistake("partial-treated-as-full", "the element mask is not applied in partial blocks: load the MASK tile of a "
            "partial block and set the scores it forbids to -inf", _flex_with(rule="partial-as-full")),
    Mistake("full-treated-as-empty", "the full blocks are not visited: walk full_kv_num_blocks / full_kv_indices too "
            "(without the mask)", _flex_with(rule="full-as-empty")),
    Mistake("partial-treated-as-empty", "the partial blocks are not visited: walk kv_num_blocks / kv_indices too, "
            "with the mask", _flex_with(rule="partial-skipped")),
    Mistake("mask-after-softmax", "the mask is applied after the exponentials: the masked scores still count in the "
            "running max and the sum l; set them to -inf before tl.max and tl.exp",
            _flex_with(after_softmax=True)),
    Mistake("transposed-mask-tile", "the MASK tile is read transposed: its rows are queries (offs_m[:, None] * "
            "stride_mq) and its columns keys (offs_n[None, :])", _flex_with(transposed=True)),
]

NAN_ROWS = Mistake(
    "fully-masked-rows-nan", "NaN where the output is finite: a row can have no allowed key in a partial block (or at "
    "all), so m_new stays -inf and exp(-inf - (-inf)) is NaN. Subtract m_safe = tl.where(m_new == float('-inf'), 0.0, "
    "m_new) in both exps, and divide by tl.where(l_i > 0, l_i, 1.0) at the end", None)
MASK_FOR_FULL = Mistake(
    "mask-loaded-for-full-blocks", "the kernel reads MASK outside its partial blocks: a full block is all allowed "
    "(its mask is all True), so reading its mask tile moves bytes for nothing. Load the MASK tile only for the "
    "blocks of kv_indices", None)


def _dense_lists(lists, bh):
    """partial, full: bool (BH, n_qb, n_kb) from torch's lists."""
    kn, ki, fn, fi = _normalised(lists)
    nkb = ki.shape[-1]

    def dense(num, idx):
        out = torch.zeros(*idx.shape[:-1], nkb + 1, dtype=torch.bool)
        out.scatter_(-1, torch.where(idx < 0, nkb, idx), True)
        return out[..., :nkb].reshape(bh, -1, nkb)
    return dense(kn, ki), dense(fn, fi)


MASK_STRIDE_IGNORED = Mistake("mask-stride-ignored", "MASK's rows are addressed with n_ctx instead of their stride: "
                              "row q of MASK starts at MASK + pid_h * stride_mh + q * stride_mq (the grader's MASK "
                              "rows are further apart than n_ctx), so the kernel read the wrong rows", None)


def _flex_launch(label, q, k, v, e, lists, bm, bn, want=None):
    """flex_fwd_kernel on (BH, N, D) inputs, the (BH, N, N) element mask ``e`` and torch's ``lists``."""
    bh, n, d = q.shape
    partial, full = _dense_lists(lists, bh)
    flat = [t.reshape(bh, *t.shape[2:]).to(torch.int32).contiguous() for t in lists]
    return _attention_launch(label, q, k, v, flat, d ** -0.5, bm, bn, want,
                             (q, k, v, d ** -0.5, e, partial, full, bm, bn),
                             ("Q", "K", "V", "scale", "MASK", "partial blocks", "full blocks", "BLOCK_M", "BLOCK_N"),
                             partial | full, e, partial)


def _flex_launches():
    out = []
    rows = [("sliding_window", 1, 2, 50, 16, 16), ("prefix_lm", 2, 1, 40, 16, 16), ("document", 2, 1, 45, 16, 16),
            ("document with padding", 1, 2, 37, 16, 16)]
    for seed, (kind, B, H, n, bm, bn) in enumerate(rows):
        g = _gen(1900 + seed)
        d = 16
        if kind == "sliding_window":
            arg = int(torch.randint(4, 20, (1,), generator=g))
        elif kind == "prefix_lm":
            arg = int(torch.randint(5, 25, (1,), generator=g))
        else:
            arg = _doc_ids(g, B, n, padding=kind.endswith("padding"))
        amp = 4.0 if seed == 1 else 1.0
        q, k, v = (_randn(g, B, H, n, d, scale=amp if i < 2 else 1.0) for i in range(3))
        mm = "document" if kind.startswith("document") else kind
        what = {"sliding_window": f"window={arg}", "prefix_lm": f"prefix_len={arg}"}.get(mm, "doc_ids")
        label = (f"{kind} ({what}), B={B}, H={H}, N={n}, D={d}, BLOCK_M={bm}, BLOCK_N={bn}"
                 + (", padding rows see no key" if kind.endswith("padding") else "")
                 + (", large scores" if amp > 1 else ""))
        e = _element_mask(mm, arg, B, H, n, n).reshape(B * H, n, n)
        want = _flex_reference(q, k, v, mm, arg, bm, d ** -0.5).reshape(B * H, n, d)
        q3, k3, v3 = (t.reshape(B * H, n, d) for t in (q, k, v))
        out.append(_flex_launch(label, q3, k3, v3, e, _torch_lists(mm, arg, B, H, n, n, bm), bm, bn, want))
    return out


def _flex_failure(learner, case, exc):
    """A failed launch, diagnosed further: MASK's rows read n_ctx apart (the kernel is right when they are), or
    NaN where flex_attention's output is finite."""
    if any(m.key == "out-of-bounds-load" for m in exc.mistakes):
        contiguous = {**case.buffers, "mask": {"data": case.buffers["mask"]["data"]}}
        try:
            launch(learner, dataclasses.replace(_FLEX, failure_diagnosis=None),
                   dataclasses.replace(case, buffers=contiguous))
        except Fail:
            return
        exc.mistakes = [MASK_STRIDE_IGNORED]  # its "stray" loads are MASK's own padding, read as rows
    elif not exc.mistakes and " raised " not in exc.message and not torch.isnan(case.want["o"]).any():
        got = run_guarded(learner, _FLEX.name, case.label, case.buffers, case.grid, case.args, case.constexprs,
                          ["o"])["o"]
        if torch.isnan(got).any():
            head, row = (int(i) for i in torch.isnan(got).nonzero()[0][:2])
            raise Fail(f"`flex_fwd_kernel` on {case.label}: NaN in row {row} of head {head}, where "
                       f"flex_attention's output is finite", [NAN_ROWS])


_FLEX = Kernel("flex_fwd_kernel", _flex_launches, _FLEX_MISTAKES, uses_dot=True,
               says="{n} launches match torch's flex_attention (sliding window, prefix-LM, documents, padding rows "
                    "that see nothing; ragged N)",
               budget_says="Q read once, each listed K/V block and each MASK tile of a partial block once, O written "
                           "once", stray_loads={"k": LOADS_SKIPPED, "v": LOADS_SKIPPED, "mask": MASK_FOR_FULL},
               loads_says="K and V of the blocks its lists name only, MASK of its partial blocks only",
               failure_diagnosis=_flex_failure)


# ---------------------------------------------------------------------------------------
# Part (d), the experiment: K/V bytes against density
# ---------------------------------------------------------------------------------------

_EXPERIMENT = (64, 16, 16)  # n, d, block_size


def _model_point(w, n, d, block_size):
    """(density, K/V bytes) of a correct kernel under sliding_window(w), from torch's block mask; and the
    other quantities the mistakes report."""
    lists = _torch_lists("sliding_window", w, 1, 1, n, n, block_size)
    partial, full = _dense_lists(lists, 1)
    visit = partial | full
    kv = 2 * sum(block_rows(j, block_size, n) for j in visit.nonzero()[:, 2].tolist()) * d * 4
    e = _element_mask("sliding_window", w, 1, 1, n, n)[0, 0]
    mask_bytes = int(_tiles(partial, block_size, block_size, n, n).sum())
    lists_bytes = 4 * (2 * visit.shape[1] + int(visit.sum()))
    return {"density": float(visit.float().mean()), "kv": kv, "partial_density": float(partial.float().mean()),
            "element_density": float(e.float().mean()), "dense_kv": 2 * n * d * 4 * visit.shape[1],
            "total": kv + 2 * n * d * 4 + mask_bytes + lists_bytes}


def _experiment_with(density="density", kv=lambda p: p["kv"]):
    def impl(windows, n, d, block_size, seed):
        points = [_model_point(w, n, d, block_size) for w in windows]
        return (torch.tensor([p[density] for p in points], dtype=torch.float64),
                torch.tensor([float(kv(p)) for p in points], dtype=torch.float64))
    return impl


_EXPERIMENT_MISTAKES = [
    Mistake("dense-bytes", "the bytes do not fall with the density: the kernel that was traced loads every key block "
            "(run your flex_fwd_kernel on the lists of each window)", _experiment_with(kv=lambda p: p["dense_kv"])),
    Mistake("density-of-elements", "the density is the fraction of *tiles* the kernel visits, (partial + full) / "
            "(n_qb * n_kb), not the fraction of allowed elements", _experiment_with(density="element_density")),
    Mistake("density-partial-only", "the density counts the full blocks too: (partial + full) / (n_qb * n_kb)",
            _experiment_with(density="partial_density")),
    Mistake("k-bytes-only", "the bytes are those read from K *and* V", _experiment_with(kv=lambda p: p["kv"] // 2)),
    Mistake("elements-not-bytes", "the quantity is bytes (4 per float32 element), not elements",
            _experiment_with(kv=lambda p: p["kv"] // 4)),
    Mistake("total-bytes", "the bytes are those read from K and V only (trace.by_tensor['K']['read'] + "
            "trace.by_tensor['V']['read']), not the trace's total", _experiment_with(kv=lambda p: p["total"])),
]


def _experiment_windows():
    g = _gen(2000)
    picks = torch.randperm(40, generator=g)[:4].sort().values.tolist()
    return [int(w) for w in picks]


def _measure_experiment(learner):
    """The learner's (densities, K/V bytes) against the grader's own reproduction: its trace of the learner's
    flex_fwd_kernel on each window's lists (in the interpreter), else (on a GPU) what a kernel that loads each
    listed K/V block once moves."""
    windows, (n, d, bs) = _experiment_windows(), _EXPERIMENT
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=_gen(2001)))
    label = f"windows={windows}, n={n}, d={d}, block_size={bs}, seed={seed}"
    args = (list(windows), n, d, bs, seed)
    _, _, _, got = next(each_result(learner, "bytes_against_density", [(label, args, {})]))
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise Fail(f"`bytes_against_density` on {label}: return (densities, kv_bytes), two 1-D tensors of "
                   f"len(windows) = {len(windows)}")
    got = tuple(torch.as_tensor(x, dtype=torch.float64) if not torch.is_tensor(x) else x.double() for x in got)
    dens, kv, how = [], [], "traced"
    g = _gen(2002)
    for w in windows:
        point = _model_point(w, n, d, bs)
        e = _element_mask("sliding_window", w, 1, 1, n, n).reshape(1, n, n)
        q, k, v = _randn(g, 1, n, d), _randn(g, 1, n, d), _randn(g, 1, n, d)
        case = _flex_launch(f"sliding_window(window={w}), N={n}", q, k, v, e,
                            _torch_lists("sliding_window", w, 1, 1, n, n, bs), bs, bs)
        traffic = {}
        run_guarded(learner, _FLEX.name, case.label, case.buffers, case.grid, case.args, case.constexprs, ["o"],
                    traffic=traffic)
        if not traffic:
            how = "counted"
        kv.append(float(traffic["k"]["load_bytes"] + traffic["v"]["load_bytes"]) if traffic else float(point["kv"]))
        dens.append(point["density"])
    want = (torch.tensor(dens, dtype=torch.float64), torch.tensor(kv, dtype=torch.float64))
    why = mismatch(got, want, rtol=1e-9, atol=1e-9)
    if why:
        line = case_line(label, args, {}, names=("windows", "n", "d", "block_size", "seed"))
        raise Fail(f"`bytes_against_density` on {label}: {why} (the densities must match within 1e-9, the bytes "
                   f"exactly)\n    {line}", diagnose(got, _EXPERIMENT_MISTAKES, args, {}, rtol=1e-9, atol=1e-9))
    falls = all(a >= b for a, b in zip(kv[::-1], kv[::-1][1:]))
    return (f"densities and K/V bytes of {len(windows)} windows equal the grader's {how} reproduction exactly "
            f"({', '.join(f'{x:.2f}: {int(b)} B' for x, b in zip(dens, kv))})"
            + ("" if falls else "; note: the bytes did not rise with the window"))


# flex-block-mask is a function part measured here: the lists are compared up to each count, and the order of the
# right blocks is told apart from wrong blocks
TABLES = {
    "flex-block-mask": Measured("function", _measure_block_mask, {"block_mask_for": _BLOCK_MASK_MISTAKES}),
    "block-sparse-loop": _SPARSE,
    "partial-blocks": _FLEX,
    "bytes-vs-density": Measured("experiment", _measure_experiment, {"bytes_against_density": _EXPERIMENT_MISTAKES}),
}
