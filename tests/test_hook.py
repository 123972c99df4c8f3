"""DDP with zen's hook trains to the same parameters as plain DDP."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distributed import LocalBucket, run_ranks


class EmbeddingModel(nn.Module):
    """A large embedding (sparse gradients) feeding a small dense head."""

    def __init__(self, vocab=20000, dim=16, sparse=False, with_unused=False):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, sparse=sparse)
        self.head = nn.Linear(dim, 4)
        if with_unused:
            self.unused = nn.Linear(4, 4)  # never used: exercises find_unused_parameters

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(1))


def batches(rank, steps, vocab):
    g = torch.Generator().manual_seed(1000 + rank)
    # Skewed token ids, as frequency-ordered vocabularies.
    return [((torch.rand(32, 12, generator=g) ** 3) * vocab).long() for _ in range(steps)]


def train(model, ddp_kwargs, hook_state, rank, steps, sparse):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zen

    ddp = DDP(model, **ddp_kwargs)
    if hook_state is not None:
        ddp.register_comm_hook(hook_state, zen.zen_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    losses = []
    for tokens in batches(rank, steps, model.embedding.num_embeddings):
        opt.zero_grad()
        loss = ddp(tokens).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


def sparse_path_ran(summary, steps):
    """A hook that went dense would pass a comparison with plain DDP: the state's summary must show a sparse
    call of "zen" every step and, the embedding's rows (nearly all of the bytes) sent sparse, under half the
    ring all-reduce's bytes."""
    return summary["schemes"].get("zen", 0) >= steps and summary["bytes_sent"] < 0.5 * summary["dense_bytes"]


def _compare(rank, world, configs, steps):
    import zen

    worst = []
    for sparse, ddp_kwargs in configs:
        torch.manual_seed(0)
        model = EmbeddingModel(sparse=sparse, with_unused=ddp_kwargs.get("find_unused_parameters", False))
        plain_params, plain_losses = train(copy.deepcopy(model), ddp_kwargs, None, rank, steps, sparse)
        state = zen.ZenState(dense_threshold=0.5)  # by density, not by timing: the sparse path every step
        zen_params, zen_losses = train(copy.deepcopy(model), ddp_kwargs, state, rank, steps, sparse)
        diff = max((a - b).abs().max().item() for a, b in zip(plain_params, zen_params))
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(plain_params, zen_params)), \
            (sparse, ddp_kwargs, diff)
        assert torch.allclose(torch.tensor(plain_losses), torch.tensor(zen_losses), rtol=1e-5, atol=1e-6)
        assert sparse_path_ran(state.summary(), steps), (sparse, ddp_kwargs, state.summary())
        worst.append(diff)
    return worst


CONFIGS = [
    (False, {}),
    (False, {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.25}),
    (False, {"static_graph": True}),
    (False, {"find_unused_parameters": True}),
    (True, {}),
    (True, {"find_unused_parameters": True}),
]


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_with_zen_hook_matches_plain_ddp(world):
    run_ranks(world, _compare, CONFIGS, 6, timeout=400)


def _compiled(rank, world, steps):
    """The same model and batches under DDP with the hook, eager and ``torch.compile(backend="aot_eager")``."""
    import zen
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = EmbeddingModel(vocab=4000, dim=16)
    results, graphs = [], []

    def recording_aot_eager(gm, example_inputs):
        """aot_eager, recording the call targets of each graph it compiles (a run that fell back to eager
        compiles none)."""
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_module")])
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    for compiled in (False, True):
        model = copy.deepcopy(base)
        ddp = DDP(model)
        state = zen.ZenState(dense_threshold=0.5)  # the sparse path every step (not timed against dense)
        ddp.register_comm_hook(state, zen.zen_hook)
        run = torch.compile(ddp, backend=recording_aot_eager) if compiled else ddp
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        for tokens in batches(rank, steps, 4000):
            opt.zero_grad()
            run(tokens).pow(2).mean().backward()
            opt.step()
        results.append(([p.detach().clone() for p in model.parameters()], state.summary()))
    (eager, eager_summary), (compiled, summary) = results
    # Compared here: a tensor put on the queue is shared memory, gone when its rank exits.
    return [torch.equal(a, b) for a, b in zip(eager, compiled)], eager_summary, summary, graphs


