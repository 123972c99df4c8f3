"""Workload statistics that a scheme declares (:class:`Statistic`): what its formulas read beyond the built-in
counts of :class:`zen.cost.Workload`, and the one definition of how each is computed wherever a workload is,
measured on a group (``zen.measure``, ``auto``), computed from index sets (``zen.planner``) or estimated
(:func:`zen.cost.estimate_workload`). Pure; no collectives."""
import dataclasses
from typing import Dict, List, Sequence

from .model import Workload


class Statistic:
    """A value of a workload that a scheme's formulas read as ``w.statistic(name)``, declared in the scheme's
    ``statistics`` (a tuple of instances). On n ranks, rank r holding the sorted int64 indices I_r of its
    non-zero entries in [0, M):

        x_r = local(I_r, M, n, seed)                  size(n) integers, from rank r's own indices
        S   = combine([x_0, ..., x_{n-1}], n)          the workload's value, from every rank's integers

    ``seed`` is the group's hash seed (the one zen's h0 partitions by). ``combine`` is pure, so every rank
    gets the same S; a measured workload pays for S only with size(n) int64 columns in the all-gather that
    ``zen.measure`` runs anyway. Where a call reduces rows of b values, the entries are rows: M counts rows
    and I_r holds row indices. S is a number or a list of numbers (a workload stays JSON-writable).

        S ~ estimate(w)                               from an estimated workload w (nnz, union, loads)

    is the closed form where one exists; the default returns None: no closed form. A workload estimated
    from summary numbers then holds no value of S, and predicting a scheme that declares it raises an error
    naming both (never a silent 0); measure the workload or compute it from index sets instead.

    Two statistics are the same where they are of one class with equal attributes; every registered
    scheme that declares a name declares the same statistic. Example, the 64-entry pages of each rank::

        class Pages(zen.cost.Statistic):
            name = "pages"
            def size(self, n): return 1
            def local(self, indices, numel, n, seed): return [torch.unique(indices // 64).numel()]
            def combine(self, rows, n): return [row[0] for row in rows]
    """

    name = "?"

    def size(self, n: int) -> int:
        """How many integers :meth:`local` returns on n ranks (the same on every rank)."""
        raise NotImplementedError

    def local(self, indices, numel: int, n: int, seed: int) -> List[int]:
        """This rank's size(n) integers from its own sorted int64 ``indices`` (a tensor on the call's device)
        of non-zero entries in [0, numel), on n ranks whose hash seed is ``seed``."""
        raise NotImplementedError

    def combine(self, rows: List[List[int]], n: int):
        """The workload's value from every rank's :meth:`local` integers (``rows[r]``: rank r's)."""
        raise NotImplementedError

    def estimate(self, w: Workload):
        """The value estimated from ``w`` (a workload estimated from summary numbers, its built-in counts
        filled); None: no closed form."""
        return None

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), self.name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{key}={value!r}' for key, value in vars(self).items())})"


def local_columns(statistics: Sequence[Statistic], indices, numel: int, n: int, seed: int) -> List[int]:
    """Every statistic's :meth:`Statistic.local` integers, in order: what a rank contributes to the row that
    ``zen.measure`` all-gathers. A ValueError naming the statistic that returns other than size(n) ints."""
    columns = []
    for statistic in statistics:
        ints = [int(x) for x in statistic.local(indices, numel, n, seed)]
        if len(ints) != statistic.size(n):
            raise ValueError(f"statistic {statistic.name!r}: local() returned {len(ints)} integers, "
                             f"size({n}) says {statistic.size(n)}")
        columns += ints
    return columns


def combine_columns(statistics: Sequence[Statistic], rows: Sequence[Sequence[int]], n: int) -> Dict[str, object]:
    """{name: value} of every statistic from every rank's :func:`local_columns` (``rows[r]``: rank r's)."""
    values, start = {}, 0
    for statistic in statistics:
        end = start + statistic.size(n)
        values[statistic.name] = statistic.combine([list(row[start:end]) for row in rows], n)
        start = end
    return values


def with_estimates(w: Workload, statistics: Sequence[Statistic]) -> Workload:
    """``w`` with the value of every statistic of ``statistics`` that has a closed form (:meth:`Statistic.estimate`)."""
    estimated = {s.name: s.estimate(w) for s in statistics}
    return dataclasses.replace(w, statistics=dict(w.statistics, **{name: value for name, value in
                                                                    estimated.items() if value is not None}))


def for_scheme(w: Workload, name: str, scheme) -> Workload:
    """``w`` as the formulas of ``scheme`` (registered as ``name``) see it: holding only the statistics the
    scheme declares, so a formula that reads another fails alike whichever schemes are registered. A
    ValueError naming the scheme and the statistic where ``w`` holds no value of one it declares."""
    declared: Sequence[Statistic] = getattr(scheme, "statistics", ())
    for statistic in declared:
        if statistic.name not in w.statistics:
            raise ValueError(
                f"scheme {name!r} reads the workload statistic {statistic.name!r}, which this workload does not "
                f"hold: a measured workload (zen.measure, zen.planner.workload_from_indices) holds every registered "
                f"scheme's statistics; an estimated one (zen.cost.estimate_workload) only those it is given that "
                f"have a closed form ({type(statistic).__name__}.estimate)")
    names = {statistic.name for statistic in declared}
    if w.statistics.keys() == names:
        return w
    return dataclasses.replace(w, statistics={key: w.statistics[key] for key in names})
