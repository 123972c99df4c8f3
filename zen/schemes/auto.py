"""``scheme="auto"``: the cost model's choice, per group and tensor size, re-checked as densities drift.

For each (group, tensor size M), calls c with c % recheck < warmup are measuring calls: the scheme
measures the workload (``zen.prediction.measure_now``: nnz, hash and block loads, the exact union by bitmap
doubling; plus, once per group, the profile probe unless ``zen.set_profile`` gave one), predicts every
candidate's time (``zen.cost.predict_times``) and picks the smallest mean prediction over the measuring
calls of the current window; then it reduces with the pick. Other calls go straight to the pick. Every
number the decision uses was exchanged (rank 0's profile, everyone's counts), so all ranks pick the same.

The measurement's first collective is the call's agreement, as the pick's is on the other calls (the
agreement's row has the same length either way), so ranks that disagree on the tensor fail alike even
though their histories differ. It costs the agreement, floor(log2 n) exchanges of M/8 bytes and an
all-gather, and the probe once per group: that is what "auto" can lose against the best fixed scheme, on
measuring calls only.

``zen.all_reduce(scheme="auto")`` builds its scheme per call, so ``make_scheme("auto")`` without settings
returns one shared instance: the history lives as long as the process.
"""
import threading
from typing import Optional, Sequence

from .. import ops
from .base import Call, Scheme

CANDIDATES = ("dense", "agsparse", "sparcml", "omnireduce", "zen")


class _History:
    __slots__ = ("calls", "window", "choice")

    def __init__(self):
        self.calls, self.window, self.choice = 0, [], None


class Auto(Scheme):
    name = "auto"

    def __init__(self, candidates: Sequence[str] = CANDIDATES, warmup: int = 1, recheck: int = 100,
                 block_size: int = 256, profile=None):
        """``warmup`` measuring calls every ``recheck`` calls (per group and tensor size); ``block_size``:
        OmniReduce's; ``profile``: a :class:`zen.cost.Profile` to use instead of the group's set or probed one
        (rank 0's counts)."""
        from . import make_scheme

        candidates = tuple(candidates)
        if not candidates or "auto" in candidates:
            raise ValueError(f"auto: candidates must be non-empty and exclude 'auto'; got {candidates!r}")
        if not isinstance(warmup, int) or not isinstance(recheck, int) or not 1 <= warmup <= recheck:
            raise ValueError(f"auto: need ints 1 <= warmup <= recheck; got warmup={warmup!r}, recheck={recheck!r}")
        self.schemes = {name: make_scheme(name, **({"block_size": block_size} if name == "omnireduce" else {}))
                        for name in candidates}
        self.warmup, self.recheck, self.block_size, self.profile = warmup, recheck, block_size, profile
        self._history = {}  # (comm, numel) -> _History; each group's lane touches its own keys only
        self._lock = threading.Lock()

    def agreement_settings(self):
        """Settings that decide the protocol (when to measure, what to pick from); checked in the agreement."""
        return (tuple(self.schemes), self.warmup, self.recheck, self.block_size)

    def reduce_dense(self, call: Call, flat):
        scheme = self._pick(call, flat.numel(), lambda: ops.nonzero(flat) + (True,))
        scheme.reduce_dense(call, flat)

    def reduce_coo(self, call, indices, values, numel):
        scheme = self._pick(call, numel, lambda: (indices, values, False))
        return scheme.reduce_coo(call, indices, values, numel)

    def choice(self, comm, numel: int) -> Optional[str]:
        """The scheme picked for tensors of ``numel`` elements on ``comm`` (None before the first call)."""
        history = self._history.get((comm, numel))
        return history.choice if history else None

    def _pick(self, call: Call, numel: int, coo) -> Scheme:
        from ..cost import choose, predict_times
        from ..prediction import cached_profile, measure_now, set_profile

        comm = call.comm
        with self._lock:
            history = self._history.setdefault((comm, numel), _History())
        phase = history.calls % self.recheck
        history.calls += 1
        if phase >= self.warmup and history.choice is not None:
            call.stats["auto"] = dict(choice=history.choice, measured=False)
            return self.schemes[history.choice]
        indices, values, dense_input = coo()
        own = self.profile or cached_profile(comm.user_group)
        workload, profile = measure_now(comm, call.agree, indices, values, numel, dense_input, self.block_size, own)
        if own is None:  # keep the agreed profile: the probe runs once per group
            set_profile(comm.user_group, profile)
        times = predict_times(workload, profile, list(self.schemes))
        if phase == 0:
            history.window = []
        history.window.append(times)
        mean = {name: sum(t[name] for t in history.window) / len(history.window) for name in self.schemes}
        history.choice = choose(mean)
        call.stats["auto"] = dict(choice=history.choice, predicted=times, measured=True)
        return self.schemes[history.choice]
