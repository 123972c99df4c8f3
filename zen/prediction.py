"""``zen.predict``: the cost model applied to a tensor on a group.

    times = zen.predict(grad)                    # {"dense": 0.0123, "zen": 0.0031, ..., "auto": 0.0031} seconds
    memory = zen.predict_memory(grad)            # {"dense": 0, "zen": 1.2e6, ...} extra bytes per rank
    zen.set_profile(bandwidth="1gbit", latency="50us")   # instead of the probe

Both are collective (call them on every rank of the group, like ``zen.all_reduce``). They measure, with
the agreement, floor(log2 n) exchanges of M/8-byte bitmaps (plus a fold for the ranks past the largest power
of two) and one all-gather of counts:

* nnz per rank, and per rank the non-zeros that zen's hash h0 sends to each partition and the non-zero
  blocks in each OmniReduce owner's range (the push loads: hash vs contiguous imbalance);
* the union U exactly, through recursive doubling of presence bitmaps (M/8 bytes per step, the schedule
  SparCML uses, so the running union of every doubling step is measured too: gamma(2^s));
* the union's split over the hash partitions and over the owners' block ranges (the pull loads);
* the statistics that registered schemes declare (``zen.cost.Statistic``), from every rank's own integers
  in the same all-gather;
* bytes per index and per value from the dtypes;

and combine them with the group's :class:`zen.cost.Profile`: set by :func:`set_profile`, or measured once
per group by :func:`probe_profile` (a few seconds: small collectives for the fixed costs; all-reduces
and all-to-alls of u and 4 u bytes for the rates (the slope), u of 1-8 MiB, all-to-alls of 96 and 384 KiB
pieces (the small ones' transport) and pairwise exchanges of 4 u; the local kernels; the calibration
calls; see :func:`zen.measurement.probe.probe_now`) and cached. All ranks use rank 0's profile, so they all
compute the same predictions.
:func:`measure` returns the measured :class:`zen.cost.Workload` itself, for offline use with
:func:`predict_times` under other profiles.
"""
import math
from typing import Dict, Optional, Sequence

import torch

from . import cost, wire
from .agreement import DTYPES, inspect_call
from .cost import Profile, Workload
from .geometry import sparse_rows
from .hierarchy import check_hierarchy
from .hierarchy.prediction import node_shard, node_step_times
from .measurement.probe import probe_now
from .measurement.store import cached_profile, set_profile
from .measurement.workload import measure_now
from .schemes import Call, registered
from .schemes.base import Request
from .schemes.call import choose_rows, segment_entries
from .transport import get_comm


