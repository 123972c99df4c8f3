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

from .. import agreement, ops, wire
from ..cost import Profile, Workload
from ..transport import Comm
from .steps import Agreed, Opening, Sum, Union

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


Segment = Tuple[int, int, int]  # (offset, numel, row size) of a part of a flat tensor


@dataclass(frozen=True)
class Request:
    """One all-reduce as asked: what goes down a call, unchanged (a node call's cross step is a
    ``dataclasses.replace`` of it).

    ``tensor``: what to sum, in place. ``scheme``: the scheme instance, None where ``name`` named none
    (``allowed``: the names that would have been, for the error). ``block_size``: reduce a strided tensor as
    rows of that many values; None chooses per call between elements and rows of the last dimension.
    ``segments``: the parts of a flat tensor (a DDP bucket's parameters) as (offset, numel, row size), each
    reduced as elements or as rows of its row size, chosen per call; they replace ``block_size``. ``keep``:
    global top-k, where the scheme supports it: keep about that many of the largest sums (the indices kept
    come back in :attr:`Outcome.kept`). ``value_dtype``: the dtype values travel in, for the schemes that
    support it (sums are kept in the tensor's dtype where the scheme sums). ``hierarchy``: the call's
    (setting, local_size) of :mod:`zen.hierarchy`, for the agreement's header (None: a call that is not one).
    ``checked``: where ``tensor`` is a part of a tensor (a node call's shard), that tensor: the agreement
    checks it. ``scanned``: what :func:`zen.schemes.call.scan_rows` would find in ``segments``, where the
    caller knows it already."""

    tensor: object
    scheme: Optional["Scheme"]
    name: object = None
    allowed: Tuple[str, ...] = ()
    block_size: Optional[int] = None
    segments: Optional[Tuple[Segment, ...]] = None
    keep: Optional[int] = None
    value_dtype: Optional[torch.dtype] = None
    hierarchy: Optional[Tuple[str, Optional[int]]] = None
    checked: Optional[Tensor] = None
    scanned: object = None

    def __post_init__(self):
        if self.name is None:  # the scheme's own name
            object.__setattr__(self, "name", getattr(self.scheme, "name", None))
        if self.segments is not None:
            object.__setattr__(self, "segments", tuple(self.segments))

    @property
    def agreed_tensor(self):
        """The tensor the agreement checks: ``checked`` where given, else ``tensor``."""
        return self.tensor if self.checked is None else self.checked


@dataclass
class Outcome:
    """What one call did, up the call: the bytes this rank sent, the block size b its entries travelled in,
    whether it was summed dense, the seconds of each phase (:meth:`Call.mark`), global top-k's kept indices,
    auto's pick (:class:`zen.auto.Pick`), a node call's :class:`zen.hierarchy.node.NodeFigures`, and the
    scheme's own figures (union, gamma, imbalance...: shown, never read back by zen). A call of several block
    sizes holds each one's outcome in ``groups``. :meth:`as_stats` is what a caller's ``stats`` dict gets."""

    bytes_sent: int = 0
    block_size: int = 1
    dense: bool = False
    phases: Dict[str, float] = field(default_factory=dict)
    kept: Optional[Tensor] = None
    pick: object = None
    hierarchy: Optional[str] = None
    node: object = None
    choice_changed: bool = False
    figures: Dict[str, object] = field(default_factory=dict)
    groups: List["Outcome"] = field(default_factory=list)

    def as_stats(self) -> dict:
        """The outcome as the ``stats`` dict of ``zen.all_reduce``: the figures, then bytes_sent, block_size,
        dense, phases, and where they apply "auto", "hierarchy", the node figures and "groups"."""
        stats = dict(self.figures, bytes_sent=self.bytes_sent, phases=self.phases)
        if self.groups:
            stats["groups"] = [{k: v for k, v in g.as_stats().items() if k != "phases"} for g in self.groups]
        else:
            stats["block_size"] = self.block_size
        stats["dense"] = self.dense
        if self.choice_changed:
            stats["choice_changed"] = True
        if self.pick is not None:
            stats["auto"] = self.pick.as_stats()
        if self.node is not None:
            stats.update(self.node.as_stats())
        if self.hierarchy is not None:
            stats["hierarchy"] = self.hierarchy
        return stats


@dataclass
class _AgreementState:
    """Where a call stands with its agreement: ``done`` (later exchanges are plain all-gathers), whether the
    next call's plan is still to be filed, and a block-size choice's counts to carry in front of the first
    opening's numbers (:mod:`zen.schemes.call`)."""

    done: bool = False
    plan_open: bool = False
    choice_counts: Optional[List[int]] = None


