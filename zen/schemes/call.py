"""Running one call of a scheme on the calling thread (the group's lane): the agreement's header, the
dispatch by layout (empty, sparse COO, strided), and the failure protocol that keeps ranks in step.

Bad input on any rank (an unsupported dtype, device or layout, an unknown scheme, a tensor that differs
across ranks, an error a rank hits before the first exchange) travels in the agreement, so every rank raises
the same :class:`zen.MismatchError` and the group stays usable. A failure after the agreement breaks the
group on the rank that sees it (:class:`zen.BrokenGroupError` for every later call; :mod:`zen.transport`).
"""
import math
import weakref
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from .. import agreement, ops, wire
from ..agreement import MismatchError, Problem
from ..geometry import rows_are_smaller, rows_to_sparse, sparse_rows
from ..transport import Comm
from .base import Call, DenseData, Outcome, Request, Segment, opens
from .steps import Agreed, Opening

def run_call(comm: Comm, request: Request) -> Outcome:
    """Run one all-reduce (:class:`Request`) on the calling thread (which must be the group's lane), in place
    in ``request.tensor``; returns its :class:`Outcome`.

    A sparse COO tensor travels as rows of its dense dims. Errors: bad input -> :class:`MismatchError` on
    every rank; a failure part-way -> the error here, and :class:`zen.BrokenGroupError` for every later
    call on the group."""
    comm.check_usable()
    header, detail = call_header(comm, request)
    call = Call(comm, request, header)
    if detail:
        agreement.report(comm, header, detail, shape=call.shape, scheme_name=call.scheme_name)
    if comm.world == 1:
        return call.outcome
    agreements = comm.agreements
    try:
        with torch.no_grad():
            _reduce(call, request)
    except MismatchError:
        raise  # raised by the agreement, alike on every rank: the group is still in step
    except Exception as error:
        if comm.agreements == agreements:
            # Failed before the first exchange (the other ranks wait in it): tell them, so all raise alike.
            header[-1] = Problem.FAILED_BEFORE_EXCHANGE
            agreement.report(comm, header, f"{type(error).__name__}: {error}", error, call.shape, call.scheme_name)
        comm.fail(error)
        raise
    except BaseException as error:  # noqa: B036  (KeyboardInterrupt part-way: the protocol is cut)
        comm.fail(error)
        raise
    return call.outcome


def call_header(comm: Comm, request: Request) -> Tuple[List[int], str]:
    """(header, detail) of ``request``'s call, as its agreement takes them (:func:`zen.agreement.inspect_call`
    on the tensor it checks)."""
    scheme = request.scheme
    settings = scheme.agreement_settings() if scheme is not None else None
    return agreement.inspect_call(request.agreed_tensor, request.name, scheme is not None, settings, comm.backend,
                                  request.allowed, request.block_size, request.hierarchy, request.value_dtype,
                                  request.keep)


def _reduce(call: Call, request: Request) -> None:
    tensor, scheme, block_size, segments = request.tensor, request.scheme, request.block_size, request.segments
    if tensor.numel() == 0:
        call.agree([])  # nothing to sum; the agreement still checks that every rank has nothing
    elif tensor.layout == torch.sparse_coo:
        reduce_sparse_coo(call, scheme, tensor)
    else:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        if segments is None:
            row = block_size or (tensor.shape[-1] if tensor.dim() > 1 else 1)
            segments = [(0, flat.numel(), row)]
        reduce_segments(call, scheme, flat, segments, chosen=block_size is None, scanned=request.scanned)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))


