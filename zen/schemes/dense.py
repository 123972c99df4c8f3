"""``scheme="dense"``: torch.distributed.all_reduce, the baseline. T = 2 (n-1)/n * M s_v / b (ring)."""
import torch
import torch.distributed as dist

from .. import ops
from .base import Call, Scheme


class Dense(Scheme):
    name = "dense"

    def reduce_dense(self, call: Call, flat: torch.Tensor) -> None:
        call.agree([])
        dist.all_reduce(flat, group=call.comm.group)
        n = call.comm.world
        call.stats["bytes_sent"] = 2 * (n - 1) * flat.numel() * flat.element_size() // n

    def reduce_coo(self, call, indices, values, numel):
        dense = torch.zeros(numel, dtype=values.dtype, device=values.device)
        ops.scatter_(dense, indices, values)
        self.reduce_dense(call, dense)
        return [ops.nonzero(dense)]
