"""zen's wire formats: the one definition of what a piece of a sparse tensor looks like on the wire.

A piece is a byte buffer of two sections, each padded to 8 bytes so that it can be viewed in place:

    COO     [ indices : count * s_i bytes | pad ][ values : count * s_v bytes | pad ]
    BITMAP  [ bitmap over I_j : ceil(|I_j| / 8) bytes | pad ][ values : count * s_v bytes | pad ]

Indices are int32 for tensors of fewer than 2**31 elements, int64 from there (``index_dtype``); values
have the tensor's dtype. In the bitmap, bit r (byte r // 8, bit r % 8) says whether I_j[r] is present;
values follow in index order.
"""
import torch

COO = 0
BITMAP = 1
_ALIGN = 8


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def _padded(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def coo_bytes(count: int, index_size: int, value_size: int) -> int:
    return _padded(count * index_size) + _padded(count * value_size)


def bitmap_bytes(count: int, set_size: int, value_size: int) -> int:
    return _padded((set_size + 7) // 8) + _padded(count * value_size)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def pack_coo_pieces(indices: torch.Tensor, values: torch.Tensor, counts) -> tuple:
    """Consecutive pieces (piece j = the next counts[j] pairs) as one buffer; returns (buffer, byte splits)."""
    si, sv = indices.element_size(), values.element_size()
    splits = [coo_bytes(c, si, sv) for c in counts]
    buf = torch.zeros(sum(splits), dtype=torch.uint8, device=indices.device)
    at = start = 0
    for count, size in zip(counts, splits):
        buf[at:at + count * si] = _as_bytes(indices[start:start + count])
        v_at = at + _padded(count * si)
        buf[v_at:v_at + count * sv] = _as_bytes(values[start:start + count])
        at += size
        start += count
    return buf, splits


def pack_coo(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return pack_coo_pieces(indices, values, [indices.numel()])[0]


def pack_bitmap(bitmap: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    nb, sv = bitmap.numel(), values.element_size()
    buf = torch.zeros(_padded(nb) + _padded(values.numel() * sv), dtype=torch.uint8, device=bitmap.device)
    buf[:nb] = bitmap
    buf[_padded(nb):_padded(nb) + values.numel() * sv] = _as_bytes(values)
    return buf


def _section(buf: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    if offset + count * size > buf.numel():
        raise ValueError(f"zen: truncated buffer: need {offset + count * size} bytes, got {buf.numel()}")
    return buf[offset:offset + count * size].view(dtype)


def unpack_coo(buf: torch.Tensor, count: int, idx_dtype: torch.dtype, val_dtype: torch.dtype):
    """(indices, values) views into one COO piece; raises on a truncated buffer."""
    if count < 0:
        raise ValueError(f"zen: corrupt piece header: negative count {count}")
    si = torch.empty(0, dtype=idx_dtype).element_size()
    sv = torch.empty(0, dtype=val_dtype).element_size()
    if buf.numel() != coo_bytes(count, si, sv):
        raise ValueError(f"zen: COO piece of {count} pairs must have {coo_bytes(count, si, sv)} bytes, got {buf.numel()}")
    return _section(buf, 0, count, idx_dtype), _section(buf, _padded(count * si), count, val_dtype)


def unpack_bitmap(buf: torch.Tensor, count: int, set_size: int, val_dtype: torch.dtype):
    """(bitmap, values) views into one BITMAP piece; raises on a truncated buffer."""
    if count < 0 or count > set_size:
        raise ValueError(f"zen: corrupt piece header: {count} values for an index set of {set_size}")
    sv = torch.empty(0, dtype=val_dtype).element_size()
    if buf.numel() != bitmap_bytes(count, set_size, sv):
        raise ValueError(f"zen: bitmap piece must have {bitmap_bytes(count, set_size, sv)} bytes, got {buf.numel()}")
    nb = (set_size + 7) // 8
    return buf[:nb], _section(buf, _padded(nb), count, val_dtype)


def split(buf: torch.Tensor, sizes):
    """Consecutive slices of ``buf`` of the given byte sizes."""
    return list(torch.split(buf, list(sizes)))
