"""The checks of exercise 06_triton_primer (one ``@CHECKS(part id)`` per graded part)."""


import torch

from attnlab.grading.core import Mistake, Registry, check_function, gen as _gen, randn as _randn
from attnlab.grading.exercises.e06 import spec as specs
from attnlab.grading.exercises.e03.spec import softmax
from attnlab.grading.kernel_check import cdiv, kernel_failure, next_power_of_2, run_guarded

CHECKS = Registry()


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


@CHECKS("softmax-traffic")
def _check_traffic(ns):
    n = check_function(ns, "softmax_traffic", specs.softmax_traffic, _TRAFFIC_CASES, _TRAFFIC_MISTAKES)
    return f"{n} sizes match the spec"


def _scale_cases():
    out = []
    for seed, (n, block) in enumerate([(1000, 128), (64, 64), (1, 32), (257, 64)]):
        g = _gen(1100 + seed)
        out.append((f"n={n}, BLOCK_SIZE={block}", _randn(g, n), 0.5 + seed, block))
    return out


@CHECKS("masked-scale")
def _check_scale(ns):
    cases = _scale_cases()
    for label, x, alpha, block in cases:
        n = x.numel()
        buffers = {"x": {"data": x[None, :]}, "y": {"shape": [1, n], "output": True}}
        args = [["buf", "x", 0], ["buf", "y", 0], ["val", n], ["val", alpha]]
        got = run_guarded(ns, "scale_kernel", label, buffers, (cdiv(n, block),), args, {"BLOCK_SIZE": block},
                          ["y"])["y"][0]
        kernel_failure(label, "scale_kernel", got, specs.scale(x, alpha), [], (x, alpha), {})
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


@CHECKS("softmax-kernel")
def _check_softmax_kernel(ns):
    cases = _softmax_kernel_cases()
    for label, x in cases:
        rows, cols = x.shape
        block = next_power_of_2(cols)
        # rows are 3 elements further apart than they are long: the kernel must use the stride
        buffers = {"x": {"data": x, "pad_cols": 3}, "y": {"shape": list(x.shape), "output": True, "pad_cols": 5}}
        args = [["buf", "y", None], ["buf", "x", None], ["stride", "x", 0], ["stride", "y", 0], ["val", cols]]
        got = run_guarded(ns, "softmax_kernel", label, buffers, (rows,), args, {"BLOCK_SIZE": block}, ["y"])["y"]
        kernel_failure(label, "softmax_kernel", got, softmax(x), _SOFTMAX_KERNEL_MISTAKES, (x,), {})
    return f"{len(cases)} inputs (odd widths, one column, large logits) match the spec, with no stray access"
