"""Microbenchmark of zen's all-reduce schemes against dense allreduce (nccl-tests style).

    python benchmarks/allreduce.py                                    # 4 local ranks on loopback
    python benchmarks/allreduce.py --world 8 --bandwidth 1gbit        # emulated cluster (root)
    python benchmarks/allreduce.py --workload text --json out.json --plot out.png
    python benchmarks/allreduce.py --workload gpt-topk      # the top-1% gradient of dense_model.py's GPT
    python benchmarks/allreduce.py --workload deepfm        # the embedding gradient of train.py's DeepFM

Workloads (--workload), each rank its own data, deterministic from (--seed, rank, step):

    uniform, zipf  --sizes x --densities synthetic 1-D tensors (workloads.uniform, workloads.zipf)
    text           the embedding-table gradient [vocab, --text-dim] of --text-batch tokens of real text
                   (workloads.embedding_gradient), reduced as rows
    gpt-topk       the GPT of benchmarks/dense_model.py (its defaults, or --gpt-vocab, --gpt-dim, --gpt-layers),
                   the same weights on every rank (a fixed seed), forward and backward on the rank's own batch
                   (dense_model.batch); every parameter's gradient flattened into one 1-D tensor, of which the
                   --topk-ratio largest-magnitude entries are kept and the rest zeroed (as DGC and Ok-Topk do
                   before their all-reduce), reduced as elements
    deepfm         the gradient of the DeepFM embedding table of benchmarks/train.py ((--fm-fields x --fm-vocab)
                   rows x --fm-dim), from the real forward and backward of --fm-batch samples per rank whose
                   ids are Zipf(--fm-alpha) per field (train.deepfm_setup): non-zero on the rows the batch
                   touched, reduced as rows

Every iteration runs the schemes side by side on the same data, in one order (shuffled once by a seed that
every rank shares), as a training step repeats its buckets' calls in one order: zen plans its push's slots
from the call that last followed the same call, which a new order every iteration would defeat. A call right
after a heavy one runs ~10% slower, so which scheme follows which is up to the seed. Each call is timed from
the last rank's start to the last rank's end (where ranks share a host's clock; else the slowest rank's own
time: ``zen.measurement.timing.call_seconds``), and every result is compared with torch.distributed.all_reduce
of the same data (#wrong counts elements off by more than the dtype's tolerance). "auto" is settled first (its measuring and trial calls, untimed; see run_case). One row per
(size, density, scheme):

    time     median (min, max) over iterations of the time of one call, as above
    algbw    numel * s_v / time, as nccl-tests defines it (GB/s)
    sent     bytes one rank sent in one call (mean over ranks), as the scheme reports it
    host MB  on an emulated cluster: bytes one host's network card sent in one call (mean over hosts, IP and
             TCP headers included), from the card's counter (a scheme@node runs zen.all_reduce(hierarchy="node"))
    speedup  dense median / scheme median
    pred     the cost model's time for the scheme (what ``zen.predict`` of the same tensor gives: the
             measured workload and the group's profile, probed once at the start; both are in the JSON)
    imb      max/mean load of the n partitions of the union (rows of a 2-D gradient), by zen's hash and by a
             contiguous split

Below the table, where each scheme's time goes (mean over ranks of the per-phase medians, ms), for the
schemes that report phases, the block size its calls used (the text workload is the embedding table
[vocab, dim], which zen reduces as rows), and local/copy: its local phases (scan, partition, aggregate,
encode, decode, merge, sum, scatter) over one ``copy_`` of the gradient timed in the same run, a ratio that
does not depend on the machine.

Last, a verdict read off the table (:func:`verdict`): the fastest scheme of each case, zen's time against it,
and what would move zen ahead (more ranks, more overlap between ranks' indices, slower links), with the
command that shows it on an emulated cluster.
"""
import argparse
import dataclasses
import json
import logging
import math
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
WORKLOADS = ("uniform", "zipf", "text", "gpt-topk", "deepfm")  # --workload: see workload_tensor
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def parse_size(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="ranks to start on this machine")
    p.add_argument("--sizes", default="4M", help="comma-separated element counts, e.g. 1M,16M (uniform and zipf "
                   "only: the other workloads' sizes are their tables' or model's)")
    p.add_argument("--densities", default="0.001,0.01,0.1", help="comma-separated per-rank densities (uniform and "
                   "zipf only)")
    p.add_argument("--workload", default="uniform", choices=WORKLOADS,
                   help="the tensor every scheme sums (see the module's docstring): synthetic (uniform, zipf), an "
                        "embedding gradient of real text (text), the top-k gradient of dense_model.py's GPT "
                        "(gpt-topk), or the embedding gradient of train.py's DeepFM from its real forward and "
                        "backward (deepfm)")
    p.add_argument("--text-dim", type=int, default=128, help="embedding dim of the text workload")
    p.add_argument("--text-batch", type=int, default=2048, help="tokens per rank per step of the text workload")
    gpt = dense_model_defaults()
    p.add_argument("--gpt-vocab", type=int, default=gpt.vocab, help="gpt-topk: the GPT's vocabulary cap "
                   "(dense_model.py's default)")
    p.add_argument("--gpt-dim", type=int, default=gpt.dim, help=f"gpt-topk: the GPT's d_model, a multiple of its "
                   f"{gpt.heads} heads (dense_model.py's default)")
    p.add_argument("--gpt-layers", type=int, default=gpt.layers, help="gpt-topk: the GPT's transformer blocks "
                   "(dense_model.py's default)")
    p.add_argument("--topk-ratio", type=float, default=0.01, help="gpt-topk: the fraction of the flattened "
                   "gradient's entries kept (the largest in magnitude)")
    p.add_argument("--fm-fields", type=int, default=26, help="deepfm: categorical fields (Criteo's 26)")
    p.add_argument("--fm-vocab", type=int, default=10000, help="deepfm: ids per field")
    p.add_argument("--fm-alpha", type=float, default=1.1, help="deepfm: the Zipf skew of each field's ids")
    p.add_argument("--fm-batch", type=int, default=256, help="deepfm: samples per rank per step")
    p.add_argument("--fm-dim", type=int, default=16, help="deepfm: the embedding table's width")
    p.add_argument("--schemes", default=None, help="comma-separated, default: every scheme (zen.SCHEMES); a scheme "
                   "with @node runs as a node call (zen.all_reduce(hierarchy='node'): dense inside each host, the "
                   "scheme across hosts), e.g. zen,zen@node,dense@node")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="with --bandwidth: ranks sharing each emulated host (its loopback between them)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-seconds", type=float, default=1.0,
                   help="time a short call more than --iters times, until its calls add up to this")
    p.add_argument("--max-iters", type=int, default=41, help="at most this many timed calls of a short call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth", default=None, help="emulated link rate, e.g. 1gbit (runs an emulated cluster, root)")
    p.add_argument("--bandwidth-per-core", default=None,
                   help="instead of --bandwidth: each rank gets this rate per core of this machine, a host's link "
                        "rate x cores / ranks (e.g. 1gbit: 250 Mbit/s at 8 ranks on 2 cores); the wire, not the "
                        "shared cores, then sets the time")
    p.add_argument("--latency", default="0ms", help="emulated one-way link latency, e.g. 0.1ms")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG here: speedup vs density, hash vs contiguous imbalance")
    p.add_argument("--no-predict", action="store_true", help="skip the cost model's prediction column")
    p.add_argument("--schedule", default="auto", choices=["auto", "direct", "pairwise", "ring", "bruck"],
                   help="the exchanges' schedule (zen.schedules): auto chooses per call; the others force one for "
                        "every exchange of every scheme (ring, bruck: the all-gathers; the all-to-alls pairwise)")
    p.add_argument("--from-env", action="store_true", help=argparse.SUPPRESS)  # one rank, launched by torchrun/cluster
    return p


