"""Multi-rank nodes: summed inside a node first, sparse across nodes (``hierarchy="node"``), the flat protocol
(``"flat"``), or whichever runs faster (``"auto"``).

With N nodes of G ranks (:mod:`zen.topology`), a node call on a tensor of M values runs three steps:

    1 reduce-scatter inside the node: local rank l receives shard l (M/G values, cut at row boundaries) of
      every rank of its node and sums them; (G-1)/G M s_v bytes per rank over the node's fast links
    2 local rank l all-reduces its shard with the chosen scheme across the nodes, over cross group l (one
      rank per node); the G cross groups run at once, so every rank's network card is busy. The scheme sees
      the density after the node's sum, so its dense switch decides on that
    3 all-gather inside the node: every rank receives the G summed shards; (G-1)/G M s_v bytes per rank

A sparse COO tensor (``nn.Embedding(sparse=True)``) stays sparse: step 1 sends each rank's rows of shard l to
local rank l, which sums them; step 2 reduces the shard's rows; step 3 gathers the summed rows.

Across the network a node sends its shards' union instead of its G ranks' entries: where the ranks of a node
share indices (the same words in a batch) the node sends fewer bytes, and each rank pulls only 1/G of the
union. What a node call costs beyond the cross step is the two steps on the fast links: dense (s_v M bytes
per rank in all), or sparse (each rank's entries, then the summed shards' entries) where the node's entries
take fewer bytes than the tensor (:class:`Scan`, :func:`zen.cost.terms.node_phases`).

Errors as in the flat call: bad input on any rank makes every rank raise a :class:`zen.MismatchError`. The
node's agreement (on its fast links) comes first; a node that fails it reports to the other nodes in the
cross step's agreement, where they raise too. Every rank must use the same ``hierarchy`` and ``local_size``:
the first call that looks for the nodes does so in an agreement on the whole group, where a rank that runs
flat (or with another setting) meets it, and every rank raises :class:`zen.MismatchError` naming them. Once
the nodes are known, a rank that changes its setting alone starts on other groups than its peers: they wait
on each other until the group's timeout, then raise :class:`zen.PeerError`.

``"auto"`` times both: on the first calls of each (group, tensor size) the node and the flat protocol take
turns (``trials`` calls each, every call timed from the last rank's start to the last one's end and the
times exchanged, so every rank picks alike) and the smaller median wins; it is timed again every ``recheck``
calls. It runs flat where there is nothing to gain (one node, or one rank per node) and, with a warning,
where nodes differ in size.
"""
import re
import statistics
import threading
import time
import warnings
from typing import Optional, Sequence

import torch

from . import agreement, ops
from .agreement import HIERARCHIES, MismatchError, Problem
from .measurement.timing import call_seconds, clock_id
from .schemes.base import phase_range
from .schemes.call import Segment, call_header, decide_rows, run_call, scan_rows, segment_entries
from .hierarchy_coo import node_sparse
from .hierarchy_strided import node_strided, shard_segments
from .topology import Topology, detect, node_comms
from .transport import Comm

def check_hierarchy(owner: str, hierarchy, local_size) -> None:
    """A ValueError naming the setting, where ``hierarchy`` or ``local_size`` is not allowed."""
    if hierarchy not in HIERARCHIES:
        raise ValueError(f"{owner}: hierarchy must be one of {', '.join(map(repr, HIERARCHIES))}; got {hierarchy!r}")
    if local_size is not None and (not isinstance(local_size, int) or isinstance(local_size, bool) or local_size < 1):
        raise ValueError(f"{owner}: local_size must be None or a positive int; got {local_size!r}")


def shard_bounds(segments: Sequence[Segment], parts: int) -> list:
    """``parts`` + 1 offsets cutting the flat tensor of ``segments`` into nearly equal shards, each cut moved
    down to a row boundary of the segment it falls in (so no row of b values is split between shards)."""
    total = sum(numel for _, numel, _ in segments)
    bounds = []
    for j in range(parts + 1):
        target = j * total // parts
        for offset, numel, row in segments:
            if offset <= target < offset + numel:
                target = offset + (target - offset) // row * row
                break
        bounds.append(target)
    return bounds


class _Trials:
    __slots__ = ("calls", "times", "choice")

    def __init__(self):
        self.calls, self.times, self.choice = 0, {"node": [], "flat": []}, None


