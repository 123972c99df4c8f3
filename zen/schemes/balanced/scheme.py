"""``scheme="zen"``: Balanced Parallelism (ZEN, OSDI 2025), the protocol's steps.

Every rank is the server of one partition of the index space, chosen by the level-1 hash h0:

1. partition: the local non-zeros are split by h0 (hierarchical hashing, ``ops.partition``) into one COO piece
   per server (:func:`push.partition`);
2. agree: all ranks exchange the piece sizes (and check they called with the same tensor); the pieces' first
   bytes ride in the agreement's own messages, in slots planned from the same call's counts last time
   (:mod:`.push`), so a repeated call spends one round on both;
3. push: what outgrew its slot follows in one more all-to-all (:func:`push.send_rest`), so equal indices
   meet on one server;
4. aggregate: server j sums what it received into U_j, the union of its partition (global top-k keeps its
   k / n largest sums);
5. pull: every server sends U_j to all, as COO indices or as a hash bitmap over I_j = {i : h0(i) = j},
   whichever is smaller, in rooms that every rank sizes alike from the agreed counts and the previous call's
   unions (:mod:`.pull`); every rank decodes the unions, which the caller writes into its output.

With ``dense_switch`` (the DDP hook's), a call whose agreed sizes say dense is cheaper (``cost.go_dense``) is
summed dense after step 2 instead; where it is small (``cost.goes_whole``), the next such call sends the
tensor whole in its agreement's slots and every rank sums the n copies, so it too takes one round.

The bytes of each step and their cost are in :mod:`.cost`.
"""
import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from ... import ops, wire
from ...cost import terms
from ...geometry import default_probes
from ..base import Call, Scheme, phase_range
from ..steps import Agreed, InPlace, Opening, Sum, Union
from . import cost, pull, push


def check_settings(owner: str, num_probes, table_factor, serial_factor, dense_threshold) -> None:
    """ValueError naming the first bad setting of the hash partition and the dense switch."""
    if num_probes is not None and (not isinstance(num_probes, int) or not 0 <= num_probes <= 16):
        raise ValueError(f"{owner}: num_probes must be None or an int in [0, 16]; got {num_probes!r}")
    if not 1.0 <= table_factor <= 64.0:
        raise ValueError(f"{owner}: table_factor must be in [1, 64]; got {table_factor!r}")
    if not 0.0 <= serial_factor <= 64.0:
        raise ValueError(f"{owner}: serial_factor must be in [0, 64]; got {serial_factor!r}")
    if dense_threshold is not None and not 0.0 <= dense_threshold <= 1.0:
        raise ValueError(f"{owner}: dense_threshold must be None or in [0, 1]; got {dense_threshold!r}")


def _numbers(counts: List[int], gamma: float, fractions: List[float]) -> List[int]:
    """This rank's numbers in the agreement: its n counts, gamma in millionths and the n union fractions four
    to an int64 (``wire.pack_fractions``): n + 1 + ceil(n / 4), within the row's room at any n."""
    return counts + [round(gamma * 1e6)] + wire.pack_fractions(fractions)


def _agreed(agreed: torch.Tensor, n: int):
    """(counts[p][j] of every rank p (int64 [n, n]), gamma, fractions) from the agreement's columns; gamma and the
    fractions are rank 0's, so every rank sees the same."""
    return agreed[:, :n], agreed[0, n].item() / 1e6, wire.unpack_fractions(agreed[0, n + 1:].tolist(), n)


@dataclass(frozen=True)
class _Format:
    """How one call's entries travel: numel entries, index and value dtypes (values on the wire in ``on_wire``,
    summed in ``val_dtype``), b values per entry (``width``), s_i and s_v bytes per index and per entry."""

    numel: int
    idx_dtype: torch.dtype
    val_dtype: torch.dtype
    on_wire: torch.dtype
    width: int
    si: int
    sv: int


@dataclass
class _Opened:
    """What step 1 leaves for the rest: the entries' format, this rank's pieces, the tensor where the slots hold
    it whole, and the pairs that took the partition's exact fallback."""

    entries: _Format
    pieces: list
    whole: Optional[torch.Tensor]
    fallback: int


