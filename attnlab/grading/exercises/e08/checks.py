"""The checks of exercise 08_block_sparse, one table per graded part in ``TABLES``: against PyTorch's FlexAttention,
run eagerly on the CPU, and attnlab's ``block_sparse_reference``; the kernels' launches also say which K/V blocks and
MASK tiles each program may load (``Launch.allowed``), besides a byte budget per buffer."""

import dataclasses
import warnings
from unittest import mock

import torch
import torch.nn.attention.flex_attention as flex

from attnlab.attention import block_sparse_reference, scaled_dot_product_attention
from attnlab.grading.core import (Fail, Mistake, case_line, clone, diagnose, each_result, gen, learner_of, mismatch,
                                  mistakes, present, randn, table, value_of)
from attnlab.grading.engine import Kernel, Launch, Measured, launch
from attnlab.grading.exercises.e08 import spec as specs
from attnlab.grading.kernel_check import (attention_budget, attention_launch, block_rows, blocks_allowed, cdiv,
                                          run_guarded)
from attnlab.mask_mods import MASK_MODS

LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def _element_mask(kind, arg, B, H, Nq, Nk):
    return flex.create_mask(MASK_MODS[kind](arg), B, H, Nq, Nk, device="cpu").expand(B, H, Nq, Nk).clone()


def _torch_block_mask(kind, arg, B, H, Nq, Nk, block_size):
    with warnings.catch_warnings(record=True):  # recorded, not shown
        return flex.create_block_mask(MASK_MODS[kind](arg), B, H, Nq, Nk, device="cpu",
                                      BLOCK_SIZE=specs.block_sizes(block_size))


def _torch_lists(*args):
    return tuple(getattr(_torch_block_mask(*args), name) for name in LISTS)


def _flex_reference(q, k, v, kind, arg, block_size, scale):
    """torch's flex_attention (eager, CPU) on q, k, v (B, H, N, D). ``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` runs it
    without dynamo's tracing (a second or more per mask), forward only (tests/test_exercise_08.py: both agree)."""
    bm = _torch_block_mask(kind, arg, *q.shape[:3], q.shape[2], block_size)
    with mock.patch.object(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True), warnings.catch_warnings(record=True):
        return flex.flex_attention(q, k, v, block_mask=bm, scale=scale)


def _mask_arg(g, kind, B, N, lengths, padding=False):
    """A mask_mod's argument drawn from ``g``: a length in ``lengths[kind]`` (low, high + 1), or sorted document ids
    (B, N), a few documents of random lengths per row (-1 on the last 5 positions with ``padding``)."""
    if kind != "document":
        return int(torch.randint(*lengths[kind], (1,), generator=g))
    cuts = torch.rand(B, N, generator=g) < 0.12
    cuts[:, 0] = False
    ids = cuts.long().cumsum(-1)
    if padding:
        ids[:, N - 5:] = -1
    return ids


# ----------------------------------------------------------------------------- flex-block-mask
def _normalised(lists):
    """The four lists as int64, the padding past each count replaced by -1."""
    kn, ki, fn, fi = (torch.as_tensor(t).long() for t in lists)
    cols = torch.arange(ki.shape[-1])
    return kn, torch.where(cols < kn[..., None], ki, -1), fn, torch.where(cols < fn[..., None], fi, -1)


def _read_lists(got, label):
    """The learner's four tensors, or Fail saying what the contract asks for."""
    n = len(got) if isinstance(got, (tuple, list)) else None
    wrong = (f"got {type(got).__name__}" + (f" of {n} values" if n is not None else "") if n != 4 else next((
        f"value {i} is " + (f"a tensor of {t.dtype}" if torch.is_tensor(t) else type(t).__name__)
        for i, t in enumerate(got) if not torch.is_tensor(t) or t.dtype.is_floating_point or t.dtype == torch.bool
        or t.is_complex()), None))
    if not wrong and ([t.dim() for t in got] != [3, 4, 3, 4] or got[1].shape[:3] != got[0].shape
                      or got[3].shape[:3] != got[2].shape):
        wrong = "returned shapes " + ", ".join(str(tuple(t.shape)) for t in got)
    if wrong:
        raise Fail(f"`create_block_mask` on {label}: {wrong}; create_block_mask must return ({', '.join(LISTS)}): "
                   f"integer tensors (B, H, n_qb), (B, H, n_qb, n_kb), (B, H, n_qb), (B, H, n_qb, n_kb)")
    return got


