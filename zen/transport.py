"""Transport: zen's private copy of a process group, its agreed seed, its ordered lane of work, and the
primitives every scheme is written in. Transport knows no scheme.

Why a private group: zen runs collectives from a worker thread (so communication overlaps backward);
sharing the user's group with the main thread (DDP's own collectives, the user's) could interleave
differently on different ranks (a dense bucket's all-reduce from DDP's hook thread is the exception). Its timeout is the user's group's (or the one given to ``ZenState``), so
a dead or stalled peer surfaces within the timeout the user chose. On gloo there are two such groups: gloo
carries a pair's messages on one socket and moves them one direction at a time, so zen sends from the lower
group rank to the higher on one group and back on the other (a pair then exchanges at the full link rate
each way, not half of it). Why one worker thread per group (the lane): every rank must issue its
collectives in the same order, and a FIFO of jobs keeps the order in which they were submitted.

A failure part-way through a collective (a peer died, a timeout, a corrupt buffer) leaves the ranks at
different points of the protocol. The rank that sees it raises it, and the group is then *broken* on that
rank: every later call on it raises :class:`BrokenGroupError` at once, queued calls included, instead of
waiting behind a protocol that can no longer line up. (Bad input is caught earlier, by the agreement:
:mod:`zen.agreement`.) The failure itself is raised as :class:`PeerError`, naming the peer this rank was
waiting on where that is known (the backends' own errors name a socket address, or only the time).
"""
import atexit
import contextlib
import datetime
import os
import threading
import warnings
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import schedules, wire
from .geometry import duplex_all_to_all
from .lane import Lane

# torch renamed all_gather_into_tensor to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class BrokenGroupError(RuntimeError):
    """Raised by every zen call on a group after a collective on it failed part-way on this rank (a peer
    died, a timeout, a corrupt buffer): the ranks may be out of step, so the group is not used again."""


class PeerError(RuntimeError):
    """A zen collective failed in an exchange with its peers: a peer died (its connection closed), or did
    not answer within the group's timeout (it stalled, or was itself waiting on another rank). The message
    names the peer this rank was waiting on where the transport knows it (a point-to-point message, or a
    group of two), else the peers it may be; then the backend's own error. ``peers``: those global ranks."""

    def __init__(self, message: str, peers: Tuple[int, ...] = ()):
        super().__init__(message)
        self.peers = tuple(peers)


def group_timeout(group) -> Optional[datetime.timedelta]:
    """The timeout of ``group``'s backend (what ``init_process_group(timeout=...)`` or ``new_group`` set),
    or None where the backend does not say."""
    pg = group if group is not None else dist.group.WORLD
    for device in getattr(pg, "_device_types", [torch.device("cpu")]):
        try:
            timeout = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    return None


def check_timeout(owner: str, timeout) -> None:
    """A ValueError naming the setting, where ``timeout`` is not None, a positive timedelta or positive seconds."""
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if timeout is not None and not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
                                    and seconds > 0):
        raise ValueError(f"{owner}: timeout must be None, a positive timedelta or seconds; got {timeout!r}")


def _as_timedelta(timeout) -> Optional[datetime.timedelta]:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _private_group(group, ranks: List[int], backend, timeout, suffix: str = "") -> dist.ProcessGroup:
    """zen's own group over ``ranks``, created by the members only.

    Its name derives from the user's group's name (the same on every member), so members may create their
    zen groups in any order, from any thread (each creation talks to the store on a connection of its own).
    (``dist.new_group(use_local_synchronization=True)`` names a group after how many groups the calling
    process made before, so ranks whose first zen calls on overlapping groups come in different orders would
    wait on different names.) Falls back to that call where torch lacks the helper, with a warning (once)."""
    global _warned_fallback
    c10d = dist.distributed_c10d
    try:
        helper, store = c10d._new_process_group_helper, c10d._get_default_store()
        name = f"zen:{(group if group is not None else dist.group.WORLD).group_name}{suffix}"
        default_timeout = c10d._get_default_timeout(backend)
    except (AttributeError, RuntimeError) as missing:
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn(f"zen: this torch lacks the private process-group helper ({missing}); zen creates its "
                          "groups with dist.new_group(use_local_synchronization=True) instead, which can wait until "
                          "the timeout when ranks make their first zen calls on overlapping groups in different "
                          "orders", RuntimeWarning, stacklevel=2)
        return dist.new_group(ranks=ranks, backend=backend, timeout=timeout, use_local_synchronization=True)
    try:  # a connection of its own: two threads making two groups at once must not wait on one store socket
        store = store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        pass
    pg, _ = helper(len(ranks), ranks.index(dist.get_rank()), ranks, backend, store, name,
                   timeout=timeout or default_timeout, group_desc="zen")
    c10d._world.pg_group_ranks[pg] = {global_rank: i for i, global_rank in enumerate(ranks)}
    return pg


