"""Top-k sparsification with error feedback (zen.topk, ZenState(topk_ratio=...)): mass conservation, selection,
the hook's sums against dist.all_reduce of what a plain-torch reference sends, global top-k, checkpoints,
bucket rebuilds, bad settings."""
import io
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from distributed import LocalBucket, run_ranks
from zen import topk


def _gradient(numel, seed, zeros=0.0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * scale
    if zeros:
        x[torch.rand(numel, generator=g) < zeros] = 0.0
    return x


# --- one rank: the maths ------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(numel=st.integers(1, 3000), ratio=st.floats(0.001, 1.0), seed=st.integers(0, 10_000),
       zeros=st.sampled_from([0.0, 0.5, 0.99]), steps=st.integers(1, 4), selection=st.sampled_from(topk.SELECTIONS))
def test_error_feedback_conserves_mass_bit_exactly(numel, ratio, seed, zeros, steps, selection):
    """sent + e' == g + e, bit for bit in float32, step after step; and sent holds at most ~k entries."""
    kept = topk.Residual(numel)
    selector = topk.Selector(selection, sampled_from=1)
    for step in range(steps):
        grad = _gradient(numel, seed + step, zeros)
        old = kept.error.clone() if kept.error is not None else torch.zeros(numel)
        expected = grad + old
        buffer = grad.clone()
        idx, val = topk.sparsify(buffer, [((0, numel, 1), kept)], ratio, selector, step, ["p"], True, None)
        assert torch.equal(buffer + kept.error, expected)
        assert torch.equal(buffer[idx], val) and int((buffer != 0).sum()) == int((val != 0).sum())
        assert bool((kept.error[idx] == 0).all())
        assert idx.numel() <= max(topk.BAND[1] * topk.keep_count(ratio, numel), 1) + 1e-9


def test_momentum_correction_conserves_mass_and_masks_momentum():
    numel, m = 5000, 0.9
    kept = topk.Residual(numel)
    selector = topk.Selector("exact")
    u, v = torch.zeros(numel), torch.zeros(numel)
    for step in range(3):
        grad = _gradient(numel, step)
        u = u * m + grad
        v = v + u
        buffer = grad.clone()
        idx, _ = topk.sparsify(buffer, [((0, numel, 1), kept)], 0.01, selector, step, ["p"], True, m)
        assert torch.equal(buffer + kept.error, v)
        u[idx] = 0
        v = kept.error.clone()
        assert torch.equal(kept.momentum, u)


def test_exact_selection_equals_torch_topk():
    for numel, ratio in [(1000, 0.01), (4096, 0.1), (70_000, 0.003)]:
        acc = _gradient(numel, numel)
        k = topk.keep_count(ratio, numel)
        idx, val = topk.Selector("exact").select(acc, k, ("p",), 0)
        ref = torch.topk(acc.abs(), k).indices.sort().values
        assert torch.equal(idx.long(), ref) and torch.equal(val, acc[ref])


@pytest.mark.parametrize("law", ["normal", "heavy", "sparse", "drifting"])
def test_sampled_selection_stays_in_band(law):
    """Sampled counts are within [0.8 k, 1.3 k] on every step, the threshold reused between estimates; the
    entries taken are the largest ones (every entry left out is smaller than every entry taken)."""
    numel, ratio = 400_000, 0.01
    k = topk.keep_count(ratio, numel)
    selector = topk.Selector("sampled", reestimate_every=4)
    for step in range(12):
        g = torch.Generator().manual_seed(step)
        if law == "heavy":
            acc = torch.randn(numel, generator=g) ** 3
        elif law == "sparse":
            acc = torch.randn(numel, generator=g) * (torch.rand(numel, generator=g) < 0.05)
        elif law == "drifting":
            acc = torch.randn(numel, generator=g) * (1.0 + step)
        else:
            acc = torch.randn(numel, generator=g)
        idx, val = selector.select(acc, k, ("p",), step)
        assert topk.BAND[0] * k <= idx.numel() <= topk.BAND[1] * k, (step, idx.numel(), k)
        left = torch.ones(numel, dtype=torch.bool)
        left[idx.long()] = False
        assert float(acc[left].abs().max()) <= float(val.abs().min())
    assert "reused" in selector.last.values() or law == "drifting"


