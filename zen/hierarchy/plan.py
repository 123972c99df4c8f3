"""A node call's plan of a strided tensor (:mod:`zen.hierarchy`): its shards, cut at row boundaries, and
:class:`NodePlan`, which chooses from the node's counts how each segment travels and whether the two steps
inside the node move entries or the shards themselves."""
from typing import Optional, Sequence

import torch

from .. import ops
from ..schemes.call import Segment, decide_rows, scan_rows, segment_entries


def shard_bounds(segments: Sequence[Segment], parts: int) -> list:
    """``parts`` + 1 offsets cutting the flat tensor of ``segments`` into nearly equal shards, each cut moved
    down to a row boundary of the segment it falls in (so no row of b values is split between shards)."""
    total = sum(numel for _, numel, _ in segments)
    bounds = []
    for j in range(parts + 1):
        target = j * total // parts
        for offset, numel, row in segments:
            if offset <= target < offset + numel:
                target = offset + (target - offset) // row * row
                break
        bounds.append(target)
    return bounds


def shard_segments(segments: Sequence[Segment], lo: int, hi: int) -> list:
    """The parts of ``segments`` within [lo, hi), as segments of that shard (offsets from lo)."""
    return [(max(offset, lo) - lo, min(offset + numel, hi) - max(offset, lo), row)
            for offset, numel, row in segments if offset < hi and offset + numel > lo]


class NodePlan:
    """A strided tensor's non-zero entries, and how the node moves them: each segment (offset, numel, row size)
    as rows of its row size or as elements, chosen on the node's counts (``zen.schemes.call.decide_rows``), and
    the two steps inside the node sparse (each rank's entries of shard j to local rank j; the summed shards'
    entries back) or dense (the shards themselves), whichever moves fewer bytes: sparse where the node's
    entries (8-byte start, b values each) take fewer bytes than one copy of the tensor, sum_q E_q <= M s_v."""

    def __init__(self, tensor, segments, block_size):
        self.flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        if block_size is not None:
            segments = [(0, self.flat.numel(), block_size)]
        elif segments is None:
            segments = [(0, self.flat.numel(), tensor.shape[-1] if tensor.dim() > 1 and tensor.shape[-1] else 1)]
        self.segments, self.forced = list(segments), block_size is not None
        self.extracted, counts = scan_rows(self.flat, self.segments)
        ones = sum(ops.count_nonzero(self.flat[o:o + n], 1)[0] for o, n, r in self.segments if r == 1)
        self.counts = counts + [ones]  # per row size > 1: elements, rows; then the elements of row size 1

    def decide(self, rows: torch.Tensor, local_size: int) -> None:
        """The blocks and the mode, from every node rank's counts (``rows``), alike on the node's ranks."""
        totals = rows.sum(dim=0).tolist()
        flat, segments = self.flat, self.segments
        self.blocks = [r for _, _, r in segments] if self.forced else decide_rows(totals[:-1], flat, segments)
        sizes = sorted({r for _, _, r in segments if r > 1})
        as_rows = {r for (_, _, r), b in zip(segments, self.blocks) if b == r > 1}
        s_v = flat.element_size()
        self.entry_bytes = []  # per node rank: its entries' bytes on the wire
        for row in rows.tolist():
            nbytes = row[-1] * (8 + s_v)
            for g, size in enumerate(sizes):
                nbytes += row[2 * g + 1] * (8 + size * s_v) if size in as_rows else row[2 * g] * (8 + s_v)
            self.entry_bytes.append(nbytes)
        self.sparse = local_size > 1 and sum(self.entry_bytes) <= flat.numel() * s_v
        self.bounds = shard_bounds(segments, local_size)

    def entries(self, lo: int = 0, hi: Optional[int] = None, rescan: bool = False) -> dict:
        """{b: (starts, values)}: the entries of [lo, hi) by block size b (starts: int64 element offsets of
        ``flat``, ascending; values [k] or [k, b]); ``rescan``: of the tensor now, not as first scanned."""
        hi = self.flat.numel() if hi is None else hi
        groups = {}
        for i, (segment, b) in enumerate(zip(self.segments, self.blocks)):
            offset, numel, row = segment
            part = shard_segments([segment], lo, hi)
            if not part:
                continue
            begin = lo + part[0][0]
            if rescan or part[0][1] != numel:
                ids, values = ops.nonzero_rows(self.flat[begin:begin + part[0][1]], b)
            else:
                ids, values = segment_entries(self.flat, segment, b, self.extracted[i])
            starts = begin + ids.to(torch.int64) * b
            groups.setdefault(b, []).append((starts, values))
        empty = self.flat[:0]
        for b in set(self.blocks):  # every block size, so that every rank's counts have the same length
            groups.setdefault(b, []).append((empty.new_empty(0, dtype=torch.int64),
                                             empty if b == 1 else empty.new_empty(0, b)))
        return {b: (torch.cat([s for s, _ in parts]), torch.cat([v for _, v in parts]))
                for b, parts in sorted(groups.items())}
