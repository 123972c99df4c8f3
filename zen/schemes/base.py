"""What every scheme implements.

A scheme all-reduces (SUM) one flat tensor over a :class:`zen.comm.Comm`. Its first collective must be
``call.agree(extra)``: that exchange checks that all ranks called with the same tensor and lets the
scheme piggyback its own sizes on it (one round trip instead of two).
"""
import time
from dataclasses import dataclass, field
from typing import List, Tuple

import torch

from .. import ops
from ..comm import Comm

Tensor = torch.Tensor


@dataclass
class Call:
    """One collective call: the group, the agreement header, and the statistics the scheme records."""

    comm: Comm
    header: List[int]
    stats: dict = field(default_factory=dict)
    _last_mark: float = field(default_factory=time.perf_counter)

    def agree(self, extra: List[int]) -> Tensor:
        return self.comm.agree(self.header, extra)

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark (or the call's start) to ``phase`` in stats["phases"]
        (seconds; where a call's time goes, for the benchmarks' breakdowns)."""
        now = time.perf_counter()
        phases = self.stats.setdefault("phases", {})
        phases[phase] = phases.get(phase, 0.0) + now - self._last_mark
        self._last_mark = now


class Scheme:
    name = "?"

    def reduce_dense(self, call: Call, flat: Tensor) -> None:
        """Sum ``flat`` (contiguous, 1-D) over the group, in place. Default: extract the non-zeros, reduce
        them as COO, write the union back. The union holds every local non-zero, so positions outside it
        are zero already: no clearing pass is needed."""
        indices, values = ops.nonzero(flat)
        call.mark("scan")
        ops.scatter_pieces_(flat, self.reduce_coo(call, indices, values, flat.numel()))
        call.mark("scatter")

    def reduce_coo(self, call: Call, indices: Tensor, values: Tensor, numel: int) -> List[Tuple[Tensor, Tensor]]:
        """Sum a sparse tensor given as unique (indices, values) over [0, numel). Returns the union as a
        list of (indices, values) pieces with disjoint indices."""
        raise NotImplementedError
