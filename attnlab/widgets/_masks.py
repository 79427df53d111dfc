"""The editor's link to the kernels: preset patterns, BlockMask, and costs from attnlab.iomodel."""

import numpy as np


def preset(name, n_q_blocks, n_k_blocks, param, density, seed):
    """A bool ``(n_q_blocks, n_k_blocks)`` block mask for a preset pattern.

    local: key blocks within ``param - 1`` of the query block's diagonal position;
    strided: every ``param``-th key block counted back from the diagonal, plus the diagonal;
    global: the first ``param`` key blocks (global tokens every query sees) and the first
    ``param`` query blocks (which see everything), plus the diagonal; causal: key block <=
    query block (top-left aligned); random: each tile kept with probability ``density``
    (seeded), plus the diagonal so no query row is empty; dense / empty: all / none.
    """
    i = np.arange(n_q_blocks)[:, None]
    j = np.arange(n_k_blocks)[None, :]
    if name == "local":
        return np.abs(i - j) < param
    if name == "strided":
        return (j <= i) & ((i - j) % param == 0)
    if name == "global":
        return (j < param) | (i < param) | (i == j)
    if name == "causal":
        return j <= i
    if name == "random":
        rng = np.random.default_rng(seed)
        return (rng.random((n_q_blocks, n_k_blocks)) < density) | (i == j)
    if name == "dense":
        return np.ones((n_q_blocks, n_k_blocks), bool)
    if name == "empty":
        return np.zeros((n_q_blocks, n_k_blocks), bool)
    raise ValueError(f"preset: unknown preset {name!r}")
