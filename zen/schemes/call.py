"""Running one call of a scheme on the calling thread (the group's lane): the agreement's header, the
dispatch by layout (empty, sparse COO, strided), and the failure protocol that keeps ranks in step.

Bad input on any rank (an unsupported dtype, device or layout, an unknown scheme, a tensor that differs
across ranks, an error a rank hits before the first exchange) travels in the agreement, so every rank raises
the same :class:`zen.MismatchError` and the group stays usable. A failure after the agreement breaks the
group on the rank that sees it (:class:`zen.BrokenGroupError` for every later call; :mod:`zen.transport`).
"""
import math
from typing import Optional, Sequence

import torch

from .. import agreement
from ..agreement import MismatchError, Problem
from ..geometry import sparse_to_flat
from ..transport import Comm
from .base import Call


def run_call(comm: Comm, tensor: torch.Tensor, scheme, scheme_name: Optional[str] = None,
             stats: Optional[dict] = None, allowed: Sequence[str] = ()):
    """Run one all-reduce on the calling thread (which must be the group's lane). In place; returns tensor.

    ``scheme``: a scheme instance, or None when ``scheme_name`` named no scheme (``allowed``: the names that
    would have been, for the error). Errors: bad input -> :class:`MismatchError` on every rank; a failure
    part-way -> the error here, and :class:`zen.BrokenGroupError` for every later call on the group."""
    comm.check_usable()
    if scheme_name is None:
        scheme_name = getattr(scheme, "name", None)
    settings = scheme.agreement_settings() if scheme is not None else None
    header, detail = agreement.inspect_call(tensor, scheme_name, scheme is not None, settings, comm.backend, allowed)
    shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else ()
    scheme_name = str(scheme_name)  # (after inspect_call, whose detail names a non-string scheme by its repr)
    if detail:
        agreement.report(comm, header, detail, shape=shape, scheme_name=scheme_name)
    if comm.world == 1:
        return tensor
    call = Call(comm, header, shape, scheme_name)
    agreements = comm.agreements
    try:
        with torch.no_grad():
            _reduce(call, scheme, tensor)
    except MismatchError:
        raise  # raised by the agreement, alike on every rank: the group is still in step
    except Exception as error:
        if comm.agreements == agreements:
            # Failed before the first exchange (the other ranks wait in it): tell them, so all raise alike.
            header[-1] = Problem.FAILED_BEFORE_EXCHANGE
            agreement.report(comm, header, f"{type(error).__name__}: {error}", error, shape, scheme_name)
        comm.fail(error)
        raise
    except BaseException as error:  # noqa: B036  (KeyboardInterrupt part-way: the protocol is cut)
        comm.fail(error)
        raise
    comm.last_stats = call.stats
    if stats is not None:
        stats.update(call.stats)
    return tensor


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
