"""``scheme="sparcml"``: SparCML's recursive doubling with incremental merging (Renggli et al., SC 2019).

Any world size n: with p the largest power of two <= n,

1. agree: all ranks exchange their non-zero counts (so the first messages need no size header);
2. fold: rank p + i (i < n - p) sends its data to rank i, which merges it;
3. recursive doubling over the p core ranks: at step s rank r exchanges its running sum with rank
   r XOR 2^s and both merge (lower group's data first, so both compute bit-identical sums);
4. unfold: rank i sends the result to rank p + i.

The running sum is kept sparse (COO) while its COO piece is smaller than the dense tensor, i.e. while
|union| <= M s_v / (s_i + s_v) (half of M for fp32 values with int32 indices), and switches to DENSE past
that break-even density; once dense it stays dense (the union only grows). Messages whose size the
receiver cannot know carry a step header [count, format] first (``wire.step_header``).

Cost (ZEN Eq. 2, power-of-two n): T = sum_{i=1..log2 n} min(gamma(2^(i-1)) M d (s_i + s_v), M s_v) / b plus
2 log2 n latencies; the messages grow with the union, so densification hurts every step.
"""
from typing import Dict, Optional, Tuple

import torch

from .. import ops, wire
from ..cost import Profile, Workload, terms
from ..geometry import doubling_plan
from .base import Call, Scheme
from .steps import Agreed, DenseSum, Opening, Sum, Union


class _Running:
    """A running sum: COO (indices ascending, unique) or DENSE (``dense`` set)."""

    __slots__ = ("indices", "values", "dense")

    def __init__(self, indices=None, values=None, dense=None):
        self.indices, self.values, self.dense = indices, values, dense

    @property
    def fmt(self) -> int:
        return wire.DENSE if self.dense is not None else wire.COO

    @property
    def count(self) -> int:
        return -1 if self.dense is not None else self.indices.numel()

    def pack(self) -> torch.Tensor:
        return wire.pack_dense(self.dense) if self.dense is not None else wire.pack_coo(self.indices, self.values)


def _message(count: float, w: Workload) -> float:
    """SparCML's message for a running union of ``count``: COO while smaller than dense, then dense."""
    return min(terms.coo(count, w), w.numel * w.value_size)


