"""The planner: predicted time of every scheme, and the recommendation, for a model you have no cluster for yet.

    python -m zen.planner --embedding 1000000x64 --batch-tokens 4096 --world 8 --bandwidth 1gbit --latency 50us
    python -m zen.planner --gradient rank0.pt rank1.pt --world 8 --bandwidth 10gbit --latency 20us

An embedding table of V rows x D columns, fed ``--batch-tokens`` T tokens per rank and step, gets a gradient
whose non-zero rows are the distinct tokens of the batch. Token ids follow Zipf's law with exponent s
(``--zipf``, default 1.0; 0 is uniform) and are frequency ordered (hot rows have small ids, as vocabularies
are built), so row v is drawn with probability p_v = (v+1)^-s / sum_u (u+1)^-s. With T independent draws
(balls in bins), the expected number of distinct rows is

    R(T) = sum_v 1 - (1 - p_v)^T,

so a rank has k = D R(T) non-zeros, m ranks together D R(m T) (gamma(m) = R(m T) / R(T)); a block of B
elements is non-zero when one of the rows it covers is drawn: sum over blocks of 1 - (1 - P_b)^T with P_b
the rows' total probability, counted per OmniReduce owner range (the contiguous imbalance). The hash
imbalance is the balls-in-bins estimate of ``zen.cost.hash_imbalance_estimate``.

``--gradient`` takes saved gradients (torch.save of a tensor, dense or sparse, or a dict of them): one file
per rank gives the exact workload; fewer files give nnz, blocks and the contiguous imbalance, and the union
growth fitted to the files' own union (``zen.cost.union_growth``), or, from a single file, ``--gamma`` or the
uniform model (every index non-zero with probability d on each rank independently: an upper bound).

The statistics that registered schemes declare (``zen.cost.Statistic``) are exact from one file per rank
and take their closed-form estimate otherwise; predicting a scheme one of whose statistics has none from
an estimated workload is an error naming the scheme and the statistic.
"""
import argparse
import json
import sys
from typing import List, Optional

import numpy as np
import torch

from . import cost, ops, wire
from .agreement import DTYPES
from .cost import LOCAL_TIMES, Profile, Workload
from .cost.statistics import combine_columns, local_columns, with_estimates
from .geometry import block_bounds, doubling_groups, flat_coo
from .measurement.store import make_profile
from .prediction import predict_times
from .schemes import registered, registered_statistics

_CHUNK = 1 << 22
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def zipf_probabilities(rows: int, exponent: float) -> np.ndarray:
    """p_v = (v+1)^-s / sum_u (u+1)^-s for v < rows (s = 0: uniform)."""
    weights = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


def expected_distinct(probabilities: np.ndarray, draws: float) -> np.ndarray:
    """1 - (1 - p)^draws per entry: the probability that it is drawn at least once in ``draws`` draws."""
    out = np.empty_like(probabilities)
    for s in range(0, probabilities.size, _CHUNK):
        p = np.minimum(probabilities[s:s + _CHUNK], 1.0 - 1e-16)
        out[s:s + _CHUNK] = -np.expm1(draws * np.log1p(-p))
    return out