def workload_tensor(args, numel, density, rank, step):
    import workloads

    dtype = DTYPES[args.dtype]
    if args.workload == "uniform":
        return workloads.uniform(numel, density, rank, args.seed + step, dtype)
    if args.workload == "zipf":
        return workloads.zipf(numel, density, rank, args.seed + step, dtype)
    if args.workload == "gpt-topk":
        return gpt_topk_gradient(args, rank, step)
    if args.workload == "deepfm":
        return deepfm_gradient(args, rank, step)
    corpus = workloads.StdlibCorpus()
    grad = workloads.embedding_gradient(corpus, args.text_dim, args.text_batch, rank, step, args.seed, dtype)
    return grad.view(corpus.vocab_size, args.text_dim)  # the table's shape: zen may reduce it as rows


def dense_model_defaults():
    """benchmarks/dense_model.py's own defaults (vocab, dim, layers, heads, seq, batch, tie_head): the GPT of the
    gpt-topk workload is that script's model, at its sizes unless --gpt-* say otherwise."""
    import dense_model

    return dense_model.build_parser().parse_args([])


def gpt_options(args):
    """dense_model.py's options for the gpt-topk workload: its defaults, with --gpt-vocab, --gpt-dim, --gpt-layers
    and --seed."""
    options = dense_model_defaults()
    options.vocab, options.dim, options.layers, options.seed = args.gpt_vocab, args.gpt_dim, args.gpt_layers, args.seed
    return options


def _gpt(options, vocab_size):
    """dense_model.py's GPT as its ranks build it: torch.manual_seed(seed), so the same weights on every rank (the
    global generator left as it was)."""
    import dense_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        return dense_model.GPT(vocab_size, options.dim, options.layers, options.heads, options.seq, options.tie_head)


def gpt_numel(args) -> int:
    """The elements of the gpt-topk workload's tensor: the GPT's parameters (the vocabulary is the capped corpus's,
    as dense_model.py's). The model is built and dropped (tens of ms; the meta device would import some 800 more
    modules, 70 MB a rank)."""
    import dense_model

    options = gpt_options(args)
    corpus, _, _ = dense_model.streams(options)
    return sum(p.numel() for p in _gpt(options, corpus.vocab_size).parameters())


# Each (workload, its options, rank, step)'s tensor, made once per process: a benchmark's repeated calls (and its
# cases) get a copy instead of another forward and backward.
_CACHE = {}


def _cached(key, make):
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key].clone()


def _no_exact_zeros(values, dtype):
    """values in dtype, an entry that rounds to exactly 0 set to dtype's smallest normal (a zero would silently
    lower the density the workload claims)."""
    values = values.to(dtype)
    values[values == 0] = torch.finfo(dtype).tiny
    return values


