"""Every scheme against torch.distributed.all_reduce, at world sizes 1-5, on random, skewed and adversarial
data; zen.predict's measurements against the truth; scheme="auto" picks the smallest prediction, then times
the near ties.

Each world size is one spawn (a spawn costs seconds); every case runs inside it. Integer-valued floats
(and integer dtypes) are summed exactly by every order of summation, so they are compared with
torch.equal; random floats with allclose at a tight tolerance. Every rank must also get the bit-identical
result, whatever the data: checked by hashing each rank's output.
"""
import hashlib

import pytest
import torch

from cases import KINDS, make
from distributed import run_ranks

FIXED = ("dense", "zen", "agsparse", "sparcml", "omnireduce")
SCHEMES = FIXED + ("auto",)
PROFILE = dict(bandwidth=125e6, latency=50e-6)  # 1 Gbit/s, 50 us

# (kind, numel, density) of tests/cases.py, plus "rows": a Zipf-skewed embedding gradient (whole rows).
CASES = ([(kind, 1000, 0.05) for kind in KINDS]
         + [("uniform", 30011, 0.6), ("skewed", 30011, 0.01), ("uniform", 7, 0.5), ("edges", 1, 1.0),
            ("edges", 777, 0.0), ("rows", 4096, 0.0),
            # pieces past zen.geometry.DUPLEX_ALL_TO_ALL_BYTES at every world size: gloo's two-group transport
            ("uniform", 600_000, 0.9)])


