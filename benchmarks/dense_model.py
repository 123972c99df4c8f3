"""Dense model, compressed gradients: a small GPT-style transformer trained data-parallel with plain DDP,
PowerSGD and zen's top-k hook side by side, for convergence (train and held-out loss) and speed.

    python benchmarks/dense_model.py --world 2 --steps 20 --variants plain,powersgd     # local ranks, loopback
    python benchmarks/dense_model.py --world 4 --steps 300 --json dm.json --plot dm.png
    python benchmarks/dense_model.py --world 8 --bandwidth 1gbit --steps 300 --json dm8.json --plot dm8.png  # root

Model: a decoder-only transformer over the Python standard library's source (StdlibCorpus, word-level,
vocabulary capped at --vocab): token embedding + learned positions, --layers blocks of pre-LayerNorm causal
self-attention (--heads heads) and a 4x MLP (GELU), a final LayerNorm and an output head over the vocabulary
(its own weight, or the token embedding's with --tie-head); full softmax cross-entropy on next-token
prediction. Every gradient is dense (the token embedding's has zero rows for the tokens absent from the
batch, all others are full), so the compressors, not the data, make them sparse.

Data: each rank's batch at each step is --batch windows of --seq + 1 consecutive tokens at random offsets
(workloads.batch_token_ids, drawn from (seed, rank, step)), from the first 95% of the token stream; the last
5% (the last files of the sorted stdlib) is held out. Evaluation: the mean loss over --eval-batches fixed
held-out batches per rank (the same ones at every evaluation; the mean over ranks), before training, every
--eval-every steps and after the last step, on the module itself, outside the timed steps.

Variants (--variants, any of):

    plain       DDP's own all-reduce
    powersgd    DDP + torch's powerSGD_hook, PowerSGDState(matrix_approximation_rank=--powersgd-rank,
                start_powerSGD_iter=--warmup-steps), error feedback and warm start on (torch's defaults);
                a bucket's collectives start after the previous bucket's have finished (gloo pairs
                collectives by issue order, and the hook issues P and Q from completion callbacks)
    zen         DDP + zen.zen_hook with zen.ZenState(topk_ratio=--topk-ratio, warmup_steps=--warmup-steps):
                each parameter's top-k entries by magnitude, error feedback, zen's sparse all-reduce
    zen-global  the same with global_topk=True: the partitions' owners keep only the global top k
    zen-mc      zen with DGC's momentum correction, ZenState(momentum=0.9), and SGD without momentum
                (--optimizer sgd only; the dense warm-up steps then run without momentum)

All variants start from the same weights and see the same batches; every step runs every variant, in
alternating order (the listed order on even steps, reversed on odd ones), so drifting machine load hits all
alike. Optimizer: SGD with momentum 0.9 or AdamW (--optimizer), the same --lr for all; gradients are
clipped to norm --clip after the all-reduce (the same on every rank).

Per variant and step: the loss (mean over ranks), the step's time (forward, backward with the all-reduce or
hook, clipping, optimizer step; after a barrier; the slowest rank's), its cumulative sum (the wall clock of
training, without evaluations and barriers), the CPU time of a rank's process (mean over ranks) and the bytes
one rank sends (mean over ranks):

    plain       what a ring all-reduce of every gradient sends: 2 (n-1)/n x 4 bytes x parameters (n ranks)
    powersgd    the same ring formula over the elements the hook all-reduces, counted per bucket as the
                hook decides them: the whole bucket before start_powerSGD_iter, then for each gradient
                viewed as a matrix (rows = its first dim, cols = the rest) with r = min(rows, cols, rank)
                and (rows + cols) r * min_compression_rate < rows cols: P (rows x r) and Q (cols x r);
                every other gradient (vectors, small matrices) whole
    zen         measured: the difference of state.summary()["bytes_sent"] over the step

Reported per variant: final train loss (the mean of the last 10 steps' losses), final held-out loss and
their relative gap to the baseline (plain if run, else the first variant), the median step time over the
steps after the warm-up (step >= --warmup-steps, where every compressor is compressing; all steps if there
are none), the speedup against the baseline's median, the bytes sent per rank per step after the warm-up,
and the compression against a ring all-reduce of the whole model. Checks: every loss finite, and each
variant's parameters identical on every rank at the end (a compressor must hand every rank the same
update); a failed check makes the exit code 1. On one machine (loopback or the emulated cluster) the "CPU
floor" = world x CPU per rank / cores is the least a step can take there: a step near it measures the
machine's cores, not the network.
"""
import argparse
import copy
import itertools
import json
import math
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VARIANTS = ("plain", "powersgd", "zen", "zen-global", "zen-mc")
HELD_OUT = 0.05      # the last 5% of the token stream is never trained on
LAST_STEPS = 10      # final train loss: the mean of this many last steps


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4, help="ranks to start on this machine (default 4)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--variants", default="plain,powersgd,zen",
                   help=f"comma-separated, any of {', '.join(VARIANTS)} (default plain,powersgd,zen); a zen "
                        "variant may carry its own settings: NAME[/RATIO][/warmN][/rampN], e.g. zen/0.05/ramp100")
    p.add_argument("--seed", type=int, default=0)
    # compression
    p.add_argument("--topk-ratio", type=float, default=0.01, help="zen: fraction of entries sent (default 0.01)")
    p.add_argument("--warmup-steps", type=int, default=10,
                   help="zen and powersgd: steps with uncompressed all-reduce first (>= 2; default 10)")
    p.add_argument("--density-ramp", type=int, default=None,
                   help="zen: over this many steps after the warm-up the ratio falls from 1 to --topk-ratio "
                        "(DGC's warm-up; default none)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="powersgd: matrix approximation rank (default 4)")
    # optimisation
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"], help="SGD with momentum 0.9, or AdamW")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: sgd 0.1, adamw 1e-3)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="default 0 (AdamW's decoupled decay too)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip after the all-reduce; 0: none")
    # model and data
    p.add_argument("--vocab", type=int, default=8000, help="vocabulary cap (default 8000)")
    p.add_argument("--dim", type=int, default=128, help="d_model (default 128)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq", type=int, default=64, help="context length in tokens (default 64)")
    p.add_argument("--batch", type=int, default=8, help="windows per rank per step (default 8)")
    p.add_argument("--tie-head", action="store_true", help="the output head shares the token embedding")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb (default DDP's)")
    p.add_argument("--eval-every", type=int, default=25, help="held-out evaluation every this many steps")
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank (default 4)")
    # where and what to write
    p.add_argument("--bandwidth", default=None, help="emulated link rate, e.g. 1gbit (runs an emulated cluster, root)")
    p.add_argument("--latency", default="0ms", help="emulated one-way link latency (needs sch_netem)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run (default 3600)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of the loss curves and step times here")
    p.add_argument("--from-env", action="store_true", help=argparse.SUPPRESS)  # one rank, launched by torchrun/cluster
    return p


def variant_options(spec, args):
    """(name, topk ratio, warm-up steps, density ramp) of a variant spec NAME[/RATIO][/warmN][/rampN]: a zen
    variant's own settings, where given, else the command line's (e.g. zen/0.05/warm50/ramp100)."""
    name, *options = spec.split("/")
    ratio, warmup, ramp = args.topk_ratio, args.warmup_steps, args.density_ramp
    for option in options:
        if option.startswith("warm"):
            warmup = int(option[4:])
        elif option.startswith("ramp"):
            ramp = int(option[4:])
        else:
            ratio = float(option)
    return name, ratio, warmup, ramp


def _options_ok(spec):
    try:
        _, ratio, warmup, ramp = variant_options(spec, argparse.Namespace(topk_ratio=0.01, warmup_steps=2,
                                                                           density_ramp=None))
    except ValueError:
        return False
    return (spec.startswith("zen") or "/" not in spec) and 0 < ratio <= 1 and warmup >= 2 and (ramp or 1) >= 1


def check_args(args, parser):
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v.split("/")[0] not in VARIANTS or not _options_ok(v)]
    if not variants or unknown or len(set(variants)) != len(variants):
        parser.error(f"--variants: a comma-separated list of distinct names from {', '.join(VARIANTS)}; "
                     f"got {args.variants!r}")
    if any(v.split("/")[0] == "zen-mc" for v in variants) and args.optimizer != "sgd":
        parser.error("--variants zen-mc: momentum correction replaces SGD's momentum; it needs --optimizer sgd")
    if args.warmup_steps < 2:
        parser.error("--warmup-steps must be >= 2: DDP rebuilds its buckets after the first step, and "
                     "PowerSGD's residuals are kept per bucket")
    if args.dim % args.heads:
        parser.error(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if not 0 < args.topk_ratio <= 1:
        parser.error("--topk-ratio must be in (0, 1]")
    if min(args.steps, args.batch, args.seq, args.eval_every, args.eval_batches, args.layers) < 1:
        parser.error("--steps, --batch, --seq, --eval-every, --eval-batches and --layers must be >= 1")
    args.variant_list = variants
    if args.lr is None:
        args.lr = 0.1 if args.optimizer == "sgd" else 1e-3
    return args


# ----------------------------------------------------------------------------------------------------------
# model


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token embedding + learned positions -> blocks -> LayerNorm -> head; returns the mean next-token loss.
    Weights as GPT-2: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 layers)), zero biases."""

    def __init__(self, vocab, dim, layers, heads, seq, tie_head=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie_head:
            self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.tok(inputs) + self.pos(torch.arange(inputs.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------------------------------------
# data


def streams(args):
    """The corpus and its two streams, training and held-out, each with the `ids` and `num_tokens`
    that workloads.batch_token_ids reads."""
    import workloads

    corpus = workloads.StdlibCorpus(args.vocab)
    cut = int(corpus.num_tokens * (1 - HELD_OUT))
    train = types.SimpleNamespace(ids=corpus.ids[:cut], num_tokens=cut)
    held_out = types.SimpleNamespace(ids=corpus.ids[cut:], num_tokens=corpus.num_tokens - cut)
    return corpus, train, held_out


def batch(stream, args, rank, step):
    """One rank's batch: --batch windows of --seq + 1 tokens, (batch, seq + 1)."""
    import workloads

    w = args.seq + 1
    return workloads.batch_token_ids(stream, args.batch * w, rank, step, args.seed, window=w).view(args.batch, w)


# ----------------------------------------------------------------------------------------------------------
# variants


def counting_powersgd_hook(count):
    """torch's powerSGD_hook, adding to count["elements"] the elements it all-reduces (see the module's
    docstring), with one bucket's collectives after the previous bucket's.

    Counting: the hook decides and counts its tensors before it returns its future. Once PowerSGD has
    started, its state adds (rows + cols) r for every compressed gradient and rows x cols for every other
    one to total_numel_after_compression; before, the whole bucket is all-reduced.

    Order: the hook all-reduces P and Q from the completion callbacks of the all-reduce before (on gloo's
    threads), while DDP calls it for the next bucket from the backward pass. Gloo pairs collectives by the
    order each rank issues them, so one rank's Q can meet another's next-bucket all-reduce: a size mismatch,
    and gloo aborts the process. So before a bucket's first collective this waits for the previous bucket's
    chain (the first bucket's still overlaps the rest of the backward pass; the last waits for it)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    pending = []

    def powersgd_counting_hook(state, bucket):
        while pending:
            pending.pop().wait()
        if state.iter < state.start_powerSGD_iter:
            count["elements"] += bucket.buffer().numel()
            return psgd.powerSGD_hook(state, bucket)
        before = state.total_numel_after_compression
        fut = psgd.powerSGD_hook(state, bucket)
        count["elements"] += state.total_numel_after_compression - before
        if not bucket.is_last():
            pending.append(fut)
        return fut

    return powersgd_counting_hook


def ring_bytes(elements, world, element_size=4):
    return 2 * (world - 1) / world * element_size * elements


class Variant:
    """One variant on this rank: its DDP model, optimizer, hook state (None for plain) and bytes_sent(),
    this rank's bytes sent so far."""

    def __init__(self, name, model, args, world):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.name, self.world, self.steps, self.state = name, world, 0, None
        self.ddp = DDP(copy.deepcopy(model), bucket_cap_mb=args.bucket_cap_mb)
        self.numel = sum(p.numel() for p in model.parameters())
        if name == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            self.state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=args.warmup_steps)
            self.count = {"elements": 0}
            self.ddp.register_comm_hook(self.state, counting_powersgd_hook(self.count))
        elif name.split("/")[0] in ("zen", "zen-global", "zen-mc"):
            import zen

            name, ratio, warmup, ramp = variant_options(name, args)
            self.state = zen.ZenState(topk_ratio=ratio, warmup_steps=warmup, density_ramp=ramp,
                                      global_topk=name == "zen-global", momentum=0.9 if name == "zen-mc" else None)
            self.ddp.register_comm_hook(self.state, zen.zen_hook)
        params = self.ddp.parameters()
        if args.optimizer == "sgd":
            momentum = 0.0 if name == "zen-mc" else 0.9  # zen-mc: the hook accumulates the momentum
            self.opt = torch.optim.SGD(params, lr=args.lr, momentum=momentum, weight_decay=args.weight_decay)
        else:
            self.opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)

    def bytes_sent(self):
        if self.name == "plain":
            return ring_bytes(self.numel, self.world) * self.steps
        if self.name == "powersgd":
            return ring_bytes(self.count["elements"], self.world)
        return float(self.state.summary()["bytes_sent"])

    def step(self, tokens, clip):
        loss = self.ddp(tokens)
        loss.backward()
        if clip > 0:
            nn.utils.clip_grad_norm_(self.ddp.parameters(), clip)
        self.opt.step()
        self.steps += 1
        return loss


