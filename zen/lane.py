"""The lane: one worker thread per process group that runs zen's jobs in submission order.

Every rank must issue its collectives on a group in the same order; a FIFO of jobs keeps the order in which
they were submitted.
"""
import queue
import threading

import torch


class Lane:
    """One daemon worker thread running jobs in submission order. A daemon, so that a job stuck in a
    collective never keeps the process from exiting."""

    def __init__(self, name: str):
        self._jobs = queue.SimpleQueue()
        # OpenMP's thread count is per thread: the lane uses its creator's, or a new thread would spin up
        # every core and oversubscribe a machine shared by several ranks.
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self):
        torch.set_num_threads(self._threads)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def submit(self, job) -> None:
        self._jobs.put(job)

    def is_current(self) -> bool:
        """Whether the calling thread is this lane's (a job, or a callback of a job's future)."""
        return threading.current_thread() is self._thread

    def close(self, timeout: float) -> None:
        """End the thread after the jobs already submitted; wait for it at most ``timeout`` seconds (a job
        stuck in a collective with a dead peer must not hold up the process's exit)."""
        self._jobs.put(None)
        self._thread.join(timeout)
