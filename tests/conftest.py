import os

import pytest
from hypothesis import settings

# Kernel tests run on ZEN_TEST_DEVICE (default cpu; benchmarks/gpu_check.sh sets cuda).
DEVICE = os.environ.get("ZEN_TEST_DEVICE", "cpu")

settings.register_profile("default", max_examples=60, deadline=None)
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture
def device():
    return DEVICE
