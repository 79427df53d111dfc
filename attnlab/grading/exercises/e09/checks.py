"""The checks of exercise 09_capstone: one table per graded part (:mod:`attnlab.grading.engine`), in ``TABLES``.

The training run and the experiment are reproduced here from the same salted seeds, every step's loss within a
tolerance; when no mistake of their own matches, they name a failing earlier part (:func:`_upstream`).
"""

import functools

import torch

from attnlab.attention import causal_mask
from attnlab.grading.core import Fail, Mistake, NotDone, case_line, diagnose, each_result, gen, learner_of, mismatch, \
    mistakes, randn, table
from attnlab.grading.engine import Gradients, Kernel, Launch, Measured, run
from attnlab.grading.exercises.e09 import spec as specs
from attnlab.grading.kernel_check import attention_budget, attention_launch, cdiv
from attnlab.grading.sandbox.agent import device


# ---------------------------------------------------------------------------------------------- my_sdpa

def _sdpa_case(g, label, shape, amp, kwargs):
    b, h, nq, nk, d = shape
    q, k, v = randn(g, b, h, nq, d, scale=amp), randn(g, b, h, nk, d, scale=amp), randn(g, b, h, nk, d)
    return label, (q, k, v), dict(kwargs), randn(g, b, h, nq, d)


def _sdpa_cases():
    causal, i = {"is_causal": True}, torch.arange(8)
    return table(1900, [  # (label, (B, H, Nq, Nk, D), q/k amplitude, kwargs)
        ("B=2, H=2, T=8, D=16, is_causal=True (the model's call)", (2, 2, 8, 8, 16), 1.0, causal),
        ("B=1, H=3, Nq=5, Nk=7, D=8, no mask, not causal", (1, 3, 5, 7, 8), 1.0, {}),
        ("B=2, H=1, T=6, D=4, is_causal=True, scale=0.3", (2, 1, 6, 6, 4), 1.0, {"is_causal": True, "scale": 0.3}),
        ("B=1, H=2, T=9, D=16, is_causal=True, large logits (q, k x 10)", (1, 2, 9, 9, 16), 10.0, causal),
        ("B=2, H=2, T=8, D=8, attn_mask (8, 8) a window of 3 AND is_causal=True", (2, 2, 8, 8, 8), 1.0,
         {"is_causal": True, "attn_mask": (i[:, None] - i[None, :]).abs() < 3}),
        ("B=2, H=1, Nq=4, Nk=6, D=8, attn_mask (2, 1, 1, 6) key padding (lengths 6 and 3), not causal",
         (2, 1, 4, 6, 8), 1.0, {"attn_mask": (torch.arange(6) < torch.tensor([[6], [3]]))[:, None, None, :]}),
        ("B=1, H=1, Nq=4, Nk=6, D=8, is_causal=True (top-left: query i sees keys 0..i)", (1, 1, 4, 6, 8), 1.0, causal),
    ], _sdpa_case)