def _block_mask_cases():
    g = gen(1800)
    # (kind, B, H, Nq, Nk, block_size): a square case first (so a transposed answer keeps its shape)
    args = [(kind, _mask_arg(g, kind, B, Nq, {"sliding_window": (3, 12), "prefix_lm": (5, 20)}), B, H, Nq, Nk, bs)
            for kind, B, H, Nq, Nk, bs in [
                ("sliding_window", 1, 2, 40, 40, 8), ("sliding_window", 2, 1, 37, 50, (16, 8)),
                ("prefix_lm", 2, 2, 45, 45, (8, 16)), ("prefix_lm", 1, 1, 33, 20, 8), ("document", 2, 1, 45, 45, 8),
                ("document", 3, 2, 32, 32, (16, 8))]]
    return [(f"{kind}({f'doc_ids {tuple(arg.shape)}' if kind == 'document' else arg}), B={B}, H={H}, Nq={Nq}, "
             f"Nk={Nk}, block_size={bs}", (kind, arg, B, H, Nq, Nk, bs), {}) for kind, arg, B, H, Nq, Nk, bs in args]


def _lists_with(pad=False, transposed=False, rule="right", floor=False, edge=False, ragged_full=False):
    """A wrong create_block_mask (normalised lists), from the element mask."""
    def impl(kind, arg, B, H, Nq, Nk, block_size):
        bq, bk = specs.block_sizes(block_size)
        if transposed and (Nq != Nk or bq != bk):
            raise ValueError("only square")
        e, nqb, nkb = _element_mask(kind, arg, B, H, Nq, Nk), cdiv(Nq, bq), cdiv(Nk, bk)
        m = torch.full((B, H, nqb * bq, nkb * bk), pad, dtype=torch.bool)
        m[..., :Nq, :Nk] = e.transpose(-2, -1) if transposed else e
        if edge:  # tile (i, j) also takes row (i + 1) * BQ and column (j + 1) * BK of the next blocks
            tiles = [[m[..., i * bq:(i + 1) * bq + 1, j * bk:(j + 1) * bk + 1] for j in range(nkb)] for i in range(nqb)]
            count = torch.stack([torch.stack([t.sum((-2, -1)) for t in row], -1) for row in tiles], -2)
            full_size = torch.tensor([[t.shape[-2] * t.shape[-1] for t in row] for row in tiles])
        else:
            count, full_size = m.view(B, H, nqb, bq, nkb, bk).sum((3, 5)), bq * bk
        if ragged_full:  # a tile is "full" when all of its positions inside the sequence are allowed
            full_size = (torch.clamp(Nq - torch.arange(nqb) * bq, max=bq)[:, None]
                         * torch.clamp(Nk - torch.arange(nkb) * bk, max=bk)[None, :])
        if floor:
            count = count[..., :Nq // bq, :Nk // bk]
        some, full, none = count > 0, count == full_size, torch.zeros_like(count, dtype=torch.bool)
        partial, full = {"right": (some & ~full, full), "full-means-any": (none, some), "all-partial": (some, none),
                         "full-dropped": (some & ~full, none), "partial-includes-full": (some, full)}[rule]
        return _normalised((*specs.block_lists(partial), *specs.block_lists(full)))
    return impl


_BLOCK_MASK_MISTAKES = mistakes(_lists_with, [
    ("transposed-block-mask", "the block mask is transposed: rows are query blocks, columns key blocks (q_idx "
     "along dim -2, kv_idx along dim -1)", {"transposed": True}),
    ("off-by-one-block-edge", "off by one at the block edge: tile (i, j) is rows i*BQ ... (i+1)*BQ - 1 and columns "
     "j*BK ... (j+1)*BK - 1", {"edge": True}),
    ("partial-treated-as-full", "a tile with only some allowed elements is partial: full means all BQ x BK allowed",
     {"rule": "full-means-any"}),
    ("full-treated-as-partial", "no block is full: a tile with all BQ x BK elements allowed goes into "
     "full_kv_num_blocks / full_kv_indices", {"rule": "all-partial"}),
    ("full-treated-as-empty", "the full blocks are missing: list a tile with all elements allowed in full_kv_indices",
     {"rule": "full-dropped"}),
    ("partial-lists-include-full", "kv_num_blocks / kv_indices list the partial blocks only: a full block goes in "
     "the full lists alone", {"rule": "partial-includes-full"}),
    *[("ragged-tail-full", "positions past Nq or Nk count as masked out (pad with False), so a ragged last tile is "
       "partial, never full: a full tile is visited with no mask, not even the sequence's end", change)
      for change in ({"pad": True}, {"ragged_full": True})],
    ("ragged-tail-dropped", "the block counts round up, n_qb = ceil(Nq / BQ), n_kb = ceil(Nk / BK): the ragged last "
     "block counts", {"floor": True})])


def _measure_block_mask(learner):
    """The learner's create_block_mask (through block_mask_for) against torch's lists, up to each count."""
    learner, cases = learner_of(learner), _block_mask_cases()
    present(learner.call("create_block_mask", []), "create_block_mask")  # NotDone unless it is defined
    reply = learner.call("block_mask_for", [[clone(args), {}] for _, args, _ in cases])
    present(reply, "block_mask_for")
    results = reply.get("results", [])
    for i, (label, args, _) in enumerate(cases):
        if i >= len(results):
            raise Fail(f"`create_block_mask`: the grader got no result for {label}")
        # what it returned, or raised, is create_block_mask's: block_mask_for is the notebook's given wrapper
        got = _normalised(_read_lists(value_of(results[i], "create_block_mask", label), label))
        want = _normalised(_torch_lists(*args))
        why = mismatch(got, want)
        if not why:
            continue
        in_order = [[t.sort(-1).values if t.dim() == 4 else t for t in lists] for lists in (got, want)]
        if all(g.shape == w.shape for g, w in zip(got, want)) and not mismatch(*in_order):
            raise Fail(f"`create_block_mask` on {label}: the right blocks, in another order: list each query block's "
                       f"key blocks in increasing order, as FlexAttention does")
        which = next(n for n, g, w in zip(LISTS, got, want) if mismatch(g, w))
        line = case_line(label, args, {}, names=("kind", "arg", "B", "H", "Nq", "Nk", "block_size"))
        raise Fail(f"`create_block_mask` on {label}: {why} ({which}; entries past each count are shown as -1 and not "
                   f"compared)\n    {line}", diagnose(got, _BLOCK_MASK_MISTAKES, args, {}))
    return (f"{len(cases)} block masks (sliding window, prefix-LM, document; ragged lengths, Nq != Nk, "
            f"BQ != BK) equal torch's create_block_mask")


# ----------------------------------------------------------------------------- the kernels: launches, what they load
def _tiles(x, bm, bn, n_q, n_k):
    """Expand a bool (..., n_qb, n_kb) to (..., n_q, n_k): element (i, j) is block (i // bm, j // bn)'s."""
    return x.repeat_interleave(bm, -2).repeat_interleave(bn, -1)[..., :n_q, :n_k]


def _launch(label, q, k, v, scale, bm, bn, want, visit=None, mask_mod=None):
    """One launch on (BH, N, D) inputs in sentinel memory, 16 extra rows per head: block_sparse_fwd_kernel's on the
    lists of ``visit`` (BH, n_qb, n_kb), or flex_fwd_kernel's on torch's lists of ``mask_mod`` (kind, arg, B, H) and
    its element mask MASK (BH, N, N) in int8, rows 3 rows and 5 columns further apart than they are long. A program
    may load Q once, K and V of each listed block once, MASK of its rows of its partial blocks; it writes O once."""
    bh, n, d = q.shape
    tensors, strides = {"q": q, "k": k, "v": v, "o": q.shape}, ["o"]
    if mask_mod is None:
        lists, inputs = specs.block_lists(visit), (q, k, v, scale, visit, bm, bn)
        names = ("Q", "K", "V", "scale", "visited blocks", "BLOCK_M", "BLOCK_N")
    else:
        lists, mask = _torch_lists(*mask_mod, n, n, (bm, bn)), _element_mask(*mask_mod, n, n).reshape(bh, n, n)
        partial, full = _dense_lists(lists, bh)
        visit, lists = partial | full, [t.reshape(bh, *t.shape[2:]).to(torch.int32).contiguous() for t in lists]
        inputs = (q, k, v, scale, mask, partial, full, bm, bn)
        names = ("Q", "K", "V", "scale", "MASK", "partial blocks", "full blocks", "BLOCK_M", "BLOCK_N")
        tensors["mask"], strides = mask.to(torch.int8), ["o", "mask"]
    allowed = dict.fromkeys("kv", blocks_allowed(visit, bn, q.shape))
    budget = attention_budget(q.shape, sum(block_rows(j, bn, n) for j in visit.nonzero()[:, 2].tolist()))
    if mask_mod is not None:  # MASK: a program's own rows of its partial blocks
        tp, heads, rows = _tiles(partial, bm, bn, n, n), torch.arange(bh)[:, None, None], torch.arange(n)[:, None] // bm
        allowed["mask"] = lambda program: tp & (heads == program[1]) & (rows == program[0])
        budget["mask"] = (int(tp.sum()), 0)
    nqb, nkb = lists[1].shape[-2:]
    buffers, args = attention_launch(tensors, {**dict.fromkeys("qkvo", 16), "mask": (3, 5)}, strides,
                                     [n, nqb, nkb, scale], lists)
    return Launch(label, buffers, (nqb, bh), args, {"HEAD_DIM": d, "BLOCK_M": bm, "BLOCK_N": bn}, {"o": want},
                  inputs, names, budget, allowed)


LOADS_SKIPPED = Mistake("loads-skipped-blocks", "K/V blocks the lists leave out are loaded (dense traffic): for i in "
                        "range(0, num): j = tl.load(indices + ...), then load K and V of block j only", None)


# ----------------------------------------------------------------------------- block-sparse-loop
def _sparse_with(visit=None, rescale=True, nan_empty=False, mask_tail=True, scale_ignored=False):
    """A wrong block-skipping loop in PyTorch; ``visit(vis)``: the blocks it visits instead of the listed ``vis``."""
    def impl(q, k, v, scale, vis, bm, bn):
        bh, n, d = q.shape
        scale = d ** -0.5 if scale_ignored else scale
        vis = vis if visit is None else visit(vis)
        n_k = n if mask_tail else cdiv(n, bn) * bn  # keys past N loaded as 0 and scored 0: they join the softmax
        k, v = (torch.cat([t, t.new_zeros(bh, n_k - n, t.shape[-1])], dim=1) for t in (k, v))
        mask = _tiles(vis, bm, bn, n, n_k)
        if rescale:
            out = scaled_dot_product_attention(q[None], k[None], v[None], mask=mask[None], scale=scale)[0]
            return out.masked_fill(~mask.any(-1)[..., None], float("nan")) if nan_empty else out
        # acc not rescaled: block b's weights stay relative to the running max after block b, l to the last max
        s = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~mask, float("-inf"))
        s = torch.nn.functional.pad(s, (0, -s.shape[-1] % bn), value=float("-inf"))
        m = s.unflatten(-1, (-1, bn)).amax(-1).cummax(-1).values          # (BH, N, n_blocks): the max after each block
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m.repeat_interleave(bn, -1))
        l = torch.exp(s - m[..., -1:]).sum(-1, keepdim=True)  # noqa: E741
        return (p @ torch.nn.functional.pad(v, (0, 0, 0, p.shape[-1] - v.shape[1]))) / torch.where(l > 0, l, 1.0)
    return impl


