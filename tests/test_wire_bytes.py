"""Bytes on the wire, counted where zen's collectives reach torch.distributed, against figures computed here from
the wire formats of docs/protocol.md and zen/wire.py's docstring (never from zen.cost or a call's own stats).

Every rank wraps torch.distributed's collectives (:class:`Wire`) and counts, per call, the bytes it hands to the
backend for its peers: an all-to-all's pieces for the other ranks, a point-to-point send's tensor, the tensor an
all-reduce is called with. The hash partition h0 (``zen.ops.hash_partition``, the one partition rule, at the
group's seed: ZEN_SEED, fixed by conftest.py) says which partition every index falls in; from it and the known
inputs the test computes each rank's pieces, unions and messages.

Figures, with n ranks, int32 indices (s_i = 4), s_v the bytes of an entry (a value, or a row of b values),
pad(x) = x rounded up to 8 bytes, COO(k) = pad(k s_i) + pad(k s_v), BITMAP_j(k) = pad(ceil(|I_j| / 8)) + pad(k s_v):

* every call's agreement: a row of L int64s to each peer, L = 13 header fields + 1 + max(extra, room), the room
  n + ceil(n / 4) + 8 (zen's n counts, gamma and n union fractions four to an int64, and 8 more);
* dense: the agreement (extra = 0), then dist.all_reduce called once with the whole tensor (M s_v bytes; the
  backend's ring then moves 2 (n-1)/n of that per rank);
* agsparse: the agreement (extra = 1), then its COO piece to each peer: (n-1) COO(k_me);
* zen, first call of a shape (no plan, no history): the agreement (extra = 2n + 1) as a plain all-gather, the
  push as exact COO pieces, then the pull: a slot of 16 + min(COO, BITMAP_me)(R_me) bytes to each peer, R_j the
  pairs that partition j received (the bound of its union, what the first call sizes the slot by);
* zen, steady state (the same call a third time): the push rides in the agreement, each message the row and a
  slot of COO(slot(c[me][j])) bytes, slot(x) = ceil(1.02 x + 2 sqrt(x) + 4); the pull's slot is
  16 + min(COO, BITMAP_me)(min(R_me, slot(f R_me))), f = |U_me| / R_me of the previous call as it travels
  (int64 millionths). Two exchanges in all.
* sparcml: the agreement (extra = 1), then point-to-point messages (isend) of recursive doubling, p the largest
  power of two <= n: rank p + i sends its COO piece to rank i (no header: its count is agreed) and receives the
  result; core rank r, at step s, sends its running sum over the ranks of its level-s group (core ranks c with
  c >> s == r >> s, and their folded partners c + p) to r XOR 2^s, preceded by a step header [count, format]
  (16 bytes) where s > 0 or r has a folded partner, and finally sends header and result to its partner. A
  running sum of u entries travels as COO(u) while that is at most M s_v (the break-even density), else DENSE
  (M s_v bytes, count -1);
* omnireduce: the agreement (extra = n), its BLOCKS pieces to each owner w != me (0 bytes for none, else
  pad(ceil(|range_w| / 8)) + pad(c 256 s_v), c its non-zero blocks of 256 elements in owner w's contiguous
  range [w B / n, (w + 1) B / n) of the B = ceil(M b / 256) blocks), the union counts as one int64 to each
  peer, and its summed union blocks' BLOCKS piece to each peer.

All these are exact: the slots' padding is part of them. The pull's own header (count, format) is read from
the message as it reaches the backend.
"""
import math

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks, tap_collectives

SI = 4  # int32 indices: every tensor here has fewer than 2**31 entries
HEADER_INTS = 13 + 1  # the agreement's header fields and the count of the scheme's numbers
SLOT_HEADER = 16  # a SLOTTED pull message's [count, format]
COO_FMT, BITMAP_FMT, DENSE_FMT = 0, 1, 2  # zen/wire.py's format codes, as step headers carry them
BLOCK = 256  # OmniReduce's block of elements (its default)