# ----------------------------------------------------------------------------------------------------------
# one rank's run


def evaluate(module, held):
    with torch.no_grad():
        return statistics.mean(module(b).item() for b in held)


def bench(rank, world, args):
    torch.set_num_threads(1)
    variants = args.variant_list
    corpus, train, held_out = streams(args)
    held = [batch(held_out, args, rank, ("eval", i)) for i in range(args.eval_batches)]
    torch.manual_seed(args.seed)
    model = GPT(corpus.vocab_size, args.dim, args.layers, args.heads, args.seq, args.tie_head)
    numel = sum(p.numel() for p in model.parameters())
    runs = {v: Variant(v, model, args, world) for v in variants}

    S = args.steps
    step_s = {v: torch.zeros(S, dtype=torch.float64) for v in variants}
    cpu_s = {v: torch.zeros(S, dtype=torch.float64) for v in variants}
    losses = {v: torch.zeros(S, dtype=torch.float64) for v in variants}
    sent = {v: torch.zeros(S, dtype=torch.float64) for v in variants}
    eval_steps = [0] + [s for s in range(args.eval_every, S, args.eval_every)] + [S]
    evals = {v: torch.zeros(len(eval_steps), dtype=torch.float64) for v in variants}
    for v in variants:
        evals[v][0] = evaluate(runs[v].ddp.module, held)
    t_start = time.perf_counter()
    for step in range(S):
        tokens = batch(train, args, rank, step)
        for v in (variants if step % 2 == 0 else variants[::-1]):
            run = runs[v]
            before = run.bytes_sent()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = run.step(tokens, args.clip)
            t1, c1 = time.perf_counter(), time.process_time()
            run.opt.zero_grad(set_to_none=True)
            step_s[v][step], cpu_s[v][step], losses[v][step] = t1 - t0, c1 - c0, loss.item()
            sent[v][step] = run.bytes_sent() - before
        if step + 1 in eval_steps:
            for v in variants:
                evals[v][eval_steps.index(step + 1)] = evaluate(runs[v].ddp.module, held)
    elapsed = time.perf_counter() - t_start

    # the slowest rank's step times; means over ranks of the losses, CPU times and bytes
    for v in variants:
        dist.all_reduce(step_s[v], op=dist.ReduceOp.MAX)
        for t in (losses[v], cpu_s[v], sent[v], evals[v]):
            dist.all_reduce(t)
            t /= world
    # each variant's parameters against rank 0's
    rank_diff = torch.zeros(len(variants), dtype=torch.float64)
    for i, v in enumerate(variants):
        flat = torch.cat([p.detach().reshape(-1) for p in runs[v].ddp.module.parameters()])
        ref = flat.clone()
        dist.broadcast(ref, 0)
        rank_diff[i] = (flat - ref).abs().max().item()
    dist.all_reduce(rank_diff, op=dist.ReduceOp.MAX)
    zen_summaries = {}
    for v in variants:
        if v.startswith("zen"):
            s = runs[v].state.summary()
            zen_summaries[v] = {"schemes": s["schemes"], "dense_bytes": s["dense_bytes"],
                                "bytes_sent": s["bytes_sent"], "seconds": s["seconds"]}

    return {
        "step_s": {v: step_s[v].tolist() for v in variants}, "cpu_s": {v: cpu_s[v].tolist() for v in variants},
        "loss": {v: losses[v].tolist() for v in variants}, "bytes": {v: sent[v].tolist() for v in variants},
        "eval_steps": eval_steps, "eval_loss": {v: evals[v].tolist() for v in variants},
        "rank_diff": dict(zip(variants, rank_diff.tolist())), "zen_summary_rank0": zen_summaries,
        "params": numel, "vocab": corpus.vocab_size, "corpus_tokens": corpus.num_tokens,
        "held_out_tokens": held_out.num_tokens, "elapsed_s": elapsed,
    }


