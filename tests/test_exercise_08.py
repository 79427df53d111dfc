"""Exercise 08 (block sparsity, FlexAttention-style): wrong implementations, written the way a learner would,
fail their check with the matching diagnosis; shortcuts are refused; and the references the checks use
(PyTorch's create_block_mask and flex_attention, eager on the CPU) agree with attnlab's."""

import os
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as flex
import triton
import triton.language as tl

from attnlab._interp_hooks import interpreter_session
from attnlab.attention import scaled_dot_product_attention
from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.exercises.e08 import checks as e08, spec
from attnlab.mask_mods import MASK_MODS, document, prefix_lm, sliding_window
from attnlab.memory import trace
from mistakes import Wrong, variant as _variant

WRONG = Wrong()


# ---------------------------------------------------------------------------------------
# Part 1: create_block_mask
# ---------------------------------------------------------------------------------------

# the known mistakes of flex-block-mask are proven by the check's own emulations (tests/test_every_mistake.py)

def _create(unsorted=False):
    """A learner's create_block_mask; ``unsorted``: the block indices listed in decreasing order."""
    def create_block_mask(mask_mod, B, H, Nq, Nk, block_size):
        bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
        nqb, nkb = -(-Nq // bq), -(-Nk // bk)
        b, h = torch.arange(B)[:, None, None, None], torch.arange(H)[None, :, None, None]
        m = mask_mod(b, h, torch.arange(Nq)[None, None, :, None], torch.arange(Nk)[None, None, None, :])
        m = m.expand(B, H, *m.shape[-2:])
        allowed = torch.zeros((B, H, nqb * bq, nkb * bk), dtype=torch.bool)  # past Nq or Nk: masked out
        allowed[..., :m.shape[-2], :m.shape[-1]] = m
        count = torch.zeros(B, H, nqb, nkb, dtype=torch.long)
        full = torch.zeros(B, H, nqb, nkb, dtype=torch.bool)
        for i in range(nqb):
            for j in range(nkb):
                tile = allowed[..., i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
                count[..., i, j] = tile.sum((-2, -1))
                full[..., i, j] = tile.all(-1).all(-1)
        partial = (count > 0) & ~full

        def lists(kind):
            num = kind.sum(-1).to(torch.int32)
            idx = torch.zeros(kind.shape, dtype=torch.int32)
            for pos in torch.cartesian_prod(*[torch.arange(s) for s in kind.shape[:-1]]).tolist():
                found = kind[tuple(pos)].nonzero().flatten()
                if unsorted:
                    found = found.flip(0)
                idx[tuple(pos)][:len(found)] = found.to(torch.int32)
            return num, idx

        return (*lists(partial), *lists(full))
    return create_block_mask


def _with(create):
    def block_mask_for(kind, arg, B, H, Nq, Nk, block_size):
        return create(MASK_MODS[kind](arg), B, H, Nq, Nk, block_size)
    return {"create_block_mask": create, "block_mask_for": block_mask_for}


def test_a_learner_style_create_block_mask_passes_and_unsorted_indices_are_named():
    assert run_check("flex-block-mask", LocalLearner(_with(_create()), forbidden=[])).passed
    result = run_check("flex-block-mask", LocalLearner(_with(_create(unsorted=True)), forbidden=[]))
    assert not result.passed and "increasing order" in result.message


def test_calling_torch_s_create_block_mask_is_a_shortcut():
    def create_block_mask(mask_mod, B, H, Nq, Nk, block_size):
        bm = flex.create_block_mask(mask_mod, B, H, Nq, Nk, device="cpu", BLOCK_SIZE=block_size)
        return bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices

    result = run_check("flex-block-mask", LocalLearner(_with(create_block_mask)))
    assert not result.passed and "shortcut" in result.diagnosis, result.message


def test_the_spec_s_create_block_mask_equals_torch_s_on_every_case():
    for label, args, _ in e08._block_mask_cases():
        kind, arg, *shape = args
        got = e08._normalised(spec.create_block_mask(MASK_MODS[kind](arg), *shape))
        want = e08._normalised(e08._torch_lists(*args))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), label


def test_the_mask_mods_work_on_scalars_and_on_broadcast_grids():
    docs = torch.tensor([[0, 0, 1, 1, 1, -1]])
    for mm in (sliding_window(2), prefix_lm(3), document(docs)):
        grid = mm(torch.arange(1)[:, None, None, None], torch.arange(1)[None, :, None, None],
                  torch.arange(6)[None, None, :, None], torch.arange(6)[None, None, None, :])
        assert torch.equal(grid.expand(1, 1, 6, 6), flex.create_mask(mm, 1, 1, 6, 6, device="cpu"))
    with pytest.raises(ValueError, match="window"):
        sliding_window(-1)
    with pytest.raises(TypeError, match="doc_ids"):
        document([0, 1])


# ---------------------------------------------------------------------------------------
# Part 2: the block-skipping loop (the mistake switches are globals of the kernel's code)
# ---------------------------------------------------------------------------------------

@triton.jit
def _loop_body(Q, K, V, O, kv_num_blocks, kv_indices, stride_h, stride_n, n_ctx, n_qb, n_kb, scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    base = pid_h * stride_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * stride_n + offs_d[None, :], mask=offs_m[:, None] < n_ctx, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    row = pid_m if HEAD_ZERO else pid_h * n_qb + pid_m
    num = tl.load(kv_num_blocks + row)
    stop = num - 1 if DROP_LAST else num
    if not USE_LIST or LOAD_ALL:
        stop = n_kb
    for i in range(0, stop):
        if COUNTER_AS_INDEX or not USE_LIST or LOAD_ALL:
            j = i
        else:
            j = tl.load(kv_indices + row * n_kb + i)
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx, other=0.0)
        if LOAD_TWICE:
            k = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx,
                        other=0.0)
        v = tl.load(V + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=offs_n[:, None] < n_ctx, other=0.0)
        if SCALE_ARG:
            s = tl.dot(q, tl.trans(k)) * scale
        else:
            s = tl.dot(q, tl.trans(k)) * (1.0 / HEAD_DIM ** 0.5)  # 1/sqrt(d) written in
        if MASK_TAIL:
            s = tl.where(offs_n[None, :] < n_ctx, s, float("-inf"))
        if LOAD_ALL:  # every block loaded, the unlisted ones masked to -inf afterwards
            listed = 0
            for t in range(0, num):
                listed = listed | (tl.load(kv_indices + row * n_kb + t) == j).to(tl.int32)
            s = tl.where(listed != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if RESCALE:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        else:
            acc = acc + tl.dot(p, v)
        m_i = m_new
    if GUARD_EMPTY:
        l_i = tl.where(l_i > 0, l_i, 1.0)
    tl.store(O + base + offs_m[:, None] * stride_n + offs_d[None, :], acc / l_i[:, None], mask=offs_m[:, None] < n_ctx)


_LOOP_OK = dict(HEAD_ZERO=False, DROP_LAST=False, USE_LIST=True, LOAD_ALL=False, COUNTER_AS_INDEX=False,
                LOAD_TWICE=False, MASK_TAIL=True, RESCALE=True, GUARD_EMPTY=True, SCALE_ARG=True)


def _loop(**flags):
    return _variant(_loop_body, **{**_LOOP_OK, **flags})


for _key, _flags in [("list-ignored", {"USE_LIST": False}), ("counter-as-block-index", {"COUNTER_AS_INDEX": True}),
                     ("head-offset-forgotten", {"HEAD_ZERO": True}), ("acc-not-rescaled", {"RESCALE": False}),
                     ("fully-masked-row", {"GUARD_EMPTY": False}), ("tail-not-masked", {"MASK_TAIL": False}),
                     ("count-off-by-one", {"DROP_LAST": True}), ("loads-skipped-blocks", {"LOAD_ALL": True}),
                     ("extra-traffic", {"LOAD_TWICE": True}), ("scale-argument-ignored", {"SCALE_ARG": False})]:
    WRONG.add("block-sparse-loop", _key, block_sparse_fwd_kernel=_loop(**_flags))


class _FakeKernel:
    """kernel[grid](...) that computes in PyTorch: not a Triton kernel."""

    def __getitem__(self, grid):
        def run(q, k, v, o, *args, **kwargs):
            o.copy_(scaled_dot_product_attention(q[None], k[None], v[None])[0])
        return run


def test_the_learner_style_loop_passes_and_a_fake_kernel_is_refused():
    assert run_check("block-sparse-loop", LocalLearner({"block_sparse_fwd_kernel": _loop()}, forbidden=[])).passed
    result = run_check("block-sparse-loop", LocalLearner({"block_sparse_fwd_kernel": _FakeKernel()}))
    assert not result.passed and "must be a Triton kernel" in result.message, result.message


# ---------------------------------------------------------------------------------------
# Part 3: partial blocks
# ---------------------------------------------------------------------------------------

@triton.jit
def _flex_body(Q, K, V, O, MASK, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
               stride_h, stride_n, stride_mh, stride_mq, n_ctx, n_qb, n_kb, scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    base = pid_h * stride_h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_mask = offs_m[:, None] < n_ctx
    q = tl.load(Q + base + offs_m[:, None] * stride_n + offs_d[None, :], mask=q_mask, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    row = pid_h * n_qb + pid_m
    n_partial = tl.load(kv_num_blocks + row) if VISIT_PARTIAL else 0
    n_full = tl.load(full_kv_num_blocks + row) if VISIT_FULL else 0
    for i in range(0, n_partial + n_full):
        is_partial = i < n_partial
        if is_partial:
            j = tl.load(kv_indices + row * n_kb + i)
        else:
            j = tl.load(full_kv_indices + row * n_kb + i - n_partial)
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_mask = offs_n[:, None] < n_ctx
        k = tl.load(K + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=kv_mask, other=0.0)
        if LOAD_TWICE:
            v = tl.load(V + base + offs_n[:, None] * stride_n + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(offs_n[None, :] < n_ctx, s, float("-inf"))
        keep = tl.full((BLOCK_M, BLOCK_N), 1, tl.int8)
        if (is_partial or MASK_FULL) and APPLY_MASK:
            inside = q_mask & (offs_n[None, :] < n_ctx)
            if TRANSPOSED:
                keep = tl.load(MASK + pid_h * stride_mh + offs_n[None, :] * stride_mq + offs_m[:, None],
                               mask=inside, other=0)
            elif ROWS_BY_N:  # MASK's rows taken to be n_ctx apart
                keep = tl.load(MASK + pid_h * stride_mh + offs_m[:, None] * n_ctx + offs_n[None, :],
                               mask=inside, other=0)
            else:
                keep = tl.load(MASK + pid_h * stride_mh + offs_m[:, None] * stride_mq + offs_n[None, :],
                               mask=inside, other=0)
            if not AFTER:
                s = tl.where(keep != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if GUARD:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if AFTER:  # the mask applied to the probabilities, after the sum
            p = tl.where(keep != 0, p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    if GUARD:
        l_i = tl.where(l_i > 0, l_i, 1.0)
    tl.store(O + base + offs_m[:, None] * stride_n + offs_d[None, :], acc / l_i[:, None], mask=q_mask)


_FLEX_OK = dict(VISIT_PARTIAL=True, VISIT_FULL=True, LOAD_TWICE=False, MASK_FULL=False, APPLY_MASK=True,
                TRANSPOSED=False, AFTER=False, GUARD=True, ROWS_BY_N=False)


def _flex(**flags):
    return _variant(_flex_body, **{**_FLEX_OK, **flags})


for _key, _flags in [("partial-treated-as-full", {"APPLY_MASK": False}),
                     ("full-treated-as-empty", {"VISIT_FULL": False}),
                     ("partial-treated-as-empty", {"VISIT_PARTIAL": False}), ("mask-after-softmax", {"AFTER": True}),
                     ("transposed-mask-tile", {"TRANSPOSED": True}), ("fully-masked-rows-nan", {"GUARD": False}),
                     ("mask-loaded-for-full-blocks", {"MASK_FULL": True}), ("extra-traffic", {"LOAD_TWICE": True}),
                     ("mask-stride-ignored", {"ROWS_BY_N": True})]:
    WRONG.add("partial-blocks", _key, flex_fwd_kernel=_flex(**_flags))


def test_the_learner_style_flex_kernel_passes_and_a_fake_kernel_is_refused():
    assert run_check("partial-blocks", LocalLearner({"flex_fwd_kernel": _flex()}, forbidden=[])).passed
    result = run_check("partial-blocks", LocalLearner({"flex_fwd_kernel": _FakeKernel()}))
    assert not result.passed and "must be a Triton kernel" in result.message, result.message


@triton.jit
def _mask_unbounded(Q, K, V, O, MASK, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                    stride_h, stride_n, stride_mh, stride_mq, n_ctx, n_qb, n_kb, scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # reads a whole MASK tile of the first partial block, past n_ctx too; stores zeros
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N) + tl.load(kv_indices + (pid_h * n_qb + pid_m) * n_kb) * BLOCK_N
    keep = tl.load(MASK + pid_h * stride_mh + offs_m[:, None] * stride_mq + offs_n[None, :])
    out = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32) + tl.sum(keep.to(tl.float32), axis=1)[:, None] * 0.0
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(O + pid_h * stride_h + offs_m[:, None] * stride_n + offs_d[None, :], out, mask=offs_m[:, None] < n_ctx)


def test_an_unbounded_load_of_the_int8_mask_is_caught():
    result = run_check("partial-blocks", LocalLearner({"flex_fwd_kernel": _mask_unbounded}, forbidden=[]))
    assert not result.passed and "out-of-bounds-load" in result.diagnosis, result.message


def test_flex_attention_s_eager_paths_agree_with_each_other_and_with_attnlab():
    g = torch.Generator().manual_seed(0)
    docs = e08._mask_arg(g, "document", 2, 37, {}, padding=True)
    q, k, v = (torch.randn(2, 1, 37, 16, generator=g) for _ in range(3))
    fast = e08._flex_reference(q, k, v, "document", docs, 16, 0.25)
    assert flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is False  # restored
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = flex.flex_attention(q, k, v, block_mask=e08._torch_block_mask("document", docs, 2, 1, 37, 37, 16),
                                     scale=0.25)
    plain = scaled_dot_product_attention(q, k, v, mask=e08._element_mask("document", docs, 2, 1, 37, 37), scale=0.25)
    assert torch.allclose(fast, traced, atol=1e-6) and torch.allclose(fast, plain, atol=1e-5)
    assert (plain[:, :, -5:] == 0).all()  # padding rows see nothing: zeros, as flex_attention gives


# ---------------------------------------------------------------------------------------
# Part 4: the experiment
# ---------------------------------------------------------------------------------------

def _flex_forward(kernel, q, k, v, lists, mask, block_size, int64_lists=False):
    b, h, n, d = q.shape
    flat = [t.reshape(b * h, *t.shape[2:]).to(torch.int64 if int64_lists else torch.int32).contiguous() for t in lists]
    q3, k3, v3 = (t.reshape(b * h, n, d).contiguous() for t in (q, k, v))
    m3 = mask.expand(b, h, n, n).reshape(b * h, n, n).to(torch.int8).contiguous()
    o = torch.empty_like(q3)
    n_qb, n_kb = flat[1].shape[-2:]
    kernel[(n_qb, b * h)](q3, k3, v3, o, m3, *flat, o.stride(0), o.stride(1), m3.stride(0), m3.stride(1), n, n_qb, n_kb,
                          d ** -0.5, HEAD_DIM=d, BLOCK_M=block_size, BLOCK_N=block_size)
    return o


def _interpreted_flex(**flags):
    """The right kernel (``flags``: a mistake's switches) decorated with TRITON_INTERPRET=1, as the notebook's setup cell does on a CPU, so that
    attnlab.memory.trace sees its loads (it traces plain @triton.jit kernels only when they are interpreted)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return _flex(**flags)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def _experiment(density="tiles", measure="kv", dense=False, create=spec.create_block_mask, offset=0.0):
    kernel = _interpreted_flex()

    def bytes_against_density(windows, n, d, block_size, seed):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 1, n, d, generator=g) for _ in range(3))
        dens, out = [], []
        for w in windows:
            mm = sliding_window(w)
            lists = create(mm, 1, 1, n, n, block_size)
            run = create(lambda b, h, q_idx, kv_idx: q_idx >= 0, 1, 1, n, n, block_size) if dense else lists
            i = torch.arange(n)
            e = mm(0, 0, i[:, None], i[None, :])
            # this process imported triton without TRITON_INTERPRET (the notebook's setup cell sets it first)
            with interpreter_session():
                t = trace(_flex_forward, kernel, q, k, v, run, e, block_size)
            n_qb, n_kb = lists[1].shape[-2:]
            if density == "tiles":
                dens.append(float(lists[0].sum() + lists[2].sum()) / (n_qb * n_kb))
            elif density == "partial":
                dens.append(float(lists[0].sum()) / (n_qb * n_kb))
            else:
                dens.append(float(e.float().mean()))
            kv = t.by_tensor["K"]["read"] + t.by_tensor["V"]["read"]
            out.append({"kv": kv, "k": t.by_tensor["K"]["read"], "elements": kv // 4, "total": t.total_bytes}[measure])
        return torch.tensor(dens, dtype=torch.float64) + offset, torch.tensor(out, dtype=torch.float64)
    return {"bytes_against_density": bytes_against_density, "flex_fwd_kernel": kernel}


for _key, _kw in [("dense-bytes", {"dense": True}), ("density-of-elements", {"density": "elements"}),
                  ("density-partial-only", {"density": "partial"}), ("k-bytes-only", {"measure": "k"}),
                  ("elements-not-bytes", {"measure": "elements"}), ("total-bytes", {"measure": "total"})]:
    WRONG.add("bytes-vs-density", _key, **_experiment(**_kw))


def test_the_experiment_passes_and_its_tolerance_is_tight():
    assert run_check("bytes-vs-density", LocalLearner(_experiment(), forbidden=[])).passed
    result = run_check("bytes-vs-density", LocalLearner(_experiment(offset=1e-6), forbidden=[]))
    assert not result.passed and "within 1e-9" in result.message


def test_the_experiment_may_not_build_its_masks_with_torch():
    def create(mask_mod, B, H, Nq, Nk, block_size):
        bm = flex.create_block_mask(mask_mod, B, H, Nq, Nk, device="cpu", BLOCK_SIZE=block_size)
        return bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices

    result = run_check("bytes-vs-density", LocalLearner(_experiment(create=create)))
    assert not result.passed and "shortcut" in result.diagnosis, result.message


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


def test_numbers_theory_predicts_score_only_when_the_kernel_moves_them():
    # 2 x 16 rows x d x 4 bytes per visited tile, counted without running anything: the bytes of a kernel that
    # loads each listed block once, so right for such a kernel and wrong for one that loads V twice
    def theory(windows, n, d, block_size, seed):
        dens, kv = [], []
        for w in windows:
            kn, _, fn, _ = spec.create_block_mask(sliding_window(w), 1, 1, n, n, block_size)
            dens.append(float(kn.sum() + fn.sum()) / (n // block_size) ** 2)
            kv.append(float(kn.sum() + fn.sum()) * 2 * block_size * d * 4)
        return torch.tensor(dens, dtype=torch.float64), torch.tensor(kv, dtype=torch.float64)

    right = {"bytes_against_density": theory, "flex_fwd_kernel": _interpreted_flex()}
    assert run_check("bytes-vs-density", LocalLearner(right, forbidden=[])).passed
    wasteful = {"bytes_against_density": theory, "flex_fwd_kernel": _interpreted_flex(LOAD_TWICE=True)}
    result = run_check("bytes-vs-density", LocalLearner(wasteful, forbidden=[]))
    assert not result.passed and "within 1e-9" in result.message, result.message


def test_the_experiment_s_points_differ_and_depend_on_the_salt():
    from attnlab.grading import core

    # two windows a block apart in 0 ... 111 give two different points (n = 128, 16-row blocks)
    points = [e08._model_point(w, 128, 16, 16) for w in range(112)]
    for w in range(112):
        for w2 in range(w + 16, 112):
            assert points[w]["density"] != points[w2]["density"] and points[w]["kv"] != points[w2]["kv"], (w, w2)
    seen = set()
    try:
        for salt in range(300):
            core._SALT[0] = salt
            windows = e08._windows(128, 16)
            assert 0 <= windows[0] and windows[-1] <= 111, windows
            assert all(b - a >= 16 for a, b in zip(windows, windows[1:])), windows
            seen.add(tuple(points[w]["kv"] for w in windows))
    finally:
        core._SALT[0] = 0
    assert len(seen) >= 40  # of the 70 sets of 4 points: no table of numbers answers every grading
