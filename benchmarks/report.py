"""The measured figures of README.md, benchmarks/README.md and docs/cost_model.md, written from results/.

    python benchmarks/report.py            # rewrite the pages' generated blocks in place
    python benchmarks/report.py --check    # exit 1 with a diff where a page differs from what it would write

Every table (and every sentence made only of figures) of those pages that a results/ file holds sits
between two markers, ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->``; NAME is the results file(s) it is
written from (without extension; several joined by commas; ``#part`` where one file gives several blocks). The
lines between the markers are exactly what this script writes from the files: edit the file's command and
rerun it (``make results`` for those that need no root), never the block. The prose around the blocks is
written by hand, and types no measured figure: a sentence that needs one (a range, a ratio, whether a target
is met) is a ``#part`` block written here from the file that holds it, and the prose says the rest in words.

Standard library only (it runs in CI before anything is built): JSON where the benchmark writes it, else the
benchmark's printed table (results/memory.txt). ``--root`` and ``--results`` point it at other copies.

A block written from a file measured on an earlier version of the code ends with a line that says so: a file's
commit is the one that last changed it (git's record), and it is stale where zen/ (but its test harness,
zen/testing.py) or csrc/ in the working tree differ from that commit's.
"""
import argparse
import difflib
import json
import os
import re
import statistics
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import sweep  # noqa: E402  (standard library only: the sweep's own median-of-rounds and tables)
from launch import MEASURED_CODE  # noqa: E402  (standard library only: what a results file measures)

FIXED = sweep.FIXED  # the fixed schemes, dense first
SCHEMES = FIXED + ("auto",)
NAMES = {"sparcml": "SparCML", "omnireduce": "OmniReduce", "agsparse": "all-gather"}
LOCAL_PHASES = ("scan", "partition", "aggregate", "encode", "decode", "merge", "sum", "scatter")  # allreduce.py's
TARGET_WORLD = 8  # the hosts the issues' targets are stated at
TARGET_DENSE, TARGET_OMNIREDUCE, TARGET_ROWS = 8.0, 2.0, 1.2  # zen's speedup targets: dense, OmniReduce, rows
TARGET_MAPE, TARGET_AUTO = 0.10, 1.10  # the cost model's targets: MAPE per scheme; auto against the fastest fixed
TARGET_SIM_MAPE = 0.15  # the simulator's target: MAPE per scheme against the measured cells
MISS = 0.20  # a sweep cell predicted further off than this is listed
MARKER = re.compile(r"^<!-- (/?)report:([\w.,#+-]+) -->$")
WIDTH = 110  # README's prose lines


# ---------------------------------------------------------------------------------------------- formatting

def para(*sentences, first="", rest=""):
    """Sentences as README prose: one paragraph (or list item: ``first="- ", rest="  "``) wrapped at WIDTH,
    never inside a `code span` or between a figure and its unit."""
    text = " ".join(sentences)
    text = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\0"), text)
    text = re.sub(r"(?<=\d) (?=(ms|MB|MiB)\b)", "\0", text)  # a figure and its unit on one line
    lines = textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                          break_on_hyphens=False)
    return [line.replace("\0", " ") for line in lines]


def and_join(items):
    """'a', 'a and b', 'a, b and c'."""
    items = [str(x) for x in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def percent(density):
    """0.001 -> '0.1%', 0.1 -> '10%'."""
    return f"{density * 100:.3g}%"


def count(numel):
    """4000000 -> '4M', 13637760 -> '13.6M', 100000 -> '100k'."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if numel >= scale:
            return f"{numel / scale:.3g}{suffix}"
    return str(numel)


def sci(x):
    """Two significant digits, exponent without padding: 9.54e-07 -> '9.5e-7', 5.96e-08 -> '6e-8'."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def link(bandwidth):
    """'100mbit' -> '100 Mbit/s', '1gbit' -> '1 Gbit/s'."""
    m = re.fullmatch(r"([\d.]+)([kmg])bit", bandwidth)
    return f"{m.group(1)} {m.group(2).upper()}bit/s" if m else bandwidth


def bits(bps):
    """125e6 -> '125 Mbit/s'."""
    return f"{bps / 1e9:.3g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.3g} Mbit/s"


def rate(bandwidth):
    m = re.fullmatch(r"([\d.]+)([kmg])bit", bandwidth)
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] if m else float("inf")


def ratio_range(values, digits=2):
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def percent_range(values, digits=0):
    """Fractions as a range of percents: [0.12, 0.51] -> '12-51%'."""
    lo, hi = f"{100 * min(values):.{digits}f}", f"{100 * max(values):.{digits}f}"
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


# ---------------------------------------------------------------------------------------------- results

class Results:
    """The files of one results/ folder, read once each."""

    def __init__(self, folder):
        self.folder = folder
        self._cache = {}
        self.used = set()  # the files read since this was last cleared (a block's)

    def path(self, name):
        self.used.add(name)
        path = os.path.join(self.folder, name)
        if not os.path.exists(path):
            raise SystemExit(f"report: {path} is missing (the page that shows it says which command writes it)")
        return path

    def exists(self, name):
        """Whether results/NAME is there (a block that shows only the files measured so far asks; nothing read)."""
        return os.path.exists(os.path.join(self.folder, name))

    def json(self, stem):
        self.used.add(stem + ".json")  # read before or not, the block that asks was written from it
        if stem not in self._cache:
            with open(self.path(stem + ".json")) as f:
                self._cache[stem] = json.load(f)
        return self._cache[stem]

    def text(self, name):
        with open(self.path(name)) as f:
            return f.read()

    def merged(self, stem):
        """A sweep's rows, one per (cell, scheme): the medians over its rounds, as sweep.py computes them."""
        key = stem + "#merged"
        self.used.add(stem + ".json")
        if key not in self._cache:
            self._cache[key] = sweep.merge_rounds(self.json(stem))
        return self._cache[key]


def _git(*args):
    """git's output in this repository, or None where git or the repository is not at hand."""
    try:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def recorded_version(name):
    """(commit, code_changed) that results/NAME records of the code it measured (benchmarks/allreduce.py's rows:
    launch.code_version), or None where it records none."""
    if not name.endswith(".json"):
        return None
    try:
        with open(os.path.join(ROOT, "results", name)) as f:
            rows = json.load(f)
    except (OSError, ValueError):
        return None
    first = rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else {}
    return (first["commit"], bool(first.get("code_changed"))) if first.get("commit") else None


def measured_version(name):
    """(commit, code_changed) of the code a results file measured: what it records (where it ran from a checkout
    of its own), else the commit that last changed results/NAME (git records it) and False; commit None where
    neither says."""
    recorded = recorded_version(name)
    return recorded or (_git("log", "-1", "--format=%H", "--", f"results/{name}") or None, False)


def stale_files(names):
    """(name, commit) of each of ``names`` whose commit's zen/ and csrc/ differ from the working tree's, or that
    records it ran with changes of its own to them."""
    stale = []
    for name in sorted(names):
        commit, changed = measured_version(name)
        if commit and (changed or _git("diff", "--name-only", commit, "--", *MEASURED_CODE)):
            stale.append((name, commit[:8] + (" with changes" if changed else "")))
    return stale


def stale_mark(names):
    """The line a block gets where any file it was written from was measured on an earlier version."""
    stale = stale_files(names)
    if not stale:
        return []
    files = ", ".join(f"{name} ({commit})" for name, commit in stale)
    return ["", f"*Measured on an earlier version of zen/ or csrc/: {files}.*"]


def error(row):
    return (row["time_predicted"] - row["time_median"]) / row["time_median"]


