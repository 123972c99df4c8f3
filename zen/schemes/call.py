"""Running one call of a scheme on the calling thread (the group's lane): the agreement's header, the
dispatch by layout (empty, sparse COO, strided), and the failure protocol that keeps ranks in step.

Bad input on any rank (an unsupported dtype, device or layout, an unknown scheme, a tensor that differs
across ranks, an error a rank hits before the first exchange) travels in the agreement, so every rank raises
the same :class:`zen.MismatchError` and the group stays usable. A failure after the agreement breaks the
group on the rank that sees it (:class:`zen.BrokenGroupError` for every later call; :mod:`zen.transport`).
"""
import math
from typing import List, Optional, Sequence, Tuple

import torch

from .. import agreement, ops, wire
from ..agreement import MismatchError, Problem
from ..geometry import rows_are_smaller, rows_to_sparse, sparse_rows
from ..transport import Comm
from .base import Call, DenseData

Segment = Tuple[int, int, int]  # (offset, numel, row size) of a part of a flat tensor


def run_call(comm: Comm, tensor: torch.Tensor, scheme, scheme_name: Optional[str] = None,
             stats: Optional[dict] = None, allowed: Sequence[str] = (), block_size: Optional[int] = None,
             segments: Optional[Sequence[Segment]] = None, keep: Optional[int] = None,
             value_dtype: Optional[torch.dtype] = None, whole: Optional[torch.Tensor] = None, scanned=None,
             hierarchy: Optional[tuple] = None):
    """Run one all-reduce on the calling thread (which must be the group's lane). In place; returns tensor.

    ``scheme``: a scheme instance, or None when ``scheme_name`` named no scheme (``allowed``: the names that
    would have been, for the error). ``block_size``: reduce a strided tensor as rows of that many values;
    None chooses per call between elements and rows of the last dimension (:func:`choose_rows`).
    ``segments``: the parts of a flat tensor (e.g. a DDP bucket's parameters) as (offset, numel, row size),
    each reduced as elements or as rows of its row size, chosen per call; they replace ``block_size``.
    ``keep``: global top-k, where the scheme supports it (:attr:`Call.keep`); the indices that reached the
    sum are then in ``stats["kept"]`` (absent where every entry did). ``value_dtype``: the dtype values
    travel in (:attr:`Call.value_dtype`; the caller checks that the scheme supports it). ``whole``: where
    ``tensor`` is a part of a tensor (a hierarchical call's shard), that tensor: the agreement checks it.
    ``scanned``: what :func:`scan_rows` would find in ``segments``, where the caller knows it already.
    ``hierarchy``: (setting, local_size) of a :mod:`zen.hierarchy` call, for the agreement's header.
    A sparse COO tensor travels as rows of its dense dims. Errors: bad input -> :class:`MismatchError` on
    every rank; a failure part-way -> the error here, and :class:`zen.BrokenGroupError` for every later
    call on the group."""
    comm.check_usable()
    header, detail, shape, scheme_name = call_header(comm, tensor if whole is None else whole, scheme, scheme_name,
                                                     allowed, block_size, hierarchy, value_dtype, keep)
    if detail:
        agreement.report(comm, header, detail, shape=shape, scheme_name=scheme_name)
    if comm.world == 1:
        return tensor
    call = Call(comm, header, shape, scheme_name, keep=keep, value_dtype=value_dtype)
    agreements = comm.agreements
    try:
        with torch.no_grad():
            _reduce(call, scheme, tensor, block_size, segments, scanned)
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


def call_header(comm: Comm, tensor, scheme, scheme_name, allowed, block_size, hierarchy=None, value_dtype=None,
                keep=None) -> tuple:
    """(header, detail, shape, scheme name) of a call on ``tensor``, as its agreement takes them
    (:func:`zen.agreement.inspect_call`; ``scheme_name`` None: the scheme's own name)."""
    if scheme_name is None:
        scheme_name = getattr(scheme, "name", None)
    settings = scheme.agreement_settings() if scheme is not None else None
    header, detail = agreement.inspect_call(tensor, scheme_name, scheme is not None, settings, comm.backend,
                                            allowed, block_size, hierarchy, value_dtype, keep)
    shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else ()
    # str after inspect_call, whose detail names a non-string scheme by its repr
    return header, detail, shape, str(scheme_name)


def _reduce(call: Call, scheme, tensor: torch.Tensor, block_size: Optional[int], segments, scanned=None) -> None:
    if tensor.numel() == 0:
        call.agree([])  # nothing to sum; the agreement still checks that every rank has nothing
    elif tensor.layout == torch.sparse_coo:
        reduce_sparse_coo(call, scheme, tensor)
    else:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        if segments is None:
            row = block_size or (tensor.shape[-1] if tensor.dim() > 1 else 1)
            segments = [(0, flat.numel(), row)]
        reduce_segments(call, scheme, flat, segments, chosen=block_size is None, scanned=scanned)
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


class _ChoiceChanged(Exception):
    """Raised alike on every rank by the agreement when the agreed block sizes differ from the expected ones."""


