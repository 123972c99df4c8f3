"""The tests' multi-rank launcher is zen's own (zen/testing.py)."""
from zen.testing import LocalBucket, RankError, free_port, run_ranks  # noqa: F401