def test_ramp_and_keep_count():
    assert topk.keep_count(0.01, 1) == 1 and topk.keep_count(0.01, 1000) == 10 and topk.keep_count(1.0, 7) == 7
    assert topk.ramped_ratio(0.01, 5, None, 5) == 0.01
    path = [topk.ramped_ratio(0.01, 5, 4, s) for s in range(5, 12)]
    assert path[0] == pytest.approx(0.01 ** 0.25) and path[3:] == [0.01] * 4
    assert all(a > b for a, b in zip(path[:4], path[1:4]))


@pytest.mark.parametrize("kwargs, name", [
    (dict(topk_ratio=0.0), "topk_ratio"), (dict(topk_ratio=1.5), "topk_ratio"), (dict(topk_ratio=True), "topk_ratio"),
    (dict(topk_ratio=0.1, warmup_steps=1), "warmup_steps"), (dict(topk_ratio=0.1, warmup_steps=2.5), "warmup_steps"),
    (dict(topk_ratio=0.1, momentum=1.0), "momentum"), (dict(topk_ratio=0.1, selection="fast"), "selection"),
    (dict(topk_ratio=0.1, min_numel=0), "min_numel"), (dict(topk_ratio=0.1, density_ramp=0), "density_ramp"),
    (dict(global_topk=True), "global_topk"), (dict(topk_ratio=0.1, global_topk=True, scheme="sparcml"), "global_topk"),
    # checked without topk_ratio too
    (dict(selection="fast"), "selection"), (dict(momentum="0.9"), "momentum"), (dict(min_numel=-1), "min_numel"),
])
def test_bad_settings_raise_naming_the_setting(kwargs, name):
    import zen

    with pytest.raises(ValueError, match=name):
        zen.ZenState(**kwargs)


def test_the_parts_are_the_flat_keywords():
    """ZenState(topk=TopK(...), scheme=SchemeSettings(...)) is the flat form: same settings, checkpoints that load
    into each other, the flat names read back; a part given whole takes none of its keywords beside it, and
    belongs to one state (it keeps that state's residuals)."""
    import zen

    flat = zen.ZenState(topk_ratio=0.01, warmup_steps=2, momentum=0.9, num_probes=0, dense_threshold=0.5)
    parts = zen.ZenState(scheme=zen.SchemeSettings("zen", dense_threshold=0.5, num_probes=0),
                         topk=zen.TopK(0.01, warmup_steps=2, momentum=0.9))
    assert parts.topk_settings() == flat.topk_settings() and parts.scheme_settings == flat.scheme_settings
    assert (parts.topk_ratio, parts.momentum, parts.num_probes, parts.dense_threshold) == (0.01, 0.9, 0, 0.5)
    parts.load_state_dict(flat.state_dict())
    with pytest.raises(ValueError, match="warmup_steps"):
        zen.ZenState(topk_ratio=0.01, warmup_steps=3).load_state_dict(parts.state_dict())
    with pytest.raises(TypeError, match="warmup_steps given beside"):
        zen.ZenState(topk=zen.TopK(0.01), warmup_steps=3)
    with pytest.raises(TypeError, match="num_probes given beside"):
        zen.ZenState(scheme=zen.SchemeSettings("zen"), num_probes=0)
    with pytest.raises(ValueError, match="TopK: ratio must be None or in"):
        zen.TopK(1.5)
    topk = zen.TopK(0.01)
    zen.ZenState(topk=topk)
    with pytest.raises(ValueError, match="another ZenState's"):
        zen.ZenState(topk=topk)


# --- several ranks: the hook against a plain-torch reference and dist.all_reduce --------------------------