class BalancedParallelism(Scheme):
    name = "zen"
    phases = staticmethod(cost.phases)
    memory = staticmethod(cost.memory)

    def __init__(self, num_probes: Optional[int] = None, table_factor: float = 2.0, serial_factor: float = 0.1,
                 dense_switch: bool = False, dense_threshold: Optional[float] = None):
        """``num_probes``: level-2 probes of the hierarchical hash; 0 partitions by an exact counting sort
        instead; None (default) picks by device (:func:`default_probes`). ``dense_switch``: after the size
        exchange, send the whole tensor dense (all ranks alike) when the cost formulas say dense is cheaper,
        or when the mean density exceeds ``dense_threshold``."""
        check_settings("BalancedParallelism", num_probes, table_factor, serial_factor, dense_threshold)
        self.num_probes = num_probes
        self.table_factor = table_factor
        self.serial_factor = serial_factor
        self.dense_switch = dense_switch
        self.dense_threshold = dense_threshold
        # (ranks, entries, row width) -> (gamma, [|U_j| / R_j]) of the last call: the dense switch's gamma and
        # the expected unions that size the pull's rooms
        self.history = {}

    def agreement_settings(self):
        """The settings every rank must share (they decide the protocol); checked in the agreement."""
        return (self.dense_switch, self.dense_threshold)

    def open(self, call: Call, indices, values, numel) -> Opening:
        """Step 1 (partition); what step 2 agrees: the counts, gamma and the union fractions of the last call of
        this shape (the dense switch's and the pull rooms' inputs), and the pieces (or the tensor whole) to ride
        in the agreement's slots."""
        comm = call.comm
        n = comm.world
        idx_dtype, val_dtype, width = wire.index_dtype(numel), values.dtype, wire.row_width(values)
        # Values travel in call.value_dtype where given; the owners sum them in the tensor's own dtype.
        indices, values = indices.to(idx_dtype), values.to(call.value_dtype or val_dtype)
        entries = _Format(numel, idx_dtype, val_dtype, values.dtype, width,
                          torch.empty(0, dtype=idx_dtype).element_size(), wire.entry_bytes(values))

        # 1. partition: pieces[j] = this rank's pairs for server j.
        with call.phase("partition", self.name):
            probes = self.num_probes if self.num_probes is not None else default_probes(indices.device)
            pieces, counts, fallback = push.partition(indices, values, n, comm.seed, probes, self.table_factor,
                                                      self.serial_factor)
            whole = push.whole(call)  # the tensor, where the plan's slots are to hold it whole
        last = self.history.get((n, numel, width), (float(n), [1.0] * n))
        return Opening(_numbers(counts, *last), pieces if whole is None else [wire.pack_dense(whole)] * n,
                       _Opened(entries, pieces, whole, fallback))

    def finish(self, call: Call, opening: Opening, agreed: Agreed) -> Sum:
        """Steps 2 (what was agreed: counts[p][j] = pairs rank p sends to server j, and rank 0's gamma and
        fractions, alike on every rank) to 5."""
        comm = call.comm
        n, me = comm.world, comm.rank
        entries, pieces, whole = opening.state.entries, opening.state.pieces, opening.state.whole
        numel, idx_dtype, on_wire, width, si, sv = (entries.numel, entries.idx_dtype, entries.on_wire, entries.width,
                                                   entries.si, entries.sv)
        counts, gamma, fractions = _agreed(agreed.numbers, n)
        arrived, planned = agreed.arrived, agreed.slots
        in_slots = sum(planned[me])
        nnz = counts.sum(1).tolist()
        loads = counts.sum(0).tolist()  # R_j, the pairs server j receives
        call.outcome.figures.update(nnz=nnz, imbalance=max(loads) * n / max(1, sum(loads)),
                                    partition_fallback=opening.state.fallback)
        if self.dense_switch and call.dense is not None and cost.go_dense(nnz, numel, n, si, sv, gamma,
                                                                          self.dense_threshold):
            with phase_range(self.name, "dense"):  # a range only: its seconds go to the next phase, as before
                push.sum_dense(call, whole, arrived, numel * sv)
            call.outcome.dense = True
            call.outcome.bytes_sent = in_slots if whole is not None else terms.dense_bytes(numel, n, sv)
            call.outcome.figures["whole_in_agreement"] = whole is not None
            return InPlace()

        # 3. push: what outgrew its slot.
        with call.phase("push", self.name):
            sent = push.send_rest(call, pieces, arrived, planned, counts, si, sv, whole is not None)

        # 4. aggregate my partition.
        with call.phase("aggregate", self.name):
            received = [wire.unpack_coo(buf, c, idx_dtype, on_wire, width)
                        for c, buf in zip(counts[:, me].tolist(), sent.received(me))]
            union_idx, union_val = ops.aggregate(torch.cat([p[0] for p in received]),
                                                 torch.cat([p[1] for p in received]).to(entries.val_dtype), numel, n,
                                                 comm.seed, me)
            if call.keep is not None:
                union_idx, union_val = self._keep_largest(union_idx, union_val, math.ceil(call.keep / n))

        # 5. pull, in the smaller format, in rooms every rank sized beforehand (no round for sizes); decode.
        with call.phase("encode", self.name):
            piece, fmt = pull.encode(comm, union_idx, union_val.to(on_wire), numel, si, sv)
        with call.phase("pull", self.name):
            bounds = loads if call.keep is None else [min(r, math.ceil(call.keep / n)) for r in loads]
            rooms = pull.rooms(comm, bounds, fractions, loads, numel, si, sv, union_idx.device)
            pulled = pull.exchange(comm, union_idx.numel(), fmt, piece, rooms, bounds, numel, si, sv)
        union = sum(count for count, _ in pulled.headers)
        mean_nnz = sum(nnz) / n
        if mean_nnz > 0:
            fractions = [c / r if r else 1.0 for (c, _), r in zip(pulled.headers, loads)]
            self.history[(n, numel, width)] = (union / mean_nnz, fractions)
        call.outcome.bytes_sent = in_slots + sum(sent.overflow[me]) + pulled.sent
        call.outcome.figures.update(union=union, gamma=union / mean_nnz if mean_nnz else 0.0, pull_format=fmt,
                                    pull_overflow=pulled.overflow, **sent.figures(me))
        with call.phase("decode", self.name):
            out = []
            for j, (count, fmt_j) in enumerate(pulled.headers):
                idx, val = pull.decode(comm, pulled.piece(j), j, count, fmt_j, numel, idx_dtype, on_wire, width)
                out.append((idx, val.to(entries.val_dtype)))
            if call.keep is not None:
                call.outcome.kept = torch.cat([idx for idx, _ in out])
        # global top-k: the owners may have dropped some of this rank's entries, which are not in the sum
        return Union(out, covers_local=call.keep is None)

    @staticmethod
    def _keep_largest(union_idx, union_val, m: int):
        """Global top-k on this owner's partition: its m sums of largest magnitude (rows: by their L1 norm).
        The hash spreads indices evenly over the partitions, so the owners' top k/n are the top k of the whole
        sum up to sampling noise, and no round is spent on a global threshold."""
        if union_idx.numel() <= m:
            return union_idx, union_val
        score = union_val if union_val.dim() == 1 else union_val.abs().sum(1)
        at = ops.topk_select(score.contiguous(), m)[0].long()
        return union_idx[at], union_val[at]