def _sdpa_with(wrong):
    """my_sdpa with the mistake ``wrong`` (its key) made; differentiable, so that a wrong gradient is diagnosed too."""
    def impl(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        d = q.shape[-1]
        if scale is None or wrong == "scale-ignored":
            scale = 1.0 / d if wrong == "scale-1-over-d" else d ** -0.5
        s = q @ k.transpose(-2, -1) * (1.0 if wrong == "scale-missing" else scale)   # (B, H, Nq, Nk)
        nq, nk = s.shape[-2:]
        keep = None
        if is_causal and wrong != "is-causal-ignored":
            keep = torch.ones(nq, nk, dtype=torch.bool).tril(
                {"causal-bottom-right": nk - nq, "causal-diagonal-excluded": -1}.get(wrong, 0))
        if attn_mask is not None and not (wrong == "causal-replaces-mask" and keep is not None):
            keep = (~attn_mask if wrong == "mask-inverted" else attn_mask) & (True if keep is None else keep)
        after, axis = wrong == "mask-after-softmax", -2 if wrong == "softmax-wrong-axis" else -1
        if keep is not None and not after:
            s = s.masked_fill(~keep, float("-inf"))
        e = torch.exp(s) if wrong == "no-max-subtraction" else torch.exp(s - s.amax(axis, keepdim=True).detach())
        w = e / e.sum(axis, keepdim=True)
        return (w * keep if keep is not None and after else w) @ v
    return impl


_SDPA_MISTAKES = [Mistake(key, message, _sdpa_with(key)) for key, message in [
    ("no-max-subtraction", "exp overflows on large scores (NaN weights): subtract each row's max before exp"),
    ("scale-1-over-d", "the default scale is 1/sqrt(D), not 1/D"),
    ("scale-missing", "the scores are not scaled: multiply q @ k^T by scale (1/sqrt(D) by default)"),
    ("scale-ignored", "the `scale` argument is ignored: when given it replaces 1/sqrt(D)"),
    ("causal-diagonal-excluded", "the causal mask hides the diagonal: query i sees key i (tril(), not tril(-1))"),
    ("causal-bottom-right", "the causal mask is bottom-right; SDPA's is top-left: torch.ones(Nq, Nk).tril()"),
    ("mask-inverted", "attn_mask is read backwards: True means may attend"),
    ("mask-after-softmax", "the mask is applied after the softmax: set masked scores to -inf before it"),
    ("softmax-wrong-axis", "the softmax runs over the queries (dim -2), not the keys (dim -1)"),
    ("is-causal-ignored", "is_causal=True is ignored: every position sees the future"),
    ("causal-replaces-mask", "with is_causal=True the attn_mask is dropped: apply both (AND)"),
]]


# ---------------------------------------------------------------------------------------------- the causal kernel

BH_MODEL = specs.BATCH * specs.TINY["n_heads"]                    # the model's (batch x heads) slices
HS_MODEL = specs.TINY["d_model"] // specs.TINY["n_heads"]         # its head size
TILE_MODEL = 16                                                    # the tiles the notebook's launcher uses


def _kernel_with(wrong):
    """The kernel's loop in PyTorch, program by program (q, k, v: (BH, N, D)), with the mistake ``wrong`` made.
    Keys past N are left out, as the kernel's load masks them."""
    def impl(q, k, v, scale, bm, bn):
        bh, n, d = q.shape
        out = torch.empty_like(q)
        for start_m in range(0, n, bm):
            rows = torch.arange(start_m, min(start_m + bm, n))
            m = torch.full((bh, len(rows)), float("-inf"))
            l, acc = torch.zeros(bh, len(rows)), torch.zeros(bh, len(rows), d)
            stop = n if wrong == "not-causal" else min((start_m // bm + 1) * (bn if wrong == "loop-bound-block-n"
                                                                              else bm), n)
            if wrong == "one-fixed-tile":
                bn = stop = 64
            for start in range(0, stop, bn):
                cols = torch.arange(start, min(start + bn, n))
                s = q[:, rows] @ k[:, cols].transpose(-2, -1) * (1.0 if wrong == "scale-forgotten" else scale)
                if wrong not in ("causal-mask-missing", "not-causal"):
                    s = s.masked_fill(cols[None, :] > rows[:, None] - int(wrong == "causal-diagonal-excluded"),
                                      float("-inf"))
                m_new = torch.maximum(m, s.amax(-1))
                alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[..., None])
                l = (l if wrong == "sum-not-rescaled" else alpha * l) + p.sum(-1)
                acc = (acc if wrong == "acc-not-rescaled" else alpha[..., None] * acc) + p @ v[:, cols]
                m = m_new
            out[:, rows] = acc if wrong == "not-normalised" else acc / l[..., None]
        return out
    return impl


