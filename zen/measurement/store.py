"""The profile store: each group's :class:`zen.cost.Profile` (set by the user or probed once), and the codec
that carries a profile between ranks as one row of int64 (all ranks then use rank 0's, or the median).

The codec is derived from the Profile's fields and their metadata: a scalar with unit "B/s" travels as int
bytes/s, one with unit "s" as int picoseconds; a table (a tuple of (key, value) pairs) as one column per
key of its "keys", -1 where the key is absent. A table keyed by "schemes" travels as ``SCHEME_SLOTS`` pairs
(code of the scheme's name, value), so its row has the same length on every rank whatever the schemes.
"""
import dataclasses
import statistics
from typing import List, Optional, Sequence

import torch.distributed as dist

from ..agreement import text_code
from ..cost import LOCAL_TIMES, Profile
from ..units import parse_rate, parse_time
from .timing import PS

SCHEME_SLOTS = 16  # schemes a calibration table can hold
_profiles = {}  # group (or WORLD) -> Profile


def _key(group):
    return group if group is not None else dist.group.WORLD


def make_profile(bandwidth, latency, memory_bandwidth=None, **local_times) -> Profile:
    """A :class:`Profile` from numbers or strings ('1gbit', '50us', '10GB/s'); what is not given keeps the
    Profile's default. ``local_times``: any of :data:`zen.cost.LOCAL_TIMES`."""
    unknown = set(local_times) - set(LOCAL_TIMES)
    if unknown:
        raise TypeError(f"make_profile: unknown field(s) {', '.join(sorted(unknown))}")
    fields = dict(bandwidth=parse_rate(bandwidth), latency=parse_time(latency))
    if memory_bandwidth is not None:
        fields["memory_bandwidth"] = parse_rate(memory_bandwidth)
    fields.update({name: parse_time(value) for name, value in local_times.items() if value is not None})
    return Profile(**fields)


def set_profile(group=None, profile: Optional[Profile] = None, *, bandwidth=None, latency=None,
                memory_bandwidth=None, **local_times) -> Profile:
    """Use ``profile`` (or one built from bandwidth, latency, memory_bandwidth and the local times of
    :func:`make_profile`) for ``group`` instead of the probe. Local (no collective); rank 0's profile is the
    one every rank uses. Strings are parsed ('1gbit', '50us'). Returns the profile set."""
    if profile is None:
        if bandwidth is None or latency is None:
            raise ValueError("set_profile: give a Profile, or at least bandwidth and latency")
        profile = make_profile(bandwidth, latency, memory_bandwidth, **local_times)
    _profiles[_key(group)] = profile
    return profile


def cached_profile(group=None) -> Optional[Profile]:
    """The profile set or probed for ``group``, or None."""
    return _profiles.get(_key(group))


def clear_profile(group=None) -> None:
    _profiles.pop(_key(group), None)


# --- the codec ------------------------------------------------------------------------------------------


def _to_int(value: float, unit: str) -> int:
    return int(value) if unit == "B/s" else round(value * PS)


def _from_int(value: int, unit: str) -> float:
    return float(value) if unit == "B/s" else value / PS


def columns(schemes: Sequence[str]) -> List[str]:
    """The name of every column of an encoded profile ("field" or "field.key"), in order."""
    names = []
    for f in dataclasses.fields(Profile):
        keys = f.metadata.get("keys")
        if keys is None:
            names.append(f.name)
        elif keys == "schemes":
            names += [f"{f.name}.{part}{slot}" for slot in range(SCHEME_SLOTS) for part in ("code", "value")]
        else:
            names += [f"{f.name}.{key}" for key in keys]
    return names


def encode(p: Optional[Profile], schemes: Sequence[str]) -> List[int]:
    """A profile as one row of int64 (-1 for what was not measured; all zeros for None, which decodes to
    nothing: a rank with no profile). ``schemes``: the names a "schemes" table may hold."""
    if p is None:
        return [0] * len(columns(schemes))
    row = []
    for f in dataclasses.fields(Profile):
        unit, keys, value = f.metadata["unit"], f.metadata.get("keys"), getattr(p, f.name)
        if keys is None:
            row.append(_to_int(value, unit))
        elif keys == "schemes":
            pairs = [(text_code(name), _to_int(v, unit)) for name, v in value if name in schemes][:SCHEME_SLOTS]
            pairs += [(0, -1)] * (SCHEME_SLOTS - len(pairs))
            row += [x for pair in pairs for x in pair]
        else:
            table = dict(value)
            row += [_to_int(table[key], unit) if key in table else -1 for key in keys]
    return row


def decode(row: Sequence[int], schemes: Sequence[str]) -> Profile:
    """The inverse of :func:`encode` (a "schemes" table keeps the entries of ``schemes`` only)."""
    row, at, fields = [int(x) for x in row], 0, {}
    by_code = {text_code(name): name for name in schemes}
    for f in dataclasses.fields(Profile):
        unit, keys = f.metadata["unit"], f.metadata.get("keys")
        if keys is None:
            fields[f.name] = _from_int(row[at], unit)
            at += 1
        elif keys == "schemes":
            pairs = zip(row[at:at + 2 * SCHEME_SLOTS:2], row[at + 1:at + 2 * SCHEME_SLOTS:2])
            fields[f.name] = tuple((by_code[code], _from_int(v, unit)) for code, v in pairs
                                   if v >= 0 and code in by_code)
            at += 2 * SCHEME_SLOTS
        else:
            least = 1 if unit == "B/s" else 0  # a rate of 0 was not measured
            fields[f.name] = tuple((key, _from_int(v, unit)) for key, v in zip(keys, row[at:at + len(keys)])
                                   if v >= least)
            at += len(keys)
    return Profile(**fields)


def median_rows(rows) -> list:
    """Per column, the median of the ranks' non-negative values (-1 where none has one)."""
    agreed = []
    for column in zip(*rows):
        valid = [x for x in column if x >= 0]
        agreed.append(int(statistics.median_low(valid)) if valid else -1)
    return agreed