# ----------------------------------------------------------------------------------------------------------
# report


def summarize(raw, args, world):
    variants = args.variant_list
    S, W = args.steps, args.warmup_steps
    timed = slice(W, S) if S > W else slice(0, S)
    base = "plain" if "plain" in variants else variants[0]
    dense_step = ring_bytes(raw["params"], world)
    rows = {}
    for v in variants:
        steps = raw["step_s"][v]
        cum = list(itertools.accumulate(steps))
        losses = raw["loss"][v]
        b = raw["bytes"][v]
        rows[v] = {
            "variant": v, "loss": losses, "step_s": steps, "cum_s": cum, "cpu_s": raw["cpu_s"][v],
            "bytes_per_step": b, "eval_loss": raw["eval_loss"][v],
            "initial_loss": losses[0], "final_train_loss": statistics.mean(losses[-LAST_STEPS:]),
            "final_eval_loss": raw["eval_loss"][v][-1],
            "step_median_s": statistics.median(steps[timed]), "step_min_s": min(steps[timed]),
            "step_max_s": max(steps[timed]), "cpu_per_rank_median_s": statistics.median(raw["cpu_s"][v][timed]),
            "train_s": cum[-1], "bytes_per_step_after_warmup": statistics.mean(b[timed]),
            "bytes_total": sum(b), "rank_max_abs_diff": raw["rank_diff"][v],
            "finite": all(math.isfinite(x) for x in losses + raw["eval_loss"][v]),
        }
    ref = rows[base]
    for r in rows.values():
        r["train_gap"] = (r["final_train_loss"] - ref["final_train_loss"]) / ref["final_train_loss"]
        r["eval_gap"] = (r["final_eval_loss"] - ref["final_eval_loss"]) / ref["final_eval_loss"]
        r["speedup"] = ref["step_median_s"] / r["step_median_s"]
        r["compression"] = dense_step / r["bytes_per_step_after_warmup"] if r["bytes_per_step_after_warmup"] else None
    shared = not args.from_env or "ZEN_CLUSTER_BANDWIDTH_BPS" in os.environ
    cores = os.cpu_count() or 1
    for r in rows.values():
        r["cpu_floor_s"] = world * r["cpu_per_rank_median_s"] / cores if shared else None
    ok = all(r["finite"] and r["rank_max_abs_diff"] == 0.0 for r in rows.values())
    config = {k: getattr(args, k) for k in ("steps", "seed", "topk_ratio", "warmup_steps", "density_ramp",
                                              "powersgd_rank", "optimizer", "lr", "weight_decay", "clip", "dim",
                                              "layers", "heads", "seq", "batch", "tie_head", "bucket_cap_mb",
                                              "eval_every", "eval_batches")}
    return {
        "benchmark": "dense_model", "world": world, "bandwidth": args.bandwidth or "loopback",
        "latency": args.latency, "config": config, "params": raw["params"], "vocab": raw["vocab"],
        "corpus_tokens": raw["corpus_tokens"], "held_out_tokens": raw["held_out_tokens"],
        "tokens_per_rank_per_step": args.batch * args.seq, "baseline": base,
        "timed_steps": [timed.start, timed.stop], "dense_ring_bytes_per_step": dense_step,
        "eval_steps": raw["eval_steps"], "variants": [rows[v] for v in variants],
        "zen_summary_rank0": raw["zen_summary_rank0"], "elapsed_s": raw["elapsed_s"], "ok": ok,
        "load_average": os.getloadavg(), "cpus": os.cpu_count(), "torch": torch.__version__,
    }


