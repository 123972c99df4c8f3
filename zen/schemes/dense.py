"""``scheme="dense"``: torch.distributed.all_reduce, the baseline. T = 2 (n-1)/n * M s_v / b (ring)."""
import torch

from .. import ops, wire
from ..cost import Profile, Workload, terms
from .base import Call, Scheme, phase_range
from .steps import Agreed, DenseSum, InPlace, Opening, Sum


class Dense(Scheme):
    name = "dense"

    def reduce_dense(self, call: Call, flat: torch.Tensor) -> None:
        # Profiler ranges only: a dense call records no phases (its formula is ``time``).
        with phase_range(self.name, "agree"):
            call.agree([])
        with phase_range(self.name, "all_reduce"):
            call.comm.all_reduce(flat, call.value_dtype)
        n = call.comm.world
        call.outcome.bytes_sent = 2 * (n - 1) * flat.numel() * (call.value_dtype or flat.dtype).itemsize // n

    def open(self, call: Call, indices, values, numel) -> Opening:
        return Opening([], state=(indices, values, numel))  # nothing to agree beyond the header

    def finish(self, call: Call, opening: Opening, agreed: Agreed) -> Sum:
        """The data summed dense: the call's own where it has it, else the entries scattered into a dense tensor
        first."""
        indices, values, numel = opening.state
        width = wire.row_width(values)
        n, size = call.comm.world, (call.value_dtype or values.dtype).itemsize
        call.outcome.bytes_sent = 2 * (n - 1) * numel * width * size // n
        with phase_range(self.name, "all_reduce"):
            if call.dense is not None:  # the non-zeros are not needed: the tensor itself is sent
                call.all_reduce_dense()
                return InPlace()
            dense = torch.zeros(numel * width, dtype=values.dtype, device=values.device)
            ops.scatter_(dense, indices, values)
            call.comm.all_reduce(dense, call.value_dtype)
        return DenseSum(dense)

    # --- cost model ----------------------------------------------------------------------------------
    @staticmethod
    def time(w: Workload, p: Profile) -> float:
        """Agreement + ring all-reduce: c_ar + 2 (n-1)/n M s_v / b_ar (COO input is densified first and
        found again after: 2 M s_v / mu, the scatter of k_r into its blocks, f per non-zero of the union)."""
        t = p.call_overhead + terms.agree(0, w, p)
        if w.n > 1:
            t += p.fixed("allreduce", w.n) + terms.dense_bytes(w.numel, w.n, w.value_size) / p.rate("allreduce")
        if not w.dense_input:
            t += 2 * w.numel * w.value_size / p.memory_bandwidth
            t += w.union * p.found_time
            t += max(terms.scatter(k, sum(row), w, p) for k, row in zip(w.nnz, w.block_counts))
        return t

    @staticmethod
    def memory(w: Workload) -> float:
        """In place: nothing for a dense tensor; COO input is densified (M s_v) and read back (U pairs)."""
        return 0.0 if w.dense_input else w.numel * w.value_size + terms.coo(w.union, w)
