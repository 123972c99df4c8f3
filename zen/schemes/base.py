"""What every scheme implements: the protocol and, beside it, its cost formulas.

A scheme all-reduces (SUM) one flat tensor over a :class:`zen.transport.Comm`, as R = M / b entries of
b values (``call.block_size``: b = 1 reduces elements; b > 1 reduces rows, one index per row, a row with
any non-zero sent whole). Its first collective must be ``call.agree(extra)``: that exchange checks that
all ranks called with the same tensor and lets the scheme piggyback its own sizes on it (one round trip
instead of two). Its formulas predict, from a
:class:`zen.cost.Workload` and a :class:`zen.cost.Profile`, the seconds of a call (``time``, or the sum of
``phases``, which name the phases its calls record with ``call.mark``) and its extra memory (``memory``).

Each phase of a call runs under the PyTorch profiler's range ``zen::<scheme>::<phase>`` (:func:`phase_range`,
through :meth:`Call.phase`), on the thread where it runs (a group's lane: profile it with
``torch.profiler.profile(experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True))``,
as a default profile records the thread that started it only). With no profiler on, a range costs a flag read.
"""
import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.autograd import profiler as autograd_profiler

from .. import agreement, ops
from ..cost import Profile, Workload
from ..transport import Comm

Tensor = torch.Tensor
_NO_RANGE = contextlib.nullcontext()


def phase_range(scheme: str, phase: str):
    """The profiler's range of one phase: ``torch.profiler.record_function("zen::<scheme>::<phase>")`` while a
    torch profiler runs (on any thread), else a shared no-op context (one flag read). The one definition of
    zen's ranges: the schemes' phases (:meth:`Call.phase`), the node steps, top-k selection."""
    if autograd_profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"zen::{scheme}::{phase}")
    return _NO_RANGE


class _Phase:
    """``with call.phase(name, scheme):`` the block under :func:`phase_range`, then ``call.mark(name)``."""

    __slots__ = ("call", "name", "scheme", "range")

    def __init__(self, call: "Call", name: str, scheme: str):
        self.call, self.name, self.scheme = call, name, scheme

    def __enter__(self) -> None:
        self.range = phase_range(self.scheme, self.name)
        self.range.__enter__()

    def __exit__(self, *error) -> None:
        self.range.__exit__(*error)
        self.call.mark(self.name)


@dataclass
class DenseData:
    """A call's data as one dense tensor, where the caller can give it: ``values()``, the data flat (the
    tensor itself, or its parts joined); ``write(summed)``, the sum back into the data."""

    values: Callable[[], Tensor]
    write: Callable[[Tensor], None]


