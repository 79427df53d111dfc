"""Shared test settings. Fixtures that only one test file uses stay in that file."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Property tests run few, small examples: the suite must stay fast on a 2-core CPU,
# and Triton's interpreter has a fixed cost per operation.
settings.register_profile(
    "attnlab",
    max_examples=int(os.environ.get("ATTNLAB_HYPOTHESIS_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("attnlab")


@pytest.fixture
def large_fp16_qkv():
    """A maker of float16 q, k, v (1, 2, n, d) of magnitude about 100 (as peers' edge-case suites use)
    whose scores are large (about 2e4 to 3e4, where float16's spacing is 16 or 32) but differ by tens
    along a row, so the softmax is not one-hot: the keys share one large direction. Used by the
    float16 tests of standard attention and of the flash kernels' gradients."""

    def make(d, n=48, seed=0):
        g = torch.Generator().manual_seed(seed)
        q = 100 * torch.randn(1, 2, n, d, generator=g)
        k = 100 * torch.randn(1, 2, 1, d, generator=g) + 0.2 * torch.randn(1, 2, n, d, generator=g)
        v = 100 * torch.randn(1, 2, n, d, generator=g)
        return [t.half() for t in (q, k, v)]

    return make
