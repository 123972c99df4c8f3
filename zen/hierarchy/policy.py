"""The hierarchy policy: each call flat (:func:`zen.schemes.call.run_call`) or by nodes
(:func:`zen.hierarchy.node.node_call`), as its ``hierarchy`` setting says (:mod:`zen.hierarchy`).

``"auto"`` times both: on the first calls of each (group, tensor size) the node and the flat protocol take
turns (``trials`` calls each, every call timed from the last rank's start to the last one's end and the
times exchanged, so every rank picks alike) and the smaller median wins; it is timed again every ``recheck``
calls. It runs flat where there is nothing to gain (one node, or one rank per node) and, with a warning,
where nodes differ in size.
"""
import statistics
import threading
import time
import warnings
from typing import Optional

import torch

from ..agreement import HIERARCHIES, MismatchError
from ..measurement.timing import trial_seconds
from ..schemes.base import Outcome, Request
from ..schemes.call import call_header, run_call
from ..transport import Comm
from .node import node_call
from .topology import Topology, detect


def check_hierarchy(owner: str, hierarchy, local_size) -> None:
    """A ValueError naming the setting, where ``hierarchy`` or ``local_size`` is not allowed."""
    if hierarchy not in HIERARCHIES:
        raise ValueError(f"{owner}: hierarchy must be one of {', '.join(map(repr, HIERARCHIES))}; got {hierarchy!r}")
    if local_size is not None and (not isinstance(local_size, int) or isinstance(local_size, bool) or local_size < 1):
        raise ValueError(f"{owner}: local_size must be None or a positive int; got {local_size!r}")


class _Trials:
    __slots__ = ("calls", "times", "choice")

    def __init__(self):
        self.calls, self.times, self.choice = 0, {"node": [], "flat": []}, None


class Hierarchy:
    """Runs calls flat or by nodes, and keeps what ``"auto"`` measured. One per process (:data:`HIERARCHY`)."""

    def __init__(self, trials: int = 3, recheck: int = 100):
        self.trials, self.recheck = trials, recheck
        self._topologies = {}  # (comm, local_size) -> Topology
        self._trials = {}  # (comm, topology, tensor key) -> _Trials
        self._warned = set()
        self._lock = threading.Lock()

    def topology(self, comm: Comm, local_size: Optional[int], agreement_of=None) -> Topology:
        """``comm``'s nodes, found on first use (collective; a failure there breaks the group on this rank).
        ``agreement_of``: a function giving the (header, detail, shape, scheme name) of the call that needs them,
        for the agreement that finds them (:func:`zen.hierarchy.topology.detect`)."""
        key = (comm, local_size)
        if key not in self._topologies:
            comm.check_usable()
            try:
                self._topologies[key] = detect(comm, local_size, *(agreement_of() if agreement_of else ()))
            except MismatchError:
                raise
            except BaseException as error:  # noqa: B036  (the exchange failed: a dead peer, a timeout)
                comm.fail(error)
                raise
        return self._topologies[key]

    def run(self, comm: Comm, request: Request) -> Outcome:
        """One all-reduce on ``comm``'s lane, flat (:func:`zen.schemes.call.run_call`) or by nodes, as
        ``request.hierarchy`` says; its outcome says which ran (``hierarchy``)."""
        hierarchy, local_size = request.hierarchy
        if hierarchy == "flat" or comm.world == 1:
            outcome = run_call(comm, request)
            outcome.hierarchy = "flat"
            return outcome
        topology = self.topology(comm, local_size, lambda: call_header(comm, request) + (
            _shape(request.tensor), str(request.name)))
        mode = self._mode(comm, topology, hierarchy)
        key = (comm, topology.nodes, _tensor_key(request.tensor), request.block_size)
        trial = None
        if mode == "auto":
            mode, trial = self._next(key)
        start = time.perf_counter()
        outcome = run_call(comm, request) if mode == "flat" else node_call(comm, topology, request)
        outcome.hierarchy = mode
        if trial is not None:
            self._timed(comm, key, mode, start, outcome)
        return outcome

    def _mode(self, comm: Comm, topology: Topology, hierarchy: str) -> str:
        """"flat", "node" or "auto" (still to be timed) for this topology; "node" on unequal nodes raises on
        every rank (the topology is agreed)."""
        g = topology.local_size
        if g is None:
            if hierarchy == "node":
                raise MismatchError(f"zen: hierarchy='node' needs nodes of equal size; this group has "
                                    f"{topology.describe()}. Use hierarchy='flat' (or 'auto', which falls back to it)")
            if (comm, topology) not in self._warned:
                self._warned.add((comm, topology))
                warnings.warn(f"zen: hierarchy='auto' runs flat: {topology.describe()}", RuntimeWarning, stacklevel=4)
            return "flat"
        if hierarchy == "auto" and (g == 1 or len(topology.nodes) == 1):
            return "flat"  # one rank per node, or one node: nothing to sum first
        return hierarchy

    def _next(self, key) -> tuple:
        """(mode, whether this call is a trial) for an "auto" call."""
        with self._lock:
            history = self._trials.setdefault(key, _Trials())
        phase = history.calls % self.recheck
        history.calls += 1
        if phase < 2 * self.trials:
            if phase == 0:
                history.times = {"node": [], "flat": []}
            return ("node", "flat")[phase % 2], True
        return history.choice, None

    def _timed(self, comm: Comm, key, mode: str, start: float, outcome: Outcome) -> None:
        """Record a trial call's time on the group (the same on every rank); after the last, pick."""
        seconds = trial_seconds(comm, start, "hierarchy")
        history = self._trials[key]
        history.times[mode].append(seconds)
        if all(len(t) == self.trials for t in history.times.values()):
            medians = {m: statistics.median(t) for m, t in history.times.items()}
            history.choice = min(("node", "flat"), key=medians.get)
            outcome.figures["hierarchy_medians"] = medians

    def choice(self, comm: Comm, tensor, block_size: Optional[int] = None, local_size: Optional[int] = None):
        """What ``"auto"`` picked for calls like this one on ``comm`` ("node" or "flat"; None while timing)."""
        topology = self._topologies.get((comm, local_size))
        history = self._trials.get((comm, topology.nodes if topology else None, _tensor_key(tensor), block_size))
        return history.choice if history else None


def _shape(tensor) -> tuple:
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else ()


def _tensor_key(tensor) -> tuple:
    if not isinstance(tensor, torch.Tensor):
        return ()
    return (tuple(tensor.shape), tensor.dtype, tensor.layout)


HIERARCHY = Hierarchy()