_SPARSE_MISTAKES = mistakes(_sparse_with, [
    ("list-ignored", "every key block is visited (dense attention): visit only the kv_num_blocks[row] blocks of "
     "kv_indices[row]", {"visit": torch.ones_like}),
    ("counter-as-block-index", "block i is visited instead of j = kv_indices[row, i]: load j from the list",
     {"visit": lambda vis: torch.arange(vis.shape[-1]) < vis.sum(-1, keepdim=True)}),
    ("head-offset-forgotten", "every head reads head 0's lists: row (pid_h, pid_m) of the lists is "
     "pid_h * n_qb + pid_m", {"visit": lambda vis: vis[:1].expand_as(vis)}),
    ("acc-not-rescaled", "acc is not rescaled when the running max grows: acc = acc * alpha[:, None] + tl.dot(p, v)",
     {"rescale": False}),
    ("fully-masked-row", "an empty list gives NaN (0 / 0): divide by tl.where(l_i > 0, l_i, 1.0)", {"nan_empty": True}),
    ("tail-not-masked", "keys past n_ctx join the softmax: in the ragged last block, tl.where(offs_n[None, :] < "
     "n_ctx, s, float('-inf'))", {"mask_tail": False}),
    ("count-off-by-one", "the last listed block is skipped: visit i = 0 ... kv_num_blocks[row] - 1, range(0, num)",
     {"visit": lambda vis: vis & (vis.cumsum(-1) < vis.sum(-1, keepdim=True))}),
    ("scale-argument-ignored", "multiply the scores by `scale`, not 1/sqrt(HEAD_DIM)", {"scale_ignored": True})])


