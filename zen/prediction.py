"""``zen.predict``: the cost model applied to a tensor on a group.

    times = zen.predict(grad)                    # {"dense": 0.0123, "zen": 0.0031, ..., "auto": 0.0031} seconds
    memory = zen.predict_memory(grad)            # {"dense": 0, "zen": 1.2e6, ...} extra bytes per rank
    zen.set_profile(bandwidth="1gbit", latency="50us")   # instead of the probe

Both are collective (call them on every rank of the group, like ``zen.all_reduce``). They measure, with
the agreement, floor(log2 n) exchanges of M/8-byte bitmaps (plus a fold for the ranks past the largest power
of two) and one all-gather of counts:

* nnz per rank, and per rank the non-zeros that zen's hash h0 sends to each partition and the non-zero
  blocks in each OmniReduce owner's range (the push loads: hash vs contiguous imbalance);
* the union U exactly, through recursive doubling of presence bitmaps (M/8 bytes per step, the schedule
  SparCML uses, so the running union of every doubling step is measured too: gamma(2^s));
* the union's split over the hash partitions and over the owners' block ranges (the pull loads);
* bytes per index and per value from the dtypes;

and combine them with the group's :class:`zen.cost.Profile`: set by :func:`set_profile`, or measured once
per group by :func:`probe_profile` (a few seconds: small collectives for the fixed costs; all-reduces
and all-to-alls of u and 4 u bytes for the rates (the slope), u of 1-8 MiB, all-to-alls of 96 and 384 KiB
pieces (the small ones' transport) and pairwise exchanges of 4 u; the local kernels; the calibration
calls; see :func:`probe_now`) and cached. All ranks use rank 0's profile, so they all
compute the same predictions.
:func:`measure` returns the measured :class:`zen.cost.Workload` itself, for offline use with
:func:`zen.cost.predict_times` under other profiles.
"""
import dataclasses
import functools
import math
import os
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import cost, ops, wire
from .comm import DUPLEX_ALL_TO_ALL_BYTES, Comm, get_comm
from .cost import LOCAL_TIMES, Profile, Workload
from .schemes.balanced import default_probes
from .schemes.omnireduce import block_bounds
from .schemes.sparcml import doubling_plan

PRIMITIVES = ("allgather", "allreduce", "alltoall", "p2p")
_PS = 1e12  # profile times travel as integer picoseconds
RATE_SECONDS = 0.03  # the probe's rate measurements grow their messages until one takes this long
# Pause before each timed call of the calibration (and of benchmarks/allreduce.py): where ranks share
# cores, CPU work just before a call (preparing its input, checking the last result) slows it through the
# scheduler. 8 ranks on 2 cores, 1 Gbit/s, zen at 4M elements and 0.1%: 31-35 ms after a 20 ms sleep,
# 35-40 back to back, 45-48 after 20-40 ms of busy work on every rank. Timed from a quiet start, a call's
# time is its own.
QUIET_SECONDS = 0.05
_profiles = {}  # group (or WORLD) -> Profile


# --------------------------------------------------------------------------------------------------------
# units


