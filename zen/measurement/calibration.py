"""The calibration: what each scheme's formula misses on real calls of the group (the costs the
per-primitive and per-element terms leave out), measured once per probe and kept in the profile."""
import dataclasses
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Tuple

import torch

from .. import ops
from ..cost import CALIBRATION_NUMELS, Profile, predict_times
from ..schemes import registered
from ..schemes.base import Request
from ..schemes.call import run_call
from ..transport import Comm
from .timing import together_times
from .workload import measure_now


def calibrate(comm: Comm, profile: Profile, repeats: int = 5) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Seconds each scheme's formula misses on a small and on a large call (collective, on the lane): ({scheme:
    miss} at ``CALIBRATION_NUMELS[0]`` elements, density 1%; {scheme: miss} at ``CALIBRATION_NUMELS[1]``,
    density 0.01%). Every scheme all-reduces a random tensor of that size, the schemes taking turns, each call
    handed to another thread as ``zen.all_reduce`` hands it to the lane; the miss is the call's time (from
    the last rank's start to the last one's end, as the benchmarks time it; ``timing.call_seconds``) minus the
    formula's time for that call's measured workload, at least 0. The small call holds what the formulas'
    per-primitive latencies leave out (Python, the backend's per-message work); the large one also the
    waits that grow with the tensor: where ranks outnumber cores, a rank descheduled in a long local phase
    (the scan of M elements...) holds up every peer at the next collective, which the kernel probe's
    per-element rates (averaged over many back-to-back runs) do not see. Dense's formula has no local
    phase to be held up in, and its large call is the slowest of all (a ring all-reduce of 16 MiB), so
    it is calibrated small only. ``cost.Profile.miss`` interpolates between the two. The schemes are the
    registered ones (``zen.schemes.registered``), run directly (``zen.schemes.call.run_call``)."""
    small, large = CALIBRATION_NUMELS
    names = list(registered())
    return (_misses(comm, profile, repeats, small, 0.01, names),
            _misses(comm, profile, repeats, large, 1e-4, [s for s in names if s != "dense"]))


def _misses(comm: Comm, profile: Profile, repeats: int, numel: int, density: float, names) -> Dict[str, float]:
    """{scheme: measured - predicted seconds, at least 0} for all-reducing a random tensor (see :func:`calibrate`)."""
    generator = torch.Generator().manual_seed(comm.rank)
    x = torch.zeros(numel)
    x[torch.randperm(numel, generator=generator)[:max(1, int(numel * density))]] = 1.0
    x = x.to(comm.device)
    indices, values = ops.nonzero(x)
    workload, _ = measure_now(comm, comm.all_gather_ints, indices, values, numel, True)
    uncalibrated = dataclasses.replace(profile, calibration=(), calibration_large=())
    schemes = registered()
    predicted = predict_times(workload, uncalibrated, {name: schemes[name] for name in names})
    # Each call is handed to another thread and waited for, as ``zen.all_reduce`` hands its calls to the
    # lane: where ranks share cores, waking the two threads costs far more than the idle hand-off the
    # profile's call_overhead measures. The schemes take turns within every repeat, as the benchmarks run
    # them: a call's time depends on what ran before it, not only on the pause.
    with ThreadPoolExecutor(max_workers=1, initializer=torch.set_num_threads,
                            initargs=(torch.get_num_threads(),)) as caller:
        def call(scheme):
            return lambda y: caller.submit(run_call, comm, Request(y, scheme)).result()

        times = together_times(comm, [call(schemes[name]()) for name in names], repeats, prepare=x.clone)
    return {name: max(0.0, statistics.median(t) - predicted[name]) for name, t in zip(names, times)}