@dataclass
class Call:
    """One collective call: the group, the agreement header, what names the call in errors (the tensor's
    shape, the scheme's name), the block size b of its entries, and the statistics the scheme records.

    ``dense``, where the caller gives it (:class:`DenseData`), is the data as one dense tensor: a scheme with
    a dense switch may sum that instead of running its protocol (:meth:`all_reduce_dense`; then it returns no
    pieces).

    ``keep``, where the caller gives it (global top-k), asks a scheme that supports it to keep only about
    that many of the largest sums; the scheme then records the indices kept in ``stats["kept"]``.
    ``value_dtype``, where given, is the dtype values travel in, for the schemes that support it (sums are
    kept in the tensor's dtype where the scheme sums; the dense all-reduce sums in it)."""

    comm: Comm
    header: List[int]
    shape: tuple = ()
    scheme_name: str = ""
    block_size: int = 1
    dense: Optional[DenseData] = None
    stats: dict = field(default_factory=dict)
    agreed: bool = False
    plan_open: bool = False
    choice_counts: Optional[List[int]] = None
    on_choice: Optional[Callable[[List[int]], None]] = None
    keep: Optional[int] = None
    value_dtype: Optional[torch.dtype] = None
    _last_mark: float = field(default_factory=time.perf_counter)

    def agree(self, extra: List[int]) -> Tensor:
        """The call's agreement (:func:`zen.agreement.agree`): every rank's ``extra``, one row per rank. Where
        the caller chooses the block size, its ``choice_counts`` ride in front and ``on_choice`` gets their
        sums over the ranks (and may raise, alike on every rank). Once agreed, a plain all-gather."""
        return self.agree_and_carry(extra, None)[0]

    def agree_and_carry(self, extra: List[int], payloads) -> Tuple[Tensor, List[Tensor], List[List[int]]]:
        """:meth:`agree`, with the first bytes of ``payloads`` (this rank's bytes for each rank) in the
        agreement's planned slots (:func:`zen.agreement.agree_and_carry`). Returns (extra columns, firsts, S):
        firsts[q], the first S[q][me] bytes of rank q's payload for this rank; once agreed, S is all zeros
        (nothing rode along). The scheme files the next call's plan with :meth:`file_plan`."""
        n = self.comm.world
        if self.agreed:
            empty = torch.empty(0, dtype=torch.uint8, device=self.comm.device)
            return self.comm.all_gather_rows(extra), [empty] * n, [[0] * n for _ in range(n)]
        self.agreed = self.plan_open = True
        counts, self.choice_counts = self.choice_counts or [], None
        rows, firsts, slots = agreement.agree_and_carry(self.comm, self.header, counts + list(extra), payloads,
                                                        shape=self.shape, scheme_name=self.scheme_name)
        if counts:
            self.on_choice(rows[:, :len(counts)].sum(dim=0).tolist())
        return rows[:, len(counts):], firsts, slots

    def all_reduce_dense(self) -> None:
        """Sum the data dense with the backend's all-reduce (in ``value_dtype`` where given), in place."""
        values = self.dense.values()
        self.comm.all_reduce(values, self.value_dtype)
        self.dense.write(values)

    def planned(self) -> Tuple[List[List[int]], object]:
        """(S, label) of the plan this call's agreement will use (:func:`zen.agreement.planned`); nothing
        rides along once agreed."""
        n = self.comm.world
        return ([[0] * n for _ in range(n)], None) if self.agreed else agreement.planned(self.comm)

    def file_plan(self, slots: List[List[int]], label=None) -> None:
        """The slots (bytes, S[p][j]) that the next call after this call's predecessor will carry payloads
        in, and what they are to hold (:func:`zen.agreement.file_plan`); the first filing of the call counts
        (a call that reduces several groups of segments carries the first group's payloads in the agreement)."""
        if self.plan_open:
            self.plan_open = False
            agreement.file_plan(self.comm, slots, label)

    @property
    def choosing(self) -> bool:
        """Whether this call's agreement carries the counts of a block-size choice."""
        return self.choice_counts is not None

    def phase(self, name: str, scheme: Optional[str] = None) -> _Phase:
        """``with call.phase("push", self.name): ...``: the block is the phase ``name`` of ``scheme`` (default:
        the call's scheme name): it runs under the profiler's range ``zen::<scheme>::<name>``
        (:func:`phase_range`), and its seconds, with those since the previous mark, go to
        stats["phases"][name] (:meth:`mark`)."""
        return _Phase(self, name, scheme or self.scheme_name)

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark (or the call's start) to ``phase`` in stats["phases"]
        (seconds; where a call's time goes, for the benchmarks' breakdowns)."""
        now = time.perf_counter()
        phases = self.stats.setdefault("phases", {})
        phases[phase] = phases.get(phase, 0.0) + now - self._last_mark
        self._last_mark = now


class Scheme:
    """The interface. A new scheme overrides :meth:`reduce_coo` (and :meth:`reduce_dense` where it has a
    better path than extract, reduce, write back), ``phases`` or ``time``, and ``memory``; then
    ``zen.register_scheme(name, cls)`` makes ``zen.all_reduce(scheme=name)``, ``zen.predict`` and ``auto``
    use it. ``statistics``: the :class:`zen.cost.Statistic` instances its formulas read beyond the Workload's
    built-in counts (``w.statistic(name)``), measured wherever its workloads are."""

    name = "?"
    statistics: tuple = ()

    def agreement_settings(self) -> Optional[tuple]:
        """The settings every rank must share because they decide the protocol; checked in the agreement."""
        return None

    def reduce_dense(self, call: Call, flat: Tensor) -> None:
        """Sum ``flat`` (contiguous, 1-D, of M values, b = ``call.block_size`` dividing M) over the group,
        in place. Default: extract the non-zero entries, reduce them as COO, write the union back. The union
        holds every local non-zero, so positions outside it are zero already: no clearing pass is needed."""
        with call.phase("scan", self.name):
            indices, values = ops.nonzero_rows(flat, call.block_size)
        self.reduce_extracted(call, flat, indices, values)

    def reduce_extracted(self, call: Call, flat: Tensor, indices: Tensor, values: Tensor) -> None:
        """:meth:`reduce_dense` once the non-zero entries of ``flat`` are extracted (indices ascending, values
        [k] or rows [k, b]): reduce them as COO, write the union back."""
        pieces = self.reduce_coo(call, indices, values, flat.numel() // call.block_size)
        with call.phase("scatter", self.name):
            ops.scatter_pieces_(flat, pieces)

    def reduce_coo(self, call: Call, indices: Tensor, values: Tensor, numel: int) -> List[Tuple[Tensor, Tensor]]:
        """Sum a sparse tensor given as unique (indices, values) over [0, numel) entries: values [k], or rows
        [k, b] (entry i is the row of b values at i). Returns the union as a list of (indices, values)
        pieces with disjoint indices and values shaped like the input's: every index that is non-zero on
        any rank, also where the sum is zero (:meth:`reduce_dense` writes only the union back)."""
        raise NotImplementedError

    # --- the cost model's formulas (static: they describe the protocol, not one instance's state) -------
    @staticmethod
    def phases(w: Workload, p: Profile) -> Optional[Dict[str, float]]:
        """Predicted seconds of each phase a call records (``call.mark``); None for a scheme whose calls
        record none (then it overrides :meth:`time`)."""
        return None

    @classmethod
    def time(cls, w: Workload, p: Profile) -> float:
        """Predicted seconds of a call: the call's fixed cost and the sum of :meth:`phases`."""
        phases = cls.phases(w, p)
        if phases is None:
            raise NotImplementedError(f"{cls.__name__} declares neither phases nor time")
        return p.call_overhead + sum(phases.values())

    @staticmethod
    def memory(w: Workload) -> float:
        """Predicted extra bytes per rank: the peak of the call's buffers and caches."""
        raise NotImplementedError
