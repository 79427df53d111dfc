"""Shared test settings. Fixtures that only one test file uses stay in that file."""

import os

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
