"""``zen.all_reduce``: the entry point with the contract of ``torch.distributed.all_reduce(op=SUM)``."""
import datetime
import math
import threading
from typing import List, Optional, Tuple, Union

import torch

from . import comm as comm_mod
from .comm import Comm, MismatchError, get_comm, shape_code
from .schemes import SCHEMES, make_scheme
from .schemes.base import Call, Scheme

_BACKEND_DEVICES = {"gloo": {"cpu"}, "nccl": {"cuda"}, "mpi": {"cpu", "cuda"}}


class Work:
    """The handle of an asynchronous zen collective (like ``torch.distributed.Work``)."""

    def __init__(self, future: torch.futures.Future):
        self._future = future

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

    def get_future(self) -> torch.futures.Future:
        return self._future


def _code(value, values) -> int:
    return values.index(value) if value in values else len(values)


def inspect_call(tensor, scheme, scheme_name, comm: Comm) -> Tuple[List[int], str]:
    """The agreement header of a call and, when this rank cannot take part, the reason (the header's
    ``problem`` field is then non-zero): every rank learns it in the agreement and raises alike."""
    is_tensor = isinstance(tensor, torch.Tensor)
    device = tensor.device.type if is_tensor else "cpu"
    dtype = tensor.dtype if is_tensor else torch.float32
    settings = getattr(scheme, "agreement_settings", None)
    header = [
        tensor.numel() if is_tensor else -1,
        comm_mod.ALL_DTYPES.index(dtype) if dtype in comm_mod.ALL_DTYPES else -1,
        shape_code(tensor.shape) if is_tensor else 0,
        SCHEMES.index(scheme_name) if scheme_name in SCHEMES else -1,
        (1 if tensor.layout == torch.sparse_coo else 0 if tensor.layout == torch.strided else 2) if is_tensor else 0,
        _code(device, comm_mod.DEVICE_TYPES),
        shape_code(settings()) if callable(settings) else 0,
        0,
    ]
    problem, detail = 0, ""
    if not is_tensor:
        problem, detail = 5, f"got {type(tensor).__name__}"
    elif dtype not in comm_mod.DTYPES:
        problem, detail = 1, f"got {dtype}"
    elif device not in _BACKEND_DEVICES.get(comm.backend, {device}):
        problem, detail = 2, (f"a {device} tensor on the {comm.backend} backend, which takes "
                              f"{', '.join(sorted(_BACKEND_DEVICES[comm.backend]))} tensors")
    elif scheme is None:
        problem, detail = 3, f"{scheme_name!r}; allowed: {', '.join(SCHEMES)}"
    elif tensor.layout not in (torch.strided, torch.sparse_coo):
        problem, detail = 4, f"got {tensor.layout}"
    elif tensor.layout == torch.strided and torch._debug_has_internal_overlap(tensor) == 1:
        problem, detail = 7, f"strides {tensor.stride()} for shape {tuple(tensor.shape)}"
    header[-1] = problem
    return header, detail


def header_for(tensor: torch.Tensor, scheme: str, comm: Comm) -> list:
    """The agreement header of a call; ``problem`` != 0 marks what this rank cannot do."""
    return inspect_call(tensor, object() if scheme in SCHEMES else None, scheme, comm)[0]


def reduce_now(comm: Comm, tensor: torch.Tensor, scheme, scheme_name: Optional[str] = None,
               stats: Optional[dict] = None):
    """Run one all-reduce on the calling thread (which must be the group's lane). In place; returns tensor.

    ``scheme``: a scheme instance, or None when ``scheme_name`` named no scheme. Errors: see
    :mod:`zen.comm` (bad input -> :class:`MismatchError` on every rank; a failure part-way -> the error
    here, and :class:`BrokenGroupError` for every later call on the group)."""
    comm.check_usable()
    if scheme_name is None:
        scheme_name = getattr(scheme, "name", None)
    header, detail = inspect_call(tensor, scheme, scheme_name, comm)
    comm.call_shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
    if detail:
        _report(comm, header, detail)
    if comm.world == 1:
        return tensor
    call = Call(comm, header)
    agreements = comm.agreements
    try:
        with torch.no_grad():
            _reduce(call, scheme, tensor)
    except MismatchError:
        raise  # raised by the agreement, alike on every rank: the group is still in step
    except Exception as error:
        if comm.agreements == agreements:
            # Failed before the first exchange (the other ranks wait in it): tell them, so all raise alike.
            header[-1] = 6
            _report(comm, header, f"{type(error).__name__}: {error}", error)
        comm.fail(error)
        raise
    except BaseException as error:  # noqa: B036  (KeyboardInterrupt part-way: the protocol is cut)
        comm.fail(error)
        raise
    comm.last_stats = call.stats
    if stats is not None:
        stats.update(call.stats)
    return tensor


