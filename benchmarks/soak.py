"""Soak test: thousands of zen all-reduces with changing sizes, sparsity patterns, dtypes, layouts and
schemes on local ranks, every result compared with torch.distributed.all_reduce, resident memory sampled.

    python benchmarks/soak.py                          # 4 ranks, 2000 calls, every scheme in turn
    python benchmarks/soak.py --calls 10000 --schemes zen --json soak.json

Every rank draws the same call plan from --seed (size, density, pattern, dtype, layout, scheme, entry
point), its own data from (seed, call, rank). Values are small multiples of 1/2 (and NaN/Inf in the
"nan_inf" pattern), so every summation order gives the same bits: a result counts as wrong when any
element differs from dist.all_reduce's (NaN where NaN). A share of the calls goes through the DDP hook
(zen.zen_hook with one long-lived ZenState, averaging) and a share through async_op.

Memory: RSS (from /proc/self/statm) of every rank, sampled every --sample-every calls. "warm" is the RSS
after --warmup calls, "end" the last sample; growth = end - warm. The process holds caches that fill
during warm-up (zen's index-set cache of 8 sizes, torch's and glibc's allocators), so flat after warm-up
is the expectation.

Not part of the test suite (it runs for minutes); tests/test_reliability.py covers the same paths briefly.
"""
import argparse
import ctypes
import json
import os
import random
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PATTERNS = ["uniform", "skewed", "same", "disjoint", "edges", "some_empty", "all_empty", "dense", "nan_inf"]
DENSITIES = [0.0001, 0.001, 0.01, 0.05, 0.2, 0.6, 1.0]
SIZES = [0, 1, 7, 100, 1000, 4096, 30011, 65536, 100000, 262144, 500000, 1000000]
DTYPES = [torch.float32] * 6 + [torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
LAYOUTS = ["flat"] * 5 + ["2d", "transposed", "strided"]


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4, help="local ranks (default 4)")
    p.add_argument("--calls", type=int, default=2000, help="all-reduce calls per rank (default 2000)")
    p.add_argument("--warmup", type=int, default=200, help="calls before the RSS baseline (default 200)")
    p.add_argument("--sample-every", type=int, default=50, help="RSS sample period in calls (default 50)")
    p.add_argument("--schemes", default="all", help="comma-separated schemes, or 'all' (default: zen.SCHEMES)")
    p.add_argument("--max-numel", type=int, default=1000000, help="largest tensor (default 1M elements)")
    p.add_argument("--hook-share", type=float, default=0.15, help="share of calls through zen_hook (default 0.15)")
    p.add_argument("--async-share", type=float, default=0.1, help="share of calls with async_op (default 0.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-trim", action="store_true", help="sample RSS without malloc_trim(0) first")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    p.add_argument("--json", default=None, help="write the figures as JSON here")
    return p


