"""Dead and stalled peers: what each surviving rank raises, and how long it takes (the scenario that
tests/test_reliability.py checks; this prints its timings).

    python benchmarks/faults.py                       # 4 local ranks, an 8 s timeout
    python benchmarks/faults.py --timeout 8 --json results/faults.json

Four local gloo ranks in two pairs (see :func:`scenario`): a peer that dies during DDP's backward, one
dead before the call, a stalled peer (alive, never calling) under zen's timeout and under the group's, a
bounded ``Work.wait``, and a peer that dies part-way through a call. Each line: the case, the survivor,
the exception's type, the seconds until it raised, and the start of its message.
"""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _tensor(rank, numel, seed=0, density=0.2):
    """Small integers at ``density``, from (seed, rank)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-8, 8, (numel,), generator=g).float() * (torch.rand(numel, generator=g) < density)


def failure(fn):
    """(exception type name, message, the peers it names as global ranks, or None) of what ``fn`` raised;
    ("ok", "", None) when it returned."""
    try:
        fn()
        return ("ok", "", None)
    except Exception as error:  # noqa: BLE001  (recorded and checked by the parent)
        return (type(error).__name__, str(error), getattr(error, "peers", None))


def scenario(rank, world, timeout):
    """Pairs {0, 1} and {2, 3}, each with their own groups.

    0, 1: DDP with zen's hook on group A; rank 1 dies in its second backward (the hook's collective in
          flight on rank 0). Then rank 0 calls zen.all_reduce on group D, whose peer is already dead.
    2, 3: rank 3 stalls (alive, never calls) while rank 2 queues three calls on group B (torch's 30 min
          default timeout; zen's was given to zen.all_reduce), then one call on group C (zen follows C's
          own timeout); then rank 3 joins a call on group E and dies in its push, after the agreement.
    Returns what each survivor raised (:func:`failure`) and the seconds it took."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zen

    td = datetime.timedelta(seconds=timeout)
    group_a, group_d = dist.new_group([0, 1], timeout=td), dist.new_group([0, 1], timeout=td)
    group_b = dist.new_group([2, 3])  # torch's default timeout (30 min)
    group_c, group_e = dist.new_group([2, 3], timeout=td), dist.new_group([2, 3], timeout=td)
    out = {}
    if rank in (0, 1):
        zen.all_reduce(torch.ones(10), group=group_d)  # zen's private group for D exists before the fault
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(5000, 8), nn.Flatten(), nn.Linear(8 * 4, 2))
        ddp = DDP(model, process_group=group_a)
        ddp.register_comm_hook(zen.ZenState(process_group=group_a), zen.zen_hook)
        for step in range(3):
            tokens = torch.randint(0, 5000, (16, 4), generator=torch.Generator().manual_seed(rank * 10 + step))
            loss = ddp(tokens).pow(2).mean()
            if rank == 1 and step == 1:
                model[2].weight.register_hook(lambda grad: os._exit(3))  # dies part-way through backward
            start = time.monotonic()
            out["ddp"] = failure(loss.backward) + (time.monotonic() - start, step)
            if out["ddp"][0] != "ok":
                break
        start = time.monotonic()
        out["dead_before"] = failure(lambda: zen.all_reduce(torch.ones(100), group=group_d)) + (time.monotonic() - start,)
        start = time.monotonic()
        out["after_broken"] = failure(lambda: zen.all_reduce(torch.ones(100), group=group_d)) + (time.monotonic() - start,)
        return out
    zen.all_reduce(torch.ones(10), group=group_b, timeout=timeout)
    zen.all_reduce(torch.ones(10), group=group_c)
    zen.all_reduce(torch.ones(10), group=group_e)
    begin = time.monotonic()
    if rank == 3:
        time.sleep(2 * timeout + 3)  # stalled: rank 2's calls on B and C must time out, not wait for it
        from zen.transport import Comm

        # Dies in the push's all-to-all, after the agreement (whose all-gather also goes as an all-to-all
        # on gloo, so the patch is zen's primitive, not torch's).
        Comm.all_to_all = lambda *args, **kwargs: os._exit(3)
        zen.all_reduce(_tensor(rank, 1000), group=group_e)
        return {"unexpected": "survived"}
    works = [zen.all_reduce(_tensor(rank, 1000, seed=i), group=group_b, async_op=True) for i in range(3)]
    out["wait_timeout"] = failure(lambda: works[0].wait(timeout=1.0)) + (time.monotonic() - begin,)
    out["stalled_b"] = [failure(work.wait) + (time.monotonic() - begin,) for work in works]
    start = time.monotonic()
    out["stalled_c"] = failure(lambda: zen.all_reduce(_tensor(rank, 1000), group=group_c)) + (time.monotonic() - start,)
    start = time.monotonic()
    out["dies_during"] = failure(lambda: zen.all_reduce(_tensor(rank, 1000), group=group_e)) + (time.monotonic() - start,)
    out["dies_during_waited_for_peer"] = begin + 2 * timeout + 3 - start
    return out



def run(timeout: float) -> list:
    """The scenario on 4 local ranks (ranks 1 and 3 die in it): every rank's record, None for the dead."""
    from zen.testing import run_ranks

    return run_ranks(4, scenario, timeout, timeout=300, pg_timeout=timeout, expect_dead=(1, 3))


CASES = [  # (record key, survivor, what happened)
    ("ddp", 0, "peer dies during DDP's backward (hook in flight)"),
    ("dead_before", 0, "peer dead before the call"),
    ("after_broken", 0, "next call on the broken group"),
    ("wait_timeout", 2, "Work.wait(timeout=1) on a stalled peer"),
    ("stalled_c", 2, "stalled peer, the group's own timeout"),
    ("dies_during", 2, "peer dies part-way (in the push)"),
]


def table(records, timeout: float) -> str:
    lines = [f"4 local ranks (gloo, loopback), timeout {timeout:g} s; seconds from the call to the exception",
             f"{'case':<48} {'rank':>4} {'raised':<18} {'seconds':>8}  message"]
    for key, rank, what in CASES:
        kind, message, _, seconds = records[rank][key][:4]
        if key == "dies_during":  # rank 3 was still asleep when the call began
            seconds -= max(0.0, records[rank]["dies_during_waited_for_peer"])
        lines.append(f"{what:<48} {rank:>4} {kind:<18} {seconds:>8.3f}  {message[:70]}")
    stalled = records[2]["stalled_b"]
    lines.append(f"{'stalled peer, zen timeout: 3 queued calls':<48} {2:>4} {stalled[0][0]:<18} {stalled[0][3]:>8.3f}  "
                 f"then {', '.join(k for k, *_ in stalled[1:])} at +{stalled[-1][3] - stalled[0][3]:.3f} s")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timeout", type=float, default=8.0, help="the groups' timeout in seconds (default 8)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    records = run(args.timeout)
    print(table(records, args.timeout))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(timeout=args.timeout, records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