def _reference_step(grad, residual, ratio, world):
    """What one rank sends at a top-k step, in plain torch: acc = g / n + e, its top-k by magnitude (ties
    toward the lower index, as zen's kernels break them)."""
    acc = grad / world + residual
    k = topk.keep_count(ratio, acc.numel())
    sent = torch.zeros_like(acc)
    top = torch.sort(acc.abs(), descending=True, stable=True).indices[:k]
    sent[top] = acc[top]
    return sent, acc - sent


def _hook_matches_reference(rank, world, scheme, hierarchy):
    import zen

    torch.manual_seed(0)
    # A large matrix (sparsified), a bias (dense), as DDP's bucket lays them out.
    params = [torch.empty(64, 100), torch.empty(10)]
    numel = sum(p.numel() for p in params)
    state = zen.ZenState(scheme=scheme, topk_ratio=0.05, warmup_steps=2, selection="exact", hierarchy=hierarchy,
                         local_size=2)
    residual = torch.zeros(6400)
    for step in range(5):
        # Half-integers with distinct magnitudes: every sum is exact, the top-k is unique.
        grad = (torch.randperm(numel, generator=torch.Generator().manual_seed(10 * step + rank)).float() + 1) / 2
        grad *= torch.where(torch.rand(numel, generator=torch.Generator().manual_seed(step)) < 0.5, -1.0, 1.0)
        bucket = LocalBucket(grad.clone(), index=0, parameters=params, is_last=True)
        out = zen.zen_hook(state, bucket).wait()
        if step < 2:
            ref = grad / world
            dist.all_reduce(ref)
        else:
            sent, residual = _reference_step(grad[:6400], residual, 0.05, world)
            ref = torch.cat([sent, grad[6400:] / world])
            dist.all_reduce(ref)
            assert torch.equal(state.topk.residuals[0].error, residual)
            assert state.last_stats["sent"] == 320
            assert state.last_stats["hierarchy"] == hierarchy
        assert torch.equal(out, ref), (rank, step)
    assert state.summary()["steps"] == 5
    return state.summary()["bytes_sent"], state.summary()["dense_bytes"]


@pytest.mark.parametrize("scheme,hierarchy,world", [("zen", "flat", 2), ("agsparse", "flat", 2), ("auto", "flat", 2),
                                                     ("zen", "node", 4)])
def test_hook_topk_equals_allreduce_of_the_reference_selection(scheme, hierarchy, world):
    for sent, dense in run_ranks(world, _hook_matches_reference, scheme, hierarchy):
        assert 0 < sent < dense


