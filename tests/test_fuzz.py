"""The wire formats and the kernels under hypothesis. Valid input round-trips: what is packed unpacks to
the same indices, bitmap and value bits. Hostile input (random bytes, counts, lengths, indices and
settings, as a corrupt or mismatched peer would send them) is judged by a plain-Python oracle of what the
format allows: where the oracle says valid, the call must succeed and return what the oracle decodes;
only where it says invalid may the call raise, and then only its clean error (ValueError from the wire
formats, RuntimeError from the kernels). None may read or write out of bounds (run this file under the
sanitizer build too: benchmarks/sanitize.sh)."""
import struct

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from zen import ops, wire
from zen.schemes.balanced.pull import decode as decode_pull

from reference import aggregate as ref_aggregate
from reference import index_sets as ref_index_sets
from reference import partition_of

VALUE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
INDEX_DTYPES = [torch.int32, torch.int64]
MAX_PARTITIONS = 1 << 20  # csrc/include/zen/checks.h
seeds = st.integers(0, 2**63 - 1)
counts = st.one_of(st.integers(-3, 70), st.sampled_from([2**31 - 1, 2**31, 2**62, -2**62]))
widths = st.sampled_from([1, 1, 2, 3])  # values [k], or rows [k, b]


def raw(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def size(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def padded(nbytes: int) -> int:
    """The formats' 8-byte alignment of a section, written out here rather than taken from zen."""
    return -(-nbytes // 8) * 8


def bits_of(t: torch.Tensor) -> bytes:
    """The bytes of a tensor (NaN payloads included): values compare bit for bit."""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def little(data: bytes, dtype) -> list:
    """Signed little-endian integers of ``dtype``'s width in ``data``."""
    n = size(dtype)
    return [int.from_bytes(data[k:k + n], "little", signed=True) for k in range(0, len(data), n)]


def int_tensor(values, dtype):
    info = torch.iinfo(dtype)
    return torch.tensor([min(max(v, info.min), info.max) for v in values], dtype=dtype)


def random_values(count, width, dtype, seed):
    """``count`` entries of ``width`` values of any bits (NaN, Inf and -0.0 among them for floats)."""
    shape = (count, width) if width > 1 else (count,)
    g = torch.Generator().manual_seed(seed % 2**63)
    data = torch.randint(0, 256, (count * width * size(dtype),), dtype=torch.uint8, generator=g)
    return data.view(dtype).view(shape)


def judged(valid: bool, call, error):
    """``call()`` where the input is valid (it must not raise); else it must raise ``error``: None."""
    event("valid" if valid else "invalid")  # (--hypothesis-show-statistics: both kinds come up)
    if valid:
        return call()
    with pytest.raises(error):
        call()
    return None


def set_bits(bitmap: bytes, length: int) -> list:
    return [r for r in range(length) if bitmap[r // 8] >> (r % 8) & 1]


# --- round trips of valid input ---------------------------------------------------------------------------
@given(st.integers(1, 2**33), st.data(), st.sampled_from(VALUE_DTYPES), widths)
def test_coo_round_trip(numel, data, val_dtype, width):
    """pack_coo_pieces then unpack_coo, piece by piece: the indices and value bits come back."""
    idx_dtype = wire.index_dtype(numel)
    picked = sorted(data.draw(st.sets(st.integers(0, numel - 1), max_size=60)))
    indices = torch.tensor(picked, dtype=idx_dtype)
    values = random_values(len(picked), width, val_dtype, data.draw(seeds))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(picked)), max_size=3)))
    piece_counts = [b - a for a, b in zip([0] + cuts, cuts + [len(picked)])]
    buf, splits = wire.pack_coo_pieces(indices, values, piece_counts)
    entry = size(val_dtype) * width
    assert splits == [padded(c * size(idx_dtype)) + padded(c * entry) for c in piece_counts]
    start = 0
    for count, piece in zip(piece_counts, wire.split(buf, splits)):
        got_idx, got_val = wire.unpack_coo(piece, count, idx_dtype, val_dtype, width)
        assert got_idx.dtype == idx_dtype and got_idx.tolist() == picked[start:start + count]
        assert got_val.shape == values[start:start + count].shape
        assert bits_of(got_val) == bits_of(values[start:start + count])
        start += count
    one_idx, one_val = wire.unpack_coo(wire.pack_coo(indices, values), len(picked), idx_dtype, val_dtype, width)
    assert one_idx.tolist() == picked and bits_of(one_val) == bits_of(values)


@given(st.integers(0, 3000), st.integers(1, 5), seeds, st.data(), st.sampled_from(VALUE_DTYPES), widths)
def test_bitmap_round_trip(numel, n, seed, data, val_dtype, width):
    """A subset of a partition's index set: bitmap_encode, pack_bitmap, unpack_bitmap, bitmap_decode give the
    subset and the value bits back; the bitmap has bit r set exactly where I_j[r] is in the subset."""
    sets, offsets = ops.bitmap_index_sets(numel, n, seed)
    j = data.draw(st.integers(0, n - 1))
    index_set = sets[offsets[j]:offsets[j + 1]]
    members = index_set.tolist()
    assert members == ref_index_sets(numel, n, seed)[j].tolist()
    keep = data.draw(st.lists(st.booleans(), min_size=len(members), max_size=len(members)))
    subset = [i for i, k in zip(members, keep) if k]
    values = random_values(len(subset), width, val_dtype, seed)
    bitmap = ops.bitmap_encode(torch.tensor(subset, dtype=index_set.dtype), index_set)
    assert set_bits(bits_of(bitmap), len(members)) == [r for r, k in enumerate(keep) if k]
    assert bitmap.numel() == (len(members) + 7) // 8
    buf = wire.pack_bitmap(bitmap, values)
    assert buf.numel() == padded(bitmap.numel()) + padded(len(subset) * size(val_dtype) * width)
    got_bitmap, got_val = wire.unpack_bitmap(buf, len(subset), len(members), val_dtype, width)
    assert bits_of(got_bitmap) == bits_of(bitmap) and bits_of(got_val) == bits_of(values)
    assert got_val.shape == values.shape
    assert ops.bitmap_decode(got_bitmap, index_set, len(subset)).tolist() == subset


@given(st.lists(st.integers(0, 40), min_size=1, max_size=4), st.integers(1, 8), st.data(),
       st.sampled_from(VALUE_DTYPES))
def test_blocks_round_trip(ranges, block_size, data, val_dtype):
    """BLOCKS pieces (one per owner range, empty ones included): pack_blocks_pieces then unpack_blocks give
    each piece's bitmap over its range and its blocks back; a piece of no blocks is 0 bytes."""
    bitmaps, chosen, blocks = [], [], []
    for num_blocks in ranges:
        sent = data.draw(st.lists(st.booleans(), min_size=num_blocks, max_size=num_blocks))
        ids = [r for r, s in enumerate(sent) if s]
        bitmaps.append(ops.bitmap_encode(torch.tensor(ids, dtype=torch.int64), torch.arange(num_blocks)))
        chosen.append(ids)
        blocks.append(random_values(len(ids), block_size, val_dtype, data.draw(seeds)).view(len(ids), block_size))
    block_values = torch.cat(blocks) if blocks else torch.empty(0, block_size, dtype=val_dtype)
    buf, splits = wire.pack_blocks_pieces(bitmaps, block_values, [len(ids) for ids in chosen])
    sv = size(val_dtype)
    assert splits == [padded((r + 7) // 8) + padded(len(ids) * block_size * sv) if ids else 0
                      for r, ids in zip(ranges, chosen)]
    for piece, num_blocks, ids, bitmap, values in zip(wire.split(buf, splits), ranges, chosen, bitmaps, blocks):
        got_bitmap, got_val = wire.unpack_blocks(piece, len(ids), num_blocks, block_size, val_dtype)
        assert set_bits(bits_of(got_bitmap), num_blocks) == ids and bits_of(got_bitmap) == bits_of(bitmap)
        assert got_val.shape == (len(ids), block_size) and bits_of(got_val) == bits_of(values)
        if ids:
            alone = wire.pack_blocks(bitmap, values)
            assert bits_of(alone) == bits_of(piece)


@given(st.integers(0, 200), st.sampled_from(VALUE_DTYPES), seeds)
def test_dense_round_trip(numel, val_dtype, seed):
    values = random_values(numel, 1, val_dtype, seed)
    buf = wire.pack_dense(values)
    assert buf.numel() == numel * size(val_dtype)
    assert bits_of(wire.unpack_dense(buf, numel, val_dtype)) == bits_of(values)


@given(st.binary(max_size=300), st.integers(16, 400), counts, st.integers(-1, 3))
def test_slotted_pull_round_trip(piece, slot, count, fmt):
    """A SLOTTED message headed by [count, format] (zen's pull): the header in the first 16 bytes, the first part
    exactly ``slot`` bytes (zeros after a short piece), the rest what did not fit; joined, the piece's bytes come
    back."""
    first, splits = wire.pack_slotted(wire.step_header(count, fmt), [raw(piece)], [slot - 16])
    rest = raw(piece)[slot - 16:]
    head = struct.pack("<qq", count, fmt)
    assert splits == [slot] and first.numel() == slot and bits_of(first[:16]) == head
    assert bits_of(first[16:]) + bits_of(rest) == piece + bytes(max(0, slot - 16 - len(piece)))
    assert rest.numel() == wire.slotted_rest_bytes(slot - 16, len(piece)) == max(0, 16 + len(piece) - slot)
    got_head, room = wire.unpack_slotted(first, 2)
    assert got_head.tolist() == [count, fmt]
    assert bits_of(wire.join_slotted(room, rest, len(piece))) == piece


@given(st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=12),
       st.lists(st.tuples(st.binary(max_size=80), st.integers(0, 12).map(lambda w: 8 * w)), min_size=1, max_size=5))
def test_slotted_round_trip(row, pieces_and_slots):
    """SLOTTED messages headed by a row (the agreement's): each the row's int64s, then exactly its slot (a piece's
    first bytes, zeros after a short one); unpacked, the row and the slot come back, and joined with what did not
    fit, the piece."""
    pieces = [raw(piece) for piece, _ in pieces_and_slots]
    slots = [slot for _, slot in pieces_and_slots]
    mine = torch.tensor(row, dtype=torch.int64)
    buf, splits = wire.pack_slotted(mine, pieces, slots)
    assert splits == [8 * len(row) + slot for slot in slots] and buf.numel() == sum(splits)
    for message, (piece, slot) in zip(wire.split(buf, splits), pieces_and_slots):
        got_row, first = wire.unpack_slotted(message, len(row))
        assert got_row.tolist() == row and first.numel() == slot
        assert bits_of(first) == piece[:slot] + bytes(max(0, slot - len(piece)))
        assert bits_of(wire.join_slotted(first, raw(piece[slot:]), len(piece))) == piece


@given(st.binary(max_size=64), st.binary(max_size=64), st.integers(0, 100), st.integers(0, 8))
def test_slotted_hostile_parts(first, rest, piece_bytes, head_ints):
    """A message shorter than its head, or a second part of the wrong length, is a clean ValueError."""
    valid = len(first) >= 8 * head_ints
    got = judged(valid, lambda: wire.unpack_slotted(raw(first), head_ints), ValueError)
    if not valid:
        return
    head, slot = got
    assert head.tolist() == list(struct.unpack(f"<{head_ints}q", first[:8 * head_ints]))
    valid = len(rest) == max(0, piece_bytes - slot.numel())
    joined = judged(valid, lambda: wire.join_slotted(slot, raw(rest), piece_bytes), ValueError)
    if valid:
        assert bits_of(joined) == (first[8 * head_ints:] + rest)[:piece_bytes]


# --- wire: unpacking hostile bytes --------------------------------------------------------------------------
def draw_bytes(data, expected: int) -> bytes:
    """Random bytes of the length the format expects (so that valid pieces come up often), a few bytes off
    it, or any length."""
    near = [n for n in (expected, expected - 1, expected + 1, expected + 8) if 0 <= n <= 600]
    choices = [st.just(near[0]), st.sampled_from(near)] if near else []
    length = data.draw(st.one_of(*choices, st.integers(0, 600)))
    return data.draw(st.binary(min_size=length, max_size=length))


@given(counts, st.sampled_from(INDEX_DTYPES), st.sampled_from(VALUE_DTYPES), widths, st.data())
def test_unpack_coo_random_bytes(count, idx_dtype, val_dtype, width, data):
    si, sv = size(idx_dtype), size(val_dtype) * width
    expected = padded(count * si) + padded(count * sv)
    blob = draw_bytes(data, expected)
    valid = count >= 0 and len(blob) == expected
    got = judged(valid, lambda: wire.unpack_coo(raw(blob), count, idx_dtype, val_dtype, width), ValueError)
    if valid:
        indices, values = got
        assert indices.dtype == idx_dtype and indices.tolist() == little(blob[:count * si], idx_dtype)
        assert values.dtype == val_dtype and values.shape == ((count, width) if width > 1 else (count,))
        assert bits_of(values) == blob[padded(count * si):padded(count * si) + count * sv]


@given(counts, st.integers(-2, 300), st.sampled_from(VALUE_DTYPES), widths, st.data())
def test_unpack_bitmap_random_bytes(count, set_size, val_dtype, width, data):
    sv = size(val_dtype) * width
    nb = (set_size + 7) // 8
    expected = padded(nb) + padded(count * sv)
    blob = draw_bytes(data, expected)
    valid = 0 <= count <= set_size and len(blob) == expected
    got = judged(valid, lambda: wire.unpack_bitmap(raw(blob), count, set_size, val_dtype, width), ValueError)
    if valid:
        bitmap, values = got
        assert bits_of(bitmap) == blob[:nb] and bits_of(values) == blob[padded(nb):padded(nb) + count * sv]


@given(st.integers(-2, 100), st.sampled_from(VALUE_DTYPES), st.data())
def test_unpack_dense_random_bytes(numel, val_dtype, data):
    expected = numel * size(val_dtype)
    blob = draw_bytes(data, expected)
    valid = numel >= 0 and len(blob) == expected
    got = judged(valid, lambda: wire.unpack_dense(raw(blob), numel, val_dtype), ValueError)
    if valid:
        assert got.dtype == val_dtype and got.numel() == numel and bits_of(got) == blob


@given(st.integers(-2, 40), st.integers(-2, 40), st.integers(1, 8), st.sampled_from(VALUE_DTYPES), st.data())
def test_unpack_blocks_random_bytes(count, num_blocks, block_size, val_dtype, data):
    sv = size(val_dtype)
    nb = (num_blocks + 7) // 8
    expected = padded(nb) + padded(count * block_size * sv) if count > 0 else 0
    blob = draw_bytes(data, expected)
    valid = 0 <= count <= num_blocks and len(blob) == expected
    got = judged(valid, lambda: wire.unpack_blocks(raw(blob), count, num_blocks, block_size, val_dtype), ValueError)
    if valid:
        bitmap, values = got
        assert values.shape == (count, block_size) and bitmap.numel() == nb
        # no blocks: 0 bytes on the wire, and the receiver reads an all-clear bitmap
        assert bits_of(bitmap) == (blob[:nb] if count else bytes(nb))
        assert bits_of(values) == blob[padded(nb):padded(nb) + count * block_size * sv]


@st.composite
def cuts_of(draw):
    """(bytes, sizes): sizes that cut the bytes whole (valid) half the time, any sizes otherwise."""
    blob = draw(st.binary(max_size=200))
    if draw(st.booleans()):
        at = sorted(draw(st.lists(st.integers(0, len(blob)), max_size=5)))
        return blob, [b - a for a, b in zip([0] + at, at + [len(blob)])]
    return blob, draw(st.lists(st.integers(-4, 120), max_size=6))


@given(cuts_of())
def test_split_random_sizes(cut):
    blob, sizes = cut
    valid = all(s >= 0 for s in sizes) and sum(sizes) == len(blob)
    pieces = judged(valid, lambda: wire.split(raw(blob), sizes), RuntimeError)
    if valid:
        at = [sum(sizes[:k]) for k in range(len(sizes))]
        assert [bits_of(p) for p in pieces] == [blob[a:a + s] for a, s in zip(at, sizes)]


# --- kernels on hostile input -----------------------------------------------------------------------------
@given(st.lists(st.integers(-5, 200), max_size=200, unique=True), st.sampled_from(INDEX_DTYPES), st.booleans(),
       st.data())
def test_bitmap_decode_random_bitmaps(index_set, dtype, sort, data):
    # The index set is the receiver's own (sorted); an unsorted, negative one shows decode only gathers.
    index_set = sorted(index_set) if sort else index_set
    length = len(index_set)
    blob = bytearray(draw_bytes(data, (length + 7) // 8))
    if length % 8 and len(blob) == (length + 7) // 8 and data.draw(st.booleans()):
        blob[-1] &= (1 << length % 8) - 1  # no bits past the set, half the time
    blob = bytes(blob)
    popcount = sum(bin(b).count("1") for b in blob)
    count = data.draw(st.one_of(st.sampled_from([popcount, -1]), counts))
    bits = [r for r in range(8 * len(blob)) if blob[r // 8] >> (r % 8) & 1]
    valid = len(blob) == (length + 7) // 8 and all(r < length for r in bits) and (count < 0 or count == len(bits))
    got = judged(valid, lambda: ops.bitmap_decode(raw(blob), torch.tensor(index_set, dtype=dtype), count),
                 RuntimeError)
    if valid:
        assert got.tolist() == [index_set[r] for r in bits]


@st.composite
def received(draw):
    """(indices, numel, n, partition, seed): anything at all half the time; else what a peer sends for
    partition ``partition`` (or for the whole tensor: -1), with a stray index now and then."""
    seed = draw(seeds)
    if draw(st.booleans()):
        return (draw(st.lists(st.integers(-2**40, 2**40), max_size=80)), draw(st.integers(-3, 2**40)),
                draw(st.integers(-1, 9)), draw(st.integers(-2, 9)), seed)
    numel, n = draw(st.integers(0, 3000)), draw(st.integers(1, 9))
    partition = draw(st.integers(-1, n - 1))
    indices = [i for i in draw(st.lists(st.integers(0, max(0, numel - 1)), max_size=80))
               if numel and (partition < 0 or partition_of(i, seed, n) == partition)]
    return indices + draw(st.lists(st.integers(-5, numel + 5), max_size=1)), numel, n, partition, seed


@given(received(), st.sampled_from(INDEX_DTYPES), st.sampled_from(VALUE_DTYPES))
def test_aggregate_random_indices(buffer, idx_dtype, val_dtype):
    indices, numel, n, partition, seed = buffer
    idx = int_tensor(indices, idx_dtype)
    values = (torch.arange(idx.numel()) % 7 - 3).to(val_dtype)
    received = idx.tolist()
    valid = (1 <= n <= MAX_PARTITIONS and numel >= 0 and partition < n and all(0 <= i < numel for i in received)
             and (partition < 0 or all(partition_of(i, seed, n) == partition for i in received)))
    got = judged(valid, lambda: ops.aggregate(idx, values, numel, n, seed, partition), RuntimeError)
    if valid:
        ref_idx, ref_val = ref_aggregate(idx, values)
        assert torch.equal(got[0].long(), ref_idx) and torch.equal(got[1], ref_val)


@given(st.integers(0, 300), st.one_of(st.lists(st.integers(-2**33, 2**33), max_size=60),
                                     st.lists(st.integers(-1, 300), max_size=60)), st.sampled_from(INDEX_DTYPES),
       st.sampled_from(VALUE_DTYPES), st.integers(-1, 1))
def test_scatter_out_of_range_and_mismatched(numel, indices, idx_dtype, val_dtype, length_error):
    idx = int_tensor(indices, idx_dtype)
    values = (torch.arange(max(0, idx.numel() + length_error)) + 1).to(val_dtype)
    out = torch.zeros(numel, dtype=val_dtype)
    before = out.clone()
    valid = idx.numel() == values.numel() and all(0 <= i < numel for i in idx.tolist())
    judged(valid, lambda: ops.scatter_(out, idx, values), RuntimeError)
    ref = before.clone()
    if valid:
        ref[idx.long()] = values
    assert torch.equal(out, ref)  # an error leaves out as it was: bounds are checked before any write


@given(st.lists(st.integers(-2**40, 2**40), max_size=300), st.integers(-1, 40), seeds, st.integers(-1, 20),
       st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1.0, 1.0001, 64.0, 1e300]),
                 st.floats(1.0, 64.0)),
       st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-9, 64.0, 1e300]),
                 st.floats(0.0, 64.0)))
