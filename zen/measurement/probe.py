"""The network probe: the group's fixed costs and rates, measured with zen's own transport, then the local
kernels and the calibration, into one :class:`zen.cost.Profile` that every rank agrees on."""
import dataclasses
import logging
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..cost import CALIBRATION_NUMELS, PRIMITIVES, Profile
from ..geometry import DUPLEX_ALL_TO_ALL_BYTES
from ..schemes import registered
from ..transport import Comm
from . import store
from .calibration import calibrate
from .kernels import probe_kernels
from .timing import PS, RATE_SECONDS, median_time, together_times

logger = logging.getLogger("zen")


def _size(b: int) -> str:
    return f"{b / (1 << 20):g} MiB" if b >= 1 << 20 else f"{b / 1024:g} KiB"


def slope_rate(unit: int, one: float, four: float, fixed: float = 0.0) -> float:
    """Bytes/s from the median seconds of sending ``unit`` and 4 ``unit`` bytes. With t(b) = c + b / r, the
    slope r = 3 u / (t(4u) - t(u)), free of the fixed cost c. Where noise swamps the difference (under an
    eighth of t(4u), which holds it while c < 20 u / r), that slope can come out any size, even negative:
    then the 4u send alone, r = 4 u / (t(4u) - c), with ``fixed`` for c, at most half of t(4u)."""
    difference = four - one
    if difference > four / 8:
        return 3 * unit / difference
    return 4 * unit / (four - min(fixed, four / 2))