_warned_fallback = False  # the fallback of _private_group is announced once per process


class Comm:
    """zen's view of one process group. Create through :func:`get_comm`."""

    def __init__(self, group: Optional[dist.ProcessGroup], timeout=None, ranks: Optional[List[int]] = None,
                 suffix: str = ""):
        """zen's view of ``group``; with ``ranks`` (global ranks, a subset of the group's) and ``suffix`` (a name
        unique among the group's subsets), of that subset: a sub-group made by its members only (the parts
        of a hierarchical call, :meth:`sub_comm`)."""
        self.user_group = group
        if ranks is None:
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self.backend = dist.get_backend(group)
        self.timeout = _as_timedelta(timeout) or group_timeout(group)
        self.user_timeout = group_timeout(group)
        self.group = _private_group(group, ranks, self.backend, self.timeout, suffix)
        # gloo: messages from a higher to a lower group rank go on a second group (see the module docstring).
        self.reverse_group = (_private_group(group, ranks, self.backend, self.timeout, suffix + ":reverse")
                              if self.backend == "gloo" else None)
        if suffix:  # a sub-group: its profile is its own (zen.measurement.store keys profiles by user_group)
            self.user_group, self.user_timeout = self.group, self.timeout
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        seed = int(os.environ.get("ZEN_SEED") or int.from_bytes(os.urandom(7), "little"))  # ZEN_SEED: replayable
        seed = torch.tensor([seed], dtype=torch.int64, device=self.device)
        dist.broadcast(seed, group_src=0, group=self.group)
        self.seed = int(seed.item())
        self._lane = Lane(f"zen-lane-{self.rank}")
        self.agreements = 0  # agreement exchanges started on this rank (tells a pre-exchange failure apart)
        self.broken: Optional[str] = None
        self._subs = {}  # suffix -> Comm over a subset of this group's ranks

    def sub_comm(self, ranks: List[int], suffix: str) -> "Comm":
        """The :class:`Comm` of a subset of this group (``ranks``: group ranks, ascending, this rank among them),
        created by its members on first use (each member calls with the same ranks and ``suffix``) and cached.
        Its collectives run on this group's lane: a call that uses it runs there, so every member issues
        them in the same order."""
        if suffix not in self._subs:
            members = [dist.get_global_rank(self.group, q) for q in ranks]
            self._subs[suffix] = Comm(self.user_group, self.timeout, members, suffix)
        return self._subs[suffix]

    def set_timeout(self, timeout) -> None:
        """Timeout of zen's private group for the collectives started from now on."""
        timeout = _as_timedelta(timeout)
        if timeout is not None and timeout != self.timeout:
            for group in (self.group, self.reverse_group):
                if group is not None:
                    dist.distributed_c10d._set_pg_timeout(timeout, group)
            self.timeout = timeout
        for sub in self._subs.values():
            sub.set_timeout(timeout)

    # --- the lane -----------------------------------------------------------------------------------
    def submit(self, job, stream=None) -> torch.futures.Future:
        """Run ``job()`` on this group's lane; the future carries its result or its exception.

        A job's future completes on the lane, so its callbacks run there: a collective that a callback starts
        (``work.get_future().then(...)``, a DDP hook's ``.then``) runs at once, inline, where it would
        otherwise wait in the queue behind the callback that waits for it. Every rank runs it at the same
        point, right after the job whose future it follows."""
        fut = torch.futures.Future()

        def run():
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        result = job()
                        stream.synchronize()
                else:
                    result = job()
                fut.set_result(result)
            except BaseException as error:  # noqa: B036  (the waiter re-raises it)
                fut.set_exception(error)

        if self._lane.is_current():
            run()
        else:
            self._lane.submit(run)
        return fut

    def all_reduce_async(self, tensor: torch.Tensor, value_dtype: Optional[torch.dtype] = None,
                         stream=None, on_done=None) -> torch.futures.Future:
        """``dist.all_reduce`` (sum) of ``tensor`` in place on the *user's* group, started at once from the
        calling thread: plain DDP's collective for a bucket, for DDP's hook thread only (it starts buckets in
        the same order on every rank). Only where :meth:`user_group_in_time`. The future carries ``tensor``
        once summed (after ``on_done()``), or the failure as :class:`PeerError` (the group then broken)."""
        result = torch.futures.Future()

        def finish(done: torch.futures.Future, low: torch.Tensor):
            try:
                with self.waiting_on("an all-reduce", self.others()):
                    done.wait()
                if low is not tensor:
                    tensor.copy_(low)
                if on_done is not None:
                    on_done()
                result.set_result(tensor)
            except BaseException as error:  # noqa: B036  (the waiter re-raises it)
                self.fail(error)
                result.set_exception(error)

        try:
            self.check_usable()
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                low = tensor if value_dtype in (None, tensor.dtype) else tensor.to(value_dtype)
                work = dist.all_reduce(low, group=self.user_group, async_op=True)
        except BaseException as error:  # noqa: B036
            result.set_exception(error)
            return result
        work.get_future().add_done_callback(lambda done: finish(done, low))
        return result

    # --- failure state --------------------------------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        """Mark the group broken on this rank after ``error`` interrupted a collective part-way."""
        if self.broken is None:
            self.broken = f"{type(error).__name__}: {error}"[:2000]

    def peer_text(self, peers: List[int]) -> str:
        """``peers`` (group ranks) as the message names them: by global rank, then group rank."""
        if len(peers) == 1:
            return f"rank {dist.get_global_rank(self.group, peers[0])} (group rank {peers[0]})"
        return (f"one of ranks {[dist.get_global_rank(self.group, q) for q in peers]} (group ranks {list(peers)}; "
                f"the backend does not say which)")

    @contextlib.contextmanager
    def waiting_on(self, what: str, peers: List[int]):
        """Raise a backend failure inside as :class:`PeerError` naming ``peers`` (group ranks), the ranks this
        rank waits on in ``what``. In a group of two that is the other rank, whatever the collective."""
        try:
            yield
        except PeerError:
            raise
        except RuntimeError as error:  # (DistBackendError is one; gloo raises RuntimeError itself)
            text, who = str(error), self.peer_text(peers)
            lower = text.lower()
            if "timed out" in lower or "timeout" in lower:
                seconds = f" ({self.timeout.total_seconds():g} s)" if self.timeout is not None else ""
                cause = f"{who} did not answer within the timeout{seconds}: it stalled, or it waits on another rank"
            elif any(word in lower for word in ("connection", "closed by peer", "reset by peer", "broken pipe")):
                cause = f"the connection to {who} broke: it died or exited"
            else:
                cause = f"while waiting on {who}"
            ranks = tuple(dist.get_global_rank(self.group, q) for q in peers)
            raise PeerError(f"zen: {what} failed on rank {dist.get_rank()} (group rank {self.rank}); {cause}. "
                            f"Backend error: {type(error).__name__}: {text}", ranks) from error

    def user_group_in_time(self) -> bool:
        """Whether the user's group times out within zen's timeout (a collective on it fails as soon)."""
        return self.timeout is None or (self.user_timeout is not None and self.user_timeout <= self.timeout)

    def others(self) -> List[int]:
        return [q for q in range(self.world) if q != self.rank]

    def check_usable(self) -> None:
        if self.broken is not None:
            raise BrokenGroupError(
                f"zen: this process group is unusable on this rank (group rank {self.rank}): an earlier zen collective on it failed "
                f"part-way ({self.broken}); the ranks may be out of step. Create a new process group to go on.")

    # --- primitives -------------------------------------------------------------------------------
    def all_gather_ints(self, row: List[int]) -> torch.Tensor:
        """Every rank's ``row`` of int64s (the same length on every rank), as a CPU tensor [world, len].

        On gloo they go as one all-to-all (every rank sends its row to every peer at once): gloo's
        all-gather is a ring of n-1 dependent steps, and for rows this small the steps' latency is all
        there is."""
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        rows = torch.empty(self.world * mine.numel(), dtype=torch.int64, device=self.device)
        with self.waiting_on("an all-gather of rows", self.others()):
            if self.backend == "gloo":
                dist.all_to_all_single(rows, mine.repeat(self.world), group=self.group)
            else:
                _all_gather_single(rows, mine, group=self.group)
            return rows.view(self.world, -1).cpu()

    def all_reduce(self, tensor: torch.Tensor, value_dtype: Optional[torch.dtype] = None) -> None:
        """``dist.all_reduce`` (sum) of ``tensor`` over the group, in place; with ``value_dtype``, of a copy
        in that dtype (sent and summed in it, as torch's ``fp16_compress_hook`` does)."""
        low = tensor if value_dtype in (None, tensor.dtype) else tensor.to(value_dtype)
        with self.waiting_on("an all-reduce", self.others()):
            dist.all_reduce(low, group=self.group)
        if low is not tensor:
            tensor.copy_(low)

    # --- transport ----------------------------------------------------------------------------------
    def _direction_group(self, src: int, dst: int) -> dist.ProcessGroup:
        """The group that carries messages from group rank ``src`` to ``dst``."""
        return self.reverse_group if self.reverse_group is not None and src > dst else self.group

    def exchange(self, sends: List[Tuple[int, torch.Tensor]], recvs: List[Tuple[int, torch.Tensor]]) -> None:
        """Point-to-point: send each (group rank, tensor) of ``sends`` and fill each of ``recvs``, all posted at
        once; empty tensors are not sent. Sender and receiver agree on each message's byte size (not dtype).

        On gloo each direction of a pair has its own group (one group would move the pair's two messages one
        direction at a time); elsewhere they go as one ``batch_isend_irecv`` (so NCCL can pair them)."""
        sends = [(peer, _as_bytes(tensor)) for peer, tensor in sends if tensor.numel()]
        recvs = [(peer, _as_bytes(tensor)) for peer, tensor in recvs if tensor.numel()]
        peers = sorted({peer for peer, _ in sends + recvs})
        if self.reverse_group is not None:
            # One work per message: a failed wait names its own peer.
            with self.waiting_on("a point-to-point exchange", peers):
                works = [("a send", peer, dist.isend(t, group=self._direction_group(self.rank, peer), group_dst=peer))
                         for peer, t in sends]
                works += [("a receive", peer, dist.irecv(t, group=self._direction_group(peer, self.rank),
                                                              group_src=peer)) for peer, t in recvs]
            for what, peer, work in works:
                with self.waiting_on(f"{what} in a point-to-point exchange", [peer]):
                    work.wait()
            return
        ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(self.group, peer), self.group) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(self.group, peer), self.group) for peer, t in recvs]
        with self.waiting_on("a point-to-point exchange", peers):  # (a batch may come back as one work)
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor, recv_splits: List[int],
                   send_splits: List[int], largest: int) -> None:
        """Byte buffers: piece j of ``send`` (send_splits[j] bytes) goes to rank j, piece q of ``recv`` comes from
        rank q. ``largest``: the largest piece any rank sends to another in this all-to-all. It picks the
        transport and the schedule (:mod:`zen.schedules`), so it must be the same on every rank (the schemes
        know every size from their agreement).

        "direct": on gloo, from ``DUPLEX_ALL_TO_ALL_BYTES`` on (``DUPLEX_PAIR_BYTES`` between two ranks:
        :func:`duplex_all_to_all`), the pieces go as point-to-point messages over the two direction groups, all
        at once in a staggered order (rank r sends to r+1, r+2, ... and receives from r-1, r-2, ...); smaller
        ones as the backend's all-to-all. "pairwise": n-1 rounds of one message each way."""
        schedule = schedules.choose(self.world, largest, gather=False)
        if schedule == "direct" and (self.reverse_group is None or not duplex_all_to_all(self.world, largest)):
            with self.waiting_on("an all-to-all", self.others()):
                dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
            return
        n, me = self.world, self.rank
        send_pieces, recv_pieces = wire.split(send, send_splits), wire.split(recv, recv_splits)
        recv_pieces[me].copy_(send_pieces[me])
        rounds = schedules.pairwise_rounds(n, me)
        if schedule == "direct":
            self.exchange([(to, send_pieces[to]) for to, _ in rounds], [(q, recv_pieces[q]) for _, q in rounds])
            return
        for to, source in rounds:
            self.exchange([(to, send_pieces[to])], [(source, recv_pieces[source])])

    def all_gather_bytes(self, recv: torch.Tensor, piece: torch.Tensor, recv_splits: List[int]) -> None:
        """Every rank's ``piece`` (uneven byte sizes, recv_splits[q] from rank q, the same list on every rank)
        into ``recv``: no backend has an all-gather of uneven sizes, so a ring of n-1 rounds or Bruck's log2 n
        rounds where :func:`zen.schedules.choose` says so, else an all-to-all of n copies of the piece."""
        n, me = self.world, self.rank
        schedule = schedules.choose(n, max(recv_splits), gather=True)
        if schedule not in ("ring", "bruck"):
            self.all_to_all(recv, piece.repeat(n), recv_splits, [piece.numel()] * n, largest=max(recv_splits))
            return
        pieces = wire.split(recv, recv_splits)
        pieces[me].copy_(piece)
        schedules.all_gather_in_rounds(self.exchange, schedule, pieces, n, me)

    def reduce_scatter(self, flat: torch.Tensor, bounds: List[int]) -> None:
        """The sum over the group of every rank's ``flat[bounds[q]:bounds[q + 1]]``, into that part of ``flat`` on
        rank q, in place (the other parts keep this rank's values): part q goes to rank q, an all-to-all of
        (n-1)/n of the bytes, and each rank adds the n parts it received in rank order."""
        n, me = self.world, self.rank
        if n == 1:
            return
        size = flat.element_size()
        mine = bounds[me + 1] - bounds[me]
        send_splits = [(bounds[q + 1] - bounds[q]) * size for q in range(n)]
        recv = torch.empty(n * mine, dtype=flat.dtype, device=flat.device)
        self.all_to_all(_as_bytes(recv), _as_bytes(flat), [mine * size] * n, send_splits, largest=max(send_splits))
        torch.sum(recv.view(n, mine), dim=0, out=flat[bounds[me]:bounds[me + 1]])

    def all_gather_parts(self, flat: torch.Tensor, bounds: List[int]) -> None:
        """Every rank q's ``flat[bounds[q]:bounds[q + 1]]`` into the same part of ``flat`` on every rank."""
        if self.world == 1:
            return
        size = flat.element_size()
        me = self.rank
        piece = flat[bounds[me]:bounds[me + 1]].clone()
        self.all_gather_bytes(_as_bytes(flat), _as_bytes(piece),
                              [(bounds[q + 1] - bounds[q]) * size for q in range(self.world)])


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


