"""Every kernel against its plain-torch reference (tests/reference.py), with hypothesis."""
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import zen
from zen import ops

from conftest import DEVICE
from reference import aggregate as ref_aggregate
from reference import index_sets as ref_index_sets
from reference import nonzero as ref_nonzero
from reference import partition_of

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
seeds = st.integers(min_value=0, max_value=2**63 - 1)


@st.composite
def sparse_index_sets(draw, max_numel=5000):
    """Unique indices in [0, numel): uniform, skewed to the front (as frequency-ordered embeddings), or
    adversarial (the edges 0 and numel-1, one dense run)."""
    numel = draw(st.integers(1, max_numel))
    kind = draw(st.sampled_from(["uniform", "skewed", "edges", "run", "empty", "full"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if kind == "uniform":
        mask = torch.rand(numel, generator=g) < draw(st.floats(0.0, 1.0))
    elif kind == "skewed":
        pos = (torch.rand(max(1, numel // 4), generator=g) ** 4 * numel).long()
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[pos] = True
    elif kind == "edges":
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[0] = mask[-1] = True
    elif kind == "run":
        start = draw(st.integers(0, numel - 1))
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[start:start + draw(st.integers(1, numel))] = True
    elif kind == "empty":
        mask = torch.zeros(numel, dtype=torch.bool)
    else:
        mask = torch.ones(numel, dtype=torch.bool)
    return numel, torch.nonzero(mask).view(-1)


def values_for(count, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randint(-50, 50, (count,), generator=g) * 0.25).to(dtype)
    return torch.randint(-1000, 1000, (count,), generator=g).to(dtype)


# --- hash -----------------------------------------------------------------------------------------------
@given(st.lists(st.integers(0, 2**62), min_size=1, max_size=50), seeds, st.integers(1, 300))
def test_hash_partition_matches_documented_h0(indices, seed, n):
    t = torch.tensor(indices, dtype=torch.int64, device=DEVICE)
    got = ops.hash_partition(t, n, seed).cpu().tolist()
    assert got == [partition_of(i, seed, n) for i in indices]
    assert ops.hash_partition(t.to(torch.int32) if max(indices) < 2**31 else t, n, seed).cpu().tolist() == got


def test_hash_partition_is_balanced():
    counts = torch.bincount(ops.hash_partition(torch.arange(1 << 20, device=DEVICE), 16, 1234).cpu().long())
    assert counts.max().item() / counts.float().mean().item() < 1.01


# --- nonzero ---------------------------------------------------------------------------------------------
@given(sparse_index_sets(), st.sampled_from(DTYPES))
def test_nonzero_matches_reference(case, dtype):
    numel, idx = case
    dense = torch.zeros(numel, dtype=dtype)
    dense[idx] = values_for(idx.numel(), dtype, 1)
    dense[idx[dense[idx] == 0]] = 1  # every chosen position non-zero
    got_idx, got_val = ops.nonzero(dense.to(DEVICE))
    ref_idx, ref_val = ref_nonzero(dense)
    assert got_idx.dtype == torch.int32
    assert torch.equal(got_idx.cpu().long(), ref_idx)
    assert torch.equal(got_val.cpu(), ref_val)


def test_nonzero_special_values():
    x = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 0.0], device=DEVICE)
    idx, val = ops.nonzero(x)
    assert idx.cpu().tolist() == [2, 3, 4, 5, 6]
    assert torch.isnan(val[0]) and val[1] == float("inf") and val[2] == -float("inf")


@pytest.mark.parametrize("dtype", DTYPES + [torch.int8, torch.uint8, torch.int16])
def test_nonzero_long_tensors(dtype):
    """Beyond one chunk of the scan and not a multiple of its 64-element words: every width of element, with
    -0.0 (a zero), NaN and subnormals among the non-zeros of float types."""
    g = torch.Generator().manual_seed(3)
    numel = 3 * 2**16 + 101  # the scan's chunks are 2**16 elements
    dense = torch.zeros(numel, dtype=dtype)
    at = torch.randperm(numel, generator=g)[:numel // 50]
    dense[at] = torch.randint(1, 100, (at.numel(),), generator=g).to(dtype)
    dense[[0, 63, 64, 2**16 - 1, 2**16, numel - 1]] = torch.ones(6, dtype=dtype)
    if dtype.is_floating_point:
        dense[[5, 2**16 + 7, numel - 2]] = torch.tensor([-0.0, float("nan"), torch.finfo(dtype).tiny / 4]).to(dtype)
    got_idx, got_val = ops.nonzero(dense.to(DEVICE))
    ref_idx, ref_val = ref_nonzero(dense)
    assert torch.equal(got_idx.cpu().long(), ref_idx)
    assert torch.equal(got_val.cpu().view(torch.uint8), ref_val.view(torch.uint8))


def test_nonzero_rejects_bad_input():
    with pytest.raises(RuntimeError, match="dense must be 1-D"):
        ops.nonzero(torch.zeros(2, 2, device=DEVICE))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.nonzero(torch.zeros(10, device=DEVICE)[::2])


@pytest.mark.skipif(DEVICE != "cpu", reason="2 GiB host tensor")
def test_nonzero_int64_indices_from_2_pow_31_elements():
    numel = 2**31 + 8
    dense = torch.zeros(numel, dtype=torch.uint8)
    dense[[0, 2**31 - 1, 2**31, numel - 1]] = 7
    idx, val = ops.nonzero(dense)
    assert idx.dtype == torch.int64
    assert idx.tolist() == [0, 2**31 - 1, 2**31, numel - 1] and val.tolist() == [7] * 4
    del dense


# --- partition -------------------------------------------------------------------------------------------
def check_partition(indices, values, n, seed, **settings):
    out_idx, out_val, counts, stats = ops.partition(indices.to(DEVICE), values.to(DEVICE), n, seed, **settings)
    out_idx, out_val, counts, stats = out_idx.cpu(), out_val.cpu(), counts.cpu(), stats.cpu()
    assert counts.sum().item() == indices.numel() == out_idx.numel()
    if settings.get("num_probes", 3) == 0:
        assert stats.tolist() == [0, 0, 0]  # counting sort: no tables
    else:
        assert stats[0] + stats[1] == indices.numel() or stats[2] == 1
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    pairs_in = {}
    for i, v in zip(indices.tolist(), values.tolist()):
        pairs_in.setdefault(i, []).append(v)
    for j in range(n):
        piece_idx = out_idx[offsets[j]:offsets[j + 1]].tolist()
        assert all(partition_of(i, seed, n) == j for i in piece_idx)
        for i, v in zip(piece_idx, out_val[offsets[j]:offsets[j + 1]].tolist()):
            pairs_in[i].remove(v)  # each pair exactly once
    assert all(not left for left in pairs_in.values())
    return stats


@given(sparse_index_sets(), st.integers(1, 9), seeds, st.sampled_from([torch.int32, torch.int64]))
def test_partition_every_pair_lands_once(case, n, seed, idx_dtype):
    numel, idx = case
    check_partition(idx.to(idx_dtype), values_for(idx.numel(), torch.float32), n, seed, num_probes=3)


@given(sparse_index_sets(), st.integers(1, 9), seeds)
def test_partition_by_counting_sort_keeps_pieces_ascending(case, n, seed):
    numel, idx = case
    out_idx, _, counts, stats = ops.partition(idx.to(torch.int32).to(DEVICE), torch.ones(idx.numel(), device=DEVICE),
                                              n, seed, num_probes=0)
    check_partition(idx.to(torch.int32), values_for(idx.numel(), torch.float32), n, seed, num_probes=0)
    offsets = [0] + torch.cumsum(counts.cpu(), 0).tolist()
    for j in range(n):
        piece = out_idx.cpu()[offsets[j]:offsets[j + 1]]
        assert torch.equal(piece, piece.sort().values)


@given(sparse_index_sets(), st.integers(1, 5), seeds, st.integers(1, 4), st.floats(1.0, 1.5), st.floats(0.0, 0.05))
def test_partition_with_tiny_tables_falls_back_without_loss(case, n, seed, probes, table_factor, serial_factor):
    numel, idx = case
    check_partition(idx.to(torch.int32), values_for(idx.numel(), torch.float64), n, seed, num_probes=probes,
                    table_factor=table_factor, serial_factor=serial_factor)


def test_partition_overflow_forces_the_fallback():
    idx = torch.arange(20000, dtype=torch.int32)
    stats = check_partition(idx, values_for(idx.numel(), torch.float32), 3, 7, num_probes=1, table_factor=1.0,
                            serial_factor=0.0)
    assert stats[2] == 1


def test_partition_all_into_one_partition_and_duplicates():
    seed, n = 99, 8
    parts = ops.hash_partition(torch.arange(50000), n, seed)
    idx = torch.nonzero(parts == 3).view(-1).to(torch.int32)
    idx = torch.cat([idx, idx[:100], torch.tensor([idx[0].item()] * 5, dtype=torch.int32)])  # duplicates kept
    stats = check_partition(idx, values_for(idx.numel(), torch.float32), n, seed, num_probes=3)
    assert stats[0] > 0


def test_partition_int64_indices_past_2_pow_31():
    idx = torch.tensor([0, 2**31 - 1, 2**31, 2**40, 2**62], dtype=torch.int64)
    check_partition(idx, values_for(idx.numel(), torch.float32), 4, 5)


def test_partition_rejects_bad_settings():
    i, v = torch.arange(4, dtype=torch.int32, device=DEVICE), torch.ones(4, device=DEVICE)
    with pytest.raises(RuntimeError, match="num_probes"):
        ops.partition(i, v, 2, 0, num_probes=-1)
    with pytest.raises(RuntimeError, match="table_factor"):
        ops.partition(i, v, 2, 0, table_factor=0.5)
    with pytest.raises(RuntimeError, match="num_partitions"):
        ops.partition(i, v, 0, 0)
    with pytest.raises(RuntimeError, match="same length"):
        ops.partition(i, v[:3], 2, 0)


# --- aggregate -------------------------------------------------------------------------------------------
@given(st.lists(sparse_index_sets(max_numel=2000), min_size=1, max_size=6), st.sampled_from(DTYPES))
def test_aggregate_matches_reference(pieces, dtype):
    numel = max(p[0] for p in pieces)
    idx = torch.cat([p[1] for p in pieces]).to(torch.int32)
    val = values_for(idx.numel(), dtype, 3)
    got_idx, got_val = ops.aggregate(idx.to(DEVICE), val.to(DEVICE), numel)
    ref_idx, ref_val = ref_aggregate(idx, val)
    assert torch.equal(got_idx.cpu().long(), ref_idx)
    assert torch.equal(got_val.cpu(), ref_val)  # quarter-integers: exact in every dtype at this size


@pytest.mark.parametrize("extra", [0, 20])  # a merge of 3 runs, and of 22 (each [r, r + 1] starts one)
def test_aggregate_sums_in_peer_order(extra):
    """Equal indices from several runs (peers' pieces) are summed in run order, as a sequential sum: in float32
    (1e8 + 1) - 1e8 is 0, where another order gives 1."""
    pieces = [([5], [1e8]), ([5], [1.0]), ([5], [-1e8])] + [([r, r + 1], [1.0, 2.0]) for r in range(10, 10 + extra)]
    idx = torch.tensor([i for piece, _ in pieces for i in piece], dtype=torch.int32)
    val = torch.tensor([v for _, values in pieces for v in values])
    got_idx, got_val = ops.aggregate(idx.to(DEVICE), val.to(DEVICE), 100)
    ref_idx, _ = ref_aggregate(idx, val)
    assert torch.equal(got_idx.cpu().long(), ref_idx)
    assert got_val.cpu()[0].item() == 0.0


@given(sparse_index_sets(max_numel=3000), st.integers(0, 2**31))
def test_aggregate_unordered_input(case, shuffle_seed):
    numel, idx = case
    idx = torch.cat([idx, idx, idx[: idx.numel() // 2]])
    idx = idx[torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(shuffle_seed))].to(torch.int32)
    val = values_for(idx.numel(), torch.float32, 4)
    got_idx, got_val = ops.aggregate(idx.to(DEVICE), val.to(DEVICE), numel)
    ref_idx, ref_val = ref_aggregate(idx, val)
    assert torch.equal(got_idx.cpu().long(), ref_idx) and torch.equal(got_val.cpu(), ref_val)


@given(st.integers(1, 6), seeds)
def test_aggregate_checks_partition_membership(n, seed):
    numel = 500
    parts = ops.hash_partition(torch.arange(numel), n, seed)
    mine = torch.nonzero(parts == 0).view(-1).to(torch.int32)
    ops.aggregate(mine.to(DEVICE), torch.ones(mine.numel(), device=DEVICE), numel, n, seed, 0)
    if n > 1:
        other = torch.nonzero(parts == 1).view(-1)[:1].to(torch.int32)
        with pytest.raises(RuntimeError, match="does not belong to partition 0"):
            ops.aggregate(other.to(DEVICE), torch.ones(1, device=DEVICE), numel, n, seed, 0)


def test_aggregate_rejects_out_of_range():
    for bad in ([-1], [10]):
        with pytest.raises(RuntimeError, match=r"outside \[0, 10\)"):
            ops.aggregate(torch.tensor(bad, dtype=torch.int32, device=DEVICE), torch.ones(1, device=DEVICE), 10)


# --- hash bitmap -----------------------------------------------------------------------------------------
@given(st.integers(0, 3000), st.integers(1, 9), seeds)
def test_index_sets_match_reference(numel, n, seed):
    sets, offsets = ops.bitmap_index_sets(numel, n, seed, DEVICE)
    ref = ref_index_sets(numel, n, seed)
    assert offsets.cpu().tolist() == [0] + torch.cumsum(torch.tensor([r.numel() for r in ref]), 0).tolist()
    for j in range(n):
        assert torch.equal(sets[offsets[j]:offsets[j + 1]].cpu().long(), ref[j])


@given(st.integers(1, 3000), st.integers(1, 9), seeds, st.floats(0.0, 1.0), st.integers(0, 2**31))
def test_bitmap_roundtrip(numel, n, seed, density, data_seed):
    sets, offsets = ops.bitmap_index_sets(numel, n, seed, DEVICE)
    g = torch.Generator().manual_seed(data_seed)
    for j in range(n):
        index_set = sets[offsets[j]:offsets[j + 1]]
        chosen = index_set[(torch.rand(index_set.numel(), generator=g) < density).to(DEVICE)]
        bitmap = ops.bitmap_encode(chosen, index_set)
        assert bitmap.dtype == torch.uint8 and bitmap.numel() == (index_set.numel() + 7) // 8
        ref_bits = torch.isin(index_set.cpu(), chosen.cpu())
        for r in range(index_set.numel()):
            assert bool(bitmap[r // 8].item() >> (r % 8) & 1) == bool(ref_bits[r])
        assert torch.equal(ops.bitmap_decode(bitmap, index_set, chosen.numel()).cpu(), chosen.cpu())


def test_bitmap_rejects_corrupt_input():
    sets, offsets = ops.bitmap_index_sets(100, 3, 11, DEVICE)
    index_set = sets[offsets[1]:offsets[2]]
    other = sets[offsets[0]:offsets[1]]
    with pytest.raises(RuntimeError, match="not in the partition's index set"):
        ops.bitmap_encode(other[:1], index_set)
    with pytest.raises(RuntimeError, match="ascending"):
        ops.bitmap_encode(index_set[:2].flip(0), index_set)
    bitmap = ops.bitmap_encode(index_set[:3], index_set)
    with pytest.raises(RuntimeError, match="truncated or corrupt"):
        ops.bitmap_decode(bitmap[:-1], index_set, 3)
    with pytest.raises(RuntimeError, match="bits set, expected 4"):
        ops.bitmap_decode(bitmap, index_set, 4)
    if index_set.numel() % 8:
        bad = bitmap.clone()
        bad[-1] = 0xFF
        with pytest.raises(RuntimeError, match="past its index set"):
            ops.bitmap_decode(bad, index_set, -1)


# --- scatter ---------------------------------------------------------------------------------------------
@given(sparse_index_sets(), st.sampled_from(DTYPES))
def test_scatter_matches_reference(case, dtype):
    numel, idx = case
    val = values_for(idx.numel(), dtype, 5)
    out = torch.zeros(numel, dtype=dtype, device=DEVICE)
    ops.scatter_(out, idx.to(torch.int32).to(DEVICE), val.to(DEVICE))
    ref = torch.zeros(numel, dtype=dtype)
    ref[idx] = val
    assert torch.equal(out.cpu(), ref)


@given(sparse_index_sets(max_numel=100_000), st.integers(1, 9), st.sampled_from(DTYPES), st.integers(0, 2**31))
def test_scatter_pieces_matches_reference(case, pieces, dtype, seed):
    """Disjoint pieces interleaved over the whole output (past the CPU's 64 KiB blocks), some shuffled
    (out of order: written as they come) and some empty, as scatter_ of each would write them."""
    numel, idx = case
    g = torch.Generator().manual_seed(seed)
    val = values_for(idx.numel(), dtype, 5)
    owner = torch.randint(0, pieces, (idx.numel(),), generator=g)
    split = []
    for j in range(pieces):
        i, v = idx[owner == j], val[owner == j]
        if j % 3 == 2:
            order = torch.randperm(i.numel(), generator=g)
            i, v = i[order], v[order]
        split.append((i.to(torch.int32).to(DEVICE), v.to(DEVICE)))
    out = torch.zeros(numel, dtype=dtype, device=DEVICE)
    ops.scatter_pieces_(out, split)
    ref = torch.zeros(numel, dtype=dtype)
    ref[idx] = val
    assert torch.equal(out.cpu(), ref)


def test_scatter_pieces_checks_every_piece_before_writing():
    out = torch.zeros(5, device=DEVICE)
    one = (torch.tensor([1], dtype=torch.int32, device=DEVICE), torch.ones(1, device=DEVICE))
    past_the_end = (torch.tensor([5], dtype=torch.int32, device=DEVICE), torch.ones(1, device=DEVICE))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.scatter_pieces_(out, [one, past_the_end])
    assert not out.any()
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.scatter_pieces_(out, [one, (torch.tensor([2], device=DEVICE), torch.ones(1, device=DEVICE))])
    with pytest.raises(RuntimeError, match="2 index pieces but 1 value"):
        torch.ops.zen.scatter_pieces_(out, [one[0], one[0]], [one[1]])
    ops.scatter_pieces_(out, [])
    assert not out.any()


def test_scatter_pieces_default_kernel():
    """The kernel of devices without their own (the GPU's: one scatter_ per piece), called directly."""
    op = torch.ops.zen.scatter_pieces_.default
    out = torch.zeros(10, device=DEVICE)
    idx = [torch.tensor([7, 1], dtype=torch.int32, device=DEVICE), torch.tensor([3], dtype=torch.int32, device=DEVICE)]
    val = [torch.tensor([1.0, 2.0], device=DEVICE), torch.tensor([5.0], device=DEVICE)]
    op._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, out, idx, val)
    assert out.cpu().tolist() == [0, 2, 0, 5, 0, 0, 0, 1, 0, 0]
    with pytest.raises(RuntimeError, match="out of range"):
        op._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, torch.zeros(10, device=DEVICE),
                  [idx[0], torch.tensor([10], dtype=torch.int32, device=DEVICE)], val)


def test_scatter_rejects_out_of_range():
    out = torch.zeros(5, device=DEVICE)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.scatter_(out, torch.tensor([0, 5], dtype=torch.int32, device=DEVICE), torch.ones(2, device=DEVICE))
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.scatter_(out, torch.tensor([0], dtype=torch.int32, device=DEVICE), torch.ones(1, dtype=torch.float64,
                                                                                          device=DEVICE))


def test_ops_pass_opcheck():
    idx = torch.tensor([0, 3, 7, 9], dtype=torch.int32, device=DEVICE)
    val = torch.tensor([1.0, 2.0, 3.0, 4.0], device=DEVICE)
    torch.library.opcheck(torch.ops.zen.nonzero.default, (torch.tensor([0.0, 1.0, 0.0, 2.0], device=DEVICE),),
                          test_utils=("test_schema",))
    torch.library.opcheck(torch.ops.zen.aggregate.default, (idx, val, 10, 1, 0, -1), test_utils=("test_schema",))
    torch.library.opcheck(torch.ops.zen.scatter_.default, (torch.zeros(10, device=DEVICE), idx, val),
                          test_utils=("test_schema",))
    torch.library.opcheck(torch.ops.zen.scatter_pieces_.default, (torch.zeros(10, device=DEVICE), [idx], [val]),
                          test_utils=("test_schema",))
    assert zen.ops.hash_partition(idx, 4, 1).dtype == torch.int32


# --- rows: one index per block of b values ----------------------------------------------------------------


@given(st.integers(1, 9), st.integers(0, 40), st.floats(0.0, 1.0), st.integers(0, 2**31))
def test_nonzero_blocks_and_count_match_reference(width, blocks, density, seed):
    g = torch.Generator().manual_seed(seed)
    dense = torch.where(torch.rand(blocks * width, generator=g) < density, torch.randn(blocks * width, generator=g),
                        torch.zeros(()))
    dense[::7] = -0.0  # a signed zero is a zero
    view = dense.view(blocks, width)
    expected = torch.nonzero((view != 0).any(dim=1)).view(-1)
    ids, rows = ops.nonzero_blocks(dense.to(DEVICE), width)
    assert ids.dtype == torch.int32 and ids.cpu().long().tolist() == expected.tolist()
    assert rows.shape == (expected.numel(), width) and torch.equal(rows.cpu(), view[expected])
    assert ops.count_nonzero(dense.to(DEVICE), width) == (int((dense != 0).sum()), expected.numel())


def test_nonzero_blocks_rejects_a_block_size_that_does_not_divide():
    with pytest.raises(RuntimeError, match="block_size 4 does not divide the tensor's 10 elements"):
        ops.nonzero_blocks(torch.zeros(10, device=DEVICE), 4)
    with pytest.raises(RuntimeError, match="block_size must be >= 1"):
        ops.count_nonzero(torch.zeros(10, device=DEVICE), 0)


@given(st.integers(1, 6), st.lists(st.integers(0, 30), max_size=60), st.integers(1, 5), st.integers(0, 2**31))
def test_row_ops_match_reference(width, index_list, n, seed):
    """partition, aggregate and scatter_ move, sum and write whole rows as the element ops do values."""
    idx = torch.tensor(index_list, dtype=torch.int32)
    rows = torch.randint(-8, 8, (idx.numel(), width)).float() * 0.5
    part_idx, part_rows, counts, _ = ops.partition(idx.to(DEVICE), rows.to(DEVICE), n, seed, 0)
    order = sorted(range(idx.numel()), key=lambda i: partition_of(index_list[i], seed, n))
    assert part_idx.cpu().tolist() == [index_list[i] for i in order]
    assert torch.equal(part_rows.cpu(), rows[order]) and counts.sum().item() == idx.numel()
    union, sums = ops.aggregate(idx.to(DEVICE), rows.to(DEVICE), 31)
    expected_union = sorted(set(index_list))
    assert union.cpu().tolist() == expected_union and sums.shape == (len(expected_union), width)
    for u, row in zip(expected_union, sums.cpu()):
        assert torch.equal(row, rows[idx == u].sum(dim=0))
    out = torch.full((31 * width,), 7.0, device=DEVICE)
    ops.scatter_(out, union, sums)
    expected = torch.full((31, width), 7.0)
    expected[torch.tensor(expected_union, dtype=torch.long)] = sums.cpu()
    assert torch.equal(out.cpu(), expected.view(-1))
    pieces = [(union[i::2].contiguous(), sums[i::2].contiguous()) for i in range(2)]
    out2 = torch.full((31 * width,), 7.0, device=DEVICE)
    ops.scatter_pieces_(out2, pieces)
    assert torch.equal(out2.cpu(), expected.view(-1))


def test_row_scatter_checks_blocks():
    with pytest.raises(RuntimeError, match="out of range.*for an output of 3 blocks"):
        ops.scatter_(torch.zeros(6, device=DEVICE), torch.tensor([3], dtype=torch.int32, device=DEVICE),
                     torch.ones(1, 2, device=DEVICE))
    with pytest.raises(RuntimeError, match="does not divide"):
        ops.scatter_(torch.zeros(7, device=DEVICE), torch.tensor([0], dtype=torch.int32, device=DEVICE),
                     torch.ones(1, 2, device=DEVICE))