def test_partition_random_settings(indices, n, seed, probes, table_factor, serial_factor):
    idx = torch.tensor(indices, dtype=torch.int64)
    values = torch.arange(idx.numel(), dtype=torch.float32)
    valid = 1 <= n <= MAX_PARTITIONS and 0 <= probes <= 16 and 1 <= table_factor <= 64 and 0 <= serial_factor <= 64
    got = judged(valid, lambda: ops.partition(idx, values, n, seed, probes, table_factor, serial_factor),
                 RuntimeError)
    if valid:
        part_idx, part_val, piece_counts, stats = got
        # every pair exactly once, grouped by h0 (any index is a valid key: partition hashes, it never indexes)
        assert sorted(zip(part_idx.tolist(), part_val.tolist())) == sorted(zip(idx.tolist(), values.tolist()))
        expected = [sum(partition_of(i, seed, n) == j for i in indices) for j in range(n)]
        assert piece_counts.tolist() == expected
        start = 0
        for j, c in enumerate(expected):
            assert all(partition_of(i, seed, n) == j for i in part_idx[start:start + c].tolist())
            start += c


@given(st.integers(-3, 3000), st.integers(-2, 12), seeds)
def test_bitmap_index_sets_random_sizes(numel, n, seed):
    valid = numel >= 0 and 1 <= n <= MAX_PARTITIONS
    got = judged(valid, lambda: ops.bitmap_index_sets(numel, n, seed), RuntimeError)
    if valid:
        sets, offsets = got
        ref = ref_index_sets(numel, n, seed)
        assert [sets[offsets[j]:offsets[j + 1]].tolist() for j in range(n)] == [r.tolist() for r in ref]


