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

With top-k (``topk=zen.TopK(r)``, or ``topk_ratio=r``; dense models), each bucket is first sparsified to the
top r of each large parameter, with error feedback (:class:`zen.topk.TopK`); its small parameters are summed
dense, all in one all-reduce; the sparsified rest goes through the same scheme, which sees its density.

A :class:`ZenState` is made of parts, as GRACE separates compressor, memory and communicator: the scheme and
its settings (:class:`SchemeSettings`), the compressor with its residuals (:class:`zen.topk.TopK`), the
counters (:class:`zen.totals.Totals`) and the buckets' plans (:class:`zen.bucket_plan.BucketPlans`).
"""
import time
import warnings
from dataclasses import asdict, dataclass, fields
from operator import attrgetter
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .agreement import MismatchError, text_code
from .bucket_plan import BucketPlans, bucket_layout, bucket_segments, check_hook_call
from .collective import SCHEMES, make_scheme
from .cost.terms import dense_bytes
from .hierarchy import HIERARCHY, check_hierarchy
from .schemes.balanced import check_settings
from .schemes.base import Outcome, Request, phase_range
from .schemes.call import run_call
from .topk import TopK, check_topk_settings, settings_differ
from .totals import Totals
from .transport import check_timeout, get_comm


def check_scheme(owner: str, name, num_probes, table_factor, serial_factor, dense_threshold) -> None:
    """ValueError naming the first bad setting of a :class:`SchemeSettings`, as ``owner``'s."""
    if name not in SCHEMES:
        raise ValueError(f"{owner}: scheme must be one of {', '.join(SCHEMES)}; got {name!r}")
    check_settings(owner, num_probes, table_factor, serial_factor, dense_threshold)


@dataclass(frozen=True)
class SchemeSettings:
    """The scheme a :class:`ZenState` runs, and its settings.

    Args:
        name: one of ``zen.SCHEMES``; "zen" (default) is Balanced Parallelism.
        dense_threshold: mean density above which a bucket goes dense. None (default): decide per bucket by
            the cost formulas (``zen.cost``), with the union growth seen on that bucket before.
        num_probes, table_factor, serial_factor: the hierarchical hash's settings ("zen" only; k probes, 0 for
            an exact counting sort, None for the device's default: 3 on GPUs, 0 on CPUs; parallel memory of
            table_factor * nnz slots, serial memory of serial_factor * table slots).

    ``ZenState(scheme=SchemeSettings("zen", num_probes=0))`` is ``ZenState(scheme="zen", num_probes=0)``.
    """

    name: str = "zen"
    dense_threshold: Optional[float] = None
    num_probes: Optional[int] = None
    table_factor: float = 2.0
    serial_factor: float = 0.1

    def __post_init__(self):
        check_scheme("SchemeSettings", **asdict(self))

    def make(self):
        """The scheme instance the hook runs: "zen" with these settings and its dense switch (a call whose
        sizes say dense is cheaper goes dense after the agreement); any other the process's own."""
        if self.name != "zen":
            return make_scheme(self.name)
        return make_scheme("zen", num_probes=self.num_probes, table_factor=self.table_factor,
                           serial_factor=self.serial_factor, dense_switch=True, dense_threshold=self.dense_threshold)


# ZenState's flat keywords -> (its part that holds the setting, the setting's name there)
FLAT = {**{name: ("scheme_settings", name) for name in ("dense_threshold", "num_probes", "table_factor",
                                                        "serial_factor")},
        "topk_ratio": ("topk", "ratio"),
        **{name: ("topk", name) for name in ("warmup_steps", "error_feedback", "momentum", "min_numel", "selection",
                                             "density_ramp", "reestimate_every", "global_topk")}}


