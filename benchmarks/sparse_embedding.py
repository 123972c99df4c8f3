"""DDP with ``nn.Embedding(sparse=True)``: plain DDP (gloo's own sparse all-reduce) against DDP with zen's hook,
side by side in one run.

    python benchmarks/sparse_embedding.py --world 2          # local ranks over loopback
    python benchmarks/sparse_embedding.py --world 4 --json results/sparse_embedding_4.json

Both models start from the same weights and see the same batches (each rank its own Zipf-skewed token ids);
each step is a forward, backward (which runs the all-reduce) and SGD step; the two variants alternate step by
step, each step timed from the last rank's start to the last rank's end after a barrier. Prints, per variant,
the median step (and min, max), the rows per rank and bytes sent per rank (zen: its summary; plain DDP: the
gathered COO it all-gathers, which gloo does not report), and whether the final parameters are equal.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step (Zipf 1.1 over the vocab)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", default=None)
    return p


class Model(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, sparse=True)
        self.head = nn.Linear(dim, 1)

    def forward(self, tokens):
        return self.head(self.embedding(tokens)).pow(2).mean()


def tokens_for(args, rank, step):
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    weights = 1.0 / torch.arange(1, args.vocab + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(weights, args.tokens, replacement=True, generator=g)


def run(rank, world, args):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zen
    from zen.measurement import timing

    torch.manual_seed(0)
    base = Model(args.vocab, args.dim)
    variants = {"plain DDP": DDP(Model(args.vocab, args.dim)), "zen hook": DDP(Model(args.vocab, args.dim))}
    for ddp in variants.values():
        ddp.module.load_state_dict(base.state_dict())
    state = zen.ZenState()
    variants["zen hook"].register_comm_hook(state, zen.zen_hook)
    optimizers = {name: torch.optim.SGD(ddp.parameters(), lr=0.1) for name, ddp in variants.items()}
    spans = {name: [] for name in variants}
    rows = []
    for step in range(args.warmup + args.steps):
        tokens = tokens_for(args, rank, step)
        rows.append(torch.unique(tokens).numel())
        for name, ddp in variants.items():
            dist.barrier()
            start = time.perf_counter()
            optimizers[name].zero_grad()
            ddp(tokens).backward()
            optimizers[name].step()
            end = time.perf_counter()
            dist.barrier()
            if step >= args.warmup:
                spans[name].append((start, end))
        if step == args.warmup - 1:
            warm = state.summary()
    clocks = [None] * world
    dist.all_gather_object(clocks, timing.clock_id())
    out = {"world": world, "rows_per_rank": statistics.mean(rows[args.warmup:])}
    for name in variants:
        every = [None] * world
        dist.all_gather_object(every, spans[name])
        times = timing.call_seconds([[s for s, _ in mine] for mine in every], [[e for _, e in mine] for mine in every],
                                    clocks)
        out[name] = dict(median_ms=statistics.median(times) * 1e3, min_ms=min(times) * 1e3, max_ms=max(times) * 1e3)
    summary = state.summary()
    out["zen hook"]["MB_sent_per_step"] = (summary["bytes_sent"] - warm["bytes_sent"]) / args.steps / 1e6
    out["zen hook"]["schemes"] = summary["schemes"]
    plain, hooked = (list(v.module.parameters()) for v in variants.values())
    out["equal"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(plain, hooked))
    return out


def main(argv=None):
    from launch import launch

    args = build_parser().parse_args(argv)
    ranks = launch(args, run, args, script=__file__, argv=argv, timeout=1800)
    if ranks.results is None:
        return ranks.exit_code
    out = ranks.results[0]
    print(f"nn.Embedding({args.vocab}, {args.dim}, sparse=True) + Linear head, {out['world']} ranks, "
          f"{args.tokens} tokens/rank/step ({out['rows_per_rank']:.0f} distinct rows per rank), {args.steps} steps:")
    for name in ("plain DDP", "zen hook"):
        r = out[name]
        print(f"  {name:>10}: step {r['median_ms']:7.2f} ms (min {r['min_ms']:.2f}, max {r['max_ms']:.2f})")
    print(f"  zen sent {out['zen hook']['MB_sent_per_step']:.3f} MB per rank per step; calls "
          f"{out['zen hook']['schemes']}; final parameters equal: {out['equal']}")
    print(f"  plain DDP / zen hook: {out['plain DDP']['median_ms'] / out['zen hook']['median_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(out, args=vars(args)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
