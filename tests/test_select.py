"""topk_select and threshold_select against plain-torch references, with hypothesis."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zen import ops

from conftest import DEVICE

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Per dtype: the signed integer type of its width, and the key of +-Inf (the bits without the sign).
BITS = {torch.float16: (torch.int16, 0x7C00), torch.bfloat16: (torch.int16, 0x7F80),
        torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}


def magnitude_keys(x):
    """The documented order on magnitudes, as int64: |x| for finite values, then +-Inf, then every NaN (one
    key, so NaNs tie); both zeros are key 0."""
    int_type, inf_key = BITS[x.dtype]
    keys = x.view(int_type).long() & (torch.iinfo(int_type).max)
    return torch.where(torch.isnan(x), torch.full_like(keys, inf_key + 1), keys)


def reference_topk(x, k):
    """Indices (ascending, int64) of the top min(k, nnz) by magnitude key, ties to the lower index."""
    keys = magnitude_keys(x)
    order = torch.sort(-keys, stable=True).indices
    return order[:min(k, int((keys != 0).sum()))].sort().values


def distinct_magnitudes(numel, dtype, seed, zeros=0.0):
    """numel entries of distinct finite magnitudes (random bit patterns, denormals included) and random signs,
    a fraction of them zeros."""
    int_type, inf_key = BITS[dtype]
    g = torch.Generator().manual_seed(seed)
    span = min(inf_key - 1, 1 << 40)
    keys = torch.randint(1, span, (numel * 2 + 8,), generator=g).unique()
    keys = keys[torch.randperm(keys.numel(), generator=g)][:numel]
    signs = torch.randint(0, 2, (keys.numel(),), generator=g).bool()
    x = keys.to(int_type).view(dtype).clone()
    x[signs] = -x[signs]
    x[torch.rand(keys.numel(), generator=g) < zeros] = 0.0
    return x


def check_topk(x, k):
    idx, val = ops.topk_select(x.to(DEVICE), k)
    ref = reference_topk(x, k)
    assert idx.dtype == torch.int32 and val.dtype == x.dtype
    assert torch.equal(idx.cpu().long(), ref)
    assert torch.equal(val.cpu().view(BITS[x.dtype][0]), x[ref].view(BITS[x.dtype][0]))  # bit for bit, NaNs too
    return idx.cpu().long(), val.cpu()


# --- topk_select -------------------------------------------------------------------------------------------
@given(st.integers(1, 3000), st.integers(0, 3100), st.sampled_from(FLOATS), st.integers(0, 2**31),
       st.sampled_from([0.0, 0.3, 0.95]))
def test_topk_equals_torch_topk_on_distinct_magnitudes(numel, k, dtype, seed, zeros):
    x = distinct_magnitudes(numel, dtype, seed, zeros)
    idx, val = check_topk(x, k)
    nnz = int((x != 0).sum())
    expected = torch.topk(x.double().abs(), min(k, nnz)).indices  # distinct magnitudes: one answer
    assert idx.tolist() == sorted(expected.tolist())


def test_topk_ties_go_to_the_lower_index():
    x = torch.tensor([1.0, -1.0, 0.0, 2.0, -1.0, 1.0, -2.0])
    assert ops.topk_select(x.to(DEVICE), 3)[0].cpu().tolist() == [0, 3, 6]
    assert ops.topk_select(x.to(DEVICE), 4)[0].cpu().tolist() == [0, 1, 3, 6]
    ties = torch.full((5000,), -0.5)
    ties[::3] = 0.0
    for k in (1, 10, 3000):
        idx, val = ops.topk_select(ties.to(DEVICE), k)
        assert torch.equal(idx.cpu().long(), torch.nonzero(ties).view(-1)[:k])
        assert torch.all(val.cpu() == -0.5)


@given(st.integers(1, 2000), st.integers(1, 2100), st.sampled_from(FLOATS), st.integers(0, 2**31))
def test_topk_with_few_magnitudes_matches_the_tie_rule(numel, k, dtype, seed):
    """Many ties at every magnitude: the first k by (magnitude descending, index ascending)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(-4, 5, (numel,), generator=g) * 0.5).to(dtype)
    check_topk(x, k)