def parts_of(scheme: Union[str, SchemeSettings], topk: Optional[TopK], flat: dict) -> Tuple[SchemeSettings, TopK]:
    """The one place where :class:`ZenState`'s flat keywords (``FLAT``) become its parts: the scheme's
    :class:`SchemeSettings` (from its name and the hash's keywords) and the :class:`TopK` (from the top-k
    keywords; ``topk_ratio`` is its ``ratio``). Each is checked first in ZenState's words ("ZenState:
    topk_ratio must be ..."). A part given whole takes no keywords beside it."""
    unknown = [key for key in flat if key not in FLAT]
    if unknown:
        raise TypeError(f"ZenState.__init__() got an unexpected keyword argument {unknown[0]!r}")
    given = {"scheme_settings": {}, "topk": {}}
    for key, value in flat.items():
        part, name = FLAT[key]
        given[part][name] = value
    whole = {"scheme_settings": isinstance(scheme, SchemeSettings), "topk": topk is not None}
    twice = [key for key in flat if whole[FLAT[key][0]]]
    if twice:
        raise TypeError(f"ZenState: {', '.join(twice)} given beside the part that holds them "
                        "(scheme=SchemeSettings(...) or topk=TopK(...)); set them there")
    if not whole["scheme_settings"]:
        defaults = {f.name: f.default for f in fields(SchemeSettings)}
        check_scheme("ZenState", **dict(defaults, **given["scheme_settings"], name=scheme))
        scheme = SchemeSettings(scheme, **given["scheme_settings"])
    if not whole["topk"]:
        check_topk_settings("ZenState", given["topk"], ratio_name="topk_ratio")
        topk = TopK(**given["topk"])
    elif not isinstance(topk, TopK):
        raise TypeError(f"ZenState: topk must be None or a zen.TopK; got {type(topk).__name__}")
    return scheme, topk