def test_torch_compile_aot_eager_is_bit_identical():
    """torch.compile(backend="aot_eager") of a DDP model with the hook trains to the very parameters of the
    eager one; the hook ran each compiled step, on the sparse path, sending what the eager one sent."""
    steps = 3
    for equal, eager_summary, summary, graphs in run_ranks(2, _compiled, steps):
        # compiled for real: the backend got the model's forward as a graph (the embedding, the head's linear)
        targets = " ".join(t for graph in graphs for t in graph).lower()
        assert graphs and "embedding" in targets and "linear" in targets, graphs
        assert equal == [True] * 3, equal
        assert summary["steps"] == steps and sparse_path_ran(summary, steps), summary
        assert summary["bytes_sent"] == eager_summary["bytes_sent"], (summary, eager_summary)


class CheckpointedModel(EmbeddingModel):
    """The head recomputed by a reentrant checkpoint: its gradients come in a backward nested in the step's."""

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.head, self.embedding(tokens).mean(1), use_reentrant=True)


def _steps(rank, world, configs, steps):
    """Per config, with and without top-k (after warmup_steps=2): summary()["steps"] after each backward and
    whether its last bucket was sparsified (the step number the hook read); without top-k, the parameters
    against plain DDP's."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zen

    out = []
    for sparse, ddp_kwargs, reentrant in configs:
        torch.manual_seed(0)
        model = (CheckpointedModel if reentrant else EmbeddingModel)(vocab=2000, sparse=sparse)
        plain_params, _ = train(copy.deepcopy(model), ddp_kwargs, None, rank, steps, sparse)
        for topk_ratio in (None, 0.5):
            state = zen.ZenState(topk_ratio=topk_ratio, warmup_steps=2, min_numel=1)
            ddp = DDP(copy.deepcopy(model), **ddp_kwargs)
            ddp.register_comm_hook(state, zen.zen_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
            counted, sparsified = [], []
            for tokens in batches(rank, steps, 2000):
                opt.zero_grad()
                ddp(tokens).pow(2).mean().backward()
                opt.step()
                counted.append(state.summary()["steps"])
                sparsified.append("sent" in state.last_stats)
            if topk_ratio is None:
                assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                           for a, b in zip(plain_params, ddp.module.parameters())), (sparse, ddp_kwargs, reentrant)
            out.append(((sparse, ddp_kwargs, reentrant, topk_ratio), counted, sparsified))
    return out


STEP_CONFIGS = [  # (sparse embedding, DDP's arguments, reentrant checkpoint)
    (True, {"static_graph": True}, False),  # the first iteration hands both buckets as index 0, neither last
    (True, {}, False),
    (False, {"bucket_cap_mb": 0.01}, False),  # several buckets
    (False, {"static_graph": True, "bucket_cap_mb": 0.01}, False),
    (True, {"static_graph": True}, True),  # the head's bucket comes in a nested backward
    (False, {"bucket_cap_mb": 0.01}, True),
]


def test_summary_counts_every_step():
    """summary()["steps"] is the number of backward passes taken, and top-k starts after warmup_steps of them,
    under static_graph (whose first iteration marks no bucket last), several buckets and reentrant checkpoints."""
    steps = 4
    for results in run_ranks(2, _steps, STEP_CONFIGS, steps, timeout=300):
        for config, counted, sparsified in results:
            assert counted == list(range(1, steps + 1)), (config, counted)
            topk_ratio = config[-1]
            assert sparsified == [topk_ratio is not None and step >= 2 for step in range(steps)], (config, sparsified)


def _hook_contract(rank, world):
    import zen

    state = zen.ZenState()
    bucket_buffer = torch.zeros(1000)
    bucket_buffer[rank::7] = 1.0

    fut = zen.zen_hook(state, LocalBucket(bucket_buffer))
    assert isinstance(fut, torch.futures.Future)
    out = fut.wait()
    ref = torch.zeros(1000)
    for r in range(world):
        ref[r::7] += 1.0 / world
    assert out.shape == (1000,) and out.dtype == torch.float32 and torch.allclose(out, ref)
    # a seventh of the elements per rank: sent sparse, in fewer bytes than a ring all-reduce
    assert not state.last_stats.get("dense") and state.summary()["schemes"] == {"zen": 1}, state.last_stats
    assert state.summary()["bytes_sent"] < 0.5 * state.summary()["dense_bytes"], state.summary()

    # Too dense for sparse to pay: the bucket goes dense, on every rank alike.
    dense = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    ref = dense.clone()
    dist.all_reduce(ref)
    out = zen.zen_hook(state, LocalBucket(dense)).wait()
    assert torch.allclose(out, ref / world) and state.last_stats.get("dense") is True
    assert state.summary()["schemes"] == {"zen": 1, "zen (dense)": 1}, state.summary()
    return True


def _sparse_step_warnings(rank, world):
    """Two DDP steps of nn.Embedding(sparse=True) through the hook, every warning recorded (the lane's too:
    the warnings module's state is the process's)."""
    import warnings

    import zen

    torch.manual_seed(0)
    model = EmbeddingModel(vocab=2000, sparse=True)
    state = zen.ZenState()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, {}, state, rank, 2, True)
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught], state.summary()


def test_sparse_gradients_do_not_warn_of_sparse_invariant_checks():
    """torch warns once per process when a sparse tensor is built without saying whether to check its
    invariants; zen builds its results from indices it made itself and says so (check_invariants=False)."""
    for caught, summary in run_ranks(2, _sparse_step_warnings):
        assert not [w for w in caught if "Sparse invariant" in w], caught
        assert sparse_path_ran(summary, 2), summary


def test_hook_averages_and_goes_dense_when_dense():
    assert all(run_ranks(2, _hook_contract))


def _mismatched_schemes(rank, world):
    """Rank 0 hooks "zen", rank 1 "sparcml": what ``loss.backward()`` raises on each."""
    import zen

    torch.manual_seed(0)
    state = zen.ZenState(scheme="zen" if rank == 0 else "sparcml")
    try:
        train(EmbeddingModel(vocab=2000), {}, state, rank, 1, False)
    except Exception as error:  # noqa: BLE001  (the parent checks its type)
        return type(error), str(error)
    return None, ""


def test_an_error_in_the_hook_reaches_backward_with_its_type():
    """DDP's reducer would read a failed future as "RuntimeError: Unable to cast <error> to Tensor"."""
    for kind, message in run_ranks(2, _mismatched_schemes):
        assert kind.__name__ == "MismatchError" and "scheme" in message, (kind, message)


