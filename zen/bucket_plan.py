"""The hook's plan of each DDP bucket: dense (one all-reduce of the bucket's buffer, plain DDP's collective) or
by the scheme, decided from what every rank shares, so that a steady bucket spends no round on deciding.

A bucket is *checked* on its first call, when its layout changes (DDP rebuilds its buckets after the first
step), and every :data:`RECHECK_STEPS` steps. A check is one agreement (:func:`zen.agreement.agree`): every
rank's header, with the bucket's parameter shapes in its shape field (ranks whose buckets differ raise the same
:class:`zen.MismatchError`), and, for a scheme that may send sparse, each row-size group's non-zero elements
and rows, and this rank's last timed seconds of each way. From those every rank computes the same lower
bound of the bytes the scheme would send (:func:`sparse_may_pay`); where even that bound is not below a ring
all-reduce's, the bucket is dense and its sum is one all-reduce. Else time decides: each way is timed where it
runs right after a check, and the faster by the slowest rank's seconds is kept (:func:`check`); the scheme
then runs with its own agreement and its dense switch.

Between checks a dense bucket is one all-reduce and nothing else, started at once on the user's group from
DDP's hook thread, as plain DDP's (:meth:`zen.transport.Comm.all_reduce_async`). A bucket the scheme ran becomes dense as soon as a call of it
went dense whole (its dense switch decides from agreed counts, alike on every rank), and goes back to the
scheme at the next check where its counts say sparse may pay.

Every input of these decisions is alike on every rank: the step count, the bucket's index and layout (DDP
makes them alike), and agreed counts. A layout that changes on some ranks only (outside DDP) meets the others
in a collective of another kind: that surfaces as :class:`zen.PeerError` within the timeout, not as a
MismatchError; the next check would name it.
"""
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from . import agreement, ops
from .cost.terms import balanced_bytes, dense_bytes
from .geometry import index_size, rows_are_smaller
from .hierarchy import HIERARCHY
from .schemes.base import Outcome, Request
from .schemes.call import Segment, call_header
from .transport import Comm

RECHECK_STEPS = 16

# Sparse may pay where the bound below sends at most this fraction of a ring all-reduce's bytes. The bound leaves
# out what a call adds (the hash's imbalance, the slots' headroom, headers, the local kernels); at full density
# Balanced Parallelism is a reduce-scatter and an all-gather, within 0.2% of the ring's bytes.
SPARSE_BYTES = 0.9

# A parameter smaller than this stays elements: reducing it in a group of its own would cost a round more
# than its rows could save (at most 4 bytes of index per element, 16 KiB: under one latency of a fast link).
SMALL_PARAMETER = 4096


def bucket_segments(parameters: Optional[list], buffer: torch.Tensor) -> Optional[List[Segment]]:
    """A bucket's ``parameters`` as segments of its flat buffer: (offset, numel, row size), the row size the
    parameter's trailing dims (numel / shape[0] for 2-D and more, 1 for a vector or a parameter of fewer than
    ``SMALL_PARAMETER`` elements). None where the bucket says nothing of its parameters or they do not tile
    the buffer (then the buffer's own shape decides)."""
    if parameters is None or buffer.layout != torch.strided:
        return None
    segments, offset = [], 0
    for p in parameters:
        large = p.dim() > 1 and p.shape[0] and p.numel() >= SMALL_PARAMETER
        rows = p.numel() // p.shape[0] if large else 1
        segments.append((offset, p.numel(), rows))
        offset += p.numel()
    return segments if offset == buffer.numel() and segments else None


def check_hook_call(state, state_type: type, bucket) -> None:
    """A TypeError naming the fix where the hook was not called as DDP calls a comm hook: ``state`` must be a
    ``state_type`` (a hook registered with no state, e.g. Lightning's ``DDPStrategy`` given ``ddp_comm_hook``
    without ``ddp_comm_state``) and ``bucket`` DDP's GradBucket or one like it (``zen.testing.LocalBucket``);
    FSDP's ``register_comm_hook`` hands its hooks a tensor, a plain call any object."""
    fix = ("register it on the DistributedDataParallel-wrapped model: "
           "ddp_model.register_comm_hook(zen.ZenState(), zen.zen_hook)")
    if not isinstance(state, state_type):
        raise TypeError(f"zen_hook: state must be a zen.ZenState; got {type(state).__name__} ({fix}; "
                        "Lightning: DDPStrategy(ddp_comm_state=zen.ZenState(), ddp_comm_hook=zen.zen_hook))")
    bucket_like = all(callable(getattr(bucket, name, None)) for name in ("buffer", "index"))
    if not bucket_like or isinstance(bucket, torch.Tensor):
        raise TypeError(f"zen_hook: bucket must be DDP's torch.distributed.GradBucket; got {type(bucket).__name__} "
                        f"(zen reduces DistributedDataParallel's buckets, not FSDP's tensors; {fix})")


