#!/usr/bin/env python3
"""Every scheme from 2 to 1024 ranks, simulated: the cost model's formulas (``zen.cost``, each scheme's own, with
the schedules ``zen.schedules`` picks at each world size) on workloads drawn from the corpus, exact at every
world size, and checked against measured cells.

    python benchmarks/simulate.py --worlds 2,4,8,16,32,64,128,256,512,1024 --bandwidth 10gbit --latency 20us
    python benchmarks/simulate.py --bandwidth-per-core 1gbit --cores 2 --text-dim 64 \\
        --validate results/scale16_direct.json results/weak_text64_*.json --json results/simulate_text64.json

Workload: the text workload of ``benchmarks/allreduce.py`` (an embedding table [vocab, dim], each rank's batch
``--text-batch`` tokens in windows of the corpus, step 0), reduced as rows, as ``zen.predict`` measures it.
Its statistics (non-zeros per rank, the union, the hash partition's loads, OmniReduce's block loads,
SparCML's running unions) are counted exactly from n ranks' drawn batches at every n
(``zen.planner.workload_from_indices``): no growth curve is fitted or extrapolated.

Machine: a link rate and a per-message latency per rank (``zen.set_profile``'s profile, local kernel speeds
at the profile's defaults). ``--bandwidth-per-core R`` gives each rank R x cores / n, the emulated cluster's
rule (``benchmarks/cluster.py --bandwidth-per-core``). ``--cores C``: the n ranks share C cores (the emulation on
one machine), so every local kernel runs max(1, n / C) times slower. Nothing is fitted to measured cells.

Probed pieces (``--probed`` files of ``benchmarks/allreduce.py --json`` run without ``--no-predict``: each row
carries the profile ``zen.probe_profile`` measured on the cluster before the timed calls, from tiny calls, rate
slopes and calibration calls of its own, never from the timed ones): in place of the latency model and the
default local speeds, the simulator uses, at world n, the probed fixed costs per primitive, the local kernel
times (probed with every rank running at once, so with the cores' sharing in them), the calibration misses, and
the links' efficiency (probed rate / link rate, applied to the simulated link). Between probed world sizes each
of these is linear in n; beyond them, it follows the nearest two probed sizes' line (clamped at 0): the ranks'
fixed costs on shared cores grow with n / cores. A world size that is validated but not probed is held out.

Validation (``--validate`` files of ``benchmarks/allreduce.py --json`` with ``--workload text``): each measured
row is simulated at its world size, link rate and dim, and compared: error = (simulated - measured) / measured;
MAPE = the mean of |error| per scheme.
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads  # noqa: E402
from zen.cost import Profile  # noqa: E402
from zen.measurement.store import make_profile, parse_rate  # noqa: E402
from zen.planner import workload_from_indices  # noqa: E402
from zen.prediction import predict_times  # noqa: E402

SCHEMES = ("dense", "agsparse", "sparcml", "omnireduce", "zen")
LOCAL_SPEEDS = ("element_time", "write_time", "found_time", "merge_time", "merge2_time", "encode_time",
                "decode_time")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--worlds", default="2,4,8,16,32,64,128,256,512,1024", help="comma-separated world sizes")
    p.add_argument("--text-dim", type=int, default=64, help="embedding dim of the text workload")
    p.add_argument("--text-batch", type=int, default=2048, help="tokens per rank of the text workload")
    p.add_argument("--seed", type=int, default=0, help="the batches' seed (benchmarks/allreduce.py's --seed)")
    link = p.add_mutually_exclusive_group()
    link.add_argument("--bandwidth", default=None, help="link rate per rank, e.g. 10gbit")
    link.add_argument("--bandwidth-per-core", default=None,
                      help="per core of --cores: each rank gets rate x cores / n (the emulated cluster's rule)")
    p.add_argument("--latency", default="50us", help="per message")
    p.add_argument("--cores", type=int, default=None,
                   help="ranks share this many cores (local kernels max(1, n / cores) times slower); default: "
                        "dedicated cores, or this machine's count with --bandwidth-per-core")
    p.add_argument("--probed", nargs="*", default=[],
                   help="profiles probed at some world sizes (benchmarks/allreduce.py --json without --no-predict)")
    p.add_argument("--validate", nargs="*", default=[], help="measured JSON files (benchmarks/allreduce.py --json)")
    p.add_argument("--json", default=None, help="write the simulated and validated rows here")
    p.add_argument("--plot", default=None, help="write a PNG here: time against ranks, simulated and measured")
    return p


def _line(points, n: float, floor=None) -> float:
    """The value at n of the piecewise-linear line through ``points`` ((n, value), sorted, at least one),
    its end segments extended, not below ``floor`` (None: unbounded)."""
    if len(points) == 1:
        return points[0][1]
    i = next((k for k in range(1, len(points) - 1) if n <= points[k][0]), len(points) - 1)
    (n0, v0), (n1, v1) = points[i - 1], points[i]
    value = v0 + (v1 - v0) * (n - n0) / (n1 - n0)
    return value if floor is None else max(floor, value)


class Probed:
    """Profiles probed at some world sizes, each with the link rate (bytes/s) it was probed at; :meth:`at` gives
    a world size's profile, every field on its line through the probed ones (see the module docstring)."""

    def __init__(self, paths):
        self.profiles = {}  # world -> (Profile, link bytes/s)
        for path in paths:
            with open(path) as f:
                for row in json.load(f):
                    if row.get("profile") and row.get("link_bps"):
                        fields = {k: tuple(map(tuple, v)) if isinstance(v, list) else v
                                  for k, v in row["profile"].items()}
                        self.profiles[row["world"]] = (Profile(**fields), row["link_bps"] / 8)
        if not self.profiles:
            raise ValueError(f"--probed: no row with a profile and a link rate in {', '.join(paths)}")
        self.worlds = sorted(self.profiles)

    def _field(self, n: int, value, floor=0.0):
        """``value(profile, link)`` at n, on its line through the probed worlds where it is not None (None
        where it is None at all of them)."""
        points = [(w, v) for w in self.worlds if (v := value(*self.profiles[w])) is not None]
        return _line(points, n, floor) if points else None

    def _table(self, n: int, name: str, per_link=False, floor=0.0) -> tuple:
        """The Profile's table ``name`` at n, entry by entry (``per_link``: a rate, as the link's rate over it)."""
        keys = dict.fromkeys(k for p, _ in self.profiles.values() for k, _ in getattr(p, name))
        out = []
        for key in keys:
            def value(profile, link, key=key):
                v = dict(getattr(profile, name)).get(key)
                return None if v is None else link / v if per_link else v
            if (v := self._field(n, value, floor)) is not None:
                out.append((key, v))
        return tuple(out)

    def at(self, n: int, rate: float) -> Profile:
        """The profile at world n on links of ``rate`` bytes/s: the rates as the probed links' efficiency."""
        times = {name: self._field(n, lambda p, _, name=name: getattr(p, name))
                 for name in LOCAL_SPEEDS + ("latency", "call_overhead")}
        # Rates on their lines as seconds per byte (the shared cores' slowdown grows with n, not their speed).
        memory = self._field(n, lambda p, _: 1 / p.memory_bandwidth, floor=1e-12)
        per_link = self._field(n, lambda p, link: link / p.bandwidth, floor=1.0)  # never past the link
        rates = tuple((k, rate / v) for k, v in self._table(n, "rates", per_link=True, floor=1.0))
        # A calibration is a miss, of either sign.
        return Profile(bandwidth=rate / per_link, memory_bandwidth=1 / memory, overheads=self._table(n, "overheads"), rates=rates,
                       calibration=self._table(n, "calibration", floor=None),
                       calibration_large=self._table(n, "calibration_large", floor=None), **times)