def _one_state_two_models(rank, world, topk_ratio):
    """One ZenState registered on two DDP models, two iterations: what backward raises or warns."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    import zen

    torch.manual_seed(0)
    models = [DDP(torch.nn.Linear(100, 100)) for _ in range(2)]
    state = zen.ZenState(topk_ratio=topk_ratio, warmup_steps=4)
    for model in models:
        model.register_comm_hook(state, zen.zen_hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(2):
                for model in models:
                    model(torch.ones(4, 100)).sum().backward()
        except ValueError as error:
            return "ValueError", str(error)
    return "warned", [str(w.message) for w in caught if "more than one DDP model" in str(w.message)]


@pytest.mark.parametrize("topk_ratio", [0.01, None])
def test_one_state_on_two_models_is_refused_with_topk_and_warned_without(topk_ratio):
    for kind, detail in run_ranks(2, _one_state_two_models, topk_ratio):
        if topk_ratio:
            assert kind == "ValueError" and "more than one DDP model" in detail, (kind, detail)
        else:
            assert kind == "warned" and len(detail) == 1, (kind, detail)


def test_state_validates_settings():
    import zen

    with pytest.raises(ValueError, match="scheme must be one of"):
        zen.ZenState(scheme="nope")
    with pytest.raises(ValueError, match="dense_threshold"):
        zen.ZenState(dense_threshold=2.0)
    with pytest.raises(ValueError, match="num_probes"):
        zen.ZenState(num_probes=-1)
    with pytest.raises(ValueError, match="table_factor"):
        zen.ZenState(table_factor=0.5)
    with pytest.raises(ValueError, match="serial_factor"):
        zen.ZenState(serial_factor=-1)
    import pickle

    state = pickle.loads(pickle.dumps(zen.ZenState(scheme="zen", num_probes=4)))
    assert state.num_probes == 4 and state.process_group is None


def _rows_in_buckets(rank, world):
    """The hook's choice per parameter: rows for a row-sparse weight, elements for a top-k-like one."""
    import zen

    g = torch.Generator().manual_seed(rank)
    weight, bias = torch.zeros(300, 64), torch.randint(-4, 5, (64,), generator=g).float()
    weight[torch.unique(torch.randint(0, 300, (20,), generator=g))] = 1.5  # whole rows
    topk = torch.zeros(300 * 64)
    topk[torch.randperm(topk.numel(), generator=g)[:300]] = -2.0  # 1.6% of the elements, nearly every row
    chosen = []
    for grad in (weight, topk.view(300, 64)):
        state = zen.ZenState()
        buffer = torch.cat([grad.reshape(-1), bias])
        want = buffer.clone()
        dist.all_reduce(want)
        got = zen.zen_hook(state, LocalBucket(buffer.clone(), parameters=[grad, bias])).wait()
        assert torch.equal(got, want / world)
        groups = state.last_stats.get("groups", [state.last_stats])
        chosen.append(sorted(group["block_size"] for group in groups))
        # the weight's group (its rows of 64, or the elements of both) went sparse; the bias alone may go dense
        assert not max(groups, key=lambda g: g["block_size"]).get("dense"), groups
        assert state.summary()["bytes_sent"] < 0.5 * state.summary()["dense_bytes"], state.summary()
    return chosen


