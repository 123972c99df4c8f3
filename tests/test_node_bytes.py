"""The node protocol's cross-node bytes against flat zen's (``hierarchy="node"`` against ``"flat"``, scheme zen),
counted where zen's collectives reach torch.distributed, against figures computed here from the wire formats
(docs/protocol.md, zen/wire.py's docstring), never from zen.cost or a call's own stats.

n = N G ranks: N nodes of G ranks (``local_size=G``: node k holds ranks kG .. kG + G - 1). A rank's
cross-node bytes are those it hands the backend for ranks on other nodes: test_wire_bytes's tap (:class:`Wire`,
:func:`_sent`), with every collective's pieces attributed to their destinations (:func:`to_peers`).

Theory. A tensor of M fp32 values, int32 indices: an entry travels as 4 + 4 bytes, COO(c) = pad(4c) + pad(4c)
(pad: up to 8 bytes). S_r: the entries rank r holds, S_k the union of node k's; owner j of an entry: a rank.

* Flat: h_n partitions the tensor over the n ranks. Rank r pushes its piece c[r][j] = |S_r owned by j| to
  each owner j; owner j pulls its union U_j to every other rank. Cross-node, node k sends
      push  sum over r in k, j off node k: COO(c[r][j])
      pull  sum over j in k: (n - G) (16 + COO(U_j))      (a [count, format] head, then the union)
  since each union goes to the G ranks of each of the N - 1 other nodes: n - G = G (N - 1) ranks.
* Node: after the sum inside the node, local rank l holds node k's summed shard l (S_k within shard l) and runs
  zen over cross group l (local rank l of every node) on that shard: h_N partitions the shard over the N nodes.
  Cross-node, node k sends
      push  sum over l, K != k: COO(c'[k][KG + l]),   c'[k][j] = |S_k owned by j|  (owner j = KG + l)
      pull  sum over j in k: (N - 1) (16 + COO(U_j))
* Pull: the node protocol carries each union once to each other node, flat G times (once to each of its
  ranks), so node pull = flat pull / G wherever node k owns the same union entries in both protocols; in
  general the same holds summed over all nodes (both split the one union, |U| = sum_j U_j), up to the pieces'
  padding and the format each piece takes (COO, or a bitmap over I_j where smaller: |I_j| ~ M / n in both).
* Push: flat sends every rank's pieces, the node its summed union once. Where a node's G ranks hold the same
  entries, c[r][j] = c'[k][j] for each r in k, so node push = flat push / G; where they are disjoint,
  c'[k][j] = sum over r in k of c[r][j], so node push = flat push (padding aside); in between, strictly
  between.
* The agreement: a row of 8 (13 + 1 + max(extra, n + ceil(n / 4) + 8)) bytes to each of the n - G off-node
  ranks in flat; in the node protocol the same with N, to the N - 1 other nodes' ranks of the cross group.

The wire adds slots (test_wire_bytes's docstring): the first call of a shape pushes exact COO pieces after a
plain agreement (extra = 2n + 1 numbers) and pulls a slot of 16 + piece(R_j), R_j the pairs owner j received
(flat counts every rank's copy, the node each node's summed copy); the steady state (the third call) pushes
each piece in a slot of COO(slot(c)) after the agreement's row (extra = n + 1 + ceil(n / 4)),
slot(x) = ceil(1.02 x + 2 sqrt(x) + 4), and pulls 16 + piece(min(R_j, slot(f_j R_j))), f_j = U_j / R_j of
the previous call in 15 bits: a slot of about the union, clipped at R_j (which the node's sum makes smaller).

The inputs make the theory exact: every non-zero is one whose owner is the same rank in both protocols
(h_n(i) = KG + l, l the shard of i, K = h_N(i - shard l's start)), so both protocols give owner j the same
union U_j; and every piece's count is even (COO(c) = 8c, no padding). Per owner j, a_j entries are held by all
ranks, b[k][j] by every rank of node k, d[r][j] by rank r alone:
    "same"      a, b only: the ranks of a node hold identical entries (the nodes partly overlap)
    "disjoint"  d only: no two ranks share an entry
    "mixed"     all three
The tests check, for world 4 (2 nodes x 2) and world 6 (3 nodes x 2, 2 nodes x 3):
    - every rank's cross-node bytes, exchange by exchange, equal the figures of the formats, in both protocols,
      on the first call and in the steady state; each pull message is headed [U_j, COO], the same U_j in both;
    - pull, per node: the unions carried (16 + COO(U_j) a message) node = flat / G exactly; on the wire, in
      the steady state, node = flat / G exactly in "disjoint" (R_j = U_j: f_j = 1, each slot the union), else
      between the unions and flat's slots / G (give or take one entry a message from f_j's rounding); on the
      first call node = flat / G in "disjoint", node < flat / G where the node's sum shrinks R_j;
    - push, per node: node = flat / G in "same" (first call and steady: the same pieces, the same slots), node
      = flat in "disjoint" on the first call (exact COO), flat / G < node < flat otherwise (in the steady
      state one slot's constant part for the node's G pieces);
    - each node's cross-node bytes in all are fewer in the node protocol;
    - and the sum is exact against dist.all_reduce, in both protocols, on every call.
"""
import functools
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from test_wire_bytes import HEADER_INTS, SLOT_HEADER, Wire, _nbytes, _sent, coo, pad, room, slot, zen_extra

