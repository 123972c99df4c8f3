"""Balanced Parallelism's cost formulas, in the building blocks of :mod:`zen.cost.terms`, and the two rules that
the protocol and the formulas share, so that the model charges what a call sends: the slot rule
(:func:`slot_count`) and the dense switch (:func:`go_dense`, :func:`goes_whole`).

With n ranks, M entries, density d, union growth gamma = |U| / (M d) and partition imbalance lambda, each
rank sends (n-1)/n lambda M d (s_i + s_v) bytes in the push and
(n-1)/n lambda min(gamma M d (s_i + s_v), gamma M d s_v + M / 8) in the pull (COO, or the hash bitmap over
I_j = {i : h0(i) = j}, |I_j| ~ M / n, whichever is smaller). A ring all-reduce sends 2 (n-1)/n M s_v.

Example: M = 2^20 float32 entries at d = 1% on n = 8 ranks (k = 10486 pairs each, gamma = 8: no overlap)
push 7/8 k 8 = 73 KB, pull 7/8 min(8 k 8, 8 k 4 + 2^20 / 8) = 7/8 min(671 KB, 467 KB) = 408 KB: the
bitmap wins; the ring would send 7.3 MB.
"""
import math
from typing import Dict, List, Sequence

import torch

from ... import wire
from ...cost import Profile, Workload, terms

# A call that the dense switch sends dense, and whose all-gather sends at most this many bytes per rank, goes
# whole in the next such call's agreement (every rank sums the n copies): it saves the all-reduce's round for
# (n-1) (1 - 2/n) M s_v more bytes than the ring, at most 16 KiB, about a round's latency at 1 Gbit/s.
WHOLE_BYTES = 16 << 10


def slot_count(expected: float, bound: float = math.inf) -> int:
    """Entries that a slot holds where ``expected`` are expected and at most ``bound`` can come: room for 2%
    and two standard deviations more (a count of independent arrivals varies by about its square root), and
    4; what outgrows the slot goes in a second message.

    Push slots (rank p to owner j): expected, the pairs p sent j on the last call of the same sequence
    (:func:`zen.schemes.balanced.push.plan`). Pull slots (owner j to all): |U_j| <= ``bound``, the pairs j
    received, R_j (or fewer where global top-k keeps fewer); expected, R_j times the fraction |U_j| / R_j that
    partition j's union had in the previous call of the shape (the hash is fixed, so a partition keeps its hot
    indices from call to call); on the first call the fraction is 1 and the slot is the bound.

    >>> slot_count(100), slot_count(100, 50), slot_count(0)
    (126, 50, 4)"""
    return int(min(bound, math.ceil(1.02 * expected + 2.0 * math.sqrt(expected) + 4)))


def slot_counts(expected: torch.Tensor) -> torch.Tensor:
    """:func:`slot_count` of every entry of an int64 tensor, without a bound: the same float64 arithmetic, so
    the same integers, in one pass (a push plan is n x n of them)."""
    e = expected.to(torch.float64)
    return torch.ceil(1.02 * e + 2.0 * torch.sqrt(e) + 4).to(torch.int64)


def go_dense(nnz_per_rank: Sequence[int], numel: int, n: int, index_size: int, value_size: int, gamma: float,
             dense_threshold=None) -> bool:
    """The dense switch, alike on every rank (its inputs are agreed): dense where the mean density exceeds
    ``dense_threshold``, or (None) where Balanced Parallelism's bytes at the last call's gamma and no imbalance,
    ``terms.balanced_bytes``, are at least the ring all-reduce's, 2 (n-1)/n M s_v."""
    mean_density = sum(nnz_per_rank) / (n * numel) if numel else 0.0
    if dense_threshold is not None:
        return mean_density > dense_threshold
    sparse = terms.balanced_bytes(numel, mean_density, n, gamma, 1.0, index_size, value_size)
    return sparse >= terms.dense_bytes(numel, n, value_size)


