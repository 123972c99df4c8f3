"""Decoders and kernels over hostile input (hypothesis): random bytes, counts, lengths, indices and
settings. Every call either raises a clean ValueError/RuntimeError or returns a result that is right; none
reads or writes out of bounds (run this file under the sanitizer build too: benchmarks/sanitize.sh)."""
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zen import ops, wire
from zen.schemes.balanced import BalancedParallelism

from reference import aggregate as ref_aggregate
from reference import index_sets as ref_index_sets
from reference import partition_of

CLEAN = (ValueError, RuntimeError)
VALUE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
INDEX_DTYPES = [torch.int32, torch.int64]
seeds = st.integers(0, 2**63 - 1)
counts = st.one_of(st.integers(-3, 70), st.sampled_from([2**31 - 1, 2**31, 2**62, -2**62]))


def raw(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def int_tensor(values, dtype):
    info = torch.iinfo(dtype)
    return torch.tensor([min(max(v, info.min), info.max) for v in values], dtype=dtype)


# --- wire: unpacking --------------------------------------------------------------------------------------
@given(st.binary(max_size=600), counts, st.sampled_from(INDEX_DTYPES), st.sampled_from(VALUE_DTYPES))
def test_unpack_coo_random_bytes(data, count, idx_dtype, val_dtype):
    buf = raw(data)
    try:
        indices, values = wire.unpack_coo(buf, count, idx_dtype, val_dtype)
    except CLEAN:
        return
    si, sv = torch.empty(0, dtype=idx_dtype).element_size(), torch.empty(0, dtype=val_dtype).element_size()
    assert buf.numel() == wire.coo_bytes(count, si, sv)
    assert indices.numel() == values.numel() == count
    assert indices.dtype == idx_dtype and values.dtype == val_dtype
    assert indices.view(torch.uint8).tolist() == list(data[:count * si])


@given(st.binary(max_size=400), counts, st.integers(-2, 300), st.sampled_from(VALUE_DTYPES))
def test_unpack_bitmap_random_bytes(data, count, set_size, val_dtype):
    buf = raw(data)
    try:
        bitmap, values = wire.unpack_bitmap(buf, count, set_size, val_dtype)
    except CLEAN:
        return
    assert 0 <= count <= set_size and bitmap.numel() == (set_size + 7) // 8 and values.numel() == count


@given(st.binary(max_size=300), st.integers(-2, 100), st.sampled_from(VALUE_DTYPES))
def test_unpack_dense_random_bytes(data, numel, val_dtype):
    try:
        values = wire.unpack_dense(raw(data), numel, val_dtype)
    except CLEAN:
        return
    assert values.numel() == numel and values.dtype == val_dtype


@given(st.binary(max_size=300), st.integers(-2, 40), st.integers(-2, 40), st.integers(1, 8), st.sampled_from(VALUE_DTYPES))
def test_unpack_blocks_random_bytes(data, count, num_blocks, block_size, val_dtype):
    try:
        bitmap, values = wire.unpack_blocks(raw(data), count, num_blocks, block_size, val_dtype)
    except CLEAN:
        return
    assert 0 <= count <= num_blocks and values.shape == (count, block_size)
    assert bitmap.numel() == (num_blocks + 7) // 8


@given(st.binary(max_size=200), st.lists(st.integers(-4, 120), max_size=6))
def test_split_random_sizes(data, sizes):
    buf = raw(data)
    try:
        pieces = wire.split(buf, sizes)
    except CLEAN:
        return
    assert sum(sizes) == buf.numel() and [p.numel() for p in pieces] == sizes


# --- kernels on hostile input -----------------------------------------------------------------------------
@given(st.binary(max_size=64), st.lists(st.integers(-5, 200), max_size=200, unique=True), counts,
       st.sampled_from(INDEX_DTYPES), st.booleans())
def test_bitmap_decode_random_bitmaps(data, index_set, count, dtype, sort):
    index_set = sorted(index_set) if sort else index_set  # a corrupt (unsorted, negative) set as well
    bitmap = raw(data)
    set_t = torch.tensor(index_set, dtype=dtype)
    try:
        got = ops.bitmap_decode(bitmap, set_t, count)
    except CLEAN:
        return
    bits = [r for r in range(len(index_set)) if data[r // 8] >> (r % 8) & 1]
    assert len(data) == (len(index_set) + 7) // 8
    assert count < 0 or count == len(bits)
    assert got.tolist() == [index_set[r] for r in bits]


@given(st.lists(st.integers(-2**40, 2**40), max_size=80), st.integers(-3, 2**40), st.integers(-1, 9),
       seeds, st.integers(-2, 9), st.sampled_from(INDEX_DTYPES), st.sampled_from(VALUE_DTYPES))
def test_aggregate_random_indices(indices, numel, n, seed, partition, idx_dtype, val_dtype):
    # a received buffer: anything at all in the indices, numel and partition arguments
    idx = int_tensor(indices, idx_dtype)
    values = (torch.arange(idx.numel()) % 7 - 3).to(val_dtype)
    try:
        got_idx, got_val = ops.aggregate(idx, values, numel, n, seed, partition)
    except CLEAN:
        return
    assert all(0 <= i < numel for i in idx.tolist())
    assert partition < 0 or all(partition_of(i, seed, n) == partition for i in idx.tolist())
    ref_idx, ref_val = ref_aggregate(idx, values)
    assert torch.equal(got_idx.long(), ref_idx) and torch.equal(got_val, ref_val)


@given(st.integers(-2, 300), st.lists(st.integers(-2**33, 2**33), max_size=60), st.sampled_from(INDEX_DTYPES),
       st.sampled_from(VALUE_DTYPES), st.integers(-1, 1))
def test_scatter_out_of_range_and_mismatched(numel, indices, idx_dtype, val_dtype, length_error):
    idx = int_tensor(indices, idx_dtype)
    values = (torch.arange(max(0, idx.numel() + length_error)) + 1).to(val_dtype)
    try:
        out = torch.zeros(numel, dtype=val_dtype)
    except CLEAN:
        return
    before = out.clone()
    try:
        ops.scatter_(out, idx, values)
    except CLEAN:
        assert torch.equal(out, before)  # bounds are checked before anything is written
        return
    assert idx.numel() == values.numel() and all(0 <= i < numel for i in idx.tolist())
    ref = before.clone()
    ref[idx.long()] = values
    assert torch.equal(out, ref)


@given(st.lists(st.integers(-2**40, 2**40), max_size=300), st.integers(-1, 40), seeds, st.integers(-1, 20),
       st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1.0, 1.0001, 64.0, 1e300])),
       st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-9, 64.0, 1e300])))
