"""Tests of kernels/vector_add.py (lesson 06's first kernel), in Triton's interpreter on the CPU."""

import pytest
import torch

from attnlab.kernels.vector_add import vector_add


@pytest.mark.parametrize("n,block", [(1, 16), (1000, 128), (1024, 1024), (4097, 512)])
def test_vector_add_matches_torch(n, block):
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(vector_add(x, y, block=block), x + y, rtol=0, atol=0)


def test_vector_add_fp16_and_empty():
    x = torch.randn(300).half()
    torch.testing.assert_close(vector_add(x, x), x + x)
    assert vector_add(torch.empty(0), torch.empty(0)).shape == (0,)


def test_vector_add_bad_input():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="y"):
        vector_add(x, torch.randn(9))
    with pytest.raises(ValueError, match="x"):
        vector_add(torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(TypeError, match="y"):
        vector_add(x, x.double())
    with pytest.raises(TypeError, match="x"):
        vector_add(torch.arange(8), torch.arange(8))
    with pytest.raises(ValueError, match="block"):
        vector_add(x, x, block=100)
    with pytest.raises(TypeError, match="x"):
        vector_add(x.bfloat16(), x.bfloat16())


def test_vector_add_traffic_is_2n_read_n_written():
    memory = pytest.importorskip("attnlab.memory")
    n = 1000
    x, y = torch.randn(n), torch.randn(n)
    tr = memory.trace(vector_add, x, y, block=256)
    assert tr.bytes_read == 2 * n * 4  # masked lanes of the last program move nothing
    assert tr.bytes_written == n * 4
    assert len(tr.programs()) == 4
