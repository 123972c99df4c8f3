"""``scheme="auto"``: the cost model's choice, per group and tensor size, settled by timing near ties, and
re-checked as densities drift.

For each (group, tensor size M), calls c with c % recheck < warmup are measuring calls: the scheme
measures the workload (``zen.measurement.workload.measure_now``: nnz, hash and block loads, the exact union by bitmap
doubling; the group's profile is the one ``zen.set_profile`` gave, or a ``zen.predict`` probed), predicts every
candidate's time (``zen.cost.predict_times``) and reduces with the smallest mean prediction over the
measuring calls of the current window. The model's error on a noisy host exceeds the gap between
the best schemes where they nearly tie, so the next calls are trials: every candidate predicted within
``trial_margin`` times the best runs ``trials`` calls (interleaved), each timed from the last rank's start
to the last one's end (one all-gather of three int64 per trial call; ``zen.measurement.timing.trial_seconds``),
and the pick is the smallest median time (a median of 3 by default: a scheme's first call may pay one-off
costs, such as zen's index sets I_j). Other calls go straight to the pick. Every number a decision uses
was exchanged (rank 0's profile, everyone's counts, the calls' times), so all ranks pick the same.

Without a profile on some rank (learnt in the measuring call's agreement), the model cannot rank, and the
probe that would give one takes seconds to a minute (``Auto(probe=True)`` runs it, once per group): the
window is ranked by trials alone, as Horovod's autotuner ranks its settings. Every candidate runs one call,
those within ``trial_margin`` times the fastest run ``trials - 1`` more, and the pick is the smallest median;
per ``recheck`` calls, that costs one call of each candidate beyond the pick's.

The measurement's first collective is the call's agreement, as the pick's is on the other calls (the
agreement's row has the same length either way), so ranks that disagree on the tensor fail alike even
though their histories differ. What "auto" can lose against the best fixed scheme, per ``recheck`` calls:
the measuring calls (the agreement, floor(log2 n) exchanges of M/8 bytes and an all-gather; the probe once
per group) and the trial calls of the slower near-ties (at most ``trial_margin`` times the best prediction).
``ZenState.summary()`` counts the measuring and trial calls' seconds.

COO input (a sparse tensor, or entries handed over as COO) never tries "dense", as a trial or as a pick, where
the dense tensor takes more bytes than every rank's entries together: M s_v > sum_r k_r (s_v + s_i) (M
entries of s_v bytes, a row of b values each where the call reduces rows; k_r the non-zero entries of rank
r). "dense" would build that tensor on every rank (an ``nn.Embedding(sparse=True)`` of 20M rows of 16 floats:
1.28 GB, for a few rows) where an all-gather of the entries alone moves fewer bytes than it, under half the
ring's 2 (n-1)/n M s_v. The k_r are the measuring call's agreement's, so every rank drops it alike, for the
window.

``zen.all_reduce(scheme="auto")`` builds its scheme per call, so ``make_scheme("auto")`` without settings
returns one shared instance: the history lives as long as the process.
"""
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from . import wire
from .cost import choose, predict_times
from .measurement.probe import probe_now
from .measurement.store import cached_profile, set_profile
from .measurement.timing import trial_seconds
from .measurement.workload import measure_now
from .schemes import Call, Scheme, registered
from .schemes.base import opens, phase_range
from .schemes.steps import Agreed, Opening, Sum


