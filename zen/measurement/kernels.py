"""The kernel probe: the local terms of the cost model (mu, f, e, m, m_2, w, x_e, x_d), from zen's own
kernels run by every rank at once, as a call runs them."""
import statistics

import torch

from .. import ops
from ..cost import lines_bytes
from ..geometry import default_probes
from ..transport import Comm
from .timing import RATE_SECONDS, together_times


def probe_kernels(comm: Comm, repeats: int, numel: int = 1 << 22) -> dict:
    """The local terms of :class:`zen.cost.Profile`, from zen's kernels on a ``numel``-element float tensor
    (16 MiB: past most caches once a few ranks share a host), every rank at once and taking turns in every repeat
    (:func:`zen.measurement.timing.together_times`), so that f, w and x_d, each a kernel's time less a part that
    mu measures, are differences within a repeat (their medians over the repeats are returned):
    the non-zero scan of zeros (mu) and of numel / 8 random non-zeros (f: per non-zero found, less the scan
    of the zeros), the hash partition (e), the aggregate of n ascending runs of one partition (m)
    of numel / 16 pairs and that of two runs of numel / 32 pairs each (m_2, as SparCML merges), the
    write-back of numel / 8 ascending indices in n pieces split by the hash (``ops.scatter_pieces_``, as a
    call writes its union; w: per element, less the lines of the output written at mu, which the model
    counts apart), the hash bitmap's encode (x_e) of a quarter of the index
    set I_0 (per index encoded), and its decode as zen's pull ends: those numel / 8 indices split by the
    hash into n pieces, each decoded from its bitmap over its own I_j (x_d: per index decoded, less the
    lines of the n index sets read at mu, which the model counts apart; one I_j decoded alone stays in the
    caches that n of them do not)."""
    n, device = max(comm.world, 2), comm.device
    probes = default_probes(device)
    generator = torch.Generator().manual_seed(comm.seed + comm.rank)
    zeros = torch.zeros(numel, device=device)
    count = numel // 16
    idx = torch.randperm(numel, generator=generator)[:count].to(device=device, dtype=torch.int32)
    val = torch.zeros(numel // 8, device=device)  # zeros: the scatter must leave the scanned tensor zero
    # an eighth non-zero, as at the densities where f matters
    found_count = numel // 8
    sparse = torch.zeros(numel, device=device).index_fill_(
        0, torch.randperm(numel, generator=generator)[:found_count].to(device), 1.0)
    ascending = torch.sort(idx).values
    mine = ops.hash_partition(idx, n, comm.seed) == 0
    runs = torch.cat([torch.sort(part).values for part in idx[mine].chunk(n)])
    two_runs = torch.cat([torch.sort(half).values for half in idx.chunk(2)])
    sets, offsets = ops.bitmap_index_sets(numel, n, comm.seed, device)
    index_set = sets[offsets[0]:offsets[1]]
    subset = index_set[torch.randperm(index_set.numel(), generator=generator)[:index_set.numel() // 4].sort().values]
    written = torch.sort(torch.randperm(numel, generator=generator)[:numel // 8]).values.to(device=device,
                                                                                          dtype=torch.int32)
    owner = ops.hash_partition(written, n, comm.seed)
    bitmaps, scattered = [], []
    for j in range(n):
        own = sets[offsets[j]:offsets[j + 1]]
        piece = written[owner == j]
        bitmaps.append((ops.bitmap_encode(piece, own), own, piece.numel()))
        scattered.append((piece, val[:piece.numel()]))

    kernels = dict(
        zeros=lambda: ops.nonzero(zeros),
        found=lambda: ops.nonzero(sparse),
        partition=lambda: ops.partition(ascending, val[:count], n, comm.seed, probes),
        aggregate=lambda: ops.aggregate(runs, val[:runs.numel()], numel, n, comm.seed, 0),
        merged=lambda: ops.aggregate(two_runs, val[:count], numel),
        written=lambda: ops.scatter_pieces_(zeros, scattered),
        encoded=lambda: ops.bitmap_encode(subset, index_set),
        decoded=lambda: [ops.bitmap_decode(*coded) for coded in bitmaps])
    times = dict(zip(kernels, together_times(comm, list(kernels.values()), repeats, least=RATE_SECONDS)))
    byte_times = [t / (numel * zeros.element_size()) for t in times["zeros"]]  # s per byte streamed, per repeat

    def less(name, streamed_bytes, items):
        """Median over the repeats of (kernel's time - the bytes it streams at that repeat's mu) / items,
        at least a tenth of the kernel's time (finding a set bit, moving a value, is never free)."""
        return statistics.median(max(t - streamed_bytes * b, 0.1 * t) / items
                                 for t, b in zip(times[name], byte_times))

    index_lines = sum(lines_bytes(decodes, own.numel(), own.element_size()) for _, own, decodes in bitmaps)
    return dict(memory_bandwidth=1 / statistics.median(byte_times),
                found_time=less("found", numel * zeros.element_size(), found_count),
                element_time=statistics.median(times["partition"]) / count,
                merge_time=statistics.median(times["aggregate"]) / runs.numel(),
                merge2_time=statistics.median(times["merged"]) / count,
                write_time=less("written", lines_bytes(written.numel(), numel, zeros.element_size()),
                                written.numel()),
                encode_time=statistics.median(times["encoded"]) / subset.numel(),
                decode_time=less("decoded", index_lines, written.numel()))
