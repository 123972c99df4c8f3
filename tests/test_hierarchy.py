"""Multi-rank nodes (zen.hierarchy): dense inside a node, every scheme across nodes, exact against
torch.distributed.all_reduce at 2 nodes x 2 ranks and 3 nodes x 2 ranks (the nodes emulated on loopback
with local_size or LOCAL_WORLD_SIZE); sparse COO and row blocks; the DDP hook; detection of the nodes;
unequal nodes; and errors that reach every rank. Values are multiples of 1/2 (compared with torch.equal)."""
import os

import pytest
import torch

from cases import make
from distributed import run_ranks
from test_rows import row_sparse

SCHEMES = ("dense", "zen", "agsparse", "sparcml", "omnireduce", "auto")
PROFILE = dict(bandwidth=125e6, latency=50e-6)


def _exact(rank, world, local_size):
    import torch.distributed as dist

    import zen

    zen.set_profile(**PROFILE)
    failures, modes, intra = [], set(), set()

    def check(label, x, **kwargs):
        want = x.clone() if x.layout == torch.strided else x.to_dense()
        dist.all_reduce(want)
        stats = {}
        zen.all_reduce(x, stats=stats, hierarchy="node", local_size=local_size, **kwargs)
        got = x if x.layout == torch.strided else x.to_dense()
        if not (got.dtype == want.dtype and torch.equal(got, want)):
            failures.append(f"{label}: max error {(got.double() - want.double()).abs().max().item()}")
        modes.add(stats.get("hierarchy"))
        if x.layout == torch.strided and x.numel():
            intra.add(stats.get("intra_sparse"))
        return stats

    for scheme in SCHEMES:
        for kind in ("uniform", "skewed", "disjoint", "edges", "some_empty", "all_empty", "dense"):
            for numel in (1, 5, 1000, 12345):
                check(f"{kind}/{numel}/{scheme}", make(kind, numel, 0.05, rank, world, seed=numel), scheme=scheme)
        # rows: an embedding-like [V, D] gradient, chosen per call and forced
        x = row_sparse(301, 16, torch.arange(rank, 301, 11), rank)
        check(f"rows/{scheme}", x.clone(), scheme=scheme)
        check(f"rows forced/{scheme}", x.clone(), scheme=scheme, block_size=16)
        check(f"strided/{scheme}", x.clone().t(), scheme=scheme)
        # sparse COO with duplicate rows and two dense dims
        rows = torch.tensor([3, 0, 3, 49, 3, rank + 5])
        values = (torch.arange(rows.numel() * 8, dtype=torch.float32).view(-1, 4, 2) % 7 - 3) * 0.5
        sparse = torch.sparse_coo_tensor(rows[None], values, (50, 4, 2), check_invariants=True)
        check(f"coo/{scheme}", sparse, scheme=scheme)
        if not sparse.is_coalesced() or sparse.values().shape[1:] != (4, 2):
            failures.append(f"coo/{scheme}: result not a coalesced [k, 4, 2] sparse tensor")
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.int64):
        check(f"{dtype}", make("uniform", 3000, 0.1, rank, world, seed=7, dtype=dtype), scheme="zen")
    from test_wire_bytes import Wire

    wire = Wire()  # counts what reaches torch.distributed, per group
    wire.on = True
    stats = check("stats", make("uniform", 100000, 0.01, rank, world, seed=3), scheme="zen")
    wire.on = False
    # a cross-node group: one rank of each of several nodes (nodes of local_size consecutive ranks)
    crossing = [nbytes for (_, nbytes, _), ranks in zip(wire.log, wire.groups)
                if len(ranks) > 1 and len({r // local_size for r in ranks}) == len(ranks)]
    stats = dict(stats, counted_cross=sum(crossing))
    keys = ("nodes", "local_size", "inter_bytes", "intra_bytes", "counted_cross")
    return failures, modes, intra, {k: stats.get(k) for k in keys}


@pytest.mark.parametrize("world", [4, 6])
def test_every_scheme_exact_across_nodes(world):
    for failures, modes, intra, stats in run_ranks(world, _exact, 2, timeout=900):
        assert failures == []
        assert modes == {"node"}
        assert intra == {True, False}  # sparse and dense steps inside the node both ran
        assert stats["nodes"] == world // 2 and stats["local_size"] == 2
        # inter_bytes: what crossed the nodes, counted at torch.distributed on the cross-node group, less the
        # agreement's rows of the cross call (13 header fields, the count, the room N + ceil(N / 4) + 8 for zen's
        # N + 1 + ceil(N / 4) numbers, to each of the other N - 1 nodes)
        nodes = world // 2
        rows = (nodes - 1) * 8 * (13 + 1 + nodes + -(-nodes // 4) + 8)
        assert 0 < stats["inter_bytes"] == stats["counted_cross"] - rows, (stats, rows)
        assert 0 < stats["intra_bytes"]


def _detect(rank, world, env):
    import zen
    from zen.hierarchy import HIERARCHY
    from zen.transport import get_comm

    os.environ.update(env(rank))
    comm = get_comm()
    found = comm.submit(lambda: HIERARCHY.topology(comm, None)).wait()
    given = comm.submit(lambda: HIERARCHY.topology(comm, 3)).wait()
    x = torch.full((10,), 0.5 * (rank + 1))
    stats = {}
    zen.all_reduce(x, hierarchy="auto", stats=stats)  # one host: auto runs flat
    return found, given, stats["hierarchy"]


def _torchrun_env(rank):
    return {"LOCAL_WORLD_SIZE": "2"}


def _no_env(rank):
    return {"LOCAL_WORLD_SIZE": ""}


def test_detects_nodes():
    for found, given, _ in run_ranks(4, _detect, _torchrun_env):
        assert found.nodes == ((0, 1), (2, 3)) and found.source == "LOCAL_WORLD_SIZE"
        assert given.nodes == ((0, 1, 2), (3,)) and given.local_size is None
    for found, _, mode in run_ranks(3, _detect, _no_env):
        assert found.nodes == ((0, 1, 2),) and found.source == "hostname"
        assert mode == "flat"  # one host: auto runs flat, untimed


def _unequal(rank, world):
    import zen

    errors = []
    x = torch.ones(100)
    try:
        zen.all_reduce(x, hierarchy="node", local_size=2)
    except zen.MismatchError as error:
        errors.append(str(error))
    with pytest.warns(RuntimeWarning, match="unequal"):
        zen.all_reduce(x, hierarchy="auto", local_size=2)
    return errors, x[0].item()


def test_unequal_nodes():
    for errors, value in run_ranks(3, _unequal):
        assert len(errors) == 1 and "equal size" in errors[0] and "[2, 1]" in errors[0]
        assert value == 3.0  # auto ran flat


def _bad_input(rank, world):
    import zen

    def message_of(x, **kwargs):
        try:
            zen.all_reduce(x, hierarchy="node", local_size=2, **kwargs)
        except zen.MismatchError as error:
            return str(error)
        return ""

    messages = [message_of(torch.ones(100, dtype=torch.int8 if rank == 3 else torch.float32))]  # finding the nodes
    y = torch.ones(10)
    zen.all_reduce(y, hierarchy="node", local_size=2)  # the groups are still usable; the nodes are known now
    # Inside node 1, inside node 0, between the nodes: every rank raises the same text, naming the group's ranks.
    messages.append(message_of(torch.ones(100, dtype=torch.int8 if rank == 3 else torch.float32)))
    messages.append(message_of(torch.ones(4, 6) if rank == 0 else torch.ones(6, 4)))
    messages.append(message_of(torch.ones(10), scheme="zen" if rank < 2 else "sparcml"))
    return messages, y[0].item()


def test_bad_input_raises_on_every_rank():
    results = run_ranks(4, _bad_input)
    for messages, value in results:
        assert "rank 3: unsupported dtype" in messages[0] and "int8" in messages[0]
        assert messages[1].startswith("zen.all_reduce: on node 1: rank 3: unsupported dtype")
        assert messages[2].endswith("on node 0: shape is (4, 6) on ranks [0]; (6, 4) on ranks [1]")
        assert messages[3].endswith("scheme is 'zen' on ranks [0, 1]; 'sparcml' on ranks [2, 3]")
        assert value == 4.0
    assert all(r == results[0] for r in results)


def _mixed_settings(rank, world):
    import zen

    messages = []
    # Rank 0 alone: flat, another local_size, "auto", each on the first call that would look for the nodes.
    for mine in (dict(hierarchy="flat", local_size=2), dict(hierarchy="node", local_size=4),
                 dict(hierarchy="auto", local_size=2)):
        try:
            zen.all_reduce(torch.ones(100), **(mine if rank == 0 else dict(hierarchy="node", local_size=2)))
        except zen.MismatchError as error:
            messages.append(str(error))
    y = torch.ones(10)
    zen.all_reduce(y, hierarchy="node", local_size=2)  # the group is still usable
    return messages, y[0].item()


def test_ranks_with_different_hierarchy_settings_all_raise():
    results = run_ranks(4, _mixed_settings)
    for messages, value in results:
        assert len(messages) == 3 and all("hierarchy is" in m for m in messages)
        assert "'flat' (local_size 2) on ranks [0]; 'node' (local_size 2) on ranks [1, 2, 3]" in messages[0]
        assert "'node' (local_size 4) on ranks [0]" in messages[1]
        assert "'auto' (local_size 2) on ranks [0]" in messages[2]
        assert value == 4.0
    assert all(r == results[0] for r in results)


def _auto(rank, world):
    import zen
    from zen.hierarchy import HIERARCHY
    from zen.transport import get_comm

    modes = []
    for _ in range(8):
        x = make("uniform", 20000, 0.01, rank, world, seed=1)
        want = x.clone()
        import torch.distributed as dist

        dist.all_reduce(want)
        stats = {}
        zen.all_reduce(x, stats=stats, hierarchy="auto", local_size=2)
        assert torch.equal(x, want)
        modes.append(stats["hierarchy"])
    return modes, HIERARCHY.choice(get_comm(), x, local_size=2)


def test_auto_times_both_then_keeps_one():
    results = run_ranks(4, _auto)
    for modes, choice in results:
        assert modes[:6] == ["node", "flat"] * 3
        assert choice in ("node", "flat") and modes[6:] == [choice, choice]
    assert len({choice for _, choice in results}) == 1


def _hook(rank, world, scheme, sparse):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zen

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(500, 16, sparse=sparse), torch.nn.Linear(16, 4))
    reference = torch.nn.Sequential(torch.nn.Embedding(500, 16, sparse=sparse), torch.nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model)
    state = zen.ZenState(scheme=scheme, hierarchy="node", local_size=2)
    ddp.register_comm_hook(state, zen.zen_hook)
    g = torch.Generator().manual_seed(rank)
    mismatches = []
    for step in range(3):
        tokens = torch.randint(0, 500, (32,), generator=g)
        ddp.zero_grad()
        ddp(tokens).square().sum().backward()
        reference.zero_grad()
        reference(tokens).square().sum().backward()
        for a, b in zip(model.parameters(), reference.parameters()):
            want = b.grad.to_dense() if sparse and b.grad.is_sparse else b.grad.clone()
            dist.all_reduce(want)
            got = a.grad.to_dense() if a.grad.is_sparse else a.grad
            if not torch.allclose(got, want / world, rtol=1e-5, atol=1e-6):
                mismatches.append((step, tuple(a.shape), (got - want / world).abs().max().item()))
    return mismatches, state.last_stats.get("hierarchy")


@pytest.mark.parametrize("scheme,sparse", [("zen", False), ("auto", False), ("zen", True)])
def test_hook_across_nodes(scheme, sparse):
    for mismatches, mode in run_ranks(4, _hook, scheme, sparse):
        assert mismatches == []
        assert mode == "node"


def test_bad_settings():
    import zen

    with pytest.raises(ValueError, match="hierarchy"):
        zen.ZenState(hierarchy="nodes")
    with pytest.raises(ValueError, match="local_size"):
        zen.ZenState(local_size=0)


def _predict(rank, world):
    import zen

    zen.set_profile(**PROFILE)
    x = make("uniform", 200000, 0.01, rank, world, seed=1).view(-1, 50)
    return zen.predict(x, hierarchy="both", local_size=2)


def test_predict_shows_both_options():
    results = run_ranks(4, _predict, timeout=600)
    for both in results:
        assert set(both) == {"flat", "node"}
        for times in both.values():
            assert set(times) >= {"dense", "zen", "auto"} and all(t > 0 for t in times.values())
            assert times["auto"] == min(t for name, t in times.items() if name != "auto")
    assert all(both == results[0] for both in results)  # every rank predicts alike
