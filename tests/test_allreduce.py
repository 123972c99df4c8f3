"""zen.all_reduce against torch.distributed.all_reduce of the same data, on 1-4 gloo ranks."""
import itertools

import pytest
import torch
import torch.distributed as dist

from cases import KINDS, make
from distributed import run_ranks

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def same(a, b):
    """Bit-equal results, NaN where NaN."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(torch.nan_to_num(a, nan=12345.0),
                                                                        torch.nan_to_num(b, nan=12345.0))


def _exact_cases(rank, world, cases, scheme):
    import zen

    failures = []
    for i, (kind, numel, density, dtype, shape) in enumerate(cases):
        x = make(kind, numel, density, rank, world, seed=i, dtype=dtype).view(shape)
        ref = x.clone()
        dist.all_reduce(ref)
        zen.all_reduce(x, scheme=scheme)
        if not same(x, ref):
            failures.append((kind, numel, density, str(dtype), shape))
    return failures


def exact_cases():
    out = []
    for kind, numel, density in itertools.product(KINDS, [1, 7, 1000, 30011], [0.001, 0.05, 0.6]):
        out.append((kind, numel, density, torch.float32, (numel,)))
    for dtype in DTYPES:
        out.append(("uniform", 4096, 0.1, dtype, (64, 64)))
        out.append(("skewed", 20000, 0.05, dtype, (20000,)))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_against_dense_allreduce(world):
    cases = exact_cases()
    for failures in run_ranks(world, _exact_cases, cases, "zen"):
        assert failures == []


def _random_floats(rank, world):
    import zen

    worst = 0.0
    for i, (numel, density) in enumerate([(100000, 0.01), (100000, 0.3), (5000, 0.9), (250000, 0.001)]):
        x = make("uniform", numel, density, rank, world, seed=50 + i, exact=False)
        ref = x.clone()
        dist.all_reduce(ref)
        zen.all_reduce(x)
        assert torch.equal(x != 0, ref != 0) or torch.allclose(x, ref, rtol=0, atol=1e-6)
        worst = max(worst, (x - ref).abs().max().item())
    return worst


def test_random_floats_match_to_rounding():
    # Only the order of summation differs from gloo's: 4 terms of N(0, 1) agree to a few ulps.
    for worst in run_ranks(4, _random_floats):
        assert worst <= 4 * torch.finfo(torch.float32).eps * 8


def _views_and_async(rank, world):
    import zen

    base = make("uniform", 600, 0.2, rank, world, seed=7).view(20, 30)
    view = base[:, ::3]  # non-contiguous: the sum must land in the caller's tensor
    ref = view.clone()
    dist.all_reduce(ref)
    zen.all_reduce(view)
    assert same(view, ref) and same(base[:, 1::3], make("uniform", 600, 0.2, rank, world, seed=7).view(20, 30)[:, 1::3])

    works, refs, xs = [], [], []
    for i in range(6):
        x = make("skewed", 3000 + i, 0.05, rank, world, seed=80 + i)
        r = x.clone()
        dist.all_reduce(r)
        works.append(zen.all_reduce(x, async_op=True))
        xs.append(x)
        refs.append(r)
    for w, x, r in zip(works, xs, refs):
        assert w.wait() and w.is_completed()
        assert same(x, r)
    work = zen.all_reduce(torch.ones(2, 5), dist.ReduceOp.SUM, None, True)  # dist.all_reduce's positions
    assert isinstance(work, dist.Work)
    fut = work.get_future()  # as torch's: a future of [tensor]
    assert same(fut.wait()[0], torch.full((2, 5), float(world))) and work.exception() is None
    assert work.is_success()
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT):
        with pytest.raises(ValueError, match="op must be torch.distributed.ReduceOp.SUM"):
            zen.all_reduce(torch.ones(3), op=op)
    assert same(work.result()[0], torch.full((2, 5), float(world)))
    # A collective started in a callback of a zen future, which runs on zen's worker thread: it runs at once,
    # where queued behind the callback it would wait forever. (The gate holds the worker until the callback is
    # registered, so the future completes there.)
    import threading

    gate = threading.Event()
    zen.transport.get_comm().submit(gate.wait)
    norm = torch.ones(3)
    chained = zen.all_reduce(torch.ones(2, 5), async_op=True).get_future().then(
        lambda done: zen.all_reduce(norm) or done.value()[0].sum())
    gate.set()
    assert chained.wait().item() == 10 * world and same(norm, torch.full((3,), float(world)))

    from test_wire_bytes import Wire

    stats = {}
    x = make("uniform", 50000, 0.01, rank, world, seed=3)
    ref = x.clone()
    dist.all_reduce(ref)
    wire = Wire()  # counts what reaches torch.distributed
    wire.on = True
    zen.all_reduce(x, stats=stats)
    wire.on = False
    assert same(x, ref)
    stats["counted"] = sum(nbytes for _, nbytes, _ in wire.take())
    return stats


def test_views_async_and_stats():
    stats = run_ranks(3, _views_and_async)
    # The agreement's rows, which bytes_sent leaves out: 13 header fields, the count of zen's numbers and the
    # row's room for them, n + ceil(n / 4) + 8 = 12 slots (n counts, gamma, n fractions four to an int64: 5), to
    # each of the n - 1 = 2 peers.
    rows = 2 * 8 * (13 + 1 + 12)
    for s in stats:
        assert s["union"] >= max(s["nnz"]) and 1.0 <= s["imbalance"] < 1.3
        assert 0 < s["bytes_sent"] == s["counted"] - rows, (s["bytes_sent"], s["counted"], rows)


def _sparse_coo(rank, world):
    import zen

    g = torch.Generator().manual_seed(rank)
    rows = torch.randint(0, 50, (8,), generator=g)
    t = torch.sparse_coo_tensor(rows[None], torch.randint(-4, 4, (8, 3), generator=g).float(), (50, 3),
                                check_invariants=True).coalesce()
    ref = t.to_dense()
    dist.all_reduce(ref)
    zen.all_reduce(t)
    assert t.is_sparse and same(t.to_dense(), ref)
    return True


def test_sparse_coo_tensor():
    assert all(run_ranks(3, _sparse_coo))


def _subgroups(rank, world):
    import zen

    evens = dist.new_group([0, 2])
    odds = dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    for i in range(3):
        x = make("uniform", 4000, 0.05, rank, world, seed=i)
        ref = x.clone()
        dist.all_reduce(ref, group=mine)
        zen.all_reduce(x, group=mine)
        assert same(x, ref)
        y = make("skewed", 5000, 0.02, rank, world, seed=10 + i)
        ref = y.clone()
        dist.all_reduce(ref)
        zen.all_reduce(y)  # the world, in turn with the subgroup
        assert same(y, ref)
    return True


def test_subgroups_and_several_groups_in_turn():
    assert all(run_ranks(4, _subgroups))