def predict_times(workload: Workload, profile: Profile, schemes: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """Predicted seconds of every registered scheme (or of ``schemes``) for ``workload`` on ``profile``, and
    "auto", the smallest of them: :func:`zen.cost.predict_times` over the registry. No collectives."""
    formulas = registered()
    return cost.predict_times(workload, profile, {name: formulas[name] for name in (schemes or formulas)
                                                  if name != "auto"})


def predict_phases(workload: Workload, profile: Profile) -> Dict[str, Dict[str, float]]:
    """Predicted seconds of each phase, for every registered scheme whose calls record phases."""
    phases = {name: scheme.phases(cost.for_scheme(workload, name, scheme), profile)
              for name, scheme in registered().items()}
    return {name: p for name, p in phases.items() if p is not None}


def probe_profile(group=None, message_bytes: int = 1 << 20, repeats: int = 5) -> Profile:
    """Measure ``group``'s profile now (collective), cache it and return it."""
    comm = get_comm(group)
    if comm is None:
        return None
    return set_profile(group, comm.submit(lambda: probe_now(comm, message_bytes, repeats)).wait())


def _check_input(tensor, block_size) -> None:
    """A TypeError or ValueError naming the argument, where zen.predict cannot take it."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"zen.predict expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPES:
        raise TypeError(f"zen.predict: unsupported dtype {tensor.dtype} (zen sums {', '.join(map(str, DTYPES))})")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"zen.predict: block_size (OmniReduce's block, in elements) must be a positive int; "
                         f"got {block_size!r}")


def _measure(tensor, group, block_size, want_profile, profile=None):
    _check_input(tensor, block_size)
    comm = get_comm(group)
    if comm is None:
        return None, None
    header, _ = inspect_call(tensor, "zen", True, None, comm.backend)  # a bad tensor: every rank raises alike
    return comm.submit(lambda: _measure_on(comm, header, tensor, tensor, block_size, want_profile, profile)).wait()


def _measure_on(comm, header, tensor, whole, block_size, want_profile, profile=None):
    """(workload, profile) of all-reducing ``tensor`` (a part of ``whole``, whose header the agreement checks)
    over ``comm``, on its lane; the profile is ``profile``, else the one set or probed for ``comm``'s group."""
    mine = profile or cached_profile(comm.user_group)
    # The entries zen.all_reduce would reduce: rows of a sparse tensor's dense dims, or the rows of the
    # last dimension where all ranks' rows take fewer bytes (chosen alike, in the agreement), else elements.
    call = Call(comm, Request(tensor, None, "", checked=whole), header)
    if tensor.layout == torch.sparse_coo:
        t = tensor.coalesce()
        indices, values = sparse_rows(t)
        numel, dense_input, row_choice = math.prod(t.shape[:t.sparse_dim()]), False, False
    else:
        flat = tensor.contiguous().view(-1)
        row = whole.shape[-1] if whole.dim() > 1 and flat.numel() and whole.shape[-1] else 1
        segment = (0, flat.numel(), row)
        blocks, extracted = choose_rows(call, flat, [segment]) if segment[2] > 1 else ([1], [None])
        indices, values = segment_entries(flat, segment, blocks[0], extracted[0])
        numel, dense_input, row_choice = flat.numel() // blocks[0], True, segment[2] > 1
    result = measure_now(comm, call.agree, indices, values, numel, dense_input,
                         -(-block_size // wire.row_width(values)), mine,
                         probe=(lambda: probe_now(comm)) if want_profile else None, row_choice=row_choice)
    if want_profile and mine is None:
        set_profile(comm.user_group, result[1])
    return result


def _node_times(tensor, group, local_size, block_size) -> Optional[Dict[str, float]]:
    """Predicted seconds of ``zen.all_reduce(tensor, scheme=s, hierarchy="node")`` for every scheme s: the two
    steps inside the node on the node's profile (probed on a node's ranks, once) and the cross step on the
    workload of the summed shards, measured on the cross group, on its own profile (probed on it, every
    cross group at once: the ranks of a node share its network)."""
    _check_input(tensor, block_size)
    comm = get_comm(group)
    if comm is None:
        return None
    header, _ = inspect_call(tensor, "zen", True, None, comm.backend)

    def job():
        # What the node call does inside the node, then its cross step measured as a flat call on the cross group.
        intra, cross, scan, shard = node_shard(comm, tensor, local_size)
        workload, cross_profile = _measure_on(cross, header, shard, tensor, block_size, want_profile=True)
        steps = node_step_times(intra, scan, workload)
        times = {name: t + sum(steps.values()) for name, t in predict_times(workload, cross_profile).items()}
        # The call ends with its slowest node and cross group: the largest over the ranks, the same on all.
        slowest = comm.all_gather_ints([round(t * 1e12) for t in times.values()]).max(dim=0).values
        times = {name: t / 1e12 for name, t in zip(times, slowest.tolist()) if name != "auto"}
        return dict(times, auto=min(times.values()))

    return comm.submit(job).wait()


def measure(tensor: torch.Tensor, group=None, block_size: int = 256) -> Workload:
    """The measured :class:`zen.cost.Workload` of all-reducing ``tensor`` over ``group`` (collective)."""
    return _measure(tensor, group, block_size, want_profile=False)[0]


def predict(tensor: torch.Tensor, group=None, profile: Optional[Profile] = None,
            block_size: int = 256, hierarchy: str = "flat", local_size: Optional[int] = None) -> Dict[str, float]:
    """Predicted seconds of ``zen.all_reduce(tensor, scheme=s, group=group)`` for every scheme s of
    ``zen.SCHEMES`` ("auto": the smallest). Collective. ``profile``: use it instead of the cached or probed one
    (rank 0's counts). None on a rank outside the group.

    ``hierarchy``: "flat" (default) predicts the flat call; "node" the node call (``zen.hierarchy``; a strided
    tensor), with s the scheme across nodes; "both": {"flat": ..., "node": ...}, the two options side by side.
    ``local_size`` as in ``zen.all_reduce``.

    Example::

        zen.set_profile(bandwidth="10gbit", latency="20us")
        times = zen.predict(embedding.weight.grad)
        best = min(times, key=times.get)
    """
    check_hierarchy("zen.predict", hierarchy if hierarchy != "both" else "flat", local_size)
    if hierarchy == "auto":
        raise ValueError("zen.predict: hierarchy must be 'flat', 'node' or 'both'; got 'auto'")
    if hierarchy != "flat" and not (isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided):
        raise TypeError(f"zen.predict(hierarchy={hierarchy!r}) predicts node calls of strided tensors; for a "
                        f"sparse COO tensor use hierarchy='flat'")
    times = {}
    if hierarchy in ("flat", "both"):
        workload, agreed = _measure(tensor, group, block_size, want_profile=True, profile=profile)
        times["flat"] = None if workload is None else predict_times(workload, agreed)
    if hierarchy in ("node", "both"):
        times["node"] = _node_times(tensor, group, local_size, block_size)
    return times if hierarchy == "both" else times[hierarchy]


def predict_memory(tensor: torch.Tensor, group=None, block_size: int = 256) -> Dict[str, float]:
    """Predicted extra memory (bytes per rank, the peak of the scheme's buffers and caches, e.g. zen's hash
    tables and cached index sets, the all-gather's n pieces) for every scheme. Collective."""
    workload = measure(tensor, group, block_size)
    return None if workload is None else cost.predict_memory(workload, registered())