@given(st.binary(min_size=0, max_size=512), st.sampled_from(VALUE_DTYPES))
def test_nonzero_on_random_bits(blob, dtype):
    n = size(dtype)
    blob = blob[:len(blob) // n * n]
    dense = raw(blob).view(dtype) if blob else torch.empty(0, dtype=dtype)
    idx, val = ops.nonzero(dense)
    bits = dense.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[n])
    sign = -(1 << (8 * n - 1)) if dtype.is_floating_point else 0  # -0.0 is a zero, NaN is not
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


def reference_pull(blob: bytes, count: int, fmt: int, index_set: list, idx_dtype, val_dtype, width):
    """What a pull piece from server j holds, read by the format's definition: (indices, value bytes), or
    None where the piece is invalid (an unknown format, a length or count that does not fit, a bitmap with
    bits past I_j or other than ``count`` bits set)."""
    sv = size(val_dtype) * width
    if fmt == wire.COO:
        si = size(idx_dtype)
        if count < 0 or len(blob) != padded(count * si) + padded(count * sv):
            return None
        return little(blob[:count * si], idx_dtype), blob[padded(count * si):padded(count * si) + count * sv]
    if fmt != wire.BITMAP:
        return None
    nb = (len(index_set) + 7) // 8
    if not 0 <= count <= len(index_set) or len(blob) != padded(nb) + padded(count * sv):
        return None
    bits = set_bits(blob[:nb], 8 * nb)
    if any(r >= len(index_set) for r in bits) or len(bits) != count:
        return None
    return [index_set[r] for r in bits], blob[padded(nb):padded(nb) + count * sv]