def _report(comm: Comm, header: List[int], detail: str, cause: Optional[BaseException] = None) -> None:
    """Take part in the agreement with a problem: it raises the same MismatchError on every rank."""
    try:
        comm.agree(header, [], detail)
    except MismatchError as mismatch:
        raise mismatch from cause
    except BaseException as error:  # noqa: B036  (the exchange itself failed: a dead peer, a timeout)
        comm.fail(error)
        raise
    raise AssertionError("unreachable: the agreement raises when a rank reports a problem")


def _reduce(call: Call, scheme, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        call.agree([])  # nothing to sum; the agreement still checks that every rank has nothing
    elif tensor.layout == torch.sparse_coo:
        reduce_sparse_coo(call, scheme, tensor)
    elif tensor.is_contiguous():
        scheme.reduce_dense(call, tensor.view(-1))
    else:
        flat = tensor.contiguous().view(-1)
        scheme.reduce_dense(call, flat)
        tensor.copy_(flat.view(tensor.shape))


def sparse_to_flat(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of a coalesced sparse COO tensor over its flat index space: entry (row, column)
    of its sparse dims x dense dims is flat index row * D + column, D the dense dims' size."""
    row_numel = math.prod(t.shape[t.sparse_dim():])
    rows = torch.zeros(t.indices().shape[1], dtype=torch.int64, device=t.device)
    for dim, size in enumerate(t.shape[:t.sparse_dim()]):
        rows = rows * size + t.indices()[dim]
    flat_idx = (rows[:, None] * row_numel + torch.arange(row_numel, device=t.device)).reshape(-1)
    return flat_idx, t.values().reshape(-1)


def reduce_sparse_coo(call: Call, scheme, tensor: torch.Tensor) -> None:
    """A sparse COO tensor (e.g. the gradient of ``nn.Embedding(sparse=True)``): its entries become flat
    indices row * D + column over its sparse dims x dense dims, are reduced as COO, and the union is
    written back into ``tensor`` (still sparse)."""
    t = tensor.coalesce()
    sparse_shape = t.shape[:t.sparse_dim()]
    row_numel = math.prod(t.shape[t.sparse_dim():])
    flat_idx, flat_val = sparse_to_flat(t)
    pieces = scheme.reduce_coo(call, flat_idx, flat_val, tensor.numel())
    idx = torch.cat([p[0].to(torch.int64) for p in pieces]) if pieces else flat_idx[:0]
    val = torch.cat([p[1] for p in pieces]) if pieces else flat_val[:0]
    # Back to rows: keep one entry per row (column 0 of the row is not always present after a dense
    # fallback dropped zeros, so rebuild rows from the flat indices).
    row_ids = torch.unique(idx // row_numel)
    values = torch.zeros((row_ids.numel(), row_numel), dtype=val.dtype, device=val.device)
    values.view(-1)[torch.searchsorted(row_ids, idx // row_numel) * row_numel + idx % row_numel] = val
    multi = []
    rest = row_ids
    for size in reversed(sparse_shape):
        multi.append(rest % size)
        rest = rest // size
    indices = torch.stack(list(reversed(multi))) if multi else row_ids[None]
    result = torch.sparse_coo_tensor(indices, values.view((-1,) + tuple(t.shape[t.sparse_dim():])), t.shape)
    tensor.copy_(result.coalesce())


def all_reduce(tensor: torch.Tensor, scheme: Union[str, Scheme] = "zen", group=None, async_op: bool = False,
               stats: Optional[dict] = None, timeout=None):
    """Sum ``tensor`` over ``group`` in place, like ``torch.distributed.all_reduce(tensor, op=SUM)``.

    ``scheme`` picks the algorithm: a name from ``zen.SCHEMES``, or a scheme instance with its own settings
    (e.g. ``BalancedParallelism(num_probes=1)``); every scheme gives the sum of all ranks' tensors.
    Any shape; float32/float64/float16/bfloat16 (and int32/int64, summed exactly); strided tensors of
    any stride (the result lands in ``tensor``) and sparse COO tensors. NaN and Inf are summed as by
    ``dist.all_reduce``.

    Errors are the same on every rank: a tensor that differs across ranks (numel, shape, dtype, layout,
    device), or a scheme that does, or any rank's bad input (unsupported dtype, device or layout, unknown
    scheme, not a tensor) raises :class:`zen.MismatchError` (a ValueError) naming the rank and the problem,
    and the group stays usable. A dead or stalled peer raises (a RuntimeError from the backend) within the
    group's timeout, after which the group is broken on that rank (:class:`zen.comm.BrokenGroupError`).

    ``timeout`` (timedelta or seconds; default: ``group``'s own timeout): bounds zen's collectives on this
    group from this call on. Returns None, or a :class:`Work` handle when ``async_op``. ``stats``, if given,
    receives what the call measured (bytes sent, union size, gamma, partition imbalance...).

    Example::

        grad = embedding.weight.grad            # mostly zero rows
        zen.all_reduce(grad)                     # == dist.all_reduce(grad), fewer bytes
    """
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
    future = comm.submit(lambda: reduce_now(comm, tensor, instance, name, stats), stream)
    work = Work(future)
    if async_op:
        return work
    work.wait()
    return None
