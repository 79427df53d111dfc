"""Exercise 05 (the quadratic cost): wrong experiments, written as a learner would, fail their check with the
matching diagnosis (the other parts' known mistakes: tests/test_every_mistake.py); shortcuts are refused; the
experiment is graded exactly from the learner's own timings and within a stated factor of the grader's own."""

import math

import pytest
import torch

from attnlab.grading.checks import run_check
from attnlab.grading.core import LocalLearner
from attnlab.grading.exercises.e05 import checks as e05_checks
from attnlab.grading.exercises.e05 import spec as specs
from attnlab.grading.parts import forbidden
from attnlab.measure import time_call
from mistakes import Wrong

WRONG = Wrong()

# attention-flops, attention-bytes, arithmetic-intensity and roofline-prediction: every known mistake is proven by
# its check's own emulation (tests/test_every_mistake.py). The experiment's mistakes are judged from timings.

def _right_prediction(batch, heads, n, d, flop_rate, bandwidth, element_size=4):
    """A right predict_naive_time, written as a learner would: a roofline per step, summed."""
    mm = 2 * batch * heads * n * n * d
    steps = [(mm, batch * heads * (2 * n * d + n * n) * element_size), (0, batch * heads * 2 * n * n * element_size),
             (mm, batch * heads * (n * n + 2 * n * d) * element_size)]
    return sum(max(f / flop_rate, m / bandwidth) for f, m in steps)


# --- naive-time-experiment: a learner's experiment with one thing wrong -------------------------------------


def _experiment(flops_per_matmul=2, copy_passes=2, units=1.0, rate=lambda work, seconds: work / seconds,
                predict=_right_prediction):
    def naive_time_experiment(seed, n=1024, heads=4, d=64, repeats=5):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(1024, 1024, generator=g)
        matmul_s = time_call(torch.matmul, a, a, repeats=repeats, reduce="min") * units
        src = torch.ones(32 * 2**20 // 4)
        dst = torch.empty_like(src).zero_()
        copy_s = time_call(dst.copy_, src, repeats=repeats, reduce="min") * units
        flop_rate = rate(flops_per_matmul * 1024**3, matmul_s)
        bandwidth = rate(copy_passes * 32 * 2**20, copy_s)
        predicted = predict(1, heads, n, d, flop_rate, bandwidth)
        q, k, v = (torch.randn(1, heads, n, d, generator=g) for _ in range(3))

        def naive(q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1) * d ** -0.5, dim=-1) @ v

        return matmul_s, copy_s, flop_rate, bandwidth, predicted, time_call(naive, q, k, v, repeats=repeats,
                                                                             reduce="min") * units
    return naive_time_experiment


WRONG.add("naive-time-experiment", "matmul-flops-once", naive_time_experiment=_experiment(flops_per_matmul=1))
WRONG.add("naive-time-experiment", "copy-counted-once", naive_time_experiment=_experiment(copy_passes=1))
WRONG.add("naive-time-experiment", "giga-units", naive_time_experiment=_experiment(rate=lambda w, s: w / s / 1e9))
WRONG.add("naive-time-experiment", "rate-inverted", naive_time_experiment=_experiment(rate=lambda w, s: s / w))
WRONG.add("naive-time-experiment", "milliseconds", naive_time_experiment=_experiment(units=1e3))
WRONG.add("naive-time-experiment", "microseconds", naive_time_experiment=_experiment(units=1e6))
WRONG.add("naive-time-experiment", "nanoseconds", naive_time_experiment=_experiment(units=1e9))
WRONG.add("naive-time-experiment", "no-overlap", naive_time_experiment=_experiment(
    predict=lambda b, h, n, d, p, w: sum(f / p + (r + wr) / w for f, (r, wr) in zip(
        (2 * b * h * n * n * d, 0, 2 * b * h * n * n * d), specs.step_bytes(b, h, n, d)))))
WRONG.add("naive-time-experiment", "softmax-skipped", naive_time_experiment=_experiment(
    predict=lambda b, h, n, d, p, w: sum(max(2 * b * h * n * n * d / p, (r + wr) / w)
                                         for i, (r, wr) in enumerate(specs.step_bytes(b, h, n, d)) if i != 1)))

test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


def test_numpy_scalars_pass():
    import numpy as np

    ns = {"arithmetic_intensity": lambda b, h, n, d, es=4: np.float64(4 * n * n * d / ((4 * n * d + 4 * n * n) * es)),
          "is_memory_bound": lambda i, p, bw: np.bool_(i < p / bw)}
    assert run_check("arithmetic-intensity", ns).passed


def test_a_right_experiment_passes_and_reports_the_miss():
    result = run_check("naive-time-experiment", {"naive_time_experiment": _experiment()})
    assert result.passed, result.message
    assert "measured / predicted" in result.message


