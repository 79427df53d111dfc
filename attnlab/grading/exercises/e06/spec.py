"""The references of exercise 06_triton_primer: what the grader compares the learner's answers with.

Never shown in the exercise; hidden (stand-ins that raise) in a kernel that ``attnlab grade`` runs.
"""



def scale(x, alpha):
    """y = alpha * x elementwise; x: (n,)."""
    return alpha * x


def softmax_traffic(n_rows, n_cols, element_size=4):
    """Bytes of HBM traffic of a row softmax, naive (PyTorch ops) vs fused (one kernel).

    Naive (Triton's fused-softmax tutorial): x.max -> read MN, write M; x - max -> read MN + M,
    write MN; exp -> read MN, write MN; sum -> read MN, write M; divide -> read MN + M, write MN.
    In all 8MN + 4M elements. Fused: read MN, write MN = 2MN elements.
    Returns (naive_bytes, fused_bytes).
    """
    m, n = n_rows, n_cols
    naive = (8 * m * n + 4 * m) * element_size
    fused = 2 * m * n * element_size
    return naive, fused


__import__("attnlab.grading.hiding", fromlist=["hide"]).hide(globals())
