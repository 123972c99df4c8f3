"""The DDP communication hook: ``ddp_model.register_comm_hook(zen.ZenState(), zen.zen_hook)``.

Each gradient bucket is averaged and summed over the group, and the hook returns the pending future at
once, so communication overlaps the rest of backward. A bucket whose plan says dense (:mod:`zen.bucket_plan`)
is one all-reduce of its buffer on the user's group, as plain DDP's; any other runs a zen scheme on the
group's lane (a worker thread). Both keep DDP's bucket order, the same on every rank.

Where a bucket goes by the scheme, the hook finds rows without being told: each parameter of a bucket is a segment of the bucket's buffer
whose row size is its trailing dims (an embedding [V, D]: rows of D; a bias: elements). Per call and per
row size, rows or elements are chosen alike on every rank (``zen.schemes.call.reduce_segments``), and the
segments of one block size are reduced together, so a bucket's rounds of collectives grow with its
number of distinct row sizes, not of parameters. A sparse gradient (``nn.Embedding(sparse=True)``)
travels as rows of its dense dims.

With ``topk_ratio=r`` (dense models), each bucket is first sparsified to the top r of each large
parameter, with error feedback (:mod:`zen.topk`); its small parameters are summed dense, all in one
all-reduce; the sparsified rest goes through the same scheme, which sees its density.
"""
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from . import topk
from .agreement import MismatchError, text_code
from .bucket_plan import BucketPlans, bucket_layout, bucket_segments, check_hook_call
from .collective import SCHEMES, make_scheme
from .cost.terms import dense_bytes
from .hierarchy import POLICY, check_hierarchy
from .schemes.balanced import check_settings
from .schemes.base import phase_range
from .schemes.call import run_call
from .totals import Totals
from .transport import check_timeout, get_comm


