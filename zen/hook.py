"""The DDP communication hook: ``ddp_model.register_comm_hook(zen.ZenState(), zen.zen_hook)``.

Each gradient bucket is averaged and summed over the group by a zen scheme on the group's lane (a worker
thread), so communication overlaps the rest of backward; the hook returns the pending future at once.
Buckets reach the lane in DDP's bucket order, the same on every rank, and the lane keeps that order.

The hook finds rows without being told: each parameter of a bucket is a segment of the bucket's buffer
whose row size is its trailing dims (an embedding [V, D]: rows of D; a bias: elements). Per call and per
row size, rows or elements are chosen alike on every rank (``zen.schemes.call.reduce_segments``), and the
segments of one block size are reduced together, so a bucket's rounds of collectives grow with its
number of distinct row sizes, not of parameters. A sparse gradient (``nn.Embedding(sparse=True)``)
travels as rows of its dense dims.
"""
import logging
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from .collective import SCHEMES, make_scheme
from .cost.terms import dense_bytes
from .schemes.balanced import check_settings
from .schemes.call import Segment, run_call
from .transport import get_comm

logger = logging.getLogger("zen")


def _no_totals() -> dict:
    """:meth:`ZenState.summary`'s counters before the first bucket."""
    return dict(steps=0, buckets=0, bytes_sent=0, dense_bytes=0, schemes={}, seconds=0.0)


class ZenState:
    """Settings and per-group state of :func:`zen_hook`.

    Args:
        process_group: the group to reduce over (default: the world).
        scheme: one of ``zen.SCHEMES``; "zen" is Balanced Parallelism.
        dense_threshold: mean density above which a bucket goes dense. None (default): decide per
            bucket by the cost formulas (``zen.cost``), with the union growth seen on that bucket before.
        num_probes, table_factor, serial_factor: the hierarchical hash's settings (k probes, 0 for an
            exact counting sort, None for the device's default: 3 on GPUs, 0 on CPUs; parallel
            memory of table_factor * nnz slots, serial memory of serial_factor * table slots).
        timeout: bound on every zen collective of the group (timedelta or seconds; default: the process
            group's own timeout). A dead or stalled peer makes the hook's future (so DDP's backward) raise
            within it.
        log_every: log :meth:`summary` (logger "zen", level INFO) every that many steps; None: never.
    """

    __slots__ = ["process_group", "scheme", "dense_threshold", "num_probes", "table_factor", "serial_factor",
                 "timeout", "log_every", "_scheme", "_comm", "last_stats", "_totals"]

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, scheme: str = "zen",
                 dense_threshold: Optional[float] = None, num_probes: Optional[int] = None, table_factor: float = 2.0,
                 serial_factor: float = 0.1, timeout=None, log_every: Optional[int] = None):
        if scheme not in SCHEMES:
            raise ValueError(f"ZenState: scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
        check_settings("ZenState", num_probes, table_factor, serial_factor, dense_threshold)
        if timeout is not None and not (timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout) > 0:
            raise ValueError(f"ZenState: timeout must be None, a positive timedelta or seconds; got {timeout!r}")
        if log_every is not None and (not isinstance(log_every, int) or log_every < 1):
            raise ValueError(f"ZenState: log_every must be None or a positive int; got {log_every!r}")
        self.process_group = process_group
        self.scheme = scheme
        self.dense_threshold = dense_threshold
        self.num_probes = num_probes
        self.table_factor = table_factor
        self.serial_factor = serial_factor
        self.timeout = timeout
        self.log_every = log_every
        self._comm = None
        self._scheme = None
        self.last_stats = {}
        self._totals = _no_totals()

    def summary(self) -> dict:
        """This rank's totals since the state was made: ``steps``, ``buckets``, ``bytes_sent``, ``dense_bytes``
        (what a ring all-reduce of the same buckets sends: 2 (n-1)/n x their bytes), ``schemes`` (calls per
        scheme; a block of a bucket that went dense counts as "<scheme> (dense)"), ``seconds`` (in zen's
        collectives, on the lane)."""
        return dict(self._totals, schemes=dict(self._totals["schemes"]))

    def _record(self, buffer: torch.Tensor, stats: dict, seconds: float, last: bool) -> None:
        totals = self._totals
        totals["buckets"] += 1
        totals["bytes_sent"] += stats.get("bytes_sent", 0)
        totals["dense_bytes"] += dense_bytes(buffer.numel(), self._comm.world, buffer.element_size())
        totals["seconds"] += seconds
        for group in stats.get("groups", [stats]):
            name = self.scheme + (" (dense)" if group.get("dense") else "")
            totals["schemes"][name] = totals["schemes"].get(name, 0) + 1
        if last:
            totals["steps"] += 1
            if self.log_every and totals["steps"] % self.log_every == 0:
                logger.info("zen: %s", self.summary())

    def comm(self):
        if self._comm is None:
            self._comm = get_comm(self.process_group, self.timeout)
        return self._comm

    def scheme_instance(self):
        if self._scheme is None:
            settings = {}
            if self.scheme == "zen":
                settings = dict(num_probes=self.num_probes, table_factor=self.table_factor,
                                serial_factor=self.serial_factor, dense_switch=True,
                                dense_threshold=self.dense_threshold)
            self._scheme = make_scheme(self.scheme, **settings)
        return self._scheme

    def __getstate__(self):
        return {name: getattr(self, name) for name in self.__slots__
                if name not in ("process_group", "_comm", "_scheme")}

    def __setstate__(self, state):
        self.process_group = None
        self._comm = None
        self._scheme = None
        self.log_every = None
        self._totals = _no_totals()
        for name, value in state.items():
            setattr(self, name, value)


# A parameter smaller than this stays elements: reducing it in a group of its own would cost a round more
# than its rows could save (at most 4 bytes of index per element, 16 KiB: under one latency of a fast link).
SMALL_PARAMETER = 4096


def bucket_segments(bucket, buffer: torch.Tensor) -> Optional[List[Segment]]:
    """The bucket's parameters as segments of its flat buffer: (offset, numel, row size), the row size the
    parameter's trailing dims (numel / shape[0] for 2-D and more, 1 for a vector or a parameter of fewer than
    ``SMALL_PARAMETER`` elements). None where the bucket says nothing of its parameters or they do not tile
    the buffer (then the buffer's own shape decides)."""
    parameters = getattr(bucket, "parameters", None)
    if parameters is None or buffer.layout != torch.strided:
        return None
    segments, offset = [], 0
    for p in parameters():
        large = p.dim() > 1 and p.shape[0] and p.numel() >= SMALL_PARAMETER
        rows = p.numel() // p.shape[0] if large else 1
        segments.append((offset, p.numel(), rows))
        offset += p.numel()
    return segments if offset == buffer.numel() and segments else None


def zen_hook(state: ZenState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the group with zen; returns a pending future of the bucket's buffer."""
    buffer = bucket.buffer()
    comm = state.comm()
    scheme = state.scheme_instance()
    segments = bucket_segments(bucket, buffer)
    last = bucket.is_last() if hasattr(bucket, "is_last") else False

    def job():
        start = time.perf_counter()
        stats = {}
        buffer.div_(comm.world)  # divide before summing: no fp16 overflow, same as DDP's own allreduce
        run_call(comm, buffer, scheme, state.scheme, stats, segments=segments)
        state.last_stats = stats
        state._record(buffer, stats, time.perf_counter() - start, last)
        return buffer

    stream = torch.cuda.current_stream(buffer.device) if buffer.is_cuda else None
    return comm.submit(job, stream)