def format_report(s):
    c = s["config"]
    head = (f"{'variant':>10} {'loss0':>7} {'train':>7} {'gap':>7} {'eval':>7} {'gap':>7} {'step ms':>8} "
            f"{'CPU ms':>7} {'speedup':>7} {'MB/step':>8} {'x fewer':>7} {'train s':>8}")
    lines = [
        f"dense_model: GPT {c['layers']} layers x d{c['dim']} ({c['heads']} heads), vocab {s['vocab']}, "
        f"{'tied' if c['tie_head'] else 'untied'} head, {s['params'] / 1e6:.2f}M parameters; "
        f"{s['world']} ranks, {s['bandwidth']}; batch {c['batch']} x {c['seq']} tokens/rank; "
        f"{c['optimizer']} lr {c['lr']:g}, clip {c['clip']:g}; {c['steps']} steps, warm-up {c['warmup_steps']} "
        f"(top-k {c['topk_ratio']:g}, PowerSGD rank {c['powersgd_rank']})",
        f"train = mean loss of the last {min(LAST_STEPS, c['steps'])} steps; eval = held-out loss after the last "
        f"step; gap = relative to {s['baseline']}; step ms = median of the slowest rank over steps "
        f"{s['timed_steps'][0]}..{s['timed_steps'][1] - 1}; MB/step = sent per rank per step after the warm-up",
        head, "-" * len(head)]
    for r in s["variants"]:
        fewer = f"{r['compression']:.1f}" if r["compression"] else "-"
        lines.append(f"{r['variant']:>10} {r['initial_loss']:>7.3f} {r['final_train_loss']:>7.3f} "
                     f"{100 * r['train_gap']:>+6.1f}% {r['final_eval_loss']:>7.3f} {100 * r['eval_gap']:>+6.1f}% "
                     f"{r['step_median_s'] * 1e3:>8.1f} {r['cpu_per_rank_median_s'] * 1e3:>7.1f} "
                     f"{r['speedup']:>6.2f}x {r['bytes_per_step_after_warmup'] / 1e6:>8.3f} {fewer:>7} "
                     f"{r['train_s']:>8.1f}")
    lines.append("held-out loss at steps " + ", ".join(str(x) for x in s["eval_steps"]) + ":")
    for r in s["variants"]:
        lines.append(f"{r['variant']:>10}: " + " ".join(f"{x:.3f}" for x in r["eval_loss"]))
    for v, z in s["zen_summary_rank0"].items():
        lines.append(f"{v}: calls {z['schemes']}")
    if s["variants"][0]["cpu_floor_s"] is not None:
        lines.append(f"CPU floor (all ranks' CPU time per step / {s['cpus']} cores of this machine): "
                     + ", ".join(f"{r['variant']} {r['cpu_floor_s'] * 1e3:.0f} ms" for r in s["variants"]))
    bad = [r["variant"] for r in s["variants"] if not r["finite"] or r["rank_max_abs_diff"] != 0.0]
    lines.append(("checks OK" if s["ok"] else f"checks FAILED for {', '.join(bad)}") +
                 " (losses finite; parameters identical on every rank: max diff to rank 0 "
                 + ", ".join(f"{r['variant']} {r['rank_max_abs_diff']:.3g}" for r in s["variants"]) + ")")
    lines.append(f"load average {', '.join(f'{x:.1f}' for x in s['load_average'])} on {s['cpus']} CPUs; "
                 f"{s['elapsed_s']:.0f} s in the training loop")
    return "\n".join(lines)


