"""Top-k sparsification with error feedback: how a dense gradient becomes a sparse one (DGC, ICLR 2018;
Ok-Topk, PPoPP 2022): :class:`TopK`, the compressor of :class:`zen.ZenState` ``(topk=TopK(r))``.

Per step, each large parameter p of a bucket (numel >= ``min_numel``; smaller ones stay dense) keeps the
k_p = ceil(r |p|) entries of largest magnitude of its accumulated gradient, DGC's per-layer rule:

    acc = g + e                  e: the residual of the previous steps (0 without error feedback)
    S   = top-k_p of |acc|       NaN first, then +-Inf, so a broken gradient is always sent
    sent = acc on S, 0 elsewhere
    e'  = acc - sent             acc off S, 0 on S: sent + e' == acc bit for bit

With momentum correction (DGC section 3.2; use it with SGD *without* momentum), the momentum is accumulated
before selection and both buffers are masked on S ("momentum factor masking"):

    u = m u + g;  v = v + u;  acc = v;  e' = v - sent;  u' = u with 0 on S.

Selection is exact (:func:`zen.ops.topk_select`) below ``sampled_from`` elements and sampled above: the
threshold t is the k'-th magnitude of a strided sample of at least 1% of the entries (k' = k x sample /
numel), then every |acc| >= t is taken (:func:`zen.ops.threshold_select`). A count in [0.8 k, 1.3 k] is
accepted; above it the exact top-k of the candidates is taken (still exact: every entry outside them is
smaller); below it the exact top-k of the whole. t is reused for ``reestimate_every`` steps (Ok-Topk) and,
after an exact refinement, replaced by the k-th magnitude found.
"""
import math
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import ops
from .schemes.base import phase_range
from .schemes.call import Segment

Tensor = torch.Tensor

SELECTIONS = ("auto", "exact", "sampled")
SAMPLE_FRACTION = 0.01
BAND = (0.8, 1.3)


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# setting -> (whether a value is allowed, what it must be), in the order they are checked
RULES = {
    "ratio": (lambda v: v is None or _real(v) and 0.0 < v <= 1.0, "None or in (0, 1]"),
    "warmup_steps": (lambda v: _int(v) and v >= 2, "an int >= 2 (DDP rebuilds its buckets after the first step, "
                                                   "and residuals are kept per bucket)"),
    "momentum": (lambda v: v is None or _real(v) and 0.0 <= v < 1.0, "None or in [0, 1)"),
    "min_numel": (lambda v: _int(v) and v >= 1, "a positive int"),
    "selection": (lambda v: v in SELECTIONS, f"one of {', '.join(SELECTIONS)}"),
    "density_ramp": (lambda v: v is None or _int(v) and v >= 1, "None or a positive int (steps)"),
    "reestimate_every": (lambda v: _int(v) and v >= 1, "a positive int"),
}


def check_topk_settings(owner: str, settings: dict, ratio_name: str = "ratio") -> None:
    """ValueError naming the first bad one of ``settings`` (:class:`TopK`'s names; those left out keep their
    defaults, which are good), the ratio as ``ratio_name``: "ZenState: topk_ratio must be ...; got 2"."""
    for name, (allowed, what) in RULES.items():
        if name in settings and not allowed(settings[name]):
            shown = ratio_name if name == "ratio" else name
            raise ValueError(f"{owner}: {shown} must be {what}; got {settings[name]!r}")


def keep_count(ratio: float, numel: int) -> int:
    """k = ceil(r M), at least 1."""
    return max(1, math.ceil(ratio * numel - 1e-9))


def ramped_ratio(ratio: float, warmup_steps: int, density_ramp: Optional[int], step: int) -> float:
    """The ratio at ``step``: r, or with a ramp of R steps after the warm-up, the exponential path from 1 down
    to r, r^((s - w + 1) / R) (DGC's warm-up training, 25% -> 6.25% -> ... -> 0.1%, as a smooth curve)."""
    if not density_ramp:
        return ratio
    done = min(1.0, (step - warmup_steps + 1) / density_ramp)
    return ratio ** done


def _magnitude_floor(values: Tensor) -> float:
    """The least magnitude among ``values`` (NaNs left out); +inf when there is none."""
    mags = values.abs()
    mags = mags[~torch.isnan(mags)]
    return float(mags.min()) if mags.numel() else math.inf


