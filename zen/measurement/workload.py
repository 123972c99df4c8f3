"""Measuring a workload on a group: everything the cost model needs to know about one all-reduce (the
non-zeros per rank, their hash and block loads, the exact union and its growth by recursive doubling of
presence bitmaps, the statistics the registered schemes declare), in a few collectives."""
from typing import Callable, Optional, Tuple

import torch

from .. import ops, wire
from ..cost import Profile, Workload
from ..cost.statistics import combine_columns, local_columns
from ..geometry import block_bounds, doubling_plan
from ..schemes import registered, registered_statistics
from ..transport import Comm
from . import store

_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)
_CHUNK = 1 << 20  # bytes of a bitmap handled at once (bounds the temporaries)


def _popcount(bitmap: torch.Tensor) -> int:
    table = _POPCOUNT.to(bitmap.device)
    return sum(int(table[bitmap[s:s + _CHUNK].long()].sum()) for s in range(0, bitmap.numel(), _CHUNK))


def _bitmap_of(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Presence bitmap over [0, numel) of unique int64 ``indices`` (bit i % 8 of byte i // 8)."""
    bitmap = torch.zeros((numel + 7) // 8, dtype=torch.uint8, device=indices.device)
    bits = torch.bitwise_left_shift(torch.ones_like(indices), indices % 8).to(torch.uint8)
    bitmap.index_put_((indices // 8,), bits, accumulate=True)  # distinct bits: the sum is the OR
    return bitmap


def _indices_of(bitmap: torch.Tensor, first_byte: int):
    """The set bits of ``bitmap`` (whose byte 0 is byte ``first_byte`` of the whole), ascending, chunk by chunk."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmap.device)
    for s in range(0, bitmap.numel(), _CHUNK):
        bits = (bitmap[s:s + _CHUNK, None] >> shifts) & 1
        yield torch.nonzero(bits.reshape(-1)).reshape(-1) + 8 * (first_byte + s)


def measure_now(comm: Comm, agree, indices, values, numel: int, dense_input: bool, block_size: int = 256,
                profile: Optional[Profile] = None, probe: Optional[Callable[[], Profile]] = None,
                row_choice: bool = False) -> Tuple[Workload, Optional[Profile]]:
    """Measure the workload of all-reducing (indices, values) over [0, numel) entries (collective, on the
    lane); values [k] or rows [k, b], ``block_size`` OmniReduce's in entries; ``row_choice``: the call it
    measures chooses its block size (for the cost model's agreement).

    ``agree(row)`` is the first collective (the call's agreement), of [has a profile, nnz]; it returns every
    rank's row (a caller that agreed already hands back what it agreed). With ``probe``
    (the network probe, collective: ``zen.measurement.probe.probe_now`` bound to the group), ranks without a
    profile run it (all ranks take part when one lacks it) and rank 0's profile is returned; without, no profile
    is exchanged and None is returned. The last exchange, an all-gather, carries the union counts per doubling
    level, the union's split over hash partitions and owners, the push loads, the local integers of every
    registered scheme's declared statistics (``zen.cost.Statistic.local``, combined alike on every rank) and
    the profile."""
    n, me = comm.world, comm.rank
    schemes = list(registered())
    idx_dtype = wire.index_dtype(numel)
    si = torch.empty(0, dtype=idx_dtype).element_size()
    idx = indices.to(torch.int64)
    if idx.numel() and not bool((idx[1:] > idx[:-1]).all()):
        idx = torch.sort(idx).values
    device = idx.device
    hash_counts = torch.bincount(ops.hash_partition(idx.to(idx_dtype), n, comm.seed).long(), minlength=n)
    bounds = block_bounds(numel, block_size, n)
    bound_tensor = torch.tensor(bounds, dtype=torch.int64, device=device)
    block_cuts = torch.searchsorted(torch.unique_consecutive(idx // block_size), bound_tensor).tolist()
    statistics = registered_statistics()
    declared = local_columns(statistics, idx, numel, n, comm.seed)
    rows = agree([1 if profile is not None else 0, idx.numel()]).tolist()
    if probe is not None and any(r[0] == 0 for r in rows):
        probed = probe()
        profile = profile or probed

    # Union bitmaps by recursive doubling (SparCML's schedule): levels[s] = |my core group's union| after s steps.
    bitmap = _bitmap_of(idx, numel)
    p, steps = doubling_plan(n)
    levels = [0] * (steps + 1)
    if me >= p:
        comm.exchange([(me - p, bitmap)], [])
    else:
        if me + p < n:
            other = torch.empty_like(bitmap)
            comm.exchange([], [(me + p, other)])
            bitmap = bitmap | other
        levels[0] = _popcount(bitmap)
        for s in range(steps):
            peer, other = me ^ (1 << s), torch.empty_like(bitmap)
            comm.exchange([(peer, bitmap)], [(peer, other)])
            bitmap = bitmap | other
            levels[s + 1] = _popcount(bitmap)

    # The union's split over hash partitions and owners: core rank c reads its slice of whole 8-block units.
    hash_union = torch.zeros(n, dtype=torch.int64, device=device)
    block_union = torch.zeros(n, dtype=torch.int64, device=device)
    if me < p:
        units = -(-bitmap.numel() // block_size)
        lo, hi = me * units // p * block_size, (me + 1) * units // p * block_size
        for union_idx in _indices_of(bitmap[lo:hi], lo):
            hash_union += torch.bincount(ops.hash_partition(union_idx.to(idx_dtype), n, comm.seed).long(),
                                         minlength=n)
            ids = torch.unique_consecutive(union_idx // block_size)
            block_union += torch.diff(torch.searchsorted(ids, bound_tensor))
    block_counts = [block_cuts[w + 1] - block_cuts[w] for w in range(n)]
    row = (levels + hash_union.tolist() + block_union.tolist() + hash_counts.tolist() + block_counts + declared
           + store.encode(profile if probe is not None else None, schemes))
    gathered = comm.all_gather_ints(row).tolist()
    columns = [steps + 1 + i * n for i in range(5)]  # where each group of n columns starts; the last, their end
    declared_values = combine_columns(statistics, [r[columns[4]:columns[4] + len(declared)] for r in gathered], n)
    hash_total, block_total = ([sum(r[c + j] for r in gathered) for j in range(n)] for c in columns[:2])
    doubling = [[gathered[g << s][s] for g in range(p >> s)] for s in range(steps + 1)]
    workload = Workload(numel=numel, n=n, nnz=[r[1] for r in rows], union=doubling[-1][0],
                        hash_counts=[r[columns[2]:columns[3]] for r in gathered], hash_union=hash_total,
                        doubling_unions=doubling, block_counts=[r[columns[3]:columns[4]] for r in gathered],
                        block_union=block_total, index_size=si, value_size=wire.entry_bytes(values),
                        block_size=block_size, dense_input=dense_input, row_size=wire.row_width(values),
                        row_choice=row_choice, statistics=declared_values)
    return workload, (store.decode(gathered[0][-len(store.columns(schemes)):], schemes) if probe is not None else None)
