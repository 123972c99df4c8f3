import os

import pytest
from hypothesis import settings

# zen's hash seed (zen.transport.Comm), else drawn from os.urandom per group: fixed for the tests, so a failure
# that depends on the partition replays with the seed the run's header prints (ZEN_SEED=... python -m pytest).
os.environ.setdefault("ZEN_SEED", "1207")


def pytest_report_header(config):
    return f"ZEN_SEED={os.environ['ZEN_SEED']} (zen's hash seed; set it to replay a run)"


# Kernel tests run on ZEN_TEST_DEVICE (default cpu; benchmarks/gpu_check.sh sets cuda).
DEVICE = os.environ.get("ZEN_TEST_DEVICE", "cpu")

# Hypothesis profiles. "ci", the default: derandomised, so a run's examples are the same every time (a
# failure in CI reproduces, and CI never fails on an example no one changed code for). "dev": ten times
# the examples, randomised, for local runs that go looking (ZEN_HYPOTHESIS=dev python -m pytest ...).
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=600, deadline=None)
# "fuzz" (make fuzz): fresh seeds every run, rounds of it until a set time; a failure prints how to replay it.
settings.register_profile("fuzz", max_examples=2000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("ZEN_HYPOTHESIS") or "ci")


@pytest.fixture
def device():
    return DEVICE
