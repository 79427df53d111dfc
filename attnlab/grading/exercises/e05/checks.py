"""The checks of exercise 05_quadratic_cost: one table per graded part (:mod:`attnlab.grading.engine`)."""

import math
import numbers

import torch

from attnlab.grading.core import Fail, Mistake, each_result, gen as _gen, mismatch, mistakes, salted_ints
from attnlab.grading.engine import Function, InTurn, Measured
from attnlab.grading.exercises.e05 import spec as specs

# (batch, heads, n, d, element_size, what the case shows); then one size no one knows
_SIZES = [(1, 1, 1024, 64, 4, ""), (2, 8, 512, 128, 2, ""), (4, 12, 2048, 64, 2, ""),
          (1, 2, 100, 30, 1, ", n and d not powers of 2"), (3, 1, 1, 16, 4, ", a single position"),
          (8, 16, 16384, 128, 2, ", a long sequence")]


def _size_cases(with_elem=False):
    b, h, n, d, e = salted_ints(1500, (1, 4), (1, 16), (3, 3000), (8, 160), (0, 2))
    return [(f"batch={b}, heads={h}, n={n}, d={d}" + (f", element_size={es}" if with_elem else "") + note,
             (b, h, n, d, es) if with_elem else (b, h, n, d), {})
            for b, h, n, d, es, note in _SIZES + [(b, h, n, d, (1, 2, 4)[e], "")]]


_PER_HEAD = "this is one head of one sequence: multiply by batch and heads"
_FLOPS_MISTAKES = [
    Mistake("multiply-add-once", "2 FLOPs per multiply-add, in QK^T and PV", lambda b, h, n, d: b * h * 2 * n * n * d),
    Mistake("swapped-n-d", "n and d are swapped: each matmul costs 2 n^2 d", lambda b, h, n, d: b * h * 4 * n * d * d),
    Mistake("per-head-only", _PER_HEAD, lambda b, h, n, d: 4 * n * n * d),
    Mistake("heads-forgotten", "multiply by heads too", lambda b, h, n, d: b * 4 * n * n * d),
    Mistake("batch-forgotten", "multiply by batch too", lambda b, h, n, d: h * 4 * n * n * d),
    Mistake("softmax-counted", "count the matmuls only", lambda b, h, n, d: b * h * (4 * n * n * d + 5 * n * n)),
]


def _steps_with(unit=None, swap=False, per_head=False, **counts):
    """A wrong step_bytes: ``counts`` {step: f(n, d) -> its (read, written) elements} replace the right ones."""
    def impl(b, h, n, d, es=4):
        steps = {"scores": (2 * n * d, n * n), "softmax": (n * n, n * n), "pv": (n * n + n * d, n * d),
                 **{k: f(n, d) for k, f in counts.items()}}
        x = (1 if per_head else b * h) * (es if unit is None else unit)
        return tuple((w * x, r * x) if swap else (r * x, w * x) for r, w in steps.values())
    return impl


_STEP_MISTAKES = mistakes(_steps_with, [
    ("elements-not-bytes", "these are elements: multiply by element_size", {"unit": 1}),
    ("read-write-swapped", "each pair is (bytes read, bytes written), in that order", {"swap": True}),
    ("pv-forgets-v", "O = PV reads V (n*d elements) as well as P", {"pv": lambda n, d: (n * n, n * d)}),
    ("scores-forgets-k", "S = QK^T reads both Q and K (2*n*d elements)", {"scores": lambda n, d: (n * d, n * n)}),
    ("output-is-n-by-n", "O = PV writes O, (n, d) per head", {"pv": lambda n, d: (n * n + n * d, n * n)}),
    ("softmax-in-place", "the softmax reads S and writes P: n^2 elements each way", {"softmax": lambda n, d: (0, 0)}),
    ("per-head-only", _PER_HEAD, {"per_head": True}),
])
_TOTAL_MISTAKES = mistakes(lambda nn=4, nd=4, unit=None, heads=True: lambda b, h, n, d, es=4: (
    (b * h if heads else 1) * (nn * n * n + nd * n * d) * (es if unit is None else unit)), [
    ("elements-not-bytes", "this counts elements: multiply by element_size", {"unit": 1}),
    ("writes-only", "only the writes are counted: S and P are read back, and Q, K, V read", {"nn": 2, "nd": 1}),
    ("reads-only", "only the reads are counted: S, P and O are written too", {"nn": 2, "nd": 3}),
    ("matrices-only", "only S and P are counted: add Q, K, V read and O written (4nd elements)", {"nd": 0}),
    ("per-head-only", _PER_HEAD, {"heads": False}),
])
_INTENSITY_MISTAKES = [
    Mistake("inverted-ratio", "this is bytes per FLOP: arithmetic intensity is FLOPs / bytes",
            lambda b, h, n, d, es=4: specs.attention_bytes(b, h, n, d, es) / specs.attention_flops(b, h, n, d)),
    Mistake("elements-not-bytes", "divide by bytes, not elements",
            lambda b, h, n, d, es=4: specs.attention_flops(b, h, n, d) / specs.attention_bytes(b, h, n, d, 1)),
    Mistake("multiply-add-once", "a multiply-add counts as 2 FLOPs",
            lambda b, h, n, d, es=4: specs.attention_flops(b, h, n, d) / 2 / specs.attention_bytes(b, h, n, d, es)),
]