def make_case(kind, numel, density, rank, world, seed, dtype=torch.float32, exact=True):
    """tests/cases.py's tensors, and "rows": 512 rows x 8 with Zipf(1.1) row ids, hot rows first."""
    if kind != "rows":
        return make(kind, numel, density, rank, world, seed, dtype, exact)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    weights = 1.0 / torch.arange(1, numel // 8 + 1, dtype=torch.float64) ** 1.1
    rows = torch.unique(torch.multinomial(weights, 60, replacement=True, generator=gen))
    t = torch.zeros(numel, dtype=dtype)
    values = torch.randint(1, 9, (rows.numel() * 8,), generator=gen) * (2 * torch.randint(0, 2, (rows.numel() * 8,),
                                                                                        generator=gen) - 1)
    t[(rows[:, None] * 8 + torch.arange(8)).view(-1)] = values.to(dtype)
    return t


def same(a, b):
    """Bit-equal results, NaN where NaN."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(torch.nan_to_num(a, nan=12345.0),
                                                                        torch.nan_to_num(b, nan=12345.0))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _sparse_of(dense_rows: torch.Tensor) -> torch.Tensor:
    """A [rows, cols] tensor as sparse COO over its non-zero rows (like nn.Embedding(sparse=True)'s grad)."""
    rows = torch.nonzero(dense_rows.abs().sum(1)).view(-1)
    return torch.sparse_coo_tensor(rows[None], dense_rows[rows], dense_rows.shape, check_invariants=True)


def _run_exactness(rank, world):
    """Every scheme on every case; returns the failures and, per check, the digest of the output."""
    import torch.distributed as dist

    import zen
    from zen.schemes.omnireduce import OmniReduce
    from zen.schemes.sparcml import SparCML

    failures, digests = [], []

    def run(label, x, scheme, exact=True, group=None):
        want = x.clone() if x.layout == torch.strided else x.to_dense()
        dist.all_reduce(want, group=group)
        zen.all_reduce(x, scheme=scheme, group=group)
        got = x if x.layout == torch.strided else x.to_dense()
        ok = same(got, want) if exact else torch.allclose(got, want, rtol=1e-6, atol=1e-5)
        if not ok:
            failures.append(f"{label}: max error {(got.double() - want.double()).abs().max().item()}")
        if group is None:
            digests.append((label, _digest(got)))

    zen.set_profile(**PROFILE)
    for seed, (kind, numel, density) in enumerate(CASES):
        for scheme in SCHEMES:
            run(f"{scheme}/{kind}/{numel}/{density}", make_case(kind, numel, density, rank, world, seed), scheme)
    for scheme in SCHEMES:
        run(f"{scheme}/random floats", make("uniform", 3000, 0.1, rank, world, 99, exact=False), scheme, exact=False)
        if world in (2, 3):  # dtypes and strides do not depend on the world size
            for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64):
                run(f"{scheme}/rows/{dtype}", make_case("rows", 4096, 0, rank, world, 5, dtype), scheme)
            x = make("skewed", 1000, 0.1, rank, world, 7).view(40, 25).t()  # non-contiguous: written back
            run(f"{scheme}/transposed", x, scheme)
        for kind in ("rows", "some_empty", "all_empty", "same"):  # sparse COO: each scheme's reduce_coo
            dense = make_case(kind, 4096, 0.05, rank, world, 11).view(512, 8)
            run(f"{scheme}/sparse/{kind}", _sparse_of(dense), scheme)

    # settings the registry's defaults do not reach: odd block sizes, a low SparCML switch.
    variants = [OmniReduce(block_size=7), OmniReduce(block_size=1), OmniReduce(block_size=5000),
                SparCML(dense_threshold=0.01)]
    for scheme in variants:
        for seed, (kind, numel, density) in enumerate([("uniform", 1000, 0.05), ("edges", 777, 0), ("rows", 4096, 0),
                                                       ("skewed", 30011, 0.01)]):
            run(f"{scheme.name}{vars(scheme)}/{kind}", make_case(kind, numel, density, rank, world, seed), scheme)

    failures += _check_transport(rank, world)
    failures += _check_pull_slots(rank, world)
    failures += _check_push_slots(rank, world)
    failures += _check_whole_in_agreement(rank, world)

    if world == 4:  # subgroups: point-to-point peers are group ranks, mapped to global ranks
        evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
        mine = evens if rank % 2 == 0 else odds
        for scheme in SCHEMES:
            run(f"{scheme}/subgroup", make("skewed", 5000, 0.05, rank, world, 13), scheme, group=mine)
    return failures, digests


def _zen_against_dense(t, scheme):
    """zen.all_reduce of ``t`` in place, against torch.distributed.all_reduce of a copy: (bit-equal, its stats)."""
    import torch.distributed as dist

    import zen

    want = t.clone()
    dist.all_reduce(want)
    stats = {}
    zen.all_reduce(t, scheme=scheme, stats=stats)
    return same(t, want), stats


def _integer_sparse(numel, density, generator):
    """A tensor whose non-zeros (about ``density`` of ``numel``) are small integers: exact in any order of sum."""
    values = torch.randint(-8, 8, (numel,), generator=generator).float()
    return torch.where(torch.rand(numel, generator=generator) < density, values, torch.zeros(numel))


def _check_pull_slots(rank, world):
    """zen's pull goes in slots sized from the previous call's gamma: a union that outgrows its slot (gamma 1,
    then n) sends the rest in a second message and the sum is still exact; the next such call fits. In COO
    and in bitmap pulls."""
    import torch.distributed as dist

    import zen
    from zen.schemes.balanced import BalancedParallelism

    failures, numel = [], 20000
    for density in (0.05, 0.9 / world):
        scheme = BalancedParallelism()
        overflows = []
        for case in ("same", "disjoint", "disjoint"):
            owner = torch.arange(numel) % world == (0 if case == "same" else rank)
            chosen = owner & (torch.rand(numel, generator=torch.Generator().manual_seed(len(overflows))) < density)
            t = torch.where(chosen, torch.arange(numel) % 17 - 7.5, torch.zeros(numel))
            exact, stats = _zen_against_dense(t, scheme)
            if not exact:
                failures.append(f"pull slots, density {density}, {case} #{len(overflows)}: wrong sum")
            overflows.append(stats.get("pull_overflow"))
        expected = [0, world, 0] if world > 1 else [None] * 3  # (one rank: nothing is pulled)
        if overflows != expected:
            failures.append(f"pull slots, density {density}: pieces over their slots {overflows}, not {expected}")
    # By name, the scheme is the process's one instance: the second call of a shape sizes its slots from the
    # first's unions (overlapping ranks: the unions are far below the pairs received), so it sends less.
    t = torch.zeros(numel)
    t[torch.arange(0, numel, 7)] = 1.5
    sent = []
    for _ in range(2):
        stats = {}
        zen.all_reduce(t.clone(), scheme="zen", stats=stats)
        sent.append(stats.get("bytes_sent", 0))
    if world > 2 and not sent[1] < 0.8 * sent[0]:
        failures.append(f"pull slots by name: bytes {sent} (the second call should size its slots from the first)")
    return failures


def _check_push_slots(rank, world):
    """zen's push rides in its agreement, in slots planned from the call that last followed the same call: in
    a repeated call, from the same call's counts. The second call of a shape has no plan (everything goes in
    a second all-to-all), the third and fourth fit their slots; a call with more non-zeros outgrows them and
    is still exact, and the next one fits again."""
    failures, numel, overflows = [], 30011, []
    for density in (0.05, 0.05, 0.05, 0.05, 0.3, 0.3):
        t = _integer_sparse(numel, density, torch.Generator().manual_seed(int(density * 100) + rank))
        exact, stats = _zen_against_dense(t, "zen")
        if not exact:
            failures.append(f"push slots, call {len(overflows)}: wrong sum")
        overflows.append(stats.get("push_overflow"))
    if world > 1 and not (overflows[1] == world * (world - 1) and overflows[2:4] == [0, 0]
                          and overflows[4] == world * (world - 1) and overflows[5] == 0):
        failures.append(f"push slots: pieces over their slots {overflows}")
    return failures


def _check_whole_in_agreement(rank, world):
    """A small call that zen's dense switch sums dense rides whole in the agreement of the call that next
    follows the same call (every rank sums the n copies): the third dense call of a tensor goes so and is exact;
    a sparse call of it then sends its pieces in a second all-to-all instead, and the dense one after it goes
    by the all-reduce again (its plan was the pieces')."""
    from zen.schemes.balanced import BalancedParallelism

    scheme, failures, seen = BalancedParallelism(dense_switch=True), [], []
    for call, density in enumerate((0.9, 0.9, 0.9, 0.01, 0.9)):
        t = _integer_sparse(300, density, torch.Generator().manual_seed(100 * call + rank))
        exact, stats = _zen_against_dense(t, scheme)
        if not exact:
            failures.append(f"whole in agreement, call {call}: wrong sum")
        seen.append((bool(stats.get("dense")), bool(stats.get("whole_in_agreement"))))
    if world > 1 and seen[1:] != [(True, False), (True, True), (False, False), (True, False)]:
        failures.append(f"whole in agreement: (dense, whole) per call {seen}")
    return failures


def _check_transport(rank, world):
    """zen's all-to-all (both of gloo's transports) and pairwise exchange against torch's all-to-all, with
    uneven and empty pieces."""
    import torch.distributed as dist

    from zen.geometry import DUPLEX_ALL_TO_ALL_BYTES
    from zen.transport import get_comm

    comm, failures = get_comm(), []
    for scale in (8, DUPLEX_ALL_TO_ALL_BYTES):
        size = lambda src, dst: 0 if (src + 2 * dst) % 3 == 0 else scale + 7 * src + dst  # noqa: E731
        send_splits = [size(rank, j) for j in range(world)]
        recv_splits = [size(q, rank) for q in range(world)]
        send = torch.randint(0, 256, (sum(send_splits),), dtype=torch.uint8)
        want = torch.empty(sum(recv_splits), dtype=torch.uint8)
        dist.all_to_all_single(want, send, recv_splits, send_splits)
        got = torch.empty_like(want)
        largest = max((size(q, j) for q in range(world) for j in range(world) if q != j), default=0)
        comm.submit(lambda: comm.all_to_all(got, send, recv_splits, send_splits, largest)).wait()
        if not torch.equal(got, want):
            failures.append(f"all_to_all, pieces of about {scale} bytes: wrong bytes")
    if world > 1:  # a ring of 3 MB messages: each rank sends right and receives from the left
        right, left = (rank + 1) % world, (rank - 1) % world
        mine = torch.full((3 << 18,), float(rank))
        theirs = torch.empty_like(mine)
        comm.submit(lambda: comm.exchange([(right, mine)], [(left, theirs)])).wait()
        if not torch.equal(theirs, torch.full_like(mine, float(left))):
            failures.append("exchange: wrong message from the left")
    return failures


def _run_predict_and_auto(rank, world):
    """zen.predict's measured inputs against the truth; auto's choice against the predictions."""
    import torch.distributed as dist

    import zen
    from zen import cost
    from zen.auto import Auto
    from zen.planner import workload_from_indices
    from zen.transport import get_comm

    out = []
    comm = get_comm()
    profile = zen.set_profile(**PROFILE)
    for seed, (kind, numel, density) in enumerate([("rows", 4096, 0), ("uniform", 1000, 0.05), ("uniform", 30011, 0.6),
                                                   ("skewed", 30011, 0.01), ("some_empty", 1000, 0.05),
                                                   ("all_empty", 1000, 0.05)]):
        name = f"{kind}/{numel}/{density}"
        t = make_case(kind, numel, density, rank, world, seed)
        w = zen.measure(t)
        # the truth: every rank's non-zeros, gathered, and the workload computed in one process
        masks = [torch.zeros(numel, dtype=torch.bool) for _ in range(world)]
        dist.all_gather(masks, t != 0)
        truth = workload_from_indices([torch.nonzero(m).view(-1) for m in masks], numel, seed=comm.seed)
        assert w == truth, (name, w, truth)
        assert w.union == int(torch.stack(masks).any(0).sum()), name
        if kind == "rows":  # whole rows of 8: as [512, 8] and as sparse COO, the same workload of rows
            as_rows = zen.measure(t.view(-1, 8))
            assert as_rows.numel == 512 and as_rows.value_size == 8 * 4 and as_rows.nnz == [r // 8 for r in w.nnz]
            coo = zen.measure(_sparse_of(t.view(-1, 8)))
            assert as_rows.row_size == 8 and as_rows.row_choice  # (the tensor [512, 8]: rows chosen per call)
            assert not coo.dense_input and vars(coo) == dict(vars(as_rows), dense_input=False, row_choice=False), name

        times = zen.predict(t)
        expected = zen.predict_times(w, profile)
        assert all(abs(times[k] - expected[k]) <= 1e-9 * expected[k] for k in expected), (name, times, expected)
        assert set(times) == set(zen.SCHEMES), name
        assert times["auto"] == min(v for k, v in times.items() if k != "auto")
        memory = zen.predict_memory(t)
        assert set(memory) == set(FIXED) and all(v >= 0 for v in memory.values()), name
        for scheme, phases in zen.predict_phases(w, profile).items():  # every phase a call records has a formula
            recorded = {}
            zen.all_reduce(t.clone(), scheme=scheme, stats=recorded)
            assert set(recorded.get("phases", {})) <= set(phases), (name, scheme, recorded)

        stats = {}
        zen.all_reduce(t, scheme=Auto(), stats=stats)  # a fresh history: this call measures
        assert stats["auto"]["measured"], name
        choice = stats["auto"]["choice"]
        assert choice == cost.choose(stats["auto"]["predicted"]) == cost.choose(times), (name, choice, times)
        out.append((name, choice))

    # a dense tensor goes dense; one non-zero in a large tensor does not (the shared "auto" decides each
    # tensor size on its first call).
    dense = torch.ones(20000)
    stats = {}
    zen.all_reduce(dense, scheme="auto", stats=stats)
    assert stats["auto"]["choice"] == "dense", stats
    assert torch.equal(dense, torch.full((20000,), float(world)))
    single = torch.zeros(20001)
    single[rank] = 1.0
    zen.all_reduce(single, scheme="auto", stats=stats)
    assert stats["auto"]["choice"] != "dense", stats

    # re-check: a tensor size that turns dense after 2 calls is re-decided at call 3 (recheck=3).
    from zen.schemes.base import Request
    from zen.schemes.call import run_call

    auto = Auto(recheck=3)
    picks = []
    for call in range(6):
        t = torch.zeros(30000)
        if call < 3:
            t[rank] = 1.0
        else:
            t += 1.0
        stats = comm.submit(lambda: run_call(comm, Request(t, auto, "auto")).as_stats()).wait()
        assert torch.equal(t, torch.full_like(t, float(world)) if call >= 3 else _one_hot_sum(world, 30000))
        picks.append((stats["auto"]["choice"], stats["auto"]["measured"], "scan" in stats.get("phases", {})))
    assert [m for _, m, _ in picks] == [True, False, False, True, False, False], picks
    assert picks[3][0] == "dense" and picks[0][0] != "dense", picks
    # a measuring call scans for the non-zeros; a trial or a settled call of dense sends the tensor unscanned
    unscanned = [not scan for choice, measured, scan in picks if choice == "dense" and not measured]
    assert picks[3][2] and unscanned and all(unscanned), picks
    out.append(("recheck", picks))

    # trials: every candidate within the margin runs 2 timed calls, interleaved in order of prediction; the
    # pick is the smallest median slowest-rank time (exchanged, so the same on every rank); then it settles.
    auto = Auto(trials=2, trial_margin=1e9)
    data = make_case("uniform", 30011, 0.01, rank, world, 7)
    expected = data.clone()
    dist.all_reduce(expected)
    seen = []
    for call in range(2 + 2 * len(FIXED)):
        t = data.clone()
        stats = {}
        zen.all_reduce(t, scheme=auto, stats=stats)
        assert torch.equal(t, expected), (call, stats["auto"])
        seen.append(stats["auto"])
    predicted = {k: v for k, v in seen[0]["predicted"].items() if k != "auto"}
    trials = [s["choice"] for s in seen[1:-1]]
    assert seen[0]["measured"] and all(s.get("trial") for s in seen[1:-1]), seen
    assert trials == sorted(predicted, key=predicted.get) * 2, trials
    medians = seen[-2]["trial_medians"]
    assert set(medians) == set(FIXED) and all(v > 0 for v in medians.values()), medians
    assert seen[-1] == dict(choice=min(medians, key=medians.get), measured=False), seen[-1]
    assert auto.settled(comm, 30011)
    times = auto.trial_times(comm, 30011)
    assert {k: len(v) for k, v in times.items()} == {k: 2 for k in FIXED} and seen[1]["seconds"] == times[trials[0]][0]
    out.append(("trials", (trials, medians)))

    # no profile on some rank (here all but rank 0): no probe, trials alone, on every rank. One call of each
    # candidate (registered order), then the rest of the trials of those within the margin (here all), then
    # the smallest median.
    from zen.measurement.store import cached_profile, clear_profile
    from zen.schemes import registered

    if rank != 0:
        clear_profile()
    auto = Auto(trials=2, trial_margin=1e9)
    seen = []
    for call in range(1 + 2 * len(FIXED)):
        t = data.clone()
        stats = {}
        zen.all_reduce(t, scheme=auto, stats=stats)
        assert torch.equal(t, expected), (call, stats["auto"])
        seen.append(stats["auto"])
    order = [name for name in registered() if name != "auto"]
    assert [s["choice"] for s in seen[:-1]] == order * 2 and all(s.get("trial") for s in seen[:-1]), seen
    assert not any(s.get("measured") for s in seen) and (rank == 0 or cached_profile() is None), seen
    medians = seen[-2]["trial_medians"]
    assert seen[-1] == dict(choice=min(medians, key=medians.get), measured=False), seen[-1]
    # a margin that keeps only the fastest: one call of each, then the pick
    auto = Auto(trials=3, trial_margin=1.0)
    for call in range(len(FIXED) + 1):
        stats = {}
        zen.all_reduce(data.clone(), scheme=auto, stats=stats)
    assert auto.settled(comm, 30011) and set(map(len, auto.trial_times(comm, 30011).values())) == {1}, stats
    out.append(("untried", medians))
    zen.set_profile(**PROFILE)

    # ZenState(scheme="auto") in DDP: the same gradients as DDP's own allreduce.
    (with_zen, summary), (plain, _) = _ddp_grads(rank, world, "auto"), _ddp_grads(rank, world, None)
    out.append(("ddp", all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(with_zen, plain))))
    # its summary tells the measuring apart: the first call of a bucket measures, within the collectives' time
    out.append(("summary", 0 < summary["auto_seconds"] <= summary["seconds"] and summary["auto_trials"] >= 0))

    # ranks that disagree on the tensor raise alike, even though their auto histories differ.
    size = 5000 if rank == 0 else 5001
    try:
        zen.all_reduce(torch.zeros(size), scheme="auto")
        out.append(("mismatch", "no error"))
    except zen.MismatchError as error:
        out.append(("mismatch", "numel" in str(error)))
    return out


def _one_hot_sum(world, numel):
    t = torch.zeros(numel)
    t[:world] = 1.0
    return t


def _ddp_grads(rank, world, scheme):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import zen

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 8), torch.nn.Flatten(), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)
    state = zen.ZenState(scheme=scheme) if scheme is not None else None
    if state is not None:
        ddp.register_comm_hook(state, zen.zen_hook)
    tokens = torch.randint(0, 300, (5, 4), generator=torch.Generator().manual_seed(rank))
    ddp(tokens).pow(2).sum().backward()
    dist.barrier()
    return [p.grad.clone() for p in model.parameters()], state.summary() if state else None