def gpt_topk_gradient(args, rank, step):
    """The gpt-topk workload: dense_model.py's GPT (the same weights on every rank), forward and backward on this
    rank's batch for (seed, rank, step) (dense_model.batch: its --batch windows of --seq + 1 tokens of the
    training stream), every parameter's gradient flattened into one 1-D tensor in the order of parameters(), of
    which k = round(--topk-ratio x numel) entries, the largest in magnitude, are kept and the rest zeroed: exactly
    k non-zeros per rank. Cached per (options, rank, step)."""
    key = ("gpt-topk", args.seed, args.gpt_vocab, args.gpt_dim, args.gpt_layers, args.topk_ratio, args.dtype,
           rank, step)
    return _cached(key, lambda: _gpt_topk(args, rank, step))


def _gpt_topk(args, rank, step):
    import dense_model

    options = gpt_options(args)
    corpus, train, _ = dense_model.streams(options)
    model = _gpt(options, corpus.vocab_size)
    model(dense_model.batch(train, options, rank, step)).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    k = max(1, min(flat.numel(), round(args.topk_ratio * flat.numel())))
    kept = flat.abs().topk(k, sorted=False).indices
    dtype = DTYPES[args.dtype]
    out = torch.zeros(flat.numel(), dtype=dtype)
    out[kept] = _no_exact_zeros(flat[kept], dtype)
    return out


def deepfm_options(args):
    """train.py's options for its DeepFM (train.deepfm_setup) from --fm-*."""
    return argparse.Namespace(fields=args.fm_fields, field_vocab=args.fm_vocab, batch=args.fm_batch,
                              zipf_alpha=args.fm_alpha, fm_dim=args.fm_dim, seed=args.seed)


def deepfm_gradient(args, rank, step):
    """The deepfm workload: the gradient of train.py's DeepFM embedding table, [fields x vocab, dim], from the real
    forward and backward (binary cross-entropy) of this rank's batch for (seed, rank, step), as train.py's
    deepfm_setup draws it: --fm-batch samples, each field's id Zipf(--fm-alpha) over --fm-vocab ids
    (workloads._zipf_draws), labels from its fixed hidden logistic model; the model's weights the same on every
    rank (a fixed seed). Non-zero on exactly the rows the batch touched (an entry of such a row that is exactly 0
    in the dtype is set to its smallest normal). Cached per (options, rank, step)."""
    key = ("deepfm", args.seed, args.fm_fields, args.fm_vocab, args.fm_alpha, args.fm_batch, args.fm_dim,
           args.dtype, rank, step)
    return _cached(key, lambda: _deepfm(args, rank, step))


def deepfm_batch_ids(args, rank, step):
    """The table rows (field offset + id) of this rank's batch at step: (--fm-batch, --fm-fields)."""
    return _deepfm_setup(args, rank, step)[1][step][0]


def _deepfm_setup(args, rank, step):
    import train

    # Every step's batch is drawn from its own generator (seed, rank, step): the setup's first step + 1 batches
    # hold the one asked for, whatever the steps before. The model is built under torch.manual_seed(seed).
    with torch.random.fork_rng(devices=[]):
        return train.deepfm_setup(deepfm_options(args), rank, step + 1)


def _deepfm(args, rank, step):
    model, batches, _, _ = _deepfm_setup(args, rank, step)
    ids, labels = batches[step]
    model(ids, labels).backward()
    grad = model.embed.weight.grad
    rows = torch.unique(ids)
    out = torch.zeros(grad.shape, dtype=DTYPES[args.dtype])
    out[rows] = _no_exact_zeros(grad[rows], out.dtype)
    return out