_KERNEL_MISTAKES = [Mistake(key, message, _kernel_with(key)) for key, message in [
    ("acc-not-rescaled", "the accumulator is not rescaled: acc = acc * alpha[:, None] + tl.dot(p, v)"),
    ("sum-not-rescaled", "the running sum is not rescaled: l_i = l_i * alpha + tl.sum(p, 1)"),
    ("scale-forgotten", "the scores are not multiplied by `scale`"),
    ("not-normalised", "the output is not divided by the running sum: store acc / l_i[:, None]"),
    ("causal-diagonal-excluded", "the element mask hides the diagonal (the first row is NaN): keep offs_n <= offs_m"),
    # also a kernel with no element mask at all: it fails the first launch (N a multiple of BLOCK_N) the same way
    ("causal-mask-missing", "the diagonal block has no element mask: s = -inf where offs_n > offs_m (or >= n_ctx)"),
    ("not-causal", "the kernel is not causal: every query sees every key"),
    ("loop-bound-block-n", "the loop ends at (pid_m + 1) * BLOCK_N; it must end at (pid_m + 1) * BLOCK_M"),
    ("one-fixed-tile", "one fixed tile of 64 keys fits only a short n_ctx: loop over key blocks (online softmax)"),
]]


def _launch(g, bh, n, d, bm, bn, amp, what):
    q, k, v = randn(g, bh, n, d, scale=amp), randn(g, bh, n, d, scale=amp), randn(g, bh, n, d)
    buffers, args = attention_launch({"q": q, "k": k, "v": v, "o": q.shape}, 3, ["o"], [n, d ** -0.5])
    want = specs.my_sdpa(q[None], k[None], v[None], is_causal=True)[0]
    return Launch(f"{what}, tiles {bm}x{bn}", buffers, (cdiv(n, bm), bh), args,
                  {"HEAD_DIM": d, "BLOCK_M": bm, "BLOCK_N": bn}, {"o": want}, (q, k, v, d ** -0.5, bm, bn),
                  ("Q", "K", "V", "scale", "BLOCK_M", "BLOCK_N"), traffic_budget(bh, n, d, bm, bn))


def _kernel_launches():
    return table(2000, [  # (BH, N, D, BLOCK_M, BLOCK_N, q/k amplitude, what the launch shows)
        (BH_MODEL, specs.SEQ, HS_MODEL, TILE_MODEL, TILE_MODEL, 1.0, f"the model's shape: BH={BH_MODEL} (batch "
         f"{specs.BATCH} x {specs.TINY['n_heads']} heads), N={specs.SEQ}, D={HS_MODEL}"),
        (2, 20, 16, 16, 16, 1.0, "BH=2, N=20 (a partial last block), D=16"),
        (1, 7, 16, 16, 16, 1.0, "BH=1, N=7 (shorter than one block), D=16"),
        (2, 48, 16, 16, 16, 8.0, "BH=2, N=48, D=16, large scores (the running max must rescale)"),
        (2, 40, 32, 32, 16, 1.0, "BH=2, N=40, D=32, BLOCK_M=32 != BLOCK_N=16"),
        (1, 100, 16, 16, 16, 1.0, "BH=1, N=100 (more keys than one tile of 64 holds), D=16")], _launch)


def causal_kv_rows(n, bm, bn):
    """Rows of K (or V) of one slice a causal kernel loads: query block i, the key blocks before (i + 1) * BLOCK_M."""
    return sum(min(cdiv(min((i + 1) * bm, n), bn) * bn, n) for i in range(cdiv(n, bm)))


def traffic_budget(bh, n, d, bm, bn, element_size=4):
    """{buffer: (max load bytes, max store bytes)}: Q read once, K and V up to the diagonal, O written once."""
    return attention_budget((bh, n, d), bh * causal_kv_rows(n, bm, bn), element_size)


def _dense_loop(case, traffic):
    bh, n, d = case.inputs[0].shape   # as much K or V as a loop over every key block loads: the dense loop
    dense = bh * cdiv(n, case.constexprs["BLOCK_M"]) * n * d * 4
    dense_loop = max(traffic[b]["load_bytes"] for b in "kv") >= dense > case.budget["k"][0]
    return [Mistake("dense-loop", "the loop also visits the key blocks above the diagonal (wasted traffic): stop it "
                    "at the diagonal, range(0, (pid_m + 1) * BLOCK_M, BLOCK_N)", None)] if dense_loop else []


