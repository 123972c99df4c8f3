"""Reliability: bad input on any rank, edge-case tensors, pathological partitions, dead and stalled peers.

Every multi-rank case runs inside one of two launches (a module fixture each), because starting ranks is
what costs here; the test functions then check their part of the recorded outcomes. An outcome is
("ok", details) or (exception type name, message), per rank.
"""
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from distributed import LocalBucket, free_port, run_ranks

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
BAD_DTYPES = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.complex64, torch.complex128]
PG_TIMEOUT = 8  # seconds: the fault-injection launch's process-group timeout
# No test here bounds a wall-clock time (a loaded 2-core machine schedules late): benchmarks/faults.py prints
# how long each fault took to surface. The tests check what each rank raised, naming whom, and in what order.


def same(a, b):
    """Bit-equal values (NaN where NaN), same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a, nan=0.0),
                                                                             torch.nan_to_num(b, nan=0.0))
    return torch.equal(a, b)


def outcome(fn):
    try:
        result = fn()
        return ("ok", result)
    except Exception as error:  # noqa: BLE001  (recorded and checked by the parent)
        return (type(error).__name__, str(error))


def tensor_for(rank, numel=600, dtype=torch.float32, seed=0, density=0.2):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randint(-8, 8, (numel,), generator=g).to(dtype) * (torch.rand(numel, generator=g) < density)
    return x.to(dtype)


def check(x, group=None, scheme="zen", **kw):
    """zen.all_reduce(x) against dist.all_reduce of a copy; returns whether they are bit-equal."""
    import zen

    ref = x.detach().clone()
    dist.all_reduce(ref, group=group)
    zen.all_reduce(x, scheme=scheme, group=group, **kw)
    return same(x.detach(), ref)


# --- launch 1: bad input, edge cases, groups, pathological partitions (3 ranks) -------------------------
def _bad_input_cases(rank, world):
    import zen
    from zen.schemes.balanced import BalancedParallelism

    out = {}
    x = tensor_for(rank)

    def run(name, make_tensor, scheme="zen"):
        out[name] = outcome(lambda: zen.all_reduce(make_tensor(), scheme=scheme))

    run("scheme_one", lambda: x.clone(), "nope" if rank == 1 else "zen")
    run("scheme_all", lambda: x.clone(), "nope")
    run("scheme_object", lambda: x.clone(), 42 if rank == 2 else "zen")
    run("scheme_differs", lambda: x.clone(), "dense" if rank == 0 else "zen")
    for dtype in BAD_DTYPES:
        run(f"dtype_one_{dtype}", lambda: x.to(dtype) if rank == 2 else x.clone())
    run("dtype_all_int8", lambda: x.to(torch.int8))
    run("dtype_differs", lambda: x.double() if rank == 1 else x.clone())
    run("numel_differs", lambda: tensor_for(rank, 600 + (rank == 2)))
    run("shape_differs", lambda: x.view(20, 30) if rank == 0 else x.view(30, 20))
    run("layout_differs", lambda: x.to_sparse() if rank == 1 else x.clone())
    run("meta_one", lambda: torch.empty(600, device="meta") if rank == 0 else x.clone())
    run("meta_all", lambda: torch.empty(600, device="meta"))
    run("not_a_tensor", lambda: [1.0] * 600 if rank == 1 else x.clone())
    run("overlapping", lambda: torch.ones(1).expand(600) if rank == 2 else x.clone())

    class FailsBeforeExchange(BalancedParallelism):
        def reduce_dense(self, call, flat):
            if rank == 1:
                raise RuntimeError("injected failure before the exchange")
            return super().reduce_dense(call, flat)

    run("fails_before_exchange", lambda: x.clone(), FailsBeforeExchange())

    # With a plan in place (x and y reduced in turn: each zen call's pieces ride in its agreement's slots, sized
    # from the same call last time), a call that breaks the sequence: the exchange's sizes come from the plan,
    # alike on every rank, so a mismatch or a failure on one rank still raises alike.
    y = tensor_for(rank, 900, seed=1)

    def planned(make_tensor, scheme="zen"):
        exact = [check(t.clone()) for t in (x, y, x, y, x)]
        return exact, outcome(lambda: zen.all_reduce(make_tensor(), scheme=scheme))

    out["planned_numel_differs"] = planned(lambda: tensor_for(rank, 900 + (rank == 1)))
    out["planned_scheme_differs"] = planned(lambda: y.clone(), "agsparse" if rank == 2 else "zen")
    out["planned_fails_before_exchange"] = planned(lambda: y.clone(), FailsBeforeExchange())
    # The same where the plan's slots hold a small tensor whole (zen's dense switch sums it so).
    dense_switch, z = BalancedParallelism(dense_switch=True), tensor_for(rank, 300, seed=2, density=0.9)
    exact = [check(z.clone(), scheme=dense_switch) for _ in range(5)]
    out["planned_whole_numel_differs"] = exact, outcome(
        lambda: zen.all_reduce(tensor_for(rank, 300 + (rank == 1), seed=2, density=0.9), scheme=dense_switch))
    run("settings_differ", lambda: x.clone(),
        BalancedParallelism(dense_switch=True, dense_threshold=0.5 if rank == 0 else None))
    for scheme in zen.SCHEMES:  # every scheme's agreement: a one-rank mismatch and a one-rank bad dtype
        run(f"numel_differs_{scheme}", lambda: tensor_for(rank, 600 + rank), scheme)
        run(f"dtype_one_{scheme}", lambda: x.to(torch.int16) if rank == 0 else x.clone(), scheme)
    out["usable_after"] = outcome(lambda: check(x.clone()))

    def timeouts():  # zen's group starts with the user's group's timeout (60 s here); a call may change it
        from zen.transport import get_comm, group_timeout

        first = group_timeout(get_comm().group).total_seconds()
        zen.all_reduce(x.clone(), timeout=45)
        return first, group_timeout(get_comm().group).total_seconds()

    out["timeouts"] = outcome(timeouts)
    return out


def _edge_cases(rank, world):
    import zen

    out = {}
    for scheme in zen.SCHEMES:
        for shape in [(0,), (0, 5), (3, 0, 2)]:
            out[f"empty_{scheme}_{shape}"] = outcome(lambda: check(torch.zeros(shape), scheme=scheme))
        out[f"scalar_{scheme}"] = outcome(lambda: check(torch.tensor(float(rank + 1)), scheme=scheme))
        for dtype in FLOATS:
            def nan_inf():
                x = tensor_for(rank, 200, dtype, seed=3)
                x[5] = float("nan") if rank == 1 else 0.0  # NaN on one rank only
                x[6] = [float("inf"), -float("inf"), 1.0][rank]  # +Inf + -Inf = NaN
                x[7] = float("inf") if rank == 2 else 2.0  # Inf + finite
                x[8] = -float("inf")  # -Inf everywhere
                x[9] = float("nan")  # NaN everywhere
                return check(x, scheme=scheme)

            out[f"nan_inf_{scheme}_{dtype}"] = outcome(nan_inf)

        def views():
            results = []
            for index in [(slice(None), slice(None)), (slice(3, 30), slice(5, 50, 4)), (slice(7, 8), slice(None))]:
                base = tensor_for(rank, 2400, seed=4).view(40, 60)
                before = base.clone()
                results.append(check(base[index].t(), scheme=scheme))  # transposed / strided / offset
                outside = torch.ones_like(base, dtype=torch.bool)
                outside[index] = False
                results.append(torch.equal(base[outside], before[outside]))  # the rest of the buffer untouched
            image = tensor_for(rank, 2 * 3 * 8 * 8, seed=5).view(2, 3, 8, 8).to(memory_format=torch.channels_last)
            results.append(check(image, scheme=scheme))
            return results

        out[f"views_{scheme}"] = outcome(views)

    def parameter():
        p = torch.nn.Parameter(tensor_for(rank, 500, seed=6))
        ref = p.detach().clone()
        dist.all_reduce(ref)
        zen.all_reduce(p)
        return same(p.detach(), ref) and p.requires_grad

    out["parameter"] = outcome(parameter)

    # World size 1 (a group of one per rank), subgroups, overlapping groups in turn, and a bad call in one
    # group that leaves the others working.
    singles = [dist.new_group([r]) for r in range(world)]
    pairs = [dist.new_group([0, 1]), dist.new_group([1, 2]), dist.new_group([0, 2])]
    mine = singles[rank]
    x = tensor_for(rank, 300, seed=7)
    # At world size 1 a call checks its input on this rank (the agreement's local part: a bad dtype still
    # raises) and then returns before any scheme runs: the sum over one rank is the tensor itself, and
    # there is no peer to send to. So the tests check that every scheme leaves the tensor as it was.
    out["world1_unchanged"] = outcome(lambda: [check(x.clone(), group=mine, scheme=s) for s in zen.SCHEMES])

    def world1_sparse():
        results = []
        for scheme in zen.SCHEMES:
            sparse = x.view(30, 10).to_sparse(1)  # rows, as nn.Embedding(sparse=True) gives them
            zen.all_reduce(sparse, scheme=scheme, group=mine)
            results.append(sparse.layout == torch.sparse_coo and same(sparse.to_dense(), x.view(30, 10)))
        return results

    out["world1_sparse"] = outcome(world1_sparse)
    out["world1_empty"] = outcome(lambda: [check(torch.zeros(0), group=mine, scheme=s) for s in zen.SCHEMES])
    out["world1_bad_dtype"] = outcome(lambda: zen.all_reduce(x.to(torch.int8), group=mine))
    results = []
    for round_ in range(2):
        for g, members in zip(pairs, [(0, 1), (1, 2), (0, 2)]):
            if rank in members:
                results.append(check(tensor_for(rank, 500, seed=8 + round_), group=g))
                # a mismatch in this pair only: raises on both members, and the next round still works
                results.append(outcome(lambda: zen.all_reduce(tensor_for(rank, 500 + rank), group=g))[0])
        results.append(check(tensor_for(rank, 700, seed=9 + round_)))  # the world, in turn
    out["groups_in_turn"] = ("ok", results)

    # Two threads, each making its first zen call on a group of its own, in a different order on each rank.
    import threading

    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    threads_out = {}

    def run(tag):
        time.sleep(0.3 if rank % 2 == tag else 0.0)
        threads_out[tag] = [check(tensor_for(rank + tag, 400, seed=10 + i), group=groups[tag]) for i in range(3)]

    threads = [threading.Thread(target=run, args=(tag,)) for tag in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PG_TIMEOUT * 4)
    out["two_threads"] = ("ok", [threads_out.get(tag) for tag in range(2)])
    return out


def _pathological_partitions(rank, world):
    import zen
    from zen import ops
    from zen.transport import get_comm
    from zen.schemes.balanced import BalancedParallelism

    out = {}
    settings = {
        "overflow": dict(num_probes=1, table_factor=1.0, serial_factor=0.0),  # every collision overflows
        "all_serial": dict(num_probes=1, table_factor=1.0, serial_factor=1.0),  # collisions go serial
        "widest": dict(num_probes=16, table_factor=64.0, serial_factor=64.0),
        "sort_only": dict(num_probes=0),
    }
    seed = get_comm().seed
    hot = torch.arange(100000)
    one_partition = hot[ops.hash_partition(hot, world, seed) == 0][:3000]  # every index into partition 0
    for name, kw in settings.items():
        scheme = BalancedParallelism(**kw)
        for case in ["dense", "uniform", "one_partition", "empty_rank"]:
            if case == "dense":
                x = tensor_for(rank, 4000, seed=10, density=1.1)
            elif case == "uniform":
                x = tensor_for(rank, 50000, seed=11, density=0.05)
            elif case == "one_partition":
                x = torch.zeros(100000)
                x[one_partition] = tensor_for(rank, one_partition.numel(), seed=12, density=0.8)
            else:
                x = tensor_for(rank, 20000, seed=13) if rank != 1 else torch.zeros(20000)
            stats = {}

            def run():
                ok = check(x, scheme=scheme, stats=stats)
                return ok, stats.get("partition_fallback"), stats.get("imbalance")

            out[f"{name}_{case}"] = outcome(run)

    # The same through the DDP hook's state (tiny tables), on a bucket-like buffer.
    state = zen.ZenState(num_probes=1, table_factor=1.0, serial_factor=0.0, dense_threshold=1.0)

    def hook():
        buf = tensor_for(rank, 30000, seed=14, density=0.3)
        ref = buf.clone()
        dist.all_reduce(ref)
        got = zen.zen_hook(state, LocalBucket(buf)).wait()
        return torch.allclose(got, ref / world, rtol=0, atol=1e-6), state.last_stats.get("partition_fallback")

    out["hook_overflow"] = outcome(hook)
    return out


def _launch1(rank, world):
    out = {}
    out.update(_bad_input_cases(rank, world))
    out.update(_edge_cases(rank, world))
    out.update(_pathological_partitions(rank, world))
    return out


@pytest.fixture(scope="module")
def three_ranks():
    return run_ranks(3, _launch1, timeout=400)


def agreed_error(outcomes, *fragments):
    """Every rank raised MismatchError with the same message, which holds every fragment."""
    kinds = {o[0] for o in outcomes}
    messages = {o[1] for o in outcomes}
    assert kinds == {"MismatchError"}, outcomes
    assert len(messages) == 1, outcomes
    message = messages.pop()
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def by_case(three_ranks, name):
    return [three_ranks[r][name] for r in range(3)]


def test_unknown_scheme_raises_on_every_rank(three_ranks):
    import zen

    agreed_error(by_case(three_ranks, "scheme_one"), "rank 1", "unknown scheme", "'nope'", "allowed",
                 ", ".join(zen.SCHEMES))
    message = agreed_error(by_case(three_ranks, "scheme_all"), "'nope'")
    assert all(f"rank {r}" in message for r in range(3))
    agreed_error(by_case(three_ranks, "scheme_object"), "rank 2", "unknown scheme", "42")
    agreed_error(by_case(three_ranks, "scheme_differs"), "scheme is 'dense' on ranks [0]; 'zen' on ranks [1, 2]")


def test_unsupported_dtype_on_one_rank_raises_on_every_rank(three_ranks):
    for dtype in BAD_DTYPES:
        agreed_error(by_case(three_ranks, f"dtype_one_{dtype}"), "rank 2", "unsupported dtype", f"got {dtype}")
    message = agreed_error(by_case(three_ranks, "dtype_all_int8"), "torch.int8")
    assert all(f"rank {r}" in message for r in range(3))


def test_tensors_that_differ_across_ranks_raise_on_every_rank(three_ranks):
    agreed_error(by_case(three_ranks, "dtype_differs"), "dtype is torch.float32 on ranks [0, 2]; torch.float64 on ranks [1]")
    agreed_error(by_case(three_ranks, "numel_differs"), "numel is 600 on ranks [0, 1]; 601 on ranks [2]")
    agreed_error(by_case(three_ranks, "shape_differs"), "shape is (20, 30) on ranks [0]; (30, 20) on ranks [1, 2]")
    agreed_error(by_case(three_ranks, "layout_differs"), "layout is strided on ranks [0, 2]; sparse_coo on ranks [1]")


def test_every_scheme_refuses_bad_input_alike(three_ranks):
    import zen

    for scheme in zen.SCHEMES:
        agreed_error(by_case(three_ranks, f"numel_differs_{scheme}"), "numel is 600 on ranks [0]")
        agreed_error(by_case(three_ranks, f"dtype_one_{scheme}"), "rank 0", "got torch.int16")


def test_bad_device_layout_or_argument_raises_on_every_rank(three_ranks):
    agreed_error(by_case(three_ranks, "meta_one"), "rank 0", "device", "meta", "gloo")
    message = agreed_error(by_case(three_ranks, "meta_all"), "meta")
    assert all(f"rank {r}" in message for r in range(3))
    agreed_error(by_case(three_ranks, "not_a_tensor"), "rank 1", "not a tensor", "got list")
    agreed_error(by_case(three_ranks, "overlapping"), "rank 2", "overlapping memory")


def test_failure_before_the_exchange_raises_on_every_rank(three_ranks):
    agreed_error(by_case(three_ranks, "fails_before_exchange"), "rank 1", "failed before the exchange",
                 "RuntimeError: injected failure before the exchange")


def test_calls_that_break_a_planned_sequence_raise_on_every_rank(three_ranks):
    """zen's push rides in its agreement, in slots planned from the previous calls: a call that differs across
    ranks, or fails on one, after a sequence that planned them, raises alike (and the calls before are exact)."""
    cases = {"planned_numel_differs": ("numel is 900 on ranks [0, 2]; 901 on ranks [1]",),
             "planned_scheme_differs": ("scheme is 'zen' on ranks [0, 1]; 'agsparse' on ranks [2]",),
             "planned_fails_before_exchange": ("rank 1", "RuntimeError: injected failure before the exchange"),
             "planned_whole_numel_differs": ("numel is 300 on ranks [0, 2]; 301 on ranks [1]",)}
    for name, fragments in cases.items():
        outcomes = by_case(three_ranks, name)
        assert all(exact == [True] * 5 for exact, _ in outcomes), outcomes
        agreed_error([result for _, result in outcomes], *fragments)


def test_scheme_settings_that_differ_raise_on_every_rank(three_ranks):
    agreed_error(by_case(three_ranks, "settings_differ"), "settings is", "on ranks [0]", "on ranks [1, 2]")


def test_group_still_usable_after_bad_input(three_ranks):
    assert by_case(three_ranks, "usable_after") == [("ok", True)] * 3


def test_zens_group_takes_the_users_timeout_and_a_given_one(three_ranks):
    assert by_case(three_ranks, "timeouts") == [("ok", (60.0, 45.0))] * 3


def test_empty_scalar_nan_inf_views_and_parameters(three_ranks):
    import zen

    names = [n for n in three_ranks[0] if n.split("_")[0] in ("empty", "scalar", "nan", "views", "parameter")]
    assert len(names) == len(zen.SCHEMES) * (3 + 1 + len(FLOATS) + 1) + 1
    bad = {}
    for name in names:
        for rank, (kind, value) in enumerate(by_case(three_ranks, name)):
            ok = kind == "ok" and (all(value) if isinstance(value, list) else value is True)
            if not ok:
                bad[(name, rank)] = (kind, value)
    assert bad == {}


def test_world_size_one_groups_in_turn(three_ranks):
    import zen

    for rank in range(3):
        out = three_ranks[rank]
        schemes = len(zen.SCHEMES)  # every scheme (auto included) left the tensor as it was (see _edge_cases)
        assert out["world1_unchanged"] == ("ok", [True] * schemes)
        assert out["world1_sparse"] == ("ok", [True] * schemes)
        assert out["world1_empty"] == ("ok", [True] * schemes)
        assert out["world1_bad_dtype"][0] == "MismatchError" and "torch.int8" in out["world1_bad_dtype"][1]
        kind, results = out["groups_in_turn"]
        # per round: two pairs (a check and a mismatch each), then the world
        assert results == [True, "MismatchError", True, "MismatchError", True] * 2, results


def test_two_threads_make_their_first_calls_on_two_groups_at_once(three_ranks):
    for kind, per_thread in by_case(three_ranks, "two_threads"):
        assert kind == "ok" and per_thread == [[True] * 3, [True] * 3], per_thread


def test_pathological_partitions_are_exact(three_ranks):
    names = [n for n in three_ranks[0] if n.split("_")[0] in ("overflow", "all", "widest", "sort")]
    assert len(names) == 16
    for name in names:
        for kind, value in by_case(three_ranks, name):
            assert kind == "ok" and value[0] is True, (name, kind, value)
    # the exact fallback really ran where the serial memory had no room, and one server took everything
    assert any(three_ranks[r]["overflow_dense"][1][1] == 1 for r in range(3))
    assert any(three_ranks[r]["overflow_one_partition"][1][1] == 1 for r in range(3))
    assert three_ranks[0]["widest_one_partition"][1][2] == pytest.approx(3.0)
    for rank in range(3):
        kind, (ok, fallback) = three_ranks[rank]["hook_overflow"]
        assert kind == "ok" and ok and fallback == 1


def test_scheme_and_state_settings_are_validated():
    import zen
    from zen.schemes.balanced import BalancedParallelism

    for kw, name in [(dict(num_probes=17), "num_probes"), (dict(num_probes=1.5), "num_probes"),
                     (dict(table_factor=0.5), "table_factor"), (dict(table_factor=float("inf")), "table_factor"),
                     (dict(table_factor=float("nan")), "table_factor"), (dict(serial_factor=-0.1), "serial_factor"),
                     (dict(serial_factor=float("inf")), "serial_factor"), (dict(dense_threshold=1.5), "dense_threshold")]:
        with pytest.raises(ValueError, match=name):
            BalancedParallelism(**kw)
        with pytest.raises(ValueError, match=name):
            zen.ZenState(**kw)
    with pytest.raises(ValueError, match="scheme must be one of.*zen"):
        zen.ZenState(scheme="nope")
    with pytest.raises(ValueError, match="timeout"):
        zen.ZenState(timeout=-1)
    for timeout in (0, -1, "5"):
        with pytest.raises(ValueError, match="zen.all_reduce: timeout"):
            zen.all_reduce(torch.ones(3), timeout=timeout)
    with pytest.raises(TypeError, match="stats"):
        zen.all_reduce(torch.ones(3), stats=[])
    with pytest.raises(ValueError, match="allowed: .*zen"):
        from zen.collective import make_scheme

        make_scheme("nope")


# --- launch 2: faults (4 ranks) -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def faults():
    """The scenario of benchmarks/faults.py (which prints its timings)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import faults as scenario

    return scenario.run(PG_TIMEOUT)


