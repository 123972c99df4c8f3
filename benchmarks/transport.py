#!/usr/bin/env python3
"""How fast gloo moves an all-to-all, three ways, side by side (run under benchmarks/cluster.py):

    python benchmarks/cluster.py --ranks 4 --bandwidth 1gbit -- python benchmarks/transport.py

1. gloo's own all-to-all (``all_to_all_single``);
2. point-to-point messages on one group (rank r sends to r+1, r+2, ... and receives from r-1, r-2, ...);
3. the same on two groups, one per direction of each pair: zen's transport on gloo for large all-to-alls,
   and between two ranks for all but the smallest (``Comm.all_to_all``, ``zen.geometry.duplex_all_to_all``),
   since gloo moves a pair's messages on one connection one direction at a time.

Prints, per piece size (bytes per peer), the median time of each and the bytes each rank sent per second.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from zen.transport import get_comm


def staggered(recv, send, piece, rank, world, send_group, recv_group):
    """Point-to-point all-to-all of equal pieces; ``send_group(dst)``/``recv_group(src)`` pick the groups."""
    recv[rank * piece:(rank + 1) * piece].copy_(send[rank * piece:(rank + 1) * piece])
    works = []
    for k in range(1, world):
        dst, src = (rank + k) % world, (rank - k) % world
        works.append(dist.isend(send[dst * piece:(dst + 1) * piece], group=send_group(dst), group_dst=dst))
        works.append(dist.irecv(recv[src * piece:(src + 1) * piece], group=recv_group(src), group_src=src))
    for work in works:
        work.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pieces", default="16K,256K,1M,4M", help="bytes per peer (K, M suffixes)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = get_comm()
    one = lambda peer: comm.group  # noqa: E731
    ways = {
        "gloo all-to-all": lambda recv, send, piece: dist.all_to_all_single(recv, send, group=comm.group),
        "p2p, one group": lambda recv, send, piece: staggered(recv, send, piece, rank, world, one, one),
        "p2p, two groups": lambda recv, send, piece: comm.all_to_all(recv, send, [piece] * world, [piece] * world,
                                                                    largest=1 << 62),
    }
    if rank == 0:
        print(f"{world} ranks, median of {args.repeats - 1} (after one warm-up), ms (MB/s sent per rank)")
        print(f"{'piece':>8} " + " ".join(f"{name:>24}" for name in ways))
    for text in args.pieces.split(","):
        piece = int(float(text.rstrip("KM")) * {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1))
        send = torch.zeros(piece * world, dtype=torch.uint8)
        recv = torch.empty_like(send)
        times = {name: [] for name in ways}
        for _ in range(args.repeats):  # interleaved: A B C A B C ...
            for name, way in ways.items():
                dist.barrier(group=comm.group)
                start = time.perf_counter()
                way(recv, send, piece)
                dist.barrier(group=comm.group)
                times[name].append(time.perf_counter() - start)
        if rank == 0:
            cells = []
            for name in ways:
                t = statistics.median(times[name][1:])
                cells.append(f"{t * 1e3:10.1f} ({piece * (world - 1) / t / 1e6:7.1f} MB/s)")
            print(f"{text:>8} " + " ".join(f"{c:>24}" for c in cells), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
