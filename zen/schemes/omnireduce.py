"""``scheme="omnireduce"``: OmniReduce's block-sparse point-to-point scheme (Fei et al., SIGCOMM 2021).

The M elements are cut into B = ceil(M / block_size) fixed blocks (256 elements by default); a block is
non-zero when any of its elements is. Where the call reduces rows of b values, a block is the fewest whole
rows that hold block_size elements (``rows_per_block``), so no block cuts a row. Worker w owns the
contiguous block range [w B / n, (w + 1) B / n):

1. agree: all ranks exchange how many non-zero blocks they have in each owner's range;
2. push: all-to-all, each owner receives the non-zero blocks of its range (a bitmap of the blocks present,
   then their values: ``wire.BLOCKS``);
3. sum: each owner adds the blocks it received, rank 0's first;
4. pull: every owner sends its summed non-zero blocks to all ranks (an all-gather of uneven pieces: an
   all-to-all of the owner's piece repeated n times), which write them into their output.

The ownership is fixed and contiguous, so skewed gradients (hot rows at small indices) load the first
owners most: with K non-zero blocks per rank, union growth gamma_b over blocks and lambda_push, lambda_pull
the heaviest owner's load over the mean, the heaviest rank moves
(n-1)/n * (lambda_push K + lambda_pull gamma_b K) * block_size * s_v bytes. Whole blocks travel, so a block
with one non-zero element costs block_size values.
"""
from dataclasses import dataclass
from typing import Dict

import torch

from .. import ops, wire
from ..cost import Profile, Workload, terms
from ..geometry import block_bounds
from .base import Call, Scheme
from .steps import Agreed, Opening, Sum


def _blocks_piece(count: float, range_blocks: float, w: Workload) -> float:
    """A BLOCKS piece: bitmap over the owner's range + count whole blocks (empty when count is 0)."""
    return count * w.block_size * w.value_size + range_blocks / 8.0 if count > 0 else 0.0