def test_topk_never_takes_a_zero():
    x = torch.tensor([0.0, -0.0, 3.0, 0.0, -1e-30, -0.0])
    idx, val = ops.topk_select(x.to(DEVICE), 6)
    assert idx.cpu().tolist() == [2, 4] and torch.equal(val.cpu(), x[[2, 4]])
    idx, val = ops.topk_select(torch.zeros(100, device=DEVICE), 5)
    assert idx.numel() == 0 and val.numel() == 0


@pytest.mark.parametrize("dtype", FLOATS)
def test_topk_k_zero_past_nnz_and_empty(dtype):
    x = torch.tensor([0.0, 2.0, 0.0, -1.0, 0.5], dtype=dtype)
    idx, val = ops.topk_select(x.to(DEVICE), 0)
    assert idx.numel() == 0 and idx.dtype == torch.int32 and val.dtype == dtype and val.numel() == 0
    for k in (3, 4, 1000):
        idx, val = ops.topk_select(x.to(DEVICE), k)
        assert idx.cpu().tolist() == [1, 3, 4] and torch.equal(val.cpu(), x[[1, 3, 4]])
        nz_idx, nz_val = ops.nonzero(x.to(DEVICE))
        assert torch.equal(idx, nz_idx) and torch.equal(val, nz_val)
    for k in (0, 5):
        idx, val = ops.topk_select(torch.empty(0, dtype=dtype, device=DEVICE), k)
        assert idx.numel() == 0 and idx.dtype == torch.int32 and val.dtype == dtype


@pytest.mark.parametrize("dtype", FLOATS)
def test_topk_takes_nan_then_inf_first(dtype):
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([1e3, nan, -inf, 5.0, inf, nan, -7.0], dtype=dtype)
    x[5] = -x[5]  # a NaN with its sign bit set is a NaN all the same
    expected = {1: [1], 2: [1, 5], 3: [1, 2, 5], 4: [1, 2, 4, 5], 5: [0, 1, 2, 4, 5], 7: [0, 1, 2, 3, 4, 5, 6]}
    for k, want in expected.items():
        idx, val = ops.topk_select(x.to(DEVICE), k)
        assert idx.cpu().tolist() == want
        assert torch.equal(val.cpu().view(BITS[dtype][0]), x[want].view(BITS[dtype][0]))
    many_nans = torch.full((300,), nan, dtype=dtype)
    assert ops.topk_select(many_nans.to(DEVICE), 7)[0].cpu().tolist() == list(range(7))


@pytest.mark.parametrize("dtype", FLOATS)
def test_topk_index_dtype_and_values(dtype):
    x = distinct_magnitudes(1000, dtype, 3)
    idx, val = ops.topk_select(x.to(DEVICE), 10)
    assert idx.dtype == torch.int32 and val.dtype == dtype and idx.device == val.device == x.to(DEVICE).device
    assert torch.equal(val.cpu(), x[idx.cpu().long()])
    assert torch.all(idx[1:] > idx[:-1])