def probe_now(comm: Comm, message_bytes: int = 1 << 20, repeats: int = 5) -> Profile:
    """Measure the group's profile (collective; on the calling thread, which must be the group's lane).
    Every rank measures; the result is the per-field median over the ranks (the same on every rank).

    Fixed costs: the median time of a tiny call of each primitive, timed as a call like the sizes below
    (the pairwise rate subtracts its fixed cost from such a time). Rates: bytes sent per rank per second,
    from the slope between sending u and 4 u bytes (so TCP's ramp-up and the fixed cost cancel out), u
    from ``message_bytes`` doubled (up to 8x) until one send of u takes ``RATE_SECONDS`` on the slowest
    rank (so a few ms of jitter stay small beside the slope's difference): a ring all-reduce (2 (n-1)/n
    bytes sent per byte reduced; at most a ring step's rate), an all-to-all; a pairwise exchange's rate
    from 4 u alone, 4 u over its median time less its fixed cost (see below). The sizes are timed as calls
    (:func:`zen.measurement.timing.together_times`: a common start, then from the last rank's start to the last
    one's end): timed back to back on each rank, ranks drift into each other's calls and overrate all-to-alls.
    Local: zen's kernels, every rank at once (:func:`zen.measurement.kernels.probe_kernels`). Then, on the agreed
    profile, :func:`zen.measurement.calibration.calibrate`."""
    n, me, device = comm.world, comm.rank, comm.device
    mine, rates = {}, {}
    unit = message_bytes
    started = time.perf_counter()
    # Said before it starts: the probe is collective and runs once per group, so a first zen.predict (or
    # scheme "auto") would seem to hang without it. It takes longer on slower links.
    # Printed (no logging setup needed), by the group's first rank only: one line per probe.
    if n > 1 and me == 0:
        most = 4 * max(8 * message_bytes, DUPLEX_ALL_TO_ALL_BYTES * (n - 1))  # the slopes' largest send
        print(f"zen: probing the links of a group of {n} ranks ({comm.backend}, {device.type}), once per group: "
              f"fixed costs, all-reduce, all-to-all and pairwise rates ({_size(message_bytes)} up to {_size(most)} "
              f"per rank), zen's kernels and a calibration of {len(registered())} schemes; about 10-30 s, longer "
              f"on slow links. zen.set_profile(group, bandwidth=..., latency=...) skips it.",
              file=sys.stderr, flush=True)

    def slope(run, unit, grow=True, fixed=0.0):
        """(bytes/s, unit) of ``run(b)`` (b bytes sent per rank; collective), from the slope between
        b = unit and b = 4 unit: 3 unit over the difference of their median times over ``repeats`` runs; with
        ``grow``, unit doubles alike on every rank (the slowest decides). Not the median of the per-repeat
        differences: single slow runs spoil a difference when either of its runs is slow, twice as often as
        a median of one size. ``fixed``: the primitive's fixed cost, for :func:`slope_rate`."""
        t_one = median_time(lambda: run(unit), repeats)
        while (grow and 2 * unit <= largest_unit
               and comm.all_gather_ints([round(t_one * PS)]).max() < RATE_SECONDS * PS):
            unit *= 2
            t_one = median_time(lambda: run(unit), repeats)
        ones, fours = together_times(comm, [lambda: run(unit), lambda: run(4 * unit)], repeats)
        return slope_rate(unit, statistics.median(ones), statistics.median(fours), fixed), unit

    if n > 1:
        one = torch.zeros(1, device=device)
        a2a_in = torch.zeros(8 * n, dtype=torch.uint8, device=device)
        a2a_out = torch.empty_like(a2a_in)
        tiny = dict(allgather=lambda: comm.all_gather_ints([0]),
                    allreduce=lambda: dist.all_reduce(one, group=comm.group),
                    alltoall=lambda: comm.all_to_all(a2a_out, a2a_in, [8] * n, [8] * n, 8))
        for name, times in zip(tiny, together_times(comm, list(tiny.values()), 2 * repeats + 1)):
            mine[name] = statistics.median(times)
        # All-to-all pieces of at least DUPLEX_ALL_TO_ALL_BYTES: large all-to-alls' transport
        # (``Comm.all_to_all``) at both ends of the slope.
        a2a_unit = max(unit, DUPLEX_ALL_TO_ALL_BYTES * (n - 1))
        largest_unit = max(8 * unit, a2a_unit)
        big = torch.zeros((largest_unit * n // (n - 1) + 2) * 4, dtype=torch.uint8, device=device)  # 4 units n/(n-1)
        big_in = torch.empty_like(big)
        floats = big.view(torch.float32)
        rates["allreduce"], unit = slope(lambda b: dist.all_reduce(floats[:b * n // (8 * (n - 1))], group=comm.group),
                                         unit, fixed=mine["allreduce"])
        if n > 2:
            # Shaped links refill their token buckets between the ring's 2 (n-1) steps, so all-reduces too
            # small for them overrate it; a ring step alone (to the right, from the left) bounds it. Only a
            # clear overrate: at the grown unit the two agree, and the smaller of two noisy estimates of one
            # rate is biased low.
            right, left = (me + 1) % n, (me - 1) % n
            ring_step, _ = slope(lambda b: comm.exchange([(right, big[:b])], [(left, big_in[:b])]), unit)
            if rates["allreduce"] > 1.5 * ring_step:
                rates["allreduce"] = ring_step

        def all_to_all(b):  # b bytes to the n-1 peers; the piece size picks the transport
            piece = b // (n - 1)
            comm.all_to_all(big_in[:piece * n], big[:piece * n], [piece] * n, [piece] * n, piece)

        rates["alltoall"], _ = slope(all_to_all, max(unit, a2a_unit), fixed=mine["alltoall"])
        if comm.reverse_group is not None and n > 2:
            # Smaller all-to-alls go as gloo's own (between two ranks, only the smallest: its rate is
            # left unmeasured there): pieces of 96 and 384 KiB, under DUPLEX_ALL_TO_ALL_BYTES at both ends.
            rates["alltoall_small"], _ = slope(all_to_all, (96 << 10) * (n - 1), grow=False, fixed=mine["alltoall"])
        peer = me ^ 1 if (me ^ 1) < n else None  # (the last rank of an odd group sits the pairs out)
        peers = [peer] if peer is not None else []

        def exchange(b):  # b bytes each way with the peer
            comm.exchange([(q, big[:b]) for q in peers], [(q, big_in[:b]) for q in peers])

        p2p_fixed = statistics.median(together_times(comm, [lambda: exchange(8)], 2 * repeats + 1)[0])
        if peer is not None:
            mine["p2p"] = p2p_fixed
        # Not a slope: a pairwise exchange varies most from run to run, and a difference of two such
        # medians overrates it. At 4 u (u: the all-reduce's, grown alike on every rank), with twice as many runs.
        fours, = together_times(comm, [lambda: exchange(4 * unit)], 2 * repeats + 1)
        p2p_rate = 4 * unit / max(statistics.median(fours) - mine.get("p2p", 0.0), 1e-9)
        if peer is not None:
            rates["p2p"] = p2p_rate
    if n > 1:
        logger.info("zen: rank %d: links probed in %.1f s; now zen's kernels", me, time.perf_counter() - started)
    kernels = probe_kernels(comm, repeats)
    with ThreadPoolExecutor(max_workers=1) as pool:
        hop = median_time(lambda: pool.submit(lambda: None).result(), repeats)
    local = Profile(bandwidth=max(rates.values(), default=kernels["memory_bandwidth"]), latency=mine.get("p2p", 0.0),
                    call_overhead=hop, **kernels, overheads=tuple((k, mine[k]) for k in PRIMITIVES if k in mine),
                    rates=tuple(rates.items()))
    schemes = list(registered())
    row = store.encode(local, schemes)
    if n > 1 and "p2p" not in mine:
        # measured nothing point-to-point: no latency, and no p2p columns (already -1)
        row[store.columns(schemes).index("latency")] = -1
    profile = store.decode(store.median_rows(comm.all_gather_ints(row).tolist()), schemes)
    if n == 1:
        return profile
    logger.info("zen: rank %d: kernels probed; now the calibration (%d schemes, calls of %d and %d elements)",
                me, len(schemes), *CALIBRATION_NUMELS)
    small, large = calibrate(comm, profile, 2 * repeats + 1)  # (a miss is a difference of two noisy times)
    logger.info("zen: rank %d: probe done in %.1f s", me, time.perf_counter() - started)
    return dataclasses.replace(profile, calibration=tuple(small.items()), calibration_large=tuple(large.items()))
