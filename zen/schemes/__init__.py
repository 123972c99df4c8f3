"""The fixed schemes, registered by name (``zen.schemes.registry``); one module per scheme (zen's: a package,
``zen.schemes.balanced``) holds its protocol and its cost formulas.

    dense       torch.distributed.all_reduce (ring), the baseline
    agsparse    all-gather of every rank's COO, then a local sum (gloo's sparse allreduce, Horovod)
    sparcml     recursive doubling with incremental merging, dense past the break-even density (SparCML)
    omnireduce  fixed blocks, bitmap of non-zero blocks, contiguous ownership, push and pull (OmniReduce)
    zen         Balanced Parallelism: hash partition, push, aggregate, pull with the hash bitmap (ZEN)

(``scheme="auto"``, the cost model's choice among them, is a policy above the measurement: :mod:`zen.auto`.)
"""
from .agsparse import AllGatherSparse
from .balanced import BalancedParallelism
from .base import Call, Scheme
from .dense import Dense
from .omnireduce import OmniReduce
from .registry import register_scheme, registered, registered_statistics, scheme_class
from .sparcml import SparCML

register_scheme("dense", Dense)
register_scheme("agsparse", AllGatherSparse)
register_scheme("sparcml", SparCML)
register_scheme("omnireduce", OmniReduce)
register_scheme("zen", BalancedParallelism)

__all__ = ["Call", "Scheme", "register_scheme", "registered", "registered_statistics", "scheme_class", "Dense",
           "BalancedParallelism", "AllGatherSparse", "SparCML", "OmniReduce"]