DEAD_1 = "the connection to rank 1 (group rank 1) broke: it died or exited"  # global rank 1 is group rank 1 of {0, 1}
DEAD_3 = "the connection to rank 3 (group rank 1) broke: it died or exited"
STALLED_3 = f"rank 3 (group rank 1) did not answer within the timeout ({PG_TIMEOUT} s)"


def test_dead_peer_during_ddp_backward_raises_through_the_hook(faults):
    kind, message, peers, seconds, step = faults[0]["ddp"]
    assert step == 1, faults[0]["ddp"]  # the step in which rank 1 died, not a later one
    assert kind == "PeerError" and DEAD_1 in message and peers == (1,), faults[0]["ddp"]


def test_peer_dead_before_the_call_raises_then_group_is_broken(faults):
    kind, message, peers, seconds = faults[0]["dead_before"]
    assert kind == "PeerError" and DEAD_1 in message and peers == (1,), faults[0]["dead_before"]
    assert "Backend error: RuntimeError: " in message, faults[0]["dead_before"]
    # the next call fails at once, by the group's broken state (no collective: nothing to time out on)
    kind, message, peers, seconds = faults[0]["after_broken"]
    assert kind == "BrokenGroupError" and "unusable" in message and DEAD_1 in message, faults[0]["after_broken"]
    assert message.startswith("zen: this process group is unusable on this rank (group rank 0)"), message


