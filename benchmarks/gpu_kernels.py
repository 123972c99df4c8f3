"""Speed and correctness of zen's CUDA kernels on large buckets, beside a device-to-device copy.

For each density, one dense bucket of --numel elements with non-zeros at uniformly random positions:

  nonzero     the bucket -> (indices, values)
  partition   those pairs -> grouped by hash partition (--partitions, 3 probes, table 2x, serial 0.1x)
  part_sort   the same with num_probes=0: no tables, a stable sort by partition id
  aggregate   what server 0 receives: partition 0's piece of each of --partitions peers' buckets
  bm_encode   the aggregate's indices -> a bitmap over I_0 (the index set of partition 0)
  bm_decode   that bitmap -> the indices again
  scatter     the bucket's (indices, values) -> a dense output
  index_sets  I_j for all j (built once per (numel, seed); shown for scale)

Time: median over --reps runs after --warmup, CUDA events around one op call (each op synchronises
with the host once, to size its outputs; that is part of its cost). Bandwidth is that of the gradient
bucket, the same for every kernel: GB/s = numel * element size / time, so kernels compare directly with
the copy (copy GB/s counted the same way, so it moves twice those bytes) and ratio = copy time / time.
Every result is checked against the CPU op on the same data (partition: same counts and, per partition,
the same multiset of pairs). Exits 1 if any check fails.

    python benchmarks/gpu_kernels.py [--numel 26214400] [--densities 0.01 0.1] [--dtype float32] [--json out.json]
"""
import argparse
import importlib
import json
import statistics
import sys
import time

import torch


def load_ops(need_cuda):
    try:
        ext = importlib.import_module("zen._C")  # registers torch.ops.zen
    except ImportError as e:
        sys.exit(f"cannot import zen._C ({e}); build first: FORCE_CUDA=1 pip install --no-build-isolation -e .")
    if need_cuda and not ext.has_cuda_kernels():
        sys.exit("zen was built without its CUDA kernels; rebuild with FORCE_CUDA=1")
    return torch.ops.zen


def time_op(fn, reps, warmup, device):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)  # seconds
        else:  # --device cpu: a dry run of this script
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def same_partition_groups(ops_out_gpu, ref_cpu, num_partitions, num_probes):
    """Same counts, and per partition the same multiset of (index, value) pairs; order may differ."""
    gi, gv, gc, gs = (t.cpu() for t in ops_out_gpu)
    ri, rv, rc, _ = ref_cpu
    if not torch.equal(gc, rc):
        return False, "counts differ"
    if num_probes == 0 and gs.tolist() != [0, 0, 0]:
        return False, f"stats {gs.tolist()}, expected [0, 0, 0] without tables"
    if num_probes > 0 and not gs[2].item() and gs[0].item() + gs[1].item() != gi.numel():
        return False, f"stats {gs.tolist()} do not add up to {gi.numel()}"
    offsets = [0] + torch.cumsum(rc, 0).tolist()
    for j in range(num_partitions):
        a, b = offsets[j], offsets[j + 1]
        # Indices are unique here (they come from nonzero), so sorting by index fixes the order.
        go, ro = torch.argsort(gi[a:b]), torch.argsort(ri[a:b])
        if not (torch.equal(gi[a:b][go], ri[a:b][ro]) and torch.equal(gv[a:b][go], rv[a:b][ro])):
            return False, f"partition {j} differs"
    return True, ""


