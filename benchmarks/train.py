"""End-to-end DDP training: plain DDP against DDP with zen's hook, side by side in one run.

    python benchmarks/train.py --model lm --world 2 --steps 5                # local ranks on loopback
    python benchmarks/train.py --model lm --world 8 --bandwidth 1gbit        # emulated cluster (root)
    python benchmarks/train.py --model deepfm --world 8 --bandwidth 1gbit --json fm.json --plot fm.png
    python benchmarks/train.py --model deepfm --world 2 --steps 5 --trace traces   # + a Chrome trace per rank

Models (both embedding-heavy, with dense embedding gradients, nn.Embedding(sparse=False), so DDP's buckets
carry mostly-zero rows):

    lm      word-level language model over the Python standard library's source (StdlibCorpus, vocabulary
            capped at --vocab): Embedding(V, 64) -> LSTM(64, 64) -> sampled softmax over an output embedding
            (V x 64) and a bias (V x 1), with --negatives shared negative samples per batch drawn from the
            log-uniform (Zipf) law that frequency-ordered ids follow, logQ-corrected, accidental hits masked.
            Each rank's batch is --batch windows of --seq + 1 consecutive tokens at random offsets of the
            stream, drawn for (seed, rank, step) as in workloads.batch_token_ids (the text workload of
            allreduce.py); one sample = one window.
    deepfm  DeepFM click model: --fields categorical fields, each with Zipf(--zipf-alpha) ids over
            --field-vocab values, in one shared Embedding(F * field_vocab, 16) (field offsets) plus a first-order
            Embedding(F * field_vocab, 1); FM second-order term + MLP(128-64-32-1). Labels are Bernoulli draws
            from a fixed hidden logistic model over the same features; one sample = one impression.

Both variants start from the same weights and see the same per-rank batches; every step runs both, in
alternating order (plain then zen on even steps, zen then plain on odd ones), so drifting machine load hits
both alike. Optimizer: SGD. The first --warmup steps are trained and checked but not timed.

Timing, per variant and step (every phase starts after a barrier; a phase's time is its slowest rank's):

    compute  forward + backward of the same batch under ddp.no_sync() (no bucket copies, no hook, no
             all-reduce; the gradients are then dropped), plus the optimizer step of the real step
    step     the real step: forward, backward (DDP's all-reduce or zen's hook, overlapped with backward as
             DDP does it), optimizer step
    comm     exposed communication = step - compute: whatever backward waits for beyond its own compute,
             i.e. the all-reduce and its local work (bucket copies, zen's scan / partition / scatter)
    CPU      CPU time (user + system, all threads) of one rank's process during the real step, mean over
             ranks: the work a host does per step, whatever share of the machine's cores it got

With every rank on one machine (loopback or the emulated cluster), "CPU floor" = world * CPU / cores is the
least a step can take there; a step close to it is limited by this machine's cores, not by the network.

The table reports medians over the timed steps (comm = median step - median compute) and samples/s =
world * batch / median step. Checks on every run: the loss curves of the two variants (the mean over ranks of
each step's loss) agree within rtol 1e-4, the parameters of the two variants agree at the end (rtol 1e-4,
atol 1e-6), and each variant's parameters are identical on every rank. A failed check makes the exit code 1.

``--trace DIR``: after the timed steps, --trace-steps more steps of each variant (untimed, the same for both)
run under the PyTorch profiler, every thread recorded (zen's phases, ranges "zen::<scheme>::<phase>", run on
its lane beside autograd's backward); each rank writes DIR/rank<r>.json, a Chrome trace (chrome://tracing,
Perfetto), each step in a range "train::<variant>::step".
"""
import argparse
import copy
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VARIANTS = ("plain", "zen")
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-7
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-6


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="lm", choices=["lm", "deepfm"])
    p.add_argument("--world", type=int, default=4, help="ranks to start on this machine (default 4)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the timed ones (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None, help="SGD learning rate (default: lm 1.0, deepfm 0.05)")
    p.add_argument("--batch", type=int, default=None, help="samples per rank (default: lm 64 windows, deepfm 256)")
    p.add_argument("--scheme", default="zen", help="the hook's scheme, ZenState(scheme=...) (default zen)")
    p.add_argument("--dense-threshold", type=float, default=None,
                   help="ZenState(dense_threshold=...): a bucket goes dense above this mean density, not by timing")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP's bucket_cap_mb (default: DDP's own default, a 1 MB first bucket, then 25 MB)")
    # lm
    p.add_argument("--vocab", type=int, default=70000, help="lm: vocabulary cap (default 70000)")
    p.add_argument("--seq", type=int, default=32, help="lm: tokens per window (default 32)")
    p.add_argument("--dim", type=int, default=64, help="lm: embedding and LSTM width (default 64)")
    p.add_argument("--negatives", type=int, default=64, help="lm: shared negative samples per batch (default 64)")
    # deepfm
    p.add_argument("--fields", type=int, default=8, help="deepfm: categorical fields (default 8)")
    p.add_argument("--field-vocab", type=int, default=100000, help="deepfm: ids per field (default 100000)")
    p.add_argument("--fm-dim", type=int, default=16, help="deepfm: embedding width (default 16)")
    p.add_argument("--zipf-alpha", type=float, default=1.1, help="deepfm: skew of the ids (default 1.1)")
    # where and what to write
    p.add_argument("--bandwidth", default=None, help="emulated link rate, e.g. 1gbit (runs an emulated cluster, root)")
    p.add_argument("--latency", default="0ms", help="emulated one-way link latency (needs sch_netem)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run (default 3600)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of the loss curves (and step times) here")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write a Chrome trace of --trace-steps more steps per rank here (DIR/rank<r>.json)")
    p.add_argument("--trace-steps", type=int, default=3, help="steps of each variant in the trace (default 3)")
    p.add_argument("--from-env", action="store_true", help=argparse.SUPPRESS)  # one rank, launched by torchrun/cluster
    return p


