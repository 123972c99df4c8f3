"""Top-k sparsification with error feedback: how a dense gradient becomes a sparse one (DGC, ICLR 2018;
Ok-Topk, PPoPP 2022), for :class:`zen.ZenState` ``(topk_ratio=r)``.

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
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import ops
from .schemes.base import phase_range
from .schemes.call import Segment

Tensor = torch.Tensor

SELECTIONS = ("auto", "exact", "sampled")
SAMPLE_FRACTION = 0.01
BAND = (0.8, 1.3)


def check_topk_settings(owner: str, topk_ratio, warmup_steps, momentum, min_numel, selection, density_ramp,
                        reestimate_every) -> None:
    """ValueError naming the first bad top-k setting (each is checked, with top-k or without)."""
    if topk_ratio is not None and (isinstance(topk_ratio, bool) or not isinstance(topk_ratio, (int, float))
                                   or not 0.0 < topk_ratio <= 1.0):
        raise ValueError(f"{owner}: topk_ratio must be None or in (0, 1]; got {topk_ratio!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 2:
        raise ValueError(f"{owner}: warmup_steps must be an int >= 2 (DDP rebuilds its buckets after the first "
                         f"step, and residuals are kept per bucket); got {warmup_steps!r}")
    if momentum is not None and (isinstance(momentum, bool) or not isinstance(momentum, (int, float))
                                 or not 0.0 <= momentum < 1.0):
        raise ValueError(f"{owner}: momentum must be None or in [0, 1); got {momentum!r}")
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 1:
        raise ValueError(f"{owner}: min_numel must be a positive int; got {min_numel!r}")
    if selection not in SELECTIONS:
        raise ValueError(f"{owner}: selection must be one of {', '.join(SELECTIONS)}; got {selection!r}")
    if density_ramp is not None and (isinstance(density_ramp, bool) or not isinstance(density_ramp, int)
                                     or density_ramp < 1):
        raise ValueError(f"{owner}: density_ramp must be None or a positive int (steps); got {density_ramp!r}")
    if isinstance(reestimate_every, bool) or not isinstance(reestimate_every, int) or reestimate_every < 1:
        raise ValueError(f"{owner}: reestimate_every must be a positive int; got {reestimate_every!r}")


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