class ZenState:
    """Settings and per-group state of :func:`zen_hook`.

    Args:
        process_group: the group to reduce over (default: the world).
        scheme: one of ``zen.SCHEMES``; "zen" is Balanced Parallelism.
        dense_threshold: mean density above which a bucket goes dense. None (default): decide per
            bucket by the cost formulas (``zen.cost``), with the union growth seen on that bucket before.
        num_probes, table_factor, serial_factor: the hierarchical hash's settings (k probes, 0 for an
            exact counting sort, None for the device's default: 3 on GPUs, 0 on CPUs; parallel
            memory of table_factor * nnz slots, serial memory of serial_factor * table slots).
        timeout: bound on every zen collective of the group (timedelta or seconds; default: the process
            group's own timeout). A dead or stalled peer makes the hook's future (so DDP's backward) raise
            within it.
        log_every: log :meth:`summary` (logger "zen", level INFO) every that many steps; None: never.

    Top-k sparsification (dense models; :mod:`zen.topk` has the maths):
        topk_ratio: None (default): send every non-zero. r in (0, 1]: each parameter of at least
            ``min_numel`` elements sends its top ceil(r numel) entries by magnitude; smaller ones stay dense.
        warmup_steps: the first steps run without sparsification; an int >= 2, as DDP rebuilds its buckets
            after the first step and residuals are kept per bucket (torch's PowerSGD hook has the same rule).
        error_feedback: keep what was not sent and add it to the next step's gradient (default True).
        momentum: DGC's momentum correction with this factor (then use SGD without momentum); None: off.
        min_numel: parameters below this many elements stay dense (default 4096).
        selection: "exact" (top-k), "sampled" (a threshold from a 1% sample, reused for
            ``reestimate_every`` steps) or "auto" (default: sampled from 2**20 elements).
        density_ramp: over this many steps after the warm-up, the ratio falls from 1 to topk_ratio
            exponentially (DGC's warm-up); None: topk_ratio at once.
        global_topk: after the push, each partition's owner keeps only its top k/n sums (Ok-Topk's
            global top-k; ``scheme="zen"`` only), so the pull stays O(k); entries that did not survive go back
            into the sender's residual.
        value_dtype: torch.float16 or torch.bfloat16: values travel in it, with or without top-k (the zen
            scheme's owners sum in the gradient's dtype; a dense all-reduce sums in it, as torch's
            ``fp16_compress_hook``). ``scheme`` "zen" or "dense" only. None (default): the gradient's dtype.

    Multi-rank nodes (:mod:`zen.hierarchy`):
        hierarchy: "node": each bucket is summed inside the node first (on the fast links), then across
            the nodes by ``scheme``, each local rank on its own shard, then gathered inside the node; "flat":
            ``scheme`` over all ranks; "auto" (default): both timed on the first steps, the faster kept (flat on
            one node or with one rank per node). Not with ``global_topk``.
        local_size: ranks per node; None (default) finds it (``LOCAL_WORLD_SIZE``, else the hostnames).
    """

    __slots__ = ["process_group", "scheme", "dense_threshold", "num_probes", "table_factor", "serial_factor",
                 "timeout", "log_every", "topk_ratio", "warmup_steps", "error_feedback", "momentum", "min_numel",
                 "selection", "density_ramp", "reestimate_every", "global_topk", "value_dtype", "hierarchy",
                 "local_size", "_scheme", "_comm", "last_stats",
                 "_totals", "_residuals", "_ordinals", "_layouts", "_plans", "_selector", "_checked", "_unpickled", "_unended",
                 "_in_backward", "_first_step", "_warned_models"]

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, scheme: str = "zen",
                 dense_threshold: Optional[float] = None, num_probes: Optional[int] = None, table_factor: float = 2.0,
                 serial_factor: float = 0.1, timeout=None, log_every: Optional[int] = None,
                 topk_ratio: Optional[float] = None, warmup_steps: int = 10, error_feedback: bool = True,
                 momentum: Optional[float] = None, min_numel: int = 4096, selection: str = "auto",
                 density_ramp: Optional[int] = None, reestimate_every: int = 16, global_topk: bool = False,
                 value_dtype: Optional[torch.dtype] = None, hierarchy: str = "auto",
                 local_size: Optional[int] = None):
        if scheme not in SCHEMES:
            raise ValueError(f"ZenState: scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
        check_settings("ZenState", num_probes, table_factor, serial_factor, dense_threshold)
        topk.check_topk_settings("ZenState", topk_ratio, warmup_steps, momentum, min_numel, selection,
                                 density_ramp, reestimate_every)
        if global_topk and (topk_ratio is None or scheme != "zen"):
            raise ValueError("ZenState: global_topk needs topk_ratio and scheme='zen' (the partitions' owners "
                             f"select); got topk_ratio={topk_ratio!r}, scheme={scheme!r}")
        if value_dtype not in (None, torch.float16, torch.bfloat16) or (value_dtype and scheme not in ("zen", "dense")):
            raise ValueError("ZenState: value_dtype must be None, torch.float16 or torch.bfloat16, with scheme 'zen' "
                             f"or 'dense'; got value_dtype={value_dtype!r}, scheme={scheme!r}")
        check_hierarchy("ZenState", hierarchy, local_size)
        if global_topk and hierarchy == "node":
            raise ValueError("ZenState: global_topk selects on all ranks' partitions; it does not run with "
                             "hierarchy='node'")
        check_timeout("ZenState", timeout)
        if log_every is not None and (not isinstance(log_every, int) or log_every < 1):
            raise ValueError(f"ZenState: log_every must be None or a positive int; got {log_every!r}")
        self.process_group = process_group
        self.scheme = scheme
        self.dense_threshold = dense_threshold
        self.num_probes = num_probes
        self.table_factor = table_factor
        self.serial_factor = serial_factor
        self.timeout = timeout
        self.log_every = log_every
        self.topk_ratio = topk_ratio
        self.warmup_steps = warmup_steps
        self.error_feedback = bool(error_feedback)
        self.momentum = momentum
        self.min_numel = min_numel
        self.selection = selection
        self.density_ramp = density_ramp
        self.reestimate_every = reestimate_every
        self.global_topk = bool(global_topk)
        self.value_dtype = value_dtype
        self.hierarchy = "flat" if global_topk else hierarchy
        self.local_size = local_size
        self._comm = None
        self._scheme = None
        self.last_stats = {}
        self._totals = Totals(scheme, log_every)
        self._residuals = {}  # parameter ordinal (or bucket place) -> topk.Residual
        self._ordinals = WeakIdKeyDictionary()  # parameter -> its ordinal: the order the hook first saw it
        self._layouts = {}  # bucket index -> its segments, where its parameters are not known
        self._plans = None  # BucketPlans: each bucket dense or by the scheme (zen.bucket_plan)
        self._selector = topk.Selector(selection, reestimate_every=reestimate_every)
        self._checked = False
        self._unpickled = False
        self._unended = []  # futures of this step's buckets, hooked inside backward, while none was is_last()
        self._in_backward = {}  # graph task id -> futures of the buckets hooked in that backward
        self._first_step = None  # the step on which this process's hook first saw parameters
        self._warned_models = False

    def topk_settings(self) -> dict:
        """The settings that decide what a step sends; they must be equal on every rank (checked on the first
        sparsified step) and in a checkpoint that is loaded."""
        return dict(scheme=self.scheme, topk_ratio=self.topk_ratio, warmup_steps=self.warmup_steps,
                    error_feedback=self.error_feedback, momentum=self.momentum, min_numel=self.min_numel,
                    selection=self.selection, density_ramp=self.density_ramp,
                    reestimate_every=self.reestimate_every, global_topk=self.global_topk,
                    value_dtype=str(self.value_dtype))

    def state_dict(self) -> dict:
        """What a resumed run needs to take the same next step: steps taken, residuals and momenta per
        parameter, the selection thresholds, and the settings they belong to. Works with ``torch.save``.

        Parameters are named by the order the hook first saw them: DDP's first step, whose buckets follow
        the model's parameters, the same in the run that saved and the one that resumes."""
        residuals = {key: dict(numel=r.numel, error=r.error, momentum=r.momentum)
                     for key, r in self._residuals.items()}
        return dict(settings=self.topk_settings(), totals=self.summary(), residuals=residuals,
                    selector=self._selector.state_dict(), world=self._world())

    def _world(self) -> Optional[int]:
        """The size of this state's group (None before torch.distributed is initialised)."""
        return dist.get_world_size(self.process_group) if dist.is_initialized() else None

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; its settings must equal this state's, and where it holds residuals, its
        world size this group's (a ValueError naming what differs)."""
        differ = [f"{k} (checkpoint {v!r}, here {self.topk_settings()[k]!r})"
                  for k, v in state["settings"].items() if self.topk_settings().get(k) != v]
        if differ:
            raise ValueError("ZenState.load_state_dict: the checkpoint's settings differ: " + "; ".join(differ))
        saved, world = state.get("world"), self._world()
        if state["residuals"] and saved and world and saved != world:
            raise ValueError(f"ZenState.load_state_dict: the checkpoint's residuals are parts of gradients averaged "
                             f"over {saved} ranks; this group has {world}")
        self._totals.load(state["totals"])
        self._residuals = {key: topk.Residual(**r) for key, r in state["residuals"].items()}
        self._selector.load_state_dict(state["selector"])

    def _check_same_settings(self, comm) -> None:
        """Before the state's first call: every rank's settings, one code each, gathered; every rank raises the
        same MismatchError naming the settings that differ. (On the first call, not the first sparsified one:
        ranks that differ in whether a step is sparsified, or in the dtype values travel in, would otherwise
        start different collectives.)"""
        if self._checked:
            return
        settings = self.topk_settings()
        rows = comm.all_gather_rows([text_code(v) for v in settings.values()]).tolist()
        differ = [name for i, name in enumerate(settings) if len({row[i] for row in rows}) > 1]
        if differ:
            ranks = [r for r, row in enumerate(rows) if row != rows[0]]
            raise MismatchError(f"ZenState: ranks {ranks} differ from rank 0 in " + ", ".join(differ))
        self._checked = True

    def _ordinal(self, parameter: torch.Tensor) -> int:
        """The parameter's ordinal: the order in which the hook first saw it."""
        if parameter not in self._ordinals:
            self._ordinals[parameter] = len(self._ordinals)
        return self._ordinals[parameter]

    def _note_parameters(self, parameters, step: int) -> None:
        """Number a bucket's parameters (:meth:`_ordinal`). DDP hooks every bucket of its model on every step,
        so all of them are seen on the state's first step here: one first seen on a later step is another
        model's. A state counts one model's steps (top-k's warm-up and ramp follow them): with top-k that is
        a ValueError, without it a warning (the sums are right; summary() counts both models' steps)."""
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
                if self.topk_ratio is not None:
                    raise ValueError(message + ": top-k's warm-up and ramp count the state's steps")
                self._warned_models = True
                warnings.warn(message + ": summary() counts the steps of all of them", RuntimeWarning, stacklevel=3)
            self._ordinal(parameter)

    def _parts(self, bucket, buffer: torch.Tensor, segments, large) -> tuple:
        """(parts, keys) of the bucket's large segments: each with its residual, kept per parameter (by
        ordinal), or per place in the bucket where its parameters are unknown (dropped with a warning when
        that bucket's layout changes). A residual whose size no longer fits is dropped with a warning."""
        parameters = list(bucket.parameters()) if hasattr(bucket, "parameters") else []
        known = len(parameters) == len(segments) and all(p.numel() == s[1] for p, s in zip(parameters, segments))
        ordinals = [self._ordinal(p) for p in parameters] if known else None
        if not known and self._layouts.setdefault(bucket.index(), segments) != segments:
            warnings.warn(f"ZenState: bucket {bucket.index()} changed its layout; its residuals are dropped, "
                          "never applied to other parameters", stacklevel=3)
            self._residuals = {k: r for k, r in self._residuals.items()
                               if not (isinstance(k, tuple) and k[1] == bucket.index())}
            self._layouts[bucket.index()] = segments
        parts, keys = [], []
        for i in large:
            segment = segments[i]
            key = ordinals[i] if known else ("bucket", bucket.index(), segment[0])
            kept = self._residuals.get(key)
            if kept is not None and kept.numel != segment[1]:
                warnings.warn(f"ZenState: the residual kept for {key} has {kept.numel} elements, its parameter "
                              f"{segment[1]}: dropped, never applied", stacklevel=3)
                kept = None
            if kept is None:
                kept = self._residuals[key] = topk.Residual(segment[1])
            parts.append((segment, kept.to(buffer.device)))
            keys.append(key)
        return parts, keys

    def summary(self) -> dict:
        """This rank's totals since the state was made: ``steps`` (a step ends with its bucket that is_last(), or
        where none is, with the backward its buckets were hooked in), ``buckets``, ``bytes_sent``, ``dense_bytes``
        (what a ring all-reduce of the same buckets sends: 2 (n-1)/n x their bytes), ``schemes`` (calls per
        scheme; a block of a bucket that went dense counts as "<scheme> (dense)"), ``seconds`` (in zen's
        collectives, on the lane); with ``scheme="auto"``: ``auto_seconds`` (what it spent choosing: its
        measuring, the probe where it ran, and its trial calls whole) and ``auto_trials`` (its trial calls);
        ``bytes_vs_dense``, bytes_sent / dense_bytes, and ``last_step``, the last whole step's bytes_sent,
        dense_bytes and vs_dense."""
        return self._totals.summary()

    def _record(self, buffer: torch.Tensor, stats: dict, seconds: float, last: bool) -> None:
        self.last_stats = stats
        self._totals.record(buffer.numel(), buffer.element_size(), self._comm.world, stats, seconds, last)

    def _end_of_backward(self, task: int) -> None:
        """The callback of a backward (graph task ``task``) in which buckets were hooked, run at its end (after
        DDP has called every bucket's hook). It waits for those buckets' futures and so raises an error whole:
        DDP's reducer reads a failed future's value as a tensor ("Unable to cast <the error> to Tensor"),
        losing the error's type.

        A step ends with its bucket that is_last(), but DDP's first ``static_graph`` iteration hands every
        bucket as index 0, none last: such a step ends here, at the end of the outermost backward (where no
        autograd node runs; a reentrant checkpoint's backward is nested in one), once its buckets are done."""
        for future in self._in_backward.pop(task, ()):
            future.wait()
        if self._unended and torch._C._current_autograd_node() is None:
            for pending in self._unended:
                pending.wait()
            self._unended = []
            self._totals.end_step()

    def plans(self) -> BucketPlans:
        """The buckets' plans (:mod:`zen.bucket_plan`), made on first use from the settings."""
        if self._plans is None:
            self._plans = BucketPlans(self.scheme, self.value_dtype, (self.hierarchy, self.local_size),
                                      self.dense_threshold)
        return self._plans

    def comm(self):
        if self._comm is None:
            if self._unpickled and self.process_group is None:
                warnings.warn("ZenState was unpickled without its process group: it now uses the default group "
                              "(set state.process_group before the first step to choose another)", stacklevel=2)
            self._comm = get_comm(self.process_group, self.timeout)
        return self._comm

    def scheme_instance(self):
        if self._scheme is None:
            settings = {}
            if self.scheme == "zen":
                settings = dict(num_probes=self.num_probes, table_factor=self.table_factor,
                                serial_factor=self.serial_factor, dense_switch=True,
                                dense_threshold=self.dense_threshold)
            self._scheme = make_scheme(self.scheme, **settings)
        return self._scheme

    def __getstate__(self):
        return {name: getattr(self, name) for name in self.__slots__
                if name not in ("process_group", "_comm", "_scheme", "_ordinals", "_plans", "_unended", "_in_backward",
                                "_first_step")}

    def __setstate__(self, state):
        self.process_group = None
        self._comm = None
        self._scheme = None
        self.log_every = None
        self._totals = Totals(state.get("scheme", "zen"))
        self._ordinals = WeakIdKeyDictionary()
        self._plans = None
        self._unended, self._in_backward = [], {}
        self._first_step, self._warned_models = None, False
        self.hierarchy, self.local_size = "auto", None  # (a state pickled before these settings)
        for name, value in state.items():
            setattr(self, name, value)
        self._checked = False
        self._unpickled = True


def _sparsified_call(state: ZenState, comm, scheme, bucket, buffer: torch.Tensor, segments, step: int,
                     stats: dict) -> None:
    """One top-k step of a bucket (averaged already): sparsify its large parameters with error feedback, sum
    its small ones dense in one all-reduce, and the rest with the scheme."""
    segments = segments or [(0, buffer.numel(), 1)]
    large, small = topk.split_segments(segments, state.min_numel)
    parts, keys = state._parts(bucket, buffer, segments, large)
    small = [segments[i] for i in small]
    ratio = topk.ramped_ratio(state.topk_ratio, state.warmup_steps, state.density_ramp, step)
    sent_idx, sent_val = topk.sparsify(buffer, parts, ratio, state._selector, step, keys, state.error_feedback,
                                       state.momentum)
    dense = torch.cat([buffer[o:o + n] for o, n, _ in small]) if small else None
    for o, n, _ in small:
        buffer[o:o + n].zero_()
    if large:
        # Global top-k: the owners keep the k (summed over the parameters, alike on every rank) largest sums.
        keep = sum(topk.keep_count(ratio, s[1]) for s, _ in parts) if state.global_topk else None
        if keep is None:
            POLICY.run(comm, buffer, scheme, state.scheme, stats, block_size=1, value_dtype=state.value_dtype,
                       hierarchy=state.hierarchy, local_size=state.local_size)
        else:
            run_call(comm, buffer, scheme, state.scheme, stats, block_size=1, keep=keep, value_dtype=state.value_dtype)
            stats["hierarchy"] = "flat"  # the owners' threshold is over the whole group
        reached = stats.pop("kept", None)
        if reached is not None and state.error_feedback:
            stats["returned"] = topk.return_unsent(parts, sent_idx, sent_val, reached, buffer.numel())
    if dense is not None:
        comm.all_reduce(dense, state.value_dtype)
        for (o, n, _), part in zip(small, dense.split([n for _, n, _ in small])):
            buffer[o:o + n].copy_(part)
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + dense_bytes(
            dense.numel(), comm.world, (state.value_dtype or dense.dtype).itemsize)
    stats.update(topk_ratio=ratio, sent=int(sent_idx.numel()))


def zen_hook(state: ZenState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the group with zen; returns a pending future of the bucket's buffer.

    Steps, alike on every rank:

    1. a bucket that top-k sparsifies (after ``warmup_steps``) goes to its scheme, its small parameters dense;
    2. with ``scheme`` "zen" or "dense" (and ``hierarchy`` not "node"), a bucket whose plan says dense
       (:mod:`zen.bucket_plan`) and that is not due a check is one all-reduce of its buffer on the user's
       group, as plain DDP's, started at once (where that group's timeout is not longer than the state's);
    3. any other bucket is a job on the group's lane: a check where one is due, then the scheme where the
       check (or the plan) says it may pay, else the one all-reduce.
    """
    check_hook_call(state, ZenState, bucket)
    buffer = bucket.buffer()
    comm = state.comm()
    parameters = list(bucket.parameters()) if hasattr(bucket, "parameters") else None
    segments = bucket_segments(parameters, buffer)
    last = bucket.is_last() if hasattr(bucket, "is_last") else False
    # Read here, not on the lane: DDP waits for every bucket of a step before the next step's hooks run.
    step = state._totals.steps
    # A sparse (COO) bucket is sparse already: it is sent as it is.
    strided = buffer.layout == torch.strided
    sparsify = state.topk_ratio is not None and step >= state.warmup_steps and strided
    planned = strided and not sparsify and state.scheme in ("zen", "dense") and state.hierarchy != "node"
    if parameters:  # ordinals from the first step's layout, DDP's initial one
        state._note_parameters(parameters, step)
    plans, layout = state.plans(), bucket_layout(buffer, segments)
    stream = torch.cuda.current_stream(buffer.device) if buffer.is_cuda else None
    # On the user's group only where its timeout is within ZenState(timeout=)'s; else on the lane, as below.
    if planned and comm.user_group_in_time() and plans.dense_now(bucket.index(), layout, step):
        start = time.perf_counter()
        with phase_range(state.scheme, "dense_bucket"):  # its start only: the all-reduce runs in the backend
            buffer.div_(comm.world)
            # seconds from the start: they include waiting for the ranks' backward to meet
            future = comm.all_reduce_async(buffer, state.value_dtype, stream, lambda: state._record(
                buffer, plans.dense_stats(buffer, comm), time.perf_counter() - start, last))
    else:
        scheme = state.scheme_instance()

        def job():
            start = time.perf_counter()
            stats = {}
            state._check_same_settings(comm)
            buffer.div_(comm.world)  # divide before summing: no fp16 overflow, same as DDP's own allreduce
            with phase_range(state.scheme, "bucket"):
                if sparsify:
                    _sparsified_call(state, comm, scheme, bucket, buffer, segments, step, stats)
                elif planned:
                    plans.run(comm, scheme, bucket.index(), parameters, buffer, segments, layout, step, stats)
                else:
                    POLICY.run(comm, buffer, scheme, state.scheme, stats, segments=segments,
                               value_dtype=state.value_dtype, hierarchy=state.hierarchy, local_size=state.local_size)
            state._record(buffer, stats, time.perf_counter() - start, last)
            return buffer

        future = comm.submit(job, stream)
    task = torch._C._current_graph_task_id()
    if task != -1:  # inside backward
        state._unended = [] if last else state._unended + [future]
        if task not in state._in_backward:  # one callback per backward, for all its buckets
            state._in_backward[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(lambda: state._end_of_backward(task))
        state._in_backward[task].append(future)
    return future
