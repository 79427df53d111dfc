"""The references of exercise 06_triton_primer (empty in the sandbox): the general ones are the library's."""

from attnlab.attention import causal_mask, softmax
from attnlab.iomodel import matmul_io


def scale(x, alpha):
    return alpha * x


def transpose(x):
    return x.t().contiguous()


def outer(x, y):
    return x[:, None] * y[None, :]


def row_sum(x):
    return x.sum(-1)


def row_softmax(x):
    return softmax(x, dim=-1)


def matmul(a, b):
    """c = a @ b; a: (M, K), b: (K, N) -> (M, N), float32 products (as input_precision="ieee")."""
    return a @ b


def causal_scores(s, scale):
    """out[i, j] = scale * s[i, j] where key j <= query i, else -inf; s: (n_q, n_k) -> (n_q, n_k)."""
    return (s * scale).masked_fill(~causal_mask(s.shape[0], s.shape[1]), float("-inf"))


def tiles_touching_causal(n_q, n_k, block_m, block_n):
    """Elements of S in the (block_m, block_n) tiles that keep an entry (j <= i): what a causal kernel reads."""
    return sum((min(i0 + block_m, n_q) - i0) * min(n_k, ((min(i0 + block_m, n_q) - 1) // block_n + 1) * block_n)
               for i0 in range(0, n_q, block_m))


def matmul_traffic(M, N, K, block, seed=0):
    """Bytes a float32 (block x block)-tiled matmul A (M, K) @ B (K, N) reads, whatever the seed."""
    return matmul_io(M, N, K, 4, block, block).bytes_read