@dataclass
class BucketPlan:
    """A bucket's plan: its ``layout`` when checked (numel, dtype, device, segments), whether it travels
    ``dense``, the step of its last check and how many checks it had, whether its counts said sparse
    ``may_pay``, and this rank's last measured ``seconds`` of each way ("dense", "scheme")."""

    layout: tuple
    dense: bool = True
    checked: int = 0
    checks: int = 0
    may_pay: bool = False
    seconds: dict = field(default_factory=dict)


def bucket_layout(buffer: torch.Tensor, segments: Optional[Sequence[Segment]]) -> tuple:
    return (buffer.numel(), buffer.dtype, str(buffer.device), tuple(segments or ()))


def is_due(plan: Optional[BucketPlan], layout: tuple, step: int) -> bool:
    """Whether this call of the bucket is a check: no plan yet, another layout, RECHECK_STEPS since the last,
    or sparse may pay and one of the two ways is still to be timed."""
    return (plan is None or plan.layout != layout or step - plan.checked >= RECHECK_STEPS
            or (plan.may_pay and len(plan.seconds) < 2))


def group_counts(flat: torch.Tensor, segments: Sequence[Segment]) -> List[int]:
    """This rank's counts per row-size group (ascending row size): non-zero elements and non-zero rows."""
    sizes = sorted({row for _, _, row in segments})
    counts = [0] * (2 * len(sizes))
    for offset, numel, row in segments:
        elements, rows = ops.count_nonzero(flat[offset:offset + numel], row)
        g = sizes.index(row)
        counts[2 * g] += elements
        counts[2 * g + 1] += rows
    return counts


def sparse_may_pay(counts: torch.Tensor, segments: Sequence[Segment], value_size: int) -> bool:
    """Whether a sparse sum of the groups could send at most ``SPARSE_BYTES`` of a ring all-reduce's bytes for the
    whole bucket, 2 (n-1)/n M s_v, by a lower bound of what Balanced Parallelism sends: per group,
    :func:`zen.cost.terms.balanced_bytes` with no imbalance and the pull's union the largest rank's entries,
    U = max_r k_r (gamma = U / mean_r k_r).

    ``counts``: every rank's :func:`group_counts`, [n, 2 G]. Each group of row size b and M_g elements
    travels as rows (k_r of M_g / b rows, b s_v values and an index each) where that is smaller, else as
    elements (k_r of M_g)."""
    n = counts.shape[0]
    sizes = sorted({row for _, _, row in segments})
    total = sum(numel for _, numel, _ in segments)
    sparse = 0.0
    for g, b in enumerate(sizes):
        numel = sum(m for _, m, row in segments if row == b)
        elements, rows = counts[:, 2 * g].tolist(), counts[:, 2 * g + 1].tolist()
        width = b if rows_are_smaller(sum(elements), sum(rows), b, numel, value_size) else 1
        k, entries = (rows if width > 1 else elements), numel // width
        if sum(k):
            mean = sum(k) / n
            sparse += balanced_bytes(entries, mean / entries, n, max(k) / mean, 1.0, index_size(entries),
                                     width * value_size)
    return sparse <= SPARSE_BYTES * dense_bytes(total, n, value_size)


def _micros(seconds: Optional[float]) -> int:
    return -1 if seconds is None else round(seconds * 1e6)


def check(comm: Comm, scheme, scheme_name: str, buffer: torch.Tensor, segments: Sequence[Segment], shapes: tuple,
          value_dtype: Optional[torch.dtype], hierarchy: Tuple[str, Optional[int]], plan: BucketPlan,
          dense_threshold: Optional[float] = None) -> bool:
    """One check of a bucket (on the lane): the agreement, with every rank's counts and its last measured
    seconds of each way where the scheme may send sparse; sets ``plan.dense`` (the way of the steps to come) and
    ``plan.may_pay``, and returns whether this call goes dense. Raises the same :class:`zen.MismatchError` on
    every rank where the ranks' buckets or settings differ, or any rank cannot take part.

    With ``dense_threshold``, the bucket goes dense where its mean density exceeds it, and nothing is timed.
    Else, where sparse may pay (:func:`sparse_may_pay`), the ways are timed as they run right after a check's
    agreement (the ranks in step): a way not timed yet runs first (the scheme, then dense); then the faster
    by the slowest rank's seconds, except that every fourth check runs the other way once, so that the
    figure of a way not chosen does not go stale."""
    comm.check_usable()
    header, detail = call_header(comm, Request(buffer, scheme, scheme_name, value_dtype=value_dtype,
                                               hierarchy=hierarchy))
    scheme_name = str(scheme_name)
    header[agreement.HEADER_FIELDS.index("shape")] = agreement.shape_code(shapes)
    if detail:
        agreement.report(comm, header, detail, shape=shapes, scheme_name=scheme_name)
    count = scheme_name != "dense"
    extra = (group_counts(buffer, segments) + [_micros(plan.seconds.get(w)) for w in ("dense", "scheme")]
             if count else [])
    try:
        rows = agreement.agree(comm, header, extra, shape=shapes, scheme_name=scheme_name)
    except agreement.MismatchError:
        raise
    except BaseException as error:  # noqa: B036  (the exchange itself failed: a dead peer, a timeout)
        comm.fail(error)
        raise
    plan.checks += 1
    plan.dense = _choose(plan, rows, buffer, segments, value_dtype, dense_threshold, count)
    explore = plan.may_pay and len(plan.seconds) == 2 and plan.checks % 4 == 0
    return plan.dense != explore


