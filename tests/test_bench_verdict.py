"""benchmarks/allreduce.py's verdict (the last lines of `make bench`): read off the table's own rows."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from allreduce import EMULATED_COMMAND, verdict  # noqa: E402


def row(scheme, nnz, ms, numel=1000, union=None, world=4, link=float("nan")):
    union = nnz * world / numel if union is None else union
    return {"scheme": scheme, "numel": numel, "nnz_per_rank": nnz, "union_density": union, "world": world,
            "time_median": ms / 1e3, "link_bps": link}


def test_names_the_fastest_scheme_and_zens_ratio_at_each_density():
    rows = [row("dense", 10, 8.0), row("agsparse", 10, 2.0), row("zen", 10, 3.0), row("auto", 10, 2.5),
            row("dense", 100, 8.0, union=0.2), row("agsparse", 100, 9.0, union=0.2), row("zen", 100, 4.0, union=0.2)]
    text = verdict(rows)
    lines = text.splitlines()
    assert lines[1] == "verdict:"
    assert lines[2] == "  numel 1000, density 1.00%: fastest agsparse 2.00 ms; zen 3.00 ms, 1.50x the fastest's time"
    assert lines[3] == "  numel 1000, density 10.00%: fastest zen 4.00 ms; zen is the fastest"
    assert "what would move zen ahead: more ranks (here 4)" in text
    assert "at most 2.00x" in text  # 4 ranks x 100 non-zeros over a union of 200
    assert "here loopback (no link set)" in text
    assert lines[-1] == f"  on an emulated cluster (root): {EMULATED_COMMAND}"


def test_zen_ahead_everywhere_and_a_set_link():
    rows = [row("dense", 10, 8.0, world=16, link=2.5e8), row("zen", 10, 1.0, world=16, link=2.5e8),
            row("zen@node", 10, 0.5, world=16, link=2.5e8)]
    text = verdict(rows)
    assert "fastest zen@node 0.50 ms; zen is the fastest" in text
    assert "zen leads here, and further with" in text and "(here 16)" in text and "0.25 Gbit/s per host" in text


def test_without_zen_says_so():
    assert verdict([row("dense", 10, 8.0), row("agsparse", 10, 2.0)]).splitlines()[-1] == "  (zen was not among --schemes)"