def equal_all(gpu, cpu):
    gpu = gpu if isinstance(gpu, (tuple, list)) else (gpu,)
    cpu = cpu if isinstance(cpu, (tuple, list)) else (cpu,)
    return all(torch.equal(g.cpu(), c) for g, c in zip(gpu, cpu))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=25 * 2**20, help="bucket elements (default 25 Mi)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.1])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cpu: dry run of the script itself, on the CPU kernels")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the CPU ops")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device visible")
    ops = load_ops(need_cuda=dev.type == "cuda")
    dtype = getattr(torch, args.dtype)
    es = torch.empty((), dtype=dtype).element_size()
    n, seed, M = args.partitions, args.seed, args.numel
    bucket_bytes = M * es
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    device_name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (dry run)"
    print(f"# {device_name}  torch {torch.__version__} (CUDA {torch.version.cuda})  "
          f"numel {M}  {args.dtype}  partitions {n}  median of {args.reps}")

    def bucket(density):
        mask = torch.rand(M, device=dev, generator=gen) < density
        return torch.randn(M, device=dev, generator=gen).to(dtype) * mask

    rows, failures = [], 0
    src = torch.randn(M, device=dev, generator=gen).to(dtype)
    dst = torch.empty_like(src)
    t_copy = time_op(lambda: dst.copy_(src), args.reps, args.warmup, dev)
    copy_gbs = bucket_bytes / t_copy / 1e9
    rows.append(dict(kernel="copy", density=None, items=M, time_us=t_copy * 1e6, gbs=copy_gbs, ratio=1.0, check="-"))

    t = time_op(lambda: ops.bitmap_index_sets(src, M, n, seed), max(3, args.reps // 4), 1, dev)
    sets, offsets = ops.bitmap_index_sets(src, M, n, seed)
    ok = args.no_check or equal_all((sets, offsets), ops.bitmap_index_sets(src.cpu(), M, n, seed))
    rows.append(dict(kernel="index_sets", density=None, items=M, time_us=t * 1e6, gbs=bucket_bytes / t / 1e9,
                     ratio=t_copy / t, check="skip" if args.no_check else ("ok" if ok else "FAIL")))
    set0 = sets[offsets[0].item():offsets[1].item()]

    for d in args.densities:
        dense = bucket(d)
        idx, val = ops.nonzero(dense)
        parted = ops.partition(idx, val, n, seed, 3, 2.0, 0.1)
        # Server 0's input: partition 0's piece of each peer's bucket (this one is peer 0).
        pieces_i, pieces_v = [], []
        for peer in range(n):
            pi, pv, pc, _ = parted if peer == 0 else ops.partition(*ops.nonzero(bucket(d)), n, seed, 3, 2.0, 0.1)
            pieces_i.append(pi[: pc[0].item()])
            pieces_v.append(pv[: pc[0].item()])
        agg_in_i, agg_in_v = torch.cat(pieces_i), torch.cat(pieces_v)
        agg_i, agg_v = ops.aggregate(agg_in_i, agg_in_v, M, n, seed, 0)
        bitmap = ops.bitmap_encode(agg_i, set0)
        out = torch.zeros_like(dense)

        cases = [
            ("nonzero", M, lambda: ops.nonzero(dense),
             lambda g: equal_all(g, ops.nonzero(dense.cpu()))),
            ("partition", idx.numel(), lambda: ops.partition(idx, val, n, seed, 3, 2.0, 0.1),
             lambda g: same_partition_groups(g, ops.partition(idx.cpu(), val.cpu(), n, seed, 3, 2.0, 0.1), n, 3)),
            ("part_sort", idx.numel(), lambda: ops.partition(idx, val, n, seed, 0, 2.0, 0.1),
             lambda g: same_partition_groups(g, ops.partition(idx.cpu(), val.cpu(), n, seed, 0, 2.0, 0.1), n, 0)),
            ("aggregate", agg_in_i.numel(), lambda: ops.aggregate(agg_in_i, agg_in_v, M, n, seed, 0),
             lambda g: equal_all(g, ops.aggregate(agg_in_i.cpu(), agg_in_v.cpu(), M, n, seed, 0))),
            ("bm_encode", agg_i.numel(), lambda: ops.bitmap_encode(agg_i, set0),
             lambda g: equal_all(g, ops.bitmap_encode(agg_i.cpu(), set0.cpu()))),
            ("bm_decode", agg_i.numel(), lambda: ops.bitmap_decode(bitmap, set0, agg_i.numel()),
             lambda g: equal_all(g, ops.bitmap_decode(bitmap.cpu(), set0.cpu(), agg_i.numel()))),
            ("scatter", idx.numel(), lambda: ops.scatter_(out, idx, val),
             lambda g: equal_all(out, _scatter_cpu(ops, torch.zeros_like(dense, device="cpu"), idx, val))),
        ]
        for name, items, fn, check in cases:
            t = time_op(fn, args.reps, args.warmup, dev)
            status = "skip"
            if not args.no_check:
                result = check(fn())
                ok, why = result if isinstance(result, tuple) else (result, "")
                status = "ok" if ok else f"FAIL {why}".strip()
                failures += not ok
            rows.append(dict(kernel=name, density=d, items=items, time_us=t * 1e6, gbs=bucket_bytes / t / 1e9,
                             ratio=t_copy / t, check=status))
        del dense, idx, val, parted, agg_in_i, agg_in_v, out
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    print(f"{'kernel':<11} {'density':>7} {'items':>10} {'time_us':>9} {'GB/s':>8} {'copy GB/s':>9} {'ratio':>6}  check")
    for r in rows:
        dens = "-" if r["density"] is None else f"{r['density']:.2%}"
        print(f"{r['kernel']:<11} {dens:>7} {r['items']:>10} {r['time_us']:>9.1f} {r['gbs']:>8.1f} {copy_gbs:>9.1f} "
              f"{r['ratio']:>6.2f}  {r['check']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name, numel=M, dtype=args.dtype, partitions=n,
                           reps=args.reps, copy_gbs=copy_gbs, rows=rows), f, indent=1)
    if failures:
        print(f"{failures} check(s) FAILED")
        sys.exit(1)


def _scatter_cpu(ops, out, idx, val):
    ops.scatter_(out, idx.cpu(), val.cpu())
    return out


if __name__ == "__main__":
    main()
