"""Bad input to the DDP hook: a clear error naming the fix where zen_hook is not called as DDP calls it, and
what a hook registered late (after the first backward) or twice does under torch's DDP."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zen
from distributed import LocalBucket, run_ranks

FIX = "ddp_model.register_comm_hook(zen.ZenState(), zen.zen_hook)"


@pytest.mark.parametrize("bucket", [object(), torch.zeros(8), None], ids=["object", "tensor (FSDP's hooks)", "None"])
def test_a_bucket_not_from_ddp_names_the_fix(bucket):
    with pytest.raises(TypeError, match="bucket must be DDP's torch.distributed.GradBucket") as caught:
        zen.zen_hook(zen.ZenState(), bucket)
    assert FIX in str(caught.value) and type(bucket).__name__ in str(caught.value)


@pytest.mark.parametrize("state", [None, object()], ids=["no state (Lightning without ddp_comm_state)", "object"])
def test_a_state_not_zens_names_the_fix(state):
    with pytest.raises(TypeError, match="state must be a zen.ZenState") as caught:
        zen.zen_hook(state, LocalBucket(torch.zeros(8)))
    assert FIX in str(caught.value) and "ddp_comm_state=zen.ZenState()" in str(caught.value)


def test_a_model_not_ddp_wrapped_has_no_register_comm_hook():
    # The plain entry point fails in torch before zen is called: an nn.Module has no register_comm_hook.
    with pytest.raises(AttributeError, match="register_comm_hook"):
        torch.nn.Linear(4, 4).register_comm_hook(zen.ZenState(), zen.zen_hook)


def _late(rank, world):
    """Two DDP models from one seed, stepped alike; zen's hook registered on one after its first backward.
    Torch's DDP takes the late hook (its buckets are then the rebuilt ones), and a second one raises."""
    torch.manual_seed(0)
    models = [DDP(torch.nn.Sequential(torch.nn.Embedding(500, 8), torch.nn.Linear(8, 8))) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    for step in range(4):
        tokens = torch.randint(0, 500, (16,), generator=torch.Generator().manual_seed(step * world + rank))
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            model(tokens).square().sum().backward()
            optimizer.step()
        if step == 0:
            models[1].register_comm_hook(zen.ZenState(), zen.zen_hook)
    try:
        models[1].register_comm_hook(zen.ZenState(), zen.zen_hook)
        twice = None
    except RuntimeError as error:
        twice = str(error)
    equal = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(models[0].parameters(), models[1].parameters()))
    steps = models[1]._get_ddp_logging_data().get("comm_hook", "")
    return equal, twice, steps


def test_a_hook_registered_after_the_first_backward_runs_and_a_second_one_raises():
    for equal, twice, comm_hook in run_ranks(2, _late):
        assert equal  # DDP accepts the late hook and zen's sums equal plain DDP's
        assert twice == "register_comm_hook or register_builtin_comm_hook can only be called once."
        assert "zen_hook" in comm_hook
