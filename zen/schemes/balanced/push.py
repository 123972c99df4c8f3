"""zen's push: rank p sends piece j of its non-zeros, those with h0(i) = j, to rank j, so that equal indices meet
on one server. Its round is the agreement's own.

Pieces: the hash partition (``ops.partition``) orders the pairs by partition; piece j is COO (``wire``), of
c[p][j] pairs, COO(c) = pad(c s_i) + pad(c s_v) bytes.

Slots: piece j's first bytes ride in the agreement's message to rank j (:func:`zen.agreement.agree_and_carry`,
wire SLOTTED), in a slot of S[p][j] bytes that both ends knew before the call: the plan this scheme filed
(:func:`plan`) when the same sequence of calls last came by, from that call's agreed counts,
S[p][j] = COO(slot_count(c[p][j])) (room for 2% and two standard deviations more, ``cost.slot_count``), 0 for
p = j. Rank j reads each piece's size from the counts in the agreement's rows, so what outgrows its slot,
COO(c[p][j]) - S[p][j] bytes where positive, follows in one more all-to-all (:func:`send_rest`) that every
rank sizes alike; in steady state nothing does, and the push costs no round of its own.

Whole: where the dense switch sent a small call dense (``cost.goes_whole``), the plan's slots are to hold the
tensor whole instead (label WHOLE), so that the next such call is an all-gather inside the agreement and
every rank sums the n copies (:func:`sum_dense`), one round in all.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch

from ... import ops, wire
from ..base import Call
from .cost import goes_whole, slot_counts

# The labels of the plans this scheme files (the agreement hands them back untouched): what the slots hold.
PIECES = "zen: push pieces"
WHOLE = "zen: the tensor whole"


def partition(indices, values, n: int, seed: int, probes: int, table_factor: float, serial_factor: float):
    """(pieces, counts, fallback): this rank's COO pieces for each rank (byte views of one buffer), counts[j]
    the pairs in piece j, and how many pairs took the partition's exact fallback (``ops.partition``)."""
    part_idx, part_val, counts, part_stats = ops.partition(indices, values, n, seed, probes, table_factor,
                                                           serial_factor)
    counts = counts.tolist()
    send, splits = wire.pack_coo_pieces(part_idx, part_val, counts)
    return wire.split(send, splits), counts, int(part_stats[2])


def plan(call: Call, counts: torch.Tensor, si: int, sv: int) -> None:
    """File the slots of the next call that follows this call's predecessor: S[p][j] = COO(slot_count(c[p][j]))
    bytes (0 for p = j), from this call's agreed counts c (int64 [n, n]), so alike on every rank."""
    slots = wire.coo_bytes(slot_counts(counts), si, sv)
    call.file_plan(slots.fill_diagonal_(0).tolist(), PIECES)


def whole(call: Call) -> Optional[torch.Tensor]:
    """The call's data as one dense tensor where the plan says its agreement's slots hold it whole (the same
    call went dense last time, and was small) and every slot has room for it; else None. Alike on every rank:
    the plan is, and so are the call's size and value dtype (the agreement checks them)."""
    slots, label = call.planned()
    if label != WHOLE or call.dense is None or call.value_dtype is not None:
        return None
    values = call.dense.values()
    value_bytes = values.numel() * values.element_size()
    fits = all(s >= value_bytes for p, row in enumerate(slots) for j, s in enumerate(row) if p != j)
    return values if fits else None


def sum_dense(call: Call, whole_data: Optional[torch.Tensor], arrived, value_bytes: int) -> None:
    """The dense switch's sum of the call's data (``value_bytes`` on the wire): of the n copies that came whole
    in the agreement (``whole_data`` this rank's, ``arrived`` the slots), in rank order and in the tensor's
    dtype, else by the backend's all-reduce. Files the plan of the next such call: whole where
    ``cost.goes_whole``, else none (all-zero slots)."""
    n, me = call.comm.world, call.comm.rank
    small = goes_whole(n, value_bytes, call.value_dtype)
    slot = wire.padded(value_bytes)  # slots are whole int64s
    call.file_plan([[slot if small and p != j else 0 for j in range(n)] for p in range(n)], WHOLE if small else None)
    if whole_data is None:
        call.all_reduce_dense()
        return
    copies = [whole_data if q == me else wire.unpack_dense(arrived[q][:value_bytes], whole_data.numel(),
                                                           whole_data.dtype) for q in range(n)]
    summed = copies[0].clone()
    for copy in copies[1:]:
        summed += copy
    call.dense.write(summed)


@dataclass
class Push:
    """One call's push as this rank saw it: ``pieces`` (its own, by rank), ``arrived`` (the slots' bytes from
    each rank), ``planned`` (S), ``sizes[p][j]`` (COO bytes of piece p -> j), ``overflow[p][j]`` (what followed
    the slot) and ``rest`` (the bytes of the second all-to-all that came to this rank)."""

    pieces: list
    arrived: list
    planned: List[List[int]]
    sizes: List[List[int]]
    overflow: List[List[int]]
    rest: torch.Tensor

    def received(self, me: int) -> List[torch.Tensor]:
        """The whole piece from every rank for this rank's partition: each slot joined with what followed it
        (``wire.join_slotted``; a view where it fit), this rank's own piece as it is."""
        n = len(self.pieces)
        rests = wire.split(self.rest, [self.overflow[q][me] for q in range(n)])
        return [self.pieces[me] if q == me else wire.join_slotted(first, rest, self.sizes[q][me])
                for q, (first, rest) in enumerate(zip(self.arrived, rests))]

    def figures(self, me: int) -> dict:
        """The pieces that outgrew their slots (all ranks'), and this rank's bytes of padding in its slots."""
        return dict(push_overflow=sum(1 for row in self.overflow for x in row if x),
                    push_padding=sum(max(0, slot - size) for slot, size in zip(self.planned[me], self.sizes[me])))


def send_rest(call: Call, pieces, arrived, planned, counts: torch.Tensor, si: int, sv: int,
              slots_held_whole: bool) -> Push:
    """The push after the agreement: files the next call's plan (:func:`plan`) and sends what of each piece
    outgrew its slot in one all-to-all, sized from the agreed ``counts`` (int64 [n, n]; so alike on every rank;
    skipped where nothing did). Where the slots held the tensor whole (``slots_held_whole``) but the call goes
    sparse, every piece follows whole. The n x n bookkeeping is tensor arithmetic: per element in Python it
    would cost every rank O(n^2) interpreter steps per call."""
    comm = call.comm
    n, me = comm.world, comm.rank
    if slots_held_whole:
        planned, arrived = [[0] * n for _ in range(n)], [a[:0] for a in arrived]
    plan(call, counts, si, sv)
    sizes = wire.coo_bytes(counts, si, sv)
    # wire.slotted_rest_bytes of every piece: what exceeds its slot (none for a rank's own piece)
    overflow = (sizes - torch.tensor(planned, dtype=torch.int64)).clamp_(min=0).fill_diagonal_(0)
    largest = int(overflow.max())
    sizes, overflow = sizes.tolist(), overflow.tolist()
    send = torch.cat([piece[planned[me][j]:] if overflow[me][j] else piece[:0] for j, piece in enumerate(pieces)])
    incoming = [row[me] for row in overflow]
    rest = torch.empty(sum(incoming), dtype=torch.uint8, device=pieces[me].device)
    if largest:
        comm.all_to_all(rest, send, incoming, overflow[me], largest=largest)
    return Push(pieces, arrived, planned, sizes, overflow, rest)