def auto_ratios(rows):
    """Per cell: auto's measured time over the fastest fixed scheme's (as sweep.accuracy_tables counts them)."""
    ratios = {}
    for key, by in sorted(sweep.cells_of(rows).items()):
        fixed = [by[s]["time_median"] for s in FIXED if s in by]
        if "auto" in by and fixed:
            ratios[key] = by["auto"]["time_median"] / min(fixed)
    return ratios


def auto_within(rows):
    ratios = auto_ratios(rows)
    return sum(r <= TARGET_AUTO for r in ratios.values()), len(ratios)


def phase_lines(rows, scheme):
    """sweep.py's phase table for a scheme, without its title."""
    return sweep.phase_table(rows, scheme).split("\n")[2:]


# ---------------------------------------------------------------------------------------------- blocks

def sweep_accuracy(res):
    rows = res.merged("sweep_accuracy")
    bandwidths = sorted({r["bandwidth"] for r in rows}, key=rate)
    cells = len({sweep.cell_key(r) for r in rows})
    columns = [("MAPE", 6), ("median APE", 12), ("worst APE", 11), ("bias", 7)]
    columns += [(f"MAPE {link(b)}", len(f"MAPE {link(b)}") + 3) for b in bandwidths]
    lines = ["```", f"prediction error per scheme ({cells} cells)",
             f"{'scheme':>10}" + "".join(f"{title:>{width}}" for title, width in columns)]
    for scheme in SCHEMES:
        mine = [r for r in rows if r["scheme"] == scheme]
        if not mine:
            continue
        errors = [error(r) for r in mine]
        absolute = [abs(e) for e in errors]
        values = [f"{statistics.mean(absolute):.1%}", f"{statistics.median(absolute):.1%}",
                  f"{max(absolute):.1%}", f"{statistics.mean(errors):+.1%}"]
        values += [f"{statistics.mean(abs(error(r)) for r in mine if r['bandwidth'] == b):.1%}" for b in bandwidths]
        lines.append(f"{scheme:>10}" + "".join(f"{v:>{width}}" for v, (_, width) in zip(values, columns)))
    within, total = auto_within(rows)
    lines += ["", f"auto within 10% of the fastest fixed scheme in {within} of {total} cells "
              "(every cell: results/sweep_accuracy.txt)", "",
              "sparcml's phases: measured (mean over ranks) / predicted ms, summed over the cells of each world size:"]
    lines += phase_lines(rows, "sparcml") + ["```"]
    return lines


def sweep_heldout(res):
    """MAPE per scheme on the tuning grid beside the held-out grid's (never tuned on: the figure to believe),
    and per held-out cell auto against the fastest fixed scheme."""
    tuning, heldout = res.merged("sweep_accuracy"), res.merged("sweep_heldout")
    cells = {name: len({sweep.cell_key(r) for r in rows}) for name, rows in (("tuning", tuning), ("heldout", heldout))}
    head = [f"tuning MAPE ({cells['tuning']})", f"held-out MAPE ({cells['heldout']})", "held-out worst", "bias"]
    lines = ["```", "prediction error per scheme, cells of the tuning grid and of the held-out grid "
             "(medians of the runs per cell)", f"{'scheme':>10}" + "".join(f"{h:>{len(h) + 3}}" for h in head)]
    for scheme in SCHEMES:
        mine = [r for r in heldout if r["scheme"] == scheme]
        tuned = [abs(error(r)) for r in tuning if r["scheme"] == scheme]
        if not mine:
            continue
        values = [f"{statistics.mean(tuned):.1%}" if tuned else "-", f"{statistics.mean(abs(error(r)) for r in mine):.1%}",
                  f"{max(abs(error(r)) for r in mine):.1%}", f"{statistics.mean(error(r) for r in mine):+.1%}"]
        lines.append(f"{scheme:>10}" + "".join(f"{v:>{len(h) + 3}}" for v, h in zip(values, head)))
    lines += ["", "held-out cells: the fastest fixed scheme and auto (measured medians, ms)",
              f"{'link':>9} {'ranks':>5} {'data':>8} {'dtype':>8} {'numel':>7} {'density':>8} {'fastest':>10} "
              f"{'ms':>8} {'auto ms':>8} {'auto/best':>9}"]
    by_cell = sweep.cells_of(heldout)
    ratios = auto_ratios(heldout)
    for key, ratio in ratios.items():
        bandwidth, world, data, dtype, numel, density = key
        fixed = {s: by_cell[key][s]["time_median"] for s in FIXED if s in by_cell[key]}
        best = min(fixed, key=fixed.get)
        lines.append(f"{link(bandwidth):>9} {world:>5} {data:>8} {dtype:>8} {count(numel):>7} {percent(density):>8} "
                     f"{best:>10} {fixed[best] * 1e3:>8.1f} {by_cell[key]['auto']['time_median'] * 1e3:>8.1f} "
                     f"{ratio:>8.2f}x")
    within = sum(r <= 1.1 for r in ratios.values())
    lines += [f"auto within 1.10x of the fastest fixed scheme in {within} of {len(ratios)} held-out cells", "```"]
    return lines


def sweep_accuracy_runs(res):
    """Each round's own MAPE per scheme, schemes in the order of their MAPE over the medians (worst first)."""
    rows = res.json("sweep_accuracy")
    merged = res.merged("sweep_accuracy")
    cells = len({sweep.cell_key(r) for r in merged})
    order = sorted((s for s in SCHEMES if any(r["scheme"] == s for r in merged)),
                   key=lambda s: -statistics.mean(abs(error(r)) for r in merged if r["scheme"] == s))
    rounds = sorted({r.get("round", 0) for r in rows})
    lines = [f"Each run's MAPE over the {cells} cells:"]
    for i, scheme in enumerate(order):
        mapes = [statistics.mean(abs(error(r)) for r in rows if r["scheme"] == scheme and r.get("round", 0) == k)
                 for k in rounds]
        mapes = [f"{m * 100:.1f}" for m in mapes]
        lines += para(f"{scheme}: {and_join(mapes)}%" + ("." if i == len(order) - 1 else ";"), first="- ", rest="  ")
    return lines


def mapes(rows):
    """{scheme: its MAPE over ``rows``}, for the schemes the rows hold."""
    return {s: statistics.mean(abs(error(r)) for r in rows if r["scheme"] == s)
            for s in SCHEMES if any(r["scheme"] == s for r in rows)}


def sweep_accuracy_targets(res):
    """The tuning grid against the cost model's targets: on the medians per cell, and run by run."""
    rows, merged = res.json("sweep_accuracy"), res.merged("sweep_accuracy")
    mape = mapes(merged)
    within, total = auto_within(merged)
    worst = sorted(mape, key=mape.get, reverse=True)[:2]
    met = max(mape.values()) <= TARGET_MAPE and within == total
    rounds = sorted({r.get("round", 0) for r in rows})
    runs_met = 0
    for k in rounds:
        mine = [r for r in rows if r.get("round", 0) == k]
        runs_met += max(mapes(mine).values()) <= TARGET_MAPE and auto_within(mine)[0] == auto_within(mine)[1]
    return para(f"On the sweep's measure (the median of the {len(rounds)} runs per cell) the target (a MAPE of at most "
                f"{TARGET_MAPE:.0%} per scheme, auto within {TARGET_AUTO - 1:.0%} of the fastest fixed scheme in every "
                f"cell) {'is met' if met else 'is not met'}: the highest MAPEs are "
                + and_join(f"{s}'s ({mape[s]:.1%})" for s in worst)
                + f", and auto is within {TARGET_AUTO - 1:.0%} in {within} of {total} cells (at most "
                f"{max(auto_ratios(merged).values()):.2f}x). Run by run it is met in {runs_met} of {len(rounds)} runs.")