_comms = {}
_comms_lock = threading.Lock()
_creating = {}  # group -> the lock of its Comm's creation


@atexit.register
def _forget_comms() -> None:
    """End the lanes and drop zen's groups while the interpreter is whole: left to its final teardown, a
    gloo group whose peers already exited (a script that ends with destroy_process_group) could abort
    the process, and so could a lane thread that has run torch's kernels and is still alive when the C++
    runtime tears down ("terminate called without an active exception", seen at exit of 2-rank runs)."""
    with _comms_lock:
        for comm in _comms.values():
            for sub in comm._subs.values():
                sub._lane.close(timeout=1.0)
            comm._lane.close(timeout=1.0)
        _comms.clear()
        _creating.clear()


def get_comm(group=None, timeout=None) -> Optional[Comm]:
    """The :class:`Comm` of ``group`` (default: the world), created (collectively) on first use; None on a
    rank outside the group. ``timeout`` (timedelta or seconds; default: the group's own) bounds every zen
    collective on the group; given again later, it replaces the earlier one."""
    if not dist.is_initialized():
        raise RuntimeError("zen: torch.distributed is not initialised; call dist.init_process_group first")
    if group is not None and dist.get_rank(group) < 0:
        return None
    key = group if group is not None else dist.group.WORLD
    with _comms_lock:
        comm = _comms.get(key)
        creating = _creating.setdefault(key, threading.Lock()) if comm is None else None
    if comm is None:
        # Made by its members collectively, under its own lock only: two threads making the Comms of two groups
        # may do so in either order on each rank (under one lock, each rank's first would wait on the other's).
        with creating:
            with _comms_lock:
                comm = _comms.get(key)
            if comm is None:
                comm = Comm(group, timeout)
                with _comms_lock:
                    _comms[key] = comm
                return comm
    if timeout is not None:
        comm.set_timeout(timeout)
    return comm