class SparCML(Scheme):
    name = "sparcml"

    def __init__(self, dense_threshold: Optional[float] = None):
        """``dense_threshold``: union density (|union| / M) past which the running sum goes dense;
        None (default) is the break-even density s_v / (s_i + s_v)."""
        if dense_threshold is not None and not 0.0 <= dense_threshold <= 1.0:
            raise ValueError(f"SparCML: dense_threshold must be None or in [0, 1]; got {dense_threshold!r}")
        self.dense_threshold = dense_threshold

    def agreement_settings(self):
        """The settings every rank must share (receivers infer formats from them); checked in the agreement."""
        return (self.dense_threshold,)

    # ------------------------------------------------------------------------------------------------
    def _is_dense(self, count: int, numel: int, si: int, sv: int) -> bool:
        if self.dense_threshold is not None:
            return count > self.dense_threshold * numel
        return wire.coo_bytes(count, si, sv) > wire.dense_piece_bytes(numel, sv)

    def open(self, call: Call, indices, values, numel) -> Opening:
        """Step 1: the entries ascending (summed locally where they are not), and their count k_r for the
        agreement."""
        indices = indices.to(wire.index_dtype(numel))
        if indices.numel() and not bool((indices[1:] > indices[:-1]).all()):
            with call.phase("merge", self.name):
                indices, values = ops.aggregate(indices, values, numel)  # ascending, as the merges keep it
        return Opening([indices.numel()], state=(indices, values, numel))

    def finish(self, call: Call, opening: Opening, agreed: Agreed) -> Sum:
        """Recursive doubling of the running sums (the module's docstring)."""
        comm = call.comm
        n, me = comm.world, comm.rank
        indices, values, numel = opening.state
        idx_dtype, val_dtype, width = indices.dtype, values.dtype, wire.row_width(values)
        si, sv = indices.element_size(), wire.entry_bytes(values)
        device = values.device
        nnz = agreed.numbers[:, 0].tolist()
        call.outcome.figures["nnz"] = nnz

        def as_sum(idx, val):
            if self._is_dense(idx.numel(), numel, si, sv):
                dense = torch.zeros(numel * width, dtype=val_dtype, device=device)
                ops.scatter_(dense, idx, val)
                return _Running(dense=dense)
            return _Running(idx, val)

        def merge(lower: _Running, higher: _Running) -> _Running:
            """The sum of two running sums; a pure function of (lower, higher), so partners agree bit for bit."""
            if lower.dense is None and higher.dense is None:
                return as_sum(*ops.aggregate(torch.cat([lower.indices, higher.indices]),
                                             torch.cat([lower.values, higher.values]), numel))
            if lower.dense is not None and higher.dense is not None:
                return _Running(dense=lower.dense + higher.dense)
            dense, sparse = (lower, higher) if lower.dense is not None else (higher, lower)
            out = dense.dense.clone()
            out.view(numel, width).index_put_((sparse.indices.long(),), sparse.values.view(-1, width), accumulate=True)
            return _Running(dense=out)

        def recv_buffer(count, fmt):
            size = wire.piece_bytes(fmt, count, numel, si, sv)
            return torch.empty(size, dtype=torch.uint8, device=device)

        def unpack(buf, count, fmt) -> _Running:
            if fmt == wire.DENSE:
                return _Running(dense=wire.unpack_dense(buf, numel * width, val_dtype))
            return _Running(*wire.unpack_coo(buf, count, idx_dtype, val_dtype, width))

        def initial_format(rank):
            return wire.DENSE if self._is_dense(nnz[rank], numel, si, sv) else wire.COO

        sent = [0]

        def step(peer, mine: Optional[_Running], send_header: bool,
                 known: Optional[Tuple[int, int]]) -> Optional[_Running]:
            """Send ``mine`` to ``peer`` (if given) and receive the peer's sum (unless ``known`` is False);
            ``known`` = (count, format) of the peer's message when this rank knows it, None when a header
            comes first."""
            with call.phase("exchange", self.name):
                receive = known is not False
                if send_header or (receive and known is None):
                    header_in = torch.empty(2, dtype=torch.int64, device=device)
                    comm.exchange([(peer, wire.step_header(mine.count, mine.fmt, device))] if send_header else [],
                                  [(peer, header_in)] if receive and known is None else [])
                    if receive and known is None:
                        known = tuple(header_in.tolist())
                    sent[0] += 16 if send_header else 0
                payload = mine.pack() if mine is not None else None
                buf = recv_buffer(*known) if receive else None
                comm.exchange([(peer, payload)] if payload is not None else [], [(peer, buf)] if receive else [])
                if payload is not None:
                    sent[0] += payload.numel()
                theirs = unpack(buf, *known) if receive else None
            return theirs

        running = as_sum(indices, values)
        p, steps = doubling_plan(n)
        if me >= p:  # fold into me - p, wait for the result
            step(me - p, running, send_header=False, known=False)
            running = step(me - p, None, send_header=False, known=None)
        else:
            folded = me + p < n
            if folded:
                extra = step(me + p, None, send_header=False, known=(nnz[me + p], initial_format(me + p)))
                with call.phase("merge", self.name):
                    running = merge(running, extra)
            for s in range(steps):
                peer = me ^ (1 << s)
                peer_known = None
                if s == 0 and peer + p >= n:  # the peer holds its own data only: size agreed already
                    peer_known = (nnz[peer], initial_format(peer))
                theirs = step(peer, running, send_header=(s > 0 or folded), known=peer_known)
                with call.phase("merge", self.name):
                    running = merge(running, theirs) if me < peer else merge(theirs, running)
            if folded:
                step(me + p, running, send_header=True, known=False)
        call.outcome.dense, call.outcome.bytes_sent = running.dense is not None, sent[0]
        if running.dense is None:  # a dense sum has lost the union's size
            mean_nnz = sum(nnz) / n
            call.outcome.figures.update(union=running.count, gamma=running.count / mean_nnz if mean_nnz else 0.0)
        if running.dense is not None:
            return DenseSum(running.dense)
        return Union([(running.indices, running.values)])

    # --- cost model ----------------------------------------------------------------------------------
    @staticmethod
    def phases(w: Workload, p: Profile) -> Dict[str, float]:
        """SparCML, phase by phase (the phases a call records): scan; agreement (k_r); exchange: the fold of
        the n - 2^L extra ranks, L = floor(log2 n) doubling steps, step s packing and moving the largest
        running union of level s (COO, or dense past break-even; its bytes / mu + its bytes / b_p2p) plus a
        step header where the size is not known, and the unfold of the union; merge: the two sums' pairs
        concatenated (their bytes / mu) and merged at m_2 per pair (two ascending runs), or dense adds
        (2 M s_v / mu); scatter: the write-back of the union (a copy, M s_v / mu, once it is dense)."""
        n, k = w.n, w.nnz
        pw, steps = doubling_plan(n)
        folded = n - pw
        dense_bytes_ = w.numel * w.value_size
        phases = dict(scan=terms.scan(w, p), agree=terms.agree(1, w, p), exchange=0.0, merge=0.0)

        def merge(a, b):
            both = a + b
            if _message(a, w) >= dense_bytes_ or _message(b, w) >= dense_bytes_:
                return 2 * dense_bytes_ / p.memory_bandwidth
            return (terms.coo(both, w) / p.memory_bandwidth + both * p.merge2_time
                    + (dense_bytes_ / p.memory_bandwidth if terms.coo(both, w) > dense_bytes_ else 0.0))

        def send(message_bytes):  # packed, then sent
            return message_bytes / p.memory_bandwidth + message_bytes / p.rate("p2p")

        if folded:
            phases["exchange"] += p.fixed("p2p", n) + max(send(_message(k[pw + i], w)) for i in range(folded))
            phases["merge"] += max(merge(k[i], k[pw + i]) for i in range(folded))
        for s in range(steps):
            level = w.doubling_unions[s]
            headers = 1 if (s > 0 or folded) else 0
            phases["exchange"] += (1 + headers) * p.fixed("p2p", n) + max(send(_message(u, w)) for u in level)
            phases["merge"] += max(merge(level[g], level[g ^ 1]) for g in range(len(level)))
        if folded:
            phases["exchange"] += 2 * p.fixed("p2p", n) + send(_message(w.union, w))
        dense_out = _message(w.union, w) >= dense_bytes_
        # copy out (dense input) or find the non-zeros (COO) of a dense union; else write the union back
        phases["scatter"] = dense_bytes_ / p.memory_bandwidth if dense_out else terms.write_back(w.union, w, p)
        return phases

    @staticmethod
    def memory(w: Workload) -> float:
        """At each merge of running sums a (this rank's) and b (the partner's): a, the received b, their
        concatenation, the aggregate's scratch and the merged sum (COO); a merge with a dense side holds three
        dense sums of M s_v. Merges: the fold (rank p + i into core rank i), then one per doubling step."""
        dense = w.numel * w.value_size
        k, levels = w.nnz, w.doubling_unions
        pw = len(levels[0])  # core ranks
        merges = [(k[i], k[pw + i], levels[0][i]) for i in range(w.n - pw)]
        merges += [(level[g], level[g ^ 1], levels[s + 1][g >> 1]) for s, level in enumerate(levels[:-1])
                   for g in range(len(level))]
        worst = max(terms.coo(x, w) for x in k)
        for a, b, merged in merges:
            if _message(a, w) >= dense or _message(b, w) >= dense or terms.coo(merged, w) > dense:
                worst = max(worst, 3 * dense)
            else:
                merging = terms.coo(a, w) + terms.coo(b, w) + terms.coo(a + b, w)
                worst = max(worst, merging + terms.aggregate_bytes(a + b, merged, w))
        return worst