# ---------------------------------------------------------------------------------------------- the runs

TRAIN_STEPS, EXPERIMENT_STEPS = 8, 20


def train_tolerance():
    """Every step's loss within this of SDPA's run: float32 rounding on a CPU; on a GPU tl.dot rounds to TF32."""
    return 1e-2 if device() == "cuda" else 1e-3


def _salted_seed(n):
    return int(torch.randint(0, 10**6, (1,), generator=gen(n)))


def _upstream(learner, parts=(("capstone-sdpa", "my_sdpa"),)):
    """[a Mistake] for the first of ``parts`` ((part, function)) whose own table fails: a run through a wrong
    function of the learner's cannot be right before that function is."""
    for part, name in parts:
        try:
            run(TABLES[part], learner)
        except Fail as exc:
            if not isinstance(exc, NotDone):   # not written (or not in this namespace): nothing to say of it
                return [Mistake(f"{part}-fails", f"your {name} fails its own part ({part}: "
                                f"{exc.message.splitlines()[0]}); the run goes through it: fix that part first", None)]
        except Exception:
            continue
    return []


def _reproduce(learner, name, cases, known, differs, upstream, fallback=lambda got, want: []):
    """Each case's loss curves against the reference's within :func:`train_tolerance`; a failure no mistake
    explains is put down to ``upstream``, then to ``fallback``. Returns the last (got, want)."""
    learner, reference, tol = learner_of(learner), getattr(specs, name), train_tolerance()
    for label, args, _, got in each_result(learner, name, cases):
        want = reference(*args)
        why = mismatch(got, want, rtol=0.0, atol=tol)
        if why:
            found = diagnose(got, known, args, {}, rtol=0.0, atol=tol) or _upstream(learner, upstream) or fallback(
                got, want)
            raise Fail(f"`{name}` on {label}: {differs} (every step within {tol:g}): {why}\n    "
                       + case_line(label, args, {}, reference), found)
    return got, want


# ---------------------------------------------------------------------------------------------- training

_TRAIN_MISTAKES = mistakes(lambda **switch: functools.partial(specs.train_gpt, **switch), [
    ("grads-accumulate", "the gradients are not zeroed: optimizer.zero_grad() before backward", {"zero_grad": False}),
    ("no-clip", "no gradient clipping: clip_grad_norm_(model.parameters(), CLIP) before step", {"clip": False}),
    ("same-batch", "every step trains on the same batch: make one generator before the loop", {"reseed": lambda i: 0}),
    ("generator-per-step", "a new generator each step: draw every batch from one made before the loop",
     {"reseed": lambda i: i}),
    ("wrong-lr", "the learning rate is Adam's default 1e-3, not LR", {"lr": 1e-3}),
    # a step at learning rate 0 leaves the weights as they were: the run of a loop that never steps
    ("no-update", "the weights never change: optimizer.step() after backward, zero_grad() before backward, not after",
     {"lr": 0.0}),
    ("sgd", "the optimizer is SGD; the recipe is Adam(model.parameters(), lr=LR)", {"optimizer": torch.optim.SGD}),
])

def _first_step(got, want):
    try:
        losses = torch.as_tensor(got, dtype=want.dtype)
    except (TypeError, ValueError, RuntimeError):
        return []
    if losses.shape != want.shape or not mismatch(losses[:1], want[:1], rtol=0.0, atol=train_tolerance()):
        return []
    return [Mistake("first-step-differs", "the first loss differs, before any update: GPT(**TINY, ..., seed=seed), "
                    "the batches from one torch.Generator().manual_seed(seed)", None)]