def sweep_misses(stem):
    """The cells of a sweep whose median is predicted more than MISS off, worst first."""
    def block(res):
        off = sorted((r for r in res.merged(stem) if abs(error(r)) > MISS), key=lambda r: -abs(error(r)))
        lines = [f"Cells predicted more than {MISS:.0%} off (`results/{stem}.txt` has every cell and its phases):", "",
                 "| scheme | link | ranks | gradient | measured ms | predicted ms | error |", "|---|---|---|---|---|---|---|"]
        for r in off:
            gradient = f"{r.get('data', 'uniform')}, {count(r['numel'])} {r['dtype']} at {percent(r['density'])}"
            lines.append(f"| {r['scheme']} | {link(r['bandwidth'])} | {r['world']} | {gradient} "
                         f"| {r['time_median'] * 1e3:.1f} | {r['time_predicted'] * 1e3:.1f} | {error(r):+.0%} |")
        return lines if off else [f"No cell is predicted more than {MISS:.0%} off."]
    return block


def sweep_heldout_targets(res):
    heldout = res.merged("sweep_heldout")
    mape = mapes(heldout)
    within, total = auto_within(heldout)
    met = max(mape.values()) <= TARGET_MAPE and within == total
    return para(f"The held-out target (a MAPE of at most {TARGET_MAPE:.0%} per scheme, auto within {TARGET_AUTO:.2f}x "
                f"of the fastest fixed scheme in every cell) {'is met' if met else 'is not met'}: the schemes' MAPEs "
                f"are {percent_range(mape.values(), 1)}, and auto is within {TARGET_AUTO:.2f}x in {within} of {total} "
                "cells.")


MEMORY_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)%\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s*$")