class Wire:
    """Wraps torch.distributed's collectives in this process; while ``on``, logs (kind, bytes this rank hands the
    backend for its peers, the first 16 bytes of its first piece for a peer as two int64s), and in ``groups``
    the global ranks of each logged collective's group."""

    def __init__(self):
        self.log, self.groups, self.on = [], [], False
        tap_collectives(self._record, ("all_to_all_single", "all_reduce", "isend", "irecv", "broadcast",
                                       "batch_isend_irecv", "all_gather_into_tensor", "all_gather", "send", "recv",
                                       "reduce_scatter_tensor"))

    def _record(self, name, args, kwargs):
        if self.on:
            self.log.append((name,) + _sent(name, args, kwargs))
            group = kwargs.get("group") or dist.group.WORLD
            self.groups.append(tuple(dist.get_process_group_ranks(group)))

    def take(self):
        log, self.log, self.groups = self.log, [], []
        return log


def _nbytes(t):
    return t.numel() * t.element_size()


def _sent(name, args, kwargs):
    """(bytes handed to the backend for the other ranks, head of the first piece for a peer or None)."""
    if name == "all_to_all_single":
        output, send = args[0], args[1]
        splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
        group = kwargs.get("group", args[4] if len(args) > 4 else None)
        n, me = dist.get_world_size(group), dist.get_rank(group)
        size = send.element_size()
        splits = [s * size for s in splits] if splits else [_nbytes(send) // n] * n
        flat = send.reshape(-1).view(torch.uint8)
        peer = next(j for j in range(n) if j != me)
        at = sum(splits[:peer])
        head = flat[at:at + SLOT_HEADER].clone().view(torch.int64).tolist() if splits[peer] >= SLOT_HEADER else None
        return _nbytes(send) - splits[me], head
    if name in ("isend", "send"):  # a point-to-point message: its first 16 bytes are SparCML's step header, if any
        tensor = args[0] if args else kwargs["tensor"]
        flat = tensor.reshape(-1).view(torch.uint8)
        return _nbytes(tensor), flat[:SLOT_HEADER].clone().view(torch.int64).tolist() if flat.numel() >= 16 else None
    if name in ("all_reduce", "broadcast"):
        return _nbytes(args[0] if args else kwargs["tensor"]), None
    if name == "batch_isend_irecv":
        return sum(_nbytes(op.tensor) for op in args[0] if op.op in (dist.isend, dist.send)), None
    if name in ("all_gather_into_tensor", "all_gather"):
        group = kwargs.get("group")
        return (dist.get_world_size(group) - 1) * _nbytes(args[1]), None
    return 0, None


# --- the inputs: known index sets per rank ----------------------------------------------------------------
CASES = {  # name: (entries E, row width b, shared entries, entries of each rank's own)
    "coo": (40000, 1, 300, 100),  # 1% density: the pull's COO is smaller than a bitmap over I_j
    "bitmap": (20000, 1, 5000, 200),  # 26% density, mostly shared: the hash bitmap is smaller
    "rows": (3000, 16, 150, 50),  # rows of 16 float32 values (block_size=16): s_v = 64
}


# SparCML's dense switch: M = 4000 fp32 elements, COO(u) = 8 u against M s_v = 16000 bytes, so a running sum of
# u <= 2000 entries travels as COO and one of more as DENSE. Rank 0 and its folded partner p hold 1000 each, their
# union exactly 2000 (at the break-even: still COO, which a switch at >= would send dense); rank 1 adds 600 (2600:
# DENSE from there on), the others 200 each.
SWITCH_NUMEL = 4000


def switch_entries(rank, n):
    p = 1 << (n.bit_length() - 1)
    start, size = {0: (0, 1000), p: (1000, 1000), 1: (2000, 600)}.get(rank, (2600 + 200 * (rank - 2), 200))
    return torch.arange(start, start + size)


def entries(case, rank, n=None):
    """The entries (ascending) that ``rank`` holds non-zero in ``case`` (at ``n`` ranks): the shared ones and
    its own."""
    if case == "switch":
        return switch_entries(rank, n)
    numel, _, shared, own = CASES[case]
    perm = torch.randperm(numel, generator=torch.Generator().manual_seed(7))
    mine = torch.randperm(numel, generator=torch.Generator().manual_seed(100 + rank))[:own]
    return torch.unique(torch.cat([perm[:shared], mine]))


def tensor_for(case, rank, n=None):
    numel, width, _, _ = CASES[case] if case != "switch" else (SWITCH_NUMEL, 1, 0, 0)
    at = entries(case, rank, n)
    x = torch.zeros(numel, width)
    x[at] = torch.randint(1, 8, (at.numel(), width), generator=torch.Generator().manual_seed(rank)).float()
    return x if width > 1 else x.view(-1)


# --- the ranks ---------------------------------------------------------------------------------------------
def _counted(rank, world, schemes):
    import zen
    from zen.transport import get_comm

    wire = Wire()
    zen.all_reduce(torch.ones(1), hierarchy="flat")
    out = {"seed": get_comm().seed}
    separator = [0]

    def measured(case, scheme, repeats=1):
        """(exact against dist.all_reduce, wire log) of each of ``repeats`` calls of ``case``, after a dense call
        of a size used nowhere else (so the first call finds no plan filed after its predecessor)."""
        separator[0] += 1
        zen.all_reduce(torch.zeros(7 + separator[0]), scheme="dense", hierarchy="flat")
        width = CASES[case][1] if case in CASES else 1
        results = []
        for _ in range(repeats):
            x = tensor_for(case, rank, world)
            expected = x.clone()
            dist.all_reduce(expected)
            wire.on = True
            zen.all_reduce(x, scheme=scheme, hierarchy="flat", block_size=width if width > 1 else None)
            wire.on = False
            results.append((torch.equal(x, expected), wire.take()))
        return results

    for case in CASES:
        for scheme in schemes:
            # zen: a first call (fresh shapes: no history, no plan) and the steady state (the third)
            out[(case, scheme)] = measured(case, scheme, 3 if scheme == "zen" else 1)
    out[("switch", "sparcml")] = measured("switch", "sparcml")
    return out


@pytest.fixture(scope="module", params=[3, 5])
def counted(request):
    import zen

    return request.param, run_ranks(request.param, _counted, list(zen.SCHEMES), timeout=300)


# --- the expected figures ----------------------------------------------------------------------------------
def pad(nbytes):
    return (nbytes + 7) // 8 * 8


def coo(k, sv):
    return pad(k * SI) + pad(k * sv)


def slot(x):
    return math.ceil(1.02 * x + 2.0 * math.sqrt(x) + 4)


class Layout:
    """The partition of a case's entries at n ranks: I_j, c[p][j], R_j, U_j, and the bitmap's bytes."""

    def __init__(self, case, n, seed):
        from zen import ops

        numel, width, _, _ = CASES[case]
        self.n, self.sv = n, 4 * width
        owner = ops.hash_partition(torch.arange(numel, dtype=torch.int32), n, seed).long()
        self.set_size = torch.bincount(owner, minlength=n).tolist()  # |I_j|
        held = [entries(case, p) for p in range(n)]
        self.k = [h.numel() for h in held]
        self.c = [torch.bincount(owner[h], minlength=n).tolist() for h in held]
        self.R = [sum(self.c[p][j] for p in range(n)) for j in range(n)]
        union = torch.unique(torch.cat(held))
        self.U = torch.bincount(owner[union], minlength=n).tolist()

    def bitmap(self, count, j):
        return pad((self.set_size[j] + 7) // 8) + pad(count * self.sv)

    def pull_piece(self, count, j, formats=(COO_FMT, BITMAP_FMT)):
        return min(coo(count, self.sv) if COO_FMT in formats else math.inf,
                   self.bitmap(count, j) if BITMAP_FMT in formats else math.inf)

    def agreement(self, extra):
        return agreement_bytes(self.n, extra)

    def zen_first(self, me):
        n = self.n
        push = sum(coo(self.c[me][j], self.sv) for j in range(n) if j != me)
        return self.agreement(zen_extra(n)) + push + (n - 1) * (SLOT_HEADER + self.pull_piece(self.R[me], me))

    def zen_steady(self, me, formats=(COO_FMT, BITMAP_FMT)):
        """The steady call's bytes; ``formats``: those the pull may take (COO only: what it would send so)."""
        n = self.n
        row = 8 * (HEADER_INTS + max(zen_extra(n), room(n)))
        agree_and_push = sum(row + coo(slot(self.c[me][j]), self.sv) for j in range(n) if j != me)
        f = round(self.U[me] / self.R[me] * 32767) / 32767  # the previous call's |U_j| / R_j, as it travels (15 bits)
        pull_slot = SLOT_HEADER + self.pull_piece(min(self.R[me], slot(f * self.R[me])), me, formats)
        return agree_and_push + (n - 1) * pull_slot

    def agsparse(self, me):
        return self.agreement(1) + (self.n - 1) * coo(self.k[me], self.sv)

    def pull_format(self, me):
        return BITMAP_FMT if self.bitmap(self.U[me], me) < coo(self.U[me], self.sv) else COO_FMT


def room(n):
    """The agreement row's room for a scheme's numbers: n + ceil(n / 4) + 8 int64s."""
    return n + -(-n // 4) + 8


def zen_extra(n):
    """zen's numbers in its agreement: n counts, gamma, n union fractions four to an int64."""
    return n + 1 + -(-n // 4)


def agreement_bytes(n, extra):
    """A plain agreement's bytes from each rank: its row of 13 + 1 + max(extra, room(n)) int64s to every peer."""
    return (n - 1) * 8 * (HEADER_INTS + max(extra, room(n)))


def sparcml_messages(held, numel, sv, me):
    """The point-to-point messages rank ``me`` sends in one SparCML call, in order: (bytes, [count, format]) for
    a step header, (bytes, None) for a piece. ``held``: every rank's entries; M = ``numel`` entries of ``sv`` bytes."""
    n = len(held)
    p = 1 << (n.bit_length() - 1)  # the core ranks: the largest power of two <= n
    out = []

    def send(ranks, header):
        u = torch.unique(torch.cat([held[r] for r in ranks])).numel()
        nbytes, fmt, count = (coo(u, sv), COO_FMT, u) if coo(u, sv) <= numel * sv else (numel * sv, DENSE_FMT, -1)
        if header:
            out.append((SLOT_HEADER, [count, fmt]))
        out.append((nbytes, None))

    if me >= p:  # fold into me - p (the count is agreed: no header); then only receive
        send([me], header=False)
        return out
    folded = me + p < n
    for s in range(p.bit_length() - 1):  # the running sum over my level-s group, to me XOR 2^s
        core = [c for c in range(p) if c >> s == me >> s]
        send(core + [c + p for c in core if c + p < n], header=s > 0 or folded)
    if folded:  # the result to my folded partner
        send(range(n), header=True)
    return out


def omnireduce_exchanges(held, numel, width, me, sv=4):
    """Bytes rank ``me`` sends in each exchange of one OmniReduce call: the agreement, the push of its blocks to
    their owners, the union counts, the pull of its union blocks. ``held``: every rank's entries (rows of
    ``width`` elements of ``sv`` bytes; 256 is a multiple of ``width``, so block = entry * width // 256)."""
    n = len(held)
    num_blocks = -(-numel * width // BLOCK)
    bounds = [w * num_blocks // n for w in range(n + 1)]  # contiguous ownership

    def per_owner(blocks):
        return [sum(1 for b in blocks.tolist() if bounds[w] <= b < bounds[w + 1]) for w in range(n)]

    blocks = [torch.unique(h * width // BLOCK) for h in held]
    mine, union = per_owner(blocks[me]), per_owner(torch.unique(torch.cat(blocks)))

    def piece(count, w):  # BLOCKS: a bitmap over the owner's range, then the blocks whole; empty when none
        return pad(-(-(bounds[w + 1] - bounds[w]) // 8)) + pad(count * BLOCK * sv) if count else 0

    push = sum(piece(mine[w], w) for w in range(n) if w != me)
    return [agreement_bytes(n, n), push, (n - 1) * 8, (n - 1) * piece(union[me], me)]


def total(log):
    return sum(b for _, b, _ in log)


def layouts(counted):
    import os

    n, records = counted
    seed = records[0]["seed"]
    assert seed == int(os.environ["ZEN_SEED"]), seed  # the group's seed is the one the suite fixed
    return n, records, {case: Layout(case, n, seed) for case in CASES}


# --- the tests ---------------------------------------------------------------------------------------------
def test_every_scheme_is_exact_while_counted(counted):
    import zen

    n, records = counted
    for case in CASES:
        for scheme in zen.SCHEMES:
            for rank in range(n):
                assert all(exact for exact, _ in records[rank][(case, scheme)]), (n, case, scheme, rank)
    for rank in range(n):
        assert all(exact for exact, _ in records[rank][("switch", "sparcml")]), (n, "switch", rank)


def test_dense_is_one_all_reduce_of_the_tensor(counted):
    n, records, lay = layouts(counted)
    for case, layout in lay.items():
        numel, width, _, _ = CASES[case]
        for rank in range(n):
            [(_, log)] = records[rank][(case, "dense")]
            assert [kind for kind, _, _ in log] == ["all_to_all_single", "all_reduce"], log
            assert log[0][1] == layout.agreement(0), (case, rank, log)
            assert log[1][1] == numel * width * 4, (case, rank, log)  # M s_v: what plain dist.all_reduce sends


def test_agsparse_sends_its_piece_to_every_peer(counted):
    n, records, lay = layouts(counted)
    for case, layout in lay.items():
        for rank in range(n):
            [(_, log)] = records[rank][(case, "agsparse")]
            assert total(log) == layout.agsparse(rank), (case, rank, total(log), layout.agsparse(rank), log)


def test_zen_first_call_bytes(counted):
    n, records, lay = layouts(counted)
    for case, layout in lay.items():
        for rank in range(n):
            _, log = records[rank][(case, "zen")][0]
            assert total(log) == layout.zen_first(rank), (case, rank, total(log), layout.zen_first(rank), log)


def test_zen_steady_state_is_two_exchanges_of_the_expected_bytes(counted):
    n, records, lay = layouts(counted)
    for case, layout in lay.items():
        for rank in range(n):
            _, log = records[rank][(case, "zen")][2]
            assert total(log) == layout.zen_steady(rank), (case, rank, total(log), layout.zen_steady(rank), log)
            if n < 12:  # below 12 ranks every exchange is one all-to-all (docs/protocol.md, Schedules)
                assert [kind for kind, _, _ in log] == ["all_to_all_single"] * 2, log


def test_zen_pulls_a_bitmap_where_it_is_smaller_and_coo_where_that_is(counted):
    n, records, lay = layouts(counted)
    formats = {}
    for case, layout in lay.items():
        for rank in range(n):
            _, log = records[rank][(case, "zen")][2]
            count, fmt = log[-1][2]  # the pull message's header, as it reached the backend
            assert count == layout.U[rank] and fmt == layout.pull_format(rank), (case, rank, count, fmt)
            formats.setdefault(case, set()).add(fmt)
    # the inputs were built for it: every owner's bitmap is smaller in "bitmap", its COO in "coo"
    assert formats["bitmap"] == {BITMAP_FMT} and formats["coo"] == {COO_FMT}, formats
    for rank in range(n):  # and the bitmap really is the smaller: the same call with COO pulls would send more
        sent = total(records[rank][("bitmap", "zen")][2][1])
        assert sent == lay["bitmap"].zen_steady(rank) < lay["bitmap"].zen_steady(rank, formats=(COO_FMT,)), rank


def test_zen_sends_fewer_bytes_than_the_all_gather_at_five_ranks(counted):
    n, records, lay = layouts(counted)
    if n != 5:
        pytest.skip("the claim is for 5 ranks")
    for case in CASES:  # most entries shared: zen ~ 2 (n-1)/n k (s_i + s_v), the all-gather (n-1) k (s_i + s_v)
        for rank in range(n):
            zen_bytes = total(records[rank][(case, "zen")][2][1])
            gathered = total(records[rank][(case, "agsparse")][0][1])
            assert zen_bytes < gathered, (case, rank, zen_bytes, gathered)


def test_sparcml_sends_the_messages_of_recursive_doubling(counted):
    """Every point-to-point message of each rank, in order, with the step headers' contents, at 3 ranks (one
    folded) and 5 (one folded, two doubling steps); and "switch", whose running sums cross the break-even."""
    n, records, _ = layouts(counted)
    for case in list(CASES) + ["switch"]:
        numel, width = CASES[case][:2] if case in CASES else (SWITCH_NUMEL, 1)
        held = [entries(case, r, n) for r in range(n)]
        for rank in range(n):
            [(_, log)] = records[rank][(case, "sparcml")]
            expected = sparcml_messages(held, numel, 4 * width, rank)
            assert [kind for kind, _, _ in log if kind not in ("isend", "irecv")] == ["all_to_all_single"], log
            assert log[0][1] == agreement_bytes(n, 1), (case, rank, log)
            sent = [(nbytes, head) for kind, nbytes, head in log if kind == "isend"]
            assert [b for b, _ in sent] == [b for b, _ in expected], (case, rank, sent, expected)
            heads = [(i, head) for i, ((_, head), (_, want)) in enumerate(zip(sent, expected)) if want is not None]
            assert heads == [(i, want) for i, (_, want) in enumerate(expected) if want is not None], (case, rank)
            assert total(log) == agreement_bytes(n, 1) + sum(b for b, _ in expected), (case, rank)


def test_sparcml_goes_dense_past_the_break_even_and_not_at_it(counted):
    """Rank 0 folds rank p's 1000 entries into its own 1000: 2000, COO(2000) = 16000 bytes = M s_v, sent as COO
    (the switch is strictly past the break-even); adding rank 1's 600 makes 2600 entries, sent DENSE (count -1,
    M s_v bytes). At 3 ranks that is its result to rank 2; at 5, its step-1 sum to rank 2."""
    n, records, _ = layouts(counted)
    [(_, log)] = records[0][("switch", "sparcml")]
    sent = [(nbytes, head) for kind, nbytes, head in log if kind == "isend"]
    assert sent[:2] == [(16, [2000, COO_FMT]), (16000, sent[1][1])], sent  # step 0: header, then COO(2000)
    assert sent[2:4] == [(16, [-1, DENSE_FMT]), (SWITCH_NUMEL * 4, sent[3][1])], sent  # then dense


def test_omnireduce_pushes_blocks_to_their_owners_and_pulls_the_unions(counted):
    """Four exchanges, each of the bytes its BLOCKS pieces take: blocks of 256 elements, each owner's range
    contiguous, a bitmap over the owner's range before the blocks."""
    n, records, _ = layouts(counted)
    for case, (numel, width, _, _) in CASES.items():
        held = [entries(case, r) for r in range(n)]
        for rank in range(n):
            [(_, log)] = records[rank][(case, "omnireduce")]
            assert [kind for kind, _, _ in log] == ["all_to_all_single"] * 4, log  # direct: pieces under 512 KiB
            expected = omnireduce_exchanges(held, numel, width, rank)
            assert [b for _, b, _ in log] == expected, (case, rank, log, expected)