def test_hook_reduces_rows_of_a_row_sparse_parameter_and_elements_of_a_top_k_one():
    for chosen in run_ranks(2, _rows_in_buckets):
        assert chosen == [[1, 64], [1]]


def _embedding_bytes(rank, world, sparse, steps):
    import zen

    torch.manual_seed(0)
    model = EmbeddingModel(vocab=20000, dim=16, sparse=sparse)
    state = zen.ZenState(dense_threshold=0.5)  # the sparse path every step (not timed against dense)
    train(model, {}, state, rank, steps, sparse)
    return state.summary(), state.last_stats


@pytest.mark.parametrize("sparse", [False, True])
def test_hook_sends_rows_near_the_row_level_ideal(sparse):
    """summary()["bytes_sent"] of an embedding model within 1.3x of the row-level ideal: over the steps,
    (n-1)/n (R_r + U)(b s_v + s_i), R_r the rows of rank r's gradient (its distinct tokens), U their union,
    plus the head (68 values, under SMALL_PARAMETER: elements), which goes dense: its ring bytes."""
    world, steps, row_bytes = 2, 4, 16 * 4 + 4
    summaries = run_ranks(world, _embedding_bytes, sparse, steps)
    for rank, (summary, last) in enumerate(summaries):
        ideal = 0.0
        for step in range(steps):
            tokens = [batches(r, steps, 20000)[step] for r in range(world)]
            local = torch.unique(tokens[rank]).numel()
            union = torch.unique(torch.cat(tokens)).numel()
            ideal += (world - 1) / world * (local + union) * row_bytes + 2 * (world - 1) / world * 68 * 4
        assert summary["steps"] == steps and summary["buckets"] >= steps
        assert summary["bytes_sent"] <= 1.3 * ideal, (summary, ideal)
        assert summary["bytes_sent"] < 0.1 * summary["dense_bytes"]
        assert summary["schemes"].get("zen", 0) >= steps  # the sparse path ran (not only dense fallbacks)
        if not sparse:  # one bucket: the embedding's rows of 16 went sparse (with sparse=True it has its own)
            groups = last.get("groups", [last])
            assert any(g["block_size"] == 16 and not g.get("dense") for g in groups), last
