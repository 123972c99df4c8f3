"""zen: sparse-gradient all-reduce for PyTorch (ZEN's Balanced Parallelism and its alternatives).

    import zen
    zen.all_reduce(tensor, scheme="zen")                       # == dist.all_reduce(tensor), sparse on the wire
    ddp_model.register_comm_hook(zen.ZenState(), zen.zen_hook)  # DDP with zen
"""
__version__ = "0.1.0"

from . import ops  # noqa: F401  (loads the extension)
from .collective import Work, all_reduce
from .comm import MismatchError
from .hook import ZenState, zen_hook
from .schemes import SCHEMES

__all__ = ["all_reduce", "Work", "MismatchError", "ZenState", "zen_hook", "SCHEMES", "ops", "__version__"]