class Hierarchy:
    """Runs calls flat or by nodes, and keeps what ``"auto"`` measured. One per process (:data:`POLICY`)."""

    def __init__(self, trials: int = 3, recheck: int = 100):
        self.trials, self.recheck = trials, recheck
        self._topologies = {}  # (comm, local_size) -> Topology
        self._trials = {}  # (comm, topology, tensor key) -> _Trials
        self._warned = set()
        self._lock = threading.Lock()

    def topology(self, comm: Comm, local_size: Optional[int], agreement_of=None) -> Topology:
        """``comm``'s nodes, found on first use (collective; a failure there breaks the group on this rank).
        ``agreement_of``: a function giving the (header, detail, shape, scheme name) of the call that needs them,
        for the agreement that finds them (:func:`zen.topology.detect`)."""
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

    def run(self, comm: Comm, tensor, scheme, scheme_name=None, stats: Optional[dict] = None,
            allowed: Sequence[str] = (), block_size: Optional[int] = None,
            segments: Optional[Sequence[Segment]] = None, hierarchy: str = "auto", local_size: Optional[int] = None,
            value_dtype: Optional[torch.dtype] = None):
        """One all-reduce on ``comm``'s lane, flat (:func:`zen.schemes.call.run_call`) or by nodes, as ``hierarchy``
        says; the arguments as run_call's. ``stats`` gets "hierarchy" (what ran) besides the scheme's."""
        setting = (hierarchy, local_size)
        if hierarchy == "flat" or comm.world == 1:
            run_call(comm, tensor, scheme, scheme_name, stats, allowed, block_size, segments, value_dtype=value_dtype,
                     hierarchy=setting)
            if stats is not None:
                stats["hierarchy"] = "flat"
            return tensor
        topology = self.topology(comm, local_size,
                                 lambda: call_header(comm, tensor, scheme, scheme_name, allowed, block_size, setting,
                                                     value_dtype))
        mode = self._mode(comm, topology, hierarchy)
        key = (comm, topology.nodes, _tensor_key(tensor), block_size)
        trial = None
        if mode == "auto":
            mode, trial = self._next(key)
        start = time.perf_counter()
        if mode == "flat":
            run_call(comm, tensor, scheme, scheme_name, stats, allowed, block_size, segments, value_dtype=value_dtype,
                     hierarchy=setting)
        else:
            node_call(comm, topology, tensor, scheme, scheme_name, stats, allowed, block_size, segments, value_dtype,
                      setting)
        if stats is not None:
            stats["hierarchy"] = mode
        if trial is not None:
            self._timed(comm, key, mode, start, stats)
        return tensor

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

    def _timed(self, comm: Comm, key, mode: str, start: float, stats: Optional[dict]) -> None:
        """Record a trial call's time on the group (the same on every rank); after the last, pick."""
        end = time.perf_counter()
        with phase_range("hierarchy", "trial_time"):
            rows = comm.all_gather_rows([clock_id(), round(start * 1e9), round(end * 1e9)]).tolist()
        seconds = call_seconds([row[1:2] for row in rows], [row[2:3] for row in rows], [row[0] for row in rows])[0] / 1e9
        history = self._trials[key]
        history.times[mode].append(seconds)
        if all(len(t) == self.trials for t in history.times.values()):
            medians = {m: statistics.median(t) for m, t in history.times.items()}
            history.choice = min(("node", "flat"), key=medians.get)
            if stats is not None:
                stats["hierarchy_medians"] = medians

    def choice(self, comm: Comm, tensor, block_size: Optional[int] = None, local_size: Optional[int] = None):
        """What ``"auto"`` picked for calls like this one on ``comm`` ("node" or "flat"; None while timing)."""
        topology = self._topologies.get((comm, local_size))
        history = self._trials.get((comm, topology.nodes if topology else None, _tensor_key(tensor), block_size))
        return history.choice if history else None


def _tensor_key(tensor) -> tuple:
    if not isinstance(tensor, torch.Tensor):
        return ()
    return (tuple(tensor.shape), tensor.dtype, tensor.layout)


POLICY = Hierarchy()