def _bound_cases():
    i, f, bw = salted_ints(1501, (1, 400), (1, 300), (1, 40))
    return [(f"intensity {i:g} FLOP/B on {p / 1e12:g} TFLOP/s and {w / 1e12:g} TB/s{what}", (i, p, w), {})
            for i, p, w, what in [(200.0, 100e12, 2e12, ""), (10.0, 100e12, 2e12, ""), (5.0, 8e12, 0.3e12, ""),
                                  (40.0, 8e12, 0.3e12, ""), (50.0, 100e12, 2e12, ", exactly at the ridge point"),
                                  (0.5, 0.2e12, 20e9, ", a softmax"), (float(i), f * 1e12, bw * 1e11, "")]]


_BOUND_MISTAKES = [
    Mistake("comparison-flipped", "below the ridge point a kernel is memory-bound", lambda i, p, bw: i > p / bw),
    Mistake("ridge-inverted", "the ridge point is peak_flops / bandwidth", lambda i, p, bw: i < bw / p),
    Mistake("ridge-inclusive", "memory-bound is strictly below the ridge point: intensity < peak_flops / bandwidth",
            lambda i, p, bw: i <= p / bw),
]


def _predict_with(combine, *, elements=None, steps=(0, 1, 2)):
    """A wrong predict_naive_time: ``combine([(FLOPs, bytes) of each step], flop_rate, bandwidth)``."""
    def impl(b, h, n, d, flop_rate, bandwidth, element_size=4):
        moved = [r + w for r, w in specs.step_bytes(b, h, n, d, element_size if elements is None else elements)]
        costs = list(zip((2 * b * h * n * n * d, 0, 2 * b * h * n * n * d), moved))
        return combine([costs[i] for i in steps], flop_rate, bandwidth)
    return impl


def _roofline_sum(costs, p, w):
    return sum(max(f / p, m / w) for f, m in costs)


_PREDICT_MISTAKES = [
    Mistake("no-overlap", "a step takes max(FLOPs / flop_rate, bytes / bandwidth), not their sum",
            _predict_with(lambda c, p, w: sum(f / p + m / w for f, m in c))),
    Mistake("one-roofline-for-all", "the steps run one after another: sum the per-step maxima, not one max of totals",
            _predict_with(lambda c, p, w: max(sum(f for f, _ in c) / p, sum(m for _, m in c) / w))),
    Mistake("flops-only", "each step also takes at least bytes / bandwidth",
            _predict_with(lambda c, p, w: sum(f / p for f, _ in c))),
    Mistake("bytes-only", "each step also takes at least FLOPs / flop_rate",
            _predict_with(lambda c, p, w: sum(m / w for _, m in c))),
    Mistake("elements-not-bytes", "multiply the elements by element_size", _predict_with(_roofline_sum, elements=1)),
    Mistake("softmax-skipped", "the softmax step is missing: it moves 2 n^2 elements per head",
            _predict_with(_roofline_sum, steps=(0, 2))),
]