def release_heap():
    """Return the heap's free memory to the system (glibc's malloc_trim), between timed calls. glibc keeps what
    a call freed in its arenas (one per thread: the lane's, gloo's), so every rank would hold its schemes' largest
    buffers for good, and 24-32 ranks would not fit this machine's memory."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None


_LIBC = _glibc()


# Copies of a case's tensor a rank holds at once (the input, the reference, the call's copy, the schemes' and the
# backend's buffers), as the emulated cluster's memory peaks at two tensor sizes imply, with a margin (see main).
TENSOR_COPIES = 18


def cases(args):
    if args.workload == "text":
        import workloads

        corpus = workloads.StdlibCorpus()
        return [(corpus.vocab_size * args.text_dim, None)]
    if args.workload == "gpt-topk":
        return [(gpt_numel(args), args.topk_ratio)]
    if args.workload == "deepfm":
        return [(args.fm_fields * args.fm_vocab * args.fm_dim, None)]
    return [(parse_size(s), float(d)) for s in args.sizes.split(",") for d in args.densities.split(",")]


def resident_bytes(args) -> int:
    """What a rank of the workload holds for the whole run besides the case's tensors: gpt-topk's corpus (the
    token stream its batches are drawn from, int64 ids, kept by StdlibCorpus's memo) is several times its
    tensor's size at the default sizes. (The text workload's corpus is small beside its tensor's copies; the
    models are built, run once and dropped before the calls.)"""
    if args.workload != "gpt-topk":
        return 0
    import dense_model

    return 8 * dense_model.streams(gpt_options(args))[0].num_tokens


def imbalance(loads):
    loads = loads.double()
    return (loads.max() / loads.mean()).item() if loads.sum() > 0 else 1.0


def say(text, progress=None):
    """A progress line on stderr (above tqdm's bar where one is shown); stdout keeps the table alone."""
    if progress is not None and not progress.disable:
        progress.write(f"[allreduce] {text}", file=sys.stderr)
    else:
        print(f"[allreduce] {text}", file=sys.stderr, flush=True)


def show_zen_log(rank):
    """Rank 0 shows the "zen" logger's INFO lines on stderr (the probe says what it measures and for how
    long, then when it is done). The benchmark configures this, never the library."""
    if rank != 0:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[allreduce] %(message)s"))
    log = logging.getLogger("zen")
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def timed_calls(args, warm_up_seconds):
    """Timed calls per scheme: ``--iters``, or more for a short call, up to ``--max-iters``, so that its calls
    add up to ``--min-seconds`` (as estimated by the slowest rank's warm-up call; the same on every rank).
    A call of a few ms on ranks that share cores varies by 3x from call to call (the hand-offs between
    threads wait for a core), where a call of seconds varies by a few %: the median of 5 of the first
    is no estimate of its typical time."""
    slowest = torch.tensor(list(warm_up_seconds.values()), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {s: max(args.iters, min(args.max_iters, math.ceil(args.min_seconds / max(t, 1e-6))))
            for s, t in zip(warm_up_seconds, slowest.tolist())}


def hierarchy_of(scheme: str) -> str:
    """"node" for a scheme named with @node, else "flat" (the benchmark times each protocol as asked)."""
    return "node" if scheme.endswith("@node") else "flat"


def call_once(instances, scheme, x0):
    import zen

    x = x0.clone()
    if scheme == "dense":
        dist.all_reduce(x)
    else:
        zen.all_reduce(x, scheme=instances[scheme], hierarchy=hierarchy_of(scheme))


def host_tx_bytes(call) -> float:
    """Bytes one emulated host's network card sent during ``call()`` (mean over hosts; IP and TCP headers
    included, the barriers around the call subtracted), read from its counter by the host's local rank 0;
    NaN outside an emulated cluster (no GLOO_SOCKET_IFNAME, or its counter unreadable)."""
    path = f"/sys/class/net/{os.environ.get('GLOO_SOCKET_IFNAME', '')}/statistics/tx_bytes"
    readable = torch.tensor([1.0 if os.path.exists(path) and "GLOO_SOCKET_IFNAME" in os.environ else 0.0])
    dist.all_reduce(readable, op=dist.ReduceOp.MIN)
    if not readable.item():
        return float("nan")
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0

    def framed(fn):
        dist.barrier()
        before = int(open(path).read()) if first else 0
        fn()
        dist.barrier()
        return (int(open(path).read()) - before) if first else 0

    delta = torch.tensor([float(framed(call) - framed(lambda: None)), float(first)], dtype=torch.float64)
    dist.all_reduce(delta)
    return delta[0].item() / delta[1].item()


def run_case(args, schemes, numel, density, rank, world, progress=None):
    """Times every scheme on one case; returns a row per scheme (on every rank)."""
    import zen
    from zen import ops
    from zen.auto import Auto
    from zen.measurement import store, timing
    from zen.transport import get_comm

    x0 = workload_tensor(args, numel, density, rank, 0)
    truth = x0.clone()
    dist.all_reduce(truth)
    union_idx = torch.nonzero(truth.view(-1)).view(-1)
    comm = get_comm()
    # The partitions' loads over the entries the hash sees: rows of a 2-D gradient, else elements.
    row = x0.shape[-1] if x0.dim() > 1 else 1
    entries = torch.unique_consecutive(union_idx // row)
    hash_imb = imbalance(torch.bincount(ops.hash_partition(entries.int(), world, comm.seed).long(), minlength=world))
    contiguous_imb = imbalance(torch.bincount(entries * world // max(1, numel // row), minlength=world))
    nnz = torch.tensor([float((x0 != 0).sum())])
    dist.all_reduce(nnz)
    # What zen.predict(x0) does, keeping its inputs for the JSON (so a sweep can be re-predicted offline).
    workload = profile = None
    predicted, predicted_phases = {}, {}  # predicted_phases[scheme][phase], ms
    if not args.no_predict:
        if progress is not None:
            say("measuring the workload for the cost model's prediction", progress)
        workload = zen.measure(x0)
        profile = store.cached_profile() or zen.probe_profile()
        predicted = zen.predict_times(workload, profile)
        if any(s.endswith("@node") for s in schemes):  # the node calls' cross step, on its own group's profile
            predicted.update({f"{name}@node": t for name, t in zen.predict(x0, hierarchy="node").items()})
        predicted_phases = {scheme: {k: v * 1e3 for k, v in phases.items()}
                            for scheme, phases in zen.predict_phases(workload, profile).items()}
    tol = TOLERANCE[x0.dtype]
    truth_max = truth.abs().max().item()
    # An element is wrong where |x - truth| > tol (|truth| + max |truth|); the bound made once per case, and
    # each call checked in place in x: n ranks check at once, so temporaries would count n times.
    bound = truth.abs().add_(truth_max).mul_(tol)
    # A fresh "auto" per case, as in a new job (a pick made for the previous case's density would otherwise
    # carry over). Its measuring and trial calls run first, untimed: the rounds time its steady state, the
    # pick it keeps for the next 100 calls; what settling cost is kept in the row (settle_calls, settle_s).
    instances = {s: Auto() if s == "auto" else s.split("@")[0] for s in schemes}
    settle_calls, settle_start = 0, time.perf_counter()
    if progress is not None and "auto" in instances:
        say("settling auto (its measuring and trial calls, untimed)", progress)
    while "auto" in instances:  # until a call goes straight to the pick
        stats = {}
        zen.all_reduce(x0.clone(), scheme=instances["auto"], stats=stats)
        settle_calls += 1
        if not stats["auto"].get("measured") and not stats["auto"].get("trial"):
            break
    settle_seconds = time.perf_counter() - settle_start
    copies = []  # one copy_ of the gradient, timed in the same run: what local compute is measured against
    blocks = {s: 1 for s in schemes}  # the block size each scheme's calls used
    spans = {s: [] for s in schemes}  # (start, end) of every timed call on this rank
    sent = {s: [] for s in schemes}
    second_rounds = {s: [0, 0] for s in schemes}  # zen's calls whose push / pull took a second exchange
    phases = {s: {} for s in schemes}
    wrong = {s: 0 for s in schemes}
    counts = {s: args.iters for s in schemes}  # timed calls per scheme; grown after the warm-up
    if progress is not None:
        say(f"timing {len(schemes)} schemes: {args.warmup} warm-up rounds, then at least {args.iters}", progress)
    it = 0
    sequence = list(schemes)
    random.Random(args.seed).shuffle(sequence)
    while it < args.warmup + max(counts.values()):
        order = [s for s in sequence if it < args.warmup + counts[s]]
        y = torch.empty_like(x0)
        time.sleep(timing.QUIET_SECONDS)
        start = time.perf_counter()
        y.copy_(x0)
        copies.append(time.perf_counter() - start)
        for scheme in order:
            x = x0.clone()
            stats = {}
            time.sleep(timing.QUIET_SECONDS)  # a quiet start: CPU work just before a call slows it
            dist.barrier()
            start = time.perf_counter()
            if scheme == "dense":
                dist.all_reduce(x)  # the baseline is torch.distributed itself
                stats["bytes_sent"] = 2 * (world - 1) * numel * x.element_size() / world
            else:
                zen.all_reduce(x, scheme=instances[scheme], stats=stats, hierarchy=hierarchy_of(scheme))
            end = time.perf_counter()
            # Nothing else runs until every rank has ended the call: where ranks share cores, the first to
            # end would check their result while the last still finish theirs, and delay the call's end (8
            # ranks on 2 cores, 1 Gbit/s, 4M elements at 0.01%: zen 37-40 ms checked at once, 23-25 after this).
            dist.barrier()
            spans[scheme].append((start, end))
            if it >= args.warmup:
                blocks[scheme] = stats.get("block_size", 1)
                sent[scheme].append(stats.get("bytes_sent", float("nan")))
                second_rounds[scheme][0] += bool(stats.get("push_overflow"))
                second_rounds[scheme][1] += bool(stats.get("pull_overflow"))
                for phase, seconds in stats.get("phases", {}).items():
                    phases[scheme].setdefault(phase, []).append(seconds)
                wrong[scheme] += int(x.sub_(truth).abs_().gt_(bound).sum())
            del x, stats
            release_heap()
        if it == args.warmup - 1:
            counts = timed_calls(args, {s: spans[s][-1][1] - spans[s][-1][0] for s in schemes})
            if progress is not None:
                progress.total += max(counts.values()) - args.iters
        it += 1
        if progress is not None:
            progress.update(1)
    spans = {s: spans[s][args.warmup:] for s in schemes}
    host_bytes = {s: host_tx_bytes(lambda: call_once(instances, s, x0)) for s in schemes}
    # The time of a call: from the last rank's start to the last rank's end (timing.call_seconds).
    clocks = [None] * world
    dist.all_gather_object(clocks, timing.clock_id())
    rows = []
    dense_median = None
    copy_median = torch.tensor([statistics.median(copies[args.warmup:] or copies)], dtype=torch.float64)
    dist.all_reduce(copy_median)
    copy_ms = copy_median.item() * 1e3 / world
    for scheme in schemes:
        every = [None] * world
        dist.all_gather_object(every, spans[scheme])
        t = torch.tensor(timing.call_seconds([[s for s, _ in mine] for mine in every],
                                                 [[e for _, e in mine] for mine in every], clocks), dtype=torch.float64)
        w = torch.tensor([wrong[scheme]], dtype=torch.int64)
        dist.all_reduce(w)
        b = torch.tensor([statistics.mean(sent[scheme])], dtype=torch.float64)
        dist.all_reduce(b)
        second = torch.tensor(second_rounds[scheme], dtype=torch.int64)
        dist.all_reduce(second, op=dist.ReduceOp.MAX)  # (alike on every rank: the agreed counts decide)
        median = statistics.median(t.tolist())
        # Ranks may record different phases (SparCML's folded ranks at world sizes that are no power of 2).
        every_phases = [None] * world
        dist.all_gather_object(every_phases, {p: statistics.median(v) for p, v in phases[scheme].items()})
        names = list(dict.fromkeys(p for mine in every_phases for p in mine))
        if scheme == "dense":
            dense_median = median
        rows.append({
            "scheme": scheme, "numel": numel, "dtype": args.dtype, "world": world, "data": args.workload,
            "nnz_per_rank": nnz.item() / world, "density": nnz.item() / world / numel,
            "union_density": union_idx.numel() / numel, "imbalance_hash": hash_imb,
            "imbalance_contiguous": contiguous_imb, "time_median": median, "time_min": t.min().item(),
            "time_max": t.max().item(), "calls": t.numel(), "algbw_GBps": numel * x0.element_size() / median / 1e9,
            "bytes_sent": b.item() / world, "wrong": int(w.item()), "host_tx_bytes": host_bytes[scheme],
            "ranks_per_host": int(os.environ.get("LOCAL_WORLD_SIZE") or 1),
            "time_predicted": predicted.get(scheme, float("nan")),
            "phases_ms": {p: sum(mine.get(p, 0.0) for mine in every_phases) * 1e3 / world for p in names},
            "copy_ms": copy_ms, "block_size": blocks[scheme],
            "second_push_calls": int(second[0]), "second_pull_calls": int(second[1]),
            "settle_calls": settle_calls if scheme == "auto" else 0,
            "settle_s": settle_seconds if scheme == "auto" else 0.0,
            "auto_choice": instances[scheme].choice(comm, numel, blocks[scheme]) if scheme == "auto" else None,
            "auto_trials": instances[scheme].trial_times(comm, numel, blocks[scheme]) if scheme == "auto" else None,
            "phases_predicted_ms": predicted_phases.get(scheme, {}),
            "profile": None if profile is None else dataclasses.asdict(profile),
            "workload": None if workload is None else dataclasses.asdict(workload),
        })
    link_bps = float(os.environ.get("ZEN_CLUSTER_BANDWIDTH_BPS") or "nan")  # set inside an emulated cluster
    for row in rows:
        # The wire's floor: the time the host's link needs for the bytes its ranks send (a rank's mean, G ranks).
        row["link_bps"] = link_bps
        row["floor_s"] = row["bytes_sent"] * 8 * row["ranks_per_host"] / link_bps
        row["speedup_vs_dense"] = dense_median / row["time_median"] if dense_median else float("nan")
        row["local_vs_copy"] = local_ms(row) / copy_ms if row["phases_ms"] else float("nan")
    return rows


LOCAL_PHASES = ("scan", "partition", "aggregate", "encode", "decode", "merge", "sum", "scatter")


def local_ms(row) -> float:
    """The call's local compute (ms): its phases that touch no network (scan, partition, aggregate, encode,
    decode, merge, sum, scatter)."""
    return sum(v for p, v in row["phases_ms"].items() if p in LOCAL_PHASES)


def format_table(rows):
    predicted = any(not math.isnan(r["time_predicted"]) for r in rows)  # not with --no-predict
    head = (f"{'numel':>11} {'nnz/rank':>9} {'union':>7} {'imb hash':>8} {'imb cont':>8} {'scheme':>10} "
            f"{'time ms':>9} {'(min':>8} {'max)':>8}" + (f" {'pred ms':>8}" if predicted else "")
            + f" {'algbw':>7} {'sent MB':>8} {'speedup':>7} {'#wrong':>6}")
    hosts = any(not math.isnan(r.get("host_tx_bytes", float("nan"))) for r in rows)
    floors = any(not math.isnan(r.get("floor_s", float("nan"))) for r in rows)
    if hosts:
        head += f" {'host MB':>8}"
    if floors:
        head += f" {'floor ms':>8} {'eff':>5}"
    lines = []
    profiles = {json.dumps(r["profile"]) for r in rows if r.get("profile")}
    for text in sorted(profiles):
        p = json.loads(text)
        rates = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in p["rates"])
        large = dict(p.get("calibration_large", ()))
        calibration = ", ".join(f"{k} {v * 1e3:.1f}/" + (f"{large[k] * 1e3:.1f}" if k in large else "-")
                                for k, v in p["calibration"])
        lines.append(f"profile (probed): MB/s per rank {rates}; latency {p['latency'] * 1e6:.0f} us; memory "
                     f"{p['memory_bandwidth'] / 1e9:.2f} GB/s; ns per hashed pair {p['element_time'] * 1e9:.1f}, "
                     f"merged pair {p.get('merge_time', 0) * 1e9:.1f} "
                     f"(of two runs {p.get('merge2_time', 0) * 1e9:.1f}), "
                     f"written element {p['write_time'] * 1e9:.1f}, "
                     f"non-zero found {p.get('found_time', 0) * 1e9:.1f}, "
                     f"bitmap index encoded {p.get('encode_time', 0) * 1e9:.2f}, "
                     f"decoded {p.get('decode_time', 0) * 1e9:.2f}; calibration ms (small/large call) {calibration}")
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['numel']:>11} {r['nnz_per_rank']:>9.0f} {r['union_density']:>7.2%} {r['imbalance_hash']:>8.2f} "
                     f"{r['imbalance_contiguous']:>8.2f} {r['scheme']:>10} {r['time_median'] * 1e3:>9.2f} "
                     f"{r['time_min'] * 1e3:>8.2f} {r['time_max'] * 1e3:>8.2f} "
                     + (f"{r['time_predicted'] * 1e3:>8.2f} " if predicted else "") + f"{r['algbw_GBps']:>7.2f} "
                     f"{r['bytes_sent'] / 1e6:>8.2f} {r['speedup_vs_dense']:>6.2f}x {r['wrong']:>6}"
                     + (f" {r['host_tx_bytes'] / 1e6:>8.2f}" if hosts else "")
                     + (f" {r['floor_s'] * 1e3:>8.2f} {r['floor_s'] / r['time_median']:>5.0%}" if floors else ""))
    phased = [r for r in rows if r.get("phases_ms")]
    if phased:
        lines += ["", "where the time goes (ms, mean over ranks of the per-phase medians; measured/predicted); b: the"
                  " block size the calls used; local/copy: the local phases over one copy_ of the gradient:"]
        for r in phased:
            predicted = r.get("phases_predicted_ms") or {}
            parts = "  ".join(f"{p} {v:.2f}" + (f"/{predicted[p]:.2f}" if p in predicted else "")
                              for p, v in r["phases_ms"].items())
            second = (f"  (second exchange: push {r['second_push_calls']}, pull {r['second_pull_calls']} of "
                      f"{r['calls']} calls)" if r.get("second_push_calls") or r.get("second_pull_calls") else "")
            lines.append(f"{r['numel']:>11} {r['nnz_per_rank']:>9.0f} {r['scheme']:>10}  b {r.get('block_size', 1):<4} "
                         f"local/copy {r.get('local_vs_copy', float('nan')):5.2f}  {parts}{second}")
    return "\n".join(lines)


EMULATED_COMMAND = "sudo python benchmarks/allreduce.py --world 16 --bandwidth-per-core 1gbit --workload text --text-dim 64"


def verdict(rows) -> str:
    """The table's verdict, from its own rows: the fastest scheme of each case (numel, density), zen's time
    against it, and what would move zen ahead, each figure read off the rows (ranks, the overlap of ranks'
    indices: sum of the ranks' non-zeros over the union's, 1.00x where no two ranks share an index; the link)."""
    cases = {}
    for r in rows:
        cases.setdefault((r["numel"], r["nnz_per_rank"]), []).append(r)
    lines = ["", "verdict:"]
    zen_behind = False
    for (numel, nnz), case in cases.items():
        best = min(case, key=lambda r: r["time_median"])
        zens = [r for r in case if r["scheme"].partition("@")[0] == "zen"]
        text = (f"  numel {numel}, density {nnz / numel:.2%}: fastest {best['scheme']} "
                f"{best['time_median'] * 1e3:.2f} ms")
        if zens:
            zen = min(zens, key=lambda r: r["time_median"])
            ratio = zen["time_median"] / best["time_median"]
            zen_behind |= zen is not best
            text += ("; zen is the fastest" if zen is best else
                     f"; {zen['scheme']} {zen['time_median'] * 1e3:.2f} ms, {ratio:.2f}x the fastest's time")
        lines.append(text)
    if not any(r["scheme"].partition("@")[0] == "zen" for r in rows):
        return "\n".join(lines + ["  (zen was not among --schemes)"])
    world = rows[0]["world"]
    overlap = max(r["nnz_per_rank"] * world / max(r["union_density"] * r["numel"], 1) for r in rows)
    link = rows[0].get("link_bps", float("nan"))
    where = "loopback (no link set)" if math.isnan(link) else f"{link / 1e9:.2f} Gbit/s per host"
    lines.append(("  what would move zen ahead: " if zen_behind else "  zen leads here, and further with: ")
                 + f"more ranks (here {world}), more overlap between ranks' indices (here at most {overlap:.2f}x: "
                 f"the ranks' non-zeros over the union's), slower links (here {where})")
    lines.append("  (zen's bytes per rank follow the union split over the ranks; agsparse's and sparcml's grow with "
                 "the ranks' total)")
    lines.append(f"  on an emulated cluster (root): {EMULATED_COMMAND}")
    return "\n".join(lines)


def bench(rank, world, args):
    """One rank's whole run, under --schedule where given; returns the rows (rank 0's are printed)."""
    from zen import schedules

    with schedules.forced(None if args.schedule == "auto" else args.schedule):
        return _bench(rank, world, args)


def _bench(rank, world, args):
    import zen

    show_zen_log(rank)
    schemes = args.schemes.split(",") if args.schemes else list(zen.SCHEMES)
    if "dense" in schemes:
        schemes.remove("dense")
    schemes = ["dense"] + schemes  # the baseline first in the tables
    all_rows = []
    todo = cases(args)
    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=len(todo) * (args.warmup + args.iters), unit="round", file=sys.stderr,
                        disable=None)  # shown on a terminal only
    if rank == 0:
        say(f"{world} ranks joined the group; {len(todo)} case(s)"
            + ("" if args.no_predict else "; the first probes the group's links once (zen's lines below)"), progress)
    for i, (numel, density) in enumerate(todo):
        if progress is not None:
            progress.set_description(f"numel={numel} density={density}")
            say(f"case {i + 1} of {len(todo)}: numel={numel} density={density}", progress)
        all_rows += run_case(args, schemes, numel, density, rank, world, progress)
    if progress is not None:
        progress.close()
    return all_rows


def plot(rows, path):
    """Left: speedup vs density per scheme. Right: the union's partition imbalance (max/mean load) per case,
    zen's hash beside a contiguous split of the index range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for scheme in sorted({r["scheme"] for r in rows}):
        pts = sorted((r["density"], r["speedup_vs_dense"]) for r in rows if r["scheme"] == scheme)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=scheme)
    ax.set_xscale("log")
    ax.set_xlabel("density per rank")
    ax.set_ylabel("speedup vs dense allreduce")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend()
    cases = sorted({(r["numel"], r["density"], r["imbalance_hash"], r["imbalance_contiguous"]) for r in rows})
    x = range(len(cases))
    bx.bar([i - 0.2 for i in x], [c[2] for c in cases], width=0.4, label="hash (zen)")
    bx.bar([i + 0.2 for i in x], [c[3] for c in cases], width=0.4, label="contiguous")
    bx.set_xticks(list(x), [f"M={c[0]:.3g}\nd={c[1]:.2%}" for c in cases], fontsize=7)
    bx.set_ylabel("partition imbalance (max / mean)")
    bx.axhline(1.0, color="grey", lw=0.5)
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(rows, args):
    if args.bandwidth or args.bandwidth_per_core:
        from launch import link_text

        print(f"links: {link_text(args)}; floor: the time the link needs for a rank's bytes sent; eff: floor / time")
    print(format_table(rows))
    print(verdict(rows))
    if args.json:
        from launch import code_version

        version = code_version()  # what report.py checks the pages' code against
        with open(args.json, "w") as f:
            json.dump([{**row, **version} for row in rows], f, indent=1)
    if args.plot:
        plot(rows, args.plot)


def check_args(parser, args) -> None:
    """argparse errors for values the benchmark cannot run (before any rank starts)."""
    import zen

    for flag, value, low in (("--world", args.world, 1), ("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                             ("--max-iters", args.max_iters, 1), ("--text-dim", args.text_dim, 1),
                             ("--text-batch", args.text_batch, 1), ("--ranks-per-host", args.ranks_per_host, 1),
                             ("--min-seconds", args.min_seconds, 0), ("--gpt-vocab", args.gpt_vocab, 2),
                             ("--gpt-dim", args.gpt_dim, 1), ("--gpt-layers", args.gpt_layers, 1),
                             ("--fm-fields", args.fm_fields, 1), ("--fm-vocab", args.fm_vocab, 1),
                             ("--fm-batch", args.fm_batch, 1), ("--fm-dim", args.fm_dim, 1)):
        if not value >= low:
            parser.error(f"{flag} must be >= {low}; got {value}")
    heads = dense_model_defaults().heads
    if args.gpt_dim % heads:
        parser.error(f"--gpt-dim must be a multiple of the GPT's {heads} heads; got {args.gpt_dim}")
    if not 0 < args.topk_ratio <= 1:
        parser.error(f"--topk-ratio must be in (0, 1]; got {args.topk_ratio}")
    if not args.fm_alpha > 0:
        parser.error(f"--fm-alpha must be > 0; got {args.fm_alpha}")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        densities = [float(d) for d in args.densities.split(",")]
    except ValueError as error:
        parser.error(f"--sizes and --densities take comma-separated numbers ({error})")
    if min(sizes) < 1:
        parser.error(f"--sizes must be >= 1 element each; got {args.sizes}")
    if not all(0 < d <= 1 for d in densities):
        parser.error(f"--densities must be in (0, 1] each; got {args.densities}")
    for name in (args.schemes.split(",") if args.schemes else []):
        scheme, _, hierarchy = name.partition("@")
        if scheme not in zen.SCHEMES or hierarchy not in ("", "node"):
            parser.error(f"--schemes: unknown {name!r} (schemes: {', '.join(zen.SCHEMES)}, each with or without @node)")
    if args.bandwidth and args.bandwidth_per_core:
        parser.error("give --bandwidth or --bandwidth-per-core, not both")
    emulated = args.bandwidth or args.bandwidth_per_core
    if args.ranks_per_host > 1 and (not emulated or args.world % args.ranks_per_host):
        parser.error("--ranks-per-host needs --bandwidth (an emulated cluster) and must divide --world")


def main(argv=None):
    from launch import launch

    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    # What a rank holds of a case at once (the input, the reference sum, the call's copy, the schemes' buffers
    # and zen's index sets, each about the tensor's size): an emulated cluster refuses a world it would not fit.
    args.workload_bytes = (TENSOR_COPIES * max(numel for numel, _ in cases(args)) * DTYPES[args.dtype].itemsize
                           + resident_bytes(args))
    if not args.from_env:  # said at once: the ranks take seconds to start, and the first case probes the links
        from launch import link_text

        emulated = args.bandwidth or args.bandwidth_per_core
        where = f"an emulated cluster at {link_text(args)}" if emulated else "local gloo ranks over loopback"
        say(f"starting {args.world} ranks ({where}): each imports torch and joins the group, then rank 0 reports "
            "here as it goes")
    ranks = launch(args, bench, args, script=__file__, argv=argv, timeout=3600)
    if ranks.results is None:  # another rank, or the emulated cluster's launcher: rank 0 reported
        return ranks.exit_code
    report(ranks.results[0], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
