"""The DDP communication hook: ``ddp_model.register_comm_hook(zen.ZenState(), zen.zen_hook)``.

Each gradient bucket is averaged and summed over the group by a zen scheme on the group's lane (a worker
thread), so communication overlaps the rest of backward; the hook returns the pending future at once.
Buckets reach the lane in DDP's bucket order, the same on every rank, and the lane keeps that order.
"""
from typing import Optional

import torch
import torch.distributed as dist

from .collective import SCHEMES, make_scheme
from .schemes.balanced import check_settings
from .schemes.call import run_call
from .transport import get_comm


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
    """

    __slots__ = ["process_group", "scheme", "dense_threshold", "num_probes", "table_factor", "serial_factor",
                 "timeout", "_scheme", "_comm", "last_stats"]

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, scheme: str = "zen",
                 dense_threshold: Optional[float] = None, num_probes: Optional[int] = None, table_factor: float = 2.0,
                 serial_factor: float = 0.1, timeout=None):
        if scheme not in SCHEMES:
            raise ValueError(f"ZenState: scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
        check_settings("ZenState", num_probes, table_factor, serial_factor, dense_threshold)
        if timeout is not None and not (timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout) > 0:
            raise ValueError(f"ZenState: timeout must be None, a positive timedelta or seconds; got {timeout!r}")
        self.process_group = process_group
        self.scheme = scheme
        self.dense_threshold = dense_threshold
        self.num_probes = num_probes
        self.table_factor = table_factor
        self.serial_factor = serial_factor
        self.timeout = timeout
        self._comm = None
        self._scheme = None
        self.last_stats = {}

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
        for name, value in state.items():
            setattr(self, name, value)


def zen_hook(state: ZenState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the group with zen; returns a pending future of the bucket's buffer."""
    buffer = bucket.buffer()
    comm = state.comm()
    scheme = state.scheme_instance()
    stats = {}

    def job():
        buffer.div_(comm.world)  # divide before summing: no fp16 overflow, same as DDP's own allreduce
        run_call(comm, buffer, scheme, state.scheme, stats)
        state.last_stats = stats
        return buffer

    stream = torch.cuda.current_stream(buffer.device) if buffer.is_cuda else None
    return comm.submit(job, stream)