def test_partition_random_settings(indices, n, seed, probes, table_factor, serial_factor):
    idx = torch.tensor(indices, dtype=torch.int64)
    values = torch.arange(idx.numel(), dtype=torch.float32)
    try:
        part_idx, part_val, counts, stats = ops.partition(idx, values, n, seed, probes, table_factor, serial_factor)
    except CLEAN:
        return
    # every pair exactly once, grouped by h0
    assert sorted(zip(part_idx.tolist(), part_val.tolist())) == sorted(zip(idx.tolist(), values.tolist()))
    start = 0
    for j, c in enumerate(counts.tolist()):
        assert all(partition_of(i, seed, n) == j for i in part_idx[start:start + c].tolist())
        start += c
    assert start == idx.numel()


@given(st.integers(-3, 3000), st.integers(-2, 12), seeds)
def test_bitmap_index_sets_random_sizes(numel, n, seed):
    try:
        sets, offsets = ops.bitmap_index_sets(numel, n, seed)
    except CLEAN:
        return
    assert numel >= 0 and 1 <= n
    ref = ref_index_sets(numel, n, seed)
    assert [sets[offsets[j]:offsets[j + 1]].tolist() for j in range(n)] == [r.tolist() for r in ref]


@given(st.binary(min_size=0, max_size=512), st.sampled_from(VALUE_DTYPES))
def test_nonzero_on_random_bits(data, dtype):
    size = torch.empty(0, dtype=dtype).element_size()
    data = data[:len(data) // size * size]
    dense = raw(data).view(dtype) if data else torch.empty(0, dtype=dtype)
    idx, val = ops.nonzero(dense)
    bits = dense.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
    sign = -(1 << (8 * size - 1)) if dtype.is_floating_point else 0  # -0.0 is a zero, NaN is not
    expect = [i for i, b in enumerate(bits.tolist()) if b not in (0, sign)] if dtype.is_floating_point else \
        [i for i, b in enumerate(bits.tolist()) if b != 0]
    assert idx.tolist() == expect
    assert torch.equal(val.view(bits.dtype), bits[idx.long()])


# --- a full pull decode: what a rank does with the buffers the servers sent --------------------------------
class _FakeComm:
    def __init__(self, n, seed):
        self.world, self.rank, self.seed = n, 0, seed
        self._sets = {}

    def index_sets(self, numel, device):
        if numel not in self._sets:
            self._sets[numel] = ops.bitmap_index_sets(numel, self.world, self.seed, device)
        return self._sets[numel]


@given(st.integers(1, 5), seeds, st.integers(0, 400), st.lists(st.tuples(st.integers(-2, 50), st.integers(-1, 3),
       st.binary(max_size=200)), min_size=1, max_size=5), st.sampled_from(VALUE_DTYPES))
def test_pull_decode_of_random_buffers(n, seed, numel, pieces, val_dtype):
    """Random (count, format, bytes) per server, decoded and scattered as BalancedParallelism does."""
    comm = _FakeComm(n, seed)
    out = torch.zeros(numel, dtype=val_dtype)
    idx_dtype = wire.index_dtype(numel)
    sets, offsets = comm.index_sets(numel, "cpu")
    for j, (count, fmt, data) in enumerate(pieces[:n]):
        try:
            indices, values = BalancedParallelism._decode_pull(comm, raw(data), j, count, fmt, numel, idx_dtype, val_dtype)
            ops.scatter_(out, indices, values)
        except CLEAN:
            continue
        assert indices.numel() == values.numel() == count
        if fmt == wire.BITMAP:  # decoded indices come from server j's own index set, ascending
            allowed = set(sets[offsets[j]:offsets[j + 1]].tolist())
            assert set(indices.tolist()) <= allowed and indices.tolist() == sorted(indices.tolist())


@given(st.integers(1, 300), st.integers(1, 4), seeds, st.floats(0.0, 1.0), st.data())
def test_pull_roundtrip_then_one_flipped_byte(numel, n, seed, density, data):
    """A real pull piece decodes to what was encoded; the same piece with a byte flipped or cut decodes to an
    error or to some in-range result, never to an out-of-bounds access."""
    comm = _FakeComm(n, seed)
    sets, offsets = comm.index_sets(numel, "cpu")
    j = data.draw(st.integers(0, n - 1))
    members = sets[offsets[j]:offsets[j + 1]]
    keep = torch.rand(members.numel(), generator=torch.Generator().manual_seed(seed % 2**31)) < density
    union = members[keep]
    values = torch.arange(1, union.numel() + 1, dtype=torch.float32)
    idx_dtype = wire.index_dtype(numel)
    for fmt in (wire.COO, wire.BITMAP):
        buf = wire.pack_coo(union.to(idx_dtype), values) if fmt == wire.COO else \
            wire.pack_bitmap(ops.bitmap_encode(union, members), values)
        got_idx, got_val = BalancedParallelism._decode_pull(comm, buf, j, union.numel(), fmt, numel, idx_dtype,
                                                            torch.float32)
        assert torch.equal(got_idx.long(), union.long()) and torch.equal(got_val, values)
        if buf.numel() == 0:
            continue
        corrupt = buf.clone()
        at = data.draw(st.integers(0, buf.numel() - 1))
        corrupt[at] ^= data.draw(st.integers(1, 255))
        cut = data.draw(st.integers(0, buf.numel()))
        for bad in (corrupt, corrupt[:cut]):
            out = torch.zeros(numel)
            try:
                idx, val = BalancedParallelism._decode_pull(comm, bad, j, union.numel(), fmt, numel, idx_dtype,
                                                            torch.float32)
                ops.scatter_(out, idx, val)
            except CLEAN:
                continue
            assert idx.numel() == union.numel()


def test_float_struct_sanity():
    # the fuzzers build values from raw bytes; make sure a NaN payload is a non-zero, -0.0 a zero
    nan = raw(struct.pack("<f", float("nan")) + struct.pack("<f", -0.0)).view(torch.float32)
    idx, _ = ops.nonzero(nan)
    assert idx.tolist() == [0]


@pytest.mark.parametrize("numel", [0, 1, 8, 9])
def test_empty_and_tiny_bitmaps(numel):
    sets, offsets = ops.bitmap_index_sets(numel, 1, 7)
    bitmap = ops.bitmap_encode(sets[:0], sets)
    assert bitmap.numel() == (numel + 7) // 8
    assert ops.bitmap_decode(bitmap, sets, 0).numel() == 0
    if numel % 8:
        bitmap[-1] = 0xFF  # bits past the set
        with pytest.raises(RuntimeError, match="past its index set"):
            ops.bitmap_decode(bitmap, sets, -1)