def test_stalled_peer_times_out_at_zens_timeout_and_queued_calls_fail_fast(faults):
    (k1, m1, p1, t1), (k2, m2, _, t2), (k3, m3, _, t3) = faults[2]["stalled_b"]
    # group B has torch's 30-minute default: the message names zen's timeout (given to zen.all_reduce), and
    # the launch (300 s) would have failed had the call waited for B's own
    assert k1 == "PeerError" and STALLED_3 in m1 and "Timed out" in m1 and p1 == (3,), faults[2]["stalled_b"]
    # the queued calls fail by the broken group (each naming the first failure), not each by a timeout of its own
    assert k2 == k3 == "BrokenGroupError" and STALLED_3 in m2 and STALLED_3 in m3, faults[2]["stalled_b"]
    assert "unusable" in m2 and "unusable" in m3 and "Timed out" in m2, faults[2]["stalled_b"]


def test_work_wait_with_a_timeout_returns_early(faults):
    # A wait's own bound: the collective is still running (it fails later, above), so no peer has failed
    # yet and there is none to name.
    kind, message, peers, seconds = faults[2]["wait_timeout"]
    assert kind == "TimeoutError" and "within 1 s" in message and peers is None, faults[2]["wait_timeout"]
    # it returned before its collective ended: the same work's wait() raised the stalled peer's PeerError next
    assert faults[2]["stalled_b"][0][0] == "PeerError", faults[2]["stalled_b"]