class Selector:
    """Picks the entries to send, exactly or by a sampled threshold reused across steps (module docstring)."""

    def __init__(self, selection: str = "auto", sampled_from: int = 1 << 20, reestimate_every: int = 16):
        self.selection = selection
        self.sampled_from = sampled_from
        self.reestimate_every = reestimate_every
        self.thresholds: Dict[tuple, Tuple[float, int]] = {}  # key -> (threshold, step it was estimated)
        self.last = {}  # how the last selection went: "exact" | "reused" | "sampled" | "refined"

    def uses_sampling(self, numel: int) -> bool:
        return self.selection == "sampled" or (self.selection == "auto" and numel >= self.sampled_from)

    def select(self, acc: Tensor, k: int, key: tuple, step: int) -> Tuple[Tensor, Tensor]:
        """(indices ascending, values) of the entries of the 1-D ``acc`` to send: its top k, or its entries
        above a threshold whose count is within [0.8 k, 1.3 k]."""
        if not self.uses_sampling(acc.numel()):
            self.last[key] = "exact"
            return ops.topk_select(acc, k)
        held = self.thresholds.get(key)
        fresh = held is None or step - held[1] >= self.reestimate_every
        threshold = self._sampled_threshold(acc, k, step) if fresh else held[0]
        idx, val = ops.threshold_select(acc, threshold)
        how = "sampled" if fresh else "reused"
        if not fresh and not BAND[0] * k <= idx.numel() <= BAND[1] * k:  # a stale threshold: estimate again
            threshold, how = self._sampled_threshold(acc, k, step), "sampled"
            idx, val = ops.threshold_select(acc, threshold)
        if idx.numel() > BAND[1] * k:
            at, val = ops.topk_select(val, k)
            idx, how = idx[at.long()], "refined"
        elif idx.numel() < BAND[0] * k:
            idx, val = ops.topk_select(acc, k)
            how = "refined"
        if how == "refined":
            threshold = _magnitude_floor(val)
        if fresh or how != "reused":
            self.thresholds[key] = (threshold, step)
        self.last[key] = how
        return idx, val

    @staticmethod
    def _sampled_threshold(acc: Tensor, k: int, step: int) -> float:
        """The k'-th magnitude of every s-th entry from an offset that moves with the step (no random state:
        a resumed run samples as the uninterrupted one), s = 1 / SAMPLE_FRACTION."""
        stride = int(round(1 / SAMPLE_FRACTION))
        start = (step * 7919) % stride
        sample = acc[start::stride].contiguous()
        wanted = max(1, round(k * sample.numel() / acc.numel()))
        return _magnitude_floor(ops.topk_select(sample, wanted)[1])

    def state_dict(self) -> dict:
        return {"thresholds": dict(self.thresholds)}

    def load_state_dict(self, state: dict) -> None:
        self.thresholds = dict(state["thresholds"])


@dataclass
class Residual:
    """One parameter's buffers between steps: the residual e and, with momentum correction, the momentum u.
    They are kept per parameter, not per bucket, so a new bucket layout (DDP rebuilds its buckets after the
    first step, and again in a resumed run) never misapplies them."""

    numel: int
    error: Optional[Tensor] = None
    momentum: Optional[Tensor] = None

    def to(self, device) -> "Residual":
        for name in ("error", "momentum"):
            kept = getattr(self, name)
            if kept is not None and kept.device != device:
                setattr(self, name, kept.to(device))
        return self


Part = Tuple[Segment, Residual]  # a large parameter's place in the buffer, and its residual


def split_segments(segments: Sequence[Segment], min_numel: int) -> Tuple[List[int], List[int]]:
    """(large, small): the positions of the parameters that are sparsified, and of those (numel < min_numel)
    that stay dense."""
    large = [i for i, s in enumerate(segments) if s[1] >= min_numel]
    small = [i for i, s in enumerate(segments) if s[1] < min_numel]
    return large, small


def sparsify(buffer: Tensor, parts: Sequence[Part], ratio: float, selector: Selector, step: int,
             keys: Sequence, error_feedback: bool, momentum: Optional[float]) -> Tuple[Tensor, Tensor]:
    """Sparsify the parts of ``buffer`` in place (module docstring): on return each holds only its sent
    entries, and its :class:`Residual` the new e (and u). ``keys`` name the parts for the selector's
    thresholds. Returns the sent (indices into ``buffer``, values), ascending; under the profiler's range
    ``zen::topk::select``."""
    with phase_range("topk", "select"):
        return _sparsify(buffer, parts, ratio, selector, step, keys, error_feedback, momentum)


