"""zen's pull: every server j sends its union U_j to every rank, which writes it into its output.

Format: U_j travels as COO, or as a hash bitmap over I_j = {i : h0(i) = j} (bit r: whether I_j[r] is in U_j;
values in index order), whichever is smaller: COO(u) = pad(u s_i) + pad(u s_v) bytes against
BITMAP_j(u) = pad(ceil(|I_j| / 8)) + pad(u s_v). The bitmap wins once u s_i > |I_j| / 8, a density of U_j
in I_j above 1 / (8 s_i) (3% with int32 indices). Every rank computes I_j alike from the group's seed
(``ops.bitmap_index_sets``), once per tensor size (:func:`index_sets`).

Slots: no round is spent on the pieces' sizes. Each piece goes SLOTTED (``wire``), headed by its
[count, format], in a room that every rank sizes alike before the exchange (:func:`rooms`): the piece of
slot_count(f_j R_j, B_j) entries in the smaller format, R_j the pairs server j received (agreed counts),
B_j <= R_j the most its union can hold, f_j = |U_j| / R_j of the previous call of the shape (agreed from
rank 0). Only a union that outgrows its room sends the rest, in a second all-gather sized from the heads.

Example: R_j = 1000 pairs received, of which the last call's union kept f_j = 0.6: the room holds a piece of
slot_count(600, 1000) = 665 entries; a union of 700 outgrows it, and its bytes past the room follow in the
second message.
"""
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import List

import torch

from ... import ops, wire
from .cost import slot_count

_INDEX_SETS = weakref.WeakKeyDictionary()  # Comm -> OrderedDict (numel, device) -> (sets, offsets) of I_j
_INDEX_SETS_KEPT = 8  # tensor sizes whose index sets a group keeps (each holds M int32/int64 indices)


def index_sets(comm, numel: int, device) -> tuple:
    """(sets, offsets) of the hash bitmap's index sets I_j = {i : h0(i) = j} of the group's seed for tensors of
    ``numel`` entries (I_j = sets[offsets[j]:offsets[j + 1]], ascending), computed once per (numel, device) and
    kept for the last few sizes."""
    cache = _INDEX_SETS.setdefault(comm, OrderedDict())
    key = (numel, str(device))
    if key not in cache:
        cache[key] = ops.bitmap_index_sets(numel, comm.world, comm.seed, device)
        while len(cache) > _INDEX_SETS_KEPT:
            cache.popitem(last=False)
    cache.move_to_end(key)
    return cache[key]


def forget_index_sets(comm) -> None:
    """Drop the group's cached index sets (the next bitmap pull computes them again: a cold call)."""
    _INDEX_SETS.pop(comm, None)