def _sparse_launch(g, bh, n, d, bm, bn, kind, scale):
    amp = 6.0 if kind == "large scores" else 1.0
    q, k, v = randn(g, bh, n, d, scale=amp), randn(g, bh, n, d, scale=amp), randn(g, bh, n, d)
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
    want = block_sparse_reference(q[None], k[None], v[None], visit[None], (bm, bn), scale=scale)[0]
    return _launch(f"BH={bh}, N={n}, D={d}, BLOCK_M={bm}, BLOCK_N={bn}, {kind} block lists, scale={scale}",
                   q, k, v, scale, bm, bn, want, visit)


# (BH, N, D, BLOCK_M, BLOCK_N, lists, scale): not only 1/sqrt(D), the kernel must use its scale argument
_SPARSE = Kernel("block_sparse_fwd_kernel", lambda: table(1700, [
                     (2, 48, 16, 16, 16, "random", 0.25), (2, 40, 16, 32, 16, "window", 0.6),
                     (2, 40, 16, 16, 16, "empty row", 0.4), (1, 64, 16, 16, 16, "large scores", 0.15)], _sparse_launch),
                 _SPARSE_MISTAKES, uses_dot=True,
                 says="{n} launches match block_sparse_reference (random, windowed and empty lists, ragged N)",
                 budget_says="Q read once, each listed K/V block once per query block that lists it, O written once",
                 stray_loads=dict.fromkeys("kv", LOADS_SKIPPED), loads_says="K and V of the blocks its lists name only")


