"""Per-process-group state: zen's private copy of the group, the agreed seed, the ordered lane of work,
the cache of hash-bitmap index sets, and the agreement step that makes every rank fail alike.

Why a private group: zen runs collectives from a worker thread (so communication overlaps backward);
sharing the user's group with the main thread (DDP's own collectives, the user's) could interleave
differently on different ranks. Why one worker thread per group (the lane): every rank must issue its
collectives in the same order, and a FIFO of jobs keeps the order in which they were submitted.
"""
import os
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import torch
import torch.distributed as dist

from . import ops

# Codes carried by the agreement header; the order of these lists is part of zen's protocol.
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
PROBLEMS = {
    1: "unsupported dtype (zen sums float32, float64, float16, bfloat16, int32 and int64)",
    2: "tensor device not supported by the process group's backend",
    3: "unknown scheme",
    4: "unsupported layout (zen takes strided tensors and sparse COO tensors)",
}
HEADER_FIELDS = ["numel", "dtype", "shape", "scheme", "layout", "problem"]


# torch renamed all_gather_into_tensor to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class MismatchError(ValueError):
    """Raised on every rank when the ranks called a zen collective with disagreeing tensors or arguments."""


def shape_code(shape) -> int:
    return zlib.crc32(repr(tuple(shape)).encode())


class Comm:
    """zen's view of one process group. Create through :func:`get_comm`."""

    def __init__(self, group: Optional[dist.ProcessGroup], timeout=None):
        self.user_group = group
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self.backend = dist.get_backend(group)
        self.group = dist.new_group(ranks=ranks, backend=self.backend, timeout=timeout,
                                    use_local_synchronization=True)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        seed = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64, device=self.device)
        dist.broadcast(seed, group_src=0, group=self.group)
        self.seed = int(seed.item())
        self._lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zen-lane")
        self._index_sets = OrderedDict()
        self.last_stats = {}

    # --- the lane -----------------------------------------------------------------------------------
    def submit(self, job, stream=None) -> torch.futures.Future:
        """Run ``job()`` on this group's lane; the future carries its result or its exception."""
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

        self._lane.submit(run)
        return fut

    # --- agreement ----------------------------------------------------------------------------------
    def agree(self, header: List[int], extra: List[int]) -> torch.Tensor:
        """All-gather ``header + extra`` of every rank; raise the same error on every rank if the headers
        disagree or any rank reported a problem. Returns the ``extra`` columns, one row per rank."""
        rows = self.all_gather_rows(header + list(extra))
        check_headers(rows[:, :len(header)].tolist())
        return rows[:, len(header):]

    def all_gather_rows(self, row: List[int]) -> torch.Tensor:
        """Every rank's ``row`` of int64s (all rows of the same length), as a CPU tensor [world, len]."""
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        rows = torch.empty(self.world * mine.numel(), dtype=torch.int64, device=self.device)
        _all_gather_single(rows, mine, group=self.group)
        return rows.view(self.world, -1).cpu()

    # --- hash bitmap index sets -----------------------------------------------------------------------
    def index_sets(self, numel: int, device) -> tuple:
        """(sets, offsets) of I_j for tensors of ``numel`` elements, computed once per (numel, device)."""
        key = (numel, str(device))
        if key not in self._index_sets:
            self._index_sets[key] = ops.bitmap_index_sets(numel, self.world, self.seed, device)
            while len(self._index_sets) > 8:
                self._index_sets.popitem(last=False)
        self._index_sets.move_to_end(key)
        return self._index_sets[key]


def check_headers(headers: List[List[int]]) -> None:
    """Raise :class:`MismatchError` (identically on every rank, since all see the same rows) when a rank
    reported a problem or the ranks' tensors differ."""
    from .schemes import SCHEMES

    for rank, header in enumerate(headers):
        problem = header[HEADER_FIELDS.index("problem")]
        if problem:
            raise MismatchError(f"zen.all_reduce: rank {rank}: {PROBLEMS.get(problem, f'problem {problem}')}"
                                f" (scheme={describe('scheme', header[3], SCHEMES)})")
    for field_index, field in enumerate(HEADER_FIELDS):
        values = [h[field_index] for h in headers]
        if len(set(values)) > 1:
            by_value = OrderedDict()
            for rank, value in enumerate(values):
                by_value.setdefault(value, []).append(rank)
            parts = [f"{describe(field, v, SCHEMES)} on ranks {r}" for v, r in by_value.items()]
            raise MismatchError(f"zen.all_reduce: tensors or arguments differ across ranks: {field} is "
                                + "; ".join(parts))


def describe(field: str, value: int, schemes) -> str:
    if field == "dtype":
        return str(DTYPES[value]) if 0 <= value < len(DTYPES) else "an unsupported dtype"
    if field == "scheme":
        return repr(schemes[value]) if 0 <= value < len(schemes) else "an unknown scheme"
    if field == "layout":
        return {0: "strided", 1: "sparse_coo"}.get(value, "another layout")
    if field == "shape":
        return f"shape#{value:08x}"
    return str(value)


_comms = {}
_comms_lock = threading.Lock()


def get_comm(group=None, timeout=None) -> Optional[Comm]:
    """The :class:`Comm` of ``group`` (default: the world), created (collectively) on first use; None on a
    rank outside the group."""
    if not dist.is_initialized():
        raise RuntimeError("zen: torch.distributed is not initialised; call dist.init_process_group first")
    if group is not None and dist.get_rank(group) < 0:
        return None
    key = group if group is not None else dist.group.WORLD
    with _comms_lock:
        if key not in _comms:
            _comms[key] = Comm(group, timeout)
        return _comms[key]
