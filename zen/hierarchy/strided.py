"""A node call's steps on a strided tensor (``zen.hierarchy``): sparse inside the node where the node's
entries take fewer bytes than the tensor, else dense, as the call's :class:`zen.hierarchy.plan.NodePlan` planned."""
import dataclasses
import time
from typing import Tuple

import torch

from .. import wire
from ..schemes.base import Outcome, Request, phase_range
from ..schemes.call import run_call
from ..transport import Comm
from .plan import shard_segments


def _positions(starts: torch.Tensor, b: int) -> torch.Tensor:
    """The element offsets of entries of b values starting at ``starts``."""
    return starts if b == 1 else (starts[:, None] + torch.arange(b, device=starts.device)).reshape(-1)


def _pack(groups: dict, cuts) -> tuple:
    """The pieces of ``groups`` ({b: (starts, values)}) for each part j (entries of [cuts[j], cuts[j+1])), each
    piece the COO pieces of the block sizes in order; returns (buffer, byte splits, counts row: per part, per b)."""
    pieces, counts = [[] for _ in range(len(cuts) - 1)], []
    for b, (starts, values) in groups.items():
        owner = torch.searchsorted(starts.new_tensor(cuts[1:-1]), starts, right=True)
        per = torch.bincount(owner, minlength=len(cuts) - 1).tolist()
        buf, splits = wire.pack_coo_pieces(starts, values, per)
        for j, piece in enumerate(wire.split(buf, splits)):
            pieces[j].append(piece)
        counts.append(per)
    counts = [c for j in range(len(cuts) - 1) for c in (per[j] for per in counts)]
    parts = [torch.cat(p) if p else torch.empty(0, dtype=torch.uint8) for p in pieces]
    return torch.cat(parts), [p.numel() for p in parts], counts


def _packed_bytes(counts, sizes, element_size: int) -> int:
    """Bytes of one piece of :func:`_pack` holding counts[i] entries of block size sizes[i]."""
    return sum(wire.coo_bytes(c, 8, b * element_size) for b, c in zip(sizes, counts))


def _unpack(buf: torch.Tensor, counts, sizes, dtype) -> list:
    """[(b, starts, values)] of one rank's piece of :func:`_pack` (``counts``: per block size in ``sizes``)."""
    out, at = [], 0
    for b, count in zip(sizes, counts):
        nbytes = wire.coo_bytes(count, 8, b * torch.empty(0, dtype=dtype).element_size())
        out.append((b,) + wire.unpack_coo(buf[at:at + nbytes], count, torch.int64, dtype, b))
        at += nbytes
    return out