# ----------------------------------------------------------------------------- partial-blocks
def _flex_with(rule="right", after_softmax=False, transposed=False):
    """A wrong flex forward in PyTorch: q, k, v (BH, N, D); e (BH, N, N) element mask; partial/full (BH, n_qb, n_kb)."""
    def impl(q, k, v, scale, e, partial, full, bm, bn):
        n = q.shape[1]
        tp, tf = _tiles(partial, bm, bn, n, n), _tiles(full, bm, bn, n, n)
        inner = e.transpose(-2, -1) if transposed else e
        mask = {"right": (inner & tp) | tf, "partial-as-full": tp | tf, "full-as-empty": inner & tp,
                "partial-skipped": tf}[rule]
        if after_softmax:  # the normaliser sums over every visited element, the masked ones too
            _, w = scaled_dot_product_attention(q[None], k[None], v[None], mask=(tp | tf)[None], scale=scale,
                                                return_weights=True)
            return (w[0] * mask) @ v
        return scaled_dot_product_attention(q[None], k[None], v[None], mask=mask[None], scale=scale)[0]
    return impl


_FLEX_MISTAKES = mistakes(_flex_with, [
    ("partial-treated-as-full", "the element mask is not applied in partial blocks: load a partial block's MASK tile "
     "and set the scores it forbids to -inf", {"rule": "partial-as-full"}),
    ("full-treated-as-empty", "the full blocks are not visited: walk full_kv_num_blocks / full_kv_indices too, "
     "without the mask", {"rule": "full-as-empty"}),
    ("partial-treated-as-empty", "the partial blocks are not visited: walk kv_num_blocks / kv_indices too, with the "
     "mask", {"rule": "partial-skipped"}),
    ("mask-after-softmax", "the mask is applied after the exponentials, so masked scores count in the running max "
     "and in l: set them to -inf before tl.max and tl.exp", {"after_softmax": True}),
    ("transposed-mask-tile", "the MASK tile is read transposed: rows are queries (offs_m[:, None] * stride_mq), "
     "columns keys (offs_n[None, :])", {"transposed": True})])
