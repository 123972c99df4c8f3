"""zen's wire formats: the one definition of what a piece of a sparse tensor looks like on the wire.

A piece is a byte buffer of two sections, each padded to 8 bytes so that it can be viewed in place:

    COO     [ indices : count * s_i bytes | pad ][ values : count * s_v bytes | pad ]
    BITMAP  [ bitmap over I_j : ceil(|I_j| / 8) bytes | pad ][ values : count * s_v bytes | pad ]
    DENSE   [ values : numel * s_v bytes ]                      (the tensor itself, no padding: sent in place)
    BLOCKS  [ bitmap over blocks [lo, hi) : ceil((hi - lo) / 8) bytes | pad ][ values : count * B * s_v | pad ]

An index names one entry: an element, or a row of b values (a block of b consecutive elements; the
values section then holds count * b values, row after row, and s_v below is the row's bytes, b times the
dtype's). Indices are int32 below 2**31 entries, int64 from there (``index_dtype``); values have the
tensor's dtype. In the bitmap, bit r (byte r // 8, bit r % 8) says whether I_j[r] is present;
values follow in index order. BLOCKS (OmniReduce): the elements are cut into fixed blocks of B elements
(block b = elements [b B, (b + 1) B)); bit r says whether block lo + r is sent, and the sent blocks follow
whole, in block order, the last block of the tensor zero-padded to B. A BLOCKS piece of zero blocks is
empty (0 bytes): the receiver knows the count beforehand.

SparCML's point-to-point messages are a STEP_HEADER, [count, format] as two int64 (``step_header``),
followed by a COO or DENSE piece; the header is left out where the receiver already knows the count.

SLOTTED is how a piece travels where no round is spent on exchanging its size: both ends know a room of
``room`` bytes before anything is exchanged, and the message is a head of h int64s (what the receiver reads
first), then the piece's first ``room`` bytes, zero-padded to exactly ``room`` when the piece is shorter; what
exceeds the room follows in a second message, whose size the receiver learns from the head (or knew already):

    SLOTTED [ head : 8 h bytes | piece ... | zeros to room ]  [ the rest of the piece, if any ]

The agreement's messages are SLOTTED (``zen.agreement``): the head is the agreement row, the room the plan's
slot S[p][j], which carries whatever the scheme filed the plan for (zen: the first bytes of a COO piece, whose
size the receiver reads from the counts in the rows, or a DENSE piece, the tensor whole). So are zen's pull
messages: the head is a STEP_HEADER [count, format] and the piece COO or BITMAP, in a room that every rank
sizes alike from the agreed counts and the previous call's unions.
"""
import torch

COO = 0
BITMAP = 1
DENSE = 2
BLOCKS = 3
_ALIGN = 8


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole 8-byte words: a section's size on the wire."""
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def coo_bytes(count: int, index_size: int, value_size: int) -> int:
    return padded(count * index_size) + padded(count * value_size)