class ZenState:
    """Settings and per-group state of :func:`zen_hook`, in parts: ``scheme_settings``
    (:class:`SchemeSettings`; ``scheme`` is its name), ``topk`` (the compressor, :class:`zen.topk.TopK`, with
    its residuals), ``totals`` (the counters, :class:`zen.totals.Totals`) and ``plans`` (each bucket dense or by
    the scheme, :class:`zen.bucket_plan.BucketPlans`).

    Args:
        process_group: the group to reduce over (default: the world).
        scheme: a name of ``zen.SCHEMES`` ("zen", default, is Balanced Parallelism) or a :class:`SchemeSettings`.
        topk: the top-k compressor, ``zen.TopK(r, warmup_steps=..., ...)``; None (default): from the flat
            keywords, without them off (every non-zero is sent).
        hierarchy: "node": each bucket is summed inside the node first (on the fast links), then across
            the nodes by ``scheme``, each local rank on its own shard, then gathered inside the node; "flat":
            ``scheme`` over all ranks; "auto" (default): both timed on the first steps, the faster kept (flat on
            one node or with one rank per node). Not with global top-k. (:mod:`zen.hierarchy`)
        local_size: ranks per node; None (default) finds it (``LOCAL_WORLD_SIZE``, else the hostnames).
        value_dtype: torch.float16 or torch.bfloat16: values travel in it, with or without top-k (the zen
            scheme's owners sum in the gradient's dtype; a dense all-reduce sums in it, as torch's
            ``fp16_compress_hook``). ``scheme`` "zen" or "dense" only. None (default): the gradient's dtype.
        timeout: bound on every zen collective of the group (timedelta or seconds; default: the process
            group's own timeout). A dead or stalled peer makes the hook's future (so DDP's backward) raise
            within it.
        log_every: log :meth:`summary` (logger "zen", level INFO) every that many steps; None: never.
        **flat: the parts' settings by their flat names, a convenience (:func:`parts_of`, the one place that
            maps them): :class:`SchemeSettings`'s ``dense_threshold``, ``num_probes``, ``table_factor``,
            ``serial_factor``; :class:`zen.topk.TopK`'s ``topk_ratio`` (its ``ratio``), ``warmup_steps``,
            ``error_feedback``, ``momentum``, ``min_numel``, ``selection``, ``density_ramp``,
            ``reestimate_every``, ``global_topk``. They read back as attributes: ``state.topk_ratio``.

    Example::

        state = zen.ZenState(topk=zen.TopK(0.01, warmup_steps=10))  # == zen.ZenState(topk_ratio=0.01)
        ddp_model.register_comm_hook(state, zen.zen_hook)
    """

    __slots__ = ["process_group", "scheme", "scheme_settings", "topk", "hierarchy", "local_size", "value_dtype",
                 "timeout", "totals", "plans", "last_stats", "_scheme", "_comm", "_checked", "_unpickled", "_unended",
                 "_in_backward"]
    _NOT_PICKLED = ("process_group", "plans", "_scheme", "_comm", "_unended", "_in_backward")

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, scheme: Union[str, SchemeSettings] = "zen",
                 *, topk: Optional[TopK] = None, hierarchy: str = "auto", local_size: Optional[int] = None,
                 value_dtype: Optional[torch.dtype] = None, timeout=None, log_every: Optional[int] = None, **flat):
        settings, topk = parts_of(scheme, topk, flat)
        name = settings.name
        if topk.global_topk and (topk.ratio is None or name != "zen"):
            raise ValueError("ZenState: global_topk needs topk_ratio and scheme='zen' (the partitions' owners "
                             f"select); got topk_ratio={topk.ratio!r}, scheme={name!r}")
        if value_dtype not in (None, torch.float16, torch.bfloat16) or (value_dtype and name not in ("zen", "dense")):
            raise ValueError("ZenState: value_dtype must be None, torch.float16 or torch.bfloat16, with scheme 'zen' "
                             f"or 'dense'; got value_dtype={value_dtype!r}, scheme={name!r}")
        check_hierarchy("ZenState", hierarchy, local_size)
        if topk.global_topk and hierarchy == "node":
            raise ValueError("ZenState: global_topk selects on all ranks' partitions; it does not run with "
                             "hierarchy='node'")
        check_timeout("ZenState", timeout)
        if log_every is not None and (not isinstance(log_every, int) or log_every < 1):
            raise ValueError(f"ZenState: log_every must be None or a positive int; got {log_every!r}")
        topk.claim()
        self.process_group = process_group
        self.scheme, self.scheme_settings, self.topk = name, settings, topk
        self.hierarchy = "flat" if topk.global_topk else hierarchy
        self.local_size, self.value_dtype, self.timeout = local_size, value_dtype, timeout
        self.totals = Totals(name, log_every)
        self.plans = self._new_plans()
        self.last_stats = {}
        self._scheme = self._comm = None
        self._checked = self._unpickled = False
        self._unended = []  # futures of this step's buckets, hooked inside backward, while none was is_last()
        self._in_backward = {}  # graph task id -> futures of the buckets hooked in that backward

    def _new_plans(self) -> BucketPlans:
        return BucketPlans(self.scheme, self.value_dtype, (self.hierarchy, self.local_size),
                           self.scheme_settings.dense_threshold)

    def topk_settings(self) -> dict:
        """The settings that decide what a step sends; they must be equal on every rank (checked on the first
        call) and in a checkpoint that is loaded."""
        return dict(scheme=self.scheme, **self.topk.settings(), value_dtype=str(self.value_dtype))

    def state_dict(self) -> dict:
        """What a resumed run needs to take the same next step: steps taken, residuals and momenta per
        parameter, the selection thresholds (:meth:`zen.topk.TopK.state_dict`), and the settings they belong
        to. Works with ``torch.save``.

        Parameters are named by the order the hook first saw them: DDP's first step, whose buckets follow
        the model's parameters, the same in the run that saved and the one that resumes."""
        return dict(self.topk.state_dict(), settings=self.topk_settings(), totals=self.summary(), world=self._world())

    def _world(self) -> Optional[int]:
        """The size of this state's group (None before torch.distributed is initialised)."""
        return dist.get_world_size(self.process_group) if dist.is_initialized() else None

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; its settings must equal this state's, and where it holds residuals, its
        world size this group's (a ValueError naming what differs)."""
        differ = settings_differ(state["settings"], self.topk_settings())
        if differ:
            raise ValueError("ZenState.load_state_dict: the checkpoint's settings differ: " + "; ".join(differ))
        saved, world = state.get("world"), self._world()
        if state["residuals"] and saved and world and saved != world:
            raise ValueError(f"ZenState.load_state_dict: the checkpoint's residuals are parts of gradients averaged "
                             f"over {saved} ranks; this group has {world}")
        self.totals.load(state["totals"])
        self.topk.load_state_dict(state)

    def _check_same_settings(self, comm) -> None:
        """Before the state's first call: every rank's settings, one code each, gathered; every rank raises the
        same MismatchError naming the settings that differ. (On the first call, not the first sparsified one:
        ranks that differ in whether a step is sparsified, or in the dtype values travel in, would otherwise
        start different collectives.)"""
        if self._checked:
            return
        settings = self.topk_settings()
        rows = comm.all_gather_ints([text_code(v) for v in settings.values()]).tolist()
        differ = [name for i, name in enumerate(settings) if len({row[i] for row in rows}) > 1]
        if differ:
            ranks = [r for r, row in enumerate(rows) if row != rows[0]]
            raise MismatchError(f"ZenState: ranks {ranks} differ from rank 0 in " + ", ".join(differ))
        self._checked = True

    def summary(self) -> dict:
        """This rank's totals since the state was made: ``steps`` (a step ends with its bucket that is_last(), or
        where none is, with the backward its buckets were hooked in), ``buckets``, ``bytes_sent``, ``dense_bytes``
        (what a ring all-reduce of the same buckets sends: 2 (n-1)/n x their bytes), ``schemes`` (calls per
        scheme; a block of a bucket that went dense counts as "<scheme> (dense)"), ``seconds`` (in zen's
        collectives, on the lane); with ``scheme="auto"``: ``auto_seconds`` (what it spent choosing: its
        measuring, the probe where it ran, and its trial calls whole) and ``auto_trials`` (its trial calls);
        ``bytes_vs_dense``, bytes_sent / dense_bytes, and ``last_step``, the last whole step's bytes_sent,
        dense_bytes and vs_dense."""
        return self.totals.summary()

    def _record(self, buffer: torch.Tensor, outcome: Outcome, seconds: float, last: bool) -> None:
        self.last_stats = outcome.as_stats()
        self.totals.record(buffer.numel(), buffer.element_size(), self._comm.world, outcome, seconds, last)

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
            self.totals.end_step()

    def comm(self):
        if self._comm is None:
            if self._unpickled and self.process_group is None:
                warnings.warn("ZenState was unpickled without its process group: it now uses the default group "
                              "(set state.process_group before the first step to choose another)", stacklevel=2)
            self._comm = get_comm(self.process_group, self.timeout)
        return self._comm

    def scheme_instance(self):
        if self._scheme is None:
            self._scheme = self.scheme_settings.make()
        return self._scheme

    def __getstate__(self):
        return {name: getattr(self, name) for name in self.__slots__ if name not in self._NOT_PICKLED}

    def __setstate__(self, state):
        self.process_group = self._scheme = self._comm = None
        self._unended, self._in_backward = [], {}
        for name, value in state.items():
            setattr(self, name, value)
        self.plans = self._new_plans()
        self._checked, self._unpickled = False, True


