"""Sweeps of benchmarks/allreduce.py over world sizes and link rates: predicted vs measured, and scaling.

    python benchmarks/sweep.py --out results/sweep                       # the cost model's accuracy (root)
    python benchmarks/sweep.py --grid heldout --rounds 3 --out results/sweep_heldout   # never tuned on (root)
    python benchmarks/sweep.py --scaling --out results/scaling           # weak scaling, 2..16 ranks (root)

The tuning grid (the default: --worlds x --bandwidths x --sizes x --densities, 2/4/8 ranks, 100 Mbit/s and
1 Gbit/s, 4M uniform float32 elements) is what the cost model was tuned on. The held-out grid (HELDOUT) has
other sizes, world sizes, link rates, workloads and a half value dtype, and is never used to tune: its
error is the one to believe.

Each (link rate, world size) is one run of allreduce.py on an emulated cluster (benchmarks/cluster.py),
every scheme side by side on the same data, with the cost model's prediction for each (``zen.predict``,
profile probed once per run). With ``--rounds R`` the whole sweep runs R times (rounds apart in time, each
run with its own probe) and a cell's measured and predicted times are the medians over the rounds. From
the rows:

    accuracy   per scheme, the mean absolute percentage error of the prediction over every cell
               (MAPE = mean |predicted - measured| / measured), and per cell whether "auto" was within
               10% of the fastest fixed scheme (with the share of CPU time the hypervisor stole during the
               cell's run); zen's phases, measured against ``zen.predict_phases``, summed per world size
    noise      (R > 1) per scheme, how far one round's measured (and predicted) time lies from the cell's
               median over the rounds (mean |round - median| / median): the error no model can go below
    scaling    (--scaling) the real-text workload at a fixed per-rank batch (weak scaling): each scheme's
               time per world size and its efficiency against its own cost-model floor, predicted / measured

Writes OUT.json (all rows), OUT.txt (the tables) and OUT.png (time vs world size, per link rate).
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile

from launch import exit_code

HERE = os.path.dirname(os.path.abspath(__file__))
FIXED = ("dense", "agsparse", "sparcml", "omnireduce", "zen")

# The held-out grid: one allreduce.py run per entry (world size, link rate, then its own arguments). Never
# change it to suit the model: where the model misses here, the model is what to fix.
HELDOUT = (
    (3, "200mbit", ["--workload", "uniform", "--sizes", "1M", "--densities", "0.01,0.1"]),
    (5, "2500mbit", ["--workload", "zipf", "--sizes", "16M", "--densities", "0.001,0.01"]),
    (6, "200mbit", ["--workload", "text", "--text-dim", "64"]),
    (5, "200mbit", ["--workload", "uniform", "--sizes", "16M", "--densities", "0.001", "--dtype", "float16"]),
    (6, "2500mbit", ["--workload", "uniform", "--sizes", "1M", "--densities", "0.01,0.1"]),
    (3, "2500mbit", ["--workload", "text", "--text-dim", "128", "--dtype", "float16"]),
)


def cpu_steal():
    """(steal, total) jiffies of this machine's CPUs so far, from /proc/stat ((0, 0) where unreadable):
    steal is time the hypervisor gave to other guests while this one had work to run."""
    try:
        with open("/proc/stat") as f:
            jiffies = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return jiffies[7], sum(jiffies)


def grid_runs(args):
    """(world, link rate, allreduce.py arguments) of every run of the sweep, in order."""
    if args.grid == "heldout":
        return list(HELDOUT)
    worlds = [int(w) for w in (args.worlds or ("2,4,8,16" if args.scaling else "2,4,8")).split(",")]
    data = (["--workload", "text"] if args.scaling else
            ["--sizes", args.sizes, "--densities", args.densities, "--workload", args.workload])
    return [(world, bandwidth, data) for bandwidth in args.bandwidths.split(",") for world in worlds]


def run_cell(args, world, bandwidth, data):
    """One allreduce.py run on an emulated cluster; returns its rows, each tagged with the link rate and the
    share of CPU time stolen by the hypervisor during the run (noise no model here can predict)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, os.path.join(HERE, "allreduce.py"), "--world", str(world), "--bandwidth", bandwidth,
               "--iters", str(args.iters), "--warmup", str(args.warmup), "--json", out] + data
        print(f"[sweep] {world} ranks at {bandwidth}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        for attempt in range(2):  # a run that fails (e.g. a rank aborting in gloo's teardown) runs once more
            steal_before, total_before = cpu_steal()
            code = exit_code([subprocess.run(cmd).returncode])  # a death by signal S reads 128 + S
            steal_after, total_after = cpu_steal()
            if code == 0:
                break
            print(f"[sweep] that run failed (exit {code})" + ("; once more" if attempt == 0 else ""),
                  file=sys.stderr, flush=True)
        else:
            raise RuntimeError(f"sweep: {world} ranks at {bandwidth} failed twice")
        with open(out) as f:
            rows = json.load(f)
    for row in rows:
        row["bandwidth"] = bandwidth
        row["cpu_steal"] = (steal_after - steal_before) / max(1, total_after - total_before)
    return rows


def repredict(rows):
    """Recompute every row's predicted time from its stored workload and profile with the current
    cost model (rows of one case share them)."""
    sys.path.insert(0, os.path.dirname(HERE))
    from zen import Profile, Workload, predict_phases, predict_times

    for row in rows:
        if row.get("workload") and row.get("profile"):
            profile = dict(row["profile"])
            for key in ("overheads", "rates", "calibration", "calibration_large"):
                profile[key] = tuple(tuple(x) for x in profile.get(key, ()))
            workload, profile = Workload(**row["workload"]), Profile(**profile)
            times = predict_times(workload, profile)
            row["time_predicted"] = times[row["scheme"]] if row["scheme"] in times else times["auto"]
            phases = predict_phases(workload, profile).get(row["scheme"])
            if phases is not None:
                row["phases_predicted_ms"] = {k: v * 1e3 for k, v in phases.items()}
    return rows


def cell_key(row):
    return (row["bandwidth"], row["world"], row.get("data") or "uniform", row.get("dtype") or "float32",
            row["numel"], round(row["density"], 6))


def cells_of(rows):
    """{cell key: {scheme: row}}."""
    cells = {}
    for r in rows:
        cells.setdefault(cell_key(r), {})[r["scheme"]] = r
    return cells


def merge_rounds(rows):
    """One row per (cell, scheme): the first round's row with the medians over the rounds of the measured
    and predicted times and phases, the mean CPU steal, auto's most frequent pick, and the rounds' own
    times kept in ``rounds`` (every round all-reduces the same data)."""
    groups = {}
    for r in rows:
        groups.setdefault(cell_key(r) + (r["scheme"],), []).append(r)
    merged = []
    for same in groups.values():
        row = dict(same[0])
        row["rounds"] = [{"time_median": r["time_median"], "time_predicted": r["time_predicted"]} for r in same]
        for key in ("time_median", "time_predicted"):
            row[key] = statistics.median(r[key] for r in same)
        for key in ("phases_ms", "phases_predicted_ms"):
            row[key] = {p: statistics.median(r[key].get(p, 0.0) for r in same) for p in same[0].get(key) or {}}
        row["cpu_steal"] = statistics.mean(r.get("cpu_steal", 0.0) for r in same)
        picks = [r["auto_choice"] for r in same if r.get("auto_choice")]
        if len(picks) > 1:  # the most frequent pick, and in how many rounds
            pick, count = collections.Counter(picks).most_common(1)[0]
            row["auto_choice"] = f"{pick} {count}/{len(same)}"
        merged.append(row)
    return merged


def noise_table(rows):
    """Per scheme, over every cell (rows from :func:`merge_rounds`; empty for one round): the mean of
    |one round's value - the median of the rounds| / that median, measured and predicted; and in how many
    cells the prediction lies within the range of the rounds' measured times."""
    if not any(len(r.get("rounds", ())) > 1 for r in rows):
        return ""
    lines = ["", "round to round (over every cell): spread = mean |one round - median of the rounds| / median;",
             "in range = cells whose prediction lies between the rounds' fastest and slowest measured time",
             f"{'scheme':>10} {'measured':>9} {'predicted':>9} {'in range':>9}"]
    for scheme in FIXED + ("auto",):
        mine = [r for r in rows if r["scheme"] == scheme and len(r.get("rounds", ())) > 1]
        if not mine:
            continue
        spread = {key: statistics.mean(abs(x[key] - r[key]) / r[key] for r in mine for x in r["rounds"])
                  for key in ("time_median", "time_predicted")}
        inside = sum(min(x["time_median"] for x in r["rounds"]) <= r["time_predicted"]
                     <= max(x["time_median"] for x in r["rounds"]) for r in mine)
        lines.append(f"{scheme:>10} {spread['time_median']:>9.1%} {spread['time_predicted']:>9.1%} "
                     f"{inside:>4} of {len(mine):<2}")
    return "\n".join(lines)


def accuracy_tables(rows):
    """MAPE per scheme, and auto against the fastest fixed scheme per cell."""
    lines = ["prediction error per scheme (over every cell of the sweep):",
             f"{'scheme':>10} {'cells':>5} {'MAPE':>7} {'median APE':>10} {'worst APE':>9} {'bias':>7}"]
    for scheme in FIXED + ("auto",):
        errors = [(r["time_predicted"] - r["time_median"]) / r["time_median"] for r in rows if r["scheme"] == scheme]
        if not errors:
            continue
        absolute = [abs(e) for e in errors]
        lines.append(f"{scheme:>10} {len(errors):>5} {statistics.mean(absolute):>7.1%} "
                     f"{statistics.median(absolute):>10.1%} {max(absolute):>9.1%} {statistics.mean(errors):>+7.1%}")
    lines += ["", "auto against the fastest fixed scheme, per cell (measured medians, ms):",
              f"{'link':>8} {'world':>5} {'workload':>8} {'dtype':>8} {'numel':>9} {'density':>8} {'fastest':>10} "
              f"{'ms':>8} {'auto ms':>8} "
              f"{'auto/best':>9} {'predicted best':>14} {'auto picked':>14} {'steal':>6}"]
    cells = cells_of(rows)
    within = 0
    for key in sorted(cells):
        by = cells[key]
        fixed = {s: by[s] for s in FIXED if s in by}
        if "auto" not in by or not fixed:
            continue
        best = min(fixed, key=lambda s: fixed[s]["time_median"])
        predicted_best = min(fixed, key=lambda s: fixed[s]["time_predicted"])
        ratio = by["auto"]["time_median"] / fixed[best]["time_median"]
        within += ratio <= 1.1
        link, world, workload, dtype, numel, density = key
        lines.append(f"{link:>8} {world:>5} {workload:>8} {dtype:>8} {numel:>9} {density:>8.2%} {best:>10} "
                     f"{fixed[best]['time_median'] * 1e3:>8.1f} {by['auto']['time_median'] * 1e3:>8.1f} "
                     f"{ratio:>8.2f}x {predicted_best:>14} {by['auto'].get('auto_choice') or '-':>14} "
                     f"{by['auto'].get('cpu_steal', float('nan')):>6.1%}")
    lines.append(f"auto within 10% of the fastest fixed scheme in {within} of {len(cells)} cells")
    return "\n".join(lines)


def phase_table(rows, scheme):
    """A scheme's phases, measured (mean over ranks) against predicted, summed over the cells of each world
    size."""
    mine = [r for r in rows if r["scheme"] == scheme and r.get("phases_ms") and r.get("phases_predicted_ms")]
    if not mine:
        return ""
    worlds = sorted({r["world"] for r in mine})
    lines = ["", f"{scheme}'s phases: measured / predicted ms, summed over the cells of each world size:",
             f"{'phase':>10} " + " ".join(f"{f'{w} ranks':>17}" for w in worlds)]
    for phase in mine[0]["phases_predicted_ms"]:
        cells = []
        for w in worlds:
            measured = sum(r["phases_ms"].get(phase, 0.0) for r in mine if r["world"] == w)
            predicted = sum(r["phases_predicted_ms"].get(phase, 0.0) for r in mine if r["world"] == w)
            cells.append(f"{measured:>8.1f} / {predicted:>6.1f}")
        lines.append(f"{phase:>10} " + " ".join(cells))
    return "\n".join(lines)


def scaling_table(rows):
    """Weak scaling: time per world size and efficiency = predicted floor / measured."""
    worlds = sorted({r["world"] for r in rows})
    schemes = [s for s in FIXED + ("auto",) if any(r["scheme"] == s for r in rows)]
    by = {(r["bandwidth"], r["world"], r["scheme"]): r for r in rows}
    lines = []
    for bandwidth in sorted({r["bandwidth"] for r in rows}):
        lines += [f"weak scaling at {bandwidth}, real-text embedding gradient, fixed batch per rank: "
                  "time ms (efficiency = cost-model floor / measured)",
                  f"{'scheme':>10} " + " ".join(f"{f'{w} ranks':>17}" for w in worlds)]
        for scheme in schemes:
            cells = []
            for w in worlds:
                r = by.get((bandwidth, w, scheme))
                cells.append(f"{'-':>17}" if r is None else
                             f"{r['time_median'] * 1e3:>9.1f} ({r['time_predicted'] / r['time_median']:>4.0%})")
            lines.append(f"{scheme:>10} " + " ".join(cells))
        speedups = [by[(bandwidth, w, "zen")]["speedup_vs_dense"] for w in worlds if (bandwidth, w, "zen") in by]
        lines.append(f"{'zen/dense':>10} " + " ".join(f"{s:>16.2f}x" for s in speedups))
        lines.append("")
    return "\n".join(lines)


def plot(rows, path):
    """Time vs world size per scheme, one panel per (link rate, numel, density) cell family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["bandwidth"], r["numel"], round(r["density"], 4)) for r in rows})
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.4 * nrows), squeeze=False)
    for ax, (bandwidth, numel, density) in zip(axes.flat, panels):
        for scheme in FIXED + ("auto",):
            pts = sorted((r["world"], r["time_median"] * 1e3, r["time_predicted"] * 1e3) for r in rows
                         if r["scheme"] == scheme and r["bandwidth"] == bandwidth and r["numel"] == numel
                         and round(r["density"], 4) == density)
            if pts:
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=scheme)
                ax.plot([p[0] for p in pts], [p[2] for p in pts], ls=":", color=line.get_color())
        ax.set_title(f"{bandwidth}, M={numel}, d={density:.2%}", fontsize=9)
        ax.set_xlabel("world size")
        ax.set_ylabel("time ms (dotted: predicted)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grid", default="tuning", choices=["tuning", "heldout"],
                   help="tuning: the grid of --worlds x --bandwidths x --sizes x --densities (the default); "
                        "heldout: the fixed grid HELDOUT, never used to tune the cost model")
    p.add_argument("--worlds", default=None, help="comma-separated world sizes (default 2,4,8; --scaling 2,4,8,16)")
    p.add_argument("--bandwidths", default="100mbit,1gbit", help="comma-separated emulated link rates")
    p.add_argument("--sizes", default="4M")
    p.add_argument("--densities", default="0.001,0.01,0.1")
    p.add_argument("--workload", default="uniform", choices=["uniform", "zipf"])
    p.add_argument("--scaling", action="store_true", help="weak scaling on the real-text workload instead")
    p.add_argument("--rounds", type=int, default=1, help="run the whole sweep this many times; medians per cell")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", required=True, help="output prefix: writes OUT.json, OUT.txt, OUT.png")
    p.add_argument("--repredict", action="store_true",
                   help="measure nothing: re-predict OUT.json's rows with the current cost model, rewrite the outputs")
    args = p.parse_args(argv)
    rows = []
    if args.repredict:
        with open(args.out + ".json") as f:
            rows = repredict(json.load(f))
        with open(args.out + ".json", "w") as f:
            json.dump(rows, f, indent=1)
    for round_ in range(0 if args.repredict else args.rounds):
        for world, bandwidth, data in grid_runs(args):
            for row in run_cell(args, world, bandwidth, data):
                rows.append(dict(row, round=round_))
            with open(args.out + ".json", "w") as f:  # kept up to date: a long sweep can be cut short
                json.dump(rows, f, indent=1)
    merged = merge_rounds(rows)
    text = scaling_table(merged) if args.scaling else ""
    text += (accuracy_tables(merged) + "\n" + phase_table(merged, "zen") + "\n" + phase_table(merged, "sparcml")
             + "\n" + noise_table(merged))
    print(text)
    with open(args.out + ".txt", "w") as f:
        f.write(f"$ python benchmarks/sweep.py {' '.join(argv if argv is not None else sys.argv[1:])}\n\n{text}\n")
    plot(merged, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