def node_call(comm: Comm, topology: Topology, tensor, scheme, scheme_name, stats, allowed, block_size, segments,
              value_dtype, setting) -> None:
    """The three steps of the module docstring, for ``comm``'s rank in ``topology`` (equal nodes); ``setting``:
    the call's (hierarchy, local_size), for its agreements."""
    intra, cross = node_comms(comm, topology)
    for sub in (intra, cross):
        sub.check_usable()
    header, detail, shape, name = call_header(comm, tensor, scheme, scheme_name, allowed, block_size, setting,
                                              value_dtype)
    node = topology.node_of(comm.rank)
    scan = None
    if not detail and tensor.layout == torch.strided and tensor.numel():
        try:
            with phase_range(name, "node_scan"):
                scan = Scan(tensor, segments, block_size)
        except Exception as error:  # told to the node in its agreement, so every rank raises alike
            header[-1] = Problem.FAILED_BEFORE_EXCHANGE
            detail = f"{type(error).__name__}: {error}"
    try:
        with phase_range(name, "intra_agree"):
            rows = agreement.agree(intra, header, scan.counts if scan else [], detail, shape, name)
    except MismatchError as error:
        # This node cannot go on; the other nodes learn it in their cross step's agreement, whose row holds a
        # short text (n + 8 int64s): the message without its preamble and the explanations in parentheses.
        text = _group_ranks(str(error).removeprefix("zen.all_reduce: ").removeprefix(_DIFFER), topology, node)
        text = re.sub(r" \([^()]*[a-z][^()]*\)", "", text)  # the same text on every node, where it fits
        forwarded = list(header)
        forwarded[-1] = Problem.FAILED_BEFORE_EXCHANGE
        try:
            agreement.report(cross, forwarded, f"node {node}: {text}", shape=shape, scheme_name=name)
        except MismatchError:
            pass
        raise MismatchError(f"zen.all_reduce: on node {node}: {text}") from None
    except BaseException as error:  # noqa: B036  (the exchange itself failed)
        intra.fail(error)
        comm.fail(error)
        raise
    cross_stats = {}
    start = time.perf_counter()
    try:
        with torch.no_grad():
            if tensor.layout == torch.sparse_coo:
                phases = node_sparse(intra, cross, tensor, scheme, name, cross_stats, allowed, block_size, setting)
            elif scan is None:  # nothing to sum: the cross step's agreement still checks every node
                run_call(cross, tensor, scheme, name, cross_stats, allowed, block_size, whole=tensor, hierarchy=setting)
                phases = dict(intra_bytes=0)
            else:
                scan.plan(rows, intra.world)
                phases = node_strided(intra, cross, tensor, scan, scheme, name, cross_stats, allowed, block_size,
                                      value_dtype, setting)
    except MismatchError as error:  # raised by the cross step's agreement, alike on every rank
        raise MismatchError(_cross_text(str(error), topology)) from None
    except BaseException as error:  # noqa: B036  (part-way: the ranks are out of step)
        for sub in (intra, cross, comm):
            sub.fail(error)
        raise
    intra_bytes = phases.pop("intra_bytes")
    result = dict(cross_stats, hierarchy="node", intra_sparse=bool(scan and scan.sparse), nodes=len(topology.nodes),
                  local_size=len(topology.nodes[0]),
                  inter_bytes=cross_stats.get("bytes_sent", 0), intra_bytes=intra_bytes,
                  bytes_sent=cross_stats.get("bytes_sent", 0) + intra_bytes,
                  phases=dict(phases, **{f"cross_{k}": v for k, v in cross_stats.get("phases", {}).items()}),
                  seconds=time.perf_counter() - start)
    comm.last_stats = result
    if stats is not None:
        stats.update(result)


_DIFFER = "tensors or arguments differ across ranks: "


def _group_ranks(text: str, topology: Topology, node: int) -> str:
    """An error of node ``node``'s agreement, its ranks ("rank q", "ranks [q, ...]": ranks of the node) as
    ranks of the whole group."""
    rank = lambda q: topology.nodes[node][int(q)]  # noqa: E731
    text = re.sub(r"\brank (\d+)", lambda m: f"rank {rank(m.group(1))}", text)
    return re.sub(r"\branks \[([\d, ]*)\]", lambda m: f"ranks {[rank(q) for q in m.group(1).split(', ')]}", text)


