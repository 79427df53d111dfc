"""The checks of exercise 05_quadratic_cost (one ``@CHECKS(part id)`` per graded part)."""



from attnlab.grading.core import Mistake, Registry, check_function
from attnlab.grading.exercises.e05 import spec as specs

CHECKS = Registry()


_SIZES = [(1, 1, 1024, 64), (2, 8, 512, 128), (4, 12, 2048, 64), (1, 2, 100, 30)]


def _size_cases(with_elem=False):
    cases = []
    for i, (b, h, n, d) in enumerate(_SIZES):
        if with_elem:
            es = [4, 2, 2, 1][i]
            cases.append((f"batch={b}, heads={h}, n={n}, d={d}, element_size={es}", (b, h, n, d, es), {}))
        else:
            cases.append((f"batch={b}, heads={h}, n={n}, d={d}", (b, h, n, d), {}))
    return cases


_FLOPS_MISTAKES = [
    Mistake("multiply-add-once", "a multiply-add counts as 2 FLOPs (or: both matmuls, QK^T and PV, must be counted)",
            lambda b, h, n, d: b * h * 2 * n * n * d),
    Mistake("swapped-n-d", "n and d are swapped: each matmul costs 2 n^2 d, quadratic in the sequence length",
            lambda b, h, n, d: b * h * 4 * n * d * d),
    Mistake("per-head-only", "this is one head of one sequence: multiply by batch and heads",
            lambda b, h, n, d: 4 * n * n * d),
]


@CHECKS("attention-flops")
def _check_flops(ns):
    n = check_function(ns, "attention_flops", specs.attention_flops, _size_cases(), _FLOPS_MISTAKES)
    return f"{n} sizes match the spec"


_BYTES_MISTAKES = [
    Mistake("elements-not-bytes", "this counts elements: multiply by element_size",
            lambda b, h, n, d, es=4: specs.attention_bytes(b, h, n, d, 1)),
    Mistake("writes-only", "only the writes are counted: S and P are also read back, and Q, K, V read",
            lambda b, h, n, d, es=4: b * h * (2 * n * n + n * d) * es),
    Mistake("matrices-only", "only S and P are counted: Q, K, V are read and O written too (4nd elements)",
            lambda b, h, n, d, es=4: b * h * 4 * n * n * es),
    Mistake("per-head-only", "this is one head of one sequence: multiply by batch and heads",
            lambda b, h, n, d, es=4: (4 * n * d + 4 * n * n) * es),
]


@CHECKS("attention-bytes")
def _check_bytes(ns):
    n = check_function(ns, "attention_bytes", specs.attention_bytes, _size_cases(True), _BYTES_MISTAKES)
    return f"{n} sizes match the spec"


_INTENSITY_MISTAKES = [
    Mistake("inverted-ratio", "this is bytes per FLOP: arithmetic intensity is FLOPs / bytes",
            lambda b, h, n, d, es=4: specs.attention_bytes(b, h, n, d, es) / specs.attention_flops(b, h, n, d)),
    Mistake("elements-not-bytes", "divide by bytes, not elements",
            lambda b, h, n, d, es=4: specs.attention_flops(b, h, n, d) / specs.attention_bytes(b, h, n, d, 1)),
    Mistake("multiply-add-once", "a multiply-add counts as 2 FLOPs",
            lambda b, h, n, d, es=4: specs.attention_flops(b, h, n, d) / 2 / specs.attention_bytes(b, h, n, d, es)),
]

_BOUND_CASES = [
    ("intensity 10 FLOP/B on 100 TFLOP/s and 2 TB/s", (10.0, 100e12, 2e12), {}),
    ("intensity 200 FLOP/B on 100 TFLOP/s and 2 TB/s", (200.0, 100e12, 2e12), {}),
    ("intensity 5 FLOP/B on 8 TFLOP/s and 0.3 TB/s", (5.0, 8e12, 0.3e12), {}),
    ("intensity 40 FLOP/B on 8 TFLOP/s and 0.3 TB/s", (40.0, 8e12, 0.3e12), {}),
]

_BOUND_MISTAKES = [
    Mistake("comparison-flipped", "the comparison is flipped: below the ridge point a kernel is memory-bound",
            lambda i, p, bw: i > p / bw),
    Mistake("ridge-inverted", "the ridge point is peak_flops / bandwidth (FLOP per byte), not its inverse",
            lambda i, p, bw: i < bw / p),
]


@CHECKS("arithmetic-intensity")
def _check_intensity(ns):
    n = check_function(ns, "arithmetic_intensity", specs.arithmetic_intensity, _size_cases(True), _INTENSITY_MISTAKES)
    n += check_function(ns, "is_memory_bound", specs.is_memory_bound, _BOUND_CASES, _BOUND_MISTAKES)
    return f"{n} cases match the spec"