def parse_rate(text) -> float:
    """A bandwidth in bytes/s: a number (bytes/s), '<x>[k|m|g|t]bit' (bits/s, decimal, as tc) or
    '<x>[K|M|G|T]B/s' (bytes/s, decimal). '1gbit' -> 1.25e8."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(?:([kmgt]?)bit|([KMGT]?)B/s)?\s*", str(text))
    if not m:
        raise ValueError(f"bad bandwidth {text!r}: use e.g. 1gbit, 100mbit, 10GB/s or a number of bytes/s")
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
    if m.group(2) is not None:
        return float(m.group(1)) * scale[m.group(2)] / 8.0
    return float(m.group(1)) * scale[(m.group(3) or "").lower()]


def parse_time(text) -> float:
    """A time in seconds: a number (s) or '<x>[s|ms|us|ns]'. '50us' -> 5e-05."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(s|ms|us|ns)?\s*", str(text))
    if not m:
        raise ValueError(f"bad time {text!r}: use e.g. 50us, 0.1ms, 2e-6")
    return float(m.group(1)) * {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[m.group(2)]


# --------------------------------------------------------------------------------------------------------
# the group profile


def _key(group):
    return group if group is not None else dist.group.WORLD


def make_profile(bandwidth, latency, memory_bandwidth=None, **local_times) -> Profile:
    """A :class:`Profile` from numbers or strings ('1gbit', '50us', '10GB/s'); what is not given keeps the
    Profile's default. ``local_times``: any of :data:`zen.cost.LOCAL_TIMES`."""
    unknown = set(local_times) - set(LOCAL_TIMES)
    if unknown:
        raise TypeError(f"make_profile: unknown field(s) {', '.join(sorted(unknown))}")
    fields = dict(bandwidth=parse_rate(bandwidth), latency=parse_time(latency))
    if memory_bandwidth is not None:
        fields["memory_bandwidth"] = parse_rate(memory_bandwidth)
    fields.update({name: parse_time(value) for name, value in local_times.items() if value is not None})
    return Profile(**fields)


def set_profile(group=None, profile: Optional[Profile] = None, *, bandwidth=None, latency=None,
                memory_bandwidth=None, **local_times) -> Profile:
    """Use ``profile`` (or one built from bandwidth, latency, memory_bandwidth and the local times of
    :func:`make_profile`) for ``group`` instead of the probe. Local (no collective); rank 0's profile is the
    one every rank uses. Strings are parsed ('1gbit', '50us'). Returns the profile set."""
    if profile is None:
        if bandwidth is None or latency is None:
            raise ValueError("set_profile: give a Profile, or at least bandwidth and latency")
        profile = make_profile(bandwidth, latency, memory_bandwidth, **local_times)
    _profiles[_key(group)] = profile
    return profile


def cached_profile(group=None) -> Optional[Profile]:
    """The profile set or probed for ``group``, or None."""
    return _profiles.get(_key(group))


def clear_profile(group=None) -> None:
    _profiles.pop(_key(group), None)


RATES = ("allreduce", "alltoall", "alltoall_small", "p2p")
_FIELDS = 11  # bandwidth, latency, memory_bandwidth, element_time, write_time, call_overhead, merge_time,
#              encode_time, decode_time, found_time, merge2_time


def _times_columns(pairs, names) -> list:
    """(name, seconds) pairs as one column per name, in picoseconds; -1 for a name not in them."""
    times = dict(pairs)
    return [round(times[k] * _PS) if k in times else -1 for k in names]


def _times_pairs(names, columns) -> tuple:
    """The inverse of :func:`_times_columns`."""
    return tuple((k, v / _PS) for k, v in zip(names, columns) if v >= 0)


def _encode(p: Optional[Profile]) -> list:
    """A profile as one row of int64 (times in picoseconds, -1 for what was not measured)."""
    schemes = list(cost.TIME_FORMULAS)
    if p is None:
        return [0] * (_FIELDS + len(PRIMITIVES) + len(RATES) + 2 * len(schemes))
    rates = dict(p.rates)
    return ([int(p.bandwidth), round(p.latency * _PS), int(p.memory_bandwidth), round(p.element_time * _PS),
             round(p.write_time * _PS), round(p.call_overhead * _PS), round(p.merge_time * _PS),
             round(p.encode_time * _PS), round(p.decode_time * _PS), round(p.found_time * _PS),
             round(p.merge2_time * _PS)]
            + _times_columns(p.overheads, PRIMITIVES)
            + [int(rates[k]) if k in rates else -1 for k in RATES]
            + _times_columns(p.calibration, schemes) + _times_columns(p.calibration_large, schemes))


def _decode(row) -> Profile:
    row = [int(x) for x in row]
    a, b = _FIELDS + len(PRIMITIVES), _FIELDS + len(PRIMITIVES) + len(RATES)
    c = b + len(cost.TIME_FORMULAS)
    return Profile(bandwidth=float(row[0]), latency=row[1] / _PS, memory_bandwidth=float(row[2]),
                   element_time=row[3] / _PS, write_time=row[4] / _PS, call_overhead=row[5] / _PS,
                   merge_time=row[6] / _PS, encode_time=row[7] / _PS, decode_time=row[8] / _PS,
                   found_time=row[9] / _PS, merge2_time=row[10] / _PS,
                   overheads=_times_pairs(PRIMITIVES, row[_FIELDS:a]),
                   rates=tuple((k, float(v)) for k, v in zip(RATES, row[a:b]) if v > 0),
                   calibration=_times_pairs(cost.TIME_FORMULAS, row[b:c]),
                   calibration_large=_times_pairs(cost.TIME_FORMULAS, row[c:]))


def _median_time(fn, repeats: int) -> float:
    """Median seconds of ``fn`` on this rank over ``repeats`` runs, after a warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    (:func:`_together_times`: a common start, then from the last rank's start to the last one's end):
    timed back to back on each rank, ranks drift into each other's calls and overrate all-to-alls (8 ranks
    at 100 Mbit/s, 96-384 KiB pieces: 12 MB/s back to back, 8.7 MB/s as calls).
    Local: zen's kernels, every rank at once (:func:`_probe_kernels`). Then, on the agreed profile,
    :func:`calibrate`."""
    n, me, device = comm.world, comm.rank, comm.device
    mine, rates = {}, {}
    unit = message_bytes

    def slope(run, unit, grow=True):
        """(bytes/s, unit) of ``run(b)`` (b bytes sent per rank; collective), from the slope between
        b = unit and b = 4 unit: 3 unit over the difference of their median times over ``repeats`` runs; with
        ``grow``, unit doubles alike on every rank (the slowest decides). Not the median of the per-repeat
        differences: single slow runs (2 ranks at 100 Mbit/s, 4 MB exchanges: 337-343 ms, and one of 9 at
        450) spoil a difference when either of its runs is slow, twice as often as a median of one size."""
        t_one = _median_time(lambda: run(unit), repeats)
        while (grow and 2 * unit <= largest_unit
               and comm.all_gather_rows([round(t_one * _PS)]).max() < RATE_SECONDS * _PS):
            unit *= 2
            t_one = _median_time(lambda: run(unit), repeats)
        ones, fours = _together_times(comm, [lambda: run(unit), lambda: run(4 * unit)], repeats)
        return 3 * unit / max(statistics.median(fours) - statistics.median(ones), 1e-9), unit

    if n > 1:
        one = torch.zeros(1, device=device)
        a2a_in = torch.zeros(8 * n, dtype=torch.uint8, device=device)
        a2a_out = torch.empty_like(a2a_in)
        tiny = dict(allgather=lambda: comm.all_gather_rows([0]),
                    allreduce=lambda: dist.all_reduce(one, group=comm.group),
                    alltoall=lambda: comm.all_to_all(a2a_out, a2a_in, [8] * n, [8] * n, 8))
        for name, times in zip(tiny, _together_times(comm, list(tiny.values()), 2 * repeats + 1)):
            mine[name] = statistics.median(times)
        # All-to-all pieces of at least DUPLEX_ALL_TO_ALL_BYTES: large all-to-alls' transport
        # (``Comm.all_to_all``) at both ends of the slope.
        a2a_unit = max(unit, DUPLEX_ALL_TO_ALL_BYTES * (n - 1))
        largest_unit = max(8 * unit, a2a_unit)
        big = torch.zeros((largest_unit * n // (n - 1) + 2) * 4, dtype=torch.uint8, device=device)  # 4 units n/(n-1)
        big_in = torch.empty_like(big)
        floats = big.view(torch.float32)
        rates["allreduce"], unit = slope(lambda b: dist.all_reduce(floats[:b * n // (8 * (n - 1))], group=comm.group),
                                         unit)
        if n > 2:
            # Shaped links refill their token buckets between the ring's 2 (n-1) steps, so all-reduces too
            # small for them overrate it (8 ranks at 1 Gbit/s: 238 MB/s); a ring step alone (to the right,
            # from the left) bounds it. Only a clear overrate: at the grown unit the two agree (8 ranks at
            # 1 Gbit/s: 108-123 and 83-119 MB/s over 4 probes), and the smaller of two noisy estimates of one
            # rate is biased low.
            right, left = (me + 1) % n, (me - 1) % n
            ring_step, _ = slope(lambda b: comm.exchange([(right, big[:b])], [(left, big_in[:b])]), unit)
            if rates["allreduce"] > 1.5 * ring_step:
                rates["allreduce"] = ring_step
        def all_to_all(b):  # b bytes to the n-1 peers; the piece size picks the transport
            piece = b // (n - 1)
            comm.all_to_all(big_in[:piece * n], big[:piece * n], [piece] * n, [piece] * n, piece)

        rates["alltoall"], _ = slope(all_to_all, max(unit, a2a_unit))
        if comm.reverse_group is not None and n > 2:
            # Smaller all-to-alls go as gloo's own (between two ranks, only the smallest: its rate is
            # left unmeasured there): pieces of 96 and 384 KiB, under DUPLEX_ALL_TO_ALL_BYTES at both ends.
            rates["alltoall_small"], _ = slope(all_to_all, (96 << 10) * (n - 1), grow=False)
        peer = me ^ 1 if (me ^ 1) < n else None  # (the last rank of an odd group sits the pairs out)
        peers = [peer] if peer is not None else []

        def exchange(b):  # b bytes each way with the peer
            comm.exchange([(q, big[:b]) for q in peers], [(q, big_in[:b]) for q in peers])

        p2p_fixed = statistics.median(_together_times(comm, [lambda: exchange(8)], 2 * repeats + 1)[0])
        if peer is not None:
            mine["p2p"] = p2p_fixed
        # Not a slope: a pairwise exchange varies most from run to run, and a difference of two such
        # medians overrates it. 4 ranks at 100 Mbit/s (12 tries with TCP bbr, 4 with reno): slopes 9.7-13.0
        # MB/s with bbr (1 MiB: 88-149 ms) and 11.4-12.1 with reno, against 9.7-11.3 and 11.4-11.7 from 4 MiB;
        # the link carries at most 11.9 MB/s of TCP payload. At 1 Gbit/s the two agree (bbr: 115-121 and
        # 114-117 MB/s). At 4 u (u: the all-reduce's, grown alike on every rank), with twice as many runs.
        fours, = _together_times(comm, [lambda: exchange(4 * unit)], 2 * repeats + 1)
        p2p_rate = 4 * unit / max(statistics.median(fours) - mine.get("p2p", 0.0), 1e-9)
        if peer is not None:
            rates["p2p"] = p2p_rate
    kernels = _probe_kernels(comm, repeats)
    with ThreadPoolExecutor(max_workers=1) as pool:
        hop = _median_time(lambda: pool.submit(lambda: None).result(), repeats)
    local = Profile(bandwidth=max(rates.values(), default=kernels["memory_bandwidth"]), latency=mine.get("p2p", 0.0),
                    call_overhead=hop, **kernels, overheads=tuple((k, mine[k]) for k in PRIMITIVES if k in mine),
                    rates=tuple(rates.items()))
    row = _encode(local)
    if n > 1 and "p2p" not in mine:
        row[1] = -1  # measured nothing point-to-point: no latency, and no p2p columns (already -1)
    profile = _decode(_median_rows(comm.all_gather_rows(row).tolist()))
    if n == 1:
        return profile
    small, large = calibrate(comm, profile, 2 * repeats + 1)  # (a miss is a difference of two noisy times)
    return dataclasses.replace(profile, calibration=tuple(small.items()), calibration_large=tuple(large.items()))


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
    model predicts. A rank that starts early only waits for the last (8 ranks sharing 2 cores leave a barrier
    up to 10 ms apart; no network adds that). Without a shared clock: the slowest rank's own time,
    max_r (end - start), which also holds that spread."""
    calls = zip(zip(*starts), zip(*ends))  # per call: (every rank's start, every rank's end)
    if len(set(clocks)) == 1:
        return [max(ends_i) - max(starts_i) for starts_i, ends_i in calls]
    return [max(end - start for start, end in zip(starts_i, ends_i)) for starts_i, ends_i in calls]


def _together_times(comm: Comm, fns, repeats: int, least: float = 0.0, prepare=None) -> List[List[float]]:
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
        comm.all_gather_rows([0])  # the common start
        start = time.perf_counter()
        for _ in range(runs):
            fn(*args)
        end = time.perf_counter()
        comm.all_gather_rows([0])  # the common end: no rank's next work slows a rank still running
        return round(start * _PS), round(end * _PS)

    def length(span: Tuple[int, int]) -> int:  # picoseconds
        return span[1] - span[0]

    counts = []
    for fn in fns:
        timed(fn, 1)  # warm-up
        runs = 1
        if least > 0:
            once = comm.all_gather_rows([length(timed(fn, 1))]).max().item() / _PS
            runs = max(1, min(1000, math.ceil(least / max(once, 1e-9))))
        counts.append(runs)
    spans = [timed(fn, runs) for _ in range(repeats) for fn, runs in zip(fns, counts)]
    if least > 0:
        slowest = comm.all_gather_rows([length(span) for span in spans]).max(dim=0).values.tolist()
    else:
        rows = comm.all_gather_rows([clock_id()] + [t for span in spans for t in span]).tolist()
        slowest = call_seconds([row[1::2] for row in rows], [row[2::2] for row in rows], [row[0] for row in rows])
    return [[slowest[r * len(fns) + i] / _PS / runs for r in range(repeats)] for i, runs in enumerate(counts)]


def _probe_kernels(comm: Comm, repeats: int, numel: int = 1 << 22) -> dict:
    """The local terms of :class:`zen.cost.Profile`, from zen's kernels on a ``numel``-element float tensor
    (16 MiB: past most caches once a few ranks share a host), every rank at once and taking turns in every
    repeat (:func:`_together_times`), so that f, w and x_d, each a kernel's time less a part that mu
    measures, are differences within a repeat (their medians over the repeats are returned):
    the non-zero scan of zeros (mu) and of numel / 8 random non-zeros (f: per scan block holding one, less
    the scan of the zeros), the hash partition (e), the aggregate of n ascending runs of one partition (m)
    of numel / 16 pairs and that of two runs of numel / 32 pairs each (m_2, as SparCML merges), the
    write-back of numel / 8 ascending indices in n pieces split by the hash (``ops.scatter_pieces_``, as a
    call writes its union; w: per element, less the lines of the output written at mu, which the model
    counts apart), the hash bitmap's encode (x_e) of a quarter of the index
    set I_0 (per index encoded), and its decode as zen's pull ends: those numel / 8 indices split by the
    hash into n pieces, each decoded from its bitmap over its own I_j (x_d: per index decoded, less the
    lines of the n index sets read at mu, which the model counts apart; one I_j decoded alone stays in the
    caches that n of them do not)."""
    n, device = max(comm.world, 2), comm.device
    probes = default_probes(device)
    generator = torch.Generator().manual_seed(comm.seed + comm.rank)
    zeros = torch.zeros(numel, device=device)
    count = numel // 16
    idx = torch.randperm(numel, generator=generator)[:count].to(device=device, dtype=torch.int32)
    val = torch.zeros(numel // 8, device=device)  # zeros: the scatter must leave the scanned tensor zero
    # an eighth non-zero: 88% of the scan's blocks hold one, as at the densities where f matters
    found_count = numel // 8
    sparse = torch.zeros(numel, device=device).index_fill_(
        0, torch.randperm(numel, generator=generator)[:found_count].to(device), 1.0)
    ascending = torch.sort(idx).values
    mine = ops.hash_partition(idx, n, comm.seed) == 0
    runs = torch.cat([torch.sort(part).values for part in idx[mine].chunk(n)])
    two_runs = torch.cat([torch.sort(half).values for half in idx.chunk(2)])
    sets, offsets = ops.bitmap_index_sets(numel, n, comm.seed, device)
    index_set = sets[offsets[0]:offsets[1]]
    subset = index_set[torch.randperm(index_set.numel(), generator=generator)[:index_set.numel() // 4].sort().values]
    written = torch.sort(torch.randperm(numel, generator=generator)[:numel // 8]).values.to(device=device,
                                                                                          dtype=torch.int32)
    owner = ops.hash_partition(written, n, comm.seed)
    bitmaps, scattered = [], []
    for j in range(n):
        own = sets[offsets[j]:offsets[j + 1]]
        piece = written[owner == j]
        bitmaps.append((ops.bitmap_encode(piece, own), own, piece.numel()))
        scattered.append((piece, val[:piece.numel()]))

    kernels = dict(
        zeros=lambda: ops.nonzero(zeros),
        found=lambda: ops.nonzero(sparse),
        partition=lambda: ops.partition(ascending, val[:count], n, comm.seed, probes),
        aggregate=lambda: ops.aggregate(runs, val[:runs.numel()], numel, n, comm.seed, 0),
        merged=lambda: ops.aggregate(two_runs, val[:count], numel),
        written=lambda: ops.scatter_pieces_(zeros, scattered),
        encoded=lambda: ops.bitmap_encode(subset, index_set),
        decoded=lambda: [ops.bitmap_decode(*coded) for coded in bitmaps])
    times = dict(zip(kernels, _together_times(comm, list(kernels.values()), repeats, least=RATE_SECONDS)))
    byte_times = [t / (numel * zeros.element_size()) for t in times["zeros"]]  # s per byte streamed, per repeat

    def less(name, streamed_bytes, items):
        """Median over the repeats of (kernel's time - the bytes it streams at that repeat's mu) / items,
        at least a tenth of the kernel's time (finding a set bit, moving a value, is never free)."""
        return statistics.median(max(t - streamed_bytes * b, 0.1 * t) / items
                                 for t, b in zip(times[name], byte_times))

    index_lines = sum(cost.lines_bytes(decodes, own.numel(), own.element_size()) for _, own, decodes in bitmaps)
    return dict(memory_bandwidth=1 / statistics.median(byte_times),
                found_time=less("found", numel * zeros.element_size(), cost.scan_blocks(found_count, numel)),
                element_time=statistics.median(times["partition"]) / count,
                merge_time=statistics.median(times["aggregate"]) / runs.numel(),
                merge2_time=statistics.median(times["merged"]) / count,
                write_time=less("written", cost.lines_bytes(written.numel(), numel, zeros.element_size()),
                                written.numel()),
                encode_time=statistics.median(times["encoded"]) / subset.numel(),
                decode_time=less("decoded", index_lines, written.numel()))


def _median_rows(rows) -> list:
    """Per column, the median of the ranks' non-negative values (-1 where none has one)."""
    agreed = []
    for column in zip(*rows):
        valid = [x for x in column if x >= 0]
        agreed.append(int(statistics.median_low(valid)) if valid else -1)
    return agreed


def calibrate(comm: Comm, profile: Profile, repeats: int = 5) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Seconds each scheme's formula misses on a small and on a large call (collective, on the lane): ({scheme:
    miss} at ``CALIBRATION_NUMELS[0]`` elements, density 1%; {scheme: miss} at ``CALIBRATION_NUMELS[1]``,
    density 0.01%). Every scheme all-reduces a random tensor of that size, the schemes taking turns, each call
    handed to another thread as ``zen.all_reduce`` hands it to the lane; the miss is the call's time (from
    the last rank's start to the last one's end, as the benchmarks time it; :func:`call_seconds`) minus the
    formula's time for that call's measured workload, at least 0. The small call holds what the formulas'
    per-primitive latencies leave out (Python, the backend's per-message work); the large one also the
    waits that grow with the tensor: where ranks outnumber cores, a rank descheduled in a long local phase
    (the scan of M elements...) holds up every peer at the next collective, which the kernel probe's
    per-element rates (averaged over many back-to-back runs) do not see. Dense's formula has no local
    phase to be held up in, and its large call is the slowest of all (a ring all-reduce of 16 MiB), so
    it is calibrated small only. ``cost.Profile.miss`` interpolates between the two."""
    small, large = cost.CALIBRATION_NUMELS
    return (_misses(comm, profile, repeats, small, 0.01, list(cost.TIME_FORMULAS)),
            _misses(comm, profile, repeats, large, 1e-4, [s for s in cost.TIME_FORMULAS if s != "dense"]))


def _misses(comm: Comm, profile: Profile, repeats: int, numel: int, density: float, names) -> Dict[str, float]:
    """{scheme: measured - predicted seconds, at least 0} for all-reducing a random tensor (see :func:`calibrate`)."""
    from .collective import reduce_now
    from .schemes import make_scheme

    generator = torch.Generator().manual_seed(comm.rank)
    x = torch.zeros(numel)
    x[torch.randperm(numel, generator=generator)[:max(1, int(numel * density))]] = 1.0
    x = x.to(comm.device)
    indices, values = ops.nonzero(x)
    workload, _ = measure_now(comm, comm.all_gather_rows, indices, values, numel, True, want_profile=False)
    uncalibrated = dataclasses.replace(profile, calibration=(), calibration_large=())
    predicted = cost.predict_times(workload, uncalibrated, names)
    # Each call is handed to another thread and waited for, as ``zen.all_reduce`` hands its calls to the
    # lane: where ranks share cores, waking the two threads costs far more than the idle hand-off the
    # profile's call_overhead measures (2 ranks on 2 cores, 1 Gbit/s, 4M elements: 0.1-3 ms, 0.8 ms median).
    # The schemes take turns within every repeat, as the benchmarks run them: a call's time depends on
    # what ran before it, not only on the pause (2 ranks, 1 Gbit/s, 4M elements at 0.1%: sparcml 4.3-4.7 ms
    # run alone, 4.8-8.0 ms among the other schemes, over 5 runs).
    with ThreadPoolExecutor(max_workers=1, initializer=torch.set_num_threads,
                            initargs=(torch.get_num_threads(),)) as caller:
        def call(scheme):
            return lambda y: caller.submit(reduce_now, comm, y, scheme).result()

        times = _together_times(comm, [call(make_scheme(name)) for name in names], repeats, prepare=x.clone)
    return {name: max(0.0, statistics.median(t) - predicted[name]) for name, t in zip(names, times)}


def probe_profile(group=None, message_bytes: int = 1 << 20, repeats: int = 5) -> Profile:
    """Measure ``group``'s profile now (collective), cache it and return it."""
    comm = get_comm(group)
    if comm is None:
        return None
    profile = comm.submit(lambda: probe_now(comm, message_bytes, repeats)).wait()
    _profiles[_key(group)] = profile
    return profile


# --------------------------------------------------------------------------------------------------------
# measuring a workload

_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)
_CHUNK = 1 << 20  # bytes of a bitmap handled at once (bounds the temporaries)


def _popcount(bitmap: torch.Tensor) -> int:
    table = _POPCOUNT.to(bitmap.device)
    return sum(int(table[bitmap[s:s + _CHUNK].long()].sum()) for s in range(0, bitmap.numel(), _CHUNK))


def _bitmap_of(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Presence bitmap over [0, numel) of unique int64 ``indices`` (bit i % 8 of byte i // 8)."""
    bitmap = torch.zeros((numel + 7) // 8, dtype=torch.uint8, device=indices.device)
    bits = torch.bitwise_left_shift(torch.ones_like(indices), indices % 8).to(torch.uint8)
    bitmap.index_put_((indices // 8,), bits, accumulate=True)  # distinct bits: the sum is the OR
    return bitmap


def _indices_of(bitmap: torch.Tensor, first_byte: int):
    """The set bits of ``bitmap`` (whose byte 0 is byte ``first_byte`` of the whole), ascending, chunk by chunk."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    for s in range(0, bitmap.numel(), _CHUNK):
        bits = (bitmap[s:s + _CHUNK, None] >> shifts) & 1
        yield torch.nonzero(bits.reshape(-1)).reshape(-1) + 8 * (first_byte + s)


def flat_coo(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """(indices, values, dense_input) of a strided or sparse COO tensor over its flat index space."""
    if tensor.layout == torch.sparse_coo:
        from .collective import sparse_to_flat

        return sparse_to_flat(tensor.coalesce()) + (False,)
    indices, values = ops.nonzero(tensor.contiguous().view(-1))
    return indices, values, True


def measure_now(comm: Comm, agree, indices, values, numel: int, dense_input: bool, block_size: int = 256,
                profile: Optional[Profile] = None, want_profile: bool = True) -> Tuple[Workload, Optional[Profile]]:
    """Measure the workload of all-reducing (indices, values) over [0, numel) (collective, on the lane).

    ``agree(row)`` is the first collective (the call's agreement), of [has a profile, nnz]. With
    ``want_profile``, ranks without a profile run the probe (all ranks take part when one lacks it) and rank
    0's profile is returned. The last exchange, an all-gather, carries the union counts per doubling level,
    the union's split over hash partitions and owners, the push loads and the profile."""
    n, me = comm.world, comm.rank
    idx_dtype = wire.index_dtype(numel)
    si = torch.empty(0, dtype=idx_dtype).element_size()
    idx = indices.to(torch.int64)
    if idx.numel() and not bool((idx[1:] > idx[:-1]).all()):
        idx = torch.sort(idx).values
    device = idx.device
    hash_counts = torch.bincount(ops.hash_partition(idx.to(idx_dtype), n, comm.seed).long(), minlength=n)
    bounds = block_bounds(numel, block_size, n)
    bound_tensor = torch.tensor(bounds, dtype=torch.int64, device=device)
    block_cuts = torch.searchsorted(torch.unique_consecutive(idx // block_size), bound_tensor).tolist()
    rows = agree([1 if profile is not None else 0, idx.numel()]).tolist()
    if want_profile and any(r[0] == 0 for r in rows):
        probed = probe_now(comm)
        profile = profile or probed

    # Union bitmaps by recursive doubling (SparCML's schedule): levels[s] = |my core group's union| after s steps.
    bitmap = _bitmap_of(idx, numel)
    p, steps = doubling_plan(n)
    levels = [0] * (steps + 1)
    if me >= p:
        comm.exchange([(me - p, bitmap)], [])
    else:
        if me + p < n:
            other = torch.empty_like(bitmap)
            comm.exchange([], [(me + p, other)])
            bitmap = bitmap | other
        levels[0] = _popcount(bitmap)
        for s in range(steps):
            peer, other = me ^ (1 << s), torch.empty_like(bitmap)
            comm.exchange([(peer, bitmap)], [(peer, other)])
            bitmap = bitmap | other
            levels[s + 1] = _popcount(bitmap)

    # The union's split over hash partitions and owners: core rank c reads its slice of whole 8-block units.
    hash_union = torch.zeros(n, dtype=torch.int64, device=device)
    block_union = torch.zeros(n, dtype=torch.int64, device=device)
    if me < p:
        units = -(-bitmap.numel() // block_size)
        lo, hi = me * units // p * block_size, (me + 1) * units // p * block_size
        for union_idx in _indices_of(bitmap[lo:hi], lo):
            hash_union += torch.bincount(ops.hash_partition(union_idx.to(idx_dtype), n, comm.seed).long(),
                                         minlength=n)
            ids = torch.unique_consecutive(union_idx // block_size)
            block_union += torch.diff(torch.searchsorted(ids, bound_tensor))
    block_counts = [block_cuts[w + 1] - block_cuts[w] for w in range(n)]
    row = (levels + hash_union.tolist() + block_union.tolist() + hash_counts.tolist() + block_counts
           + _encode(profile if want_profile else None))
    gathered = comm.all_gather_rows(row).tolist()
    columns = [steps + 1 + i * n for i in range(5)]  # where each group of n columns starts
    hash_total, block_total = ([sum(r[c + j] for r in gathered) for j in range(n)] for c in columns[:2])
    doubling = [[gathered[g << s][s] for g in range(p >> s)] for s in range(steps + 1)]
    workload = Workload(numel=numel, n=n, nnz=[r[1] for r in rows], union=doubling[-1][0],
                        hash_counts=[r[columns[2]:columns[3]] for r in gathered], hash_union=hash_total,
                        doubling_unions=doubling, block_counts=[r[columns[3]:columns[4]] for r in gathered],
                        block_union=block_total, index_size=si, value_size=values.element_size(),
                        block_size=block_size, dense_input=dense_input)
    return workload, (_decode(gathered[0][-len(_encode(None)):]) if want_profile else None)


def _measure(tensor, group, block_size, want_profile, profile=None):
    from .collective import header_for

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"zen.predict expects a torch.Tensor, got {type(tensor).__name__}")
    comm = get_comm(group)
    if comm is None:
        return None, None
    header = header_for(tensor, "zen", comm)
    mine = profile or cached_profile(group)

    def job():
        indices, values, dense_input = flat_coo(tensor)
        result = measure_now(comm, lambda row: comm.agree(header, row), indices, values, tensor.numel(),
                             dense_input, block_size, mine, want_profile)
        if want_profile and mine is None:
            _profiles[_key(group)] = result[1]
        return result

    return comm.submit(job).wait()


def measure(tensor: torch.Tensor, group=None, block_size: int = 256) -> Workload:
    """The measured :class:`zen.cost.Workload` of all-reducing ``tensor`` over ``group`` (collective)."""
    return _measure(tensor, group, block_size, want_profile=False)[0]


def predict(tensor: torch.Tensor, group=None, profile: Optional[Profile] = None,
            block_size: int = 256) -> Dict[str, float]:
    """Predicted seconds of ``zen.all_reduce(tensor, scheme=s, group=group)`` for every scheme s of
    ``zen.SCHEMES`` ("auto": the smallest). Collective. ``profile``: use it instead of the cached or probed one
    (rank 0's counts). None on a rank outside the group.

    Example::

        zen.set_profile(bandwidth="10gbit", latency="20us")
        times = zen.predict(embedding.weight.grad)
        best = min(times, key=times.get)
    """
    workload, agreed = _measure(tensor, group, block_size, want_profile=True, profile=profile)
    return None if workload is None else cost.predict_times(workload, agreed)


def predict_memory(tensor: torch.Tensor, group=None, block_size: int = 256) -> Dict[str, float]:
    """Predicted extra memory (bytes per rank, the peak of the scheme's buffers and caches, e.g. zen's hash
    tables and cached index sets, the all-gather's n pieces) for every scheme. Collective."""
    workload = measure(tensor, group, block_size)
    return None if workload is None else cost.predict_memory(workload)
