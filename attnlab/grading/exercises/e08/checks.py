"""The checks of exercise 08_block_sparse (one ``@CHECKS(part id)`` per graded part)."""


import torch

from attnlab.grading.core import Fail, Mistake, Registry, check_function, gen as _gen, randn as _randn
from attnlab.grading.exercises.e07.checks import _ATTENTION_ARGS, _attention_buffers, _kernel_reference
from attnlab.grading.exercises.e08 import spec as specs
from attnlab.grading.exercises.e07.spec import attention
from attnlab.grading.kernel_check import kernel_failure, run_guarded
from attnlab.grading.agent import device as _device

CHECKS = Registry()


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


@CHECKS("block-mask-builder")
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


@CHECKS("block-mask-to-elements")
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


@CHECKS("block-sparse-loop")
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
        want = attention(q, k, v, scale=scale, mask=specs.block_to_element_mask(bmask, (bm, bn), n, n))
        kernel_failure(label, "block_sparse_fwd_kernel", got, want, _SPARSE_MISTAKES,
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
