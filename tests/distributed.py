"""The tests' multi-rank launcher is zen's own (zen/local.py)."""
from zen.local import LocalBucket, RankError, free_port, run_ranks  # noqa: F401
