"""Timing on a group: calls timed as the benchmarks time them (from the last rank's start to the last one's
end, from a quiet common start), kernels timed with every rank running them at once."""
import functools
import math
import os
import statistics
import time
from typing import List, Tuple

from ..schemes.base import phase_range
from ..transport import Comm

PS = 1e12  # times travel between ranks as integer picoseconds
RATE_SECONDS = 0.03  # the probes grow their messages, or repeat their kernels, until one run takes this long
# Pause before each timed call (here and in benchmarks/allreduce.py): where ranks share cores, CPU work just
# before a call (preparing its input, checking the last result) slows it through the scheduler; timed from a
# quiet start, a call's time is its own.
QUIET_SECONDS = 0.05


def median_time(fn, repeats: int) -> float:
    """Median seconds of ``fn`` on this rank over ``repeats`` runs, after a warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@functools.lru_cache(maxsize=1)
def clock_id() -> int:
    """An id of the clock that ``time.perf_counter`` reads (CLOCK_MONOTONIC, one per booted kernel): ranks
    with the same id can compare their times; ranks that share no host (or cannot tell) never match."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return int(f.read().strip().replace("-", "")[:15], 16)
    except (OSError, ValueError):
        return -int.from_bytes(os.urandom(7), "little") - 1


def call_seconds(starts, ends, clocks) -> List[float]:
    """Per call i, its time on the group from every rank's ``starts[r][i]`` and ``ends[r][i]`` (perf_counter
    seconds) and ``clocks[r]`` (:func:`clock_id`). On one clock: from the moment the last rank starts the
    call to the moment the last one ends it, max_r end - max_r start: the collective itself, which the cost
    model predicts. A rank that starts early only waits for the last (ranks that share cores leave a
    barrier milliseconds apart; no network adds that). Without a shared clock: the slowest rank's own time,
    max_r (end - start), which also holds that spread."""
    calls = zip(zip(*starts), zip(*ends))  # per call: (every rank's start, every rank's end)
    if len(set(clocks)) == 1:
        return [max(ends_i) - max(starts_i) for starts_i, ends_i in calls]
    return [max(end - start for start, end in zip(starts_i, ends_i)) for starts_i, ends_i in calls]


def trial_seconds(comm: Comm, start: float, owner: str) -> float:
    """The time on the group of a trial call that this rank started at ``start`` (``time.perf_counter``) and has
    just ended, the same on every rank: one all-gather of three int64 per rank (its :func:`clock_id`, start and
    end in ns), then :func:`call_seconds` (from the last rank's start to the last one's end). The one trial timer
    of the policies that time their options (``scheme="auto"``, ``hierarchy="auto"``); the exchange runs under
    the profiler's range ``zen::<owner>::trial_time``."""
    end = time.perf_counter()
    with phase_range(owner, "trial_time"):
        rows = comm.all_gather_ints([clock_id(), round(start * 1e9), round(end * 1e9)]).tolist()
    return call_seconds([row[1:2] for row in rows], [row[2:3] for row in rows], [row[0] for row in rows])[0] / 1e9


def together_times(comm: Comm, fns, repeats: int, least: float = 0.0, prepare=None) -> List[List[float]]:
    """Seconds of each of ``fns`` run by every rank at once: ``times[i][r]`` for ``fns[i]`` in repeat r after a
    common start, the same on every rank. The fns take turns within every repeat, so the times of one
    repeat saw the same load on the host: a difference of two of them (a kernel's time less the part of
    it that another one measures) can be taken per repeat, where a slow spell of a shared host cancels,
    and calls of several schemes see each other's traces, as in the benchmarks.

    Kernels (``least`` > 0): each repeat runs a fn back to back as often as makes the slowest rank take at
    least ``least`` seconds (the same count on every rank); the time is the slowest rank's own, per run (a
    short kernel would otherwise end before ranks that share cores have all been scheduled, and look
    uncontended). Calls (``least`` = 0): one run per repeat, after a pause of ``QUIET_SECONDS`` (as the
    benchmarks pause, so that it starts quiet), timed as the benchmarks time a call (:func:`call_seconds`:
    from the last rank's start to the last one's end, where the ranks share a clock; and, as they do, no rank
    goes on before the last has ended). ``prepare`` (calls only): run before every run, untimed, its result
    passed to the fn (e.g. a fresh copy of the tensor that an all-reduce overwrites, as the benchmarks make
    one)."""
    if prepare is not None and least > 0:
        raise ValueError("_together_times: prepare needs least = 0 (one run per repeat)")

    def timed(fn, runs: int) -> Tuple[int, int]:
        args = (prepare(),) if prepare is not None else ()
        if least == 0:
            time.sleep(QUIET_SECONDS)
        comm.all_gather_ints([0])  # the common start
        start = time.perf_counter()
        for _ in range(runs):
            fn(*args)
        end = time.perf_counter()
        comm.all_gather_ints([0])  # the common end: no rank's next work slows a rank still running
        return round(start * PS), round(end * PS)

    def length(span: Tuple[int, int]) -> int:  # picoseconds
        return span[1] - span[0]

    counts = []
    for fn in fns:
        timed(fn, 1)  # warm-up
        runs = 1
        if least > 0:
            once = comm.all_gather_ints([length(timed(fn, 1))]).max().item() / PS
            runs = max(1, min(1000, math.ceil(least / max(once, 1e-9))))
        counts.append(runs)
    spans = [timed(fn, runs) for _ in range(repeats) for fn, runs in zip(fns, counts)]
    if least > 0:
        slowest = comm.all_gather_ints([length(span) for span in spans]).max(dim=0).values.tolist()
    else:
        rows = comm.all_gather_ints([clock_id()] + [t for span in spans for t in span]).tolist()
        slowest = call_seconds([row[1::2] for row in rows], [row[2::2] for row in rows], [row[0] for row in rows])
    return [[slowest[r * len(fns) + i] / PS / runs for r in range(repeats)] for i, runs in enumerate(counts)]
