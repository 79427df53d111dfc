"""attnlab.tiled's thread pool and attnlab.measure.peak_memory: what lesson 07's peak-memory cell relies on.

Lesson 07 (cell 16) measured ``tiled_attention`` forward + backward at n = 2048 with
``peak_memory`` and failed about once in 80 calls with "a leaf Variable that requires grad
is being used in an in-place operation": the pool's threads ran with torch's default grad
mode (on) inside autograd's forward, so they recorded graphs and raced on the autograd
history of the shared output. These tests fail deterministically where that happens.
"""

import contextlib
import threading

import torch

from attnlab.measure import peak_memory
from attnlab.tiled import _flash_backward, _flash_forward, _run_blocks, tiled_attention


@contextlib.contextmanager
def _torch_threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def test_blocks_run_in_the_callers_grad_mode():
    seen = []
    lock = threading.Lock()

    def program(i):
        with lock:
            seen.append(torch.is_grad_enabled())

    with _torch_threads(2):
        with torch.no_grad():
            _run_blocks(program, 4, torch.device("cpu"))
        assert seen == [False] * 4
        seen.clear()
        _run_blocks(program, 4, torch.device("cpu"))
        assert seen == [True] * 4


def test_forward_and_backward_leave_no_autograd_history_on_shared_buffers():
    # as inside autograd.Function.forward: no grad mode, inputs are no-grad views of leaves that require grad
    q, k, v = (torch.randn(1, 2, 256, 32, requires_grad=True) for _ in range(3))
    with _torch_threads(2), torch.no_grad():
        q3, k3, v3 = (t.reshape(2, 256, 32) for t in (q, k, v))
        assert q3.requires_grad  # what made the threads record graphs when they ran with grad mode on
        out, lse = _flash_forward(q3, k3, v3, 32**-0.5, False, 64, 64)
        assert out.grad_fn is None and lse.grad_fn is None
        dq, dk, dv = _flash_backward(q3, k3, v3, out, lse, torch.ones_like(out), None, 32**-0.5, False, 64, 64)
        assert dk.grad_fn is None and dv.grad_fn is None and dq.grad_fn is None


def test_tiled_gradients_are_unchanged_by_threads():
    q, k, v = (torch.randn(1, 2, 192, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grads = []
    for n in (1, 2):
        with _torch_threads(n):
            for t in (q, k, v):
                t.grad = None
            out = tiled_attention(q, k, v, causal=True, block_m=32, block_n=32)
            out.backward(torch.cos(out))
            grads.append([t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_peak_memory_counts_tiles_made_on_the_thread_pool():
    n, bh, block = 1024, 4, 256
    q, k, v = (torch.randn(1, bh, n, 64) for _ in range(3))
    with _torch_threads(2):
        _, peak = peak_memory(lambda: tiled_attention(q, k, v, block_m=block, block_n=block))
        assert torch.get_num_threads() == 2  # restored
    out_bytes = bh * n * 64 * 4
    tile_bytes = bh * block * block * 4  # one (BH, bq, bk) tile of S, made inside a block's program
    assert peak >= out_bytes + tile_bytes, peak