def embedding_workload(rows: int, dim: int, tokens: int, world: int, zipf: float = 1.0, value_size: int = 4,
                       block_size: int = 256) -> Workload:
    """The expected :class:`zen.cost.Workload` of an embedding gradient (see the module's docstring)."""
    numel = rows * dim
    p = zipf_probabilities(rows, zipf)

    def distinct_rows(ranks):
        return float(expected_distinct(p, ranks * tokens).sum())

    one = distinct_rows(1)
    nnz = one * dim
    growth = {m: distinct_rows(m) / one for m in range(1, world + 1)}
    union = growth[world] * nnz
    lam = cost.hash_imbalance_estimate(union, world)
    # blocks: block b covers rows [b B // D, ((b+1) B - 1) // D]
    num_blocks = -(-numel // block_size)
    first = np.arange(num_blocks, dtype=np.int64) * block_size // dim
    last = np.minimum((np.arange(1, num_blocks + 1, dtype=np.int64) * block_size - 1) // dim, rows - 1)
    cumulative = np.concatenate([[0.0], np.cumsum(p)])
    block_p = cumulative[last + 1] - cumulative[first]
    bounds = block_bounds(numel, block_size, world)

    def per_owner(values):
        sums = np.concatenate([[0.0], np.cumsum(values)])
        return [float(sums[bounds[w + 1]] - sums[bounds[w]]) for w in range(world)]

    block_row = per_owner(expected_distinct(block_p, tokens))
    block_union = per_owner(expected_distinct(block_p, world * tokens))
    levels = [[min(float(numel), growth[len(g)] * nnz) for g in level] for level in doubling_groups(world)]
    index_size = torch.empty(0, dtype=wire.index_dtype(numel)).element_size()
    w = Workload(numel=numel, n=world, nnz=[nnz] * world, union=union,
                 hash_counts=[cost.skewed_loads(nnz, world, lam)] * world,
                 hash_union=cost.skewed_loads(union, world, lam), doubling_unions=levels,
                 block_counts=[block_row] * world, block_union=block_union, index_size=index_size,
                 value_size=value_size, block_size=block_size, dense_input=True)
    return with_estimates(w, registered_statistics())


def workload_from_indices(indices: List[torch.Tensor], numel: int, value_size: int = 4, block_size: int = 256,
                          seed: int = 0, dense_input: bool = True) -> Workload:
    """The exact :class:`zen.cost.Workload` of n ranks whose non-zeros are ``indices[r]`` (unique int64),
    computed in one process (what ``zen.measure`` measures on a group, the registered schemes' declared
    statistics with the same ``local`` and ``combine``)."""
    n = len(indices)
    idx_dtype = wire.index_dtype(numel)
    bounds = torch.tensor(block_bounds(numel, block_size, n), dtype=torch.int64)

    def hash_loads(idx):
        return torch.bincount(ops.hash_partition(idx.to(idx_dtype), n, seed).long(), minlength=n).tolist()

    def block_loads(idx):
        return torch.diff(torch.searchsorted(torch.unique(idx // block_size), bounds)).tolist()

    def union_of(ranks):
        return torch.unique(torch.cat([indices[r] for r in ranks])) if ranks else torch.empty(0, dtype=torch.int64)

    union = union_of(list(range(n)))
    levels = [[union_of(g).numel() for g in level] for level in doubling_groups(n)]
    statistics = registered_statistics()
    rows = [local_columns(statistics, torch.sort(i.long()).values, numel, n, seed) for i in indices]
    return Workload(numel=numel, n=n, nnz=[i.numel() for i in indices], union=union.numel(),
                    hash_counts=[hash_loads(i) for i in indices], hash_union=hash_loads(union),
                    doubling_unions=levels, block_counts=[block_loads(i) for i in indices],
                    block_union=block_loads(union), index_size=torch.empty(0, dtype=idx_dtype).element_size(),
                    value_size=value_size, block_size=block_size, dense_input=dense_input,
                    statistics=combine_columns(statistics, rows, n))


def gradient_workload(tensors: List[torch.Tensor], world: int, gamma: Optional[float] = None,
                      block_size: int = 256) -> Workload:
    """A workload from saved gradients: exact with one per rank, else estimated (see the module's docstring)."""
    numel = tensors[0].numel()
    if any(t.numel() != numel for t in tensors):
        raise ValueError("--gradient: the files hold tensors of different sizes")
    coo = [flat_coo(t) for t in tensors]
    indices = [torch.unique(c[0].long()) for c in coo]
    value_size, dense_input = tensors[0].element_size(), coo[0][2]
    if len(tensors) == world:
        return workload_from_indices(indices, numel, value_size, block_size, dense_input=dense_input)
    files = workload_from_indices(indices, numel, value_size, block_size, dense_input=dense_input)
    count = len(tensors)
    k = sum(files.nnz) / count
    blocks = sum(map(sum, files.block_counts)) / count
    if count > 1:  # the growth curve through the files' own union, extrapolated to the world
        growth = cost.union_growth(k, files.gamma, count)
        block_gamma = sum(files.block_union) / blocks if blocks else 1.0
        block_growth = cost.union_growth(blocks, block_gamma, count)
    else:
        growth = cost.union_growth(k, gamma, world) if gamma is not None else cost.uniform_growth(k, numel)
        block_growth = growth  # blocks assumed to grow like elements
    union_blocks = min(float(-(-numel // block_size)), block_growth(world) * blocks)
    return cost.estimate_workload(numel, world, k, growth=growth, block_size=block_size, block_nnz=blocks,
                                  block_union=union_blocks,
                                  block_imbalance=(files.block_imbalance, files.block_imbalance),
                                  index_size=files.index_size, value_size=value_size, dense_input=dense_input,
                                  statistics=registered_statistics())


def _load(path: str) -> dict:
    """{name: tensor} of a saved gradient file ("" for a lone tensor); a ValueError naming what is wrong."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as error:
        raise ValueError(f"--gradient {path}: cannot load it ({error})") from None
    tensors = {"": obj} if isinstance(obj, torch.Tensor) else (
        {str(k): t for k, t in obj.items() if isinstance(t, torch.Tensor)} if isinstance(obj, dict) else None)
    if not tensors:
        raise ValueError(f"--gradient {path}: expected a tensor or a dict of tensors, got {type(obj).__name__}")
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"--gradient {path}{f' [{name}]' if name else ''}: unsupported dtype {t.dtype}")
    return tensors


def _load_all(paths: List[str]) -> dict:
    """{name: [the tensor of each file]}: files matched by their tensors' names, which must be the same."""
    files = [_load(path) for path in paths]
    for path, tensors in zip(paths[1:], files[1:]):
        if tensors.keys() != files[0].keys():
            raise ValueError(f"--gradient {path}: holds tensors {sorted(tensors)}, {paths[0]} holds "
                             f"{sorted(files[0])}: every file must hold the same ones")
    return {name: [tensors[name] for tensors in files] for name in files[0]}


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def plan(workloads, names, profile: Profile) -> dict:
    """Per tensor and in total: predicted seconds and extra memory of every scheme, and the pick."""
    tensors = []
    total = {}
    for name, w in zip(names, workloads):
        times = predict_times(w, profile)
        memory = cost.predict_memory(w, registered())
        for scheme, t in times.items():
            total[scheme] = total.get(scheme, 0.0) + t
        tensors.append(dict(name=name, numel=w.numel, density=sum(w.nnz) / w.n / w.numel if w.numel else 0.0,
                            gamma=w.gamma, hash_imbalance=w.hash_imbalance, block_imbalance=w.block_imbalance,
                            times=times, memory=memory, recommendation=cost.choose(times)))
    return dict(tensors=tensors, total=total, recommendation=cost.choose(total))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zen.planner", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--embedding", action="append", default=[], metavar="ROWSxDIM",
                        help="an embedding table (repeatable), e.g. 1000000x64")
    parser.add_argument("--batch-tokens", type=int, default=None, help="tokens per rank and step (with --embedding)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the token ids (0: uniform)")
    parser.add_argument("--gradient", nargs="+", default=[], metavar="FILE.pt",
                        help="saved gradients: one file per rank (exact) or fewer (estimated)")
    parser.add_argument("--gamma", type=float, default=None, help="union growth gamma(world), for a single --gradient")
    parser.add_argument("--world", type=int, required=True, help="number of ranks")
    parser.add_argument("--bandwidth", required=True, help="per rank, e.g. 1gbit, 25gbit, 10GB/s")
    parser.add_argument("--latency", required=True, help="per message, e.g. 50us")
    defaults = Profile(bandwidth=1.0, latency=0.0)
    parser.add_argument("--memory-bandwidth", default=None,
                        help=f"local streaming kernels (when not given: {defaults.memory_bandwidth / 1e9:g}GB/s)")
    for name, what in (("element_time", "per pair hashed"), ("merge_time", "per pair merged by the aggregation"),
                       ("merge2_time", "per pair merged from two runs (SparCML)"),
                       ("write_time", "per element written at ascending positions (its cache lines apart)"),
                       ("found_time", "per non-zero found by the scan of a dense tensor"),
                       ("encode_time", "per index encoded into a hash bitmap"),
                       ("decode_time", "per index decoded from a hash bitmap")):
        parser.add_argument("--" + name.replace("_", "-"), default=None,
                            help=f"{what} (when not given: {getattr(defaults, name) * 1e9:g}ns)")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--block-size", type=int, default=256, help="OmniReduce's block")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error("--world must be >= 1")
    for flag, value, low in (("--batch-tokens", args.batch_tokens, 1), ("--block-size", args.block_size, 1),
                             ("--zipf", args.zipf, 0), ("--gamma", args.gamma, 1)):
        if value is not None and not value >= low:
            parser.error(f"{flag} must be >= {low}; got {value}")
    if args.gamma is not None and args.gamma > args.world:
        parser.error(f"--gamma is the union's growth over {args.world} ranks: at most {args.world}; got {args.gamma}")
    if len(args.gradient) > args.world:
        parser.error(f"--gradient: {len(args.gradient)} files for {args.world} ranks (one per rank at most)")
    if not args.embedding and not args.gradient:
        parser.error("give --embedding ROWSxDIM (with --batch-tokens) or --gradient FILE.pt")
    if args.embedding and not args.batch_tokens:
        parser.error("--embedding needs --batch-tokens")
    try:
        profile = make_profile(args.bandwidth, args.latency, args.memory_bandwidth,
                               **{name: getattr(args, name) for name in LOCAL_TIMES})
    except ValueError as error:
        parser.error(str(error))

    value_size = torch.empty(0, dtype=_DTYPES[args.dtype]).element_size()
    workloads, names = [], []
    for spec in args.embedding:
        try:
            rows, dim = (int(x) for x in spec.lower().split("x"))
        except ValueError:
            parser.error(f"--embedding {spec!r}: expected ROWSxDIM, e.g. 1000000x64")
        if rows < 1 or dim < 1:
            parser.error(f"--embedding {spec!r}: rows and columns must be >= 1")
        workloads.append(embedding_workload(rows, dim, args.batch_tokens, args.world, args.zipf, value_size,
                                            args.block_size))
        names.append(f"embedding {rows}x{dim}")
    if args.gradient:
        try:
            for name, tensors in _load_all(args.gradient).items():
                workloads.append(gradient_workload(tensors, args.world, args.gamma, args.block_size))
                names.append(f"gradient {args.gradient[0]}" + (f" [{name}]" if name else ""))
        except ValueError as error:
            parser.error(str(error))

    result = plan(workloads, names, profile)
    if args.json:
        print(json.dumps(dict(world=args.world, bandwidth=profile.bandwidth, latency=profile.latency, **result),
                         indent=2))
        return 0
    print(f"zen planner: {args.world} ranks, {profile.bandwidth * 8 / 1e9:.3g} Gbit/s and "
          f"{profile.latency * 1e6:.3g} us per rank; {args.dtype} values")
    for t in result["tensors"]:
        print(f"\n{t['name']}: {t['numel']:,} elements, density {100 * t['density']:.3g}% per rank, "
              f"gamma({args.world}) {t['gamma']:.2f}, imbalance hash {t['hash_imbalance']:.2f} / "
              f"contiguous {t['block_imbalance']:.2f}")
        dense = t["times"]["dense"]
        print(f"  {'scheme':<11} {'time':>12} {'vs dense':>9} {'extra memory':>14}")
        for scheme, seconds in t["times"].items():
            if scheme == "auto":
                continue
            speedup = f"{dense / seconds:>8.2f}x" if seconds else f"{'-':>9}"  # one rank: nothing moves
            print(f"  {scheme:<11} {seconds * 1e3:>9.3f} ms {speedup} {_size(t['memory'][scheme]):>14}")
    total = result["total"]
    best = result["recommendation"]
    print(f"\nrecommendation: scheme=\"{best}\" ({total[best] * 1e3:.3f} ms per step, "
          f"{total['dense'] / total[best]:.2f}x dense)" if total[best] else
          f"\nrecommendation: scheme=\"{best}\" (one rank: nothing to exchange, every scheme costs 0 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