def reduce_segments(call: Call, scheme, flat: torch.Tensor, segments: Sequence[Segment], chosen: bool,
                    scanned=None) -> None:
    """Sum the segments of ``flat`` in place, each as elements or rows (``chosen``: choose per call, else each
    as rows of its row size); segments of one block size are reduced together, by one run of the scheme.

    The choice costs no round of its own: the scheme runs with the block sizes agreed on the previous call of
    the same segments (rows, on the first), and this call's counts ride in its agreement. Where the agreed
    choice differs (every rank sees it there), every rank starts the scheme over with it, once. ``scanned``:
    :func:`scan_rows`'s result, where the caller has it."""
    if not (chosen and any(row > 1 for _, _, row in segments)):
        if len(segments) == 1:  # nothing to choose: the scheme scans the tensor itself
            call.block_size = segments[0][2]
            offset, numel, _ = segments[0]
            scheme.reduce_dense(call, flat[offset:offset + numel])
            call.stats["block_size"] = call.block_size
            return
        _reduce_groups(call, scheme, flat, segments, [row for _, _, row in segments], None)
        return
    key = (tuple(segments), flat.dtype)
    expected = call.comm.row_choices.get(key, [row for _, _, row in segments])
    with call.phase("scan"):
        extracted, counts = scanned if scanned is not None else scan_rows(flat, segments)
    agreed = []

    def on_choice(totals):
        agreed.append(decide_rows(totals, flat, segments))
        call.comm.row_choices[key] = agreed[0]
        if agreed[0] != expected:
            raise _ChoiceChanged()

    call.choice_counts, call.on_choice = counts, on_choice
    try:
        _reduce_groups(call, scheme, flat, segments, expected, extracted)
    except _ChoiceChanged:
        _reduce_groups(call, scheme, flat, segments, agreed[0], extracted)
        call.stats["choice_changed"] = True


def _reduce_groups(call: Call, scheme, flat: torch.Tensor, segments, blocks, extracted) -> None:
    """The segments with block sizes ``blocks``, one run of the scheme per block size (ascending)."""
    groups = {}
    for i, (segment, b) in enumerate(zip(segments, blocks)):
        groups.setdefault(b, []).append((segment, extracted[i] if extracted else None))
    per_group = []
    for b in sorted(groups):
        call.block_size = b
        call.stats = {"phases": call.stats.get("phases", {})}
        with call.phase("scan"):
            parts = [(segment, segment_entries(flat, segment, b, found)) for segment, found in groups[b]]
        if len(parts) == 1:
            (offset, numel, _), (indices, values) = parts[0]
            scheme.reduce_extracted(call, flat[offset:offset + numel], indices, values)
        else:
            _reduce_parts(call, scheme, flat, parts, b)
        per_group.append(dict(call.stats, block_size=b))
    call.stats = _combined(per_group)


def _reduce_parts(call: Call, scheme, flat: torch.Tensor, parts, b: int) -> None:
    """Segments of one block size b, with their extracted entries, as one sparse tensor: their entries one
    after the other."""
    views = [flat[offset:offset + numel] for (offset, numel, _), _ in parts]
    bases = [0]
    for view in views:
        bases.append(bases[-1] + view.numel() // b)
    indices = torch.cat([idx.to(torch.int64) + base for (_, (idx, _)), base in zip(parts, bases)])
    values = torch.cat([val for _, (_, val) in parts])

    went_dense = []

    def write(summed):
        went_dense.append(True)
        for view, part in zip(views, summed.split([v.numel() for v in views])):
            view.copy_(part)

    call.dense = DenseData(lambda: torch.cat(views), write)
    pieces = scheme.reduce_coo(call, indices, values, bases[-1])
    call.dense = None
    with call.phase("scatter"):
        _write_parts(views, bases, parts, pieces, went_dense)


def _write_parts(views, bases, parts, pieces, went_dense) -> None:
    """:func:`_reduce_parts`'s write-back: the union ``pieces`` into the segments' ``views``."""
    if not went_dense:
        # Clear the local entries first: a scheme whose union leaves out entries that summed to zero
        # (OmniReduce's blocks, a densified sum) must not leave this rank's values there.
        for view, (_, (idx, val)) in zip(views, parts):
            ops.scatter_(view, idx, torch.zeros_like(val))
    if pieces:
        idx, val = _joined(pieces)
        owner = torch.searchsorted(torch.tensor(bases[1:-1], dtype=torch.int64, device=idx.device), idx, right=True)
        order = torch.argsort(owner, stable=True)
        idx, val = idx[order], val[order]
        cuts = torch.bincount(owner, minlength=len(views)).tolist()
        for view, base, part_idx, part_val in zip(views, bases, idx.split(cuts), val.split(cuts)):
            ops.scatter_(view, part_idx - base, part_val)


def _combined(per_group: List[dict]) -> dict:
    """One call's statistics from its groups': the group's own when one, else the bytes summed and each
    group's under "groups"."""
    if len(per_group) == 1:
        return per_group[0]
    phases = per_group[-1].get("phases", {})
    groups = [{k: v for k, v in g.items() if k != "phases"} for g in per_group]
    return dict(phases=phases, groups=groups, bytes_sent=sum(g.get("bytes_sent", 0) for g in groups),
                dense=all(g.get("dense", False) for g in groups))


def reduce_sparse_coo(call: Call, scheme, tensor: torch.Tensor) -> None:
    """A sparse COO tensor (e.g. the gradient of ``nn.Embedding(sparse=True)``) travels as rows of its dense
    dims, one index per row (duplicate rows of an uncoalesced tensor summed locally first); the union of
    rows is written back into ``tensor`` (still sparse, coalesced)."""
    t = tensor.coalesce()
    rows, values = sparse_rows(t)
    call.block_size = wire.row_width(values)
    pieces = scheme.reduce_coo(call, rows, values, math.prod(t.shape[:t.sparse_dim()]))
    call.stats["block_size"] = call.block_size
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