def _cross_text(text: str, topology: Topology) -> str:
    """An error of a cross step's agreement as the same text on every rank: a node's forwarded failure as
    "on node k: ...", else the cross group's ranks (rank k: node k, whose ranks agreed among themselves) as
    the nodes' ranks of the whole group."""
    if "failed before the exchange: node " in text:
        return re.sub(r"rank \d+: failed before the exchange: (node \d+): ", r"on \1: ", text)
    ranks = lambda qs: sorted(r for k in qs for r in topology.nodes[int(k)])  # noqa: E731
    text = re.sub(r"\brank (\d+):", lambda m: f"node {m.group(1)} (ranks {ranks([m.group(1)])}):", text)
    return re.sub(r"\branks \[([\d, ]*)\]", lambda m: f"ranks {ranks(m.group(1).split(', '))}", text)


class Scan:
    """A strided tensor's non-zero entries, and how the node moves them: each segment (offset, numel, row size)
    as rows of its row size or as elements, chosen on the node's counts (``zen.schemes.call.decide_rows``), and
    the two steps inside the node sparse (each rank's entries of shard j to local rank j; the summed shards'
    entries back) or dense (the shards themselves), whichever moves fewer bytes: sparse where the node's
    entries (8-byte start, b values each) take fewer bytes than one copy of the tensor, sum_q E_q <= M s_v."""

    def __init__(self, tensor, segments, block_size):
        self.flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        if block_size is not None:
            segments = [(0, self.flat.numel(), block_size)]
        elif segments is None:
            segments = [(0, self.flat.numel(), tensor.shape[-1] if tensor.dim() > 1 and tensor.shape[-1] else 1)]
        self.segments, self.forced = list(segments), block_size is not None
        self.extracted, counts = scan_rows(self.flat, self.segments)
        ones = sum(ops.count_nonzero(self.flat[o:o + n], 1)[0] for o, n, r in self.segments if r == 1)
        self.counts = counts + [ones]  # per row size > 1: elements, rows; then the elements of row size 1

    def plan(self, rows: torch.Tensor, local_size: int) -> None:
        """The blocks and the mode, from every node rank's counts (``rows``), alike on the node's ranks."""
        totals = rows.sum(dim=0).tolist()
        flat, segments = self.flat, self.segments
        self.blocks = [r for _, _, r in segments] if self.forced else decide_rows(totals[:-1], flat, segments)
        sizes = sorted({r for _, _, r in segments if r > 1})
        as_rows = {r for (_, _, r), b in zip(segments, self.blocks) if b == r > 1}
        s_v = flat.element_size()
        self.entry_bytes = []  # per node rank: its entries' bytes on the wire
        for row in rows.tolist():
            nbytes = row[-1] * (8 + s_v)
            for g, size in enumerate(sizes):
                nbytes += row[2 * g + 1] * (8 + size * s_v) if size in as_rows else row[2 * g] * (8 + s_v)
            self.entry_bytes.append(nbytes)
        self.sparse = local_size > 1 and sum(self.entry_bytes) <= flat.numel() * s_v
        self.bounds = shard_bounds(segments, local_size)

    def entries(self, lo: int = 0, hi: Optional[int] = None, rescan: bool = False) -> dict:
        """{b: (starts, values)}: the entries of [lo, hi) by block size b (starts: int64 element offsets of
        ``flat``, ascending; values [k] or [k, b]); ``rescan``: of the tensor now, not as first scanned."""
        hi = self.flat.numel() if hi is None else hi
        groups = {}
        for i, (segment, b) in enumerate(zip(self.segments, self.blocks)):
            offset, numel, row = segment
            part = shard_segments([segment], lo, hi)
            if not part:
                continue
            begin = lo + part[0][0]
            if rescan or part[0][1] != numel:
                ids, values = ops.nonzero_rows(self.flat[begin:begin + part[0][1]], b)
            else:
                ids, values = segment_entries(self.flat, segment, b, self.extracted[i])
            starts = begin + ids.to(torch.int64) * b
            groups.setdefault(b, []).append((starts, values))
        empty = self.flat[:0]
        for b in set(self.blocks):  # every block size, so that every rank's counts have the same length
            groups.setdefault(b, []).append((empty.new_empty(0, dtype=torch.int64),
                                             empty if b == 1 else empty.new_empty(0, b)))
        return {b: (torch.cat([s for s, _ in parts]), torch.cat([v for _, v in parts]))
                for b, parts in sorted(groups.items())}