def test_stalled_peer_times_out_at_the_groups_own_timeout(faults):
    # group C was made with an 8 s timeout and zen.all_reduce was given none: the message names C's
    kind, message, peers, seconds = faults[2]["stalled_c"]
    assert kind == "PeerError" and STALLED_3 in message and peers == (3,), faults[2]["stalled_c"]
    assert "Timed out" in message, faults[2]["stalled_c"]


def test_peer_dying_part_way_raises_naming_it(faults):
    kind, message, peers, seconds = faults[2]["dies_during"]
    assert kind == "PeerError" and DEAD_3 in message and peers == (3,), faults[2]["dies_during"]
    assert message.startswith("zen: an all-to-all failed"), message  # the push, not the agreement


def test_private_group_fallback_warns_once(monkeypatch):
    """Where torch lacks the helper zen names its groups with, the public fallback (which can wait until the
    timeout, see _private_group) is used with a warning, once per process."""
    import warnings

    from zen import transport

    monkeypatch.delattr(dist.distributed_c10d, "_new_process_group_helper")
    made = []
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw) or f"group {len(made)}")
    monkeypatch.setattr(transport, "_warned_fallback", False)
    with pytest.warns(RuntimeWarning, match="lacks the private process-group helper"):
        assert transport._private_group(None, [0, 1], "gloo", None) == "group 1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert transport._private_group(None, [0, 1], "gloo", None) == "group 2"
    assert made == [dict(ranks=[0, 1], backend="gloo", timeout=None, use_local_synchronization=True)] * 2


