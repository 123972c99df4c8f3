"""zen: sparse-gradient all-reduce for PyTorch (ZEN's Balanced Parallelism and its alternatives).

    import zen
    zen.all_reduce(tensor, scheme="zen")                       # == dist.all_reduce(tensor), sparse on the wire
    ddp_model.register_comm_hook(zen.ZenState(), zen.zen_hook)  # DDP with zen
    zen.register_scheme("mine", MyScheme)                      # a scheme of your own, everywhere at once

The package is layered; each layer imports only from the ones below it (tests/test_layers.py checks):

    1 kernels and formats   ops, wire
    2 shared geometry       geometry, units
    3 transport, agreement  transport, lane, schedules, agreement
    4 cost model            cost (model, terms, estimate, statistics)
    5 fixed schemes         schemes (registry, base, call, one module per scheme; balanced: scheme, push,
                            pull, cost)
    6 measurement           measurement (store, timing, kernels, probe, calibration, workload)
    7 policy                auto, topk, hierarchy (policy, node, plan, strided, coo, topology, cost, prediction)
    8 face                  collective, hook, bucket_plan, totals, prediction, planner, info, testing
"""
__version__ = "0.1.0"

from . import ops  # noqa: F401  (loads the extension)
from . import cost
from .agreement import MismatchError
from .collective import SCHEMES, Work, all_reduce, make_scheme
from .cost import Profile, Workload
from .hook import SchemeSettings, ZenState, zen_hook
from .measurement.store import set_profile
from .prediction import measure, predict, predict_memory, predict_phases, predict_times, probe_profile
from .schemes import Scheme, register_scheme
from .topk import TopK
from .transport import BrokenGroupError, PeerError

__all__ = ["all_reduce", "Work", "MismatchError", "BrokenGroupError", "PeerError", "ZenState", "zen_hook",
           "TopK", "SchemeSettings", "SCHEMES", "ops", "__version__", "make_scheme", "Scheme", "register_scheme",
           "predict", "predict_memory", "predict_times", "predict_phases", "measure", "set_profile", "probe_profile",
           "Profile", "Workload", "cost"]
