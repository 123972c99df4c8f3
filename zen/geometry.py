"""Shared geometry: the pure helpers that the schemes, the cost model and the measurement all need, defined
once (how a group is cut into doubling steps and block ranges, how sparse tensors map to flat indices, how
many bytes an index or a value takes)."""
import math
from typing import List, Tuple

import torch

from . import ops, wire


def doubling_plan(n: int) -> Tuple[int, int]:
    """(p, steps): the largest power of two p <= n and log2 p. Ranks p..n-1 fold into ranks 0..n-p-1
    (SparCML's schedule, and the union measurement's)."""
    p = 1
    while 2 * p <= n:
        p *= 2
    return p, p.bit_length() - 1


def doubling_groups(n: int) -> List[List[List[int]]]:
    """groups[s][g]: the ranks merged into core group g after s doubling steps (s = 0..log2 p), the folded
    ranks p + i counted with core rank i."""
    p, steps = doubling_plan(n)
    return [[[r for c in range(g << s, (g + 1) << s) for r in (c, c + p) if r < n] for g in range(p >> s)]
            for s in range(steps + 1)]


def block_bounds(numel: int, block_size: int, n: int) -> List[int]:
    """Block ids where each owner's contiguous range starts (n + 1 bounds over ceil(numel / block_size) blocks):
    owner w holds blocks [bounds[w], bounds[w + 1]) (OmniReduce's fixed ownership)."""
    num_blocks = -(-numel // block_size)
    return [w * num_blocks // n for w in range(n + 1)]


# On gloo, all-to-alls whose largest piece reaches DUPLEX_ALL_TO_ALL_BYTES go as point-to-point messages over
# the two direction groups (``zen.transport``); smaller ones as gloo's own all-to-all, whose fixed cost is
# lower. Between two ranks gloo's own moves the pair's two pieces one direction at a time, so there the duplex
# transport, one message each way, takes over from the smaller DUPLEX_PAIR_BYTES.
DUPLEX_ALL_TO_ALL_BYTES = 512 << 10
DUPLEX_PAIR_BYTES = 16 << 10


def duplex_all_to_all(n: int, largest: int) -> bool:
    """Whether an all-to-all of n ranks whose largest piece is ``largest`` bytes goes as point-to-point
    messages over the two direction groups (on gloo): the transport's rule, and so the cost model's."""
    return largest >= (DUPLEX_PAIR_BYTES if n == 2 else DUPLEX_ALL_TO_ALL_BYTES)


def default_probes(device) -> int:
    """Level-2 probes of the hash partition when none are set: 3 on GPUs, as in ZEN; 0 (the exact counting
    sort) on CPUs, where the random table accesses cost more than they save."""
    return 3 if torch.device(device).type == "cuda" else 0


def index_size(numel: int) -> int:
    """Bytes per index on the wire for a tensor of ``numel`` elements (``wire.index_dtype``)."""
    return torch.empty(0, dtype=wire.index_dtype(numel)).element_size()


def value_size(dtype: torch.dtype) -> int:
    """Bytes per value of ``dtype``."""
    return torch.empty(0, dtype=dtype).element_size()


def rows_are_smaller(nnz: int, nonzero_rows: int, row_size: int, numel: int, value_size: int) -> bool:
    """Whether ``numel`` elements with ``nnz`` non-zeros in ``nonzero_rows`` rows of ``row_size`` travel in
    fewer bytes as rows (one index per row, the row whole) than as elements:
    R_nz (b s_v + s_i(M / b)) < nnz (s_v + s_i(M)), s_i the index size of each index space."""
    if row_size <= 1:
        return False
    as_rows = nonzero_rows * (row_size * value_size + index_size(numel // row_size))
    return as_rows < nnz * (value_size + index_size(numel))


def sparse_to_flat(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of a coalesced sparse COO tensor over its flat index space: entry (row, column)
    of its sparse dims x dense dims is flat index row * D + column, D the dense dims' size."""
    row_numel = math.prod(t.shape[t.sparse_dim():])
    rows, values = sparse_rows(t)
    flat_idx = (rows[:, None] * row_numel + torch.arange(row_numel, device=t.device)).reshape(-1)
    return flat_idx, values.reshape(-1)


def sparse_rows(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(row ids, values) of a coalesced sparse COO tensor as rows of its dense dims: row id = the entry's
    sparse index flattened over the sparse dims (row-major), values [k, D] (D the dense dims' size; [k]
    when it has none)."""
    rows = torch.zeros(t.indices().shape[1], dtype=torch.int64, device=t.device)
    for dim, size in enumerate(t.shape[:t.sparse_dim()]):
        rows = rows * size + t.indices()[dim]
    values = t.values()
    return rows, values.reshape(values.shape[0], math.prod(values.shape[1:])) if values.dim() > 1 else values


def rows_to_sparse(rows: torch.Tensor, values: torch.Tensor, shape, sparse_dim: int) -> torch.Tensor:
    """The inverse of :func:`sparse_rows`: a coalesced sparse COO tensor of ``shape`` from unique row ids
    (ascending) and their values."""
    indices, rest = [], rows.to(torch.int64)
    for size in reversed(shape[:sparse_dim]):
        indices.append(rest % size)
        rest = rest // size
    index = torch.stack(indices[::-1]) if indices else rows.new_zeros((0, rows.numel()), dtype=torch.int64)
    values = values.reshape((rows.numel(),) + tuple(shape[sparse_dim:]))
    return torch.sparse_coo_tensor(index, values, shape, is_coalesced=True, check_invariants=False)


def flat_coo(tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """(indices, values, dense_input) of a strided or sparse COO tensor over its flat index space."""
    if tensor.layout == torch.sparse_coo:
        return sparse_to_flat(tensor.coalesce()) + (False,)
    indices, values = ops.nonzero(tensor.contiguous().view(-1))
    return indices, values, True