def plot(s, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, r in enumerate(s["variants"]):
        color = f"C{i}"
        # step i's loss is the model's after i updates, taken when the wall clock stood at the first i steps
        steps = range(len(r["loss"]))
        start_s = [0.0] + r["cum_s"][:-1]
        eval_s = [0.0 if k == 0 else r["cum_s"][k - 1] for k in s["eval_steps"]]
        axes[0].plot(steps, r["loss"], color=color, lw=0.8, alpha=0.35)
        axes[0].plot(s["eval_steps"], r["eval_loss"], color=color, marker="o", ms=3, label=r["variant"])
        axes[1].plot(start_s, r["loss"], color=color, lw=0.8, alpha=0.35)
        axes[1].plot(eval_s, r["eval_loss"], color=color, marker="o", ms=3, label=r["variant"])
        axes[2].plot(steps, [1e3 * t for t in r["step_s"]], color=color, lw=1,
                     label=f"{r['variant']} ({r['step_median_s'] * 1e3:.0f} ms)")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("loss (faint: train, mean over ranks; dots: held-out)")
    axes[0].set_title("loss against steps")
    axes[1].set_xlabel("training wall clock (s, sum of the slowest rank's steps)")
    axes[1].set_title("loss against time")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("step time (ms, slowest rank)")
    axes[2].axvline(s["config"]["warmup_steps"] - 0.5, color="grey", ls=":", lw=1)
    axes[2].set_ylim(bottom=0)
    axes[2].set_title(f"{s['world']} ranks, {s['bandwidth']}: step time")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"GPT {s['config']['layers']}x{s['config']['dim']}, {s['params'] / 1e6:.2f}M parameters, "
                 f"{s['config']['optimizer']} lr {s['config']['lr']:g}", fontsize=10)
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

    parser = build_parser()
    args = check_args(parser.parse_args(argv), parser)
    ranks = launch(args, bench, args, script=__file__, argv=argv, timeout=args.timeout, pg_timeout=600,
                   cluster_timeout=args.timeout)
    if ranks.results is None:  # another rank, or the emulated cluster's launcher: rank 0 reported
        return ranks.exit_code
    return report(ranks.results[0], args, ranks.world)


if __name__ == "__main__":
    sys.exit(main())