def test_an_experiment_that_times_something_else_fails_on_the_timing(monkeypatch):
    """A 'naive attention' timed on something 50 times smaller is exact in its arithmetic but far off in time.

    The timings on both sides are fixed numbers here (the grader's measurement is replaced), so the test does not
    depend on how busy the machine is: a loaded machine slowed the learner's run and not the grader's, or the other
    way round, and the factor 50 came out under 10."""
    from attnlab.grading.exercises.e05 import checks as e05_checks

    matmul_s, copy_s, naive_s = 0.02, 0.004, 0.3             # the grader's "measurement", seconds

    def naive_time_experiment(seed, n=1024, heads=4, d=64, repeats=5):
        flop_rate, bandwidth = 2 * specs.MATMUL_SIZE ** 3 / matmul_s, 2 * specs.COPY_BYTES / copy_s
        predicted = specs.predict_naive_time(1, heads, n, d, flop_rate, bandwidth)
        return matmul_s, copy_s, flop_rate, bandwidth, predicted, naive_s / 50   # e.g. timed one head of a short input

    monkeypatch.setattr(e05_checks.specs, "measure", lambda seed, **sizes: (matmul_s, copy_s, naive_s))
    result = run_check("naive-time-experiment", LocalLearner({"naive_time_experiment": naive_time_experiment},
                                                             forbidden=[]))   # the spec's numbers: not the point here
    assert not result.passed and "measured_seconds" in result.message and "factor 0.02" in result.message, \
        result.message
    honest = lambda seed, **kw: naive_time_experiment(seed, **kw)[:5] + (naive_s * 1.5,)   # noqa: E731
    result = run_check("naive-time-experiment", LocalLearner({"naive_time_experiment": honest}, forbidden=[]))
    assert result.passed, result.message


def test_the_experiment_may_not_use_pytorch_s_attention():
    def naive_time_experiment(seed, n=1024, heads=4, d=64, repeats=5):
        q = torch.randn(1, heads, n, d)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return _experiment()(seed, n=n, heads=heads, d=d, repeats=repeats)

    result = run_check("naive-time-experiment", LocalLearner({"naive_time_experiment": naive_time_experiment},
                                                             forbidden=forbidden("naive-time-experiment")))
    assert not result.passed and "shortcut" in result.diagnosis, result.message


@pytest.mark.parametrize("part, names", [("attention-flops", ["attention_flops"]),
                                         ("attention-bytes", ["step_bytes", "attention_bytes"]),
                                         ("roofline-prediction", ["predict_naive_time"])])
def test_the_references_and_the_io_model_are_refused(part, names):
    result = run_check(part, {n: getattr(specs, n) for n in names})
    assert not result.passed and "shortcut" in result.diagnosis, result.message


def test_the_io_model_is_refused():
    from attnlab import iomodel

    result = run_check("attention-flops", {"attention_flops": lambda b, h, n, d: iomodel.attention_flops(b, h, n, d=d)})
    assert not result.passed and "shortcut" in result.diagnosis, result.message


def test_the_counts_are_the_io_model_s_and_the_prediction_its_roofline():
    b, h, n, d, es = 2, 3, 40, 8, 2
    steps = specs.step_bytes(b, h, n, d, es)
    assert steps == ((b * h * 2 * n * d * es, b * h * n * n * es), (b * h * n * n * es, b * h * n * n * es),
                     (b * h * (n * n + n * d) * es, b * h * n * d * es))
    assert specs.attention_bytes(b, h, n, d, es) == sum(r + w for r, w in steps) == b * h * (4 * n * d + 4 * n * n) * es
    p, w = 1e9, 1e8
    mm = 2 * b * h * n * n * d
    want = sum(max(f / p, (r + wr) / w) for f, (r, wr) in zip((mm, 0, mm), steps))
    assert math.isclose(specs.predict_naive_time(b, h, n, d, p, w, es), want, rel_tol=1e-12)
    assert specs.is_memory_bound(49.9, 100e12, 2e12) and not specs.is_memory_bound(50.0, 100e12, 2e12)


def test_a_mistake_that_would_have_failed_an_earlier_case_is_not_named():
    """A flipped comparison fails the first case, an inverted ridge point does not: when the learner's code passes
    that case and fails a later one where both give its answer, only the inverted ridge point is named."""
    ns = {"arithmetic_intensity": specs.arithmetic_intensity, "is_memory_bound": lambda i, p, bw: i < bw / p}
    result = run_check("arithmetic-intensity", LocalLearner(ns, forbidden=[]))
    assert not result.passed and result.diagnosis == ["ridge-inverted"], result.message