EXIT_SCRIPT = """
import sys, torch, torch.distributed as dist, zen
dist.init_process_group("gloo")
x = torch.zeros(1 << 22)
x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(dist.get_rank()))[:4000]] = 1.0
for scheme in ("zen", "dense", "sparcml"):
    zen.all_reduce(x.clone(), scheme=scheme)
dist.destroy_process_group()  # no barrier first: a rank may be gone while the other tears down
"""


def test_script_ending_with_destroy_process_group_exits_cleanly():
    """A training script's usual ending: no rank aborts at exit ("terminate called ..." and SIGABRT came
    from zen's groups torn down in the interpreter's finalisation once a peer had exited)."""
    for attempt in range(3):  # the abort depended on timing: it hit most runs, not all
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
        procs = [subprocess.Popen([sys.executable, "-c", EXIT_SCRIPT], env=dict(env, RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        for rank, proc in enumerate(procs):
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0 and "terminate called" not in err, (attempt, rank, proc.returncode, err[-2000:])


def test_lane_closes_after_its_jobs_and_never_hangs_exit():
    """At exit zen ends its lanes (a live lane thread during the C++ runtime's teardown can abort the
    process): jobs already submitted run first; a job that never ends does not hold the close past its
    timeout."""
    import threading

    from zen.transport import Lane

    lane, ran = Lane("test-lane"), []
    lane.submit(lambda: ran.append(1))
    lane.close(timeout=5.0)
    assert ran == [1] and not lane._thread.is_alive()
    stuck, release = Lane("stuck-lane"), threading.Event()
    stuck.submit(release.wait)
    stuck.close(timeout=0.2)
    # close returned while its job still runs (it waits on `release`, set only below): the close did not wait
    # for the job, whatever the clock says
    assert stuck._thread.is_alive() and not release.is_set()
    release.set()
    stuck._thread.join(5.0)
    assert not stuck._thread.is_alive()
