"""The cost model's building blocks: what moving bytes over the group's primitives, and zen's local kernels,
cost on a :class:`zen.cost.Profile`, for the schemes' formulas to be written in (see :mod:`zen.cost` for the
notation). Pure functions; no collectives."""
import math
from typing import Sequence

from .. import schedules
from ..agreement import row_ints
from ..geometry import duplex_all_to_all
from .model import Profile, Workload


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



def coo(count: float, w: Workload) -> float:
    return count * (w.index_size + w.value_size)


def alltoall(send: Sequence[float], recv: Sequence[float], largest: float, w: Workload, p: Profile) -> float:
    """c_a2a + max_r max(S_r, R_r) / b, at the rate of the transport that ``largest`` (the largest piece
    a rank sends another) picks (``zen.geometry.duplex_all_to_all``): b_a2a on zen's duplex transport, the
    backend's own all-to-all's (b_a2a') below it."""
    if w.n <= 1:
        return 0.0
    return p.fixed("alltoall", w.n) + alltoall_bytes(send, recv, largest, w, p)


def alltoall_bytes(send: Sequence[float], recv: Sequence[float], largest: float, w: Workload, p: Profile) -> float:
    """max_r max(S_r, R_r) / b: :func:`alltoall` without its fixed cost (bytes that ride in another exchange).
    Where the exchange runs in rounds of one peer each way (``zen.schedules.choose``: pairwise, or a ring for
    an all-gather, the same bytes), it adds n-2 more fixed costs of a point-to-point message and moves at the
    pairwise rate b_p2p."""
    if w.n <= 1:
        return 0.0
    if schedules.choose(w.n, largest, gather=False) == "pairwise":
        return (w.n - 2) * p.fixed("p2p", w.n) + max(max(s, r) for s, r in zip(send, recv)) / p.rate("p2p")
    rate = p.rate("alltoall" if duplex_all_to_all(w.n, largest) else "alltoall_small")
    return max(max(s, r) for s, r in zip(send, recv)) / rate


def allgather(ints: int, w: Workload, p: Profile) -> float:
    """A ring all-gather of ``ints`` int64 per rank: c_ag + (n-1) 8 ints / b."""
    if w.n <= 1:
        return 0.0
    return p.fixed("allgather", w.n) + (w.n - 1) * 8 * ints / p.bandwidth


def agree(extra_ints: int, w: Workload, p: Profile) -> float:
    """The agreement, every scheme's first collective: an all-gather of its row (the header, the count of
    ``extra_ints`` and their slots: ``zen.agreement.row_ints``), 2 more where the call chooses its block
    size (``w.row_choice``: the counts of elements and rows ride in front)."""
    return allgather(row_ints(w.n, extra_ints + (2 if w.row_choice else 0)), w, p)


def rows_moved(count: float, w: Workload, p: Profile) -> float:
    """Copying ``count`` rows of b values (s_v = the row's bytes) at mu: what a kernel's per-pair time leaves
    out when its entries are rows; 0 for elements."""
    return count * w.value_size / p.memory_bandwidth if w.row_size > 1 else 0.0


def spread(blocks: float, w: Workload) -> float:
    """Elements a set of non-zeros spreads over: its non-zero blocks of ``w.block_size`` (measured), at most M
    (M where no blocks were counted)."""
    return min(float(w.numel), blocks * w.block_size) if blocks > 0 else float(w.numel)


def scan(w: Workload, p: Profile) -> float:
    """Finding the non-zeros of a dense tensor: M s_v / mu (one read: the kernel masks a cached chunk 64
    elements at a time, then takes its non-zeros from the cache) + f per non-zero found, on the slowest rank
    (0 for COO input)."""
    if not w.dense_input:
        return 0.0
    return w.numel * w.value_size / p.memory_bandwidth + max(w.nnz) * p.found_time


def scatter(count: float, blocks: float, w: Workload, p: Profile) -> float:
    """Scattering ``count`` elements that lie in ``blocks`` non-zero blocks into a dense tensor: w per element
    plus the cache lines of the tensor they land in, at mu (:func:`lines_bytes`). A sparse set costs a line per
    element, a dense one a line per 16 (float32), where w alone would make them cost the same. The elements
    spread over their non-zero blocks (measured), not over all M: a skewed set (frequency-ordered embedding rows)
    packs into few lines."""
    return count * p.write_time + lines_bytes(count, spread(blocks, w), w.value_size) / p.memory_bandwidth


def write_back(count: float, w: Workload, p: Profile) -> float:
    """Writing ``count`` union elements into the dense output (:func:`scatter` over the union's non-zero
    blocks, ``block_union``); 0 for COO input, which is returned as pairs."""
    return scatter(count, sum(w.block_union), w, p) if w.dense_input else 0.0


def others(values: Sequence[float], r: int) -> float:
    return sum(values) - values[r]


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


def aggregate_bytes(count: float, unique: float, w: Workload) -> float:
    """Peak bytes of ``ops.aggregate`` on ``count`` pairs with ``unique`` results: its scratch (count indices
    and count sums, in the accumulation type: at least 4 bytes) and its output (unique pairs)."""
    return count * (w.index_size + max(w.value_size, 4)) + coo(unique, w)
