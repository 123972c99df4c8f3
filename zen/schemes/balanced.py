"""``scheme="zen"``: Balanced Parallelism (ZEN, OSDI 2025).

Every rank is the server of one partition of the index space, chosen by the level-1 hash h0:

1. partition: the local non-zeros are split by h0 (hierarchical hashing, ``ops.partition``);
2. agree: all ranks exchange the piece sizes (and check they called with the same tensor);
3. push: all-to-all, piece j to rank j, so equal indices meet on one server. The pieces' first bytes ride
   in the agreement's own messages, in slots planned from the same call's counts last time
   (:func:`zen.agreement.agree_and_push`; wire PLANNED), so a repeated call spends one round on both;
   what outgrows its slot follows in one more all-to-all;
4. aggregate: server j sums what it received into U_j, the union of its partition;
5. pull: every server sends U_j to all, as COO indices or as a hash bitmap over
   I_j = {i : h0(i) = j}, whichever is smaller; every rank writes the union into its output. The pieces go
   in slots that every rank sizes alike from the agreed counts and the previous call's unions
   (:func:`slot_count`), headed by their count and format (``wire`` SLOTTED): no round is spent on
   exchanging their sizes, and only a union that outgrows its slot sends a second message.

With ``dense_switch`` (the DDP hook's), a call whose sizes say dense is cheaper is summed dense after the
agreement instead; where it is small (WHOLE_BYTES), the next such call sends the tensor whole in its
agreement's slots and every rank sums the n copies, so it too takes one round.

With n ranks, M elements, density d, union growth gamma = |U| / (M d) and partition imbalance lambda,
each rank sends (n-1)/n * lambda * M d (s_i + s_v) bytes in the push and
(n-1)/n * lambda * min(gamma M d (s_i + s_v), gamma M d s_v + M / 8) in the pull.
"""
import math
import weakref
from collections import OrderedDict
from typing import Dict, Optional

import torch

from .. import ops, wire
from ..cost import Profile, Workload, terms
from ..geometry import default_probes
from .base import Call, DenseData, Scheme, phase_range


# A call that the dense switch sends dense, and whose all-gather sends at most this many bytes per rank, goes
# whole in the next such call's agreement (every rank sums the n copies): it saves the all-reduce's round for
# (n-1) (1 - 2/n) M s_v more bytes than the ring, at most 16 KiB, about a round's latency at 1 Gbit/s.
WHOLE_BYTES = 16 << 10


_INDEX_SETS = weakref.WeakKeyDictionary()  # Comm -> OrderedDict (numel, device) -> (sets, offsets) of I_j
_INDEX_SETS_KEPT = 8  # tensor sizes whose index sets a group keeps (each holds M int32/int64 indices)


def index_sets(comm, numel: int, device) -> tuple:
    """(sets, offsets) of the hash bitmap's index sets I_j = {i : h0(i) = j} of the group's seed for tensors of
    ``numel`` elements, computed once per (numel, device) and kept for the last few sizes."""
    cache = _INDEX_SETS.setdefault(comm, OrderedDict())
    key = (numel, str(device))
    if key not in cache:
        cache[key] = ops.bitmap_index_sets(numel, comm.world, comm.seed, device)
        while len(cache) > _INDEX_SETS_KEPT:
            cache.popitem(last=False)
    cache.move_to_end(key)
    return cache[key]


def check_settings(owner: str, num_probes, table_factor, serial_factor, dense_threshold) -> None:
    """ValueError naming the first bad setting of the hash partition and the dense switch."""
    if num_probes is not None and (not isinstance(num_probes, int) or not 0 <= num_probes <= 16):
        raise ValueError(f"{owner}: num_probes must be None or an int in [0, 16]; got {num_probes!r}")
    if not 1.0 <= table_factor <= 64.0:
        raise ValueError(f"{owner}: table_factor must be in [1, 64]; got {table_factor!r}")
    if not 0.0 <= serial_factor <= 64.0:
        raise ValueError(f"{owner}: serial_factor must be in [0, 64]; got {serial_factor!r}")
    if dense_threshold is not None and not 0.0 <= dense_threshold <= 1.0:
        raise ValueError(f"{owner}: dense_threshold must be None or in [0, 1]; got {dense_threshold!r}")