@dataclass
class Blocks(Sum):
    """OmniReduce's union: whole blocks of ``bs`` elements, (block ids, values [K, bs]) per owner, of a tensor of
    ``numel`` entries of ``width`` values."""

    parts: list
    bs: int
    width: int
    numel: int

    def write(self, flat, indices, values) -> None:
        for ids, blocks in self.parts:  # whole blocks: entries that summed to zero too
            scatter_blocks(flat, ids, blocks, self.bs)

    def pieces(self, width: int):
        """The blocks' non-zero entries (those that summed to zero are left out)."""
        rows, out = self.bs // self.width, []
        for ids, blocks in self.parts:
            at, vals = ops.nonzero_rows(blocks.reshape(-1), self.width)
            at = at.long()
            out.append(((ids[at // rows] * rows + at % rows).to(wire.index_dtype(self.numel)), vals))
        return out


class OmniReduce(Scheme):
    name = "omnireduce"

    def __init__(self, block_size: int = 256):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"omnireduce: block_size must be a positive int; got {block_size!r}")
        self.block_size = block_size

    def agreement_settings(self):
        """The settings every rank must share; checked in the agreement."""
        return (self.block_size,)

    def rows_per_block(self, width: int) -> int:
        """Entries per block when entries are rows of ``width`` values: the fewest whole rows that hold
        ``block_size`` elements (1 for rows of ``block_size`` values or more), so blocks never cut a row."""
        return -(-self.block_size // width)

    def reduce_dense(self, call: Call, flat: torch.Tensor) -> None:
        """The non-zero blocks found in ``flat`` directly (no entries extracted first), summed, written back."""
        bs = self.rows_per_block(call.block_size) * call.block_size
        with call.phase("scan", self.name):
            indices, _ = ops.nonzero(flat)
            ids = torch.unique_consecutive(indices.long() // bs)
            blocks = gather_blocks(flat, ids, bs)
        opening = self._open_blocks(call, ids, blocks, flat.numel(), call.block_size)
        with call.phase("agree", self.name):
            agreed = call.agree_opening(opening)
        summed = self.finish(call, opening, agreed)
        with call.phase("scatter", self.name):
            summed.write(flat, None, None)

    def _blocks_of(self, indices, values):
        """(block ids, blocks [K, rows * width]) of unique entries: each block the fewest whole rows that hold
        ``block_size`` elements (:meth:`rows_per_block`)."""
        width = wire.row_width(values)
        rows = self.rows_per_block(width)
        idx = indices.long()
        ids, inverse = torch.unique(idx // rows, sorted=True, return_inverse=True)
        blocks = torch.zeros((ids.numel(), rows, width), dtype=values.dtype, device=values.device)
        blocks[inverse, idx % rows] = values.view(-1, width)
        return ids, blocks.view(-1, rows * width)

    def open(self, call: Call, indices, values, numel) -> Opening:
        """Step 1: this rank's non-zero blocks, and their count in each owner's range for the agreement."""
        with call.phase("scan", self.name):
            ids, blocks = self._blocks_of(indices, values)
        width = wire.row_width(values)
        return self._open_blocks(call, ids, blocks, numel * width, width)

    def _open_blocks(self, call: Call, ids, blocks, numel: int, width: int) -> Opening:
        """The opening of the non-zero blocks (``ids`` ascending int64, ``blocks`` [len(ids), bs]) of a tensor
        of ``numel`` elements, in entries of ``width`` values."""
        n = call.comm.world
        bounds = block_bounds(numel, blocks.shape[1], n)
        cuts = torch.searchsorted(ids, torch.tensor(bounds, dtype=ids.dtype, device=blocks.device)).tolist()
        return Opening([cuts[w + 1] - cuts[w] for w in range(n)], state=(ids, blocks, numel, width, bounds, cuts))

    # ------------------------------------------------------------------------------------------------
    def finish(self, call: Call, opening: Opening, agreed: Agreed) -> Sum:
        """Push, sum and pull of the non-zero blocks of ``bs`` elements; the union as :class:`Blocks`, one piece
        per owner."""
        comm = call.comm
        n, me = comm.world, comm.rank
        ids, blocks, numel, width, bounds, cuts = opening.state
        device, val_dtype, sv, bs = blocks.device, blocks.dtype, blocks.element_size(), blocks.shape[1]
        ranges = [bounds[w + 1] - bounds[w] for w in range(n)]
        counts = agreed.numbers.tolist()
        call.outcome.figures.update(blocks=[sum(row) for row in counts],
                                    imbalance=max(sum(row[w] for row in counts) for w in range(n)) * n
                                    / max(1, sum(map(sum, counts))))
        if sum(map(sum, counts)) == 0:
            call.outcome.figures["union_blocks"] = 0
            return Blocks([], bs, width, numel // width)

        # push: piece w = my non-zero blocks in owner w's range.
        with call.phase("push", self.name):
            block_range = torch.arange(bounds[-1], dtype=torch.int64, device=device)
            bitmaps = [ops.bitmap_encode(ids[cuts[w]:cuts[w + 1]], block_range[bounds[w]:bounds[w + 1]])
                       for w in range(n)]
            send, send_splits = wire.pack_blocks_pieces(bitmaps, blocks, counts[me])
            del blocks
            recv_splits = [wire.blocks_bytes(counts[q][me], ranges[me], bs, sv) for q in range(n)]
            recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
            largest = max((wire.blocks_bytes(counts[q][w], ranges[w], bs, sv)
                           for q in range(n) for w in range(n) if q != w), default=0)
            comm.all_to_all(recv, send, recv_splits, send_splits, largest=largest)
            del send

        # sum my range, senders in rank order.
        with call.phase("sum", self.name):
            my_range = block_range[bounds[me]:bounds[me + 1]]
            received = []
            for q, buf in enumerate(wire.split(recv, recv_splits)):
                bitmap, vals = wire.unpack_blocks(buf, counts[q][me], ranges[me], bs, val_dtype)
                received.append((ops.bitmap_decode(bitmap, my_range, counts[q][me]), vals))
            union = torch.unique(torch.cat([r[0] for r in received]))
            summed = torch.zeros((union.numel(), bs), dtype=val_dtype, device=device)
            for q_ids, vals in received:
                summed.index_add_(0, torch.searchsorted(union, q_ids), vals)
            del received, recv

        # pull: every owner's summed blocks to all.
        with call.phase("pull", self.name):
            payload = wire.pack_blocks(ops.bitmap_encode(union, my_range), summed)
            union_counts = comm.all_gather_ints([union.numel()])[:, 0].tolist()
            pull_splits = [wire.blocks_bytes(c, ranges[w], bs, sv) for w, c in enumerate(union_counts)]
            pulled = torch.empty(sum(pull_splits), dtype=torch.uint8, device=device)
            comm.all_gather_bytes(pulled, payload, pull_splits)
        call.outcome.figures["union_blocks"] = sum(union_counts)
        call.outcome.bytes_sent = sum(send_splits) - send_splits[me] + (n - 1) * payload.numel()
        out = []
        for w, buf in enumerate(wire.split(pulled, pull_splits)):
            if union_counts[w]:
                bitmap, vals = wire.unpack_blocks(buf, union_counts[w], ranges[w], bs, val_dtype)
                out.append((ops.bitmap_decode(bitmap, block_range[bounds[w]:bounds[w + 1]], union_counts[w]), vals))
        return Blocks(out, bs, width, numel // width)

    # --- cost model ----------------------------------------------------------------------------------
    @staticmethod
    def phases(w: Workload, p: Profile) -> Dict[str, float]:
        """OmniReduce, phase by phase (the phases a call records): scan: the non-zeros, their block ids (e per
        non-zero) and a copy of the K non-zero blocks; agreement (n counts); push: the all-to-all of BLOCKS
        pieces to the owners; sum: the owners' sums (2 B s_v / mu per received block); pull: the pull-size
        all-gather, the owner's piece repeated n times and the all-to-all of every owner's summed blocks;
        scatter: the write-back of the union blocks."""
        n, c, bs, sv = w.n, w.block_counts, w.block_size, w.value_size
        bounds = block_bounds(w.numel, bs, n)
        ranges = [bounds[j + 1] - bounds[j] for j in range(n)]
        blocks = [sum(row) for row in c]
        phases = dict(scan=terms.scan(w, p) + max(w.nnz) * p.element_time + max(blocks) * bs * sv / p.memory_bandwidth,
                      agree=terms.agree(n, w, p), push=0.0, sum=0.0, pull=0.0)
        if n > 1 and sum(blocks) > 0:
            send = [sum(_blocks_piece(c[r][j], ranges[j], w) for j in range(n) if j != r) for r in range(n)]
            recv = [sum(_blocks_piece(c[q][r], ranges[r], w) for q in range(n) if q != r) for r in range(n)]
            received = [sum(c[q][r] for q in range(n)) for r in range(n)]
            largest = max(_blocks_piece(c[r][j], ranges[j], w) for r in range(n) for j in range(n) if j != r)
            phases["push"] = terms.alltoall(send, recv, largest, w, p)
            phases["sum"] = max(received) * 2 * bs * sv / p.memory_bandwidth
            pieces = [_blocks_piece(u, ranges[j], w) for j, u in enumerate(w.block_union)]
            phases["pull"] = (terms.allgather(1, w, p) + n * max(pieces) / p.memory_bandwidth
                              + terms.alltoall([(n - 1) * x for x in pieces],
                                               [terms.others(pieces, r) for r in range(n)], max(pieces), w, p))
        union_values = sum(w.block_union) * bs
        phases["scatter"] = union_values * (sv / p.memory_bandwidth + (0.0 if w.dense_input else p.write_time))
        return phases

    @staticmethod
    def memory(w: Workload) -> float:
        """Local COO and block ids, the K gathered blocks (twice: gathered and packed), the received blocks,
        the owner's summed blocks, the repeated pull piece (n + 1 copies) and the pulled union blocks."""
        n, c, bs, sv = w.n, w.block_counts, w.block_size, w.value_size
        num_blocks = -(-w.numel // bs)
        worst = 0.0
        for r in range(n):
            blocks = sum(c[r])
            received = sum(c[q][r] for q in range(n))
            own = w.block_union[r]
            local = terms.coo(w.nnz[r], w) + 8 * blocks + 8 * num_blocks
            worst = max(worst, local + 2 * blocks * bs * sv + received * bs * sv,
                        local + blocks * bs * sv + received * bs * sv + (n + 2) * own * bs * sv
                        + sum(w.block_union) * bs * sv)
        return worst


def _split_tail(numel: int, ids: torch.Tensor, block_size: int):
    """(full blocks, elements in the partial last block, how many of ``ids`` (ascending) are full blocks)."""
    full = numel // block_size
    tail = numel - full * block_size
    has_tail = bool(tail) and ids.numel() > 0 and int(ids[-1]) == full
    return full, tail, ids.numel() - int(has_tail)


def gather_blocks(flat: torch.Tensor, ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """[len(ids), block_size] copy of the blocks ``ids`` (ascending) of ``flat``; the last block zero-padded."""
    full, tail, whole = _split_tail(flat.numel(), ids, block_size)
    out = torch.empty((ids.numel(), block_size), dtype=flat.dtype, device=flat.device)
    torch.index_select(flat[:full * block_size].view(full, block_size), 0, ids[:whole], out=out[:whole])
    if whole < ids.numel():
        out[-1, :tail] = flat[full * block_size:]
        out[-1, tail:] = 0
    return out


def scatter_blocks(flat: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, block_size: int) -> None:
    """The inverse of :func:`gather_blocks`: write blocks ``ids`` (ascending) of ``flat``."""
    full, tail, whole = _split_tail(flat.numel(), ids, block_size)
    flat[:full * block_size].view(full, block_size).index_copy_(0, ids[:whole], values[:whole])
    if whole < ids.numel():
        flat[full * block_size:] = values[-1, :tail]
