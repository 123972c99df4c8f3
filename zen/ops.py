"""Typed wrappers over the extension's operators (``torch.ops.zen.*``).

The C++ kernels are registered per device; these wrappers only document and forward. See
``csrc/ops.cpp`` for the schemas.
"""
from typing import Sequence, Tuple

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.zen)

Tensor = torch.Tensor


def _check_cuda_build() -> None:
    """The CUDA kernels must match the CUDA of the torch they run with (same major version)."""
    built = _C.cuda_version
    if built is None:
        return
    running = torch.version.cuda
    if running is None or built.split(".")[0] != running.split(".")[0]:
        raise ImportError(f"zen's CUDA kernels were built for CUDA {built}, but this torch has CUDA {running}: "
                          "rebuild zen (pip install --no-build-isolation .) against this torch")


_check_cuda_build()


def nonzero(dense: Tensor) -> Tuple[Tensor, Tensor]:
    """(indices, values) of the non-zeros of a contiguous 1-D tensor, indices ascending.

    A NaN or Inf is a non-zero, -0.0 is a zero. Indices are int32 below 2**31 elements, int64 above.

    >>> nonzero(torch.tensor([0., 2., 0., -1.]))
    (tensor([1, 3], dtype=torch.int32), tensor([ 2., -1.]))
    """
    return torch.ops.zen.nonzero(dense)


def nonzero_blocks(dense: Tensor, block_size: int) -> Tuple[Tensor, Tensor]:
    """(ids, blocks): the blocks of ``block_size`` consecutive elements of a contiguous 1-D tensor that hold a
    non-zero, ids ascending, and those blocks whole as rows [k, block_size]. ``block_size`` must divide the
    tensor. Ids are int32 below 2**31 blocks.

    >>> nonzero_blocks(torch.tensor([0., 0., 3., 0.]), 2)
    (tensor([1], dtype=torch.int32), tensor([[3., 0.]]))
    """
    return torch.ops.zen.nonzero_blocks(dense, block_size)


def nonzero_rows(dense: Tensor, block_size: int) -> Tuple[Tensor, Tensor]:
    """:func:`nonzero` when ``block_size`` is 1 (values [k]), else :func:`nonzero_blocks` (rows [k, b]):
    the entries of a tensor reduced as rows of ``block_size`` values."""
    return nonzero(dense) if block_size == 1 else nonzero_blocks(dense, block_size)


def count_nonzero(dense: Tensor, block_size: int) -> Tuple[int, int]:
    """(non-zero elements, blocks of ``block_size`` holding a non-zero) of a contiguous 1-D tensor, in one pass."""
    elements, blocks = torch.ops.zen.count_nonzero(dense, block_size).tolist()
    return elements, blocks


def topk_select(dense: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """(indices, values) of the ``min(k, non-zeros)`` entries of largest magnitude of a contiguous 1-D float
    tensor (float16, bfloat16, float32, float64), indices ascending: top-k gradient sparsification.

    A NaN ranks above everything (so it is always sent), then +-Inf, then |x|; a zero (0.0 or -0.0) is never
    chosen. Of the entries tied at the k-th magnitude the lower indices are taken, so the result is the same
    on every device and every run. ``k`` must be >= 0; ``k`` past the non-zeros gives them all. Indices are
    int32 below 2**31 elements, int64 above; values are ``dense[indices]``. O(numel), no sort.

    >>> topk_select(torch.tensor([0.5, -3., 0., 2., -2.]), 2)
    (tensor([1, 3], dtype=torch.int32), tensor([-3.,  2.]))
    """
    return torch.ops.zen.topk_select(dense, k)


def threshold_select(dense: Tensor, threshold: float) -> Tuple[Tensor, Tensor]:
    """(indices, values) of every non-zero entry with ``|x| >= threshold`` of a contiguous 1-D float tensor,
    and of every NaN, indices ascending (dtype as :func:`topk_select`'s). ``threshold`` must be >= 0; it is
    converted to the tensor's dtype first, as torch does in ``x.abs() >= threshold``.

    >>> threshold_select(torch.tensor([0.5, -3., 0., 2., float("nan")]), 2.0)
    (tensor([1, 3, 4], dtype=torch.int32), tensor([-3.,  2., nan]))
    """
    return torch.ops.zen.threshold_select(dense, threshold)


def hash_partition(indices: Tensor, num_partitions: int, seed: int) -> Tensor:
    """Level-1 hash: the partition h0(i) in [0, n) of each index (int32). The one partition rule of zen."""
    return torch.ops.zen.hash_partition(indices, num_partitions, seed)


def partition(indices: Tensor, values: Tensor, num_partitions: int, seed: int, num_probes: int = 3,
              table_factor: float = 2.0, serial_factor: float = 0.1):
    """Hierarchical hash partition of (indices, values) into ``num_partitions`` pieces.

    Returns (indices, values, counts, stats): the pairs grouped by partition h0 (piece j is
    ``counts[:j].sum()`` onwards), and stats = [placed in parallel memory, placed in serial memory,
    1 if a serial memory overflowed and the exact fallback ran]. Every pair lands exactly once.
    """
    return torch.ops.zen.partition(indices, values, num_partitions, seed, num_probes, table_factor, serial_factor)


def aggregate(indices: Tensor, values: Tensor, numel: int, num_partitions: int = 1, seed: int = 0,
              partition: int = -1) -> Tuple[Tensor, Tensor]:
    """Sum the values of equal indices (values [k], or rows [k, b] summed element by element): the union,
    ascending. Raises on an index outside [0, numel)
    or (when ``partition >= 0``) one that h0 does not send to ``partition``."""
    return torch.ops.zen.aggregate(indices, values, numel, num_partitions, seed, partition)


def bitmap_index_sets(numel: int, num_partitions: int, seed: int, device="cpu") -> Tuple[Tensor, Tensor]:
    """(sets, offsets): I_j = sorted {i < numel : h0(i) = j} is ``sets[offsets[j]:offsets[j+1]]``."""
    return torch.ops.zen.bitmap_index_sets(torch.empty(0, device=device), numel, num_partitions, seed)


def bitmap_encode(indices: Tensor, index_set: Tensor) -> Tensor:
    """Bitmap (uint8, bit r is byte r // 8, bit r % 8) over ``index_set`` of an ascending subset of it."""
    return torch.ops.zen.bitmap_encode(indices, index_set)


def bitmap_decode(bitmap: Tensor, index_set: Tensor, count: int = -1) -> Tensor:
    """Indices (ascending) of the set bits of ``bitmap`` over ``index_set``; checks the length and,
    when ``count >= 0``, that exactly ``count`` bits are set."""
    return torch.ops.zen.bitmap_decode(bitmap, index_set, count)


def scatter_(out: Tensor, indices: Tensor, values: Tensor) -> Tensor:
    """out[indices] = values on a contiguous 1-D ``out``, bounds checked; with rows [k, b], index i is block i
    of ``out`` (elements [i b, (i + 1) b)). Returns ``out``."""
    torch.ops.zen.scatter_(out, indices, values)
    return out


def scatter_pieces_(out: Tensor, pieces: Sequence[Tuple[Tensor, Tensor]]) -> Tensor:
    """:func:`scatter_` of every (indices, values) piece; the pieces' indices are disjoint. On the CPU, pieces
    whose indices ascend are written block by block of ``out`` (each block read from memory once, not
    once per piece: zen's n pulled partitions interleave over the whole output). Returns ``out``."""
    torch.ops.zen.scatter_pieces_(out, [p[0] for p in pieces], [p[1] for p in pieces])
    return out