NAN_ROWS = Mistake("fully-masked-rows-nan", "NaN where the output is finite: a row with no allowed key keeps m_new = "
                   "-inf, and exp(-inf - (-inf)) is NaN. Subtract m_safe = tl.where(m_new == float('-inf'), 0.0, "
                   "m_new) in both exps, and divide by tl.where(l_i > 0, l_i, 1.0) at the end", None)
MASK_FOR_FULL = Mistake("mask-loaded-for-full-blocks", "the kernel reads MASK outside its partial blocks: a full "
                        "block's mask is all True, so load the MASK tile only for the blocks of kv_indices", None)
MASK_STRIDE_IGNORED = Mistake("mask-stride-ignored", "MASK's rows are addressed with n_ctx instead of their stride: "
                              "row q starts at MASK + pid_h * stride_mh + q * stride_mq", None)


def _dense_lists(lists, bh):
    """partial, full: bool (BH, n_qb, n_kb) from torch's lists."""
    _, ki, _, fi = _normalised(lists)
    return [(i[..., None] == torch.arange(i.shape[-1])).any(-2).reshape(bh, -1, i.shape[-1]) for i in (ki, fi)]


def _flex_launch(g, kind, B, H, n, bm, bn, amp):
    d, mm, padding = 16, kind.split()[0], kind.endswith("padding")
    arg = _mask_arg(g, mm, B, n, {"sliding_window": (4, 20), "prefix_lm": (5, 25)}, padding)
    q, k, v = (randn(g, B, H, n, d, scale=amp if i < 2 else 1.0) for i in range(3))
    what = {"sliding_window": f"window={arg}", "prefix_lm": f"prefix_len={arg}"}.get(mm, "doc_ids")
    label = (f"{kind} ({what}), B={B}, H={H}, N={n}, D={d}, BLOCK_M={bm}, BLOCK_N={bn}"
             + (", padding rows see no key" if padding else "") + (", large scores" if amp > 1 else ""))
    want = _flex_reference(q, k, v, mm, arg, bm, d ** -0.5).reshape(B * H, n, d)
    q3, k3, v3 = (t.reshape(B * H, n, d) for t in (q, k, v))
    return _launch(label, q3, k3, v3, d ** -0.5, bm, bn, want, mask_mod=(mm, arg, B, H))


