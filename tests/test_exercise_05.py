"""Exercise 05 (the quadratic cost): wrong implementations fail their check with the matching diagnosis."""



from attnlab.grading.exercises.e05 import spec as specs
from attnlab.grading.checks import run_check
from mistakes import Wrong

WRONG = Wrong()


WRONG.add("attention-flops", "multiply-add-once", attention_flops=lambda b, h, n, d: b * h * 2 * n * n * d)
WRONG.add("attention-flops", "swapped-n-d", attention_flops=lambda b, h, n, d: b * h * 4 * n * d * d)
WRONG.add("attention-flops", "per-head-only", attention_flops=lambda b, h, n, d: 4 * n * n * d)

WRONG.add("attention-bytes", "elements-not-bytes", attention_bytes=lambda b, h, n, d, es=4: b * h * (4 * n * d + 4 * n * n))
WRONG.add("attention-bytes", "writes-only", attention_bytes=lambda b, h, n, d, es=4: b * h * (2 * n * n + n * d) * es)
WRONG.add("attention-bytes", "matrices-only", attention_bytes=lambda b, h, n, d, es=4: b * h * 4 * n * n * es)

_OK_BOUND = {"is_memory_bound": specs.is_memory_bound}
WRONG.add("arithmetic-intensity", "inverted-ratio", **_OK_BOUND,
      arithmetic_intensity=lambda b, h, n, d, es=4: specs.attention_bytes(b, h, n, d, es) / specs.attention_flops(
          b, h, n, d))
WRONG.add("arithmetic-intensity", "elements-not-bytes", **_OK_BOUND,
      arithmetic_intensity=lambda b, h, n, d, es=4: 4 * n * n * d / (4 * n * d + 4 * n * n))
_OK_AI = {"arithmetic_intensity": specs.arithmetic_intensity}
WRONG.add("arithmetic-intensity", "comparison-flipped", **_OK_AI, is_memory_bound=lambda i, p, bw: i >= p / bw)
WRONG.add("arithmetic-intensity", "ridge-inverted", **_OK_AI, is_memory_bound=lambda i, p, bw: i < bw / p)


test_wrong_implementation_fails_with_its_diagnosis = WRONG.test()


def test_numpy_scalars_pass():
    import numpy as np

    ns = {"arithmetic_intensity": lambda b, h, n, d, es=4: np.float64(4 * n * n * d / ((4 * n * d + 4 * n * n) * es)),
          "is_memory_bound": lambda i, p, bw: np.bool_(i < p / bw)}
    assert run_check("arithmetic-intensity", ns).passed
