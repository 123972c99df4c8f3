"""``scheme="agsparse"``: all-gather of every rank's COO, then a local sum (gloo's sparse allreduce, Horovod).

1. agree: all ranks exchange their non-zero counts k_r (piggybacked on the header check);
2. gather: every rank sends its COO piece to every other rank;
3. sum: every rank sums all n pieces (``ops.aggregate``, rank 0's piece first, so all ranks compute the
   same floating-point sums) and writes the union.

The gather is an all-to-all of n copies of the rank's piece (``Comm.all_gather_bytes``): each rank sends
exactly its (n-1) k_r (s_i + s_v) bytes and receives sum_{q != r} k_q (s_i + s_v). A padded ``all_gather`` would cost
(n-1) k_max (s_i + s_v) on every rank (:mod:`zen.cost`'s closed form with k_max for k), and gloo has no
all-gather of uneven sizes.

Cost: T = max_r max((n-1) k_r, sum_{q != r} k_q) (s_i + s_v) / b, which is (n-1) k (s_i + s_v) / b for equal
k_r: it beats dense only when d < 2 s_v / (n (s_i + s_v)). Every rank holds all n pieces at once, which is
why all-gather based sparse sync runs out of memory as workers grow.
"""
from typing import Dict

import torch

from .. import ops, wire
from ..cost import Profile, Workload, terms
from .base import Call, Scheme
from .steps import Agreed, Opening, Sum, Union


class AllGatherSparse(Scheme):
    name = "agsparse"

    def open(self, call: Call, indices, values, numel) -> Opening:
        """Step 1: this rank's count k_r, for the agreement."""
        return Opening([indices.numel()], state=(indices.to(wire.index_dtype(numel)), values, numel))

    def finish(self, call: Call, opening: Opening, agreed: Agreed) -> Sum:
        comm = call.comm
        n, me = comm.world, comm.rank
        indices, values, numel = opening.state
        idx_dtype, val_dtype, width = indices.dtype, values.dtype, wire.row_width(values)
        si, sv = indices.element_size(), wire.entry_bytes(values)
        nnz = agreed.numbers[:, 0].tolist()
        sizes = [wire.coo_bytes(k, si, sv) for k in nnz]
        call.outcome.bytes_sent = (n - 1) * sizes[me]
        call.outcome.figures["nnz"] = nnz
        if sum(sizes) == 0:
            call.outcome.figures.update(union=0, gamma=0.0)
            return Union()

        with call.phase("gather", self.name):
            payload = wire.pack_coo(indices, values)
            gathered = torch.empty(sum(sizes), dtype=torch.uint8, device=payload.device)
            comm.all_gather_bytes(gathered, payload, sizes)
            del payload

        with call.phase("sum", self.name):
            pieces = [wire.unpack_coo(buf, k, idx_dtype, val_dtype, width)
                      for buf, k in zip(wire.split(gathered, sizes), nnz)]
            union_idx, union_val = ops.aggregate(torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces]),
                                                 numel)
        mean_nnz = sum(nnz) / n
        call.outcome.figures.update(union=union_idx.numel(), gamma=union_idx.numel() / mean_nnz if mean_nnz else 0.0)
        return Union([(union_idx, union_val)])

    # --- cost model ----------------------------------------------------------------------------------
    @staticmethod
    def phases(w: Workload, p: Profile) -> Dict[str, float]:
        """All-gather sparse, phase by phase (the phases a call records): scan; agreement (k_r); gather: the
        all-to-all of the repeated COO pieces (rank r sends (n-1) k_r (s_i + s_v) and receives
        sum_{q != r} k_q (s_i + s_v)); sum: unpacking the n pieces and merging all n k pairs (m each); scatter:
        the write-back of U."""
        n, k = w.n, w.nnz
        phases = dict(scan=terms.scan(w, p), agree=terms.agree(1, w, p), gather=0.0, sum=0.0)
        if n > 1 and sum(k) > 0:
            send = [(n - 1) * terms.coo(x, w) for x in k]
            recv = [terms.coo(terms.others(k, r), w) for r in range(n)]
            phases["gather"] = terms.alltoall(send, recv, terms.coo(max(k), w), w, p)
            phases["sum"] = n * terms.coo(max(k), w) / p.memory_bandwidth + sum(k) * p.merge_time
        return dict(phases, scatter=terms.write_back(w.union, w, p))

    @staticmethod
    def memory(w: Workload) -> float:
        """Local COO (k_r pairs); the gather: the packed piece, its n copies sent and every rank's piece received
        (sum k pairs); then the sum: the received pieces, their concatenation, the aggregate's scratch and the
        union. The gathered pieces grow with n: why all-gather based sync runs out of memory as workers grow."""
        n, k = w.n, w.nnz
        total = sum(k)
        local = max(terms.coo(x, w) for x in k)
        gather = (n + 1) * local + terms.coo(total, w)
        reduce = 2 * terms.coo(total, w) + terms.aggregate_bytes(total, w.union, w)
        return local + max(gather, reduce)