def _run_world(rank, world, with_predict):
    exactness = _run_exactness(rank, world)
    if world == 1:  # one rank: nothing moves, nothing is predicted to
        import zen

        zen.set_profile(**PROFILE)
        times = zen.predict(make_case("rows", 4096, 0, 0, 1, 0))
        assert set(times) == set(zen.SCHEMES) and set(times.values()) == {0.0}, times
    if not with_predict:
        return exactness, None, None
    import zen
    from zen.measurement.store import clear_profile

    clear_profile()  # measure this group rather than use the profile the exactness run set
    probed = zen.probe_profile(message_bytes=1 << 16, repeats=2)
    return exactness, _run_predict_and_auto(rank, world), probed


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_schemes(world):
    """Exactness at every world size; zen.predict, the probe and auto at 3 and 5 (a fold, one or two steps)."""
    with_predict = world in (3, 5)
    results = run_ranks(world, _run_world, with_predict, timeout=500, pg_timeout=120)
    failures = [f"rank {r}: {f}" for r, ((fails, _), _, _) in enumerate(results) for f in fails]
    assert not failures, "\n".join(failures[:20])
    by_rank = [dict(digests) for (_, digests), _, _ in results]
    differing = [label for label in by_rank[0] if any(d[label] != by_rank[0][label] for d in by_rank[1:])]
    assert not differing, f"ranks got different bits: {differing[:10]}"
    if not with_predict:
        return
    outcomes = [outcome for _, outcome, _ in results]
    assert all(o == outcomes[0] for o in outcomes), outcomes  # every rank picked the same
    outcome = dict(outcomes[0])
    assert outcome["ddp"] is True and outcome["summary"] is True
    assert outcome["mismatch"] is True
    profiles = [profile for _, _, profile in results]
    assert all(p == profiles[0] for p in profiles)
    p = profiles[0]
    assert p.bandwidth > 0 and p.latency > 0 and p.memory_bandwidth > 0
    assert p.element_time > 0 and p.write_time > 0 and p.found_time > 0 and p.merge_time > 0
    assert p.merge2_time > 0
    assert p.encode_time > 0 and p.decode_time > 0
    assert {k for k, _ in p.overheads} == {"allgather", "allreduce", "alltoall", "p2p"}
    assert {k for k, _ in p.rates} == {"allreduce", "alltoall", "alltoall_small", "p2p"}  # the odd rank out: no p2p
    assert {k for k, _ in p.calibration} == {"dense", "agsparse", "sparcml", "omnireduce", "zen"}
    assert {k for k, _ in p.calibration_large} == {"agsparse", "sparcml", "omnireduce", "zen"}
    assert all(v >= 0 for _, v in p.calibration + p.calibration_large)
