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


def _compare(rank, world, configs, steps):
    import zen

    worst = []
    for sparse, ddp_kwargs in configs:
        torch.manual_seed(0)
        model = EmbeddingModel(sparse=sparse, with_unused=ddp_kwargs.get("find_unused_parameters", False))
        plain_params, plain_losses = train(copy.deepcopy(model), ddp_kwargs, None, rank, steps, sparse)
        state = zen.ZenState()
        zen_params, zen_losses = train(copy.deepcopy(model), ddp_kwargs, state, rank, steps, sparse)
        diff = max((a - b).abs().max().item() for a, b in zip(plain_params, zen_params))
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(plain_params, zen_params)), \
            (sparse, ddp_kwargs, diff)
        assert torch.allclose(torch.tensor(plain_losses), torch.tensor(zen_losses), rtol=1e-5, atol=1e-6)
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

    # Too dense for sparse to pay: the bucket goes dense, on every rank alike.
    dense = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    ref = dense.clone()
    dist.all_reduce(ref)
    out = zen.zen_hook(state, LocalBucket(dense)).wait()
    assert torch.allclose(out, ref / world) and state.last_stats.get("dense") is True
    return True


def test_hook_averages_and_goes_dense_when_dense():
    assert all(run_ranks(2, _hook_contract))


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
