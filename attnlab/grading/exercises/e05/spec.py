"""The references of exercise 05_quadratic_cost: what the grader compares the learner's answers with.

Never shown in the exercise; hidden (stand-ins that raise) in a kernel that ``attnlab grade`` runs.
"""



def attention_flops(batch, heads, n, d):
    """FLOPs of standard attention's two matmuls (a multiply-add counts 2).

    S = Q K^T: 2 n^2 d per head; O = P V: 2 n^2 d per head. The softmax is not counted.
    """
    return batch * heads * (2 * n * n * d + 2 * n * n * d)


def attention_bytes(batch, heads, n, d, element_size=4):
    """HBM bytes standard attention moves when it materialises S and P.

    Per head, in elements: read Q, K (2nd), write S (n^2), read S (n^2), write P (n^2),
    read P (n^2) and V (nd), write O (nd): 4nd + 4n^2.
    """
    elements = 4 * n * d + 4 * n * n
    return batch * heads * elements * element_size


def arithmetic_intensity(batch, heads, n, d, element_size=4):
    """FLOPs per HBM byte of standard attention."""
    return attention_flops(batch, heads, n, d) / attention_bytes(batch, heads, n, d, element_size)


def is_memory_bound(intensity, peak_flops, bandwidth):
    """True when a kernel of this intensity (FLOP/byte) cannot reach peak compute.

    The machine's ridge point is peak_flops / bandwidth (FLOP/s over byte/s).
    """
    return intensity < peak_flops / bandwidth


__import__("attnlab.grading.hiding", fromlist=["hide"]).hide(globals())