def _sparsify(buffer, parts, ratio, selector, step, keys, error_feedback, momentum) -> Tuple[Tensor, Tensor]:
    sent_idx, sent_val = [], []
    for ((offset, numel, _), kept), key in zip(parts, keys):
        view = buffer[offset:offset + numel]
        grad = view
        if momentum is not None:
            if kept.momentum is None:
                kept.momentum = torch.zeros_like(view)
            grad = kept.momentum.mul_(momentum).add_(view)
        if error_feedback:
            if kept.error is None:
                kept.error = torch.zeros_like(view)
            acc = kept.error.add_(grad)
        else:
            acc = grad.clone()
        idx, val = selector.select(acc, keep_count(ratio, numel), key, step)
        if error_feedback:
            acc.index_fill_(0, idx.long(), 0)  # e' = acc - sent
        if momentum is not None:
            kept.momentum.index_fill_(0, idx.long(), 0)
        view.zero_()
        ops.scatter_(view, idx, val)
        sent_idx.append(idx.to(torch.int64) + offset)
        sent_val.append(val)
    if not sent_idx:
        return torch.empty(0, dtype=torch.int64, device=buffer.device), buffer[:0]
    return torch.cat(sent_idx), torch.cat(sent_val)


def return_unsent(parts: Sequence[Part], sent_idx: Tensor, sent_val: Tensor, kept: Tensor, numel: int) -> int:
    """Global top-k: the sent entries the partitions' owners dropped go back into their residuals, so
    nothing is lost (what reached the sum + e' == acc still). ``kept``: the buffer's indices that reached the
    sum. Returns how many went back."""
    reached = torch.zeros(numel, dtype=torch.bool, device=sent_idx.device)
    reached[kept.long()] = True
    dropped = ~reached[sent_idx]
    idx, val = sent_idx[dropped], sent_val[dropped]
    for (offset, size, _), residual in parts:
        mine = (idx >= offset) & (idx < offset + size)
        residual.error.index_put_((idx[mine] - offset,), val[mine], accumulate=True)
    return int(dropped.sum())


@dataclass
class Sent:
    """What :meth:`TopK.compress` made of a bucket: the ``ratio`` it kept, its large parameters' ``parts``,
    their sent entries (``indices`` into the buffer, ascending, and ``values``), its ``small`` parameters,
    taken out as one ``dense`` tensor (None where there are none) to be summed apart, and with global top-k
    the count of sums the partitions' owners ``keep`` (None without)."""

    ratio: float
    parts: List[Part]
    indices: Tensor
    values: Tensor
    small: List[Segment]
    dense: Optional[Tensor]
    keep: Optional[int]

    def write_small(self, buffer: Tensor) -> None:
        """Put ``dense`` (summed) back into the small parameters' places in ``buffer``."""
        for (offset, numel, _), part in zip(self.small, self.dense.split([n for _, n, _ in self.small])):
            buffer[offset:offset + numel].copy_(part)