def memory(res):
    """From memory.py's printed table: the range of predicted / measured, and every scheme at 1%."""
    rows = []
    for line in res.text("memory.txt").splitlines():
        m = MEMORY_ROW.match(line)
        if m:
            rows.append(dict(numel=int(m.group(1)), density=float(m.group(2)) / 100, scheme=m.group(3),
                             predicted=float(m.group(4)), measured=float(m.group(5)),
                             ratio=None if m.group(6) == "-" else float(m.group(6))))
    if not rows:
        raise SystemExit("report: results/memory.txt holds no table of memory.py's")
    rated = [r for r in rows if r["ratio"] is not None and r["predicted"] > 0]  # dense: none predicted, in place

    def where(value):
        return ", ".join(f"{r['scheme']} at {percent(r['density'])}" for r in rated if r["ratio"] == value)

    lo, hi = min(r["ratio"] for r in rated), max(r["ratio"] for r in rated)
    densities = sorted({r["density"] for r in rows})
    shown = 0.01 if 0.01 in densities else densities[len(densities) // 2]
    at = [r for r in rows if r["density"] == shown]
    at.sort(key=lambda r: r["predicted"] == r["measured"] == 0)  # the in-place ones last
    parts = [f"{r['scheme']} 0 (in place)" if r["predicted"] == r["measured"] == 0 else
             f"{r['scheme']} {r['predicted']:.2f} vs {r['measured']:.2f}" + (" MiB" if i == 0 else "")
             for i, r in enumerate(at)]
    return para(f"predicted / measured is between {lo:.2f} ({where(lo)}) and {hi:.2f} ({where(hi)}) over every "
                f"scheme and density; e.g. at {percent(shown)}: " + ", ".join(parts) + ".")


def scaling_rows(res):
    rows = res.merged("sweep_scaling")
    return rows, {(r["world"], r["scheme"]): r for r in rows}, sorted({r["world"] for r in rows})


def sweep_scaling(res):
    rows, _, _ = scaling_rows(res)
    bandwidths = sorted({r["bandwidth"] for r in rows}, key=rate)
    if len(bandwidths) != 1:
        raise SystemExit(f"report: results/sweep_scaling.json has {len(bandwidths)} link rates; the README shows one")
    steal = [r["cpu_steal"] for r in rows]
    lines = ["```", "time ms (efficiency = the scheme's own cost-model time / measured); "
             f"CPU steal {min(steal) * 100:.1f}-{max(steal) * 100:.1f}%"]
    lines += [line for line in sweep.scaling_table(rows).split("\n")[1:] if line]
    within, total = auto_within(rows)
    return lines + [f"auto within 10% of the fastest fixed scheme in {within} of {total} cells", "```"]


def sweep_scaling_summary(res):
    rows, by, worlds = scaling_rows(res)
    fastest = [w for w in worlds
               if min((s for s in FIXED if (w, s) in by), key=lambda s: by[(w, s)]["time_median"]) == "zen"]
    zen, dense = by[(TARGET_WORLD, "zen")], by[(TARGET_WORLD, "dense")]
    within, total = auto_within(rows)
    first = (f"zen is the fastest fixed scheme at {and_join(fastest)} ranks." if fastest else
             "zen is the fastest fixed scheme at no world size.")
    versus = [f"{by[(TARGET_WORLD, s)]['time_median'] / zen['time_median']:.2f}x {NAMES[s]}"
              for s in ("sparcml", "omnireduce")]
    contiguous = [by[(w, "zen")]["imbalance_contiguous"] for w in (worlds[0], worlds[-1])]
    auto = "everywhere." if within == total else f"in {within} of {total} world sizes."
    return para(first,
                f"At {TARGET_WORLD} ranks it runs {zen['speedup_vs_dense']:.1f}x dense, {and_join(versus)}, and auto "
                f"is within 10% of the fastest {auto}",
                f"zen sends {dense['bytes_sent'] / zen['bytes_sent']:.0f}x fewer bytes than dense at {TARGET_WORLD} "
                f"ranks ({zen['bytes_sent'] / 1e6:.1f} against {dense['bytes_sent'] / 1e6:.1f} MB per rank; zen's take "
                f"{zen['bytes_sent'] * 8 / rate(zen['bandwidth']) * 1e3:.0f} ms on the {link(zen['bandwidth'])} wire, "
                f"of its {zen['time_median'] * 1e3:.0f} ms).",
                f"Its hash keeps the partitions within {max(r['imbalance_hash'] for r in rows):.2f} of even, where a "
                f"contiguous split is {contiguous[0]:.1f}x off at {worlds[0]} ranks and {contiguous[1]:.1f}x off at "
                f"{worlds[-1]}.")


def sweep_scaling_targets(res):
    _, by, _ = scaling_rows(res)
    zen = by[(TARGET_WORLD, "zen")]
    dense = zen["speedup_vs_dense"]
    omni = by[(TARGET_WORLD, "omnireduce")]["time_median"] / zen["time_median"]
    return [f"Of the issue's targets at {TARGET_WORLD} hosts:",
            f"- {TARGET_DENSE:g}x dense {'holds' if dense >= TARGET_DENSE else 'does not'} ({dense:.1f}x).",
            f"- {TARGET_OMNIREDUCE:g}x OmniReduce {'holds' if omni >= TARGET_OMNIREDUCE else 'does not'} "
            f"({omni:.2f}x).",
            f"- zen's efficiency is {zen['time_predicted'] / zen['time_median']:.0%}, against its cost-model time."]


def sweep_scaling_errors(res):
    rows, _, _ = scaling_rows(res)
    zen = [r for r in rows if r["scheme"] == "zen"]
    low = sum(error(r) < 0 for r in zen)
    numel = sorted({r["numel"] for r in rows})
    return para(f"The prediction errors of this sweep ({statistics.mean(abs(error(r)) for r in zen):.1%} for zen "
                f"over its {len(zen)} cells, {low} of them low; `results/sweep_scaling.txt`) are for a skewed workload "
                f"of {' and '.join(count(n) for n in numel)} elements, outside the accuracy sweep's cells.")


ROWS = ("rows_text64_8x1gbit", "rows_text128_8x1gbit")


def rows_files(res):
    """Per file: its rows by scheme, the embedding width, and the world and link rate of its name."""
    out = []
    for stem in ROWS:
        rows = {r["scheme"]: r for r in res.json(stem)}
        world, bandwidth = re.search(r"_(\d+)x(\w+)$", stem).groups()
        out.append((rows, rows["zen"]["workload"]["row_size"], int(world), bandwidth))
    return out


def rows_table(res):
    files = rows_files(res)
    worlds = {(w, b) for _, _, w, b in files}
    if len(worlds) != 1:
        raise SystemExit("report: the rows files differ in world size or link rate; the README's table shows one")
    (world, bandwidth), = worlds
    dims = [dim for _, dim, _, _ in files]
    lines = ["```", f"sudo python benchmarks/allreduce.py --world {world} --bandwidth {bandwidth} --workload text "
             f"--text-dim {'|'.join(str(d) for d in dims)}",
             f"{'scheme':>10}" + "".join(f"     dim {d} ms  x dense  MB sent" for d in dims)]
    for scheme in FIXED:  # auto's pick is one of them
        if not all(scheme in rows for rows, _, _, _ in files):
            continue
        cells = [f"{rows[scheme]['time_median'] * 1e3:>{len(f'dim {dim} ms') + 5}.2f} "
                 f"{rows[scheme]['speedup_vs_dense']:>7.2f}x {rows[scheme]['bytes_sent'] / 1e6:>8.2f}"
                 for rows, dim, _, _ in files]
        lines.append(f"{scheme:>10}" + "".join(cells))
    phases = [p for p in files[0][0]["zen"]["phases_ms"] if p in LOCAL_PHASES]
    lines += [f"local/copy (zen's {', '.join(phases)} over one copy_): "
              + and_join(f"{rows['zen']['local_vs_copy']:.2f}" for rows, _, _, _ in files), "```"]
    return lines


def rows_summary(res):
    files = rows_files(res)
    dense = [rows["zen"]["speedup_vs_dense"] for rows, _, _, _ in files]
    versus = {s: [rows[s]["time_median"] / rows["zen"]["time_median"] for rows, _, _, _ in files]
              for s in ("sparcml", "agsparse")}
    met = all(min(v) >= TARGET_ROWS for v in versus.values())
    sent, model = [], []
    for i, (rows, dim, world, bandwidth) in enumerate(files):
        load = rows["zen"]["workload"]
        gamma = load["union"] / statistics.mean(load["nnz"])  # the union over a rank's rows
        zen, ag = rows["zen"]["bytes_sent"], rows["agsparse"]["bytes_sent"]
        sent.append(f"{zen / ag:.2f}x at dim {dim} ({zen / 1e6:.2f} against {ag / 1e6:.2f} MB a rank, "
                    f"{(ag - zen) * 8 / rate(bandwidth) * 1e3:.1f} ms at {link(bandwidth)})" if i == 0 else
                    f"{zen / ag:.2f}x at dim {dim} ({zen / 1e6:.2f} against {ag / 1e6:.2f}, "
                    f"{(ag - zen) * 8 / rate(bandwidth) * 1e3:.1f} ms)")
        model.append(f"{(1 + gamma) / world:.2f}x (gamma {gamma:.1f})")
    return para(f"zen is {'over' if min(dense) > TARGET_DENSE else 'not over'} {TARGET_DENSE:g}x dense at "
                f"{'both widths' if len(files) == 2 else 'every width'}.",
                "Against the other sparse schemes, all of which send rows too, it is "
                f"{ratio_range(versus['sparcml'])} SparCML and {ratio_range(versus['agsparse'])} all-gather at these "
                f"cells, {'meeting' if met else 'not'} the {TARGET_ROWS:g}x the rows issue asks.",
                f"zen's bytes over the all-gather's: {and_join(sent)}; the model's (1 + gamma) / n: "
                f"{and_join(dict.fromkeys(model))}.")


def loopback(res):
    bench = res.json("bench_loopback_4")
    zen = sorted((r for r in bench if r["scheme"] == "zen"), key=lambda r: r["density"])
    speedups = [f"{r['speedup_vs_dense']:.2f}x" + (" dense" if i == 0 else "") + f" at {percent(r['density'])}"
                for i, r in enumerate(zen)]
    local = and_join(f"{r['local_vs_copy']:.2f}" for r in zen)
    runs = [res.json(f"sparse_embedding_{w}") for w in (2, 4)]
    args = runs[0]["args"]
    steps = [f"{r['zen hook']['median_ms']:.1f} ms with the hook against {r['plain DDP']['median_ms']:.1f} ms for "
             f"plain DDP at {r['world']} ranks" if i == 0 else
             f"{r['zen hook']['median_ms']:.1f} against {r['plain DDP']['median_ms']:.1f} at {r['world']}"
             for i, r in enumerate(runs)]
    return para(f"On loopback (`make bench`, {zen[0]['world']} ranks, {count(zen[0]['numel'])} uniform elements; "
                f"`results/bench_loopback_4.txt`) zen runs {and_join(speedups)}, its local phases taking "
                f"{local} times a `copy_` of the gradient; DDP with "
                f"`nn.Embedding({args['vocab']}, {args['dim']}, sparse=True)` "
                f"(`python benchmarks/sparse_embedding.py --world {'|'.join(str(r['world']) for r in runs)}`) "
                f"steps in {', '.join(steps)}.")


TRAIN = ("train_lm_4x1gbit", "train_lm_8x1gbit", "train_deepfm_8x1gbit")


def model_name(run):
    info = run["model_info"]
    if run["model"] == "lm":
        return f"LSTM LM, {count(info['vocab'])}-word stdlib vocab, sampled softmax"
    if run["model"] == "deepfm":
        return f"DeepFM, {info['fields']} Zipf fields x {count(info['field_vocab'])}"
    return run["model"]


def train_table(res):
    lines = ["| model | hosts | variant | step ms | compute ms | comm ms | CPU floor ms | samples/s | MB sent/rank "
             "| speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    shown = None
    for stem in TRAIN:
        run = res.json(stem)
        for v in run["variants"]:
            name = model_name(run) if model_name(run) != shown else ""
            shown = model_name(run)
            plain = v["variant"] == "plain"
            cells = [name, run["world"], "plain DDP" if plain else "zen hook", f"{v['step_median_s'] * 1e3:.1f}",
                     f"{v['compute_median_s'] * 1e3:.1f}", f"{v['comm_exposed_s'] * 1e3:.1f}",
                     f"{v['cpu_floor_s'] * 1e3:.1f}", f"{v['samples_per_s']:.0f}", f"{v['bytes_sent_per_rank'] / 1e6:.1f}",
                     "1.00x" if plain else f"**{run['speedup']:.2f}x**"]
            lines.append("|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|")
    return lines


def train_match(res):
    runs = [res.json(stem) for stem in TRAIN]
    parts = []
    for model, label in (("lm", "LM"), ("deepfm", "DeepFM")):
        mine = [r for r in runs if r["model"] == model]
        if not mine:
            continue
        diffs = [sci(r["loss_max_abs_diff"]) for r in mine]
        if len(set(diffs)) == 1:
            text = diffs[0] + (f" at {and_join(r['world'] for r in mine)} hosts" if len(mine) > 1 else "")
        else:
            text = ", ".join(f"{d} at {r['world']} hosts" for d, r in zip(diffs, mine))
        parts.append(f"{label}: " + ("max difference " if not parts else "") + text)
    match = all(r["loss_match"] for r in runs)
    params = sci(max(r["param_max_abs_diff"] for r in runs))
    return para(f"Loss curves {'match' if match else 'do not match'} plain DDP ({'; '.join(parts)}; final "
                f"parameters within {params}; `results/train_*.png`, `results/train_*.json`).")



DENSE = ("dense_gpt_8x1gbit", "dense_gpt_8x1gbit_noclip", "dense_gpt_8x100mbit")
HIERARCHY = ("hierarchy_text128_4x2_1gbit", "hierarchy_text128_4x2_100mbit")
VARIANT_NAMES = {"plain": "plain DDP", "powersgd": "PowerSGD (rank 4)", "zen": "zen top-1%",
                 "zen-global": "zen global top-1%",
                 "zen-mc": "zen top-1%, momentum correction"}


def dense_table(res):
    """benchmarks/dense_model.py's runs: loss, held-out loss and their gap to plain DDP, step time, bytes."""
    lines = ["| hosts, link, steps, clip | variant | train loss (gap) | held-out loss (gap) | step ms | CPU floor ms | speedup "
             "| MB sent/rank/step |", "|---|---|---|---|---|---|---|---|"]
    for stem in DENSE:
        run = res.json(stem)
        clip = run["config"]["clip"]
        where = (f"{run['world']}, {link(run['bandwidth'])}, {run['config']['steps']} steps, "
                 + (f"clip {clip:g}" if clip else "no clip"))
        for i, v in enumerate(run["variants"]):
            cells = [where if i == 0 else "", VARIANT_NAMES.get(v["variant"], v["variant"]),
                     f"{v['final_train_loss']:.3f} ({100 * v['train_gap']:+.1f}%)",
                     f"{v['final_eval_loss']:.3f} ({100 * v['eval_gap']:+.1f}%)", f"{v['step_median_s'] * 1e3:.0f}",
                     f"{v['cpu_floor_s'] * 1e3:.0f}", f"{v['speedup']:.2f}x",
                     f"{v['bytes_per_step_after_warmup'] / 1e6:.2f}"]
            lines.append("|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|")
    return lines


TOPK = ("topk_adamw_2", "topk_adamw_4", "topk_sgd_2", "topk_sgd_4")


def topk_variant(name):
    """'zen/0.1/ramp50' -> 'top-10%, ramp 50'; the plain names as VARIANT_NAMES."""
    base, *options = name.split("/")
    if not options:
        return VARIANT_NAMES.get(name, name)
    ratio = next((float(o) for o in options if o[0].isdigit()), 0.01)
    ramp = next((o[4:] for o in options if o.startswith("ramp")), None)
    return ("zen global" if base == "zen-global" else "zen") + f" top-{percent(ratio)}" + (f", ramp {ramp}" if ramp else "")


def topk_table(res):
    """benchmarks/dense_model.py, 200 steps on loopback: each top-k setting's final losses against plain DDP's."""
    lines = ["| optimizer, ranks | variant | train loss (gap) | held-out loss (gap) | MB sent/rank/step |",
             "|---|---|---|---|---|"]
    for stem in TOPK:
        run = res.json(stem)
        where = f"{run['config']['optimizer']} (lr {run['config']['lr']:g}), {run['world']}"
        for i, v in enumerate(run["variants"]):
            cells = [where if i == 0 else "", topk_variant(v["variant"]),
                     f"{v['final_train_loss']:.3f} ({100 * v['train_gap']:+.1f}%)",
                     f"{v['final_eval_loss']:.3f} ({100 * v['eval_gap']:+.1f}%)",
                     f"{v['bytes_per_step_after_warmup'] / 1e6:.2f}"]
            lines.append("|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|")
    return lines


OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD"}


def topk_summary(res):
    """Per optimizer: each top-k setting's final training loss against plain DDP's, and how many times fewer bytes
    it sends, over the world sizes."""
    runs = [res.json(stem) for stem in TOPK]
    first = runs[0]
    lines = [f"Final training loss against plain DDP's, and bytes per step, over {first['config']['steps']} steps "
             f"at {and_join(sorted({r['world'] for r in runs}))} ranks:"]
    for optimizer in dict.fromkeys(r["config"]["optimizer"] for r in runs):
        mine = [r for r in runs if r["config"]["optimizer"] == optimizer]
        parts = []
        for name in dict.fromkeys(v["variant"] for r in mine for v in r["variants"] if v["variant"] != "plain"):
            gaps, fewer = [], []
            for r in mine:
                plain = next(v for v in r["variants"] if v["variant"] == "plain")
                for v in r["variants"]:
                    if v["variant"] == name:
                        gaps.append(v["train_gap"])
                        fewer.append(plain["bytes_per_step_after_warmup"] / v["bytes_per_step_after_warmup"])
            lo, hi = f"{100 * min(gaps):+.1f}", f"{100 * max(gaps):+.1f}"
            parts.append(f"{topk_variant(name).removeprefix('zen ')} {lo if lo == hi else f'{lo} to {hi}'}% "
                         f"({ratio_range(fewer, 1)} fewer bytes)")
        lines += para(f"{OPTIMIZERS.get(optimizer, optimizer)}: " + "; ".join(parts) + ".", first="- ", rest="  ")
    return lines


def hierarchy_table(res):
    """4 emulated hosts x 2 ranks: every protocol's measured and predicted time, its speed against flat zen,
    and the bytes a host's network card sent, against the target (at most 1.2 x flat zen's / G)."""
    lines = ["| link between hosts | protocol | measured ms | predicted ms | x flat zen | MB a host sent | "
             "x (flat zen's / G) |", "|---|---|---|---|---|---|---|"]
    names = {"dense": "dense, flat", "zen": "zen, flat", "zen@node": "zen, node", "dense@node": "dense, node"}
    for stem in HIERARCHY:
        rows = {r["scheme"]: r for r in res.json(stem)}
        flat = rows["zen"]
        per_host = flat["host_tx_bytes"] / flat["ranks_per_host"]
        for i, (scheme, r) in enumerate(rows.items()):
            cells = [link(stem.rsplit("_", 1)[1]) if i == 0 else "", names.get(scheme, scheme),
                     f"{r['time_median'] * 1e3:.1f}", f"{r['time_predicted'] * 1e3:.1f}",
                     f"{flat['time_median'] / r['time_median']:.2f}x", f"{r['host_tx_bytes'] / 1e6:.2f}",
                     f"{r['host_tx_bytes'] / per_host:.2f}"]
            lines.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    return lines


def kernels_cpu(res):
    """benchmarks/kernels.py's medians, as a table."""
    run = res.json("kernels_cpu")
    lines = ["| kernel | what it runs on | ms |", "|---|---|---|"]
    lines += [f"| {k['kernel']} | {k['what']} | {k['ms']:.1f} |" for k in run["kernels"]]
    return lines


def planner_example(res):
    """The planner's command and what it printed (make results), as a code block."""
    return ["```"] + res.text("planner_example.txt").rstrip("\n").split("\n") + ["```"]


def auto_cost(res):
    """train.py --scheme auto: what auto spent choosing, against the whole run."""
    run = res.json("train_lm_2_auto")
    plain, hooked = run["variants"]
    return para(f"`python benchmarks/train.py --model lm --world {run['world']} --steps {run['steps']} --scheme "
                f"auto` ({run['world']} local ranks, {run['params'] / 1e6:.1f}M parameters in "
                f"{len(run['ddp_bucket_numels'])} buckets, {run['warmup'] + run['steps']} steps): auto spent "
                f"{run['auto_s']:.2f} s choosing ({run['auto_trials']} trial calls), "
                f"{100 * run['auto_s'] / run['zen_run_s']:.1f}% of the run's {run['zen_run_s']:.1f} s; its median "
                f"step {1e3 * hooked['step_median_s']:.1f} ms against plain DDP's {1e3 * plain['step_median_s']:.1f} "
                f"ms.")


def auto_probed(res):
    """The same run at a commit where auto probed the group on its first call, as Auto(probe=True) does."""
    run = res.json("train_lm_2_auto_probed")
    return para(f"The same run with auto probing the group's links on its first call, as `Auto(probe=True)` does "
                f"(`results/train_lm_2_auto_probed.txt`): auto spent {run['auto_s']:.1f} s choosing "
                f"({run['auto_trials']} trial calls), {100 * run['auto_s'] / run['zen_run_s']:.0f}% of the run's "
                f"{run['zen_run_s']:.1f} s.")


def faults(res):
    """benchmarks/faults.py's timings: what the survivors raised, and when."""
    run = res.json("faults")
    rec, t = run["records"], run["timeout"]

    def seconds(rank, key):
        return rec[rank][key][3]

    stalled = rec[2]["stalled_b"]
    part_way = seconds(2, "dies_during") - max(0.0, rec[2]["dies_during_waited_for_peer"])
    return para(f"**Dead peers** (`python benchmarks/faults.py`: 4 local ranks, a {t:g} s timeout): a peer that "
                f"dies during DDP's backward makes `loss.backward()` raise `{rec[0]['ddp'][0]}` on the survivor in "
                f"{seconds(0, 'ddp'):.2f} s; a peer dead before the call: {seconds(0, 'dead_before'):.3f} s, "
                f"and the next call on that group raises `{rec[0]['after_broken'][0]}` in "
                f"{seconds(0, 'after_broken'):.3f} s; a stalled peer: {stalled[0][3]:.2f} s under zen's timeout "
                f"and {seconds(2, 'stalled_c'):.2f} s under the group's own, the calls queued behind it "
                f"{1e3 * (stalled[-1][3] - stalled[0][3]):.0f} ms later; `Work.wait(timeout=1)` raises "
                f"`{rec[2]['wait_timeout'][0]}` at {seconds(2, 'wait_timeout'):.3f} s; a peer that dies part-way "
                f"through a call: {part_way:.2f} s after its death.", first="- ", rest="  ")


def soak(res):
    """benchmarks/soak.py's totals and memory slopes."""
    run = res.json("soak")
    slopes = [r["slope_mib_per_1000_calls"] for r in run["ranks"]]
    errors = sum(r["errors"] for r in run["ranks"])
    n, calls = run["world"], run["calls_per_rank"]
    return para(f"**Soak** (`python benchmarks/soak.py --calls {calls}`): {n} ranks, {calls:,} calls each "
                f"({n * calls:,} results), every scheme and the hook, changing sizes, sparsity, dtypes and "
                f"layouts, in {run['seconds'] / 60:.0f} minutes: {run['wrong']} wrong, {errors} errors; resident "
                f"memory after warm-up {min(slopes):+.1f} to {max(slopes):+.1f} MiB per 1,000 calls across ranks.",
                first="- ", rest="  ")


def sanitize(res):
    """benchmarks/sanitize.sh's outcome, with the date and commit it ran on."""
    text = res.text("sanitize.txt")
    date, commit = (re.search(rf"^{key}: (\S+)", text, re.M).group(1) for key in ("date", "commit"))
    summary = re.findall(r"^=*\s*(\d+ passed[^=]*?)\s*=*$", text, re.M)
    if not summary:
        raise SystemExit("report: results/sanitize.txt holds no pytest summary")
    reports = "no reports" if "ERROR: AddressSanitizer" not in text and "runtime error:" not in text else "REPORTS"
    return para(f"**Sanitizers** (`make sanitize`: AddressSanitizer + UndefinedBehaviorSanitizer build of the CPU "
                f"kernels, then tests/test_kernels.py and tests/test_fuzz.py under it; results/sanitize.txt): "
                f"{summary[-1]}, {reports}, on {date} at commit {commit}. Not in CI: the instrumented build alone "
                f"takes most of half an hour on 2 cores.", first="- ", rest="  ")


HOOK = ("hook_overhead_2", "hook_overhead_4")
MODEL_NAMES = {"mlp": "MLP 4 x 512", "transformer": "transformer LM", "mixed": "embedding + LM",
               "mixed-sparse": "embedding (sparse=True) + LM"}


def hook_overhead(res):
    """benchmarks/hook_overhead.py at each world size: the hook's step and bytes against plain DDP's."""
    lines = ["| model | ranks | plain DDP | torch's Python `allreduce_hook` | `ZenState()` "
             "| `ZenState(scheme=\"dense\")` | bytes, `ZenState()` | parameters against plain DDP |",
             "|---|---|---|---|---|---|---|---|"]
    for stem in HOOK:
        run = res.json(stem)
        for model, r in run["results"].items():
            plain = r["plain"]
            equal = "equal" if all(v["max_param_diff"] == 0 for v in r.values()) else (
                "max diff " + sci(max(v["max_param_diff"] for v in r.values())))
            lines.append(f"| {MODEL_NAMES.get(model, model)} | {run['world']} | {plain['median_ms']:.1f} ms "
                         f"| {r['torch-hook']['median_ms'] / plain['median_ms']:.2f}x "
                         f"| {r['zen']['median_ms'] / plain['median_ms']:.2f}x "
                         f"| {r['zen-dense']['median_ms'] / plain['median_ms']:.2f}x "
                         f"| {r['zen']['bytes_per_step'] / plain['bytes_per_step']:.2f}x | {equal} |")
    return lines


SCALE = ("scale16_direct", "scale16_ring", "scale16_bruck")


def scale_table(res):
    """benchmarks/allreduce.py at 16 emulated hosts with per-core links, once per forced schedule: every
    scheme's time, bytes, the wire's floor for them and zen's two exchanges."""
    lines = ["| schedule | scheme | time ms | vs dense | MB sent/rank | floor ms | efficiency | zen: agree + push, pull ms |",
             "|---|---|---|---|---|---|---|---|"]
    for stem in SCALE:
        schedule = stem.rsplit("_", 1)[1]
        for row in res.json(stem):
            phases = row["phases_ms"]
            zen = (f"{phases['agree'] + phases.get('push', 0):.0f}, {phases['pull']:.0f}"
                   if row["scheme"] == "zen" else "")
            lines.append(f"| {schedule} | {NAMES.get(row['scheme'], row['scheme'])} | {row['time_median'] * 1e3:.0f} "
                         f"| {row['speedup_vs_dense']:.1f}x | {row['bytes_sent'] / 1e6:.2f} "
                         f"| {row['floor_s'] * 1e3:.0f} | {row['floor_s'] / row['time_median']:.0%} | {zen} |")
    return lines


WEAK = tuple(f"weak_text64_{n}" for n in (2, 4, 8, 16, 24))
WEAK32 = tuple(f"weak_text32_{n}" for n in (2, 4, 8, 16, 24, 32))
# Series measured as they come (benchmarks/README.md's weak-scaling workloads beside the text gradient): a block
# shows the world sizes whose file exists, and says which are not measured yet.
WEAK_TOPK = tuple(f"weak_topk_{n}" for n in (2, 4, 8, 16, 24, 32))
WEAK_DEEPFM = tuple(f"weak_deepfm_{n}" for n in (2, 4, 8, 16, 24, 32))
SCHEME_ORDER = ("dense", "agsparse", "sparcml", "omnireduce", "zen")


def weak_table(stems, sent=False, partial=False):
    """benchmarks/allreduce.py on emulated hosts with per-core links (the same workload per rank), one file per
    world size: every scheme's time, with ``sent`` its MB sent per rank, and its efficiency (the wire's floor
    for its own bytes / time). ``partial``: a series still being measured, its rows from the files that exist
    (none: the block says it is not measured yet; some: it names the world sizes still missing)."""
    def table(res):
        shown = [stem for stem in stems if res.exists(stem + ".json")] if partial else stems
        missing = [stem.rsplit("_", 1)[1] for stem in stems if stem not in shown]
        if not shown:
            return [f"*Not measured yet: no `results/{stems[0].rsplit('_', 1)[0]}_N.json` (the command above "
                    "writes them).*"]
        lines = ["| ranks | link | " + " | ".join(NAMES.get(s, s) for s in SCHEME_ORDER) + " | zen vs best other |",
                 "|---" * (3 + len(SCHEME_ORDER)) + "|"]
        for stem in shown:
            rows = {row["scheme"]: row for row in res.json(stem)}
            any_row = next(iter(rows.values()))
            cells = [f"{r['time_median'] * 1e3:.0f} ms" + (f", {r['bytes_sent'] / 1e6:.2f} MB" if sent else "")
                     + f" ({r['floor_s'] / r['time_median']:.0%})" if (r := rows.get(s)) else "-" for s in SCHEME_ORDER]
            best = min(r["time_median"] for s, r in rows.items() if s != "zen")
            lines.append(f"| {any_row['world']} | {bits(any_row['link_bps'])} | " + " | ".join(cells)
                         + f" | {best / rows['zen']['time_median']:.2f}x |")
        return lines + (["", f"*Not measured yet at {and_join(missing)} ranks.*"] if missing else [])
    return table


def scale_summary(res):
    """The direct schedule at 16 ranks: zen's bytes and time against SparCML's, and where the time goes."""
    rows = {r["scheme"]: r for r in res.json(SCALE[0])}
    zen, sparcml = rows["zen"], rows["sparcml"]
    fewest = min(rows, key=lambda s: rows[s]["bytes_sent"]) == "zen"
    pz, ps = zen["phases_ms"], sparcml["phases_ms"]
    agree = pz["agree"] + pz.get("push", 0)
    return para(f"With every message posted at once (direct) zen sends {'the fewest' if fewest else 'not the fewest'} "
                f"bytes ({zen['bytes_sent'] / 1e6:.2f} MB a rank against SparCML's {sparcml['bytes_sent'] / 1e6:.2f}) "
                f"and takes {zen['time_median'] / sparcml['time_median']:.2f}x SparCML's time: its pull takes "
                f"{pz['pull']:.0f} ms against SparCML's exchange's {ps['exchange']:.0f}, its agreement with the push "
                f"{agree:.0f} ms against SparCML's agreement's {ps['agree']:.0f}.")


def weak_summary(stems):
    """The weak-scaling cells: efficiencies, bytes, where zen's time goes against SparCML's, and where it is fastest."""
    return lambda res: _weak_summary(res, stems)


def _weak_summary(res, stems):
    runs = [{row["scheme"]: row for row in res.json(stem)} for stem in stems]
    worlds = [next(iter(rows.values()))["world"] for rows in runs]

    def efficiency(r):
        return r["floor_s"] / r["time_median"]

    dense = [efficiency(rows["dense"]) for rows in runs]
    sparse = [r for rows in runs for s, r in rows.items() if s != "dense"]
    last_two = list(zip(worlds, runs))[-2:]
    phases = [f"{rows['zen']['phases_ms']['agree'] + rows['zen']['phases_ms'].get('push', 0):.0f}"
              + (f" ms at {w} ranks against SparCML's " if i == 0 else f" at {w} against ")
              + f"{rows['sparcml']['phases_ms']['agree']:.0f}" for i, (w, rows) in enumerate(last_two)]
    pulls = [f"{rows['zen']['phases_ms']['pull']:.0f}"
             + (" ms against SparCML's exchange's " if i == 0 else " against ")
             + f"{rows['sparcml']['phases_ms']['exchange']:.0f}" + (f" at {w} ranks" if i == 0 else f" at {w}")
             for i, (w, rows) in enumerate(last_two)]
    behind = [(w, rows["zen"]["time_median"] / min(r["time_median"] for r in rows.values()))
              for w, rows in zip(worlds, runs)]
    fastest = [w for w, x in behind if x <= 1]
    slower = [f"{x:.2f}x the fastest's time at {w} ranks" if i == 0 else f"{x:.2f}x at {w}"
              for i, (w, x) in enumerate((w, x) for w, x in behind if x > 1)]
    last = (f"zen is the fastest scheme at {and_join(fastest)} ranks" if fastest else
            "zen is the fastest scheme at no size") + (f"; elsewhere it takes {and_join(slower)}." if slower else ".")
    return para(f"Dense runs at {percent_range(dense)} of its floor, the sparse schemes at "
                f"{percent_range([efficiency(r) for r in sparse])} of theirs, sending "
                f"{min(r['bytes_sent'] for r in sparse) / 1e6:.1f}-{max(r['bytes_sent'] for r in sparse) / 1e6:.1f} MB "
                f"a rank. zen's agreement, which carries its push, takes {and_join(phases)}; its pull "
                f"{and_join(pulls)}.", last)


SIMULATED = ("simulate_text64", "simulate_text64_10gbit")


def simulated_table(res):
    """benchmarks/simulate.py: its validation against the measured cells, then every scheme simulated to 1024
    ranks, under the emulation's rule and on a datacenter's links."""
    checked = res.json(SIMULATED[0])
    lines = ["| ranks | scheme | measured ms | simulated ms | error |", "|---|---|---|---|---|"]
    for c in checked["validation"]:
        lines.append(f"| {c['world']} | {NAMES.get(c['scheme'], c['scheme'])} | {c['measured_s'] * 1e3:.1f} "
                     f"| {c['simulated_s'] * 1e3:.1f} | {100 * c['error']:+.0f}% |")
    lines += ["", "MAPE per scheme: " + ", ".join(f"{NAMES.get(s, s)} {m:.0f}%" for s, m in checked["mape"].items())]
    for stem in SIMULATED:
        run = res.json(stem)
        words = run["command"].split()
        shown = [w for i, w in enumerate(words) if not (w.startswith("results/") or words[i - 1] in ("--json", "--plot")
                                                       or w in ("--json", "--plot", "--validate"))]
        lines += ["", f"`python {' '.join(shown)}`", "",
                  "| ranks | link | gamma | " + " | ".join(f"{NAMES.get(s, s)} ms" for s in SCHEME_ORDER)
                  + " | zen vs best other |", "|---" * (4 + len(SCHEME_ORDER)) + "|"]
        for row in run["rows"]:
            t = row["times"]
            best = min(v for s, v in t.items() if s != "zen")
            lines.append(f"| {row['world']} | {bits(row['link_Bps'] * 8)} | {row['gamma']:.1f} | "
                         + " | ".join(f"{t[s] * 1e3:.1f}" for s in SCHEME_ORDER) + f" | {best / t['zen']:.2f}x |")
    return lines


def probed_simulation(res):
    """benchmarks/simulate.py --probed: every scheme simulated on the pieces probed at some world sizes, against
    the measured cells, and the MAPE over all of them and over the world sizes held out (not probed)."""
    run = res.json("simulate_text32")
    times = {(c["world"], c["scheme"]): c for c in run["validation"]}
    worlds = sorted({w for w, _ in times})
    lines = ["| ranks | " + " | ".join(f"{NAMES.get(s, s)} measured / simulated ms" for s in SCHEME_ORDER) + " |",
             "|---" * (1 + len(SCHEME_ORDER)) + "|"]
    for w in worlds:
        held = any(c["held_out"] for (cw, _), c in times.items() if cw == w)
        lines.append(f"| {w}{' (held out)' if held else ''} | " + " | ".join(
            f"{c['measured_s'] * 1e3:.0f} / {c['simulated_s'] * 1e3:.0f} ({100 * c['error']:+.0f}%)"
            if (c := times.get((w, s))) else "-" for s in SCHEME_ORDER) + " |")
    missing = [NAMES.get(s, s) for s, m in run["mape"].items() if m > 100 * TARGET_SIM_MAPE]
    held = [NAMES.get(s, s) for s, m in run["mape_held_out"].items() if m > 100 * TARGET_SIM_MAPE]

    def mapes(table):
        return ", ".join(f"{NAMES.get(s, s)} {m:.1f}%" for s, m in table.items())

    held_worlds = and_join(sorted({c["world"] for c in run["validation"] if c["held_out"]}))
    return lines + [""] + para(
        f"MAPE per scheme over every cell: {mapes(run['mape'])}; over the held-out cells ({held_worlds} ranks): "
        f"{mapes(run['mape_held_out'])}.",
        (f"The {TARGET_SIM_MAPE:.0%} MAPE target is met for every scheme over every cell" if not missing else
         f"The {TARGET_SIM_MAPE:.0%} MAPE target is missed for {and_join(missing)} over every cell")
        + (f"; over the held-out cells it is missed for {and_join(held)}." if held else
           ", and over the held-out cells too."))


def simulated_summary(res):
    """The simulator against the measured cells, and where zen leads on the faster links."""
    checked = res.json(SIMULATED[0])
    mape = checked["mape"]
    sparse = [c["error"] for c in checked["validation"] if c["scheme"] != "dense"]
    least = min((s for s in mape if s != "dense"), key=mape.get)
    missing = [NAMES.get(s, s) for s, m in mape.items() if m > 100 * TARGET_SIM_MAPE]
    first = (f"The simulator gets dense to {mape['dense']:.0f}% (MAPE) and "
             + (f"under-predicts every sparse scheme, by {percent_range([-e for e in sparse])}" if max(sparse) < 0 else
                f"errs on the sparse schemes by {min(sparse):+.0%} to {max(sparse):+.0%}")
             + f" ({NAMES.get(least, least)} the least); it "
             + (f"misses the {TARGET_SIM_MAPE:.0%} MAPE target for {and_join(missing)}." if missing else
                f"meets the {TARGET_SIM_MAPE:.0%} MAPE target for every scheme."))
    rows = res.json(SIMULATED[1])["rows"]
    leads = [(row["world"], min(v for s, v in row["times"].items() if s != "zen") / row["times"]["zen"]) for row in rows]
    start = next((i for i in range(len(leads)) if all(x > 1 for _, x in leads[i:])), None)
    wire = bits(rows[0]["link_Bps"] * 8)
    if start is None:
        return para(first, f"On {wire} links zen is not ahead of every other scheme at {leads[-1][0]} ranks.")
    ahead = leads[start:]
    top = max(ahead, key=lambda wx: wx[1])
    end = rows[-1]
    return para(first, f"On {wire} links zen is ahead of every other scheme from {ahead[0][0]} ranks to {ahead[-1][0]}, by "
                f"{percent_range([x - 1 for _, x in ahead])}, most at {top[0]} ranks; at {end['world']} ranks its hash "
                f"partitions of the union are {end['hash_imbalance']:.1f}x uneven (about "
                f"{end['gamma'] * end['nnz_rows'] / end['world']:.0f} rows per partition).")


BLOCKS = {
    ",".join(SCALE): scale_table,
    ",".join(WEAK): weak_table(WEAK),
    ",".join(WEAK32): weak_table(WEAK32, sent=True),
    ",".join(WEAK32) + "#summary": weak_summary(WEAK32),
    ",".join(WEAK_TOPK): weak_table(WEAK_TOPK, sent=True, partial=True),
    ",".join(WEAK_DEEPFM): weak_table(WEAK_DEEPFM, sent=True, partial=True),
    "simulate_text32": probed_simulation,
    ",".join(SIMULATED): simulated_table,
    ",".join(HOOK): hook_overhead,
    "scale16_direct#summary": scale_summary,
    ",".join(WEAK) + "#summary": weak_summary(WEAK),
    ",".join(SIMULATED) + "#summary": simulated_summary,
    ",".join(TOPK): topk_table,
    ",".join(TOPK) + "#summary": topk_summary,
    "sweep_accuracy": sweep_accuracy,
    "sweep_accuracy#targets": sweep_accuracy_targets,
    "sweep_accuracy#runs": sweep_accuracy_runs,
    "sweep_accuracy#misses": sweep_misses("sweep_accuracy"),
    "sweep_accuracy,sweep_heldout": sweep_heldout,
    "sweep_heldout#targets": sweep_heldout_targets,
    "sweep_heldout#misses": sweep_misses("sweep_heldout"),
    "memory": memory,
    "sweep_scaling": sweep_scaling,
    "sweep_scaling#summary": sweep_scaling_summary,
    "sweep_scaling#targets": sweep_scaling_targets,
    "sweep_scaling#errors": sweep_scaling_errors,
    ",".join(ROWS): rows_table,
    ",".join(ROWS) + "#summary": rows_summary,
    "bench_loopback_4,sparse_embedding_2,sparse_embedding_4": loopback,
    ",".join(TRAIN): train_table,
    ",".join(TRAIN) + "#match": train_match,
    ",".join(DENSE): dense_table,
    "kernels_cpu": kernels_cpu,
    "planner_example": planner_example,
    ",".join(HIERARCHY): hierarchy_table,
    "train_lm_2_auto": auto_cost,
    "train_lm_2_auto_probed": auto_probed,
    "faults": faults,
    "soak": soak,
    "sanitize": sanitize,
}


# ---------------------------------------------------------------------------------------------- README

def render(pages, results):
    """{page: text} with every block of every page rewritten from ``results`` (a folder); each block appears
    in exactly one page."""
    res = Results(results)
    seen, out = set(), {}
    for page, text in pages.items():
        out[page] = _render_page(page, text, res, seen)
    missing = [name for name in BLOCKS if name not in seen]
    if missing:
        raise SystemExit(f"report: no page has markers for {', '.join(missing)}")
    return out


def _render_page(page, text, res, seen):
    lines = text.split("\n")
    out, open_name = [], None
    for number, line in enumerate(lines, 1):
        m = MARKER.match(line.strip())
        if m is None:
            if open_name is None:
                out.append(line)
            continue
        closing, name = m.group(1) == "/", m.group(2)
        if not closing:
            if open_name is not None:
                raise SystemExit(f"report: {page}:{number}: block {name} opens inside block {open_name}")
            if name not in BLOCKS:
                raise SystemExit(f"report: {page}:{number}: no block named {name} (known: {', '.join(BLOCKS)})")
            if name in seen:
                raise SystemExit(f"report: {page}:{number}: block {name} appears twice")
            seen.add(name)
            open_name = name
            out.append(line)
            res.used = set()
            out += BLOCKS[name](res)
            out += stale_mark(res.used)
        else:
            if name != open_name:
                raise SystemExit(f"report: {page}:{number}: closes block {name}, but {open_name} is open")
            open_name = None
            out.append(line)
    if open_name is not None:
        raise SystemExit(f"report: {page}: block {open_name} is never closed")
    return "\n".join(out)


DOCS = ("README.md", os.path.join("benchmarks", "README.md"), os.path.join("docs", "cost_model.md"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing: exit 1 with a diff if a page would change")
    p.add_argument("--root", default=ROOT, help="the folder whose pages (README.md, benchmarks/README.md, "
                                                "docs/cost_model.md) hold the blocks")
    p.add_argument("--results", default=os.path.join(ROOT, "results"))
    args = p.parse_args(argv)
    pages = {}
    for page in DOCS:
        with open(os.path.join(args.root, page)) as f:
            pages[page] = f.read()
    new = render(pages, args.results)
    changed = [page for page in DOCS if new[page] != pages[page]]
    if not changed:
        return 0
    if args.check:
        for page in changed:
            sys.stdout.writelines(difflib.unified_diff(pages[page].splitlines(True), new[page].splitlines(True),
                                                       page, f"{page} as report.py writes it"))
        print(f"\nreport: {', '.join(changed)} differ from what results/ gives: run python benchmarks/report.py",
              file=sys.stderr)
        return 1
    for page in changed:
        with open(os.path.join(args.root, page), "w") as f:
            f.write(new[page])
        print(f"report: rewrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
