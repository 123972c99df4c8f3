"""Workloads estimated from a few numbers (the planner, and benchmarks that know only d and gamma): union
growth curves, the hash partition's expected imbalance, loads with a given skew."""
import math
from typing import Callable, List, Optional, Sequence

from ..geometry import doubling_groups
from .model import Workload
from .statistics import Statistic, with_estimates


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


def estimate_workload(numel: int, n: int, nnz: float, gamma: Optional[float] = None, *,
                      growth: Optional[Callable[[float], float]] = None, hash_imbalance: Optional[float] = None,
                      block_size: int = 256, block_nnz: Optional[float] = None,
                      block_union: Optional[float] = None, block_imbalance=(1.0, 1.0),
                      index_size: int = 4, value_size: int = 4, dense_input: bool = True,
                      statistics: Sequence[Statistic] = ()) -> Workload:
    """A :class:`Workload` from summary numbers: ``nnz`` non-zeros on every rank, union growth ``gamma``
    = gamma(n) (or the whole curve ``growth(k)``), hash imbalance (default :func:`hash_imbalance_estimate`),
    and for OmniReduce the non-zero blocks per rank and of the union (default: non-zeros spread uniformly,
    a block of B elements non-zero with probability 1 - (1 - d)^B) and the (push, pull) contiguous
    imbalance. The heaviest partition is given the imbalance, the others share the rest equally. Of the
    declared ``statistics`` (:class:`zen.cost.Statistic`; the planner gives every registered scheme's), those
    with a closed form get their estimate from the workload so built; the others get no value."""
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
    w = Workload(numel=numel, n=n, nnz=[float(nnz)] * n, union=union, hash_counts=[row] * n,
                 hash_union=skewed_loads(union, n, lam), doubling_unions=levels,
                 block_counts=[skewed_loads(block_nnz, n, push)] * n, block_union=skewed_loads(block_union, n, pull),
                 index_size=index_size, value_size=value_size, block_size=block_size, dense_input=dense_input)
    return with_estimates(w, statistics)
