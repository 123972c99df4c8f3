"""zen's cost model: the design notes' formulas, with latency and local compute terms, for every scheme.

Notation: n ranks, M elements, k_r non-zeros on rank r (k their mean, d = k / M the density), U the size of
the union of all ranks' non-zeros, gamma = U / k, lambda = heaviest partition / mean partition, s_i and s_v
bytes per index and per value. A :class:`Profile` gives the group's numbers:

    b      bandwidth per rank and direction, bytes/s (links are full duplex: a rank sends and receives at b);
           b_ar, b_a2a, b_p2p: what a ring all-reduce, an all-to-all and a pairwise exchange reach per rank
           (b_a2a of all-to-alls sent over zen's duplex transport, b_a2a' of smaller ones: comm.duplex_all_to_all)
           (measured by the probe; they differ on real transports: on gloo/TCP an all-to-all reaches
           60-95% of b, depending on the number of peers); b where not measured
    alpha  latency of one message step, s
    mu     memory bandwidth of the streaming kernels (non-zero scan, copies, dense adds), bytes/s
    e      time per pair of the hashing kernels (zen's partition, OmniReduce's block ids), s
    m      time per pair merged by ``ops.aggregate`` from n ascending runs (zen's aggregate, agsparse's sum), s
    m_2    the same from two runs (SparCML's merges): a k-way merge's heap costs log k per pair, so on 8 ranks
           sharing 2 cores m_2 is about half of m (85 against 170 ns per pair, 262144 pairs per rank), s
    f      time per block of SCAN_BLOCK elements holding a non-zero, in the scan of a dense tensor (the
           kernel tests 16 elements at once and stages a block's pairs only where one is set), s
    w      time per element scattered at ascending positions (the write-back of the union; the cache
           lines of the output it writes are counted apart, at mu), s
    x_e    time per index encoded into a hash bitmap (a galloping search of I_j and a bit set), s
    x_d    time per index decoded from a hash bitmap (a set bit found and its I_j element written; the
           cache lines of I_j it reads are counted apart, at mu), s

Wire terms. A collective finishes when its most loaded link does: an all-to-all in which rank r sends S_r
and receives R_r bytes takes  c_a2a + max_r max(S_r, R_r) / b_a2a;  a ring all-gather of R bytes per rank
takes c_ag + (n-1) R / b; a ring all-reduce of M s_v bytes c_ar + 2 (n-1)/n M s_v / b_ar; a pairwise
exchange of S bytes c_p2p + S / b_p2p. The fixed costs are
measured by the probe (``zen.predict``), or, for a profile given as (b, alpha), counted in message steps:
c_ag = (n-1) alpha (ring), c_ar = 2 (n-1) alpha (ring), c_a2a = alpha and c_p2p = alpha (all pairs at once).
Every scheme starts with the agreement (an all-gather of a few int64 per rank).

Local terms. Finding the non-zeros of a dense tensor reads all of it and writes its pairs: M s_v / mu + f per
block of 16 holding one (:func:`scan_blocks`). Hashing costs e per pair, merging m per pair (m_2 from two
runs), scattering into the output w per element plus the cache lines of the output it writes, at mu
(:func:`lines_bytes`), encoding or decoding a hash bitmap x_e or x_d per index it holds, plus its |I_j| / 8
bytes (|I_j| ~ M/n) cleared or read at mu; a decode also reads the cache lines of I_j that hold its |U_j|
indices (nearly all of I_j once the fill passes 1/16, so at 8% fill these reads cost 8x the per-index work);
copies and dense adds cost their bytes / mu. The probe measures f, e, m, m_2, w, x_e, x_d and mu with every
rank running the kernel at once (the way a call runs them), so ranks that share a host's cores or
memory bandwidth show in them.

Closed forms (equal k_r, balanced partitions, no latency, no local terms), which the functions below reduce
to and the tests check:

    dense       2 (n-1)/n M s_v / b
    agsparse    (n-1) k (s_i + s_v) / b
    zen         (n-1)/n lambda (k + min(U (s_i + s_v), U s_v + M/8) / (s_i + s_v)) (s_i + s_v) / b      (ZEN Eq. 1)
    sparcml     sum_{i=1..log2 n} min(gamma(2^(i-1)) k (s_i + s_v), M s_v) / b                      (ZEN Eq. 2)
    omnireduce  (n-1)/n (lambda_push K + lambda_pull U_b) B s_v / b, K, U_b non-zero blocks of B elements

All inputs of the exact forms are in a :class:`Workload`: measured on a group by ``zen.prediction.measure``
or estimated from a few numbers by :func:`estimate_workload`. :func:`predict_times` and
:func:`predict_memory` need no process group.
"""
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from .comm import duplex_all_to_all

HEADER_INTS = 6  # zen's agreement header (comm.HEADER_FIELDS), sent by every scheme's first collective
# The Profile's local kernel times (s), each >= 0; settable by name in zen.prediction.make_profile.
LOCAL_TIMES = ("element_time", "write_time", "found_time", "merge_time", "merge2_time", "encode_time",
               "decode_time")
