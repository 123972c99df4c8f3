"""zen's CPU kernels, one thread: the time of each on a float32 tensor of --numel elements at --density.

    python benchmarks/kernels.py --json results/kernels_cpu.json    # the README's CPU kernels table

Each kernel runs --repeats times on the same inputs; the median is reported. The inputs are what a call of
zen's scheme feeds each kernel on 4 ranks: the non-zero scan of the whole tensor; the partition of its
non-zeros into 4 pieces by the counting sort (``num_probes=0``, the CPU default) and by the hierarchical
hash (``num_probes=3``, the GPU default); the aggregate of 4 ascending pieces of one partition (a k-way
merge, as a server sums what it received); the write-back of those pairs into a zeroed tensor.
"""
import argparse
import json
import statistics
import sys
import time

import torch


def median_ms(fn, repeats: int) -> float:
    fn()  # warm: allocations and caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(numel: int, density: float, repeats: int, seed: int) -> list:
    from zen import ops

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    count = int(numel * density)
    dense = torch.zeros(numel)
    dense[torch.randperm(numel, generator=gen)[:count]] = torch.rand(count, generator=gen) + 0.5
    indices, values = ops.nonzero(dense)
    pairs = count // 4 * 4  # a server on 4 ranks: 4 ascending pieces of one partition
    mine = torch.sort(torch.randperm(numel, generator=gen)[:pairs].to(torch.int32)).values
    pieces = torch.cat([torch.sort(p).values for p in mine[torch.randperm(pairs, generator=gen)].chunk(4)])
    piece_values = torch.rand(pairs, generator=gen)
    out = torch.zeros(numel)
    rows = [
        ("nonzero", f"one vectorised pass over {numel * 4 / 1e6:.0f} MB", lambda: ops.nonzero(dense)),
        ("partition, counting sort", "num_probes=0, the CPU default; 4 partitions",
         lambda: ops.partition(indices, values, 4, seed, 0)),
        ("partition, hierarchical hash", "num_probes=3, the GPU default; 4 partitions",
         lambda: ops.partition(indices, values, 4, seed, 3)),
        ("aggregate", f"k-way merge of 4 ascending pieces, {pairs / 1e3:.0f}k pairs",
         lambda: ops.aggregate(pieces, piece_values, numel)),
        ("scatter", f"{pairs / 1e3:.0f}k pairs written back", lambda: ops.scatter_(out, mine, piece_values)),
    ]
    return [dict(kernel=name, what=what, ms=median_ms(fn, repeats)) for name, what, fn in rows]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = measure(args.numel, args.density, args.repeats, args.seed)
    print(f"zen's CPU kernels, one thread, {args.numel} float32 elements at {args.density:.0%} "
          f"(median of {args.repeats})")
    for r in rows:
        print(f"{r['kernel']:>30} {r['ms']:>8.2f} ms  {r['what']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(numel=args.numel, density=args.density, repeats=args.repeats, kernels=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