def goes_whole(n: int, value_bytes: int, value_dtype) -> bool:
    """Whether a call that went dense sends the tensor (``value_bytes`` on the wire) whole in the next such
    call's agreement: (n-1) copies of at most WHOLE_BYTES, in the tensor's own dtype (every rank sums them)."""
    return value_dtype is None and (n - 1) * value_bytes <= WHOLE_BYTES


def pull_piece(count: float, w: Workload) -> float:
    """The pull piece for |U_j| = count: the smaller of COO and the hash bitmap over I_j (|I_j| ~ M/n)."""
    return min(terms.coo(count, w), count * w.value_size + w.numel / w.n / 8.0)


def pull_slots(w: Workload) -> List[float]:
    """The pull's message bytes per owner (the step header and the room), sized as a call sizes them, in
    steady state (the previous call's unions are this one's)."""
    received = [sum(row[j] for row in w.hash_counts) for j in range(w.n)]
    return [wire.HEADER_BYTES + pull_piece(slot_count(u, r), w) for r, u in zip(received, w.hash_union)]


def phases(w: Workload, p: Profile) -> Dict[str, float]:
    """Balanced Parallelism, phase by phase (the phases a call records in ``stats["phases"]``): scan;
    hash partition (e k_r) and packing; agreement (n counts, gamma, n union fractions four to an int)
    with the push's pieces in its slots (rank r sends its pieces for the other partitions, receives theirs for
    its own); push: what outgrows the slots (nothing, in steady state); aggregate (m per received pair);
    encode (x_e |U_r| + |I_r| / 8 / mu, where the bitmap wins); pull: the all-to-all of the repeated
    slots (:func:`slot_count`; pieces COO or hash bitmap, whichever smaller), and one of what outgrows
    them; decode (x_d |U_j| + |I_j| / 8 / mu per bitmap piece, plus the lines of I_j read,
    ``terms.lines_bytes``, at mu); scatter: the write-back of U."""
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
    pieces = [pull_piece(u, w) for u in w.hash_union]
    bitmap = [x < terms.coo(u, w) for x, u in zip(pieces, w.hash_union)]
    bitmap_bytes = w.numel / n / 8 / p.memory_bandwidth  # |I_j| / 8 bytes (|I_j| ~ M/n) cleared or read
    phases["encode"] = max(u * p.encode_time + bitmap_bytes if b else 0.0 for u, b in zip(w.hash_union, bitmap))
    slots = pull_slots(w)
    rests = [max(0.0, wire.HEADER_BYTES + x - slot) for x, slot in zip(pieces, slots)]
    phases["pull"] = n * max(slots) / p.memory_bandwidth + sum(
        terms.alltoall([(n - 1) * x for x in part], [terms.others(part, r) for r in range(n)], max(part), w, p)
        for part in (slots, rests) if max(part) > 0)
    phases["decode"] = sum(u * p.decode_time + bitmap_bytes + terms.lines_bytes(u, w.numel / n, w.index_size)
                           / p.memory_bandwidth for u, b in zip(w.hash_union, bitmap) if b)
    phases["scatter"] = terms.write_back(w.union, w, p)
    return phases


def memory(w: Workload) -> float:
    """Local COO and its partitioned copy (k_r pairs each), the hash tables (2 k_r slots of int64 plus a
    tenth for the serial memory, order and partition ids: ~30 bytes per pair), the push buffers (send k_r,
    receive and concatenate R_j pairs), the aggregate's scratch, the union U_j, the pull piece and
    its slot (n + 1 copies of the slot: :func:`slot_count`), the pulled slots, the pulled union U, and the
    cached index sets I_j (M indices) when the bitmap is used."""
    n, c = w.n, w.hash_counts
    worst = 0.0
    pieces = [pull_piece(u, w) for u in w.hash_union]
    slots = [max(slot, wire.HEADER_BYTES + x) for slot, x in zip(pull_slots(w), pieces)]
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