def defaults(args):
    if args.lr is None:
        args.lr = 1.0 if args.model == "lm" else 0.05
    if args.batch is None:
        args.batch = 64 if args.model == "lm" else 256
    return args


# ----------------------------------------------------------------------------------------------------------
# models and data


class SampledSoftmaxLM(nn.Module):
    """Embedding -> LSTM -> sampled softmax over an output embedding. All embeddings have dense gradients."""

    def __init__(self, vocab, dim):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, batch_first=True)
        self.out_embed = nn.Embedding(vocab, dim)
        self.out_bias = nn.Embedding(vocab, 1)
        nn.init.normal_(self.embed.weight, std=0.05)
        nn.init.normal_(self.out_embed.weight, std=0.05)
        nn.init.zeros_(self.out_bias.weight)

    def forward(self, inputs, targets, negatives, log_q_targets, log_q_negatives):
        h, _ = self.lstm(self.embed(inputs))
        h = h.reshape(-1, h.shape[-1])                                    # (N, D), N = batch * seq
        t = targets.reshape(-1)
        # One lookup for targets and negatives: one dense (V x D) gradient per table, not two.
        rows = torch.cat([t, negatives])
        w, b = self.out_embed(rows), self.out_bias(rows).squeeze(1)
        w_t, w_n, b_t, b_n = w[: t.numel()], w[t.numel():], b[: t.numel()], b[t.numel():]
        true_logit = (h * w_t).sum(1) + b_t - log_q_targets.reshape(-1)
        neg_logits = h @ w_n.t() + (b_n - log_q_negatives)
        neg_logits = neg_logits.masked_fill(negatives[None, :] == t[:, None], float("-inf"))  # accidental hits
        logits = torch.cat([true_logit[:, None], neg_logits], 1)
        return F.cross_entropy(logits, torch.zeros(t.numel(), dtype=torch.long))


