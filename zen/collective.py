"""``zen.all_reduce``: the entry point with the contract of ``torch.distributed.all_reduce(op=SUM)``."""
from typing import Optional

import torch
import torch.distributed as dist

from . import comm as comm_mod
from .comm import Comm, get_comm, shape_code
from .schemes import SCHEMES, make_scheme
from .schemes.base import Call

_BACKEND_DEVICES = {"gloo": {"cpu"}, "nccl": {"cuda"}, "mpi": {"cpu", "cuda"}}


class Work:
    """The handle of an asynchronous zen collective (like ``torch.distributed.Work``)."""

    def __init__(self, future: torch.futures.Future):
        self._future = future

    def wait(self, timeout=None) -> bool:
        """Block until done; re-raises the collective's error on this rank."""
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


def header_for(tensor: torch.Tensor, scheme: str, comm: Comm) -> list:
    """The agreement header of a call; ``problem`` != 0 marks what this rank cannot do."""
    problem = 0
    if tensor.dtype not in comm_mod.DTYPES:
        problem = 1
    elif tensor.device.type not in _BACKEND_DEVICES.get(comm.backend, {tensor.device.type}):
        problem = 2
    elif scheme not in SCHEMES:
        problem = 3
    elif tensor.layout not in (torch.strided, torch.sparse_coo):
        problem = 4
    return [
        tensor.numel(),
        comm_mod.DTYPES.index(tensor.dtype) if tensor.dtype in comm_mod.DTYPES else -1,
        shape_code(tensor.shape),
        SCHEMES.index(scheme) if scheme in SCHEMES else -1,
        1 if tensor.layout == torch.sparse_coo else 0,
        problem,
    ]


def reduce_now(comm: Comm, tensor: torch.Tensor, scheme, scheme_name: str, stats: Optional[dict] = None):
    """Run one all-reduce on the calling thread (which must be the group's lane). In place; returns tensor."""
    call = Call(comm, header_for(tensor, scheme_name, comm))
    if call.header[-1]:
        call.agree([])  # raises on every rank
    if comm.world == 1:
        return tensor
    if tensor.layout == torch.sparse_coo:
        reduce_sparse_coo(call, scheme, tensor)
    elif tensor.is_contiguous():
        scheme.reduce_dense(call, tensor.view(-1))
    else:
        flat = tensor.contiguous().view(-1)
        scheme.reduce_dense(call, flat)
        tensor.copy_(flat.view(tensor.shape))
    comm.last_stats = call.stats
    if stats is not None:
        stats.update(call.stats)
    return tensor


def reduce_sparse_coo(call: Call, scheme, tensor: torch.Tensor) -> None:
    """A sparse COO tensor (e.g. the gradient of ``nn.Embedding(sparse=True)``): its entries become flat
    indices row * D + column over its sparse dims x dense dims, are reduced as COO, and the union is
    written back into ``tensor`` (still sparse)."""
    t = tensor.coalesce()
    sparse_shape = t.shape[:t.sparse_dim()]
    row_numel = 1
    for size in t.shape[t.sparse_dim():]:
        row_numel *= size
    rows = torch.zeros(t.indices().shape[1], dtype=torch.int64, device=t.device)
    for dim, size in enumerate(sparse_shape):
        rows = rows * size + t.indices()[dim]
    flat_idx = (rows[:, None] * row_numel + torch.arange(row_numel, device=t.device)).reshape(-1)
    flat_val = t.values().reshape(-1)
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


def all_reduce(tensor: torch.Tensor, scheme: str = "zen", group=None, async_op: bool = False,
               stats: Optional[dict] = None):
    """Sum ``tensor`` over ``group`` in place, like ``torch.distributed.all_reduce(tensor, op=SUM)``.

    ``scheme`` picks the algorithm (``zen.SCHEMES``); every scheme gives the sum of all ranks' tensors.
    Any shape; float32/float64/float16/bfloat16 (and int32/int64, summed exactly); strided tensors of
    any stride (the result lands in ``tensor``) and sparse COO tensors. Ranks that call with different
    tensors (size, shape, dtype) or schemes all raise :class:`zen.MismatchError` instead of hanging.

    Returns None, or a :class:`Work` handle when ``async_op``. ``stats``, if given, receives what the
    call measured (bytes sent, union size, gamma, partition imbalance...).

    Example::

        grad = embedding.weight.grad            # mostly zero rows
        zen.all_reduce(grad)                     # == dist.all_reduce(grad), fewer bytes
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"zen.all_reduce expects a torch.Tensor, got {type(tensor).__name__}")
    comm = get_comm(group)
    if comm is None:
        return None
    try:
        instance = make_scheme(scheme)
    except ValueError:
        instance = None  # reported through the agreement, so every rank raises
    stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None
    future = comm.submit(lambda: reduce_now(comm, tensor, instance, scheme, stats), stream)
    work = Work(future)
    if async_op:
        return work
    work.wait()
    return None
