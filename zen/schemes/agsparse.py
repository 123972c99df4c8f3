"""``scheme="agsparse"``: all-gather of every rank's COO, then a local sum (gloo's sparse allreduce, Horovod).

1. agree: all ranks exchange their non-zero counts k_r (piggybacked on the header check);
2. gather: every rank sends its COO piece to every other rank;
3. sum: every rank sums all n pieces (``ops.aggregate``, rank 0's piece first, so all ranks compute the
   same floating-point sums) and writes the union.

The gather is an all-to-all of n copies of the rank's piece (``Comm.all_gather_bytes``): each rank sends
exactly its (n-1) k_r (s_i + s_v) bytes and receives sum_{q != r} k_q (s_i + s_v). A padded ``all_gather`` would cost
(n-1) k_max (s_i + s_v) on every rank (the design notes' formula), and gloo has no all-gather of uneven sizes.

Cost: T = max_r max((n-1) k_r, sum_{q != r} k_q) (s_i + s_v) / b, which is (n-1) k (s_i + s_v) / b for equal
k_r: it beats dense only when d < 2 s_v / (n (s_i + s_v)). Every rank holds all n pieces at once, which is
why all-gather based sparse sync runs out of memory as workers grow.
"""
import torch

from .. import ops, wire
from .base import Call, Scheme


class AllGatherSparse(Scheme):
    name = "agsparse"

    def reduce_coo(self, call: Call, indices, values, numel):
        comm = call.comm
        n, me = comm.world, comm.rank
        idx_dtype, val_dtype = wire.index_dtype(numel), values.dtype
        si, sv = torch.empty(0, dtype=idx_dtype).element_size(), values.element_size()
        indices = indices.to(idx_dtype)

        nnz = call.agree([indices.numel()])[:, 0].tolist()
        call.mark("agree")
        sizes = [wire.coo_bytes(k, si, sv) for k in nnz]
        call.stats.update(nnz=nnz, bytes_sent=(n - 1) * sizes[me])
        if sum(sizes) == 0:
            call.stats.update(union=0, gamma=0.0)
            return []

        payload = wire.pack_coo(indices, values)
        gathered = torch.empty(sum(sizes), dtype=torch.uint8, device=payload.device)
        comm.all_gather_bytes(gathered, payload, sizes)
        del payload
        call.mark("gather")

        pieces = [wire.unpack_coo(buf, k, idx_dtype, val_dtype) for buf, k in zip(wire.split(gathered, sizes), nnz)]
        union_idx, union_val = ops.aggregate(torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces]),
                                             numel)
        call.mark("sum")
        mean_nnz = sum(nnz) / n
        call.stats.update(union=union_idx.numel(), gamma=union_idx.numel() / mean_nnz if mean_nnz else 0.0)
        return [(union_idx, union_val)]
