"""A node call's steps on a sparse COO tensor (``zen.hierarchy``): as rows of its dense dims, sparse throughout."""
import dataclasses
import math
import time
from typing import Tuple

import torch

from .. import wire
from ..geometry import rows_to_sparse, sparse_rows
from ..schemes.base import Outcome, Request, phase_range
from ..schemes.call import run_call
from ..transport import Comm


def node_sparse(intra: Comm, cross: Comm, request: Request) -> Tuple[dict, Outcome]:
    """Steps 1-3 on a sparse COO tensor, as rows of its dense dims; returns the phases' seconds with the
    bytes sent inside the node, and the cross step's outcome."""
    tensor, name = request.tensor, str(request.name)
    t = tensor.coalesce()
    rows, values = sparse_rows(t)
    num_rows = math.prod(t.shape[:t.sparse_dim()])
    g, me = intra.world, intra.rank
    bounds = [j * num_rows // g for j in range(g + 1)]
    width = wire.row_width(values)
    t0 = time.perf_counter()
    # Step 1: rows of shard j to local rank j (rows ascending, so each shard's rows are consecutive).
    with phase_range(name, "intra_reduce_scatter"):
        owners = torch.searchsorted(rows.new_tensor(bounds[1:-1]), rows, right=True)
        counts = torch.bincount(owners, minlength=g).tolist()
        matrix = intra.all_gather_ints(counts).tolist()  # matrix[q][j]: rows rank q sends to rank j
        send, send_splits = wire.pack_coo_pieces(rows, values, counts)
        si, sv = rows.element_size(), wire.entry_bytes(values)
        recv_splits = [wire.coo_bytes(matrix[q][me], si, sv) for q in range(g)]
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=values.device)
        largest = max(wire.coo_bytes(c, si, sv) for row in matrix for c in row)
        with intra.waiting_on("a reduce-scatter inside the node", intra.others()):
            intra.all_to_all(recv, send, recv_splits, send_splits, largest)
        got = [wire.unpack_coo(piece, matrix[q][me], rows.dtype, values.dtype, width)
               for q, piece in enumerate(wire.split(recv, recv_splits))]
        ids, inverse = torch.unique(torch.cat([i for i, _ in got]), return_inverse=True)
        summed = values.new_zeros((ids.numel(),) + tuple(values.shape[1:]))
        summed.index_add_(0, inverse, torch.cat([v for _, v in got]))
    t1 = time.perf_counter()
    # Step 2: the shard's rows across the nodes.
    with phase_range(name, "cross"):
        dense_shape = tuple(t.shape[t.sparse_dim():])
        shard = rows_to_sparse(ids - bounds[me], summed, (bounds[me + 1] - bounds[me],) + dense_shape, 1)
        crossed = run_call(cross, dataclasses.replace(request, tensor=shard, checked=tensor))
    t2 = time.perf_counter()
    # Step 3: every rank's summed rows.
    with phase_range(name, "intra_all_gather"):
        shard = shard.coalesce()
        ids, summed = sparse_rows(shard)
        ids = ids + bounds[me]
        sizes = intra.all_gather_ints([ids.numel()]).view(-1).tolist()
        piece = wire.pack_coo(ids, summed)
        splits = [wire.coo_bytes(c, si, sv) for c in sizes]
        gathered = torch.empty(sum(splits), dtype=torch.uint8, device=values.device)
        with intra.waiting_on("an all-gather inside the node", intra.others()):
            intra.all_gather_bytes(gathered, piece, splits)
        got = [wire.unpack_coo(p, c, ids.dtype, summed.dtype, width)
               for p, c in zip(wire.split(gathered, splits), sizes)]
        all_ids = torch.cat([i for i, _ in got])
        all_values = torch.cat([v for _, v in got]).reshape((all_ids.numel(),) + dense_shape)
        tensor.copy_(rows_to_sparse(all_ids, all_values, t.shape, t.sparse_dim()))
    t3 = time.perf_counter()
    intra_bytes = sum(send_splits) - send_splits[me] + piece.numel() * (g - 1)
    return dict(intra_reduce_scatter=t1 - t0, cross=t2 - t1, intra_all_gather=t3 - t2,
                intra_bytes=intra_bytes), crossed