# The flat keywords read back from their parts (``state.topk_ratio`` is ``state.topk.ratio``): properties, not a
# __getattr__, which would keep CPython from specialising every other attribute read of the hook's state.
for _flat, (_part, _setting) in FLAT.items():
    setattr(ZenState, _flat, property(attrgetter(f"{_part}.{_setting}"), doc=f"``{_part}.{_setting}``"))


def _sparsified_call(state: ZenState, comm, scheme, bucket, buffer: torch.Tensor, segments, step: int) -> Outcome:
    """One top-k step of a bucket (averaged already): the compressor sparsifies its large parameters with error
    feedback and takes out its small ones (:meth:`TopK.compress`); the scheme sums the sparsified rest, one
    all-reduce the small ones; with global top-k, what the owners dropped goes back into the residuals."""
    topk = state.topk
    sent = topk.compress(bucket, buffer, segments, step)
    outcome = Outcome()
    if sent.parts:
        request = Request(buffer, scheme, state.scheme, block_size=1, keep=sent.keep, value_dtype=state.value_dtype,
                          hierarchy=(state.hierarchy, state.local_size) if sent.keep is None else None)
        if sent.keep is None:
            outcome = HIERARCHY.run(comm, request)
        else:
            outcome = run_call(comm, request)
            outcome.hierarchy = "flat"  # the owners' threshold is over the whole group
        if outcome.kept is not None and topk.error_feedback:
            outcome.figures["returned"] = topk.return_unsent(sent, outcome.kept, buffer.numel())
    if sent.dense is not None:
        comm.all_reduce(sent.dense, state.value_dtype)
        sent.write_small(buffer)
        outcome.bytes_sent += dense_bytes(sent.dense.numel(), comm.world,
                                          (state.value_dtype or sent.dense.dtype).itemsize)
    outcome.figures.update(topk_ratio=sent.ratio, sent=int(sent.indices.numel()))
    return outcome