def scan_rows(flat: torch.Tensor, segments: Sequence[Segment]):
    """One pass over each segment of row size b > 1: its non-zero rows (ids, rows), and per distinct row size
    the count of non-zero elements (counted within those rows) and of non-zero rows. Returns (extracted,
    counts): extracted[i] is segment i's (ids, rows), None for a segment of row size 1; counts is
    [elements, rows] per distinct row size, ascending."""
    sizes = sorted({row for _, _, row in segments if row > 1})
    counts = [0] * (2 * len(sizes))
    extracted = []
    for offset, numel, row in segments:
        if row == 1:
            extracted.append(None)
            continue
        ids, rows = ops.nonzero_blocks(flat[offset:offset + numel], row)
        extracted.append((ids, rows))
        g = sizes.index(row)
        counts[2 * g] += ops.count_nonzero(rows.reshape(-1), row)[0]
        counts[2 * g + 1] += ids.numel()
    return extracted, counts


def decide_rows(totals: Sequence[int], flat: torch.Tensor, segments: Sequence[Segment]) -> List[int]:
    """The block size of each segment from the sums over all ranks of :func:`scan_rows`'s counts: its row size
    where the rows travel in fewer bytes than their elements (:func:`zen.geometry.rows_are_smaller`), else 1."""
    sizes = sorted({row for _, _, row in segments if row > 1})
    numels = {row: sum(n for _, n, r in segments if r == row) for row in sizes}
    rows = {row for g, row in enumerate(sizes)
            if rows_are_smaller(totals[2 * g], totals[2 * g + 1], row, numels[row], flat.element_size())}
    return [row if row in rows else 1 for _, _, row in segments]


def choose_rows(call: Call, flat: torch.Tensor, segments: Sequence[Segment]):
    """(block sizes, extracted) of :func:`scan_rows` and :func:`decide_rows`, the counts exchanged in the call's
    agreement on their own (a round of its own: for measuring, where the choice must come first)."""
    with call.phase("scan"):
        extracted, counts = scan_rows(flat, segments)
    with call.phase("agree"):
        totals = call.agree(counts).sum(dim=0).tolist()
    return decide_rows(totals, flat, segments), extracted