@dataclass
class Call:
    """One collective call on ``comm``, as ``request`` asks: the agreement header, the block size b of its
    entries, and its :class:`Outcome` (what the scheme records as it runs).

    ``dense``, where the caller gives it (:class:`DenseData`), is the data as one dense tensor: a scheme with
    a dense switch may sum that instead of running its protocol (:meth:`all_reduce_dense`; then it returns no
    pieces). ``keep`` and ``value_dtype`` are the request's (:class:`Request`)."""

    comm: Comm
    request: Request
    header: List[int]
    block_size: int = 1
    dense: Optional[DenseData] = None
    outcome: Outcome = field(default_factory=Outcome)
    agreement: "_AgreementState" = field(default_factory=lambda: _AgreementState())
    _last_mark: float = field(default_factory=time.perf_counter)

    @property
    def keep(self) -> Optional[int]:
        return self.request.keep

    @property
    def value_dtype(self) -> Optional[torch.dtype]:
        return self.request.value_dtype

    @property
    def scheme_name(self) -> str:
        return str(self.request.name)

    @property
    def shape(self) -> tuple:
        tensor = self.request.agreed_tensor
        return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else ()

    def agree(self, extra: List[int]) -> Tensor:
        """The call's agreement (:func:`zen.agreement.agree`): every rank's ``extra``, one row per rank; once
        agreed, a plain all-gather. For a scheme that agrees inside its ``reduce_coo``."""
        return self.agree_opening(Opening(list(extra))).numbers

    def agree_opening(self, opening: Opening) -> Agreed:
        """The call's agreement of ``opening`` (:func:`zen.agreement.agree_and_carry`): its numbers, and the
        first bytes of its payloads in the agreement's planned slots, with a block-size choice's counts in front
        where the call chooses (their sums in :attr:`Agreed.choice`). Once agreed, the numbers travel in a plain
        all-gather and nothing rides along. The scheme files the next call's plan with :meth:`file_plan`."""
        n = self.comm.world
        state = self.agreement
        if state.done:
            empty = torch.empty(0, dtype=torch.uint8, device=self.comm.device)
            return Agreed(self.comm.all_gather_ints(opening.numbers), [empty] * n, [[0] * n for _ in range(n)])
        state.done = state.plan_open = True
        counts, state.choice_counts = state.choice_counts or [], None
        rows, arrived, slots = agreement.agree_and_carry(self.comm, self.header, counts + list(opening.numbers),
                                                         opening.payloads, shape=self.shape,
                                                         scheme_name=self.scheme_name)
        choice = rows[:, :len(counts)].sum(dim=0).tolist() if counts else None
        return Agreed(rows[:, len(counts):], arrived, slots, choice)

    def all_reduce_dense(self) -> None:
        """Sum the data dense with the backend's all-reduce (in ``value_dtype`` where given), in place."""
        values = self.dense.values()
        self.comm.all_reduce(values, self.value_dtype)
        self.dense.write(values)

    def planned(self) -> Tuple[List[List[int]], object]:
        """(S, label) of the plan this call's agreement will use (:func:`zen.agreement.planned`); nothing
        rides along once agreed."""
        n = self.comm.world
        return ([[0] * n for _ in range(n)], None) if self.agreement.done else agreement.planned(self.comm)

    def file_plan(self, slots: List[List[int]], label=None) -> None:
        """The slots (bytes, S[p][j]) that the next call after this call's predecessor will carry payloads
        in, and what they are to hold (:func:`zen.agreement.file_plan`); the first filing of the call counts
        (a call that reduces several groups of segments carries the first group's payloads in the agreement)."""
        if self.agreement.plan_open:
            self.agreement.plan_open = False
            agreement.file_plan(self.comm, slots, label)

    @property
    def choosing(self) -> bool:
        """Whether this call's agreement is to carry the counts of a block-size choice."""
        return self.agreement.choice_counts is not None

    def phase(self, name: str, scheme: Optional[str] = None) -> _Phase:
        """``with call.phase("push", self.name): ...``: the block is the phase ``name`` of ``scheme`` (default:
        the call's scheme name): it runs under the profiler's range ``zen::<scheme>::<name>``
        (:func:`phase_range`), and its seconds, with those since the previous mark, go to
        the outcome's phases (:meth:`mark`)."""
        return _Phase(self, name, scheme or self.scheme_name)

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark (or the call's start) to ``phase`` in the outcome's phases
        (seconds; where a call's time goes, for the benchmarks' breakdowns)."""
        now = time.perf_counter()
        phases = self.outcome.phases
        phases[phase] = phases.get(phase, 0.0) + now - self._last_mark
        self._last_mark = now


def opens(scheme_class: type) -> bool:
    """Whether the scheme states what it needs agreed (overrides :meth:`Scheme.open` and :meth:`Scheme.finish`),
    rather than agreeing inside its own ``reduce_coo``."""
    return scheme_class.open is not Scheme.open


class Scheme:
    """The interface. A scheme runs in two steps around the call's agreement: :meth:`open` (local work, and
    what the agreement is to carry), then :meth:`finish` (the protocol, given every rank's numbers); or, more
    simply, it overrides :meth:`reduce_coo` and calls ``call.agree`` first in it. It may override
    :meth:`reduce_dense` where it has a better path than extract, reduce, write back. It declares ``phases``
    or ``time``, and ``memory``, and in ``statistics`` the :class:`zen.cost.Statistic` instances its formulas
    read beyond the Workload's built-in counts (``w.statistic(name)``), measured wherever its workloads are;
    then ``zen.register_scheme(name, cls)`` makes ``zen.all_reduce(scheme=name)``, ``zen.predict`` and
    ``auto`` use it."""

    name = "?"
    statistics: tuple = ()

    def agreement_settings(self) -> Optional[tuple]:
        """The settings every rank must share because they decide the protocol; checked in the agreement."""
        return None

    def open(self, call: Call, indices: Tensor, values: Tensor, numel: int) -> Opening:
        """Step 1, before any exchange, on the unique entries (indices ascending, values [k] or rows [k, b])
        of [0, numel): this rank's local work, and what the call's agreement is to carry (:class:`Opening`)."""
        raise NotImplementedError

    def finish(self, call: Call, opening: Opening, agreed: Agreed) -> Sum:
        """Step 2, after the agreement (every rank's numbers in ``agreed``): the protocol; returns the sum
        (:mod:`zen.schemes.steps`). A scheme with a dense switch may sum ``call.dense`` itself (``InPlace``)."""
        raise NotImplementedError

    def run(self, call: Call, indices: Tensor, values: Tensor, numel: int) -> Sum:
        """:meth:`open`, the call's agreement, :meth:`finish`; for a scheme that agrees inside its
        :meth:`reduce_coo`, its union."""
        if not opens(type(self)):
            return Union(self.reduce_coo(call, indices, values, numel))
        opening = self.open(call, indices, values, numel)
        with call.phase("agree", self.name):
            agreed = call.agree_opening(opening)
        return self.finish(call, opening, agreed)

    def reduce_dense(self, call: Call, flat: Tensor) -> None:
        """Sum ``flat`` (contiguous, 1-D, of M values, b = ``call.block_size`` dividing M) over the group,
        in place. Default: extract the non-zero entries, reduce them, write the sum back
        (:meth:`reduce_extracted`)."""
        with call.phase("scan", self.name):
            indices, values = ops.nonzero_rows(flat, call.block_size)
        self.reduce_extracted(call, flat, indices, values)

    def reduce_extracted(self, call: Call, flat: Tensor, indices: Tensor, values: Tensor) -> None:
        """:meth:`reduce_dense` once the non-zero entries of ``flat`` are extracted (indices ascending, values
        [k] or rows [k, b]): :meth:`run` on them, with ``flat`` as the call's dense data, and the sum written
        back."""
        call.dense = DenseData(lambda: flat, lambda summed: summed is flat or flat.copy_(summed))
        summed = self.run(call, indices, values, flat.numel() // call.block_size)
        call.dense = None
        if not summed.in_place:  # else the scheme wrote the sum into ``flat`` itself
            with call.phase("scatter", self.name):
                summed.write(flat, indices, values)

    def reduce_coo(self, call: Call, indices: Tensor, values: Tensor, numel: int) -> List[Tuple[Tensor, Tensor]]:
        """Sum a sparse tensor given as unique (indices, values) over [0, numel) entries: values [k], or rows
        [k, b] (entry i is the row of b values at i). Returns the union as a list of (indices, values)
        pieces with disjoint indices and values shaped like the input's: every index that is non-zero on
        any rank, also where the sum is zero (:meth:`reduce_dense` writes only the union back). Default:
        :meth:`run`'s sum as pieces."""
        if not opens(type(self)):
            raise NotImplementedError(f"{type(self).__name__} implements neither reduce_coo nor open and finish")
        return self.run(call, indices, values, numel).pieces(wire.row_width(values))

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
