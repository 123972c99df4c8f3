"""Each scheme's extra memory per rank: predicted (``zen.predict_memory``) vs measured peak.

    python benchmarks/memory.py                       # 4 local ranks, 4M float32 elements, 0.1/1/10%
    python benchmarks/memory.py --world 8 --sizes 16M --densities 0.01

Measured: the peak, over one call, of the bytes held by the tensors the call allocates (torch's profiler:
each op's own allocations minus frees, a gain at the op's start and a loss at its end, and the frees
outside ops), on each rank, the largest over the ranks. The call runs on the calling thread
(``zen.schemes.call.run_call``) so the profiler sees all of it, cold (the first call of the scheme on the group:
zen's cached index sets I_j are allocated inside it, and
counted, as the prediction counts them). The input tensor itself is not counted, by either.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
SCHEMES = ("zen", "dense", "agsparse", "sparcml", "omnireduce")  # zen first: its index sets are cold


def peak_bytes(fn) -> int:
    """Peak of live bytes allocated (and not yet freed) by CPU tensors while ``fn()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # Each op's own net allocation (its children report theirs): a gain counts from the op's start, a loss
    # (scratch freed inside the op) at its end; "[memory]" events are frees outside any op.
    steps = []
    for event in prof.events():
        delta = event.self_cpu_memory_usage
        if delta:
            steps.append((event.time_range.start if delta > 0 else event.time_range.end, delta))
    live = peak = 0
    for _, delta in sorted(steps):
        live += delta
        peak = max(peak, live)
    return peak


def run(rank, world, args):
    import workloads
    import zen
    from allreduce import parse_size
    from zen.collective import make_scheme
    from zen.schemes.balanced.pull import forget_index_sets
    from zen.schemes.base import Request
    from zen.schemes.call import run_call
    from zen.transport import get_comm

    comm = get_comm(None)
    rows = []
    for size in args.sizes.split(","):
        numel = parse_size(size)
        for density in (float(d) for d in args.densities.split(",")):
            x0 = workloads.uniform(numel, density, rank, 0, torch.float32)
            predicted = zen.predict_memory(x0)
            for name in SCHEMES:
                x = x0.clone()
                measured = peak_bytes(lambda: run_call(comm, Request(x, make_scheme(name))))
                worst = torch.tensor([measured], dtype=torch.int64)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                rows.append(dict(numel=numel, density=density, scheme=name, predicted=predicted[name],
                                 measured=int(worst.item())))
            forget_index_sets(comm)  # the next case's first zen call is cold again
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--sizes", default="4M")
    p.add_argument("--densities", default="0.001,0.01,0.1")
    args = p.parse_args(argv)
    from launch import launch

    rows = launch(args, run, args, timeout=1800).results[0]
    print(f"extra memory per rank, {args.world} ranks (MiB; ratio = predicted / measured peak)")
    print(f"{'numel':>9} {'density':>8} {'scheme':>10} {'predicted':>10} {'measured':>10} {'ratio':>6}")
    for r in rows:
        ratio = f"{r['predicted'] / r['measured']:.2f}" if r["measured"] and r["predicted"] else "-"
        print(f"{r['numel']:>9} {r['density']:>8.2%} {r['scheme']:>10} {r['predicted'] / 2**20:>10.2f} "
              f"{r['measured'] / 2**20:>10.2f} {ratio:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
