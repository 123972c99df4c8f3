"""The agreement: the first exchange of every zen call, which makes every rank fail alike.

Every rank all-gathers one row: its call's header (what it was asked to sum: numel, dtype, shape, scheme,
layout and sparse dims, device, the scheme's settings, block size, hierarchy setting, and a :class:`Problem`
code when it cannot take part), then the
scheme's own numbers (its sizes, piggybacked so the call needs one round trip, not two). Every rank sees
the same rows, so every rank makes the same decision:

* any rank reported a problem (an unsupported dtype, device or layout, an unknown scheme, an error it hit
  before the exchange): every rank raises the same :class:`MismatchError`, naming the rank and the problem;
* the headers differ (a tensor or an argument that differs across ranks): the same, naming the field and
  which ranks had which value;
* else the call goes on, in step.

The group stays usable after a :class:`MismatchError`. The row's length never depends on the scheme or
on the problem (the scheme's numbers are padded to :func:`capacity` slots; a rank with a problem sends its
message as text in those slots), so a bad call on one rank cannot desynchronise the all-gather itself.

The agreement's messages may also carry payload bytes for the peers (:func:`agree_and_carry`), so that a
scheme whose next step sends each peer something (zen's push) spends no round on the agreement alone. The
message from rank p to rank j is then the row and a slot of S[p][j] bytes (wire SLOTTED, headed by the
row). The agreement knows nothing of what the slots hold: the scheme files a plan, S and an opaque label
saying what the slots are to hold (:func:`file_plan`), and finds it again before the next call
(:func:`planned`).

Both ends must know S before anything is exchanged, and every rank's messages must have the same sizes, also
when one rank reports a problem (:func:`report`: it has no scheme running, yet sends its row in the same
slots) or runs another scheme. So S can depend on nothing of the call itself, and the store of plans is
the agreement's, not a scheme's: a plan is filed under the code of the agreement that preceded the call
that filed it, and used by the next call that follows an agreement of the same code, which every rank saw
alike. A repeated sequence of calls (a training step's buckets) thus finds each call's plan, sized from its
own last time; a call that breaks the sequence pays its predecessor's slots in padding (or uses a plan
filed by another scheme: a scheme reads only a label of its own). The sizing rule and the payloads are the
scheme's (zen's: :mod:`zen.schemes.balanced.push`).
"""
import enum
import weakref
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from . import wire