class Simulator:
    """Workloads by (world, dim), drawn once, and the profile of a world size."""

    def __init__(self, args):
        self.args = args
        self.corpus = workloads.StdlibCorpus()
        self._workloads = {}
        self.probed = Probed(args.probed) if args.probed else None
        if args.bandwidth_per_core:
            self.cores = args.cores or os.cpu_count() or 1
        else:
            self.cores = args.cores

    def workload(self, n: int, dim: int):
        """The exact workload of n ranks' batches of the text table [vocab, dim], reduced as rows."""
        key = (n, dim)
        if key not in self._workloads:
            rows = [torch.unique(workloads.batch_token_ids(self.corpus, self.args.text_batch, r, 0, self.args.seed))
                    for r in range(n)]
            w = workload_from_indices(rows, self.corpus.vocab_size, value_size=4 * dim, block_size=-(-256 // dim))
            self._workloads[key] = dataclasses.replace(w, row_size=dim, row_choice=True)
        return self._workloads[key]

    def rate(self, n: int) -> float:
        """Link bytes/s per rank at world n."""
        if self.args.bandwidth_per_core:
            return parse_rate(self.args.bandwidth_per_core) * self.cores / n
        return parse_rate(self.args.bandwidth or "10gbit")

    def profile(self, n: int, rate: float = None) -> Profile:
        if self.probed is not None:
            return self.probed.at(n, rate or self.rate(n))
        base = make_profile(rate or self.rate(n), self.args.latency)
        share = max(1.0, n / self.cores) if self.cores else 1.0
        slower = {name: getattr(base, name) * share for name in LOCAL_SPEEDS}
        return dataclasses.replace(base, memory_bandwidth=base.memory_bandwidth / share, **slower)

    def times(self, n: int, dim: int, rate: float = None) -> dict:
        return {s: t for s, t in predict_times(self.workload(n, dim), self.profile(n, rate), SCHEMES).items()
                if s in SCHEMES}


def simulate(sim: Simulator, worlds):
    rows = []
    for n in worlds:
        w = sim.workload(n, sim.args.text_dim)
        rows.append(dict(world=n, link_Bps=sim.rate(n), gamma=w.gamma, hash_imbalance=w.hash_imbalance,
                         block_imbalance=w.block_imbalance, nnz_rows=sum(w.nnz) / n,
                         times=sim.times(n, sim.args.text_dim)))
    return rows


def overtakes(rows):
    """Per other scheme: the smallest simulated world from which zen is faster at every larger one (None: never)."""
    out = {}
    for scheme in SCHEMES:
        if scheme == "zen":
            continue
        since = None
        for row in rows:
            ahead = row["times"]["zen"] < row["times"][scheme]
            since = (since or row["world"]) if ahead else None
        out[scheme] = since
    return out


def validate(sim: Simulator, paths):
    """Measured text rows against the simulation at their world, link rate and dim."""
    cells = []
    for path in paths:
        with open(path) as f:
            measured = json.load(f)
        for row in measured.get("rows", measured) if isinstance(measured, dict) else measured:
            if row.get("data") != "text" or row["scheme"] not in SCHEMES or not row.get("link_bps"):
                continue
            dim = row["numel"] // sim.corpus.vocab_size
            simulated = sim.times(row["world"], dim, row["link_bps"] / 8)[row["scheme"]]
            held_out = sim.probed is not None and row["world"] not in sim.probed.worlds
            cells.append(dict(file=os.path.basename(path), world=row["world"], dim=dim, scheme=row["scheme"],
                              link_Bps=row["link_bps"] / 8, measured_s=row["time_median"], simulated_s=simulated,
                              error=(simulated - row["time_median"]) / row["time_median"], held_out=held_out))
    return cells, mape_of(cells)


def mape_of(cells):
    """MAPE (%) per scheme over ``cells``."""
    return {s: 100 * sum(abs(c["error"]) for c in cells if c["scheme"] == s) / n
            for s in SCHEMES if (n := sum(c["scheme"] == s for c in cells))}


def _rate_text(bps: float) -> str:
    return f"{bps * 8 / 1e9:.3g} Gbit/s" if bps * 8 >= 1e9 else f"{bps * 8 / 1e6:.3g} Mbit/s"


def format_report(sim: Simulator, rows, cells, mape) -> str:
    a = sim.args
    rule = (f"{a.bandwidth_per_core} per core x {sim.cores} cores / n" if a.bandwidth_per_core
            else a.bandwidth or "10gbit")
    cores = f"; ranks share {sim.cores} cores" if sim.cores else "; a core per rank"
    machine = (f"fixed costs, local speeds, calibration and link efficiency probed at {_worlds(sim.probed.worlds)} "
               "ranks, on their lines in n between and beyond" if sim.probed else f"latency {a.latency}{cores}")
    lines = [f"simulated: text table {sim.corpus.vocab_size}x{a.text_dim} as rows, {a.text_batch} tokens per rank; "
             f"links {rule}; {machine}", "",
             "| ranks | link | gamma | hash imb | " + " | ".join(f"{s} ms" for s in SCHEMES) + " | zen vs best other |",
             "|---" * (5 + len(SCHEMES)) + "|"]
    for row in rows:
        t = row["times"]
        best_other = min(v for s, v in t.items() if s != "zen")
        lines.append(f"| {row['world']} | {_rate_text(row['link_Bps'])} | {row['gamma']:.2f} | "
                     f"{row['hash_imbalance']:.2f} | " + " | ".join(f"{t[s] * 1e3:.1f}" for s in SCHEMES)
                     + f" | {best_other / t['zen']:.2f}x |")
    lines += ["", "zen is faster from (simulated, and at every larger world size): "
              + ", ".join(f"{s} {w if w else 'never'}" for s, w in overtakes(rows).items())]
    if cells:
        lines += ["", "validation: measured (benchmarks/allreduce.py) against simulated at the same world, link and dim",
                  "", "| file | ranks | link | scheme | measured ms | simulated ms | error |", "|---" * 7 + "|"]
        for c in cells:
            lines.append(f"| {c['file']} | {c['world']} | {_rate_text(c['link_Bps'])} | {c['scheme']} | "
                         f"{c['measured_s'] * 1e3:.1f} | {c['simulated_s'] * 1e3:.1f} | {100 * c['error']:+.0f}% |")
        lines += ["", "MAPE per scheme: " + ", ".join(f"{s} {m:.0f}%" for s, m in mape.items())]
        held_out = [c for c in cells if c["held_out"]]
        if held_out:
            lines.append(f"held out (world sizes not probed: {_worlds(sorted({c['world'] for c in held_out}))}): "
                         + ", ".join(f"{s} {m:.0f}%" for s, m in mape_of(held_out).items()))
    return "\n".join(lines)


def _worlds(worlds) -> str:
    return ", ".join(map(str, worlds))


def plot(path, rows, cells):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, scheme in enumerate(SCHEMES):
        color = f"C{i}"
        ax.plot([r["world"] for r in rows], [r["times"][scheme] * 1e3 for r in rows], "-", color=color,
                label=f"{scheme} (simulated)")
        points = [c for c in cells if c["scheme"] == scheme]
        if points:
            ax.plot([c["world"] for c in points], [c["measured_s"] * 1e3 for c in points], "o", color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("ms per all-reduce")
    ax.set_title("lines: simulated; dots: measured on the emulated cluster")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        worlds = sorted({int(w) for w in args.worlds.split(",")})
    except ValueError:
        parser.error(f"--worlds: expected comma-separated integers, got {args.worlds!r}")
    if worlds[0] < 2:
        parser.error("--worlds: every world size must be >= 2")
    for flag, value in (("--text-dim", args.text_dim), ("--text-batch", args.text_batch), ("--cores", args.cores)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1; got {value}")
    try:
        parse_rate(args.bandwidth or args.bandwidth_per_core or "10gbit")
        make_profile("1gbit", args.latency)
    except ValueError as error:
        parser.error(str(error))
    sim = Simulator(args)
    rows = simulate(sim, worlds)
    cells, mape = validate(sim, args.validate)
    print(format_report(sim, rows, cells, mape))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), rows=rows, validation=cells, mape=mape,
                           mape_held_out=mape_of([c for c in cells if c["held_out"]]),
                           probed=sim.probed.worlds if sim.probed else []), f, indent=1)
    if args.plot:
        plot(args.plot, rows, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