def _pull_piece(count: float, w: Workload) -> float:
    """zen's pull piece for |U_j| = count: the smaller of COO and the hash bitmap over I_j (|I_j| ~ M/n)."""
    return min(terms.coo(count, w), count * w.value_size + w.numel / w.n / 8.0)


def slot_count(expected: float, bound: float = math.inf) -> int:
    """Entries that a slot holds where ``expected`` are expected and at most ``bound`` can come: room for 2%
    and two standard deviations more; what outgrows the slot goes in a second message.

    Push slots (rank p to owner j): expected, the pairs p sent j on the last call of the same sequence
    (:func:`zen.agreement.file_plan`). Pull slots (owner j to all): |U_j| <= ``bound``, the pairs j received,
    R_j (or fewer where global top-k keeps fewer); expected, R_j times the fraction |U_j| / R_j that partition
    j's union had in the previous call of the shape (the hash is fixed, so a partition keeps its hot indices
    from call to call); on the first call the fraction is 1 and the slot is the bound."""
    return int(min(bound, math.ceil(1.02 * expected + 2.0 * math.sqrt(expected) + 4)))


def _pull_slots(w: Workload):
    """The pull's slot bytes per owner, sized as a call sizes them, in steady state (the previous call's unions
    are this one's)."""
    received = [sum(row[j] for row in w.hash_counts) for j in range(w.n)]
    return [wire.HEADER_BYTES + _pull_piece(slot_count(u, r), w) for r, u in zip(received, w.hash_union)]