def _choose(plan: BucketPlan, rows: torch.Tensor, buffer: torch.Tensor, segments: Sequence[Segment],
            value_dtype: Optional[torch.dtype], dense_threshold: Optional[float], count: bool) -> bool:
    """Whether the bucket goes dense from this check on (:func:`check`); sets ``plan.may_pay``."""
    if not count:
        return True
    if dense_threshold is not None:
        return rows[:, 0:-2:2].sum().item() > dense_threshold * rows.shape[0] * buffer.numel()
    plan.may_pay = sparse_may_pay(rows[:, :-2], segments, (value_dtype or buffer.dtype).itemsize)
    dense, scheme = rows[:, -2].tolist(), rows[:, -1].tolist()
    if not plan.may_pay or min(dense + scheme) < 0:
        return not plan.may_pay or min(scheme) >= 0  # untimed: the scheme first, then dense
    return max(dense) <= max(scheme)


class BucketPlans:
    """A hook state's plans, by bucket index, and the settings they are made with: the scheme's name ("zen"
    or "dense"), the dtype values travel in, the hierarchy (setting, local_size) and the dense threshold."""

    def __init__(self, scheme_name: str, value_dtype: Optional[torch.dtype], hierarchy: Tuple[str, Optional[int]],
                 dense_threshold: Optional[float]):
        self.scheme_name, self.value_dtype = scheme_name, value_dtype
        self.hierarchy, self.dense_threshold = hierarchy, dense_threshold
        self._plans = {}

    def dense_now(self, index: int, layout: tuple, step: int) -> bool:
        """Whether the bucket's call is its one all-reduce, started at once: its plan says dense, no check due."""
        plan = self._plans.get(index)
        return plan is not None and plan.dense and not is_due(plan, layout, step)

    def dense_outcome(self, buffer: torch.Tensor, comm: Comm) -> Outcome:
        """The outcome of a bucket summed by its one all-reduce (a ring all-reduce's bytes)."""
        size = (self.value_dtype or buffer.dtype).itemsize
        return Outcome(dense=True, bytes_sent=dense_bytes(buffer.numel(), comm.world, size), hierarchy="flat")

    def run(self, comm: Comm, scheme, index: int, parameters: Optional[list], buffer: torch.Tensor, segments,
            layout: tuple, step: int) -> Outcome:
        """Bucket ``index``'s call on the lane, averaged already: a check where one is due, then its one all-reduce
        or the scheme; the plan keeps what every rank saw alike, and this rank's seconds of the way that ran."""
        plan = self._plans.get(index)
        dense = plan.dense if plan is not None else True
        if is_due(plan, layout, step):  # sets plan.dense: the way of the steps to come
            if plan is None or plan.layout != layout:
                plan = self._plans[index] = BucketPlan(layout)
            shapes = tuple(tuple(p.shape) for p in parameters or ()) or layout[3] or (buffer.numel(),)
            dense = check(comm, scheme, self.scheme_name, buffer, segments or [(0, buffer.numel(), 1)], shapes,
                          self.value_dtype, self.hierarchy, plan, self.dense_threshold)
            plan.checked = step
        start = time.perf_counter()
        if dense:
            comm.all_reduce(buffer, self.value_dtype)
            plan.seconds["dense"] = time.perf_counter() - start
            return self.dense_outcome(buffer, comm)
        outcome = HIERARCHY.run(comm, Request(buffer, scheme, self.scheme_name, segments=segments,
                                           value_dtype=self.value_dtype, hierarchy=self.hierarchy))
        plan.seconds["scheme"] = time.perf_counter() - start
        if not plan.dense:  # the scheme's way, unless this was a check's one call of it (not chosen)
            plan.dense = outcome.dense
        return outcome