# Sizes (elements) of the small and the large calibration call (zen.prediction.calibrate).
CALIBRATION_NUMELS = (1 << 16, 1 << 22)

# --------------------------------------------------------------------------------------------------------
# Bytes on the wire (used by the schemes' dense switches)


def dense_bytes(numel: int, n: int, value_size: int) -> float:
    """Ring allreduce: 2 (n-1)/n * M s_v."""
    return 2.0 * (n - 1) / n * numel * value_size if n > 1 else 0.0


def balanced_bytes(numel: int, density: float, n: int, gamma: float, imbalance: float, index_size: int,
                   value_size: int) -> float:
    """Balanced Parallelism (ZEN Eq. 1, with the hash-bitmap pull):

    push = (n-1)/n * lambda * M d (s_i + s_v)
    pull = (n-1)/n * lambda * min(U (s_i + s_v), U s_v + M / 8),  U = min(M, gamma M d)
    """
    if n <= 1:
        return 0.0
    nnz = numel * density
    union = min(float(numel), gamma * nnz)
    push = nnz * (index_size + value_size)
    pull = min(union * (index_size + value_size), union * value_size + numel / 8.0)
    return (n - 1) / n * imbalance * (push + pull)


# --------------------------------------------------------------------------------------------------------
# The inputs