class TopK:
    """The hook's top-k compressor (module docstring): its settings, its :class:`Selector`, and the residuals
    it keeps between steps, per parameter. ``ZenState(topk=zen.TopK(0.01, warmup_steps=2))`` is
    ``ZenState(topk_ratio=0.01, warmup_steps=2)``; a TopK belongs to one ZenState.

    Args:
        ratio: None (default): off, every non-zero is sent. r in (0, 1]: each parameter of at least
            ``min_numel`` elements sends its top ceil(r numel) entries by magnitude; smaller ones stay dense.
        warmup_steps: the first steps run without sparsification; an int >= 2, as DDP rebuilds its buckets
            after the first step and residuals are kept per bucket (torch's PowerSGD hook has the same rule).
        error_feedback: keep what was not sent and add it to the next step's gradient (default True).
        momentum: DGC's momentum correction with this factor (then use SGD without momentum); None: off.
        min_numel: parameters below this many elements stay dense (default 4096).
        selection: "exact" (top-k), "sampled" (a threshold from a 1% sample, reused for
            ``reestimate_every`` steps) or "auto" (default: sampled from 2**20 elements).
        density_ramp: over this many steps after the warm-up, the ratio falls from 1 to ``ratio``
            exponentially (DGC's warm-up); None: ``ratio`` at once.
        global_topk: after the push, each partition's owner keeps only its top k/n sums (Ok-Topk's
            global top-k; ``scheme="zen"`` only), so the pull stays O(k); entries that did not survive go back
            into the sender's residual.

    Residuals are keyed by the parameter's ordinal, the order in which the hook first saw it (DDP's first
    step, whose buckets follow the model's parameters: the same in a run and in its resumption), or, where a
    bucket does not name its parameters, by ("bucket", index, offset).
    """

    __slots__ = ("ratio", "warmup_steps", "error_feedback", "momentum", "min_numel", "selection", "density_ramp",
                 "reestimate_every", "global_topk", "selector", "residuals", "_ordinals", "_layouts", "_first_step",
                 "_warned_models", "_taken")

    def __init__(self, ratio: Optional[float] = None, *, warmup_steps: int = 10, error_feedback: bool = True,
                 momentum: Optional[float] = None, min_numel: int = 4096, selection: str = "auto",
                 density_ramp: Optional[int] = None, reestimate_every: int = 16, global_topk: bool = False):
        check_topk_settings("TopK", dict(ratio=ratio, warmup_steps=warmup_steps, momentum=momentum,
                                         min_numel=min_numel, selection=selection, density_ramp=density_ramp,
                                         reestimate_every=reestimate_every))
        self.ratio, self.warmup_steps, self.error_feedback = ratio, warmup_steps, bool(error_feedback)
        self.momentum, self.min_numel, self.selection = momentum, min_numel, selection
        self.density_ramp, self.reestimate_every, self.global_topk = density_ramp, reestimate_every, bool(global_topk)
        self.selector = Selector(selection, reestimate_every=reestimate_every)
        self.residuals: Dict[object, Residual] = {}  # parameter ordinal (or bucket place) -> its buffers
        self._ordinals = WeakIdKeyDictionary()  # parameter -> its ordinal
        self._layouts = {}  # bucket index -> its segments, where its parameters are not known
        self._first_step = None  # the step on which the hook first saw parameters
        self._warned_models = False
        self._taken = False  # given to a ZenState

    def settings(self) -> dict:
        """The settings that decide what a step sends, by ZenState's names (a checkpoint's "settings")."""
        return dict(topk_ratio=self.ratio, warmup_steps=self.warmup_steps, error_feedback=self.error_feedback,
                    momentum=self.momentum, min_numel=self.min_numel, selection=self.selection,
                    density_ramp=self.density_ramp, reestimate_every=self.reestimate_every,
                    global_topk=self.global_topk)

    def state_dict(self) -> dict:
        """Its settings, residuals and momenta per key, and the selection thresholds (``torch.save``-able)."""
        residuals = {key: dict(numel=r.numel, error=r.error, momentum=r.momentum) for key, r in self.residuals.items()}
        return dict(settings=self.settings(), residuals=residuals, selector=self.selector.state_dict())

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (or ZenState's); a ValueError names the settings that differ."""
        mine = self.settings()
        differ = settings_differ({k: v for k, v in state["settings"].items() if k in mine}, mine)
        if differ:
            raise ValueError("TopK.load_state_dict: the checkpoint's settings differ: " + "; ".join(differ))
        self.residuals = {key: Residual(**r) for key, r in state["residuals"].items()}
        self.selector.load_state_dict(state["selector"])

    def note_parameters(self, parameters: list, step: int) -> None:
        """Number a bucket's parameters (their ordinals). DDP hooks every bucket of its model on every step,
        so all of them are seen on the state's first step here: one first seen on a later step is another
        model's. A state counts one model's steps (the warm-up and ramp follow them): with a ratio that is a
        ValueError, without one a warning (the sums are right; summary() counts both models' steps)."""
        if parameters[0] in self._ordinals and parameters[-1] in self._ordinals:
            return  # a bucket seen before (DDP's buckets hold one model's parameters, noted together)
        for parameter in parameters:
            if parameter in self._ordinals:
                continue
            if self._first_step is None:
                self._first_step = step
            elif step != self._first_step and not self._warned_models:
                message = (f"ZenState: one state is registered on more than one DDP model (a parameter first seen on "
                           f"step {step}, after step {self._first_step}); give each model a ZenState of its own")
                if self.ratio is not None:
                    raise ValueError(message + ": top-k's warm-up and ramp count the state's steps")
                self._warned_models = True
                warnings.warn(message + ": summary() counts the steps of all of them", RuntimeWarning, stacklevel=3)
            self._ordinal(parameter)

    def _ordinal(self, parameter: Tensor) -> int:
        """The parameter's ordinal: the order in which the hook first saw it."""
        if parameter not in self._ordinals:
            self._ordinals[parameter] = len(self._ordinals)
        return self._ordinals[parameter]

    def compress(self, bucket, buffer: Tensor, segments: Optional[List[Segment]], step: int) -> Sent:
        """Sparsify ``buffer`` (the bucket's, averaged) in place at ``step``: its large parameters keep their
        top entries, the rest going into their residuals; its small ones are taken out (zeroed) to be summed
        dense."""
        segments = segments or [(0, buffer.numel(), 1)]
        large, small = split_segments(segments, self.min_numel)
        parts, keys = self._parts(bucket, buffer, segments, large)
        ratio = ramped_ratio(self.ratio, self.warmup_steps, self.density_ramp, step)
        indices, values = sparsify(buffer, parts, ratio, self.selector, step, keys, self.error_feedback,
                                   self.momentum)
        small = [segments[i] for i in small]
        dense = torch.cat([buffer[o:o + n] for o, n, _ in small]) if small else None
        for o, n, _ in small:
            buffer[o:o + n].zero_()
        # Global top-k: the owners keep the k (summed over the parameters, alike on every rank) largest sums.
        keep = sum(keep_count(ratio, s[1]) for s, _ in parts) if self.global_topk else None
        return Sent(ratio, parts, indices, values, small, dense, keep)

    def return_unsent(self, sent: Sent, reached: Tensor, numel: int) -> int:
        """Global top-k: what the owners dropped of ``sent`` goes back into the residuals (module function)."""
        return return_unsent(sent.parts, sent.indices, sent.values, reached, numel)

    def _parts(self, bucket, buffer: Tensor, segments: List[Segment], large: List[int]) -> tuple:
        """(parts, keys) of the bucket's large segments, each with its residual (class docstring); a bucket
        without named parameters whose layout changed drops its residuals, and so does one whose size no
        longer fits, with a warning: never applied to other parameters."""
        parameters = list(bucket.parameters()) if hasattr(bucket, "parameters") else []
        known = len(parameters) == len(segments) and all(p.numel() == s[1] for p, s in zip(parameters, segments))
        if not known and self._layouts.setdefault(bucket.index(), segments) != segments:
            warnings.warn(f"ZenState: bucket {bucket.index()} changed its layout; its residuals are dropped, "
                          "never applied to other parameters", stacklevel=4)
            self.residuals = {k: r for k, r in self.residuals.items()
                              if not (isinstance(k, tuple) and k[1] == bucket.index())}
            self._layouts[bucket.index()] = segments
        parts, keys = [], []
        for i in large:
            segment = segments[i]
            key = self._ordinal(parameters[i]) if known else ("bucket", bucket.index(), segment[0])
            kept = self.residuals.get(key)
            if kept is not None and kept.numel != segment[1]:
                warnings.warn(f"ZenState: the residual kept for {key} has {kept.numel} elements, its parameter "
                              f"{segment[1]}: dropped, never applied", stacklevel=4)
                kept = None
            if kept is None:
                kept = self.residuals[key] = Residual(segment[1])
            parts.append((segment, kept.to(buffer.device)))
            keys.append(key)
        return parts, keys

    def claim(self) -> None:
        """Make it one ZenState's: a ValueError where another has it (its residuals are that state's)."""
        if self._taken:
            raise ValueError("ZenState: this TopK is another ZenState's already (it keeps that state's residuals); "
                             "give each state a TopK of its own")
        self._taken = True

    def __getstate__(self):
        return {name: getattr(self, name) for name in self.__slots__ if name not in ("_ordinals", "_first_step")}

    def __setstate__(self, state):
        self._ordinals, self._first_step = WeakIdKeyDictionary(), None
        for name, value in state.items():
            setattr(self, name, value)


def settings_differ(saved: dict, here: dict) -> List[str]:
    """The settings of a checkpoint (``saved``) that differ from ``here``, each named with both values."""
    return [f"{k} (checkpoint {v!r}, here {here.get(k)!r})" for k, v in saved.items() if here.get(k) != v]