SV = 4  # fp32
CASES = ("same", "disjoint", "mixed")
SETUPS = [(4, 2), (6, 2), (6, 3)]  # (n, G); each world's processes run all its G
GROUPINGS = {n: tuple(g for m, g in SETUPS if m == n) for n, _ in SETUPS}


def size(case, g):
    """The tensor's fp32 values: about 0.5% of them non-zero, so every union travels as COO (a bitmap over I_j
    would be larger); a size of its own per case and G, so that no call finds another's history (unions, slots)."""
    return 48000 + 24 * CASES.index(case) + 96 * g


# --- the inputs ----------------------------------------------------------------------------------------------
def cells(case, n, g):
    """(a[j], b[k][j], d[r][j]): per owner j, the entries all ranks hold, node k's ranks hold, rank r alone
    holds (even counts, varying with j, k and r so that a piece sent to the wrong owner shows)."""
    nodes = n // g
    a = [2 * (8 + 3 * j) if case != "disjoint" else 0 for j in range(n)]
    b = [[(2 * (4 + k + j) if case == "same" else 2 * (3 + k)) if case != "disjoint" else 0 for j in range(n)]
         for k in range(nodes)]
    d = [[(2 * (3 + r + j) if case == "disjoint" else 2 * (2 + (r + j) % 3)) if case != "same" else 0
          for j in range(n)] for r in range(n)]
    return a, b, d