def _flex_failure(learner, case, exc):
    """A failed launch, diagnosed further: MASK's rows read n_ctx apart, or NaN where flex_attention's is finite."""
    if any(m.key == "out-of-bounds-load" for m in exc.mistakes):
        contiguous = dataclasses.replace(case, buffers={**case.buffers, "mask": {"data": case.buffers["mask"]["data"]}})
        try:
            launch(learner, dataclasses.replace(_FLEX, failure_diagnosis=None), contiguous)
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


# (mask, B, H, N, BLOCK_M, BLOCK_N, the amplitude of q and k)
_FLEX = Kernel("flex_fwd_kernel", lambda: table(1900, [
                   ("sliding_window", 1, 2, 50, 16, 16, 1.0), ("prefix_lm", 2, 1, 40, 16, 16, 4.0),
                   ("document", 2, 1, 45, 16, 16, 1.0), ("document with padding", 1, 2, 37, 16, 16, 1.0)],
                   _flex_launch), _FLEX_MISTAKES, uses_dot=True,
               says="{n} launches match torch's flex_attention (sliding window, prefix-LM, documents, padding rows "
                    "that see nothing; ragged N)",
               budget_says="Q read once, each listed K/V block and each partial block's MASK tile once, O written once",
               stray_loads={"k": LOADS_SKIPPED, "v": LOADS_SKIPPED, "mask": MASK_FOR_FULL},
               loads_says="K and V of the blocks its lists name only, MASK of its partial blocks only",
               failure_diagnosis=_flex_failure)


# ----------------------------------------------------------------------------- bytes-vs-density
def _model_point(w, n, d, block_size):
    """A correct kernel's density and K/V bytes under sliding_window(w), and what the mistakes report instead."""
    partial, full = _dense_lists(_torch_lists("sliding_window", w, 1, 1, n, n, block_size), 1)
    visit = partial | full
    kv = 2 * sum(block_rows(j, block_size, n) for j in visit.nonzero()[:, 2].tolist()) * d * 4
    extra = (2 * n * d * 4 + int(_tiles(partial, block_size, block_size, n, n).sum())  # Q and O, MASK's tiles, lists
             + 4 * (2 * visit.shape[1] + int(visit.sum())))
    return {"density": float(visit.float().mean()), "kv": kv, "partial_density": float(partial.float().mean()),
            "element_density": float(_element_mask("sliding_window", w, 1, 1, n, n).float().mean()),
            "dense_kv": 2 * n * d * 4 * visit.shape[1], "total": kv + extra}


def _experiment_with(density="density", kv=lambda p: p["kv"]):
    def impl(windows, n, d, block_size, seed):
        points = [_model_point(w, n, d, block_size) for w in windows]
        return (torch.tensor([p[density] for p in points], dtype=torch.float64),
                torch.tensor([float(kv(p)) for p in points], dtype=torch.float64))
    return impl