def check_pull(comm, blob, j, count, fmt, numel, val_dtype, width=1):
    """Decode one pull piece and scatter it, as BalancedParallelism does, against the reference: a valid
    piece decodes to what it holds (no error allowed), and its scatter succeeds where every index is in
    range; anything else raises a clean error and leaves the output untouched."""
    idx_dtype = wire.index_dtype(numel)
    sets, offsets = comm.index_sets(numel, "cpu")
    index_set = sets[offsets[j]:offsets[j + 1]]
    expected = reference_pull(blob, count, fmt, index_set.tolist(), idx_dtype, val_dtype, width)
    got = judged(expected is not None, lambda: decode_pull(
        comm, raw(blob), j, count, fmt, numel, idx_dtype, val_dtype, width), (ValueError, RuntimeError))
    if expected is None:
        return None
    indices, values = got
    assert indices.tolist() == expected[0] and bits_of(values) == expected[1]
    out = torch.zeros(numel * width, dtype=val_dtype)
    in_range = all(0 <= i < numel for i in expected[0])
    judged(in_range, lambda: ops.scatter_(out, indices, values), RuntimeError)
    if not in_range:
        assert bits_of(out) == bytes(out.numel() * size(val_dtype))
    return indices, values


@given(st.integers(1, 5), seeds, st.integers(0, 400), st.sampled_from(VALUE_DTYPES), st.data())
def test_pull_decode_of_random_buffers(n, seed, numel, val_dtype, data):
    """Random (count, format, bytes) per server, judged by the reference; the bytes are often as long as
    the format and count ask."""
    comm = _FakeComm(n, seed)
    sets, offsets = comm.index_sets(numel, "cpu")
    si, sv = size(wire.index_dtype(numel)), size(val_dtype)
    for j in range(data.draw(st.integers(1, n))):
        count, fmt = data.draw(st.integers(-2, 50)), data.draw(st.integers(-1, 3))
        nb = (int(offsets[j + 1] - offsets[j]) + 7) // 8
        expected = padded(nb) + padded(count * sv) if fmt == wire.BITMAP else padded(count * si) + padded(count * sv)
        check_pull(comm, draw_bytes(data, expected), j, count, fmt, numel, val_dtype)