def _global_topk(rank, world):
    import zen
    from zen import ops
    numel, ratio = 20_000, 0.01
    state = zen.ZenState(topk_ratio=ratio, warmup_steps=2, global_topk=True, selection="exact", min_numel=1)
    params = [torch.empty(numel)]
    for step in range(2):  # warm-up
        zen.zen_hook(state, LocalBucket(torch.zeros(numel), parameters=params, is_last=True)).wait()
    grad = _gradient(numel, 100 + rank)
    buffer = grad.clone()
    out = zen.zen_hook(state, LocalBucket(buffer, parameters=params, is_last=True)).wait()
    residual = state.topk.residuals[0].error
    # What each rank sent (its top-k of g / n), summed by dist.all_reduce.
    sent = torch.zeros(numel)
    acc = grad / world
    top = torch.topk(acc.abs(), topk.keep_count(ratio, numel)).indices
    sent[top] = acc[top]
    total = sent.clone()
    dist.all_reduce(total)
    kept = out != 0
    # The output is the full sum on the kept entries, nothing elsewhere; at most k per owner.
    assert torch.equal(out[kept], total[kept])
    assert int(kept.sum()) <= world * -(-topk.keep_count(ratio, numel) // world)
    # Each owner kept its largest sums.
    owner = ops.hash_partition(torch.arange(numel, dtype=torch.int32), world, state.comm().seed).long()
    for j in range(world):
        mine = (owner == j) & (total != 0)
        if bool((mine & ~kept).any()):
            assert float(total[mine & kept].abs().min()) >= float(total[mine & ~kept].abs().max())
    # Nothing lost: what reached the sum plus the residual is what this rank had.
    reached = torch.where(kept, sent, torch.zeros(numel))
    assert torch.equal(reached + residual, acc)
    assert state.last_stats["returned"] == int((sent != 0).sum() - (reached != 0).sum())
    return int(kept.sum()), state.last_stats["returned"]


def test_global_topk_keeps_the_largest_sums_and_returns_the_rest():
    results = run_ranks(3, _global_topk)
    assert results[0][0] > 0 and sum(r[1] for r in results) > 0


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 64)
        self.c = nn.Linear(64, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _train(ddp, opt, rank, steps):
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _resume(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zen

    def make(checkpoint=None):
        torch.manual_seed(0)
        model = _Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = zen.ZenState(topk_ratio=0.02, warmup_steps=2, selection="sampled", reestimate_every=3)
        if checkpoint is not None:
            saved = torch.load(io.BytesIO(checkpoint), weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            state.load_state_dict(saved["zen"])
        ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
        ddp.register_comm_hook(state, zen.zen_hook)
        return ddp, opt, state

    ddp, opt, state = make()
    _train(ddp, opt, rank, range(5))
    buf = io.BytesIO()
    torch.save(dict(model=ddp.module.state_dict(), opt=opt.state_dict(), zen=state.state_dict()), buf)
    _train(ddp, opt, rank, range(5, 9))
    uninterrupted = [p.detach().clone() for p in ddp.module.parameters()]

    ddp2, opt2, state2 = make(buf.getvalue())
    _train(ddp2, opt2, rank, range(5, 9))
    resumed = [p.detach().clone() for p in ddp2.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))
    assert state2.summary()["steps"] == state.summary()["steps"] == 9
    assert len(state.topk.residuals) >= 2 and all(bool(r.error.any()) for r in state.topk.residuals.values())
    return True


def test_checkpoint_resume_takes_the_same_steps():
    assert all(run_ranks(2, _resume))


def test_load_state_dict_rejects_other_settings():
    import zen

    saved = zen.ZenState(topk_ratio=0.01, warmup_steps=3).state_dict()
    with pytest.raises(ValueError, match="topk_ratio"):
        zen.ZenState(topk_ratio=0.02, warmup_steps=3).load_state_dict(saved)


def test_load_state_dict_rejects_residuals_of_another_world_size(monkeypatch):
    import zen

    saved = zen.ZenState(topk_ratio=0.01, warmup_steps=3).state_dict()
    saved.update(world=2, residuals={0: dict(numel=4, error=torch.ones(4), momentum=None)})
    monkeypatch.setattr(zen.ZenState, "_world", lambda self: 3)
    with pytest.raises(ValueError, match="averaged over 2 ranks; this group has 3"):
        zen.ZenState(topk_ratio=0.01, warmup_steps=3).load_state_dict(saved)
    monkeypatch.setattr(zen.ZenState, "_world", lambda self: 2)
    resumed = zen.ZenState(topk_ratio=0.01, warmup_steps=3)
    resumed.load_state_dict(saved)
    assert torch.equal(resumed.topk.residuals[0].error, torch.ones(4))


def test_pickling_leaves_out_the_group_and_warns_on_reattach():
    import zen

    state = zen.ZenState(topk_ratio=0.01, warmup_steps=3)
    state.process_group = object()
    copy = pickle.loads(pickle.dumps(state))
    assert copy.process_group is None and copy.topk_ratio == 0.01
    # No default group in this process: the reattach warns that it takes the default group, then finds none.
    with pytest.warns(UserWarning, match="unpickled without its process group: it now uses the default group"):
        with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
            copy.comm()


class _Bare:
    """A bucket that tells nothing of its parameters."""

    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer

    def index(self):
        return 0

    def is_last(self):
        return True


def _rebuild(rank, world):
    """Residuals follow their parameters through a new bucket layout; where the parameters are unknown, a
    new layout drops them with a warning."""
    import zen

    state = zen.ZenState(topk_ratio=0.1, warmup_steps=2, min_numel=1, selection="exact")
    a, b = torch.empty(3000), torch.empty(2000)
    residual = torch.zeros(5000)
    for step in range(5):
        grad = _gradient(5000, step + 10 * rank)
        if step < 3:  # one bucket [a, b]
            out = zen.zen_hook(state, LocalBucket(grad.clone(), parameters=[a, b], is_last=True)).wait()
        else:  # rebuilt: [b], then [a]
            out_b = zen.zen_hook(state, LocalBucket(grad[3000:].clone(), index=0, parameters=[b])).wait()
            out_a = zen.zen_hook(state, LocalBucket(grad[:3000].clone(), index=1, parameters=[a],
                                                    is_last=True)).wait()
            out = torch.cat([out_a, out_b])
        if step >= 2:
            sent_a, residual_a = _reference_step(grad[:3000], residual[:3000], 0.1, world)
            sent_b, residual_b = _reference_step(grad[3000:], residual[3000:], 0.1, world)
            residual = torch.cat([residual_a, residual_b])
            ref = torch.cat([sent_a, sent_b])
            dist.all_reduce(ref)
            assert torch.equal(out, ref), step
    assert torch.equal(torch.cat([state.topk.residuals[0].error, state.topk.residuals[1].error]), residual)

    unknown = zen.ZenState(topk_ratio=0.1, warmup_steps=2, min_numel=1)
    for step in range(3):
        zen.zen_hook(unknown, _Bare(_gradient(5000, step + rank))).wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = zen.zen_hook(unknown, _Bare(_gradient(3000, rank))).wait()
    assert any("layout" in str(w.message) for w in caught)
    sent, _ = _reference_step(_gradient(3000, rank), torch.zeros(3000), 0.1, world)
    dist.all_reduce(sent)
    assert torch.equal(out, sent)
    return True


def test_residuals_follow_parameters_through_a_rebuild():
    assert all(run_ranks(2, _rebuild))


def _unnamed_parameters(rank, world):
    """LocalBucket without ``parameters`` (a new buffer each step): the residual is kept by the bucket's index
    and carries over, so each step sends what the plain-torch reference sends."""
    import zen

    state = zen.ZenState(topk_ratio=0.05, warmup_steps=2, min_numel=1, selection="exact")
    residual = torch.zeros(5000)
    for step in range(5):
        grad = _gradient(5000, 10 * step + rank)
        out = zen.zen_hook(state, LocalBucket(grad.clone(), index=0, is_last=True)).wait()
        ref, residual = (grad / world, residual) if step < 2 else _reference_step(grad, residual, 0.05, world)
        dist.all_reduce(ref)
        assert torch.equal(out, ref), step
    assert list(state.topk.residuals) == [("bucket", 0, 0)], list(state.topk.residuals)
    assert torch.equal(state.topk.residuals[("bucket", 0, 0)].error, residual) and state.summary()["steps"] == 5
    return True


def test_residuals_of_a_bucket_without_parameters_carry_over():
    assert all(run_ranks(2, _unnamed_parameters))


def _different_settings(rank, world):
    """Settings that differ in what a step sends, or in whether it is sparsified at all (top-k on one rank
    only, another warm-up, values in half on one rank): every rank raises on the state's first call."""
    import zen

    cases = [(dict(topk_ratio=0.01 if rank == 0 else 0.02, warmup_steps=2), "topk_ratio"),
             (dict(topk_ratio=0.01, warmup_steps=2 + rank), "warmup_steps"),
             (dict(topk_ratio=0.01, warmup_steps=2) if rank else {}, "topk_ratio"),
             (dict(value_dtype=torch.bfloat16) if rank else {}, "value_dtype")]
    for settings, name in cases:
        state = zen.ZenState(**settings)
        with pytest.raises(zen.MismatchError, match=name):
            zen.zen_hook(state, LocalBucket(torch.ones(5000), is_last=True)).wait()
    x = torch.ones(10)
    zen.all_reduce(x)  # the group is still usable
    return x[0].item() == world


def test_ranks_with_different_settings_all_raise():
    assert all(run_ranks(2, _different_settings))


def _nan(rank, world):
    """At the first top-k step, rank 1 holds NaN at 1234, +Inf at 77 and 5, rank 0 -Inf at 77 and 99: plain DDP's
    all-reduce gives NaN at 1234 and 77 (Inf - Inf), +Inf at 5, -Inf at 99, and finite values elsewhere."""
    import zen

    state = zen.ZenState(topk_ratio=0.001, warmup_steps=2, min_numel=1)
    for step in range(3):
        grad = _gradient(10_000, rank + step)
        if step == 2:
            for at, value in ({1234: "nan", 77: "inf", 5: "inf"} if rank == 1 else {77: "-inf", 99: "-inf"}).items():
                grad[at] = float(value)
        dense = grad / world  # plain DDP's average
        dist.all_reduce(dense)
        out = zen.zen_hook(state, LocalBucket(grad, is_last=True)).wait()
    return out.numpy(), dense.numpy()  # by value: a tensor's shared memory can go with the rank's process


def test_nan_and_inf_propagate_as_in_plain_ddp():
    """Elementwise against plain DDP's all-reduce of the same gradients: NaN exactly where it has NaN, the same
    signed Inf exactly where it has Inf (top-k sends non-finite entries first); finite everywhere else."""
    for out, dense in run_ranks(2, _nan):
        out, dense = torch.from_numpy(out), torch.from_numpy(dense)
        assert torch.isnan(dense).nonzero().view(-1).tolist() == [77, 1234]  # the case is as built
        assert torch.equal(torch.isnan(out), torch.isnan(dense)), torch.isnan(out).nonzero().view(-1).tolist()
        inf = torch.isinf(dense)
        assert inf.nonzero().view(-1).tolist() == [5, 99]
        assert torch.equal(torch.isinf(out), inf) and torch.equal(out[inf], dense[inf]), out[inf]


def _value_dtype(rank, world, dtype, ratio):
    import zen

    state = zen.ZenState(value_dtype=dtype, topk_ratio=ratio, warmup_steps=2, min_numel=1, selection="exact")
    plain = zen.ZenState(topk_ratio=ratio, warmup_steps=2, min_numel=1, selection="exact")
    params = [torch.empty(20_000)]
    for step in range(3):
        # A third is not a float16 or bfloat16 number: the rounding on the wire shows.
        grad = _gradient(20_000, 10 * step + rank, zeros=0.99) / 3
        out = zen.zen_hook(state, LocalBucket(grad.clone(), parameters=params, is_last=True)).wait()
        full = zen.zen_hook(plain, LocalBucket(grad.clone(), parameters=params, is_last=True)).wait()
        if ratio is None or step < 2:
            # Each rank's values rounded to the wire dtype, summed in float32 by the owner, rounded again.
            ref = (grad / world).to(dtype).float()
            dist.all_reduce(ref)
            assert torch.equal(out, ref.to(dtype).float()), step
        assert not torch.equal(out, full) and torch.allclose(out, full, rtol=1e-2, atol=1e-6)
    assert state.summary()["bytes_sent"] < 0.8 * plain.summary()["bytes_sent"]
    return True


@pytest.mark.parametrize("dtype, ratio", [(torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, 0.01)])
def test_value_dtype_sends_half_and_sums_in_float32(dtype, ratio):
    assert all(run_ranks(2, _value_dtype, dtype, ratio))


def test_value_dtype_needs_a_scheme_that_sums_it():
    import zen

    with pytest.raises(ValueError, match="value_dtype"):
        zen.ZenState(value_dtype=torch.bfloat16, scheme="sparcml")
    with pytest.raises(ValueError, match="value_dtype"):
        zen.ZenState(value_dtype=torch.int8)