_EXPERIMENT_MISTAKES = mistakes(_experiment_with, [
    ("dense-bytes", "the bytes do not fall with the density, as if every key block were loaded: run your "
     "flex_fwd_kernel on the lists of each window", {"kv": lambda p: p["dense_kv"]}),
    ("density-of-elements", "the density is the fraction of *tiles* visited, (partial + full) / (n_qb * n_kb), not "
     "of allowed elements", {"density": "element_density"}),
    ("density-partial-only", "the density counts the full blocks too: (partial + full) / (n_qb * n_kb)",
     {"density": "partial_density"}),
    ("k-bytes-only", "the bytes are those read from K *and* V", {"kv": lambda p: p["kv"] // 2}),
    ("elements-not-bytes", "count bytes (4 per float32 element), not elements", {"kv": lambda p: p["kv"] // 4}),
    ("total-bytes", "the bytes are K's and V's only (trace.by_tensor['K']['read'] + trace.by_tensor['V']['read']), "
     "not the trace's total", {"kv": lambda p: p["total"]})])


def _windows(n, block_size):
    """4 sorted windows in 0 ... n - block_size - 1 from the salt, at least a block apart. sliding_window(w) visits
    ceil(w / block_size) key blocks left of the diagonal (at most n / block_size - 1), so no two of them visit the
    same tiles: the 4 points differ, and which 4 of the n / block_size possible ones they are is the salt's."""
    picks = torch.randperm(n - block_size - 3 * (block_size - 1), generator=gen(2000))[:4].sort().values
    return [int(x) + i * (block_size - 1) for i, x in enumerate(picks.tolist())]


def _traced_kv(learner, g, w, n, d, bs):
    """The K/V bytes the learner's flex_fwd_kernel loads on sliding_window(w)'s lists; None untraced (on a GPU)."""
    q, k, v = randn(g, 1, n, d), randn(g, 1, n, d), randn(g, 1, n, d)
    case = _launch(f"sliding_window(window={w}), N={n}", q, k, v, d ** -0.5, bs, bs, None,
                   mask_mod=("sliding_window", w, 1, 1))
    traffic = {}
    run_guarded(learner, _FLEX.name, case.label, case.buffers, case.grid, case.args, case.constexprs, ["o"],
                traffic=traffic)
    return float(traffic["k"]["load_bytes"] + traffic["v"]["load_bytes"]) if traffic else None


def _measure_experiment(learner):
    """The learner's (densities, K/V bytes) against the grader's trace of the learner's flex_fwd_kernel on each
    window's lists (in the interpreter), else (on a GPU) what a kernel that loads each listed K/V block once moves."""
    n, d, bs = 128, 16, 16
    windows, seed = _windows(n, bs), int(torch.randint(0, 2**31 - 1, (1,), generator=gen(2001)))
    label, args = f"windows={windows}, n={n}, d={d}, block_size={bs}, seed={seed}", (list(windows), n, d, bs, seed)
    _, _, _, got = next(each_result(learner, "bytes_against_density", [(label, args, {})]))
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise Fail(f"`bytes_against_density` on {label}: return (densities, kv_bytes), two 1-D tensors of "
                   f"len(windows) = {len(windows)}")
    got = tuple(torch.as_tensor(x, dtype=torch.float64) if not torch.is_tensor(x) else x.double() for x in got)
    g, points = gen(2002), [_model_point(w, n, d, bs) for w in windows]
    traced = [_traced_kv(learner, g, w, n, d, bs) for w in windows]
    dens, kv = [p["density"] for p in points], [float(p["kv"]) if t is None else t for p, t in zip(points, traced)]
    why = mismatch(got, tuple(torch.tensor(x, dtype=torch.float64) for x in (dens, kv)), rtol=1e-9, atol=1e-9)
    if why:
        line = case_line(label, args, {}, names=("windows", "n", "d", "block_size", "seed"))
        raise Fail(f"`bytes_against_density` on {label}: {why} (the densities must match within 1e-9, the bytes "
                   f"exactly)\n    {line}", diagnose(got, _EXPERIMENT_MISTAKES, args, {}, rtol=1e-9, atol=1e-9))
    return (f"densities and K/V bytes of {len(windows)} windows equal the grader's "
            f"{'counted' if None in traced else 'traced'} reproduction exactly "
            f"({', '.join(f'{x:.2f}: {int(b)} B' for x, b in zip(dens, kv))})"
            + ("" if kv == sorted(kv) else "; note: the bytes did not rise with the window"))


TABLES = {
    "flex-block-mask": Measured("function", _measure_block_mask, {"block_mask_for": _BLOCK_MASK_MISTAKES}),
    "block-sparse-loop": _SPARSE,
    "partial-blocks": _FLEX,
    "bytes-vs-density": Measured("experiment", _measure_experiment, {"bytes_against_density": _EXPERIMENT_MISTAKES}),
}