class BalancedParallelism(Scheme):
    name = "zen"

    def __init__(self, num_probes: Optional[int] = None, table_factor: float = 2.0, serial_factor: float = 0.1,
                 dense_switch: bool = False, dense_threshold: Optional[float] = None):
        """``num_probes``: level-2 probes of the hierarchical hash; 0 partitions by an exact counting sort
        instead; None (default) picks by device (:func:`default_probes`). ``dense_switch``: after the size
        exchange, send the whole tensor dense (all ranks alike) when the cost formulas say dense is cheaper,
        or when the mean density exceeds ``dense_threshold``."""
        check_settings("BalancedParallelism", num_probes, table_factor, serial_factor, dense_threshold)
        self.num_probes = num_probes
        self.table_factor = table_factor
        self.serial_factor = serial_factor
        self.dense_switch = dense_switch
        self.dense_threshold = dense_threshold
        # (ranks, entries, row width) -> (gamma, [|U_j| / R_j]) of the last call: the dense switch's gamma and
        # the expected unions that size the pull's slots
        self.history = {}

    def reduce_extracted(self, call: Call, flat: torch.Tensor, indices, values) -> None:
        call.dense = DenseData(lambda: flat, lambda summed: summed is flat or flat.copy_(summed))
        if call.keep is None:
            return super().reduce_extracted(call, flat, indices, values)
        pieces = self.reduce_coo(call, indices, values, flat.numel() // call.block_size)
        with call.phase("scatter", self.name):
            if pieces:  # the owners may have dropped some of this rank's entries: they are not in the sum
                ops.scatter_(flat, indices, torch.zeros_like(values))
                ops.scatter_pieces_(flat, pieces)

    def reduce_coo(self, call, indices, values, numel):
        return self._sync(call, indices, values, numel)

    def agreement_settings(self):
        """The settings every rank must share (they decide the protocol); checked in the agreement."""
        return (self.dense_switch, self.dense_threshold)

    def _go_dense(self, nnz_per_rank, numel, n, index_size, value_size, gamma) -> bool:
        mean_density = sum(nnz_per_rank) / (n * numel) if numel else 0.0
        if self.dense_threshold is not None:
            return mean_density > self.dense_threshold
        sparse = terms.balanced_bytes(numel, mean_density, n, gamma, 1.0, index_size, value_size)
        return sparse >= terms.dense_bytes(numel, n, value_size)

    def _sync(self, call: Call, indices, values, numel):
        comm = call.comm
        n, me, seed = comm.world, comm.rank, comm.seed
        idx_dtype, val_dtype, width = wire.index_dtype(numel), values.dtype, wire.row_width(values)
        # Values travel in call.value_dtype where given; the owners sum them in the tensor's own dtype.
        on_wire = call.value_dtype or val_dtype
        values = values.to(on_wire)
        si, sv = torch.empty(0, dtype=idx_dtype).element_size(), wire.entry_bytes(values)
        indices = indices.to(idx_dtype)

        # 1-3. partition, then agree on sizes and push: counts[p][j] = pairs rank p sends to partition j. The
        # pieces' first bytes ride in the agreement's planned slots; what outgrows them follows in one more
        # all-to-all, sized from the agreed counts.
        with call.phase("partition", self.name):
            probes = self.num_probes if self.num_probes is not None else default_probes(indices.device)
            part_idx, part_val, counts, part_stats = ops.partition(
                indices, values, n, seed, probes, self.table_factor, self.serial_factor)
            send, send_splits = wire.pack_coo_pieces(part_idx, part_val, counts.tolist())
            outgoing = wire.split(send, send_splits)
            whole = self._whole(call)  # the tensor, where the plan's slots are to hold it whole
        # Rank 0's gamma and union fractions (last call of this shape) ride along, so the dense switch and
        # the pull's slots see the same inputs on every rank.
        with call.phase("agree", self.name):
            key = (n, numel, width)
            last = self.history.get(key, (float(n), [1.0] * n))
            agreed, arrived, planned = call.agree_and_push(
                counts.tolist() + [round(last[0] * 1e6)] + wire.pack_fractions(last[1]),
                outgoing if whole is None else [wire.pack_dense(whole)] * n)
            in_slots = sum(planned[me])
            counts, gamma = agreed[:, :n].tolist(), agreed[0, n].item() / 1e6
            fractions = wire.unpack_fractions(agreed[0, n + 1:].tolist(), n)
        nnz = [sum(row) for row in counts]
        loads = [sum(counts[p][j] for p in range(n)) for j in range(n)]
        call.stats.update(nnz=nnz, imbalance=max(loads) * n / max(1, sum(loads)),
                          partition_fallback=int(part_stats[2]))
        if self.dense_switch and call.dense is not None and self._go_dense(nnz, numel, n, si, sv, gamma):
            with phase_range(self.name, "dense"):  # a range only: its seconds go to the next phase, as before
                self._sum_dense(call, whole, arrived, numel * sv)
            call.stats.update(dense=True, whole_in_agreement=whole is not None,
                              bytes_sent=in_slots if whole is not None else terms.dense_bytes(numel, n, sv))
            return []
        with call.phase("push", self.name):
            if whole is not None:  # the slots held the tensor, not the pieces: those all follow
                planned, arrived = [[0] * n for _ in range(n)], [a[:0] for a in arrived]
            call.file_plan([[0 if p == j else wire.coo_bytes(slot_count(c), si, sv) for j, c in enumerate(row)]
                            for p, row in enumerate(counts)])
            sizes = [[wire.coo_bytes(c, si, sv) for c in row] for row in counts]
            overflow = [[0 if p == j else max(0, sizes[p][j] - planned[p][j]) for j in range(n)] for p in range(n)]
            send_rest = torch.cat([piece[planned[me][j]:] if overflow[me][j] else piece[:0]
                                   for j, piece in enumerate(outgoing)])
            recv_rest = torch.empty(sum(overflow[q][me] for q in range(n)), dtype=torch.uint8, device=send.device)
            largest = max(max(row) for row in overflow)
            if largest:
                comm.all_to_all(recv_rest, send_rest, [overflow[q][me] for q in range(n)], overflow[me],
                                largest=largest)

        # 4. aggregate my partition.
        with call.phase("aggregate", self.name):
            recv_counts = [counts[p][me] for p in range(n)]
            received = [outgoing[me] if q == me else wire.join_planned(first, rest, sizes[q][me]) for q, (first, rest)
                        in enumerate(zip(arrived, wire.split(recv_rest, [overflow[q][me] for q in range(n)])))]
            pieces = [wire.unpack_coo(buf, c, idx_dtype, on_wire, width) for buf, c in zip(received, recv_counts)]
            union_idx, union_val = ops.aggregate(torch.cat([p[0] for p in pieces]),
                                                 torch.cat([p[1] for p in pieces]).to(val_dtype), numel, n, seed, me)
            if call.keep is not None:
                union_idx, union_val = self._keep_largest(union_idx, union_val, math.ceil(call.keep / n))

        # 5. pull, in the smaller format, in slots every rank sized beforehand from the counts (no round for sizes).
        with call.phase("encode", self.name):
            payload, fmt = self._encode_pull(comm, union_idx, union_val.to(on_wire), numel, si, sv)
        with call.phase("pull", self.name):
            bounds = loads if call.keep is None else [min(r, math.ceil(call.keep / n)) for r in loads]
            slots = [wire.HEADER_BYTES + self._pull_bytes(comm, slot_count(f * r, b), j, numel, si, sv,
                                                          union_idx.device)
                     for j, (b, f, r) in enumerate(zip(bounds, fractions, loads))]
            first, rest = wire.pack_slotted(union_idx.numel(), fmt, payload, slots[me])
            pulled = torch.empty(sum(slots), dtype=torch.uint8, device=payload.device)
            comm.all_gather_bytes(pulled, first, slots)
            firsts = wire.split(pulled, slots)
            headers = [self._pull_header(first_j, j, bounds[j]) for j, first_j in enumerate(firsts)]
            piece_bytes = [self._pull_bytes(comm, count, j, numel, si, sv, pulled.device, fmt_j)
                           for j, (count, fmt_j) in enumerate(headers)]
            rest_splits = [wire.slotted_rest_bytes(slot, b) for slot, b in zip(slots, piece_bytes)]
            rest_buf = torch.empty(sum(rest_splits), dtype=torch.uint8, device=pulled.device)
            if any(rest_splits):  # a union outgrew its slot: its rest follows, sized by the headers above
                comm.all_gather_bytes(rest_buf, rest, rest_splits)
            rests = wire.split(rest_buf, rest_splits)

        union = sum(count for count, _ in headers)
        mean_nnz = sum(nnz) / n
        if mean_nnz > 0:
            self.history[key] = (union / mean_nnz, [c / r if r else 1.0 for (c, _), r in zip(headers, loads)])
        call.stats.update(union=union, gamma=union / mean_nnz if mean_nnz else 0.0, pull_format=fmt,
                          pull_overflow=sum(1 for x in rest_splits if x),
                          push_overflow=sum(1 for row in overflow for x in row if x),
                          push_padding=sum(max(0, slot - size) for slot, size in zip(planned[me], sizes[me])),
                          bytes_sent=in_slots + sum(overflow[me]) + (n - 1) * (slots[me] + rest.numel()))
        with call.phase("decode", self.name):
            out = []
            for j, ((count, fmt_j), first_j, rest_j) in enumerate(zip(headers, firsts, rests)):
                buf = wire.join_slotted(first_j, rest_j, piece_bytes[j])
                idx, val = self._decode_pull(comm, buf, j, count, fmt_j, numel, idx_dtype, on_wire, width)
                out.append((idx, val.to(val_dtype)))
            if call.keep is not None:
                call.stats["kept"] = torch.cat([piece[0] for piece in out])
        return out

    @staticmethod
    def _whole(call: Call) -> Optional[torch.Tensor]:
        """The call's data as one dense tensor where the plan says its agreement's slots hold it whole (the
        same call went dense last time, and was small) and every slot has room for it; else None. Alike on
        every rank: the plan is, and so are the call's size and value dtype (the agreement checks them)."""
        slots, whole = call.planned()
        if not whole or call.dense is None or call.value_dtype is not None:
            return None
        values = call.dense.values()
        value_bytes = values.numel() * values.element_size()
        fits = all(s >= value_bytes for p, row in enumerate(slots) for j, s in enumerate(row) if p != j)
        return values if fits else None

    @staticmethod
    def _sum_dense(call: Call, whole: Optional[torch.Tensor], arrived, value_bytes: int) -> None:
        """The dense switch's sum of the call's data (``value_bytes`` on the wire): of the n copies that came
        whole in the agreement, in rank order and in the tensor's dtype, else by the backend's all-reduce.
        Files the plan of the next such call: whole where its all-gather sends at most WHOLE_BYTES per rank."""
        n, me = call.comm.world, call.comm.rank
        small = call.value_dtype is None and (n - 1) * value_bytes <= WHOLE_BYTES
        slot = wire.padded(value_bytes)  # slots are whole int64s
        call.file_plan([[slot if small and p != j else 0 for j in range(n)] for p in range(n)], whole=small)
        if whole is None:
            call.all_reduce_dense()
            return
        copies = [whole if q == me else wire.unpack_dense(arrived[q][:value_bytes], whole.numel(), whole.dtype)
                  for q in range(n)]
        summed = copies[0].clone()
        for copy in copies[1:]:
            summed += copy
        call.dense.write(summed)

    @staticmethod
    def _keep_largest(union_idx, union_val, m: int):
        """Global top-k on this owner's partition: its m sums of largest magnitude (rows: by their L1 norm).
        The hash spreads indices evenly over the partitions, so the owners' top k/n are the top k of the whole
        sum up to sampling noise, and no round is spent on a global threshold."""
        if union_idx.numel() <= m:
            return union_idx, union_val
        score = union_val if union_val.dim() == 1 else union_val.abs().sum(1)
        at = ops.topk_select(score.contiguous(), m)[0].long()
        return union_idx[at], union_val[at]

    @staticmethod
    def _pull_bytes(comm, count, j, numel, si, sv, device, fmt=None) -> int:
        """Bytes of owner j's pull piece of ``count`` entries, in ``fmt``, or (None) in the smaller format."""
        coo = wire.coo_bytes(count, si, sv)
        # |I_j| is about numel / n; look at the cached index sets only when the bitmap may win.
        if fmt == wire.COO or (fmt is None and wire.bitmap_bytes(count, numel // comm.world, sv) >= 1.25 * coo):
            return coo
        sets, offsets = index_sets(comm, numel, device)
        bitmap = wire.bitmap_bytes(count, int(offsets[j + 1] - offsets[j]), sv)
        return bitmap if fmt == wire.BITMAP else min(coo, bitmap)

    @classmethod
    def _encode_pull(cls, comm, union_idx, union_val, numel, si, sv):
        me, count = comm.rank, union_idx.numel()
        if cls._pull_bytes(comm, count, me, numel, si, sv, union_idx.device) < wire.coo_bytes(count, si, sv):
            sets, offsets = index_sets(comm, numel, union_idx.device)
            index_set = sets[offsets[me]:offsets[me + 1]]
            return wire.pack_bitmap(ops.bitmap_encode(union_idx, index_set), union_val), wire.BITMAP
        return wire.pack_coo(union_idx, union_val), wire.COO

    @staticmethod
    def _pull_header(first, j: int, bound: int):
        """(count, format) of owner j's pull, checked: |U_j| <= ``bound``, what the agreement allows."""
        count, fmt = wire.slotted_header(first)
        if fmt not in (wire.COO, wire.BITMAP):
            raise ValueError(f"zen: corrupt pull header from rank {j}: unknown format {fmt}")
        if not 0 <= count <= bound:
            raise ValueError(f"zen: corrupt pull header from rank {j}: {count} entries, where at most {bound} can be")
        return count, fmt

    @staticmethod
    def _decode_pull(comm, buf, j, count, fmt, numel, idx_dtype, val_dtype, width=1):
        if fmt == wire.COO:
            return wire.unpack_coo(buf, count, idx_dtype, val_dtype, width)
        if fmt != wire.BITMAP:
            raise ValueError(f"zen: corrupt pull header from rank {j}: unknown format {fmt}")
        sets, offsets = index_sets(comm, numel, buf.device)
        index_set = sets[offsets[j]:offsets[j + 1]]
        bitmap, values = wire.unpack_bitmap(buf, count, index_set.numel(), val_dtype, width)
        return ops.bitmap_decode(bitmap, index_set, count), values

    # --- cost model ----------------------------------------------------------------------------------
    @staticmethod
    def phases(w: Workload, p: Profile) -> Dict[str, float]:
        """Balanced Parallelism, phase by phase (the phases a call records in ``stats["phases"]``): scan;
        hash partition (e k_r) and packing; agreement (n counts, gamma, n union fractions four to an int)
        with the push's pieces in its slots (rank r sends its pieces for the other partitions, receives theirs for
        its own); push: what outgrows the slots (nothing, in steady state); aggregate (m per received pair);
        encode (x_e |U_r| + |I_r| / 8 / mu, where the bitmap wins); pull: the all-to-all of the repeated
        slots (:func:`slot_count`; pieces COO or hash bitmap, whichever smaller), and one of what outgrows
        them; decode (x_d |U_j| + |I_j| / 8 / mu per bitmap piece, plus the lines of I_j read,
        :func:`lines_bytes`, at mu); scatter: the write-back of U."""
        n, c = w.n, w.hash_counts
        packing = max(terms.coo(x, w) for x in w.nnz) / p.memory_bandwidth
        phases = dict(scan=terms.scan(w, p), partition=max(w.nnz) * p.element_time + terms.rows_moved(max(w.nnz), w, p)
                      + packing, agree=terms.agree(n + 1 + len(wire.pack_fractions([0.0] * n)), w, p))
        if n <= 1:
            return dict(phases, scatter=terms.write_back(w.union, w, p))
        # In steady state the pieces ride in the agreement's slots (the last call's counts are this one's),
        # sized by slot_count; nothing outgrows them, and the push is the agreement's extra bytes.
        slots = [[0.0 if j == r else terms.coo(slot_count(c[r][j]), w) for j in range(n)] for r in range(n)]
        send = [sum(row) for row in slots]
        recv = [sum(slots[q][r] for q in range(n)) for r in range(n)]
        largest = max(slots[r][j] for r in range(n) for j in range(n) if j != r)
        phases["agree"] += terms.alltoall_bytes(send, recv, largest, w, p)
        phases["push"] = 0.0
        received = [sum(c[q][r] for q in range(n)) for r in range(n)]
        phases["aggregate"] = max(received) * p.merge_time + terms.rows_moved(max(received), w, p)
        pieces = [_pull_piece(u, w) for u in w.hash_union]
        bitmap = [x < terms.coo(u, w) for x, u in zip(pieces, w.hash_union)]
        bitmap_bytes = w.numel / n / 8 / p.memory_bandwidth  # |I_j| / 8 bytes (|I_j| ~ M/n) cleared or read
        phases["encode"] = max(u * p.encode_time + bitmap_bytes if b else 0.0 for u, b in zip(w.hash_union, bitmap))
        slots = _pull_slots(w)
        rests = [max(0.0, wire.HEADER_BYTES + x - slot) for x, slot in zip(pieces, slots)]
        phases["pull"] = n * max(slots) / p.memory_bandwidth + sum(
            terms.alltoall([(n - 1) * x for x in part], [terms.others(part, r) for r in range(n)], max(part), w, p)
            for part in (slots, rests) if max(part) > 0)
        phases["decode"] = sum(u * p.decode_time + bitmap_bytes + terms.lines_bytes(u, w.numel / n, w.index_size)
                               / p.memory_bandwidth for u, b in zip(w.hash_union, bitmap) if b)
        phases["scatter"] = terms.write_back(w.union, w, p)
        return phases

    @staticmethod
    def memory(w: Workload) -> float:
        """Local COO and its partitioned copy (k_r pairs each), the hash tables (2 k_r slots of int64 plus a
        tenth for the serial memory, order and partition ids: ~30 bytes per pair), the push buffers (send k_r,
        receive and concatenate R_j pairs), the aggregate's scratch, the union U_j, the pull piece and
        its slot (n + 1 copies of the slot: :func:`slot_count`), the pulled slots, the pulled union U, and the cached index sets I_j (M indices) when the bitmap is used."""
        n, c = w.n, w.hash_counts
        worst = 0.0
        pieces = [_pull_piece(u, w) for u in w.hash_union]
        slots = [max(slot, wire.HEADER_BYTES + x) for slot, x in zip(_pull_slots(w), pieces)]
        bitmap = any(x < terms.coo(u, w) for x, u in zip(pieces, w.hash_union))
        for r in range(n):
            k = w.nnz[r]
            received = sum(c[q][r] for q in range(n))
            base = 3 * terms.coo(k, w)  # local, partitioned, send
            partition = 2 * terms.coo(k, w) + (16 + 1.6 + 8 + 4) * k
            pull = (base + 2 * terms.coo(received, w) + terms.coo(w.hash_union[r], w) + pieces[r] + (n + 1) * slots[r]
                    + sum(slots) + w.union * w.index_size)
            aggregate = base + 2 * terms.coo(received, w) + terms.aggregate_bytes(received, w.hash_union[r], w)
            worst = max(worst, partition, pull, aggregate)
        if bitmap:
            worst += w.numel * w.index_size + 8 * (n + 1)
        return worst
