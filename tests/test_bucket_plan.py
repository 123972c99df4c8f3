"""The hook's bucket plans (zen.bucket_plan): a steady dense bucket is one all-reduce and nothing else, counted
where the collectives reach torch.distributed; ranks whose buckets differ raise the same MismatchError at the
first step, at a layout change and at a re-check."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distributed import LocalBucket, run_ranks, tap_collectives

class Counting:
    """Counts every call of torch.distributed's collectives (by name) made while it is on: what reaches the
    process groups, whatever zen reports of itself."""

    def __init__(self):
        self.calls = {}
        self.on = False
        tap_collectives(self._record)

    def _record(self, name, args, kwargs):
        if self.on:
            self.calls[name] = self.calls.get(name, 0) + 1


def _steady_collectives(rank, world, scheme, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zen
    from zen.bucket_plan import RECHECK_STEPS

    counting = Counting()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())])
    plain = DDP(copy.deepcopy(model), bucket_cap_mb=0.25)
    hooked = DDP(copy.deepcopy(model), bucket_cap_mb=0.25)
    state = zen.ZenState(scheme=scheme)
    hooked.register_comm_hook(state, zen.zen_hook)
    buckets, sent = [], []
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x, y = torch.randn(32, 256, generator=gen), torch.randn(32, 256, generator=gen)
        for ddp in (plain, hooked):
            ddp.zero_grad()
            before = state.summary()
            counting.on = ddp is hooked and 4 <= step < RECHECK_STEPS
            nn.functional.mse_loss(ddp(x), y).backward()
            counting.on = False
            if ddp is hooked and 4 <= step < RECHECK_STEPS:
                after = state.summary()
                buckets.append(after["buckets"] - before["buckets"])
                sent.append((after["bytes_sent"] - before["bytes_sent"], after["dense_bytes"] - before["dense_bytes"]))
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), hooked.parameters()))
    return counting.calls, buckets, same, sent


@pytest.mark.parametrize("scheme", ["dense", "zen"])
def test_a_steady_dense_bucket_is_one_all_reduce(scheme):
    """A dense model's buckets, past the first checks and before the next: one dist.all_reduce per bucket and
    no other collective (no agreement, no size exchange), a ring all-reduce's bytes, and parameters
    bit-identical to plain DDP's."""
    steps = 12
    for calls, buckets, same, sent in run_ranks(2, _steady_collectives, scheme, steps):
        assert same
        assert len(buckets) == steps - 4 and all(b == buckets[0] for b in buckets) and buckets[0] >= 2, buckets
        assert calls == {"all_reduce": sum(buckets)}, (calls, buckets)
        assert all(mine == dense > 0 for mine, dense in sent), sent


def _bucket(shapes, index=0, last=True):
    """A LocalBucket of parameters of ``shapes``, their gradients rank-dependent ones."""
    parameters = [torch.zeros(shape) for shape in shapes]
    numel = sum(p.numel() for p in parameters)
    buffer = torch.arange(numel, dtype=torch.float32) % 7 + 1
    return LocalBucket(buffer, index, parameters, is_last=last)


def _mismatch(rank, world, when):
    import zen
    from zen.bucket_plan import RECHECK_STEPS

    state = zen.ZenState(scheme="dense")
    good, other = [(64, 64, 4), (32,)], [(64, 256), (32,)]  # the same numel and rows (row size 256)
    change = {"first": 0, "layout": 3, "recheck": 3}[when]
    raised = []
    for step in range(RECHECK_STEPS + 3):
        shapes = good
        if step >= change and rank == 1:
            shapes = other if when != "layout" else [(128, 128), (32,)]
        elif when == "layout" and step >= change:
            shapes = [(64, 256), (16,), (16,)]
        try:
            zen.zen_hook(state, _bucket(shapes)).wait()
        except zen.MismatchError as error:
            raised.append((step, str(error)))
            break
    return raised


@pytest.mark.parametrize("when", ["first", "layout", "recheck"])
def test_buckets_that_differ_raise_on_every_rank(when):
    """Rank 1's bucket differs from rank 0's: from the first step, from a layout change that both ranks make
    (differently), and from a step between checks (the same numel and rows, other shapes): every rank raises
    the same MismatchError, at the first step, at the change, and at the next re-check."""
    from zen.bucket_plan import RECHECK_STEPS

    results = run_ranks(2, _mismatch, when)
    expected_step = {"first": 0, "layout": 3, "recheck": RECHECK_STEPS}[when]
    for raised in results:
        assert len(raised) == 1, results
        step, message = raised[0]
        assert step == expected_step, results
        assert "differ across ranks" in message and ("shape" in message or "numel" in message), message
    assert results[0][0][1] == results[1][0][1]


def test_sparse_may_pay_only_well_below_the_rings_bytes():
    """At full density Balanced Parallelism's bytes are the ring's (a reduce-scatter and an all-gather): such a
    bucket is dense without timing anything. A bucket of a few rows may pay; one under SPARSE_BYTES (0.9) of the
    ring's bytes may pay, one over it does not."""
    from zen.bucket_plan import sparse_may_pay

    segments = [(0, 512 * 512, 512), (512 * 512, 512, 1)]  # a weight of 512 rows of 512, a bias
    full = torch.tensor([[512, 512, 512 * 512, 512]] * 2)  # per rank: bias elements, rows; weight elements, rows
    assert not sparse_may_pay(full, segments, 4)
    few = torch.tensor([[512, 512, 8 * 512, 8]] * 2)
    assert sparse_may_pay(few, segments, 4)
    # At two ranks the bound is about rows / 512 of the ring's bytes (push and pull each move half of the rows):
    for rows, expected in ((400, True), (480, False)):  # 0.78 and 0.94 of the ring's
        counts = torch.tensor([[0, 0, rows * 512, rows]] * 2)
        assert sparse_may_pay(counts, segments, 4) == expected, rows