def rss_bytes(trim: bool) -> int:
    """Resident set size. ``trim``: first hand freed heap pages back to the OS (glibc's malloc_trim), so
    that the figure follows live memory rather than what the allocator's per-thread arenas keep."""
    if trim:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def slope_per_1000(points) -> float:
    """Least-squares slope of (calls, bytes), in MiB per 1000 calls."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] / 2**20 for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def plan(args, schemes):
    """The call plan, the same on every rank."""
    rng = random.Random(args.seed)
    sizes = [s for s in SIZES if s <= args.max_numel]
    calls = []
    for i in range(args.calls):
        numel = rng.choice(sizes) if rng.random() < 0.8 else rng.randint(1, args.max_numel)
        entry = "hook" if rng.random() < args.hook_share else ("async" if rng.random() < args.async_share else "sync")
        calls.append(dict(
            numel=numel, density=rng.choice(DENSITIES), pattern=rng.choice(PATTERNS),
            dtype=torch.float32 if entry == "hook" else rng.choice(DTYPES),
            layout="flat" if entry == "hook" else rng.choice(LAYOUTS),
            scheme=rng.choice(schemes), entry=entry))
    return calls


def make(call, i, rank, world):
    from tests.cases import make as make_case

    x = make_case(call["pattern"], max(call["numel"], 1), call["density"], rank, world, seed=i, dtype=call["dtype"])
    x = x[:call["numel"]]
    if call["layout"] == "2d" and call["numel"] % 2 == 0:
        return x.view(2, -1)
    if call["layout"] == "transposed" and call["numel"] % 2 == 0:
        return x.view(2, -1).t()
    if call["layout"] == "strided":
        wide = torch.zeros(call["numel"] * 2, dtype=x.dtype)
        wide[::2] = x
        return wide[::2]
    return x


def same(a, b) -> bool:
    if a.is_floating_point():
        return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a, nan=0.0),
                                                                             torch.nan_to_num(b, nan=0.0))
    return torch.equal(a, b)


def soak_rank(rank, world, args):
    import zen
    from zen.testing import LocalBucket

    schemes = list(zen.SCHEMES) if args.schemes == "all" else args.schemes.split(",")
    calls = plan(args, schemes)
    state = zen.ZenState()  # one long-lived hook state, as under DDP
    wrong, wrong_elements, errors = {}, {}, []
    by_scheme = {}
    samples = []
    start = time.monotonic()
    for i, call in enumerate(calls):
        x = make(call, i, rank, world)
        ref = x.clone()
        dist.all_reduce(ref)
        key = "hook" if call["entry"] == "hook" else call["scheme"]
        by_scheme[key] = by_scheme.get(key, 0) + 1
        try:
            if call["entry"] == "hook":
                got = zen.zen_hook(state, LocalBucket(x)).wait()
                ref /= world
            elif call["entry"] == "async":
                zen.all_reduce(x, scheme=call["scheme"], async_op=True).wait()
                got = x
            else:
                zen.all_reduce(x, scheme=call["scheme"])
                got = x
        except Exception as error:  # noqa: BLE001  (counted and reported)
            errors.append((i, key, f"{type(error).__name__}: {str(error)[:200]}"))
            got = None
        if got is None or not same(got, ref):
            wrong[key] = wrong.get(key, 0) + 1
            if got is not None:
                bad = (torch.nan_to_num(got.float(), nan=1e30) != torch.nan_to_num(ref.float(), nan=1e30)).sum().item()
                wrong_elements[key] = wrong_elements.get(key, 0) + bad
        if (i + 1) % args.sample_every == 0 or i + 1 == len(calls):
            samples.append((i + 1, rss_bytes(not args.no_trim)))
    seconds = time.monotonic() - start
    elements = sum(c["numel"] for c in calls)
    return dict(calls=len(calls), by_scheme=by_scheme, wrong=wrong, wrong_elements=wrong_elements,
                errors=errors[:20], error_count=len(errors), samples=samples, seconds=seconds, elements=elements)


def summarize(args, results):
    mib = 1024 * 1024
    first = results[0]
    print(f"# zen soak: {args.world} ranks, {first['calls']} calls per rank, seed {args.seed}, "
          f"{first['elements'] / 1e6:.1f} M elements per rank, {first['seconds']:.0f} s")
    print(f"{'entry':>12} {'calls':>7} {'wrong':>6} {'#wrong elements':>16}")
    for key in sorted(first["by_scheme"]):
        wrong = sum(r["wrong"].get(key, 0) for r in results)
        bad = sum(r["wrong_elements"].get(key, 0) for r in results)
        print(f"{key:>12} {first['by_scheme'][key]:>7} {wrong:>6} {bad:>16}")
    print(f"RSS{'' if args.no_trim else ' after malloc_trim(0)'}, sampled every {args.sample_every} calls; "
          f"warm = after {args.warmup} calls; slope = least-squares fit after warm-up")
    print(f"{'rank':>4} {'warm MiB':>9} {'end MiB':>8} {'max MiB':>8} {'growth MiB':>10} {'MiB/1k calls':>12} "
          f"{'errors':>6}")
    rows = []
    for rank, r in enumerate(results):
        points = [(calls, rss) for calls, rss in r["samples"] if calls >= args.warmup] or r["samples"][-1:]
        warm, end, peak = points[0][1], points[-1][1], max(rss for _, rss in points)
        slope = slope_per_1000(points)
        rows.append(dict(rank=rank, warm_mib=warm / mib, end_mib=end / mib, max_mib=peak / mib,
                         growth_mib=(end - warm) / mib, slope_mib_per_1000_calls=slope, errors=r["error_count"]))
        print(f"{rank:>4} {warm / mib:>9.1f} {end / mib:>8.1f} {peak / mib:>8.1f} {(end - warm) / mib:>10.1f} "
              f"{slope:>12.2f} {r['error_count']:>6}")
    for r in results:
        for e in r["errors"][:5]:
            print("error:", e)
    total_wrong = sum(sum(r["wrong"].values()) for r in results)
    print(f"total: {args.world * first['calls']} results checked, {total_wrong} wrong, "
          f"{sum(r['error_count'] for r in results)} errors")
    return dict(world=args.world, calls_per_rank=first["calls"], seed=args.seed, seconds=first["seconds"],
                by_scheme=first["by_scheme"], wrong=total_wrong, ranks=rows,
                samples={rank: r["samples"] for rank, r in enumerate(results)})


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.warmup >= args.calls:
        raise SystemExit("--warmup must be smaller than --calls")
    from launch import launch

    results = launch(args, soak_rank, args, timeout=args.timeout, pg_timeout=300).results
    figures = summarize(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0 if figures["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