@given(st.integers(1, 300), st.integers(1, 4), seeds, st.floats(0.0, 1.0), widths, st.data())
def test_pull_roundtrip_then_one_flipped_byte(numel, n, seed, density, width, data):
    """A real pull piece decodes to what was encoded; the same piece with a byte flipped or cut is judged by
    the reference (a flipped value byte is still a valid piece, a cut one never is)."""
    comm = _FakeComm(n, seed)
    sets, offsets = comm.index_sets(numel, "cpu")
    j = data.draw(st.integers(0, n - 1))
    members = sets[offsets[j]:offsets[j + 1]]
    keep = torch.rand(members.numel(), generator=torch.Generator().manual_seed(seed % 2**31)) < density
    union = members[keep]
    values = random_values(union.numel(), width, torch.float32, seed)
    idx_dtype = wire.index_dtype(numel)
    for fmt in (wire.COO, wire.BITMAP):
        buf = wire.pack_coo(union.to(idx_dtype), values) if fmt == wire.COO else \
            wire.pack_bitmap(ops.bitmap_encode(union, members), values)
        decoded = check_pull(comm, bits_of(buf), j, union.numel(), fmt, numel, torch.float32, width)
        assert decoded is not None, "a piece as packed must be valid"
        got_idx, got_val = decoded
        assert got_idx.tolist() == union.tolist() and bits_of(got_val) == bits_of(values)
        if buf.numel() == 0:
            continue
        corrupt = bytearray(bits_of(buf))
        corrupt[data.draw(st.integers(0, buf.numel() - 1))] ^= data.draw(st.integers(1, 255))
        cut = data.draw(st.integers(0, buf.numel() - 1))
        check_pull(comm, bytes(corrupt), j, union.numel(), fmt, numel, torch.float32, width)
        assert check_pull(comm, bytes(corrupt[:cut]), j, union.numel(), fmt, numel, torch.float32, width) is None


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


@given(st.lists(st.floats(-1.0, 2.0, allow_nan=False), max_size=40))
def test_fractions_round_trip(fractions):
    """zen's union fractions in the agreement: four to an int64, each within half a step of 1 / (2^15 - 1) of
    its value clamped to [0, 1], every int non-negative (an int64 as it travels)."""
    from zen.agreement import capacity

    ints = wire.pack_fractions(fractions)
    assert len(ints) == -(-len(fractions) // 4) and all(0 <= i < 2**63 for i in ints)
    for f, back in zip(fractions, wire.unpack_fractions(ints, len(fractions))):
        assert abs(min(max(f, 0.0), 1.0) - back) <= 0.5 / 32767 + 1e-12
    n = len(fractions)
    assert n + 1 + len(ints) <= capacity(n)  # zen's numbers (counts, gamma, fractions) fit one exchange