@dataclass(frozen=True)
class Profile:
    """A group's speeds. ``overheads`` holds measured fixed costs (s) of one call of a primitive:
    "allgather", "allreduce", "alltoall", "p2p"; a primitive not in it costs its message steps * latency.
    ``rates`` holds measured bytes/s per rank of "allreduce", "alltoall", "alltoall_small" and "p2p"; one not
    in it runs at ``bandwidth``. ``call_overhead``: the fixed cost of one zen call (the lane hand-off).
    ``calibration`` and ``calibration_large`` hold, per scheme, the seconds its formula missed on a measured
    call of ``CALIBRATION_NUMELS[0]`` and of ``CALIBRATION_NUMELS[1]`` elements (costs the per-primitive and
    per-element terms leave out; ``zen.prediction.calibrate``); :meth:`miss` interpolates them for a call."""

    bandwidth: float
    latency: float
    memory_bandwidth: float = 10e9
    element_time: float = 5e-9
    write_time: float = 2e-9
    found_time: float = 30e-9
    merge_time: float = 20e-9
    merge2_time: float = 15e-9
    encode_time: float = 20e-9
    decode_time: float = 8e-9
    call_overhead: float = 0.0
    overheads: tuple = ()
    rates: tuple = ()
    calibration: tuple = ()
    calibration_large: tuple = ()

    def __post_init__(self):
        if not self.bandwidth > 0:
            raise ValueError(f"Profile: bandwidth must be > 0 bytes/s; got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"Profile: latency must be >= 0 s; got {self.latency!r}")
        if not self.memory_bandwidth > 0:
            raise ValueError(f"Profile: memory_bandwidth must be > 0 bytes/s; got {self.memory_bandwidth!r}")
        for name in LOCAL_TIMES:
            if not getattr(self, name) >= 0:
                raise ValueError(f"Profile: {name} must be >= 0 s; got {getattr(self, name)!r}")
        if not all(rate > 0 for _, rate in self.rates):
            raise ValueError(f"Profile: rates must be > 0 bytes/s; got {self.rates!r}")

    def fixed(self, primitive: str, n: int) -> float:
        """Fixed cost of one call of ``primitive`` on n ranks."""
        if n <= 1:
            return 0.0
        measured = dict(self.overheads).get(primitive)
        if measured is not None:
            return measured
        steps = {"allgather": n - 1, "allreduce": 2 * (n - 1), "alltoall": 1, "p2p": 1}[primitive]
        return steps * self.latency

    def miss(self, scheme: str, numel: int) -> float:
        """Seconds added to ``scheme``'s formula for a call of ``numel`` elements: the small calibration's
        miss c_s up to M_s = CALIBRATION_NUMELS[0] elements, the large one's c_l from M_l = CALIBRATION_NUMELS[1]
        on, linear in M between them: c_s + (c_l - c_s) (M - M_s) / (M_l - M_s). Not extrapolated: the
        large call's miss (ranks that share cores waiting on each other after every local phase) grows
        with M, but slower than M (8 ranks on 2 cores, 1 Gbit/s: ~15, ~60 and ~100 ms at 1M, 4M and 16M
        elements). A scheme without a large calibration keeps c_s; 0 without any."""
        small = dict(self.calibration).get(scheme, 0.0)
        large = dict(self.calibration_large).get(scheme, small)
        lo, hi = CALIBRATION_NUMELS
        share = min(max((numel - lo) / (hi - lo), 0.0), 1.0)
        return small + (large - small) * share

    def rate(self, primitive: str) -> float:
        """Bytes/s per rank that ``primitive`` reaches ("allreduce", "alltoall", "alltoall_small", "p2p");
        "alltoall_small" (the backend's own all-to-all, where zen sends small ones) is "alltoall"'s where
        not measured."""
        rates = dict(self.rates)
        if primitive == "alltoall_small" and primitive not in rates:
            primitive = "alltoall"
        return rates.get(primitive, self.bandwidth)


@dataclass
class Workload:
    """What the formulas need to know about one all-reduce (counts may be fractional estimates).

    nnz[r]: non-zeros of rank r. union: |U|. hash_counts[r][j]: non-zeros of rank r that h0 sends to
    partition j; hash_union[j] = |U_j|. doubling_unions[s][g]: SparCML's running union after s doubling
    steps in core group g (core ranks [g 2^s, (g+1) 2^s) with the ranks folded into them); the last level
    has one group, the union. block_counts[r][w]: non-zero blocks of rank r in owner w's range;
    block_union[w]: non-zero blocks of the union in that range. dense_input: the tensor is strided (its
    non-zeros must be found and the union written back), not sparse COO.
    """

    numel: int
    n: int
    nnz: Sequence[float]
    union: float
    hash_counts: Sequence[Sequence[float]]
    hash_union: Sequence[float]
    doubling_unions: Sequence[Sequence[float]]
    block_counts: Sequence[Sequence[float]]
    block_union: Sequence[float]
    index_size: int = 4
    value_size: int = 4
    block_size: int = 256
    dense_input: bool = True

    @property
    def gamma(self) -> float:
        mean = sum(self.nnz) / self.n
        return self.union / mean if mean else 0.0

    @property
    def hash_imbalance(self) -> float:
        loads = [sum(row[j] for row in self.hash_counts) for j in range(self.n)]
        return max(loads) * self.n / sum(loads) if sum(loads) else 1.0

    @property
    def block_imbalance(self) -> float:
        loads = [sum(row[w] for row in self.block_counts) for w in range(self.n)]
        return max(loads) * self.n / sum(loads) if sum(loads) else 1.0


# --------------------------------------------------------------------------------------------------------
# Building blocks


def _coo(count: float, w: Workload) -> float:
    return count * (w.index_size + w.value_size)


def _alltoall(send: Sequence[float], recv: Sequence[float], largest: float, w: Workload, p: Profile) -> float:
    """c_a2a + max_r max(S_r, R_r) / b, at the rate of the transport that ``largest`` (the largest piece
    a rank sends another) picks (``zen.comm.duplex_all_to_all``): b_a2a on zen's duplex transport, the
    backend's own all-to-all's (b_a2a') below it."""
    if w.n <= 1:
        return 0.0
    rate = p.rate("alltoall" if duplex_all_to_all(w.n, largest) else "alltoall_small")
    return p.fixed("alltoall", w.n) + max(max(s, r) for s, r in zip(send, recv)) / rate


def _allgather(ints: int, w: Workload, p: Profile) -> float:
    """A ring all-gather of ``ints`` int64 per rank: c_ag + (n-1) 8 ints / b."""
    if w.n <= 1:
        return 0.0
    return p.fixed("allgather", w.n) + (w.n - 1) * 8 * ints / p.bandwidth


def _agree(extra_ints: int, w: Workload, p: Profile) -> float:
    return _allgather(HEADER_INTS + extra_ints, w, p)


SCAN_BLOCK = 16  # elements the non-zero scan tests at once (csrc/cpu/nonzero_cpu.cpp)


def scan_blocks(count: float, span: float) -> float:
    """Expected blocks of SCAN_BLOCK elements that hold at least one of ``count`` non-zeros spread uniformly
    over ``span`` elements: span / B (1 - (1 - count / span)^B)."""
    return lines_bytes(count, span, 1, SCAN_BLOCK) / SCAN_BLOCK


def _span(blocks: float, w: Workload) -> float:
    """Elements a set of non-zeros spreads over: its non-zero blocks of ``w.block_size`` (measured), at most M
    (M where no blocks were counted)."""
    return min(float(w.numel), blocks * w.block_size) if blocks > 0 else float(w.numel)


def _scan(w: Workload, p: Profile) -> float:
    """Finding the non-zeros of a dense tensor: M s_v / mu + f per scan block holding one, on the slowest
    rank (0 for COO input). The non-zeros spread over the rank's non-zero blocks (skewed data packs them)."""
    if not w.dense_input:
        return 0.0
    found = max(scan_blocks(k, _span(sum(row), w)) for k, row in zip(w.nnz, w.block_counts))
    return w.numel * w.value_size / p.memory_bandwidth + found * p.found_time


def _scatter(count: float, blocks: float, w: Workload, p: Profile) -> float:
    """Scattering ``count`` elements that lie in ``blocks`` non-zero blocks into a dense tensor: w per element
    plus the cache lines of the tensor they land in, at mu (:func:`lines_bytes`). A sparse set costs a line
    per element, a dense one a line per 16 (float32): at 8 ranks on 2 cores, 45 ns per element at 8% fill
    and 15 at 50%, where w alone would make them equal. The elements spread over their non-zero blocks
    (measured), not over all M: a skewed set (frequency-ordered embedding rows) packs into few lines."""
    return count * p.write_time + lines_bytes(count, _span(blocks, w), w.value_size) / p.memory_bandwidth


def _write_back(count: float, w: Workload, p: Profile) -> float:
    """Writing ``count`` union elements into the dense output (:func:`_scatter` over the union's non-zero
    blocks, ``block_union``); 0 for COO input, which is returned as pairs."""
    return _scatter(count, sum(w.block_union), w, p) if w.dense_input else 0.0


def _others(values: Sequence[float], r: int) -> float:
    return sum(values) - values[r]


def _sparcml_message(count: float, w: Workload) -> float:
    """SparCML's message for a running union of ``count``: COO while smaller than dense, then dense."""
    return min(_coo(count, w), w.numel * w.value_size)


def _blocks_piece(count: float, range_blocks: float, w: Workload) -> float:
    """A BLOCKS piece: bitmap over the owner's range + count whole blocks (empty when count is 0)."""
    return count * w.block_size * w.value_size + range_blocks / 8.0 if count > 0 else 0.0


def _zen_pull_piece(count: float, w: Workload) -> float:
    """zen's pull piece for |U_j| = count: the smaller of COO and the hash bitmap over I_j (|I_j| ~ M/n)."""
    return min(_coo(count, w), count * w.value_size + w.numel / w.n / 8.0)


def lines_bytes(count: float, span: float, item_size: int, line: int = 64) -> float:
    """Expected bytes of the ``line``-byte cache lines of a ``span``-item array (``item_size`` bytes per item)
    that reads of ``count`` items spread uniformly over it touch: span s (1 - (1 - count / span)^(line / s)).

    >>> lines_bytes(0, 1000, 4), lines_bytes(1000, 1000, 4), round(lines_bytes(1, 1000, 4))
    (0.0, 4000.0, 64)
    """
    if span <= 0 or count <= 0:
        return 0.0
    fill = min(count / span, 1.0)
    return float(span) * item_size * (-math.expm1(line / item_size * math.log1p(-fill)) if fill < 1 else 1.0)


def _aggregate_bytes(count: float, unique: float, w: Workload) -> float:
    """Peak bytes of ``ops.aggregate`` on ``count`` pairs with ``unique`` results: its scratch (count indices
    and count sums, in the accumulation type: at least 4 bytes) and its output (unique pairs)."""
    return count * (w.index_size + max(w.value_size, 4)) + _coo(unique, w)


# --------------------------------------------------------------------------------------------------------
# Times (seconds) of every scheme


def dense_time(w: Workload, p: Profile) -> float:
    """Agreement + ring all-reduce: c_ar + 2 (n-1)/n M s_v / b_ar (COO input is densified first and
    found again after: 2 M s_v / mu, the scatter of k_r into its blocks, f per scan block of the union)."""
    t = p.call_overhead + _agree(0, w, p)
    if w.n > 1:
        t += p.fixed("allreduce", w.n) + dense_bytes(w.numel, w.n, w.value_size) / p.rate("allreduce")
    if not w.dense_input:
        t += 2 * w.numel * w.value_size / p.memory_bandwidth
        t += scan_blocks(w.union, _span(sum(w.block_union), w)) * p.found_time
        t += max(_scatter(k, sum(row), w, p) for k, row in zip(w.nnz, w.block_counts))
    return t


def agsparse_phases(w: Workload, p: Profile) -> Dict[str, float]:
    """All-gather sparse, phase by phase (the phases a call records): scan; agreement (k_r); gather: the
    all-to-all of the repeated COO pieces (rank r sends (n-1) k_r (s_i + s_v) and receives
    sum_{q != r} k_q (s_i + s_v)); sum: unpacking the n pieces and merging all n k pairs (m each); scatter:
    the write-back of U."""
    n, k = w.n, w.nnz
    phases = dict(scan=_scan(w, p), agree=_agree(1, w, p), gather=0.0, sum=0.0)
    if n > 1 and sum(k) > 0:
        phases["gather"] = _alltoall([(n - 1) * _coo(x, w) for x in k], [_coo(_others(k, r), w) for r in range(n)],
                                     _coo(max(k), w), w, p)
        phases["sum"] = n * _coo(max(k), w) / p.memory_bandwidth + sum(k) * p.merge_time
    return dict(phases, scatter=_write_back(w.union, w, p))


def agsparse_time(w: Workload, p: Profile) -> float:
    """All-gather sparse: the call's fixed cost and the sum of :func:`agsparse_phases`."""
    return p.call_overhead + sum(agsparse_phases(w, p).values())


def zen_phases(w: Workload, p: Profile) -> Dict[str, float]:
    """Balanced Parallelism, phase by phase (the phases a call records in ``stats["phases"]``): scan;
    hash partition (e k_r); agreement (n counts); push: packing and the all-to-all (rank r sends its pieces
    for the other partitions, receives theirs for its own); aggregate (m per received pair); encode
    (x_e |U_r| + |I_r| / 8 / mu, where the bitmap wins); pull: the sizes' all-gather and the all-to-all
    of the repeated pieces (COO or hash bitmap, whichever smaller); decode (x_d |U_j| + |I_j| / 8 / mu
    per bitmap piece, plus the lines of I_j read, :func:`lines_bytes`, at mu); scatter: the write-back of U."""
    n, c = w.n, w.hash_counts
    phases = dict(scan=_scan(w, p), partition=max(w.nnz) * p.element_time, agree=_agree(n, w, p))
    if n <= 1:
        return dict(phases, scatter=_write_back(w.union, w, p))
    send = [sum(_coo(c[r][j], w) for j in range(n) if j != r) for r in range(n)]
    recv = [sum(_coo(c[q][r], w) for q in range(n) if q != r) for r in range(n)]
    received = [sum(c[q][r] for q in range(n)) for r in range(n)]
    largest = max(_coo(c[r][j], w) for r in range(n) for j in range(n) if j != r)
    phases["push"] = max(_coo(x, w) for x in w.nnz) / p.memory_bandwidth + _alltoall(send, recv, largest, w, p)
    phases["aggregate"] = max(received) * p.merge_time
    pieces = [_zen_pull_piece(u, w) for u in w.hash_union]
    bitmap = [x < _coo(u, w) for x, u in zip(pieces, w.hash_union)]
    bitmap_bytes = w.numel / n / 8 / p.memory_bandwidth  # |I_j| / 8 bytes (|I_j| ~ M/n) cleared or read
    phases["encode"] = max(u * p.encode_time + bitmap_bytes if b else 0.0 for u, b in zip(w.hash_union, bitmap))
    phases["pull"] = (_allgather(3, w, p) + n * max(pieces) / p.memory_bandwidth
                      + _alltoall([(n - 1) * x for x in pieces], [_others(pieces, r) for r in range(n)], max(pieces),
                                  w, p))
    phases["decode"] = sum(u * p.decode_time + bitmap_bytes + lines_bytes(u, w.numel / n, w.index_size)
                           / p.memory_bandwidth for u, b in zip(w.hash_union, bitmap) if b)
    phases["scatter"] = _write_back(w.union, w, p)
    return phases


def zen_time(w: Workload, p: Profile) -> float:
    """Balanced Parallelism: the call's fixed cost and the sum of :func:`zen_phases`."""
    return p.call_overhead + sum(zen_phases(w, p).values())


def sparcml_phases(w: Workload, p: Profile) -> Dict[str, float]:
    """SparCML, phase by phase (the phases a call records): scan; agreement (k_r); exchange: the fold of
    the n - 2^L extra ranks, L = floor(log2 n) doubling steps, step s packing and moving the largest
    running union of level s (COO, or dense past break-even; its bytes / mu + its bytes / b_p2p) plus a
    step header where the size is not known, and the unfold of the union; merge: the two sums' pairs
    concatenated (their bytes / mu) and merged at m_2 per pair (two ascending runs), or dense adds
    (2 M s_v / mu); scatter: the write-back of the union (a copy, M s_v / mu, once it is dense)."""
    n, k = w.n, w.nnz
    pw = 1
    while 2 * pw <= n:
        pw *= 2
    steps, folded = pw.bit_length() - 1, n - pw
    dense_bytes_ = w.numel * w.value_size
    phases = dict(scan=_scan(w, p), agree=_agree(1, w, p), exchange=0.0, merge=0.0)

    def merge(a, b):
        both = a + b
        if _sparcml_message(a, w) >= dense_bytes_ or _sparcml_message(b, w) >= dense_bytes_:
            return 2 * dense_bytes_ / p.memory_bandwidth
        return (_coo(both, w) / p.memory_bandwidth + both * p.merge2_time
                + (dense_bytes_ / p.memory_bandwidth if _coo(both, w) > dense_bytes_ else 0.0))

    def send(message_bytes):  # packed, then sent
        return message_bytes / p.memory_bandwidth + message_bytes / p.rate("p2p")

    if folded:
        phases["exchange"] += p.fixed("p2p", n) + max(send(_sparcml_message(k[pw + i], w)) for i in range(folded))
        phases["merge"] += max(merge(k[i], k[pw + i]) for i in range(folded))
    for s in range(steps):
        level = w.doubling_unions[s]
        headers = 1 if (s > 0 or folded) else 0
        phases["exchange"] += (1 + headers) * p.fixed("p2p", n) + max(send(_sparcml_message(u, w)) for u in level)
        phases["merge"] += max(merge(level[g], level[g ^ 1]) for g in range(len(level)))
    if folded:
        phases["exchange"] += 2 * p.fixed("p2p", n) + send(_sparcml_message(w.union, w))
    dense_out = _sparcml_message(w.union, w) >= dense_bytes_
    # copy out (dense input) or find the non-zeros (COO) of a dense union; else write the union back
    phases["scatter"] = dense_bytes_ / p.memory_bandwidth if dense_out else _write_back(w.union, w, p)
    return phases


def sparcml_time(w: Workload, p: Profile) -> float:
    """SparCML: the call's fixed cost and the sum of :func:`sparcml_phases`."""
    return p.call_overhead + sum(sparcml_phases(w, p).values())


def omnireduce_phases(w: Workload, p: Profile) -> Dict[str, float]:
    """OmniReduce, phase by phase (the phases a call records): scan: the non-zeros, their block ids (e per
    non-zero) and a copy of the K non-zero blocks; agreement (n counts); push: the all-to-all of BLOCKS
    pieces to the owners; sum: the owners' sums (2 B s_v / mu per received block); pull: the pull-size
    all-gather, the owner's piece repeated n times and the all-to-all of every owner's summed blocks;
    scatter: the write-back of the union blocks."""
    n, c, bs, sv = w.n, w.block_counts, w.block_size, w.value_size
    num_blocks = -(-w.numel // bs)
    ranges = [(j + 1) * num_blocks // n - j * num_blocks // n for j in range(n)]
    blocks = [sum(row) for row in c]
    phases = dict(scan=_scan(w, p) + max(w.nnz) * p.element_time + max(blocks) * bs * sv / p.memory_bandwidth,
                  agree=_agree(n, w, p), push=0.0, sum=0.0, pull=0.0)
    if n > 1 and sum(blocks) > 0:
        send = [sum(_blocks_piece(c[r][j], ranges[j], w) for j in range(n) if j != r) for r in range(n)]
        recv = [sum(_blocks_piece(c[q][r], ranges[r], w) for q in range(n) if q != r) for r in range(n)]
        received = [sum(c[q][r] for q in range(n)) for r in range(n)]
        largest = max(_blocks_piece(c[r][j], ranges[j], w) for r in range(n) for j in range(n) if j != r)
        phases["push"] = _alltoall(send, recv, largest, w, p)
        phases["sum"] = max(received) * 2 * bs * sv / p.memory_bandwidth
        pieces = [_blocks_piece(u, ranges[j], w) for j, u in enumerate(w.block_union)]
        phases["pull"] = (_allgather(1, w, p) + n * max(pieces) / p.memory_bandwidth
                          + _alltoall([(n - 1) * x for x in pieces], [_others(pieces, r) for r in range(n)],
                                      max(pieces), w, p))
    union_values = sum(w.block_union) * bs
    phases["scatter"] = union_values * (sv / p.memory_bandwidth + (0.0 if w.dense_input else p.write_time))
    return phases


def omnireduce_time(w: Workload, p: Profile) -> float:
    """OmniReduce: the call's fixed cost and the sum of :func:`omnireduce_phases`."""
    return p.call_overhead + sum(omnireduce_phases(w, p).values())


# The schemes whose calls record their phases (``stats["phases"]``), with each phase's formula.
PHASE_FORMULAS: Dict[str, Callable[[Workload, Profile], Dict[str, float]]] = {
    "agsparse": agsparse_phases,
    "sparcml": sparcml_phases,
    "omnireduce": omnireduce_phases,
    "zen": zen_phases,
}

TIME_FORMULAS: Dict[str, Callable[[Workload, Profile], float]] = {
    "dense": dense_time,
    "agsparse": agsparse_time,
    "sparcml": sparcml_time,
    "omnireduce": omnireduce_time,
    "zen": zen_time,
}


def predict_times(w: Workload, profile: Profile, schemes: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """Predicted seconds of every scheme (or of ``schemes``) for workload ``w`` on ``profile``; "auto" is the
    smallest of them (what ``scheme="auto"`` picks). No collectives.

    >>> w = estimate_workload(numel=10**6, n=8, nnz=10**4, gamma=4.0)
    >>> t = predict_times(w, Profile(bandwidth=125e6, latency=50e-6))
    >>> min(t, key=t.get) in t
    True
    """
    names = [s for s in (schemes or TIME_FORMULAS) if s != "auto"]
    if w.n <= 1:  # zen.all_reduce returns at once on one rank
        times = {name: profile.call_overhead for name in names}
    elif w.numel == 0:  # only the agreement runs
        times = {name: profile.call_overhead + _agree(0, w, profile) for name in names}
    else:
        times = {name: TIME_FORMULAS[name](w, profile) + profile.miss(name, w.numel) for name in names}
    times["auto"] = min(times.values())
    return times


def choose(times: Dict[str, float]) -> str:
    """The scheme with the smallest predicted time (ties: the first in ``times``' order); never "auto"."""
    names = [s for s in times if s != "auto"]
    return min(names, key=lambda s: (times[s], names.index(s)))


# --------------------------------------------------------------------------------------------------------
# Extra memory (bytes per rank, the peak over the ranks and the phases of a call)


def dense_memory(w: Workload) -> float:
    """In place: nothing for a dense tensor; COO input is densified (M s_v) and read back (U pairs)."""
    return 0.0 if w.dense_input else w.numel * w.value_size + _coo(w.union, w)


def agsparse_memory(w: Workload) -> float:
    """Local COO (k_r pairs); the gather: the packed piece, its n copies sent and every rank's piece received
    (sum k pairs); then the sum: the received pieces, their concatenation, the aggregate's scratch and the
    union. The gathered pieces grow with n: why all-gather based sync runs out of memory as workers grow."""
    n, k = w.n, w.nnz
    total = sum(k)
    local = max(_coo(x, w) for x in k)
    gather = (n + 1) * local + _coo(total, w)
    reduce = 2 * _coo(total, w) + _aggregate_bytes(total, w.union, w)
    return local + max(gather, reduce)


def zen_memory(w: Workload) -> float:
    """Local COO and its partitioned copy (k_r pairs each), the hash tables (2 k_r slots of int64 plus a
    tenth for the serial memory, order and partition ids: ~30 bytes per pair), the push buffers (send k_r,
    receive and concatenate R_j pairs), the aggregate's scratch, the union U_j, the repeated pull piece
    (n + 1 copies), the pulled union U, and the cached index sets I_j (M indices) when the bitmap is used."""
    n, c = w.n, w.hash_counts
    worst = 0.0
    pieces = [_zen_pull_piece(u, w) for u in w.hash_union]
    bitmap = any(x < _coo(u, w) for x, u in zip(pieces, w.hash_union))
    for r in range(n):
        k = w.nnz[r]
        received = sum(c[q][r] for q in range(n))
        base = 3 * _coo(k, w)  # local, partitioned, send
        partition = 2 * _coo(k, w) + (16 + 1.6 + 8 + 4) * k
        pull = (base + 2 * _coo(received, w) + _coo(w.hash_union[r], w) + (n + 1) * pieces[r]
                + sum(pieces) + w.union * w.index_size)
        aggregate = base + 2 * _coo(received, w) + _aggregate_bytes(received, w.hash_union[r], w)
        worst = max(worst, partition, pull, aggregate)
    if bitmap:
        worst += w.numel * w.index_size + 8 * (n + 1)
    return worst


def sparcml_memory(w: Workload) -> float:
    """At each merge of running sums a (this rank's) and b (the partner's): a, the received b, their
    concatenation, the aggregate's scratch and the merged sum (COO); a merge with a dense side holds three
    dense sums of M s_v. Merges: the fold (rank p + i into core rank i), then one per doubling step."""
    dense = w.numel * w.value_size
    k, levels = w.nnz, w.doubling_unions
    pw = len(levels[0])  # core ranks
    merges = [(k[i], k[pw + i], levels[0][i]) for i in range(w.n - pw)]
    merges += [(level[g], level[g ^ 1], levels[s + 1][g >> 1]) for s, level in enumerate(levels[:-1])
               for g in range(len(level))]
    worst = max(_coo(x, w) for x in k)
    for a, b, merged in merges:
        if _sparcml_message(a, w) >= dense or _sparcml_message(b, w) >= dense or _coo(merged, w) > dense:
            worst = max(worst, 3 * dense)
        else:
            worst = max(worst, _coo(a, w) + _coo(b, w) + _coo(a + b, w) + _aggregate_bytes(a + b, merged, w))
    return worst


def omnireduce_memory(w: Workload) -> float:
    """Local COO and block ids, the K gathered blocks (twice: gathered and packed), the received blocks,
    the owner's summed blocks, the repeated pull piece (n + 1 copies) and the pulled union blocks."""
    n, c, bs, sv = w.n, w.block_counts, w.block_size, w.value_size
    num_blocks = -(-w.numel // bs)
    worst = 0.0
    for r in range(n):
        blocks = sum(c[r])
        received = sum(c[q][r] for q in range(n))
        own = w.block_union[r]
        local = _coo(w.nnz[r], w) + 8 * blocks + 8 * num_blocks
        worst = max(worst, local + 2 * blocks * bs * sv + received * bs * sv,
                    local + blocks * bs * sv + received * bs * sv + (n + 2) * own * bs * sv
                    + sum(w.block_union) * bs * sv)
    return worst


MEMORY_FORMULAS: Dict[str, Callable[[Workload], float]] = {
    "dense": dense_memory,
    "agsparse": agsparse_memory,
    "sparcml": sparcml_memory,
    "omnireduce": omnireduce_memory,
    "zen": zen_memory,
}


def predict_memory(w: Workload, schemes: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """Predicted extra memory (bytes per rank, peak of the scheme's buffers and caches; the input tensor,
    allocator slack and the backend's own buffers not counted) of every scheme for workload ``w``."""
    names = [name for name in (schemes or MEMORY_FORMULAS) if name != "auto"]
    if w.n <= 1 or w.numel == 0:  # nothing is reduced
        return {name: 0.0 for name in names}
    return {name: MEMORY_FORMULAS[name](w) for name in names}


# --------------------------------------------------------------------------------------------------------
# Estimates from a few numbers (the planner, and benchmarks that know only d and gamma)


def uniform_growth(nnz: float, space: float) -> Callable[[float], float]:
    """gamma(m) when every rank's ``nnz`` non-zeros are a uniform sample of ``space`` indices, independently:
    gamma(m) = V (1 - (1 - k/V)^m) / k (balls in bins; V = M gives the upper bound for a given density)."""
    if nnz <= 0 or space <= nnz:
        return lambda m: 1.0
    return lambda m: space * -math.expm1(m * math.log1p(-nnz / space)) / nnz


def union_growth(nnz: float, gamma: float, n: int) -> Callable[[float], float]:
    """gamma(m) for any m from gamma(n) alone: :func:`uniform_growth` over the effective index space V for
    which gamma(n) is the given value (gamma = 1: V = k; gamma = n: V infinite, gamma(m) = m).

    >>> g = union_growth(100, 3.0, 8)
    >>> round(g(1), 6), round(g(8), 6), 1 < g(4) < 3
    (1.0, 3.0, True)
    """
    gamma = min(max(gamma, 1.0), float(n))
    if nnz <= 0 or n <= 1 or gamma <= 1.0:
        return lambda m: 1.0
    if gamma >= n * (1 - 1e-12):
        return lambda m: float(m)
    lo, hi = math.log(nnz), math.log(nnz) + 80.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if uniform_growth(nnz, math.exp(mid))(n) < gamma:
            lo = mid
        else:
            hi = mid
    return uniform_growth(nnz, math.exp((lo + hi) / 2))


def hash_imbalance_estimate(union: float, n: int) -> float:
    """Expected max/mean load of n hash partitions of ``union`` distinct indices (balls in bins, normal
    approximation of the largest of n binomials): 1 + sqrt(2 (n-1) ln n / union)."""
    if n <= 1 or union <= 0:
        return 1.0
    return 1.0 + math.sqrt(2.0 * (n - 1) * math.log(n) / union)


def skewed_loads(total: float, n: int, imbalance: float) -> List[float]:
    """n loads summing to ``total`` whose largest is ``imbalance`` times the mean (the others equal)."""
    if n == 1:
        return [total]
    imbalance = min(max(imbalance, 1.0), float(n))
    heavy = imbalance * total / n
    return [heavy] + [(total - heavy) / (n - 1)] * (n - 1)


def doubling_groups(n: int) -> List[List[List[int]]]:
    """groups[s][g]: the ranks merged into SparCML's core group g after s doubling steps (s = 0..L), the
    folded ranks p + i counted with core rank i."""
    pw = 1
    while 2 * pw <= n:
        pw *= 2
    out = []
    size = 1
    while size <= pw:
        out.append([[r for c in range(g * size, (g + 1) * size) for r in (c, c + pw) if r < n]
                    for g in range(pw // size)])
        size *= 2
    return out


def estimate_workload(numel: int, n: int, nnz: float, gamma: Optional[float] = None, *,
                      growth: Optional[Callable[[float], float]] = None, hash_imbalance: Optional[float] = None,
                      block_size: int = 256, block_nnz: Optional[float] = None,
                      block_union: Optional[float] = None, block_imbalance=(1.0, 1.0),
                      index_size: int = 4, value_size: int = 4, dense_input: bool = True) -> Workload:
    """A :class:`Workload` from summary numbers: ``nnz`` non-zeros on every rank, union growth ``gamma``
    = gamma(n) (or the whole curve ``growth(k)``), hash imbalance (default :func:`hash_imbalance_estimate`),
    and for OmniReduce the non-zero blocks per rank and of the union (default: non-zeros spread uniformly,
    a block of B elements non-zero with probability 1 - (1 - d)^B) and the (push, pull) contiguous
    imbalance. The heaviest partition is given the imbalance, the others share the rest equally."""
    if growth is None:
        growth = union_growth(nnz, gamma if gamma is not None else float(n), n)
    union = min(float(numel), growth(n) * nnz)
    lam = hash_imbalance if hash_imbalance is not None else hash_imbalance_estimate(union, n)
    row = skewed_loads(nnz, n, lam)
    num_blocks = -(-numel // block_size) if numel else 0
    if block_nnz is None:
        block_nnz = num_blocks * -math.expm1(block_size * math.log1p(-min(nnz / numel, 1 - 1e-16))) if numel else 0.0
    if block_union is None:
        block_union = num_blocks * -math.expm1(block_size * math.log1p(-min(union / numel, 1 - 1e-16))) \
            if numel else 0.0
    push, pull = block_imbalance
    levels = [[min(float(numel), growth(len(g)) * nnz) for g in level] for level in doubling_groups(n)]
    return Workload(numel=numel, n=n, nnz=[float(nnz)] * n, union=union, hash_counts=[row] * n,
                    hash_union=skewed_loads(union, n, lam), doubling_unions=levels,
                    block_counts=[skewed_loads(block_nnz, n, push)] * n, block_union=skewed_loads(block_union, n, pull),
                    index_size=index_size, value_size=value_size, block_size=block_size, dense_input=dense_input)