def bitmap_bytes(count: int, set_size: int, value_size: int) -> int:
    return padded((set_size + 7) // 8) + padded(count * value_size)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def row_width(values: torch.Tensor) -> int:
    """Values per entry: b for rows [k, b], 1 for values [k]."""
    return values.shape[1] if values.dim() == 2 else 1


def entry_bytes(values: torch.Tensor) -> int:
    """s_v of the formats: bytes per entry (a value, or a row of b values)."""
    return values.element_size() * row_width(values)


def _rows(values: torch.Tensor, count: int, width: int) -> torch.Tensor:
    return values if width == 1 else values.view(count, width)


def pack_coo_pieces(indices: torch.Tensor, values: torch.Tensor, counts) -> tuple:
    """Consecutive pieces (piece j = the next counts[j] pairs) as one buffer; returns (buffer, byte splits)."""
    si, sv = indices.element_size(), entry_bytes(values)
    splits = [coo_bytes(c, si, sv) for c in counts]
    buf = torch.zeros(sum(splits), dtype=torch.uint8, device=indices.device)
    at = start = 0
    for count, size in zip(counts, splits):
        buf[at:at + count * si] = _as_bytes(indices[start:start + count])
        v_at = at + padded(count * si)
        buf[v_at:v_at + count * sv] = _as_bytes(values[start:start + count])
        at += size
        start += count
    return buf, splits


def pack_coo(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return pack_coo_pieces(indices, values, [indices.numel()])[0]


def pack_bitmap(bitmap: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    nb, nv = bitmap.numel(), values.numel() * values.element_size()
    buf = torch.zeros(padded(nb) + padded(nv), dtype=torch.uint8, device=bitmap.device)
    buf[:nb] = bitmap
    buf[padded(nb):padded(nb) + nv] = _as_bytes(values)
    return buf


def _section(buf: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    if offset + count * size > buf.numel():
        raise ValueError(f"zen: truncated buffer: need {offset + count * size} bytes, got {buf.numel()}")
    return buf[offset:offset + count * size].view(dtype)


def unpack_coo(buf: torch.Tensor, count: int, idx_dtype: torch.dtype, val_dtype: torch.dtype, width: int = 1):
    """(indices, values) views into one COO piece (values [count], or rows [count, width] when width > 1);
    raises on a truncated buffer."""
    if count < 0:
        raise ValueError(f"zen: corrupt piece header: negative count {count}")
    si = torch.empty(0, dtype=idx_dtype).element_size()
    sv = torch.empty(0, dtype=val_dtype).element_size() * width
    if buf.numel() != coo_bytes(count, si, sv):
        raise ValueError(f"zen: COO piece of {count} pairs must have {coo_bytes(count, si, sv)} bytes, got {buf.numel()}")
    values = _section(buf, padded(count * si), count * width, val_dtype)
    return _section(buf, 0, count, idx_dtype), _rows(values, count, width)


def unpack_bitmap(buf: torch.Tensor, count: int, set_size: int, val_dtype: torch.dtype, width: int = 1):
    """(bitmap, values) views into one BITMAP piece (values [count], or rows [count, width] when width > 1);
    raises on a truncated buffer."""
    if count < 0 or count > set_size:
        raise ValueError(f"zen: corrupt piece header: {count} values for an index set of {set_size}")
    sv = torch.empty(0, dtype=val_dtype).element_size() * width
    if buf.numel() != bitmap_bytes(count, set_size, sv):
        raise ValueError(f"zen: bitmap piece must have {bitmap_bytes(count, set_size, sv)} bytes, got {buf.numel()}")
    nb = (set_size + 7) // 8
    return buf[:nb], _rows(_section(buf, padded(nb), count * width, val_dtype), count, width)


def split(buf: torch.Tensor, sizes):
    """Consecutive slices of ``buf`` of the given byte sizes."""
    return list(torch.split(buf, list(sizes)))


def dense_piece_bytes(numel: int, value_size: int) -> int:
    return numel * value_size


def piece_bytes(fmt: int, count: int, numel: int, index_size: int, value_size: int) -> int:
    """Bytes of a COO piece of ``count`` pairs or of a DENSE piece of ``numel`` values."""
    if fmt == COO:
        return coo_bytes(count, index_size, value_size)
    if fmt == DENSE:
        return dense_piece_bytes(numel, value_size)
    raise ValueError(f"zen: corrupt step header: unknown format {fmt}")


def step_header(count: int, fmt: int, device=None) -> torch.Tensor:
    return torch.tensor([count, fmt], dtype=torch.int64, device=device)


STEP_HEADER_INTS = 2  # [count, format]
HEADER_BYTES = 8 * STEP_HEADER_INTS


def pack_dense(values: torch.Tensor) -> torch.Tensor:
    """A DENSE piece: a byte view of the (contiguous) values, no copy."""
    return _as_bytes(values)


def unpack_dense(buf: torch.Tensor, numel: int, val_dtype: torch.dtype) -> torch.Tensor:
    sv = torch.empty(0, dtype=val_dtype).element_size()
    if buf.numel() != numel * sv:
        raise ValueError(f"zen: DENSE piece of {numel} values must have {numel * sv} bytes, got {buf.numel()}")
    return buf.view(val_dtype)


def blocks_bytes(count: int, num_blocks: int, block_size: int, value_size: int) -> int:
    """Bytes of a BLOCKS piece of ``count`` blocks out of a range of ``num_blocks``; 0 when count is 0."""
    return bitmap_bytes(count * block_size, num_blocks, value_size) if count else 0


def pack_blocks_pieces(bitmaps, block_values: torch.Tensor, counts) -> tuple:
    """Consecutive BLOCKS pieces (piece j = bitmaps[j] and the next counts[j] rows of the [count, B]
    ``block_values``) in one buffer; returns (buffer, byte splits)."""
    block_size, sv = block_values.shape[1], block_values.element_size()
    splits = [blocks_bytes(c, b.numel() * 8, block_size, sv) if c else 0 for b, c in zip(bitmaps, counts)]
    buf = torch.empty(sum(splits), dtype=torch.uint8, device=block_values.device)
    at = start = 0
    for bitmap, count, size in zip(bitmaps, counts, splits):
        if count:
            nb = bitmap.numel()
            buf[at:at + padded(nb)].zero_()
            buf[at:at + nb] = bitmap
            values = _as_bytes(block_values[start:start + count].reshape(-1))
            buf[at + padded(nb):at + padded(nb) + values.numel()] = values
            buf[at + padded(nb) + values.numel():at + size].zero_()
        at += size
        start += count
    return buf, splits


def pack_blocks(bitmap: torch.Tensor, block_values: torch.Tensor) -> torch.Tensor:
    """A BLOCKS piece from the bitmap over the block range and the [count, B] values of the sent blocks."""
    return pack_blocks_pieces([bitmap], block_values, [block_values.shape[0]])[0]


def unpack_blocks(buf: torch.Tensor, count: int, num_blocks: int, block_size: int, val_dtype: torch.dtype):
    """(bitmap, [count, B] values) views into one BLOCKS piece; raises on a truncated or corrupt buffer."""
    if count < 0 or count > num_blocks:
        raise ValueError(f"zen: corrupt piece header: {count} blocks for a range of {num_blocks}")
    sv = torch.empty(0, dtype=val_dtype).element_size()
    expected = blocks_bytes(count, num_blocks, block_size, sv)
    if buf.numel() != expected:
        raise ValueError(f"zen: BLOCKS piece of {count} blocks must have {expected} bytes, got {buf.numel()}")
    nb = (num_blocks + 7) // 8
    if count == 0:
        return torch.zeros(nb, dtype=torch.uint8, device=buf.device), torch.empty(0, block_size, dtype=val_dtype,
                                                                                    device=buf.device)
    return buf[:nb], _section(buf, padded(nb), count * block_size, val_dtype).view(count, block_size)


def slotted_bytes(head_ints: int, room: int) -> int:
    """Bytes of a SLOTTED message's first part: a head of ``head_ints`` int64s and a room of ``room`` bytes."""
    return 8 * head_ints + room


def pack_slotted(head: torch.Tensor, pieces, rooms) -> tuple:
    """(buffer, splits): one SLOTTED first part per room, rooms[j] bytes after ``head`` (int64) holding the first
    bytes of pieces[j] (a byte tensor; ``pieces`` None: zeros), zero-padded to the room. The rest of piece j,
    ``pieces[j][rooms[j]:]``, follows in a second message where it is not empty."""
    splits = [slotted_bytes(head.numel(), room) for room in rooms]
    buf = torch.zeros(sum(splits), dtype=torch.uint8, device=head.device)
    at = head.numel() * 8
    for j, message in enumerate(split(buf, splits)):
        message[:at] = _as_bytes(head)
        if pieces is not None:
            fits = min(pieces[j].numel(), rooms[j])
            message[at:at + fits] = pieces[j][:fits]
    return buf, splits


def unpack_slotted(message: torch.Tensor, head_ints: int) -> tuple:
    """(head, room): the head (``head_ints`` int64s, a copy) and the room's bytes (a view) of a SLOTTED
    message's first part; raises where it is shorter than its head."""
    at = head_ints * 8
    if message.numel() < at:
        raise ValueError(f"zen: truncated slotted message: {message.numel()} bytes, the head needs {at}")
    return message[:at].clone().view(torch.int64), message[at:]


def slotted_rest_bytes(room: int, piece_bytes: int) -> int:
    """Bytes of a SLOTTED message's second part: what of a ``piece_bytes``-byte piece exceeds the room."""
    return max(0, piece_bytes - room)


def join_slotted(room: torch.Tensor, rest: torch.Tensor, piece_bytes: int) -> torch.Tensor:
    """The piece (``piece_bytes`` bytes) from a SLOTTED message's room and its second part; a view where it fit
    the room."""
    need = slotted_rest_bytes(room.numel(), piece_bytes)
    if rest.numel() != need:
        raise ValueError(f"zen: slotted message of a {piece_bytes}-byte piece in a {room.numel()}-byte room needs "
                         f"a second part of {need} bytes, got {rest.numel()}")
    return torch.cat([room, rest]) if need else room[:piece_bytes]


# Fractions in [0, 1] that ride in the agreement (zen's union fractions), FRACTION_BITS each, four to an int64
# (60 bits: the int stays positive): n of them take ceil(n / 4) of the row's slots.
FRACTION_BITS = 15
FRACTIONS_PER_INT = 4


def pack_fractions(fractions) -> list:
    """Ints of ``fractions`` (each clamped to [0, 1], rounded to 1 / (2^15 - 1)), four per int, the first lowest."""
    top = (1 << FRACTION_BITS) - 1
    codes = [round(min(max(f, 0.0), 1.0) * top) for f in fractions]
    return [sum(c << (FRACTION_BITS * k) for k, c in enumerate(codes[i:i + FRACTIONS_PER_INT]))
            for i in range(0, len(codes), FRACTIONS_PER_INT)]


def unpack_fractions(ints, count: int) -> list:
    """The ``count`` fractions of :func:`pack_fractions`'s ints."""
    top = (1 << FRACTION_BITS) - 1
    return [((int(ints[i // FRACTIONS_PER_INT]) >> (FRACTION_BITS * (i % FRACTIONS_PER_INT))) & top) / top
            for i in range(count)]