def _measure_train(learner):
    seed = _salted_seed(2100)
    cases = [(f"seed {seed}, {TRAIN_STEPS} steps", (seed, TRAIN_STEPS), {})]
    got, want = _reproduce(learner, "train_gpt", cases, _TRAIN_MISTAKES, "the losses are not those of SDPA's run",
                           (("capstone-kernel", "causal_attn_kernel"), ("capstone-sdpa", "my_sdpa")), _first_step)
    worst = (torch.as_tensor(got, dtype=torch.float64) - want.double()).abs().max().item()
    return (f"your run's {TRAIN_STEPS} losses follow SDPA's run from the same seed (largest difference "
            f"{worst:.1e}, tolerance {train_tolerance():g}): loss {float(want[0]):.3f} -> {float(want[-1]):.3f}")


# ---------------------------------------------------------------------------------------------- the experiment

def _experiment_with(window_off=0, use_global=True, causal=True, swapped=False, seed_offset=0, both_masked=False,
                     symmetric=False):
    def impl(seed, steps, window, n_global):
        i, j = torch.arange(specs.SEQ)[:, None], torch.arange(specs.SEQ)[None, :]
        keep = (((i - j).abs() if symmetric else i - j) < window + window_off) | ((j < n_global) & use_global)
        if causal:
            keep = keep & (j <= i)
        dense = specs.masked_run(seed, steps, keep if both_masked else causal_mask(specs.SEQ))
        local = specs.masked_run(seed + seed_offset, steps, keep)
        return (local, dense) if swapped else (dense, local)
    return impl


_EXPERIMENT_MISTAKES = mistakes(_experiment_with, [
    ("window-off-by-one", "the window holds `window` keys, the query's among them: i - j < window", {"window_off": 1}),
    ("global-missing", "the first n_global keys are not global: every query also sees j < n_global",
     {"use_global": False}),
    ("local-not-causal", "the local mask lets a query see the keys after it: keep j <= i", {"causal": False}),
    ("local-not-causal", "the window is symmetric (|i - j| < window), is_causal off: keep j <= i",
     {"causal": False, "symmetric": True}),
    ("swapped", "the two curves are in the wrong order: return (dense, local)", {"swapped": True}),
    ("different-seeds", "the two runs start from different seeds: both use `seed`", {"seed_offset": 1}),
    ("both-masked", "the dense run is masked too: it must be plain causal attention", {"both_masked": True}),
])


def _measure_experiment(learner):
    specs._RUNS.clear()   # this check's runs: the reference's two of each case, shared with the mistakes
    cases = [(f"seed {s}, {EXPERIMENT_STEPS} steps, window={w}, n_global={ng}", (s, EXPERIMENT_STEPS, w, ng), {})
             for s, w, ng in [(_salted_seed(2200), 8, 1), (_salted_seed(2201), 4, 2)]]
    _reproduce(learner, "local_vs_dense", cases, _EXPERIMENT_MISTAKES, "the grader's reproduction differs",
               (("capstone-sdpa", "my_sdpa"),))
    return (f"{len(cases)} experiments reproduced (dense and local + global loss curves, every step within "
            f"{train_tolerance():g})")


TABLES = {
    "capstone-sdpa": Gradients("my_sdpa", specs.my_sdpa, _sdpa_cases, inputs=(0, 1, 2), mistakes=_SDPA_MISTAKES,
                               labels=["dQ", "dK", "dV"], says="{n} cases match SDPA's function, output and dQ, dK, "
                               "dV (masks, scale, Nq != Nk, large logits)"),
    "capstone-kernel": Kernel("causal_attn_kernel", _kernel_launches, _KERNEL_MISTAKES, uses_dot=True,
                              says="{n} launches match causal attention with no stray access",
                              budget_says="Q read once, K and V up to the diagonal, O written once",
                              traffic_diagnosis=_dense_loop),
    "capstone-train": Measured("function", _measure_train, {"train_gpt": _TRAIN_MISTAKES}),
    "capstone-local-global": Measured("experiment", _measure_experiment, {"local_vs_dense": _EXPERIMENT_MISTAKES}),
}