def piece_bytes(comm, count: int, j: int, numel: int, si: int, sv: int, device, fmt=None) -> int:
    """Bytes of server j's pull piece of ``count`` entries, in ``fmt``, or (None) in the smaller format."""
    coo = wire.coo_bytes(count, si, sv)
    # |I_j| is about numel / n; look at the cached index sets only when the bitmap may win.
    if fmt == wire.COO or (fmt is None and wire.bitmap_bytes(count, numel // comm.world, sv) >= 1.25 * coo):
        return coo
    sets, offsets = index_sets(comm, numel, device)
    bitmap = wire.bitmap_bytes(count, int(offsets[j + 1] - offsets[j]), sv)
    return bitmap if fmt == wire.BITMAP else min(coo, bitmap)


def encode(comm, union_idx, union_val, numel: int, si: int, sv: int):
    """(piece, format): this server's union in the smaller format."""
    me, count = comm.rank, union_idx.numel()
    if piece_bytes(comm, count, me, numel, si, sv, union_idx.device) < wire.coo_bytes(count, si, sv):
        sets, offsets = index_sets(comm, numel, union_idx.device)
        index_set = sets[offsets[me]:offsets[me + 1]]
        return wire.pack_bitmap(ops.bitmap_encode(union_idx, index_set), union_val), wire.BITMAP
    return wire.pack_coo(union_idx, union_val), wire.COO


def rooms(comm, bounds, fractions, loads, numel: int, si: int, sv: int, device) -> List[int]:
    """Each server's room (bytes after the header), alike on every rank: the piece of
    slot_count(f_j R_j, B_j) entries in the smaller format (``bounds`` B_j, ``fractions`` f_j, ``loads`` R_j)."""
    return [piece_bytes(comm, slot_count(f * r, b), j, numel, si, sv, device)
            for j, (b, f, r) in enumerate(zip(bounds, fractions, loads))]


def header(head: torch.Tensor, j: int, bound: int):
    """(count, format) of server j's pull from its head, checked: a known format, |U_j| <= ``bound`` (what the
    agreement allows)."""
    count, fmt = head.tolist()
    if fmt not in (wire.COO, wire.BITMAP):
        raise ValueError(f"zen: corrupt pull header from rank {j}: unknown format {fmt}")
    if not 0 <= count <= bound:
        raise ValueError(f"zen: corrupt pull header from rank {j}: {count} entries, where at most {bound} can be")
    return count, fmt


@dataclass
class Pulled:
    """Every server's pull as it arrived: ``headers`` (count, format), ``rooms`` (the first part's piece
    bytes), ``rests`` (the second parts), ``sizes`` (each piece's bytes); ``sent``, the bytes this rank handed
    the backend for its peers."""

    headers: list
    rooms: list
    rests: list
    sizes: List[int]
    sent: int

    def piece(self, j: int) -> torch.Tensor:
        """Server j's piece, its room joined with its rest (a view where it fit)."""
        return wire.join_slotted(self.rooms[j], self.rests[j], self.sizes[j])

    @property
    def overflow(self) -> int:
        """Unions that outgrew their rooms."""
        return sum(1 for rest in self.rests if rest.numel())


def exchange(comm, count: int, fmt: int, piece: torch.Tensor, room: List[int], bounds, numel: int, si: int,
             sv: int) -> Pulled:
    """All-gather every server's piece: first each [count, format] head and room (``room[j]`` bytes, known
    alike), then, where any piece outgrew its room, the rests, sized from the heads."""
    n, me = comm.world, comm.rank
    first, _ = wire.pack_slotted(wire.step_header(count, fmt, piece.device), [piece], [room[me]])
    rest = piece[room[me]:]
    splits = [wire.slotted_bytes(wire.STEP_HEADER_INTS, r) for r in room]
    pulled = torch.empty(sum(splits), dtype=torch.uint8, device=piece.device)
    comm.all_gather_bytes(pulled, first, splits)
    parts = [wire.unpack_slotted(message, wire.STEP_HEADER_INTS) for message in wire.split(pulled, splits)]
    headers = [header(head, j, bounds[j]) for j, (head, _) in enumerate(parts)]
    sizes = [piece_bytes(comm, c, j, numel, si, sv, pulled.device, f) for j, (c, f) in enumerate(headers)]
    rest_splits = [wire.slotted_rest_bytes(r, size) for r, size in zip(room, sizes)]
    rest_buf = torch.empty(sum(rest_splits), dtype=torch.uint8, device=pulled.device)
    if any(rest_splits):  # a union outgrew its room: its rest follows, sized by the heads above
        comm.all_gather_bytes(rest_buf, rest, rest_splits)
    return Pulled(headers, [r for _, r in parts], wire.split(rest_buf, rest_splits), sizes,
                  (n - 1) * (splits[me] + rest.numel()))


def decode(comm, buf, j: int, count: int, fmt: int, numel: int, idx_dtype, val_dtype, width: int = 1):
    """(indices, values) of server j's piece ``buf`` of ``count`` entries in ``fmt``; a corrupt piece raises a
    clean error (ValueError from the format, RuntimeError from the kernel), never reads out of bounds."""
    if fmt == wire.COO:
        return wire.unpack_coo(buf, count, idx_dtype, val_dtype, width)
    if fmt != wire.BITMAP:
        raise ValueError(f"zen: corrupt pull header from rank {j}: unknown format {fmt}")
    sets, offsets = index_sets(comm, numel, buf.device)
    index_set = sets[offsets[j]:offsets[j + 1]]
    bitmap, values = wire.unpack_bitmap(buf, count, index_set.numel(), val_dtype, width)
    return ops.bitmap_decode(bitmap, index_set, count), values
