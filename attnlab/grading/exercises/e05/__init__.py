"""Exercise 05_quadratic_cost: its parts, what each may not call, and its hints.

Every exercise package has this same light layout (read without torch by attnlab/grading/parts.py; see
attnlab/grading/exercises/__init__.py), so the tables below look alike from one exercise to the next.
"""

from attnlab.grading.exercises import ATTENTION, BLOCK_MASKS, SOFTMAX, Part  # noqa: F401

EXERCISE = "05_quadratic_cost"

# in notebook order: Part(id, title, points, names of the learner's functions the check calls, kind)
PARTS = [
    Part("attention-flops", "counting FLOPs", 1, ("attention_flops",)),
    Part("attention-bytes", "the bytes of each step", 2, ("step_bytes", "attention_bytes")),
    Part("arithmetic-intensity", "arithmetic intensity and the roofline", 2,
         ("arithmetic_intensity", "is_memory_bound")),
    Part("roofline-prediction", "a roofline prediction of the time", 2, ("predict_naive_time",)),
    Part("naive-time-experiment", "predict, then measure, naive attention on this machine", 3,
         ("naive_time_experiment",), "experiment"),
    Part("prediction-explain", "why the prediction misses", 2, (), "manual"),
]

# part id -> patterns of what its answer may not call (besides the library and the references)
FORBIDDEN = {
    "naive-time-experiment": ATTENTION,
}

# part id -> up to three hints, revealed one per call of hint("part id")
HINTS = {
    "attention-flops": [
        "Only the two matrix products count: S = Q K^T and O = P V, in every head of every sequence.",
        "A (m, k) @ (k, n) product does m*n*k multiply-adds, that is 2*m*n*k FLOPs. What are m, k and n for "
        "Q K^T with Q, K of shape (n, d)? And for P V with P (n, n), V (n, d)?",
        "Each of the two products costs 2 * n * n * d per head; multiply the sum by batch and heads.",
    ],
    "attention-bytes": [
        "Go step by step through Algorithm 0: what does each step read from memory, and what does it write? Count "
        "elements first, then multiply by element_size, batch and heads.",
        "S = QK^T reads Q and K (n*d each) and writes S (n*n). The softmax reads S and writes P (n*n each). "
        "O = PV reads P (n*n) and V (n*d) and writes O (n*d).",
        "Return a tuple of three (read, written) pairs in the order scores, softmax, pv, each "
        "batch * heads * elements * element_size; attention_bytes is the sum of all six numbers.",
    ],
    "arithmetic-intensity": [
        "Arithmetic intensity is work per byte moved: reuse your attention_flops and attention_bytes.",
        "A machine with peak compute P (FLOP/s) and bandwidth W (byte/s) has its ridge point at P / W FLOP per byte.",
        "Below the ridge point a kernel is memory-bound: intensity < peak_flops / bandwidth (strictly: at the ridge "
        "point itself both limits are reached at once, and we call it compute-bound).",
    ],
    "roofline-prediction": [
        "Naive attention runs three separate steps, one after the other; predict each step's time on its own and "
        "add them up.",
        "On the roofline a step takes at least its FLOPs / flop_rate (the arithmetic) and at least its bytes / "
        "bandwidth (the memory traffic); when both overlap, the longer of the two is the time.",
        "time = sum over the steps scores, softmax, pv of max(flops_step / flop_rate, bytes_step / bandwidth), with "
        "2*n*n*d*batch*heads FLOPs for scores and pv, 0 for the softmax, and the bytes of step_bytes.",
    ],
    "naive-time-experiment": [
        "Three timings, each the fastest of `repeats` runs after one warm-up run: a MATMUL_SIZE x MATMUL_SIZE "
        "float32 matmul, a copy of COPY_BYTES bytes into a tensor allocated beforehand, and your naive attention.",
        "flop_rate = 2 * MATMUL_SIZE**3 / matmul_seconds; bandwidth = 2 * COPY_BYTES / copy_seconds (a copy reads "
        "and writes every byte); the prediction is your predict_naive_time(1, heads, n, d, flop_rate, bandwidth).",
        "Time in seconds (time.perf_counter() differences, or attnlab.measure.time_call(fn, repeats=repeats, "
        "reduce='min')). Make q, k, v with torch.randn(1, heads, n, d, generator=torch.Generator().manual_seed(seed)) "
        "outside the timed function; time only S = q @ k^T / sqrt(d), P = softmax(S), O = P @ v.",
    ],
}