def segment_entries(flat: torch.Tensor, segment: Segment, b: int, extracted) -> Tuple[torch.Tensor, torch.Tensor]:
    """The non-zero entries of ``segment`` as block size ``b``: what the choice extracted (its rows, or
    their elements), else a scan of the segment."""
    offset, numel, row = segment
    if extracted is None:
        return ops.nonzero_rows(flat[offset:offset + numel], b)
    ids, rows = extracted
    if b == row:
        return ids, rows
    at, values = ops.nonzero(rows.reshape(-1))  # elements chosen: the rows' non-zero elements
    at = at.to(torch.int64)
    return (ids.to(torch.int64)[at // row] * row + at % row).to(wire.index_dtype(numel)), values


_CHOICES = weakref.WeakKeyDictionary()  # Comm -> {(segments, dtype): the block sizes agreed on their last call}


def reduce_segments(call: Call, scheme, flat: torch.Tensor, segments: Sequence[Segment], chosen: bool,
                    scanned=None) -> None:
    """Sum the segments of ``flat`` in place, each as elements or rows (``chosen``: choose per call, else each
    as rows of its row size); segments of one block size are reduced together, by one run of the scheme.

    The choice costs no round of its own: the scheme opens its first group with the block sizes agreed on the
    previous call of the same segments (rows, on the first), and this call's counts ride in front of its
    numbers in the agreement. Where the agreed choice differs (every rank sees it there), every rank opens the
    first group of the agreed choice instead, its numbers in a plain all-gather. A scheme that agrees inside
    its own ``reduce_coo`` (:func:`zen.schemes.base.opens`) gets the choice in a round of its own.
    ``scanned``: :func:`scan_rows`'s result, where the caller has it."""
    if not (chosen and any(row > 1 for _, _, row in segments)):
        if len(segments) == 1:  # nothing to choose: the scheme scans the tensor itself
            call.block_size = segments[0][2]
            offset, numel, _ = segments[0]
            scheme.reduce_dense(call, flat[offset:offset + numel])
            call.outcome.block_size = call.block_size
            return
        _reduce_groups(call, scheme, _groups(call, flat, segments, [row for _, _, row in segments], None))
        return
    choices = _CHOICES.setdefault(call.comm, {})
    key = (tuple(segments), flat.dtype)
    expected = choices.get(key, [row for _, _, row in segments])
    with call.phase("scan"):
        extracted, counts = scanned if scanned is not None else scan_rows(flat, segments)
    if not opens(type(scheme)):
        with call.phase("agree"):
            blocks = decide_rows(call.agree(counts).sum(dim=0).tolist(), flat, segments)
        choices[key] = blocks
        _reduce_groups(call, scheme, _groups(call, flat, segments, blocks, extracted))
        return
    groups = _groups(call, flat, segments, expected, extracted)
    call.agreement.choice_counts = counts
    opened = _open(call, scheme, groups[0])
    blocks = decide_rows(opened[1].choice, flat, segments)
    choices[key] = blocks
    if blocks != expected:
        groups = _groups(call, flat, segments, blocks, extracted)
        opened = _open(call, scheme, groups[0])
    _reduce_groups(call, scheme, groups, opened)
    call.outcome.choice_changed = blocks != expected


@dataclass
class _Group:
    """The segments of one block size b, reduced by one run of the scheme: the views of ``flat`` they are, each
    one's first entry (``bases``: the group's entries one view after the other, ``numel`` in all), each one's
    non-zero entries (``parts``) and all of them as one sparse tensor (``indices``, ``values``)."""

    b: int
    views: List[torch.Tensor]
    bases: List[int]
    parts: list
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def numel(self) -> int:
        return self.bases[-1]

    @property
    def dense(self) -> DenseData:
        """The group's data as one dense tensor: its one view, or the views joined (then split back)."""
        if len(self.views) == 1:
            view = self.views[0]
            return DenseData(lambda: view, lambda summed: summed is view or view.copy_(summed))
        return DenseData(lambda: torch.cat(self.views), self._write_dense)

    def _write_dense(self, summed: torch.Tensor) -> None:
        for view, part in zip(self.views, summed.split([v.numel() for v in self.views])):
            view.copy_(part)


def _groups(call: Call, flat: torch.Tensor, segments, blocks, extracted) -> List[_Group]:
    """The segments with block sizes ``blocks`` as groups of one block size each, ascending; their entries
    are what ``extracted`` holds, else a scan (the call's phase "scan")."""
    by_size = {}
    for i, (segment, b) in enumerate(zip(segments, blocks)):
        by_size.setdefault(b, []).append((segment, extracted[i] if extracted else None))
    groups = []
    with call.phase("scan"):
        for b in sorted(by_size):
            views = [flat[offset:offset + numel] for (offset, numel, _), _ in by_size[b]]
            parts = [segment_entries(flat, segment, b, found) for segment, found in by_size[b]]
            bases = [0]
            for view in views:
                bases.append(bases[-1] + view.numel() // b)
            if len(parts) == 1:
                indices, values = parts[0]
            else:
                indices = torch.cat([idx.to(torch.int64) + base for (idx, _), base in zip(parts, bases)])
                values = torch.cat([val for _, val in parts])
            groups.append(_Group(b, views, bases, parts, indices, values))
    return groups


def _open(call: Call, scheme, group: _Group) -> Tuple[Opening, Agreed]:
    """The scheme's opening of ``group`` (the call's block size set to its b) and its agreement."""
    call.block_size = group.b
    call.dense = group.dense
    opening = scheme.open(call, group.indices, group.values, group.numel)
    with call.phase("agree"):
        agreed = call.agree_opening(opening)
    return opening, agreed


def _reduce_groups(call: Call, scheme, groups: List[_Group], opened=None) -> None:
    """One run of the scheme per group (ascending b), the first one's opening and agreement ``opened`` where
    the caller made them; each group's sum written back into its views."""
    phases = call.outcome.phases  # one clock over the groups: their phases add up
    per_group = []
    for i, group in enumerate(groups):
        call.block_size, call.dense = group.b, group.dense
        if not (i == 0 and opened):
            call.outcome = Outcome(block_size=group.b, phases=phases)
            summed = scheme.run(call, group.indices, group.values, group.numel)
        else:
            call.outcome.block_size = group.b  # the outcome its opening recorded into
            summed = scheme.finish(call, *opened)
        call.dense = None
        if not summed.in_place:  # else the scheme wrote the sum into the data itself
            with call.phase("scatter"):
                _write(group, summed)
        per_group.append(call.outcome)
    call.outcome = _combined(per_group)


def _write(group: _Group, summed) -> None:
    """A group's sum into its views: one segment's by the sum's own rule; several segments' union split by
    segment."""
    if len(group.views) == 1:
        summed.write(group.views[0], *group.parts[0])
    else:
        _write_parts(group, summed.pieces(group.b))


def _write_parts(group: _Group, pieces) -> None:
    """The union ``pieces`` of a group of several segments into their views."""
    views, bases = group.views, group.bases
    # Clear the local entries first: a sum whose pieces leave out entries that summed to zero (OmniReduce's
    # blocks, a dense sum) must not leave this rank's values there.
    for view, (idx, val) in zip(views, group.parts):
        ops.scatter_(view, idx, torch.zeros_like(val))
    if pieces:
        idx, val = _joined(pieces)
        owner = torch.searchsorted(torch.tensor(bases[1:-1], dtype=torch.int64, device=idx.device), idx, right=True)
        order = torch.argsort(owner, stable=True)
        idx, val = idx[order], val[order]
        cuts = torch.bincount(owner, minlength=len(views)).tolist()
        for view, base, part_idx, part_val in zip(views, bases, idx.split(cuts), val.split(cuts)):
            ops.scatter_(view, part_idx - base, part_val)


def _combined(per_group: List[Outcome]) -> Outcome:
    """One call's outcome from its groups': the group's own when one, else the bytes summed, dense where every
    group was, and each group's outcome in ``groups`` (global top-k is one group: its tensor travels as
    elements)."""
    if len(per_group) == 1:
        return per_group[0]
    return Outcome(bytes_sent=sum(g.bytes_sent for g in per_group), dense=all(g.dense for g in per_group),
                   phases=per_group[-1].phases, groups=per_group)


def reduce_sparse_coo(call: Call, scheme, tensor: torch.Tensor) -> None:
    """A sparse COO tensor (e.g. the gradient of ``nn.Embedding(sparse=True)``) travels as rows of its dense
    dims, one index per row (duplicate rows of an uncoalesced tensor summed locally first); the union of
    rows is written back into ``tensor`` (still sparse, coalesced)."""
    t = tensor.coalesce()
    rows, values = sparse_rows(t)
    call.block_size = wire.row_width(values)
    summed = scheme.run(call, rows, values, math.prod(t.shape[:t.sparse_dim()]))
    call.outcome.block_size = call.block_size
    with call.phase("scatter"):
        _write_sparse(tensor, t, summed.pieces(call.block_size))


def _write_sparse(tensor: torch.Tensor, t: torch.Tensor, pieces) -> None:
    """The union ``pieces`` of rows into the sparse ``tensor`` (``t``: it coalesced), coalesced."""
    rows, values = sparse_rows(t)
    if pieces:
        rows, values = _joined(pieces)
        order = torch.argsort(rows)
        rows, values = rows[order], values[order]
    else:
        rows, values = rows[:0], values[:0]
    tensor.copy_(rows_to_sparse(rows, values, t.shape, t.sparse_dim()))


def _joined(pieces) -> Tuple[torch.Tensor, torch.Tensor]:
    """A scheme's union pieces as one (int64 indices, values)."""
    return torch.cat([p[0].to(torch.int64) for p in pieces]), torch.cat([p[1] for p in pieces])