# Codes carried by the header; the order of these lists is part of zen's protocol.
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
# Every other dtype gets a code too (after the supported ones), only so that errors can name it.
ALL_DTYPES = DTYPES + [getattr(torch, name) for name in (
    "bool", "int8", "uint8", "int16", "uint16", "uint32", "uint64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "qint8", "quint8", "qint32")
    if isinstance(getattr(torch, name, None), torch.dtype)]
DEVICE_TYPES = ["cpu", "cuda", "meta", "xpu", "mps", "hpu", "mtia", "privateuseone", "xla", "lazy"]
LAYOUTS = {0: "strided", 1: "sparse_coo"}
BACKEND_DEVICES = {"gloo": {"cpu"}, "nccl": {"cuda"}, "mpi": {"cpu", "cuda"}}

HEADER_FIELDS = ["numel", "dtype", "shape", "scheme", "layout", "sparse_dim", "device", "settings", "block_size",
                 "hierarchy", "value_dtype", "keep", "problem"]
# The hierarchy settings of a call (zen.hierarchy); the header carries the setting and local_size.
HIERARCHIES = ("auto", "flat", "node")
# Slots after header + [len(extra)] beyond one per rank: a rank's problem message has room even at n = 1.
SLACK = 8
_TEXT_SLOTS = 32  # int64 slots of the text exchanged to name a shape or a scheme that differs


class Problem(enum.IntEnum):
    """Why a rank cannot take part in a call; 0 (NONE) when it can."""

    NONE = 0
    DTYPE = 1
    DEVICE = 2
    SCHEME = 3
    LAYOUT = 4
    NOT_A_TENSOR = 5
    FAILED_BEFORE_EXCHANGE = 6
    OVERLAP = 7
    BLOCK_SIZE = 8

    @property
    def message(self) -> str:
        return {
            Problem.DTYPE: "unsupported dtype (zen sums float32, float64, float16, bfloat16, int32 and int64)",
            Problem.DEVICE: "tensor device not supported by the process group's backend",
            Problem.SCHEME: "unknown scheme",
            Problem.LAYOUT: "unsupported layout (zen takes strided tensors and sparse COO tensors)",
            Problem.NOT_A_TENSOR: "not a tensor",
            Problem.FAILED_BEFORE_EXCHANGE: "failed before the exchange",
            Problem.OVERLAP: "tensor has overlapping memory (e.g. from expand()); the sum cannot be written "
                             "back into it",
            Problem.BLOCK_SIZE: "bad block_size",
        }.get(self, "no problem")


_PROBLEM = HEADER_FIELDS.index("problem")


def capacity(n: int) -> int:
    """Slots of the row for a scheme's numbers at n ranks, the same for every scheme (the rows' sizes may not
    depend on the call): an int and a fraction (``wire.pack_fractions``, four to an int64) per rank, and
    SLACK more; room for zen's n counts, gamma and n union fractions, so that its agreement is one exchange at
    any n."""
    return n + -(-n // wire.FRACTIONS_PER_INT) + SLACK


def row_ints(n: int, extra: int) -> int:
    """int64s per rank in the agreement's all-gather of a scheme sending ``extra`` numbers: the header,
    their count and max(extra, capacity(n)) slots (what the cost model charges for it)."""
    return len(HEADER_FIELDS) + 1 + max(extra, capacity(n))


class MismatchError(ValueError):
    """Raised on every rank when the ranks called a zen collective with disagreeing tensors or arguments, or
    when any rank could not take part (bad dtype, device, scheme...). The group stays usable."""


def text_code(value) -> int:
    """A 32-bit code of ``value``'s repr: how a shape, a scheme name or a scheme's settings ride in the header."""
    return zlib.crc32(repr(value).encode())


def shape_code(shape) -> int:
    return text_code(tuple(shape))


def encode_text(text: str, slots: int) -> List[int]:
    """``text`` (UTF-8, cut to fit) as ``slots`` int64s, zero-padded: how a rank's error message rides
    in the agreement row."""
    data = text.encode("utf-8", "replace")[:8 * slots]
    data += b"\0" * (8 * slots - len(data))
    return [int.from_bytes(data[8 * i:8 * i + 8], "little", signed=True) for i in range(slots)]


def decode_text(values: List[int]) -> str:
    data = b"".join(int(v).to_bytes(8, "little", signed=True) for v in values)
    return data.rstrip(b"\0").decode("utf-8", "replace")


def _code(value, values) -> int:
    return values.index(value) if value in values else len(values)


def block_size_code(block_size) -> int:
    """The header's block_size: 0 for None (chosen per call), the int, or -1 for anything else."""
    if block_size is None:
        return 0
    return block_size if isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > 0 else -1


def hierarchy_code(hierarchy: Optional[tuple]) -> int:
    """The header's hierarchy: 0 where the caller gives none (zen.predict's measurement), else the setting
    (1 + its index in HIERARCHIES) in the high 32 bits and local_size (0: None) in the low ones."""
    if hierarchy is None:
        return 0
    setting, local_size = hierarchy
    return (1 + HIERARCHIES.index(setting)) << 32 | (local_size or 0) & 0xFFFFFFFF


def _block_size_problem(tensor: torch.Tensor, block_size) -> str:
    """Why ``block_size`` cannot reduce ``tensor`` ("" when it can)."""
    if block_size is None:
        return ""
    if block_size_code(block_size) < 1:
        return f"must be None or a positive int; got {block_size!r}"
    if tensor.layout == torch.sparse_coo:
        row = tensor.shape[tensor.sparse_dim():].numel()
        if block_size != row:
            return (f"a sparse COO tensor travels as rows of its dense dims ({row} values); got {block_size}")
    elif tensor.numel() % block_size:
        return f"{block_size} does not divide the tensor's {tensor.numel()} elements"
    return ""


def inspect_call(tensor, scheme_name: str, known_scheme: bool, settings, backend: str, allowed: Sequence[str] = (),
                 block_size=None, hierarchy: Optional[tuple] = None, value_dtype: Optional[torch.dtype] = None,
                 keep: Optional[int] = None) -> Tuple[List[int], str]:
    """The header of a call and, when this rank cannot take part, the reason (the header's ``problem``
    field is then non-zero): every rank learns it in the agreement and raises alike.

    ``known_scheme``: whether ``scheme_name`` names a scheme this rank can run (``allowed``: the names it
    can, for the error); ``settings``: the scheme's settings that decide its protocol (a tuple, or None),
    which every rank must share; ``block_size``: the entries' size asked for (None: chosen per call), which
    must divide the tensor and be the same on every rank; ``hierarchy``: (setting, local_size) of a call of
    :mod:`zen.hierarchy`, alike on every rank (a rank that runs flat and one that looks for the nodes first
    meet in the same agreement, where the field tells them apart); ``value_dtype`` (the dtype values travel
    in, None: the tensor's) and ``keep`` (global top-k, None: every entry), which size the messages."""
    is_tensor = isinstance(tensor, torch.Tensor)
    device = tensor.device.type if is_tensor else "cpu"
    dtype = tensor.dtype if is_tensor else torch.float32
    header = [
        tensor.numel() if is_tensor else -1,
        ALL_DTYPES.index(dtype) if dtype in ALL_DTYPES else -1,
        shape_code(tensor.shape) if is_tensor else 0,
        text_code(scheme_name),
        (1 if tensor.layout == torch.sparse_coo else 0 if tensor.layout == torch.strided else 2) if is_tensor else 0,
        tensor.sparse_dim() if is_tensor and tensor.layout == torch.sparse_coo else 0,
        _code(device, DEVICE_TYPES),
        text_code(settings) if settings is not None else 0,
        block_size_code(block_size),
        hierarchy_code(hierarchy),
        0 if value_dtype is None else 1 + _code(value_dtype, ALL_DTYPES),
        0 if keep is None else int(keep),
        Problem.NONE,
    ]
    problem, detail = Problem.NONE, ""
    if not is_tensor:
        problem, detail = Problem.NOT_A_TENSOR, f"got {type(tensor).__name__}"
    elif dtype not in DTYPES:
        problem, detail = Problem.DTYPE, f"got {dtype}"
    elif device not in BACKEND_DEVICES.get(backend, {device}):
        problem, detail = Problem.DEVICE, (f"a {device} tensor on the {backend} backend, which takes "
                                           f"{', '.join(sorted(BACKEND_DEVICES[backend]))} tensors")
    elif not known_scheme:
        problem, detail = Problem.SCHEME, f"{scheme_name!r}; allowed: {', '.join(allowed)}"
    elif tensor.layout not in (torch.strided, torch.sparse_coo):
        problem, detail = Problem.LAYOUT, f"got {tensor.layout}"
    elif tensor.layout == torch.strided and torch._debug_has_internal_overlap(tensor) == 1:
        problem, detail = Problem.OVERLAP, f"strides {tensor.stride()} for shape {tuple(tensor.shape)}"
    elif why := _block_size_problem(tensor, block_size):
        problem, detail = Problem.BLOCK_SIZE, why
    header[_PROBLEM] = int(problem)
    return header, detail


def check_headers(headers: List[List[int]], details: Optional[List[str]] = None) -> None:
    """Raise :class:`MismatchError` (identically on every rank, since all see the same rows) when a rank
    reported a problem or the ranks' headers differ; the error's ``field`` names the first that differs."""
    problems = []
    for rank, header in enumerate(headers):
        if header[_PROBLEM]:
            problem = header[_PROBLEM]
            message = Problem(problem).message if problem in Problem._value2member_map_ else f"problem {problem}"
            detail = details[rank] if details else ""
            problems.append(f"rank {rank}: {message}" + (f": {detail}" if detail else ""))
    if problems:
        raise MismatchError("zen.all_reduce: " + "; ".join(problems))
    for field_index, field in enumerate(HEADER_FIELDS):
        values = [h[field_index] for h in headers]
        if len(set(values)) > 1:
            error = MismatchError(f"zen.all_reduce: tensors or arguments differ across ranks: {field} is "
                                  + _by_value([describe(field, v) for v in values]))
            error.field = field
            raise error


def _by_value(texts: List[str]) -> str:
    """'a on ranks [0, 2]; b on ranks [1]' from every rank's text."""
    by_text = OrderedDict()
    for rank, text in enumerate(texts):
        by_text.setdefault(text, []).append(rank)
    return "; ".join(f"{text} on ranks {ranks}" for text, ranks in by_text.items())


def describe(field: str, value: int) -> str:
    if field == "dtype":
        return str(ALL_DTYPES[value]) if 0 <= value < len(ALL_DTYPES) else "an unsupported dtype"
    if field == "layout":
        return LAYOUTS.get(value, "another layout")
    if field == "device":
        return DEVICE_TYPES[value] if 0 <= value < len(DEVICE_TYPES) else "another device"
    if field in ("shape", "scheme", "settings"):
        return f"{field}#{value:08x}"
    if field == "block_size":
        return "None (chosen per call)" if value == 0 else str(value)
    if field == "value_dtype":
        return "None (the tensor's)" if value == 0 else describe("dtype", value - 1)
    if field == "keep":
        return "None (every entry)" if value == 0 else str(value)
    if field == "hierarchy":
        if value == 0:
            return "none"
        setting = HIERARCHIES[(value >> 32) - 1] if 0 < value >> 32 <= len(HIERARCHIES) else "another"
        return repr(setting) + (f" (local_size {value & 0xFFFFFFFF})" if value & 0xFFFFFFFF else "")
    return str(value)


def _shape_text(shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


@dataclass
class _Plans:
    """A group's plans of the agreement's slots: ``slots[code]`` is (S, label): S (bytes, S[p][j] from rank p to
    rank j) of the call that last followed the agreement of headers ``code``, and the label its scheme filed
    (opaque here); ``last``, the code of the previous agreement; ``source``, the code the current call's plan
    is filed under."""

    last: int = 0
    source: int = 0
    slots: OrderedDict = field(default_factory=OrderedDict)


_PLANS_KEPT = 64
_plans = weakref.WeakKeyDictionary()  # Comm -> _Plans


def _exchange_rows(comm, row: List[int], payloads=None):
    """Every rank's ``row`` (a CPU tensor [world, len]) and, from each rank q, the S[q][me] bytes of its slot
    for this rank (``payloads``: this rank's payload for each rank, byte tensors, cut at the slot; None: the
    slots go as zeros), with S the plan that follows the previous agreement (all zeros where none: a plain
    all-gather). Returns (rows, slots received, S)."""
    plans = _plans.setdefault(comm, _Plans())
    n, me = comm.world, comm.rank
    slots = planned(comm)[0]
    if not any(map(any, slots)):
        rows = comm.all_gather_ints(row)
        firsts = [torch.empty(0, dtype=torch.uint8, device=comm.device)] * n
    else:
        mine = torch.tensor(row, dtype=torch.int64, device=comm.device)
        send, send_splits = wire.pack_slotted(mine, payloads, slots[me])
        recv_splits = [wire.slotted_bytes(len(row), slots[q][me]) for q in range(n)]
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=comm.device)
        largest = wire.slotted_bytes(len(row), max(max(r[:p] + r[p + 1:]) for p, r in enumerate(slots)))
        comm.all_to_all(recv, send, recv_splits, send_splits, largest)
        parts = [wire.unpack_slotted(part, len(row)) for part in wire.split(recv, recv_splits)]
        rows, firsts = torch.stack([r for r, _ in parts]).cpu(), [first for _, first in parts]
    plans.source, plans.last = plans.last, zlib.crc32(rows[:, :len(HEADER_FIELDS)].numpy().tobytes())
    plans.slots.pop(plans.source, None)  # refiled by the scheme (file_plan) where it carried payloads
    return rows, firsts, slots


def planned(comm) -> Tuple[List[List[int]], object]:
    """(S, label): the plan the group's next agreement will use (all zeros and None where there is none), the
    same on every rank; ``label``: what the scheme that filed it said the slots hold."""
    plans = _plans.setdefault(comm, _Plans())
    n = comm.world
    return plans.slots.get(plans.last) or ([[0] * n for _ in range(n)], None)


def file_plan(comm, slots: List[List[int]], label=None) -> None:
    """File S (bytes, multiples of 8, S[p][j] from rank p to rank j) and ``label`` (any value; the agreement
    only hands it back) as the plan of the call that will follow this call's agreement next time. Call alike
    on every rank (from what the agreement gathered), once per agreement."""
    plans = _plans.setdefault(comm, _Plans())
    plans.slots[plans.source] = ([list(map(int, row)) for row in slots], label)
    plans.slots.move_to_end(plans.source)
    while len(plans.slots) > _PLANS_KEPT:
        plans.slots.popitem(last=False)


def agree(comm, header: List[int], extra: List[int], detail: str = "", shape=None, scheme_name: str = ""):
    """All-gather ``header + extra`` of every rank over ``comm`` (a :class:`zen.transport.Comm`); raise the
    same error on every rank if the headers disagree or any rank reported a problem (``detail``: its
    message, sent in place of ``extra``). Returns the ``extra`` columns, one row per rank (a CPU tensor).

    The row has the same length on every rank (:func:`row_ints`; a longer ``extra`` takes a second
    all-gather, decided from the gathered lengths, so alike on all ranks). Where the shapes or the schemes
    differ, every rank takes one more exchange of ``shape`` and ``scheme_name`` as text to name them."""
    return agree_and_carry(comm, header, extra, None, detail, shape, scheme_name)[0]


def agree_and_carry(comm, header: List[int], extra: List[int], payloads, detail: str = "", shape=None,
                    scheme_name: str = ""):
    """:func:`agree`, with the first bytes of this rank's ``payloads`` (one byte tensor per rank, or None) in
    the planned slots of its messages (see the module docstring). Returns (extra columns, firsts, S): firsts[q],
    the first S[q][me] bytes of rank q's payload for this rank (zero-padded where the payload is shorter)."""
    extra = [int(v) for v in extra]
    room = capacity(comm.world)
    slots = encode_text(detail, room) if detail else extra[:room] + [0] * max(0, room - len(extra))
    comm.agreements += 1
    rows, firsts, planned = _exchange_rows(comm, list(header) + [len(extra)] + slots, payloads)
    width = len(header)
    headers = rows[:, :width].tolist()
    details = [decode_text(rows[r, width + 1:].tolist()) if headers[r][_PROBLEM] else "" for r in range(comm.world)]
    try:
        check_headers(headers, details)
    except MismatchError as error:
        field = getattr(error, "field", None)
        if field in ("shape", "scheme"):
            mine = _shape_text(tuple(shape or ())) if field == "shape" else repr(scheme_name)
            texts = [decode_text(row) for row in comm.all_gather_ints(encode_text(mine, _TEXT_SLOTS)).tolist()]
            raise MismatchError(f"zen.all_reduce: tensors or arguments differ across ranks: {field} is "
                                + _by_value(texts)) from None
        raise
    lengths = rows[:, width].tolist()
    if len(set(lengths)) > 1:
        raise MismatchError(f"zen.all_reduce: the ranks' schemes exchanged different agreement lengths {lengths}")
    out = rows[:, width + 1:width + 1 + min(lengths[0], room)]
    if lengths[0] > room:
        out = torch.cat([out, comm.all_gather_ints(extra[room:])], dim=1)
    return out, firsts, planned


def report(comm, header: List[int], detail: str, cause: Optional[BaseException] = None, shape=None,
           scheme_name: str = "") -> None:
    """Take part in the agreement with a problem: it raises the same MismatchError on every rank. A failure
    of the exchange itself (a dead peer, a timeout) breaks the group on this rank."""
    try:
        agree(comm, header, [], detail, shape, scheme_name)
    except MismatchError as mismatch:
        raise mismatch from cause
    except BaseException as error:  # noqa: B036  (the exchange itself failed: a dead peer, a timeout)
        comm.fail(error)
        raise
    raise AssertionError("unreachable: the agreement raises when a rank reports a problem")