@dataclass
class Pick:
    """What auto did on one call (:attr:`zen.schemes.base.Outcome.pick`): the scheme it ran (``choice``),
    whether the call measured the workload (``measured``; then ``predicted``, the model's seconds per
    candidate, and ``seconds_measuring``), whether it was a trial call (timed against the other candidates:
    ``seconds``, its slowest rank's; after a window's last trial, ``trial_medians``)."""

    choice: str
    measured: bool = False
    trial: bool = False
    predicted: Optional[Dict[str, float]] = None
    seconds_measuring: Optional[float] = None
    seconds: Optional[float] = None
    trial_medians: Optional[Dict[str, float]] = None

    @property
    def seconds_choosing(self) -> float:
        """What choosing cost this call: its measuring, and a trial call whole."""
        return (self.seconds_measuring or 0.0) + (self.seconds or 0.0)

    def as_stats(self) -> dict:
        """As ``stats["auto"]``: choice and measured, then what applies (trial where True, the rest where set)."""
        stats = dict(choice=self.choice, measured=self.measured)
        if self.trial:
            stats["trial"] = True
        for name in ("predicted", "seconds_measuring", "seconds", "trial_medians"):
            if getattr(self, name) is not None:
                stats[name] = getattr(self, name)
        return stats


@dataclass
class _Run:
    """One call of auto from :meth:`Auto.open` to :meth:`Auto.finish`: its start, (entries, row width), the
    entries, whether its data is a strided tensor and whether its agreement carries a block-size choice; the
    pick (None while it measures) and the pick's opening; for a measuring call, its place in the window and
    this rank's profile."""

    start: float
    key: tuple
    entries: tuple
    dense_input: bool
    choosing: bool
    name: Optional[str] = None
    opened: Optional[Opening] = None
    phase: int = 0
    profile: object = None


class _History:
    __slots__ = ("calls", "window", "choice", "trials", "timings", "by_trials", "pruned")

    def __init__(self):
        self.calls, self.window, self.choice = 0, [], None
        self.trials = []  # candidates still to run a trial call, in order
        self.timings = {}  # candidate -> slowest-rank seconds of its trial calls in this window
        self.by_trials = False  # this window ranks by trials alone (no profile): no measuring calls
        self.pruned = False  # (by trials) the first round, one call each, has been cut to the near ties


