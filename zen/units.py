"""Units of the settings users type: link rates and times, as tc and the README write them."""
import re


def parse_rate(text) -> float:
    """A bandwidth in bytes/s: a number (bytes/s), '<x>[k|m|g|t]bit' (bits/s, decimal, as tc) or
    '<x>[K|M|G|T]B/s' (bytes/s, decimal). '1gbit' -> 1.25e8."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(?:([kmgt]?)bit|([KMGT]?)B/s)?\s*", str(text))
    if not m:
        raise ValueError(f"bad bandwidth {text!r}: use e.g. 1gbit, 100mbit, 10GB/s or a number of bytes/s")
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
    if m.group(2) is not None:
        return float(m.group(1)) * scale[m.group(2)] / 8.0
    return float(m.group(1)) * scale[(m.group(3) or "").lower()]


def parse_time(text) -> float:
    """A time in seconds: a number (s) or '<x>[s|ms|us|ns]'. '50us' -> 5e-05."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(s|ms|us|ns)?\s*", str(text))
    if not m:
        raise ValueError(f"bad time {text!r}: use e.g. 50us, 0.1ms, 2e-6")
    return float(m.group(1)) * {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[m.group(2)]
