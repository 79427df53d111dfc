"""The references of exercise 06_triton_primer: what the grader compares the learner's kernels with.

Never shown in the exercise; an empty file in the sandbox where ``attnlab grade`` runs a notebook. The general
concepts come from the library (the row softmax, the causal mask, the tiled matmul's traffic model).
"""

from attnlab.attention import causal_mask, softmax
from attnlab.iomodel import matmul_io


def scale(x, alpha):
    """y = alpha * x elementwise; x: (n,)."""
    return alpha * x


def transpose(x):
    """y = x^T; x: (M, N) -> (N, M)."""
    return x.t().contiguous()


def outer(x, y):
    """out[i, j] = x[i] * y[j]; x: (M,), y: (N,) -> (M, N)."""
    return x[:, None] * y[None, :]


def row_sum(x):
    """out[i] = sum_j x[i, j]; x: (M, N) -> (M,)."""
    return x.sum(-1)


def row_softmax(x):
    """Softmax over each row; x: (M, N) -> (M, N)."""
    return softmax(x, dim=-1)


def matmul(a, b):
    """c = a @ b; a: (M, K), b: (K, N) -> (M, N), float32 products (as input_precision="ieee")."""
    return a @ b


def causal_scores(s, scale):
    """out[i, j] = scale * s[i, j] where key j <= query i, else -inf; s: (n_q, n_k) -> (n_q, n_k)."""
    return (s * scale).masked_fill(~causal_mask(s.shape[0], s.shape[1]), float("-inf"))


def tiles_touching_causal(n_q, n_k, block_m, block_n):
    """Elements of S in the (block_m, block_n) tiles that hold at least one kept (j <= i) entry:
    what a causal kernel needs to read at most (tiles wholly above the diagonal are all -inf)."""
    return sum((min(i0 + block_m, n_q) - i0) * min(n_k, ((min(i0 + block_m, n_q) - 1) // block_n + 1) * block_n)
               for i0 in range(0, n_q, block_m))


def matmul_traffic(M, N, K, block, seed=0):
    """Bytes a float32 (block x block)-tiled matmul C (M, N) = A (M, K) @ B (K, N) reads: A once per column of
    tiles, B once per row of tiles (whatever the seed: the traffic depends on the shapes only)."""
    return matmul_io(M, N, K, 4, block, block).bytes_read
