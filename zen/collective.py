"""``zen.all_reduce``: the entry point with the contract of ``torch.distributed.all_reduce(op=SUM)``, and the
names it accepts (``zen.SCHEMES``: every registered scheme, and "auto")."""
import datetime
import threading
from collections.abc import Sequence
from typing import Optional, Union

import torch
import torch.distributed as dist

from .auto import Auto
from .hierarchy import HIERARCHY, check_hierarchy
from .schemes import Scheme, registered, scheme_class
from .schemes.base import Request
from .transport import check_timeout, get_comm


class _SchemeNames(Sequence):
    """The names ``zen.all_reduce(scheme=...)`` accepts, read live from the registry: the registered
    schemes, in registration order, then "auto"."""

    def _names(self):
        return tuple(registered()) + ("auto",)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self):
        return len(self._names())

    def __repr__(self):
        return repr(self._names())


SCHEMES = _SchemeNames()
_shared = {}  # scheme name and class (auto: the registered names) -> the process's instance
_shared_lock = threading.Lock()


def make_scheme(name: str, **settings) -> Scheme:
    """A scheme instance; ``settings`` go to its constructor. Raises ValueError on an unknown name.

    A scheme without settings is one instance per process ("auto": per set of registered schemes):
    ``zen.all_reduce`` names its scheme per call, and what a scheme learns must outlive the call (auto's
    history of what it measured and picked; zen's unions per tensor shape, which size its pull)."""
    if name != "auto" and name not in registered():
        raise ValueError(f"unknown scheme {name!r}; allowed: {', '.join(SCHEMES)}")
    make = Auto if name == "auto" else scheme_class(name)
    if settings:
        return make(**settings)
    with _shared_lock:
        key = tuple(registered()) if name == "auto" else (name, make)
        if key not in _shared:
            _shared[key] = make()
        return _shared[key]


class Work(dist.Work):
    """The handle of an asynchronous zen collective: a ``torch.distributed.Work`` (a subclass), with ``wait``,
    ``is_completed``, ``is_success``, ``exception``, ``result`` and ``get_future`` (whose value is ``[tensor]``,
    as torch's)."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self._future = future
        self._listed = None

    def wait(self, timeout=None) -> bool:
        """Block until done; re-raises the collective's error on this rank. ``timeout`` (seconds or a
        timedelta): raise :class:`TimeoutError` if the collective has not finished by then (it goes on
        running; the group's own timeout ends it)."""
        if timeout is not None and not self._future.done():
            seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
            finished = threading.Event()
            self._future.add_done_callback(lambda _: finished.set())
            if not finished.wait(seconds):
                raise TimeoutError(f"zen: the collective did not finish within {seconds:g} s")
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        """Whether the collective finished without an error (False while it runs)."""
        return self._future.done() and self.exception() is None

    def exception(self) -> Optional[BaseException]:
        """The collective's error once it has failed; None while it runs or where it succeeded."""
        if not self._future.done():
            return None
        try:
            self._future.wait()
        except Exception as error:  # noqa: BLE001  (handed back, not raised)
            return error
        return None

    def result(self) -> list:
        """``[tensor]``, the summed tensor, once done (waits)."""
        self.wait()
        return [self._future.value()]

    def get_future(self) -> torch.futures.Future:
        """A future of ``[tensor]`` (the same future on every call)."""
        if self._listed is None:
            self._listed = self._future.then(lambda done: [done.value()])
        return self._listed


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False,
               scheme: Union[str, Scheme] = "zen", stats: Optional[dict] = None, timeout=None,
               block_size: Optional[int] = None, hierarchy: str = "auto", local_size: Optional[int] = None):
    """Sum ``tensor`` over ``group`` in place, like ``torch.distributed.all_reduce(tensor, op=SUM)``, whose
    positional arguments (tensor, op, group, async_op) it takes in the same order. ``op`` must be
    ``ReduceOp.SUM`` (a ValueError names what is supported otherwise).

    ``scheme`` picks the algorithm: a name from ``zen.SCHEMES``, or a scheme instance with its own settings
    (e.g. ``BalancedParallelism(num_probes=1)``); every scheme gives the sum of all ranks' tensors.
    Any shape; float32/float64/float16/bfloat16 (and int32/int64, summed exactly); strided tensors of
    any stride (the result lands in ``tensor``) and sparse COO tensors. NaN and Inf are summed as by
    ``dist.all_reduce``.

    Errors are the same on every rank: a tensor that differs across ranks (numel, shape, dtype, layout,
    device), or a scheme that does, or any rank's bad input (unsupported dtype, device or layout, unknown
    scheme, not a tensor) raises :class:`zen.MismatchError` (a ValueError) naming the rank and the problem,
    and the group stays usable. A dead or stalled peer raises :class:`zen.PeerError` (a RuntimeError naming
    the rank waited on) within the group's timeout, after which the group is broken on that rank
    (:class:`zen.BrokenGroupError`).

    ``block_size``: the tensor travels as R = M / b entries of b consecutive values (rows), one index per
    entry, an entry with any non-zero sent whole. None (default) chooses per call, alike on every rank:
    rows of the last dimension when all ranks' non-zero rows take fewer bytes than their non-zero elements,
    R_nz (b s_v + s_i) < nnz (s_v + s_i) (an embedding gradient), else elements (a top-k gradient). An int
    forces b; it must divide the tensor. A sparse COO tensor always travels as rows of its dense dims.

    ``hierarchy`` (:mod:`zen.hierarchy`): "node" sums inside each node first (over its fast links), then
    runs ``scheme`` across the nodes, each local rank on its own shard, then gathers inside the node; "flat"
    runs ``scheme`` over all ranks; "auto" (default) times both on the first calls and keeps the faster (flat
    where the group is one node or one rank per node). ``local_size``: ranks per node; None finds it
    (``LOCAL_WORLD_SIZE``, which torchrun sets, else the hostnames). Every rank must pass the same two.

    ``timeout`` (timedelta or seconds; default: ``group``'s own timeout): bounds zen's collectives on this
    group from this call on. Returns None, or a :class:`Work` handle when ``async_op``. ``stats``, if given,
    receives what the call measured (bytes sent, union size, gamma, partition imbalance...).

    Example::

        grad = embedding.weight.grad            # mostly zero rows
        zen.all_reduce(grad)                     # == dist.all_reduce(grad), fewer bytes
    """
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"zen.all_reduce: op must be torch.distributed.ReduceOp.SUM (zen sums; for other ops use "
                         f"torch.distributed.all_reduce); got {op!r}")
    check_hierarchy("zen.all_reduce", hierarchy, local_size)
    check_timeout("zen.all_reduce", timeout)
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"zen.all_reduce: stats must be None or a dict to fill; got {type(stats).__name__}")
    comm = get_comm(group, timeout)
    if comm is None:
        return None
    if isinstance(scheme, Scheme):
        instance, name = scheme, scheme.name
    else:
        name = scheme
        try:
            instance = make_scheme(scheme)
        except (ValueError, TypeError):
            instance = None  # reported through the agreement, so every rank raises
    is_cuda = isinstance(tensor, torch.Tensor) and tensor.is_cuda
    stream = torch.cuda.current_stream(tensor.device) if is_cuda else None
    request = Request(tensor, instance, name, tuple(SCHEMES), block_size, hierarchy=(hierarchy, local_size))

    def job():
        outcome = HIERARCHY.run(comm, request)
        if stats is not None:
            stats.update(outcome.as_stats())
        return tensor

    future = comm.submit(job, stream)
    work = Work(future)
    if async_op:
        return work
    work.wait()
    return None
