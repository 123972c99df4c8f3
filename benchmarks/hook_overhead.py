"""What the hook costs where sparse does not pay: plain DDP against DDP with zen's hook, side by side in one run.

    python benchmarks/hook_overhead.py --world 2
    python benchmarks/hook_overhead.py --world 4 --json results/hook_overhead_4.json

Models (--models, any of):

    mlp          4 x (Linear(512, 512), ReLU), batch 64, SGD: every gradient dense
    transformer  token embedding (8000 x 256), 2 encoder layers (d 256, 4 heads), head; AdamW, two micro-batches
                 per step (the first under no_sync), gradient clipping, bf16 autocast
    mixed        a large embedding (200,000 x 64, sparse=False) summed into the transformer's input: a bucket
                 of rows beside dense ones
    mixed-sparse the same with nn.Embedding(sparse=True): its COO gradient travels in its own bucket

Variants per model: ``plain`` (DDP's own all-reduce), ``torch-hook`` (torch's Python ``allreduce_hook``: what
a comm hook written in Python costs by itself), ``zen`` (the default ``ZenState()``) and ``zen-dense``
(``ZenState(scheme="dense")``). All start from the same weights and see the same batches; every step runs
every variant, in alternating order (listed order on even steps, reversed on odd ones), so drifting machine
load hits all alike. A step is forward, backward (with the all-reduce or hook), clip and optimizer step, after
a barrier; its time is the slowest rank's. Reported per variant: the median step after --warmup steps (of --steps, more for
the short MLP step, whose noise is a larger part of it), its
ratio to plain DDP's, the bytes one rank sent per step (zen: ``summary()``; plain: a ring all-reduce of the
dense gradients, 2 (n-1)/n x bytes), zen's calls per scheme, and the largest difference of the final
parameters from plain DDP's (0 = bit-identical).
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODELS = ("mlp", "transformer", "mixed", "mixed-sparse")
VARIANTS = ("plain", "torch-hook", "zen", "zen-dense")
STEPS = {"mlp": 300, "transformer": 60, "mixed": 60, "mixed-sparse": 60}  # a step's noise is a larger part of a short one


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="local ranks over loopback")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, any of {', '.join(MODELS)}")
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed steps per variant (default per model: {', '.join(f'{m} {n}' for m, n in STEPS.items())})")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results as JSON here")
    return p


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())])

    def forward(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x), y)


class LM(nn.Module):
    """Token embedding (+ an optional large side embedding), 2 encoder layers, a head over the vocabulary."""

    def __init__(self, vocab=8000, dim=256, side=None, sparse=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.side = nn.Embedding(side[0], side[1], sparse=sparse) if side else None
        self.side_proj = nn.Linear(side[1], dim, bias=False) if side else None
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, batch):
        tokens, side = batch
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.tok(inputs)
        if self.side is not None:
            x = x + self.side_proj(self.side(side[:, :-1]))
        logits = self.head(self.encoder(x, is_causal=True, mask=_causal(inputs.shape[1])))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _causal(t):
    return torch.triu(torch.full((t, t), float("-inf")), diagonal=1)


def _zipf(n, count, gen):
    weights = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(weights, count, replacement=True, generator=gen)


def make_model(name):
    if name == "mlp":
        return MLP()
    if name == "transformer":
        return LM()
    return LM(side=(200_000, 64), sparse=name == "mixed-sparse")


def make_batch(name, rank, step, seed, micro):
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step * 7 + micro)
    if name == "mlp":
        return torch.randn(64, 512, generator=gen), torch.randn(64, 512, generator=gen)
    tokens = _zipf(8000, 8 * 65, gen).view(8, 65)
    return tokens, _zipf(200_000, 8 * 65, gen).view(8, 65)


class Variant:
    def __init__(self, variant, model_name, base):
        from torch.nn.parallel import DistributedDataParallel as DDP

        import zen

        self.name, self.model_name = variant, model_name
        self.ddp = DDP(copy.deepcopy(base))
        self.state = None
        if variant == "torch-hook":  # torch's own Python all-reduce hook: what any Python hook costs
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            self.ddp.register_comm_hook(None, allreduce_hook)
        elif variant != "plain":
            self.state = zen.ZenState(scheme="dense") if variant == "zen-dense" else zen.ZenState()
            self.ddp.register_comm_hook(self.state, zen.zen_hook)
        module = self.ddp.module
        sparse = [module.side.weight] if model_name == "mixed-sparse" else []
        self.dense = [p for p in module.parameters() if all(p is not q for q in sparse)]
        if model_name == "mlp":
            self.opts = [torch.optim.SGD(self.dense, lr=0.01)]
        else:  # a sparse gradient: SparseAdam for it (AdamW and clipping take dense gradients only)
            self.opts = [torch.optim.AdamW(self.dense, lr=1e-3)] + ([torch.optim.SparseAdam(sparse)] if sparse else [])

    def step(self, batches):
        for opt in self.opts:
            opt.zero_grad(set_to_none=False)
        if self.model_name == "mlp":
            self.ddp(batches[0]).backward()
        else:
            with self.ddp.no_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = self.ddp(batches[0])
                loss.backward()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = self.ddp(batches[1])
            loss.backward()
            nn.utils.clip_grad_norm_(self.dense, 1.0)
        for opt in self.opts:
            opt.step()


def dense_ring_bytes(module, world):
    numel = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return 2 * (world - 1) / world * numel


def run(rank, world, args):
    torch.set_num_threads(1)
    out = {}
    for model_name in args.model_list:
        torch.manual_seed(args.seed)
        base = make_model(model_name)
        variants = [Variant(v, model_name, base) for v in VARIANTS]
        times = {v.name: [] for v in variants}
        sent = {v.name: [] for v in variants}
        steps = args.steps or STEPS[model_name]
        for step in range(args.warmup + steps):
            batches = [make_batch(model_name, rank, step, args.seed, m) for m in range(2)]
            order = variants if step % 2 == 0 else variants[::-1]
            for v in order:
                before = v.state.summary()["bytes_sent"] if v.state else 0
                dist.barrier()
                start = time.perf_counter()
                v.step(batches)
                times[v.name].append(time.perf_counter() - start)
                if v.state:
                    sent[v.name].append(v.state.summary()["bytes_sent"] - before)
        # the slowest rank's time per step
        stacked = torch.tensor([times[v.name] for v in variants], dtype=torch.float64)
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
        plain = dict(variants[0].ddp.module.named_parameters())
        result = {}
        for i, v in enumerate(variants):
            diff = max((p.detach() - plain[n].detach()).abs().max().item()
                       for n, p in v.ddp.module.named_parameters())
            per_step = stacked[i, args.warmup:].tolist()
            bytes_sent = (statistics.mean(sent[v.name][args.warmup:]) if v.state
                          else dense_ring_bytes(v.ddp.module, world))
            summary = v.state.summary() if v.state else {}
            result[v.name] = dict(median_ms=1e3 * statistics.median(per_step), steps_ms=[1e3 * t for t in per_step],
                                  bytes_per_step=bytes_sent, schemes=summary.get("schemes", {}),
                                  max_param_diff=diff)
        out[model_name] = result
    return out


def format_report(results, world):
    lines = [f"hook overhead, {world} ranks over loopback (gloo), median step of the slowest rank",
             "",
             f"| model | variant | step ms | vs plain | MB sent/step | vs plain bytes | calls | param diff |",
             "|---|---|---|---|---|---|---|---|"]
    for model_name, result in results.items():
        plain = result["plain"]
        for name, r in result.items():
            calls = ", ".join(f"{k}: {v}" for k, v in sorted(r["schemes"].items())) or "-"
            lines.append(f"| {model_name} | {name} | {r['median_ms']:.2f} | {r['median_ms'] / plain['median_ms']:.3f}x"
                         f" | {r['bytes_per_step'] / 1e6:.3f} | {r['bytes_per_step'] / plain['bytes_per_step']:.3f}x"
                         f" | {calls} | {r['max_param_diff']:.3g} |")
    return "\n".join(lines)


def main(argv=None):
    from launch import launch

    parser = build_parser()
    args = parser.parse_args(argv)
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.model_list if m not in MODELS]
    if bad or not args.model_list:
        parser.error(f"--models: any of {', '.join(MODELS)}; got {args.models!r}")
    ranks = launch(args, run, args, script=__file__, argv=argv, timeout=3600)
    results = ranks.results[0]
    print(f"$ python benchmarks/hook_overhead.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print()
    print(format_report(results, ranks.world))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(world=ranks.world, argv=argv if argv is not None else sys.argv[1:], results=results), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