def zen_hook(state: ZenState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the group with zen; returns a pending future of the bucket's buffer.

    Steps, alike on every rank:

    1. read the bucket: its buffer, its parameters as segments of it, whether it ends the step, the step;
    2. choose its way: top-k sparsifies it (after ``warmup_steps``; a sparse COO bucket is sent as it is);
       else, with ``scheme`` "zen" or "dense" (and ``hierarchy`` not "node"), its plan (:mod:`zen.bucket_plan`)
       decides;
    3. number its parameters (the compressor's ordinals, which key the residuals);
    4. a bucket whose plan says dense and that is not due a check is one all-reduce of its buffer on the
       user's group, as plain DDP's, started at once (where that group's timeout is not longer than the
       state's);
    5. any other bucket is a job on the group's lane: the settings' check on the first call, then top-k and
       the scheme, or the plan's check where one is due and the scheme where it says it may pay, else the one
       all-reduce;
    6. inside backward, its future is kept until backward's end, where a step without a last bucket ends and
       an error is raised whole (:meth:`ZenState._end_of_backward`).
    """
    # Step 1: the bucket.
    check_hook_call(state, ZenState, bucket)
    buffer = bucket.buffer()
    comm = state.comm()
    parameters = list(bucket.parameters()) if hasattr(bucket, "parameters") else None
    segments = bucket_segments(parameters, buffer)
    last = bucket.is_last() if hasattr(bucket, "is_last") else False
    # Read here, not on the lane: DDP waits for every bucket of a step before the next step's hooks run.
    step = state.totals.steps

    # Step 2: its way.
    topk = state.topk
    strided = buffer.layout == torch.strided
    sparsify = topk.ratio is not None and step >= topk.warmup_steps and strided
    planned = strided and not sparsify and state.scheme in ("zen", "dense") and state.hierarchy != "node"

    # Step 3: ordinals from the first step's layout, DDP's initial one.
    if parameters:
        topk.note_parameters(parameters, step)

    # Step 4: dense by its plan, on the user's group where its timeout is within ZenState(timeout=)'s.
    plans, layout = state.plans, bucket_layout(buffer, segments)
    stream = torch.cuda.current_stream(buffer.device) if buffer.is_cuda else None
    if planned and comm.user_group_in_time() and plans.dense_now(bucket.index(), layout, step):
        start = time.perf_counter()
        with phase_range(state.scheme, "dense_bucket"):  # its start only: the all-reduce runs in the backend
            buffer.div_(comm.world)
            # seconds from the start: they include waiting for the ranks' backward to meet
            future = comm.all_reduce_async(buffer, state.value_dtype, stream, lambda: state._record(
                buffer, plans.dense_outcome(buffer, comm), time.perf_counter() - start, last))

    # Step 5: a job on the lane.
    else:
        scheme = state.scheme_instance()

        def job():
            start = time.perf_counter()
            state._check_same_settings(comm)
            buffer.div_(comm.world)  # divide before summing: no fp16 overflow, same as DDP's own allreduce
            with phase_range(state.scheme, "bucket"):
                if sparsify:
                    outcome = _sparsified_call(state, comm, scheme, bucket, buffer, segments, step)
                elif planned:
                    outcome = plans.run(comm, scheme, bucket.index(), parameters, buffer, segments, layout, step)
                else:
                    outcome = HIERARCHY.run(comm, Request(buffer, scheme, state.scheme, segments=segments,
                                                       value_dtype=state.value_dtype,
                                                       hierarchy=(state.hierarchy, state.local_size)))
            state._record(buffer, outcome, time.perf_counter() - start, last)
            return buffer

        future = comm.submit(job, stream)

    # Step 6: inside backward, the step's bookkeeping at its end.
    task = torch._C._current_graph_task_id()
    if task != -1:
        state._unended = [] if last else state._unended + [future]
        if task not in state._in_backward:  # one callback per backward, for all its buckets
            state._in_backward[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(lambda: state._end_of_backward(task))
        state._in_backward[task].append(future)
    return future
