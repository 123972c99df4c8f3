"""A hook's counters: what its buckets sent, against what plain DDP's ring all-reduce would have sent, per
scheme and per step, and its logging every ``log_every`` steps."""
import logging
import threading
from typing import Optional

from .cost.terms import dense_bytes
from .schemes.base import Outcome

logger = logging.getLogger("zen")


class Totals:
    """Counters of one hook state, recorded from the lane and from the callbacks of dense all-reduces (so under
    a lock). ``scheme``: the state's scheme name, which its calls are counted under."""

    def __init__(self, scheme: str, log_every: Optional[int] = None):
        self.scheme, self.log_every = scheme, log_every
        self._lock = threading.Lock()
        self.counts = dict(steps=0, buckets=0, bytes_sent=0, dense_bytes=0, schemes={}, seconds=0.0,
                           auto_seconds=0.0, auto_trials=0)
        self._step = [0.0, 0.0]  # this step's bytes sent and dense bytes so far
        self.last_step = None  # the last whole step's

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    @property
    def steps(self) -> int:
        return self.counts["steps"]

    def summary(self) -> dict:
        """The counters (see :meth:`zen.ZenState.summary`), ``bytes_vs_dense`` over all steps and ``last_step``
        (bytes_sent, dense_bytes and vs_dense of the last whole step; None before the first)."""
        counts = self.counts
        ratio = counts["bytes_sent"] / counts["dense_bytes"] if counts["dense_bytes"] else None
        return dict(counts, schemes=dict(counts["schemes"]), bytes_vs_dense=ratio,
                    last_step=dict(self.last_step) if self.last_step else None)

    def load(self, summary: dict) -> None:
        """Resume the counters of a :meth:`summary` (from a checkpoint)."""
        self.counts.update({k: v for k, v in summary.items() if k in self.counts})
        self.counts["schemes"] = dict(summary["schemes"])

    def record(self, numel: int, element_size: int, world: int, outcome: Outcome, seconds: float, last: bool) -> None:
        """One bucket's call: its outcome (bytes sent; each group dense or not, and
        what auto spent choosing)."""
        with self._lock:
            counts = self.counts
            dense = dense_bytes(numel, world, element_size)
            counts["buckets"] += 1
            counts["bytes_sent"] += outcome.bytes_sent
            counts["dense_bytes"] += dense
            counts["seconds"] += seconds
            self._step[0] += outcome.bytes_sent
            self._step[1] += dense
            for group in outcome.groups or [outcome]:
                name = self.scheme + (" (dense)" if group.dense and self.scheme != "dense" else "")
                counts["schemes"][name] = counts["schemes"].get(name, 0) + 1
                if group.pick is not None:
                    counts["auto_seconds"] += group.pick.seconds_choosing
                    counts["auto_trials"] += group.pick.trial
            if last:
                self.end_step()

    def end_step(self) -> None:
        """A step ended: count it, keep its bytes, and log the totals every ``log_every`` steps."""
        sent, dense = self._step
        self.last_step = dict(bytes_sent=sent, dense_bytes=dense, vs_dense=sent / dense if dense else None)
        self._step = [0.0, 0.0]
        self.counts["steps"] += 1
        if self.log_every and self.counts["steps"] % self.log_every == 0:
            logger.info("zen: %s", self.summary())