def bounds(numel, g):
    """The node protocol's shards of a 1-D tensor (zen.hierarchy.plan.shard_bounds of one segment)."""
    return [l * numel // g for l in range(g + 1)]


@functools.lru_cache(maxsize=None)
def owners(numel, n, g, seed):
    """(flat owner of each index, node-protocol owner of each index, |I_j| flat, |I_j| node)."""
    from zen import ops

    nodes, cut = n // g, bounds(numel, g)
    flat = ops.hash_partition(torch.arange(numel, dtype=torch.int32), n, seed).long()
    node = torch.empty(numel, dtype=torch.long)
    for l in range(g):  # local rank l's shard, partitioned over the N nodes by its shard-relative index
        lo, hi = cut[l], cut[l + 1]
        node[lo:hi] = ops.hash_partition(torch.arange(hi - lo, dtype=torch.int32), nodes, seed).long() * g + l
    return flat, node, torch.bincount(flat, minlength=n).tolist(), torch.bincount(node, minlength=n).tolist()


def held(case, n, g, seed):
    """Every rank's entries (ascending): drawn, per owner j, from the indices whose owner is j in both protocols."""
    flat, node, _, _ = owners(size(case, g), n, g, seed)
    a, b, d = cells(case, n, g)
    out = [[] for _ in range(n)]
    for j in range(n):
        pool = torch.nonzero((flat == j) & (node == j)).view(-1).tolist()
        at = 0

        def take(count):
            nonlocal at
            assert at + count <= len(pool), (j, len(pool))
            at += count
            return pool[at - count:at]

        shared = take(a[j])
        per_node = [take(b[k][j]) for k in range(n // g)]
        for r in range(n):
            out[r] += shared + per_node[r // g]
        for r in range(n):
            out[r] += take(d[r][j])
    return [torch.tensor(sorted(e), dtype=torch.long) for e in out]


def tensor_for(case, rank, n, g, seed):
    at = held(case, n, g, seed)[rank]
    x = torch.zeros(size(case, g))
    x[at] = torch.randint(1, 8, (at.numel(),), generator=torch.Generator().manual_seed(rank)).float()
    return x


# --- the counting: every collective's bytes per destination --------------------------------------------------
def to_peers(name, args, kwargs):
    """{global rank: (bytes this rank hands the backend for it, its piece's first two int64s or None)}; for the
    collectives whose bytes have no one destination (all_reduce, broadcast, reduce_scatter): {None: (bytes,)}."""
    group = kwargs.get("group") or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()

    def head(t):
        flat = t.reshape(-1).view(torch.uint8)
        return flat[:SLOT_HEADER].clone().view(torch.int64).tolist() if flat.numel() >= SLOT_HEADER else None

    if name == "all_to_all_single":
        send = args[1]
        splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
        size = send.element_size()
        splits = [s * size for s in splits] if splits else [_nbytes(send) // len(ranks)] * len(ranks)
        flat, out, at = send.reshape(-1).view(torch.uint8), {}, 0
        for q, nbytes in enumerate(splits):
            if ranks[q] != me:
                out[ranks[q]] = (nbytes, head(flat[at:at + nbytes]))
            at += nbytes
        return out
    if name in ("isend", "send"):
        tensor = args[0] if args else kwargs["tensor"]
        if kwargs.get("group_dst") is not None:
            dst = ranks[kwargs["group_dst"]]
        else:
            dst = kwargs.get("dst", args[1] if len(args) > 1 else None)
        return {dst: (_nbytes(tensor), head(tensor))}
    if name == "batch_isend_irecv":
        out = {}
        for op in args[0]:
            if op.op in (dist.isend, dist.send):
                nbytes, first = out.get(op.peer, (0, None))
                out[op.peer] = (nbytes + _nbytes(op.tensor), first or head(op.tensor))
        return out
    if name in ("all_gather_into_tensor", "all_gather"):
        return {r: (_nbytes(args[1]), None) for r in ranks if r != me}
    nbytes, _ = _sent(name, args, kwargs)
    return {None: (nbytes, None)} if nbytes else {}


class PeerWire(Wire):
    """test_wire_bytes's Wire, which also logs each collective's bytes by destination (``peers``)."""

    def __init__(self):
        self.peers = []
        super().__init__()

    def _record(self, name, args, kwargs):
        if self.on:
            self.peers.append(to_peers(name, args, kwargs))
        super()._record(name, args, kwargs)

    def take(self):
        """[(the Wire's log entry, the global ranks of its group, its bytes by destination)], cleared."""
        peers, groups, self.peers = self.peers, self.groups, []
        return list(zip(super().take(), groups, peers))


# --- the ranks -----------------------------------------------------------------------------------------------
def _counted(rank, world, groupings):
    import zen
    from zen.transport import get_comm

    wire = PeerWire()
    zen.all_reduce(torch.ones(3), hierarchy="flat")
    out = {"seed": get_comm().seed}
    for g in groupings:
        zen.all_reduce(torch.ones(3), hierarchy="node", local_size=g)  # the nodes found, the sub-groups made
        out[g] = _measured(rank, world, g, wire)
    return out


def _measured(rank, world, g, wire):
    """{(case, mode): [(exact against dist.all_reduce, [(collective, {peer on another node: (bytes, head)})])]}
    of the three calls of each case in each protocol, at G = ``g``."""
    import zen

    seed = int(os.environ["ZEN_SEED"])
    node_of = lambda r: r // g  # noqa: E731
    out = {}
    for case in CASES:
        x0 = tensor_for(case, rank, world, g, seed)
        expected = x0.clone()
        dist.all_reduce(expected)
        for mode in ("flat", "node"):
            nodes = dict(hierarchy=mode, local_size=g if mode == "node" else None)
            separator = 5 + 10 * g + 2 * CASES.index(case) + (mode == "node")  # a size used nowhere else
            zen.all_reduce(torch.zeros(separator), scheme="dense", **nodes)  # so no plan filed after it
            calls = []
            for _ in range(3):  # the first call of the shape, then the steady state (the third)
                x = x0.clone()
                wire.on = True
                zen.all_reduce(x, scheme="zen", **nodes)
                wire.on = False
                log = []
                for (name, nbytes, _), group, peers in wire.take():
                    # the destinations account for every byte the tap of test_wire_bytes counts; a collective
                    # whose bytes have no one destination runs inside the node only
                    assert sum(b for b, _ in peers.values()) == nbytes, (name, nbytes, peers)
                    assert None not in peers or {node_of(r) for r in group} == {node_of(rank)}, (name, group)
                    cross = {r: v for r, v in peers.items() if r is not None and node_of(r) != node_of(rank)}
                    if cross:
                        log.append((name, cross))
                calls.append((torch.equal(x, expected), log))
            out[(case, mode)] = calls
    return out


@pytest.fixture(scope="module", params=SETUPS, ids=lambda s: f"{s[0] // s[1]}nodes_x{s[1]}")
def counted(request):
    n, g = request.param
    records = _records(n)
    seed = int(os.environ["ZEN_SEED"])
    assert all(r["seed"] == seed for r in records)  # the groups' seed is the one the suite fixed
    return n, g, [r[g] for r in records], Figures(n, g, seed)


@functools.lru_cache(maxsize=None)
def _records(n):
    """Every rank's records of world ``n``, at each of its G: one start of the processes per world."""
    return run_ranks(n, _counted, GROUPINGS[n], timeout=240)


# --- the expected figures ------------------------------------------------------------------------------------
class Figures:
    """Pieces, unions and the expected cross-node bytes of each case, per rank, from the wire formats."""

    def __init__(self, n, g, seed):
        self.n, self.g, self.nodes = n, g, n // g
        self.seed = seed

    def counts(self, case):
        """(c[r][j] flat pieces, c'[k][j] the node's summed pieces, U[j])."""
        n, g = self.n, self.g
        a, b, d = cells(case, n, g)
        c = [[a[j] + b[r // g][j] + d[r][j] for j in range(n)] for r in range(n)]
        summed = [[a[j] + b[k][j] + sum(d[r][j] for r in range(k * g, k * g + g)) for j in range(n)]
                  for k in range(self.nodes)]
        union = [a[j] + sum(b[k][j] for k in range(self.nodes)) + sum(d[r][j] for r in range(n)) for j in range(n)]
        return c, summed, union

    def piece(self, count, set_size):
        """A pull slot's piece of ``count`` entries: COO or a bitmap over I_j, whichever is smaller."""
        return min(coo(count, SV), pad((set_size + 7) // 8) + pad(count * SV))

    def expected(self, case, mode, rank, steady):
        """The cross-node bytes of ``rank``'s exchanges: [agreement, push, pull] on the first call,
        [agreement and push, pull] in the steady state; and the pull's head [U_j, COO] in each message."""
        n, g = self.n, self.g
        c, summed, union = self.counts(case)
        sets = owners(size(case, g), n, g, self.seed)  # |I_j| of each protocol's owner j: [2] flat, [3] node
        k, l = divmod(rank, g)
        if mode == "flat":
            world, pieces = n, {j: c[rank][j] for j in range(n) if j // g != k}
            received, set_size = sum(c[r][rank] for r in range(n)), sets[2][rank]
        else:  # the cross group of local rank l: one rank per node, owner KG + l
            world, pieces = self.nodes, {K * g + l: summed[k][K * g + l] for K in range(self.nodes) if K != k}
            received, set_size = sum(summed[K][rank] for K in range(self.nodes)), sets[3][rank]
        peers, u = len(pieces), union[rank]
        if not steady:
            agreement = peers * 8 * (HEADER_INTS + max(2 * world + 1, room(world)))
            push = sum(coo(x, SV) for x in pieces.values())
            return [agreement, push, peers * (SLOT_HEADER + self.piece(received, set_size))], [u, 0]
        row = 8 * (HEADER_INTS + max(zen_extra(world), room(world)))
        f = round(u / received * 32767) / 32767  # |U_j| / R_j of the previous call, as it travels (15 bits)
        pull = peers * (SLOT_HEADER + self.piece(min(received, slot(f * received)), set_size))
        return [sum(row + coo(slot(x), SV) for x in pieces.values()), pull], [u, 0]

    def rows(self, mode, steady):
        """The agreement rows among a rank's first exchange's cross-node bytes, in the steady state."""
        world = self.n if mode == "flat" else self.nodes
        peers = self.n - self.g if mode == "flat" else self.nodes - 1
        return peers * 8 * (HEADER_INTS + max(zen_extra(world), room(world))) if steady else 0


def exchanges(log):
    return [sum(b for b, _ in cross.values()) for _, cross in log]


def per_node(n, g, records, case, mode, call):
    """Per node: its ranks' counted cross-node bytes summed, exchange by exchange: [agreement, push, pull] on
    the first call (``call`` 0), [agreement and push, pull] in the steady state (2)."""
    out = []
    for k in range(n // g):
        total = None
        for r in range(k * g, k * g + g):
            sent = exchanges(records[r][(case, mode)][call][1])
            total = sent if total is None else [a + b for a, b in zip(total, sent)]
        out.append(total)
    return out


# --- the tests -----------------------------------------------------------------------------------------------
def test_the_sum_is_exact_in_both_protocols(counted):
    n, _, records, _ = counted
    for rank in range(n):
        for case in CASES:
            for mode in ("flat", "node"):
                assert all(exact for exact, _ in records[rank][(case, mode)]), (rank, case, mode)


@pytest.mark.parametrize("mode", ["flat", "node"])
def test_cross_node_bytes_are_the_wire_formats(counted, mode):
    """Every rank's cross-node bytes, exchange by exchange, as the formats say; every pull message headed by
    the owner's union count (COO), the same union in both protocols; and in the node protocol every cross-node
    byte goes to the rank's own cross group (local rank l of the other nodes)."""
    n, g, records, figures = counted
    for case in CASES:
        for rank in range(n):
            for call, steady in ((0, False), (2, True)):
                log = records[rank][(case, mode)][call][1]
                want, head = figures.expected(case, mode, rank, steady)
                assert exchanges(log) == want, (case, mode, rank, call, exchanges(log), want)
                assert all(name == "all_to_all_single" for name, _ in log), log  # direct below 12 ranks
                assert {tuple(h) for _, h in log[-1][1].values()} == {tuple(head)}, (case, rank, log[-1])
                if mode == "node":
                    assert all(r % g == rank % g for _, cross in log for r in cross), (case, rank, log)


def test_pull_carries_the_union_once_per_node(counted):
    """Steady state: each node's cross-node pull carries flat's divided by G. The unions its messages hold (their
    heads' counts: 16 + COO(U_j) each) exactly; the messages' bytes exactly where the node's ranks are disjoint
    (R_j = U_j in both: f_j = 1, each slot the union), else within the slots: at least the unions, at most
    flat's / G but for f_j's rounding (one entry, 16 bytes, a message: G (n - G) messages in flat's node).
    The first call's pull, sized from the pairs received, is flat's / G where the ranks are disjoint (R_j = U_j
    in both), less where they overlap (the node's sum leaves R'_j = R_j / G)."""
    n, g, records, _ = counted
    for case in CASES:
        flat, node = (per_node(n, g, records, case, mode, 2) for mode in ("flat", "node"))
        for k in range(n // g):
            flat_union, node_union = (sum(SLOT_HEADER + coo(head[0], SV) for r in range(k * g, k * g + g)
                                          for _, head in records[r][(case, mode)][2][1][-1][1].values())
                                      for mode in ("flat", "node"))
            assert node_union * g == flat_union, (case, k, node_union, flat_union)
            if case == "disjoint":
                assert node[k][-1] * g == flat[k][-1] == flat_union, (case, k, node[k], flat[k], flat_union)
            else:
                assert flat_union <= node[k][-1] * g <= flat[k][-1] + 16 * g * (n - g), (case, k, node[k], flat[k])
        flat, node = (per_node(n, g, records, case, mode, 0) for mode in ("flat", "node"))
        for k in range(n // g):
            if case == "disjoint":
                assert node[k][-1] * g == flat[k][-1], (case, k, node[k], flat[k])
            else:
                assert node[k][-1] * g < flat[k][-1], (case, k, node[k], flat[k])


def test_push_carries_the_nodes_summed_union(counted):
    """The node's push against flat's, per node: flat's / G where the node's ranks hold the same entries, flat's
    where they are disjoint (exact on the first call, whose pieces are exact COO; below flat's in the steady
    state, whose slots have a constant part per piece), strictly between where they partly overlap."""
    n, g, records, figures = counted
    for call, steady in ((0, False), (2, True)):
        at = 1 if not steady else 0  # the push's place among the exchanges
        for case in CASES:
            flat = [x[at] - figures.rows("flat", steady) * g for x in per_node(n, g, records, case, "flat", call)]
            node = [x[at] - figures.rows("node", steady) * g for x in per_node(n, g, records, case, "node", call)]
            for k in range(n // g):
                if case == "same":
                    assert node[k] * g == flat[k], (case, call, k, node[k], flat[k])
                elif case == "disjoint" and not steady:
                    assert node[k] == flat[k], (case, call, k, node[k], flat[k])
                else:
                    assert flat[k] < node[k] * g and node[k] < flat[k], (case, call, k, node[k], flat[k])


def test_node_protocol_sends_fewer_cross_node_bytes_in_all(counted):
    """Each node's cross-node bytes in all (agreement, push, pull) are fewer in the node protocol, on the first
    call and in the steady state."""
    n, g, records, _ = counted
    for case in CASES:
        for call in (0, 2):
            flat = per_node(n, g, records, case, "flat", call)
            node = per_node(n, g, records, case, "node", call)
            for k in range(n // g):
                assert sum(node[k]) < sum(flat[k]), (case, call, k, node[k], flat[k])