def _predict_cases():
    b, h, n, d, f, bw = salted_ints(1502, (1, 4), (1, 16), (16, 4096), (8, 160), (1, 500), (1, 300))
    return [   # in this order, each wrong version fails first where it is the only one that gives its number
        ("batch=1, heads=12, n=1024, d=64, fp16 on an A100 (312 TFLOP/s, 1.555 TB/s): every step memory-bound",
         (1, 12, 1024, 64, 312e12, 1.555e12), {"element_size": 2}),
        ("batch=1, heads=4, n=1024, d=64, 100 GFLOP/s, 20 GB/s: the matmuls compute-bound, the softmax not",
         (1, 4, 1024, 64, 100e9, 20e9), {}),
        ("batch=2, heads=2, n=256, d=512 (large d), 10 GFLOP/s, 50 GB/s", (2, 2, 256, 512, 10e9, 50e9), {}),
        ("batch=1, heads=1, n=100, d=30, 1 TFLOP/s, 1 GB/s", (1, 1, 100, 30, 1e12, 1e9), {}),
        (f"batch={b}, heads={h}, n={n}, d={d}, {f} TFLOP/s, {bw * 10} GB/s", (b, h, n, d, f * 1e12, bw * 1e10), {})]


# naive-time-experiment: exact from the learner's own timings, and their timings close to the grader's
FACTOR = 10.0          # a timing within FACTOR of the grader's (a busy machine slows one run; a unit is off by 1000)
RTOL = 1e-6            # the rates and the prediction follow from the learner's own numbers: exact, up to float32
SIZES = {"n": 1024, "heads": 2, "d": 64, "repeats": 5}
NAMES = ("matmul_seconds", "copy_seconds", "flop_rate", "bandwidth", "predicted_seconds", "measured_seconds")
FLOPS, BYTES = 2 * specs.MATMUL_SIZE ** 3, 2 * specs.COPY_BYTES   # the work of the timed matmul, of the timed copy


def _rate_mistakes(work, *miscounts):
    """Wrong rates from the learner's own seconds: ``miscounts`` (key, message, the work counted), giga, inverted."""
    return [*(Mistake(key, message, lambda seconds, w=w: w / seconds) for key, message, w in miscounts),
            Mistake("giga-units", "return FLOP/s and byte/s, not giga", lambda seconds: work / seconds / 1e9),
            Mistake("rate-inverted", "a rate is work / seconds", lambda seconds: seconds / work)]


_FLOP_RATE_MISTAKES = _rate_mistakes(FLOPS, ("matmul-flops-once", "a 1024^3 matmul does 2 * 1024^3 FLOPs", FLOPS / 2))
_BANDWIDTH_MISTAKES = _rate_mistakes(BYTES, ("copy-counted-once", "a copy reads and writes: 2 * COPY_BYTES", BYTES / 2),
                                     ("elements-not-bytes", "COPY_BYTES are bytes, 4 per float32", BYTES / 4))
# each the learner's timing, from the grader's own measurement of the same thing, in seconds
_UNIT_MISTAKES = [Mistake(unit, f"the times are in {unit}{why}: return seconds", lambda seconds, f=f: seconds * f)
                  for unit, why, f in (("milliseconds", "", 1e3), ("microseconds", "", 1e6),
                                       ("nanoseconds", " (perf_counter_ns?)", 1e9))]


def _differ(got, want, timing=False):
    """Why ``got`` is not ``want`` (None when it is): equal up to RTOL, or a ``timing`` within FACTOR either way."""
    f, rtol, atol = (math.log, 0.0, math.log(FACTOR)) if timing else (float, RTOL, 0.0)
    return mismatch(torch.tensor(f(got), dtype=torch.float64), torch.tensor(f(want), dtype=torch.float64),
                    rtol=rtol, atol=atol)


