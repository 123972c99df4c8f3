"""zen: sparse-gradient all-reduce for PyTorch (ZEN's Balanced Parallelism and its alternatives).

    import zen
    zen.all_reduce(tensor, scheme="zen")                       # == dist.all_reduce(tensor), sparse on the wire
    ddp_model.register_comm_hook(zen.ZenState(), zen.zen_hook)  # DDP with zen
"""
__version__ = "0.1.0"

from . import ops  # noqa: F401  (loads the extension)
from .collective import Work, all_reduce
from .comm import BrokenGroupError, MismatchError
from .hook import ZenState, zen_hook
from .schemes import SCHEMES
from . import cost
from .cost import Profile, Workload
from .prediction import measure, predict, predict_memory, probe_profile, set_profile

__all__ = ["all_reduce", "Work", "MismatchError", "BrokenGroupError", "ZenState", "zen_hook", "SCHEMES", "ops", "__version__"]
__all__ += ["predict", "predict_memory", "measure", "set_profile", "probe_profile", "Profile", "Workload", "cost"]