def _touched_rows(flat: torch.Tensor, lo: int, parts, starts: torch.Tensor) -> tuple:
    """What ``zen.schemes.call.scan_rows`` finds in the shard at ``lo`` (its segments ``parts``), from ``starts``:
    the element offsets in ``flat`` of every entry summed into the shard (so every non-zero lies in an entry
    starting there): the rows they touch, less those that summed to zero."""
    sizes = sorted({row for _, _, row in parts if row > 1})
    counts, extracted = [0] * (2 * len(sizes)), []
    for offset, numel, row in parts:
        if row == 1:
            extracted.append(None)
            continue
        begin = lo + offset
        inside = starts[(starts >= begin) & (starts < begin + numel)]
        ids = torch.unique(torch.div(inside - begin, row, rounding_mode="floor"))
        rows = flat[begin:begin + numel].view(-1, row)[ids]
        nonzero = rows != 0
        kept = nonzero.any(dim=1)
        ids, rows = ids[kept], rows[kept]
        extracted.append((ids.to(wire.index_dtype(numel // row)), rows))
        g = sizes.index(row)
        counts[2 * g] += int(nonzero.sum())
        counts[2 * g + 1] += ids.numel()
    return extracted, counts


def node_strided(intra: Comm, cross: Comm, plan, request: Request) -> Tuple[dict, Outcome]:
    """Steps 1-3 on a strided tensor (sparse or dense inside the node, as ``plan`` decided); returns the
    phases' seconds with the bytes sent inside the node, and the cross step's outcome."""
    tensor, name, block_size = request.tensor, str(request.name), request.block_size
    flat, bounds, g, me = plan.flat, plan.bounds, intra.world, intra.rank
    lo, hi = bounds[me], bounds[me + 1]
    sizes = sorted(set(plan.blocks))
    t0 = time.perf_counter()
    with phase_range(name, "intra_reduce_scatter"):
        if plan.sparse:  # each rank's entries of shard j to local rank j, which adds them to its own
            mine = plan.entries()
            send, send_splits, counts = _pack(mine, bounds)
            matrix = intra.all_gather_ints(counts).view(g, g, -1)  # [sender, owner, block size]
            recv_counts = [matrix[q, me].tolist() for q in range(g)]
            recv_splits = [_packed_bytes(row, sizes, flat.element_size()) for row in recv_counts]
            largest = max(_packed_bytes(matrix[q, j].tolist(), sizes, flat.element_size())
                          for q in range(g) for j in range(g))
            recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=flat.device)
            with intra.waiting_on("a reduce-scatter inside the node", intra.others()):
                intra.all_to_all(recv, send, recv_splits, send_splits, largest)
            touched = [starts[(starts >= lo) & (starts < hi)] for starts, _ in mine.values()]
            for q, piece in enumerate(wire.split(recv, recv_splits)):
                if q != me:
                    for b, starts, values in _unpack(piece, recv_counts[q], sizes, flat.dtype):
                        flat.index_add_(0, _positions(starts, b), values.reshape(-1))
                        touched.append(starts)
            intra_bytes = sum(send_splits) - send_splits[me]
        else:
            with intra.waiting_on("a reduce-scatter inside the node", intra.others()):
                intra.reduce_scatter(flat, bounds)
            intra_bytes = (flat.numel() - (hi - lo)) * flat.element_size()
    t1 = time.perf_counter()
    with phase_range(name, "cross"):
        parts = shard_segments(plan.segments, lo, hi) if block_size is None else None
        # The shard's non-zero rows are among those the node's entries touched: found there, not by a plan.
        scanned = _touched_rows(flat, lo, parts, torch.cat(touched)) if plan.sparse and parts else None
        crossed = run_call(cross, dataclasses.replace(request, tensor=flat[lo:hi], segments=parts or None,
                                                      checked=tensor, scanned=scanned))
    t2 = time.perf_counter()
    with phase_range(name, "intra_all_gather"):
        if plan.sparse:  # the summed shards' entries to every rank, which clears its own entries of the others first
            summed = plan.entries(lo, hi, rescan=True)
            piece, _, counts = _pack(summed, [lo, hi])
            rows = intra.all_gather_ints(counts).tolist()
            splits = [_packed_bytes(row, list(summed), flat.element_size()) for row in rows]
            gathered = torch.empty(sum(splits), dtype=torch.uint8, device=flat.device)
            with intra.waiting_on("an all-gather inside the node", intra.others()):
                intra.all_gather_bytes(gathered, piece, splits)
            for b, (starts, _) in mine.items():
                outside = (starts < lo) | (starts >= hi)
                flat.index_fill_(0, _positions(starts[outside], b), 0)
            for q, part in enumerate(wire.split(gathered, splits)):
                if q != me:
                    for b, starts, values in _unpack(part, rows[q], list(summed), flat.dtype):
                        flat.index_copy_(0, _positions(starts, b), values.reshape(-1))
            intra_bytes += piece.numel() * (g - 1)
        else:
            with intra.waiting_on("an all-gather inside the node", intra.others()):
                intra.all_gather_parts(flat, bounds)
            intra_bytes += (hi - lo) * flat.element_size() * (g - 1)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    t3 = time.perf_counter()
    return dict(intra_reduce_scatter=t1 - t0, cross=t2 - t1, intra_all_gather=t3 - t2,
                intra_bytes=intra_bytes), crossed