def _numbers(result):
    if not isinstance(result, (tuple, list)) or len(result) != len(NAMES):
        raise Fail(f"`naive_time_experiment` should return a tuple of {len(NAMES)} numbers {NAMES}, got "
                   f"{type(result).__name__}{'' if not isinstance(result, (tuple, list)) else f' of {len(result)}'}")
    values = [v.item() if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1 else v for v in result]
    for name, v in zip(NAMES, values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
            raise Fail(f"`naive_time_experiment`: {name} should be a positive number, got {v!r}")
    return {name: float(v) for name, v in zip(NAMES, values)}


def _measure_experiment(learner):
    seed = int(_gen(1300).initial_seed() % 10_000)
    label = f"seed={seed}, " + ", ".join(f"{k}={v}" for k, v in SIZES.items())
    (*_, result), = each_result(learner, "naive_time_experiment", [(label, (seed,), dict(SIZES))])
    got = _numbers(result)
    # exact: the rates from the learner's own timings, the prediction from the learner's own rates
    for rate, seconds, work, wrong in (("flop_rate", "matmul_seconds", FLOPS, _FLOP_RATE_MISTAKES),
                                       ("bandwidth", "copy_seconds", BYTES, _BANDWIDTH_MISTAKES)):
        want = work / got[seconds]
        if _differ(got[rate], want):
            raise Fail(f"`naive_time_experiment` ({label}): {rate} is {got[rate]:.6g}, but your own {seconds} "
                       f"({got[seconds]:.6g} s) gives {want:.6g}",
                       [m for m in wrong if not _differ(got[rate], m.impl(got[seconds]))])
    args = (1, SIZES["heads"], SIZES["n"], SIZES["d"], got["flop_rate"], got["bandwidth"])
    want = specs.predict_naive_time(*args)
    if _differ(got["predicted_seconds"], want):
        raise Fail(f"`naive_time_experiment` ({label}): predicted_seconds is {got['predicted_seconds']:.6g}, but the "
                   f"roofline gives {want:.6g} from your own rates",
                   [m for m in _PREDICT_MISTAKES if not _differ(got["predicted_seconds"], m.impl(*args))])

    # generous: each timing within FACTOR of the grader's own measurement, made right after (twice if needed)
    mine = dict(zip(("matmul_seconds", "copy_seconds", "measured_seconds"), specs.measure(seed, **SIZES)))
    for name in mine:
        for _ in range(2):   # the machine may have been busy during one of the two measurements: measure again
            if not _differ(got[name], mine[name], timing=True):
                break
            again = dict(zip(mine, specs.measure(seed, **SIZES)))[name]
            if abs(math.log(got[name] / again)) < abs(math.log(got[name] / mine[name])):
                mine[name] = again
        if _differ(got[name], mine[name], timing=True):
            raise Fail(f"`naive_time_experiment` ({label}): {name} is {got[name]:.4g} s, but the grader measured "
                       f"{mine[name]:.4g} s on this machine (a factor {got[name] / mine[name]:.3g}; accepted: within "
                       f"a factor {FACTOR:g} either way)",
                       [m for m in _UNIT_MISTAKES if not _differ(got[name], m.impl(mine[name]), timing=True)])
    miss = got["measured_seconds"] / got["predicted_seconds"]
    return (f"your prediction follows from your rates; your timings are within a factor {FACTOR:g} of the grader's "
            f"({', '.join(f'{got[k] * 1e3:.2f} ms against {mine[k] * 1e3:.2f} ms' for k in mine)}); "
            f"measured / predicted = {miss:.2f}")


TABLES = {
    "attention-flops": Function("attention_flops", specs.attention_flops, _size_cases, _FLOPS_MISTAKES, ordered=True,
                                says="{n} sizes match the spec"),
    "attention-bytes": InTurn("{n} cases match the spec (attnlab.iomodel's count of standard attention)", (
        Function("step_bytes", specs.step_bytes, lambda: _size_cases(True), _STEP_MISTAKES, ordered=True),
        Function("attention_bytes", specs.attention_bytes, lambda: _size_cases(True), _TOTAL_MISTAKES, ordered=True))),
    "arithmetic-intensity": InTurn("{n} cases match the spec", (
        Function("arithmetic_intensity", specs.arithmetic_intensity, lambda: _size_cases(True), _INTENSITY_MISTAKES,
                 ordered=True),
        Function("is_memory_bound", specs.is_memory_bound, _bound_cases, _BOUND_MISTAKES, ordered=True))),
    "roofline-prediction": Function("predict_naive_time", specs.predict_naive_time, _predict_cases, _PREDICT_MISTAKES,
                                    ordered=True, says="{n} cases match the spec"),
    "naive-time-experiment": Measured("experiment", _measure_experiment, {
        "(flop_rate)": _FLOP_RATE_MISTAKES, "(bandwidth)": _BANDWIDTH_MISTAKES,
        "(predicted_seconds)": _PREDICT_MISTAKES, "(timings)": _UNIT_MISTAKES}),
}
