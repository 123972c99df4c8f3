"""The tests' multi-rank launcher is zen's own (zen/testing.py); and a tap on torch.distributed's collectives,
for tests that count what reaches the process groups, whatever zen reports of itself."""
import torch.distributed as dist

from zen.testing import LocalBucket, RankError, free_port, run_ranks  # noqa: F401

COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather_single", "broadcast",
               "isend", "irecv", "batch_isend_irecv", "all_gather", "reduce_scatter_tensor", "barrier", "send",
               "recv")


def tap_collectives(record, names=COLLECTIVES) -> None:
    """Wrap each of torch.distributed's collectives ``names`` (those this torch has) in this process, so that a
    call first runs ``record(name, args, kwargs)``, then the collective."""
    for name in names:
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, _tapped(name, original, record))


def _tapped(name, original, record):
    def tapped(*args, **kwargs):
        record(name, args, kwargs)
        return original(*args, **kwargs)

    return tapped