def test_topk_large_tensors():
    """Past 2^20 elements the bounds come from a sample of the keys: the result must not depend on it, also
    where the sample misleads (spikes on the sampled positions, or just off them) and the histogram decides."""
    numel = (1 << 20) + 5
    g = torch.Generator().manual_seed(7)
    x = torch.randn(numel, generator=g)
    for k in (1, 1000, numel // 100, numel // 2):
        check_topk(x, k)
    stride = numel // (1 << 17)
    for offset in (stride // 2, stride // 2 + 1):
        spiky = torch.randn(numel, generator=g) * 0.01
        spiky[offset::stride] = 100.0
        for k in (10, 5000, 200_000):
            check_topk(spiky, k)
    sparse = torch.zeros(numel, dtype=torch.float16)
    sparse[::50] = torch.randn(sparse[::50].numel(), generator=g).half()
    for k in (100, 20_000, 21_000, 30_000):
        check_topk(sparse, k)
    ties = torch.ones(numel, dtype=torch.bfloat16)
    ties[1::2] = -1.0
    check_topk(ties, 12345)
    regions = torch.randn(numel, generator=g, dtype=torch.float64)
    regions[: numel // 3] *= 1e-6  # one flat buffer of layers at very different scales
    for k in (100, numel // 3, numel - numel // 3 + 7):
        check_topk(regions, k)


# --- threshold_select --------------------------------------------------------------------------------------
def reference_threshold(x, threshold):
    mask = ((x.abs() >= threshold) & (x != 0)) | torch.isnan(x)
    return torch.nonzero(mask).view(-1)


@given(st.integers(0, 3000), st.sampled_from(FLOATS), st.integers(0, 2**31),
       st.one_of(st.floats(0.0, 4.0), st.floats(0.0, 1e-30), st.floats(0.0, 1e40), st.just(float("inf"))))
def test_threshold_equals_a_torch_mask(numel, dtype, seed, threshold):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(numel, generator=g) * torch.rand(numel, generator=g) ** 8 * 4).to(dtype)
    x[torch.rand(numel, generator=g) < 0.2] = 0.0
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40], dtype=dtype)
    if numel > 10:
        x[torch.randint(0, numel, (5,), generator=g)] = special
    idx, val = ops.threshold_select(x.to(DEVICE), threshold)
    ref = reference_threshold(x, threshold)
    assert idx.dtype == torch.int32 and val.dtype == dtype
    assert torch.equal(idx.cpu().long(), ref)
    assert torch.equal(val.cpu().view(BITS[dtype][0]), x[ref].view(BITS[dtype][0]))


@pytest.mark.parametrize("dtype", FLOATS)
def test_threshold_edges(dtype):
    x = torch.tensor([0.0, -0.0, 0.5, -2.0, float("nan"), float("inf"), -1.0], dtype=dtype)
    assert ops.threshold_select(x.to(DEVICE), 0.0)[0].cpu().tolist() == [2, 3, 4, 5, 6]  # the non-zeros
    assert ops.threshold_select(x.to(DEVICE), 1.0)[0].cpu().tolist() == [3, 4, 5, 6]  # >=: 1.0 itself is in
    assert ops.threshold_select(x.to(DEVICE), float("inf"))[0].cpu().tolist() == [4, 5]  # NaN always
    idx, val = ops.threshold_select(torch.empty(0, dtype=dtype, device=DEVICE), 1.0)
    assert idx.numel() == 0 and idx.dtype == torch.int32 and val.dtype == dtype


def test_threshold_large_tensor_matches_topk():
    x = torch.randn((1 << 20) + 3, generator=torch.Generator().manual_seed(5))
    idx, val = ops.topk_select(x.to(DEVICE), 1000)
    floor = val.abs().min().item()
    t_idx, t_val = ops.threshold_select(x.to(DEVICE), floor)
    assert torch.equal(t_idx.cpu(), idx.cpu()) and torch.equal(t_val.cpu(), val.cpu())  # distinct magnitudes


# --- bad input ---------------------------------------------------------------------------------------------
def test_select_rejects_bad_input():
    x = torch.ones(10, device=DEVICE)
    with pytest.raises(RuntimeError, match="topk_select: k must be >= 0, got -1"):
        ops.topk_select(x, -1)
    with pytest.raises(RuntimeError, match=r"threshold must be >= 0 \(a magnitude\), got -0.5"):
        ops.threshold_select(x, -0.5)
    with pytest.raises(RuntimeError, match="threshold must be >= 0"):
        ops.threshold_select(x, float("nan"))
    for op, arg in ((ops.topk_select, 2), (ops.threshold_select, 0.5)):
        with pytest.raises(RuntimeError, match="dense must be 1-D, got 2 dimensions"):
            op(torch.ones(2, 5, device=DEVICE), arg)
        with pytest.raises(RuntimeError, match="dense must be contiguous"):
            op(torch.ones(20, device=DEVICE)[::2], arg)
        for dtype in (torch.int32, torch.int64, torch.uint8, torch.bool):
            with pytest.raises(RuntimeError, match="dense must be float16, bfloat16, float32 or float64, got"):
                op(torch.ones(4, dtype=dtype, device=DEVICE), arg)
    with pytest.raises((RuntimeError, TypeError)):
        ops.topk_select(x, 1.5)


def test_select_ops_pass_opcheck():
    x = torch.tensor([0.0, 3.0, -1.0, 2.0], device=DEVICE)
    torch.library.opcheck(torch.ops.zen.topk_select.default, (x, 2), test_utils=("test_schema",))
    torch.library.opcheck(torch.ops.zen.threshold_select.default, (x, 1.5), test_utils=("test_schema",))