class DeepFM(nn.Module):
    """First-order term + FM second-order term + MLP over a shared field embedding (dense gradients)."""

    def __init__(self, fields, field_vocab, dim):
        super().__init__()
        self.embed = nn.Embedding(fields * field_vocab, dim)
        self.linear = nn.Embedding(fields * field_vocab, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        self.mlp = nn.Sequential(nn.Linear(fields * dim, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                 nn.Linear(32, 1))
        nn.init.normal_(self.embed.weight, std=0.01)
        nn.init.zeros_(self.linear.weight)

    def forward(self, ids, labels):
        e = self.embed(ids)                                                # (B, F, D)
        first = self.linear(ids).sum((1, 2)) + self.bias
        s = e.sum(1)
        fm = 0.5 * (s * s - (e * e).sum(1)).sum(1)
        deep = self.mlp(e.flatten(1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(first + fm + deep, labels)


def log_uniform(count, vocab, gen):
    """count ids with P(k) = log((k+2)/(k+1)) / log(V+1): the law of frequency-ordered (Zipf) ids."""
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    return (torch.exp(u * math.log(vocab + 1.0)).floor().long() - 1).clamp_(0, vocab - 1)


def log_uniform_log_q(ids, vocab, count):
    """log of the expected number of times id is drawn in `count` log-uniform draws (the logQ correction)."""
    k = ids.double()
    return (math.log(count) + torch.log(torch.log((k + 2) / (k + 1)) / math.log(vocab + 1.0))).float()


def lm_setup(args, rank, total_steps):
    import workloads

    corpus = workloads.StdlibCorpus(args.vocab)
    V = corpus.vocab_size
    batches = []
    for step in range(total_steps):
        w = workloads.batch_token_ids(corpus, args.batch * (args.seq + 1), rank, step, args.seed,
                                      window=args.seq + 1).view(args.batch, args.seq + 1)
        inputs, targets = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        negatives = log_uniform(args.negatives, V, workloads.make_generator(args.seed, "negatives", rank, step))
        batches.append((inputs, targets, negatives, log_uniform_log_q(targets, V, args.negatives),
                        log_uniform_log_q(negatives, V, args.negatives)))
    torch.manual_seed(args.seed)
    model = SampledSoftmaxLM(V, args.dim)
    info = {"vocab": V, "corpus_tokens": corpus.num_tokens, "tokens_per_rank": args.batch * args.seq}
    return model, batches, info, ("embed", "out_embed")


def deepfm_setup(args, rank, total_steps):
    import workloads

    Fn, Vf = args.fields, args.field_vocab
    offsets = torch.arange(Fn) * Vf
    hidden = torch.randn(Fn * Vf, generator=workloads.make_generator(args.seed, "hidden-logistic")) * 0.7
    batches = []
    for step in range(total_steps):
        gen = workloads.make_generator(args.seed, "deepfm", rank, step)
        ids = torch.stack([workloads._zipf_draws(Vf, args.zipf_alpha, args.batch, gen) for _ in range(Fn)], 1)
        ids = ids + offsets
        p = torch.sigmoid(hidden[ids].sum(1) - 1.0)
        labels = torch.bernoulli(p, generator=gen)
        batches.append((ids, labels))
    torch.manual_seed(args.seed)
    model = DeepFM(Fn, Vf, args.fm_dim)
    return model, batches, {"fields": Fn, "field_vocab": Vf}, ("embed", "linear")


# ----------------------------------------------------------------------------------------------------------
# one rank's run


def recording_hook(log):
    """zen.zen_hook, plus a callback that copies each bucket's zen stats (sent bytes, dense or sparse) into
    `log`. The callback runs on zen's lane when the bucket's future completes, before the lane's next job."""
    import zen

    def hook(state, bucket):
        index, numel = bucket.index(), bucket.buffer().numel()

        def done(fut):
            log[index] = dict(state.last_stats, numel=numel)
            return fut.value()

        return zen.zen_hook(state, bucket).then(done)

    return hook


def bench(rank, world, args):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zen

    args = defaults(args)
    torch.set_num_threads(1)
    total = args.warmup + args.steps
    setup = lm_setup if args.model == "lm" else deepfm_setup
    model, batches, info, embedding_names = setup(args, rank, total)

    ddps, opts, zen_log = {}, {}, {}
    state = zen.ZenState(scheme=args.scheme, dense_threshold=args.dense_threshold)
    for variant in VARIANTS:
        ddp = DDP(copy.deepcopy(model), bucket_cap_mb=args.bucket_cap_mb)
        if variant == "zen":
            ddp.register_comm_hook(state, recording_hook(zen_log))
        ddps[variant] = ddp
        opts[variant] = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    embeddings = [getattr(model, name).weight for name in embedding_names]
    emb_rows = sum(w.shape[0] for w in embeddings)
    numel = sum(p.numel() for p in model.parameters())

    # rec[v][step] = [compute fwd+bwd (no_sync), step, fwd+bwd with sync, optimizer]
    rec = {v: torch.zeros(total, 4, dtype=torch.float64) for v in VARIANTS}
    losses = {v: torch.zeros(total, dtype=torch.float64) for v in VARIANTS}
    cpu = {v: torch.zeros(total, dtype=torch.float64) for v in VARIANTS}  # process CPU time of the real step
    density = torch.zeros(total, dtype=torch.float64)
    zen_bytes, zen_dense, buckets = [], [], []
    for step in range(total):
        batch = batches[step]
        for variant in (VARIANTS if step % 2 == 0 else VARIANTS[::-1]):
            ddp, opt = ddps[variant], opts[variant]
            # compute only: the same forward + backward without gradient synchronisation
            dist.barrier()
            t0 = time.perf_counter()
            with ddp.no_sync():
                ddp(*batch).backward()
            t1 = time.perf_counter()
            if variant == "plain":  # gradient density of the embeddings (untimed)
                rows = sum(int((ddp.module.get_parameter(f"{n}.weight").grad != 0).any(1).sum())
                           for n in embedding_names)
                density[step] = rows / emb_rows
            opt.zero_grad(set_to_none=True)
            # the real step
            zen_log.clear()
            dist.barrier()
            t2, c2 = time.perf_counter(), time.process_time()
            loss = ddp(*batch)
            loss.backward()
            t3 = time.perf_counter()
            opt.step()
            t4, c4 = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            rec[variant][step] = torch.tensor([t1 - t0, t4 - t2, t3 - t2, t4 - t3], dtype=torch.float64)
            cpu[variant][step] = c4 - c2
            losses[variant][step] = loss.item()
            if variant == "zen" and step >= args.warmup:
                zen_bytes.append(sum(s.get("bytes_sent", 0) for s in zen_log.values()))
                zen_dense.append(sum(1 for s in zen_log.values() if s.get("dense")))
                buckets = [zen_log[i]["numel"] for i in sorted(zen_log)]

    # the slowest rank's time of each phase; the mean loss over ranks
    for variant in VARIANTS:
        dist.all_reduce(rec[variant], op=dist.ReduceOp.MAX)
        dist.all_reduce(losses[variant])
        losses[variant] /= world
        dist.all_reduce(cpu[variant])
        cpu[variant] /= world
    dist.all_reduce(density)
    density /= world
    sent = torch.tensor([statistics.mean(zen_bytes) if zen_bytes else 0.0,
                         statistics.mean(zen_dense) if zen_dense else 0.0], dtype=torch.float64)
    dist.all_reduce(sent)
    sent /= world
    # the hook's own account (ZenState.summary), the slowest rank's: its collectives' seconds and auto's measuring
    totals = state.summary()
    hook_seconds = torch.tensor([totals["seconds"], totals["auto_seconds"]], dtype=torch.float64)
    dist.all_reduce(hook_seconds, op=dist.ReduceOp.MAX)
    if args.trace:  # after the counts above, which are the timed steps'; both variants take the same steps
        trace(args.trace, args.trace_steps, rank, ddps, opts, batches)

    # correctness: the variants against each other, and every rank against rank 0
    params = {v: torch.cat([p.detach().reshape(-1) for p in ddps[v].module.parameters()]) for v in VARIANTS}
    p_plain, p_zen = params["plain"], params["zen"]
    checks = torch.tensor([
        (p_plain - p_zen).abs().max().item(),
        0.0 if torch.allclose(p_zen, p_plain, rtol=PARAM_RTOL, atol=PARAM_ATOL) else 1.0,
        0.0, 0.0], dtype=torch.float64)
    for i, variant in enumerate(VARIANTS):
        ref = params[variant].clone()
        dist.broadcast(ref, 0)
        checks[2 + i] = (params[variant] - ref).abs().max().item()
    dist.all_reduce(checks, op=dist.ReduceOp.MAX)

    return {
        "rec": {v: rec[v].tolist() for v in VARIANTS}, "cpu": {v: cpu[v].tolist() for v in VARIANTS}, "losses": {v: losses[v].tolist() for v in VARIANTS},
        "density": density.tolist(), "zen_bytes_sent": sent[0].item(), "zen_dense_buckets": sent[1].item(),
        "param_diff": checks[0].item(), "param_close": checks[1].item() == 0.0,
        "rank_diff": {"plain": checks[2].item(), "zen": checks[3].item()}, "info": info, "numel": numel,
        "bucket_numels": buckets, "hook_seconds": hook_seconds[0].item(), "auto_seconds": hook_seconds[1].item(),
        "auto_trials": totals["auto_trials"],
    }


def trace(directory, steps, rank, ddps, opts, batches):
    """--trace: ``steps`` more steps of each variant (the last batches again) under the PyTorch profiler of
    every thread (zen's phases run on its lane; a default profile records only the thread that starts it);
    writes ``directory``/rank<rank>.json, a Chrome trace."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile, record_function

    os.makedirs(directory, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU],
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        for i in range(steps):
            batch = batches[-1 - i % len(batches)]
            for variant in VARIANTS:
                dist.barrier()
                with record_function(f"train::{variant}::step"):
                    ddps[variant](*batch).backward()
                    opts[variant].step()
                    opts[variant].zero_grad(set_to_none=True)
    path = os.path.join(directory, f"rank{rank}.json")
    prof.export_chrome_trace(path)
    if rank == 0:
        print(f"trace: {steps} steps of each variant, one Chrome trace per rank: {path} ...", flush=True)


# ----------------------------------------------------------------------------------------------------------
# report


def summarize(raw, args, world):
    args = defaults(args)
    timed = slice(args.warmup, args.warmup + args.steps)
    samples = world * args.batch
    rows = {}
    for v in VARIANTS:
        rec = raw["rec"][v][timed]
        compute = [r[0] + r[3] for r in rec]
        step = [r[1] for r in rec]
        med_step, med_compute = statistics.median(step), statistics.median(compute)
        rows[v] = {
            "variant": v, "step_median_s": med_step, "step_min_s": min(step), "step_max_s": max(step),
            "compute_median_s": med_compute, "comm_exposed_s": med_step - med_compute,
            "fwd_bwd_nosync_median_s": statistics.median(r[0] for r in rec),
            "fwd_bwd_sync_median_s": statistics.median(r[2] for r in rec),
            "optimizer_median_s": statistics.median(r[3] for r in rec),
            "cpu_per_rank_median_s": statistics.median(raw["cpu"][v][timed]),
            "samples_per_s": samples / med_step, "step_s": step, "compute_s": compute,
            "loss": raw["losses"][v],
        }
    rows["zen"]["bytes_sent_per_rank"] = raw["zen_bytes_sent"]
    rows["zen"]["dense_buckets"] = raw["zen_dense_buckets"]
    n = world
    rows["plain"]["bytes_sent_per_rank"] = 2 * (n - 1) / n * 4 * raw["numel"]  # a ring all-reduce's, fp32
    speedup = rows["plain"]["step_median_s"] / rows["zen"]["step_median_s"]
    lp, lz = torch.tensor(raw["losses"]["plain"]), torch.tensor(raw["losses"]["zen"])
    loss_diff = (lp - lz).abs().max().item()
    loss_rel = ((lp - lz).abs() / lp.abs().clamp(min=1e-30)).max().item()
    loss_ok = bool(torch.allclose(lz, lp, rtol=LOSS_RTOL, atol=LOSS_ATOL))
    ranks_ok = all(d == 0.0 for d in raw["rank_diff"].values())
    ok = loss_ok and raw["param_close"] and ranks_ok
    # All ranks on this machine (loopback, or the emulated cluster): a step cannot take less than the ranks'
    # CPU time spread over its cores. A step near this floor measures the CPUs, not the network.
    shared = not args.from_env or "ZEN_CLUSTER_BANDWIDTH_BPS" in os.environ
    cores = os.cpu_count() or 1
    for v in VARIANTS:
        rows[v]["cpu_floor_s"] = world * rows[v]["cpu_per_rank_median_s"] / cores if shared else None
    return {
        "model": args.model, "world": world, "bandwidth": args.bandwidth or "loopback", "latency": args.latency,
        "steps": args.steps, "warmup": args.warmup, "batch_per_rank": args.batch, "lr": args.lr,
        "seed": args.seed, "bucket_cap_mb": args.bucket_cap_mb, "params": raw["numel"], "scheme": args.scheme,
        "zen_run_s": sum(r[1] for r in raw["rec"]["zen"]), "hook_s": raw["hook_seconds"],
        "auto_s": raw["auto_seconds"], "auto_trials": raw["auto_trials"],
        "ddp_bucket_numels": raw["bucket_numels"],
        "embedding_density_per_rank": statistics.mean(raw["density"]),
        "model_info": raw["info"], "variants": [rows[v] for v in VARIANTS], "speedup": speedup,
        "loss_max_abs_diff": loss_diff, "loss_max_rel_diff": loss_rel, "loss_match": loss_ok,
        "param_max_abs_diff": raw["param_diff"], "param_match": raw["param_close"],
        "param_rank_max_abs_diff": raw["rank_diff"], "ranks_agree": ranks_ok, "ok": ok,
        "load_average": os.getloadavg(), "cpus": os.cpu_count(), "torch": torch.__version__,
    }


def format_report(s):
    unit = "windows" if s["model"] == "lm" else "samples"
    head = (f"{'variant':>8} {'step ms':>9} {'(min':>8} {'max)':>8} {'compute ms':>10} {'comm ms':>9} "
            f"{'CPU ms':>8} {unit + '/s':>11} {'sent MB/rank':>12} {'speedup':>7}")
    lines = [f"{s['model']}: {s['world']} ranks, {s['bandwidth']}, {s['params'] / 1e6:.2f}M parameters "
             f"(DDP buckets: {', '.join(f'{b / 1e6:.2f}' for b in s['ddp_bucket_numels'])}M elements), batch "
             f"{s['batch_per_rank']} {unit}/rank, embedding gradient density {100 * s['embedding_density_per_rank']:.2f}%"
             f"/rank, {s['steps']} timed steps (+{s['warmup']} warm-up), medians of the slowest rank",
             head, "-" * len(head)]
    base = s["variants"][0]["step_median_s"]
    for r in s["variants"]:
        lines.append(f"{r['variant']:>8} {r['step_median_s'] * 1e3:>9.1f} {r['step_min_s'] * 1e3:>8.1f} "
                     f"{r['step_max_s'] * 1e3:>8.1f} {r['compute_median_s'] * 1e3:>10.1f} "
                     f"{r['comm_exposed_s'] * 1e3:>9.1f} {r['cpu_per_rank_median_s'] * 1e3:>8.1f} "
                     f"{r['samples_per_s']:>11.1f} "
                     f"{r['bytes_sent_per_rank'] / 1e6:>12.2f} {base / r['step_median_s']:>6.2f}x")
    z = s["variants"][1]
    lines.append(f"zen (scheme {s['scheme']}): {len(s['ddp_bucket_numels'])} buckets per step, "
                 f"{z['dense_buckets']:.1f} of them sent dense (mean); its {s['warmup'] + s['steps']} steps took {s['zen_run_s']:.2f} s, "
                 f"{s['hook_s']:.2f} s of it in the hook's collectives (summary()['seconds'], slowest rank)")
    if s["scheme"] == "auto":
        lines.append(f"auto's choosing (summary()['auto_seconds'], slowest rank: measuring, probe, trial calls): "
                     f"{s['auto_s']:.2f} s, {100 * s['auto_s'] / s['zen_run_s']:.1f}% of the run; "
                     f"{s['auto_trials']} trial calls")
    lines.append(f"loss curves: max abs diff {s['loss_max_abs_diff']:.3g} (max rel {s['loss_max_rel_diff']:.3g}), "
                 f"rtol {LOSS_RTOL:g}: {'OK' if s['loss_match'] else 'MISMATCH'}; first/last loss "
                 f"{s['variants'][0]['loss'][0]:.4f} / {s['variants'][0]['loss'][-1]:.4f}")
    lines.append(f"final parameters: max abs diff plain vs zen {s['param_max_abs_diff']:.3g} "
                 f"(rtol {PARAM_RTOL:g}, atol {PARAM_ATOL:g}): {'OK' if s['param_match'] else 'MISMATCH'}; "
                 f"max diff to rank 0: plain {s['param_rank_max_abs_diff']['plain']:.3g}, "
                 f"zen {s['param_rank_max_abs_diff']['zen']:.3g}")
    if s["variants"][0]["cpu_floor_s"] is not None:
        lines.append(f"CPU floor (all ranks' CPU time per step / {s['cpus']} cores of this machine): "
                     + ", ".join(f"{r['variant']} {r['cpu_floor_s'] * 1e3:.0f} ms" for r in s["variants"]))
    lines.append(f"speedup per step (plain / zen): {s['speedup']:.2f}x; load average "
                 f"{', '.join(f'{x:.1f}' for x in s['load_average'])} on {s['cpus']} CPUs")
    return "\n".join(lines)


def plot(s, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    styles = ({"lw": 2.5, "alpha": 0.6, "color": "C0"}, {"ls": "--", "marker": ".", "lw": 1, "color": "C1"})
    for r, style in zip(s["variants"], styles):
        name = "plain DDP" if r["variant"] == "plain" else "DDP + zen hook"
        ax1.plot(range(len(r["loss"])), r["loss"], label=name, **style)
        ax2.plot(range(s["warmup"], s["warmup"] + len(r["step_s"])), [1e3 * t for t in r["step_s"]],
                 label=f"{name}: step", **style)
        ax2.plot(range(s["warmup"], s["warmup"] + len(r["compute_s"])), [1e3 * t for t in r["compute_s"]],
                 label=f"{name}: compute", ls=":", lw=1, color=style["color"])
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss (mean over ranks)")
    ax1.set_title(f"{s['model']}: loss (max abs diff {s['loss_max_abs_diff']:.2g})")
    ax1.legend()
    ax2.set_xlabel("step")
    ax2.set_ylabel("time (ms, slowest rank)")
    ax2.set_ylim(bottom=0)
    ax2.set_title(f"{s['world']} ranks, {s['bandwidth']}: {s['speedup']:.2f}x per step")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(raw, args, world):
    s = summarize(raw, args, world)
    print(format_report(s), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    if args.plot:
        plot(s, args.plot)
    return 0 if s["ok"] else 1


def main(argv=None):
    from launch import launch

    args = build_parser().parse_args(argv)
    ranks = launch(args, bench, args, script=__file__, argv=argv, timeout=args.timeout, pg_timeout=600,
                   cluster_timeout=args.timeout)
    if ranks.results is None:  # another rank, or the emulated cluster's launcher: rank 0 reported
        return ranks.exit_code
    return report(ranks.results[0], args, ranks.world)


if __name__ == "__main__":
    sys.exit(main())
