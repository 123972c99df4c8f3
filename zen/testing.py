"""Running a function on several local gloo ranks over loopback: for tests, benchmarks and trying zen
without a cluster.

Each rank is a fresh process (spawn) with its own process group on a free port; results come back to the
parent by queue. A rank that raises fails the run with its traceback; a run that outlives ``timeout``
is killed and fails (so a hang is a test failure, never a stuck suite).
"""
import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue, pg_timeout):
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        # By value (plain pickle): the queue would share a tensor's storage through this process, which may
        # exit before the parent reads it.
        result = pickle.dumps(fn(rank, world, *args))
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: B036  (reported to the parent)
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


class RankError(AssertionError):
    pass


def run_ranks(world, fn, *args, timeout=180, pg_timeout=60, expect_dead=()):
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; returns the list of results by rank.

    ``timeout``: seconds for the whole run. ``pg_timeout``: the process group's timeout (seconds).
    ``expect_dead``: ranks allowed to die without reporting (fault-injection tests; their result is None).
    A rank that dies without reporting and is not in ``expect_dead`` fails the run at once."""
    import queue as queue_mod
    import time

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, pg_timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    exited_at = {}
    try:
        while set(range(world)) - set(results) - set(errors) - set(expect_dead):
            try:
                rank, status, value = queue.get(timeout=0.5)
            except queue_mod.Empty:
                now = time.monotonic()
                if now > deadline:
                    raise RankError(f"ranks timed out after {timeout}s; reported: {sorted(results) + sorted(errors)}")
                for r, p in enumerate(procs):
                    if r in results or r in errors or r in expect_dead or p.exitcode is None:
                        continue
                    # Exited: its last message may still be in the pipe; give it a moment, then fail.
                    if now - exited_at.setdefault(r, now) > 3.0:
                        raise RankError(f"rank {r} died without reporting (exit code {p.exitcode}); "
                                        f"reported: {sorted(results) + sorted(errors)}")
                continue
            (results if status == "ok" else errors)[rank] = pickle.loads(value) if status == "ok" else value
            if status != "ok":  # the others may wait on it: give them the group's timeout to fail too
                deadline = min(deadline, time.monotonic() + pg_timeout + 10)
    finally:
        for p in procs:
            p.join(timeout=max(1.0, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        rank = min(errors)
        raise RankError(f"rank {rank} failed:\n{errors[rank]}")
    return [results.get(r) for r in range(world)]


class LocalBucket:
    """A stand-in for DDP's GradBucket (what a comm hook uses), to call a hook outside DDP: the flat buffer
    and, optionally, the parameters whose gradients tile it (their shapes give the hook their rows).

    Without ``parameters``, :meth:`parameters` is empty: the parameters are unknown, so the hook keeps what it
    keeps per parameter (top-k's residuals) by the bucket's index, which lasts from step to step, as a
    bucket of DDP does. (Handing the buffer as its own parameter would key them by each step's new buffer.)"""

    def __init__(self, buffer, index: int = 0, parameters=None, is_last: bool = False):
        self._buffer = buffer
        self._index = index
        self._parameters = parameters
        self._is_last = is_last

    def buffer(self):
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self):
        return list(self._parameters) if self._parameters is not None else []