class Auto(Scheme):
    name = "auto"

    def __init__(self, candidates: Optional[Sequence[str]] = None, warmup: int = 1, recheck: int = 100,
                 block_size: int = 256, profile=None, trials: int = 3, trial_margin: float = 1.5,
                 probe: bool = False):
        """``candidates``: the registered schemes to pick from (default: all of them, as registered now);
        ``warmup`` measuring calls every ``recheck`` calls (per group and tensor size); then ``trials`` timed
        calls of every candidate predicted within ``trial_margin`` times the best (0 trials: the model's pick
        alone); ``block_size``: OmniReduce's; ``profile``: a :class:`zen.cost.Profile` to use instead of the
        group's set or probed one (rank 0's counts); ``probe``: where a rank has no profile, probe the group
        (seconds to a minute, once per group) rather than rank by trials of every candidate."""
        schemes = registered()
        candidates = tuple(schemes) if candidates is None else tuple(candidates)
        if not candidates or "auto" in candidates:
            raise ValueError(f"auto: candidates must be non-empty and exclude 'auto'; got {candidates!r}")
        unknown = [name for name in candidates if name not in schemes]
        if unknown:
            raise ValueError(f"auto: unknown candidate(s) {', '.join(map(repr, unknown))}; registered: "
                             f"{', '.join(schemes)}")
        if not isinstance(warmup, int) or not isinstance(recheck, int) or not 1 <= warmup <= recheck:
            raise ValueError(f"auto: need ints 1 <= warmup <= recheck; got warmup={warmup!r}, recheck={recheck!r}")
        if not isinstance(trials, int) or trials < 0 or not trial_margin >= 1.0:
            raise ValueError(f"auto: need an int trials >= 0 and trial_margin >= 1; got trials={trials!r}, "
                             f"trial_margin={trial_margin!r}")
        self.schemes = {name: schemes[name](**({"block_size": block_size} if name == "omnireduce" else {}))
                        for name in candidates}
        self.warmup, self.recheck, self.block_size, self.profile = warmup, recheck, block_size, profile
        self.trials, self.trial_margin, self.probe = trials, trial_margin, bool(probe)
        self._history = {}  # (comm, numel) -> _History; each group's lane touches its own keys only
        self._lock = threading.Lock()

    def agreement_settings(self):
        """Settings that decide the protocol (when to measure, what to pick from); checked in the agreement."""
        return (tuple(self.schemes), self.warmup, self.recheck, self.block_size, self.trials,
                round(self.trial_margin * 1e6), self.probe)

    def reduce_dense(self, call: Call, flat):
        """A trial or a settled call runs the pick's own :meth:`reduce_dense` (for "dense": no scan at all); a
        call that measures scans ``flat`` for its non-zeros first (:meth:`open`, :meth:`finish`)."""
        key = (flat.numel() // call.block_size, call.block_size)
        if not self._past_measuring(self._history_of(call.comm, key)):
            return super().reduce_dense(call, flat)
        start = time.perf_counter()
        name = self._next(call, key)
        self.schemes[name].reduce_dense(call, flat)
        self._timed(call, key, name, start)

    def open(self, call: Call, indices, values, numel) -> Opening:
        """A trial or a settled call: the pick's own opening. A call that measures: [has a profile, k_r] in the
        agreement (where some rank has no profile, trials decide)."""
        run = _Run(time.perf_counter(), (numel, wire.row_width(values)), (indices, values, numel),
                   dense_input=call.dense is not None, choosing=call.choosing)
        history = self._history_of(call.comm, run.key)
        run.phase = history.calls % self.recheck
        if self._past_measuring(history):
            run.name = self._next(call, run.key)
            if opens(type(self.schemes[run.name])):
                run.opened = self.schemes[run.name].open(call, indices, values, numel)
                return Opening(run.opened.numbers, run.opened.payloads, run)
            return Opening([], state=run)  # a scheme that agrees inside its reduce_coo: a plain all-gather
        history.calls += 1
        run.profile = self.profile or cached_profile(call.comm.user_group)
        return Opening([1 if run.profile is not None else 0, indices.numel()], state=run)

    def finish(self, call: Call, opening: Opening, agreed: Agreed) -> Sum:
        run = opening.state
        if run.name is None:
            run.name = self._measured(call, run, agreed.numbers)
        if run.opened is not None:
            summed = self.schemes[run.name].finish(call, run.opened, agreed)
        else:  # the pick opens now: its numbers travel in a plain all-gather (the call has agreed)
            summed = self.schemes[run.name].run(call, *run.entries)
        self._timed(call, run.key, run.name, run.start)
        return summed

    def choice(self, comm, numel: int, row_size: int = 1) -> Optional[str]:
        """The scheme picked for tensors of ``numel`` elements reduced as rows of ``row_size`` on ``comm``
        (None before the first call)."""
        history = self._history.get((comm, numel // row_size, row_size))
        return history.choice if history else None

    def trial_times(self, comm, numel: int, row_size: int = 1) -> dict:
        """The slowest-rank seconds of each candidate's trial calls in the current window, by candidate."""
        history = self._history.get((comm, numel // row_size, row_size))
        return {name: list(times) for name, times in history.timings.items()} if history else {}

    def settled(self, comm, numel: int, row_size: int = 1) -> bool:
        """Whether the next call on ``comm`` with ``numel`` elements (rows of ``row_size``) goes straight to
        the pick (no measuring, no trial): what a benchmark of the steady state waits for."""
        history = self._history.get((comm, numel // row_size, row_size))
        return history is not None and self._past_measuring(history) and not history.trials

    def _past_measuring(self, history: _History) -> bool:
        """Whether the next call of ``history`` is past this window's measuring calls (a pick made)."""
        phase = history.calls % self.recheck
        return (phase >= self.warmup or (history.by_trials and phase > 0)) and history.choice is not None

    def _history_of(self, comm, key) -> "_History":
        with self._lock:
            return self._history.setdefault((comm,) + key, _History())

    def _next(self, call: Call, key) -> str:
        """The scheme of a call past its window's measuring calls: the next trial, or the pick."""
        history = self._history_of(call.comm, key)
        history.calls += 1
        if history.trials:
            call.outcome.pick = Pick(history.trials.pop(0), trial=True)
        else:
            call.outcome.pick = Pick(history.choice)
        return call.outcome.pick.choice

    def _measured(self, call: Call, run: "_Run", rows) -> str:
        """The pick of a measuring call, from the agreed ``rows`` ([has a profile, k_r] per rank): where a rank has
        no profile (and ``probe`` is off), this window ranks by trials of every candidate; else the workload is
        measured (:func:`zen.measurement.workload.measure_now`, whose first collective is this agreement) and
        the model picks."""
        comm, history = call.comm, self._history_of(call.comm, run.key)
        indices, values, numel = run.entries
        history.by_trials = False
        if not self.probe and self.trials and any(r[0] == 0 for r in rows.tolist()):
            names = self._candidates(rows[:, 1].tolist(), numel, values, run.dense_input)
            history.window, history.timings, history.by_trials, history.pruned = [], {}, True, False
            history.choice, history.trials = names[0], names[1:]
            call.outcome.pick = Pick(names[0], trial=True, seconds_measuring=time.perf_counter() - run.start)
            return names[0]
        with phase_range(self.name, "measure"):
            workload, profile = measure_now(comm, lambda _: rows, indices, values, numel, run.dense_input,
                                            -(-self.block_size // run.key[1]), run.profile,
                                            probe=lambda: probe_now(comm), row_choice=run.choosing)
        measuring = time.perf_counter() - run.start
        if run.profile is None:  # keep the agreed profile: the probe runs once per group
            set_profile(comm.user_group, profile)
        times = predict_times(workload, profile, {name: type(scheme) for name, scheme in self.schemes.items()})
        if run.phase == 0:
            history.window = []
        history.window.append(times)
        allowed = self._candidates(workload.nnz, numel, values, run.dense_input)
        mean = {name: sum(t[name] for t in history.window) / len(history.window) for name in allowed}
        history.choice = choose(mean)
        near = [name for name in sorted(mean, key=mean.get) if mean[name] <= self.trial_margin * mean[history.choice]]
        history.trials = near * self.trials if len(near) > 1 and run.phase == self.warmup - 1 else []
        history.timings = {}
        call.outcome.pick = Pick(history.choice, measured=True, predicted=times, seconds_measuring=measuring)
        return history.choice

    def _candidates(self, nnz: Sequence[int], numel: int, values, dense_input: bool) -> list:
        """The candidates of a window: all of them but "dense" for COO input whose dense tensor is larger than
        every rank's entries together, M s_v > sum_r k_r (s_v + s_i) (``nnz``: the agreed k_r; see the module's
        docstring). "dense" stays where it is the only candidate."""
        names = list(self.schemes)
        if dense_input or "dense" not in names or len(names) == 1:
            return names
        entry_bytes = wire.entry_bytes(values)
        index_bytes = wire.index_dtype(numel).itemsize
        if numel * entry_bytes > sum(nnz) * (entry_bytes + index_bytes):
            names.remove("dense")
        return names

    def _timed(self, call: Call, key, name: str, start: float) -> None:
        """After a trial call: record its time on the group (``zen.measurement.timing.trial_seconds``: from the last
        rank's start to the last one's end); after the last trial, pick the smallest median."""
        pick = call.outcome.pick
        if not pick.trial:
            return
        seconds = trial_seconds(call.comm, start, self.name)
        history = self._history[(call.comm,) + key]
        history.timings.setdefault(name, []).append(seconds)
        pick.seconds = seconds
        if not history.trials:
            medians = {s: statistics.median(t) for s, t in history.timings.items()}
            if history.by_trials and not history.pruned and self.trials > 1:
                # one call of each candidate so far: the near ties run the rest of their trials
                history.pruned = True
                best = min(medians.values())
                near = [s for s in self.schemes if s in medians and medians[s] <= self.trial_margin * best]
                if len(near) > 1:
                    history.trials = near * (self.trials - 1)
                    return
            history.choice = min(medians, key=lambda s: (medians[s], list(self.schemes).index(s)))
            pick.trial_medians = medians
