"""The all-reduce schemes, by name. ``SCHEMES`` lists what ``zen.all_reduce(scheme=...)`` accepts.

    dense       torch.distributed.all_reduce (ring), the baseline
    agsparse    all-gather of every rank's COO, then a local sum (gloo's sparse allreduce, Horovod)
    sparcml     recursive doubling with incremental merging, dense past the break-even density (SparCML)
    omnireduce  fixed blocks, bitmap of non-zero blocks, contiguous ownership, push and pull (OmniReduce)
    zen         Balanced Parallelism: hash partition, push, aggregate, pull with the hash bitmap (ZEN)
    auto        the cost model's choice among the others, per tensor size, re-checked periodically
"""
import threading

from .agsparse import AllGatherSparse
from .auto import Auto
from .balanced import BalancedParallelism
from .dense import Dense
from .omnireduce import OmniReduce
from .sparcml import SparCML

_FACTORIES = {
    "dense": Dense,
    "zen": BalancedParallelism,
    "agsparse": AllGatherSparse,
    "sparcml": SparCML,
    "omnireduce": OmniReduce,
    "auto": Auto,
}
SCHEMES = tuple(_FACTORIES)


_shared_auto = []
_shared_lock = threading.Lock()


def make_scheme(name: str, **settings):
    """A scheme instance; ``settings`` go to its constructor. Raises ValueError on an unknown name.

    "auto" without settings is one instance per process: ``zen.all_reduce`` builds its scheme per call,
    and auto's history (what it measured and picked, per group and tensor size) must outlive the call."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown scheme {name!r}; allowed: {', '.join(SCHEMES)}")
    if name == "auto" and not settings:
        with _shared_lock:
            if not _shared_auto:
                _shared_auto.append(Auto())
            return _shared_auto[0]
    return _FACTORIES[name](**settings)
