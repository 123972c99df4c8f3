"""zen's phases in the PyTorch profiler: every phase a call records (stats["phases"]) runs under the range
``zen::<scheme>::<phase>`` on the thread where it runs (the group's lane), so a trace shows them beside
autograd's backward. The lane is not the thread that starts the profiler: the profiler records it with
``profile_all_threads`` (a default profile records only its own thread)."""
import json
import os
import subprocess
import sys

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

import zen
from distributed import run_ranks

# The phases of one run of the zen scheme over one group of segments (zen/schemes/balanced/scheme.py), and the scan
# of the call that chooses rows or elements (zen/schemes/call.py).
ZEN_PHASES = ("partition", "agree", "push", "aggregate", "encode", "pull", "decode", "scatter")


def profiled(fn):
    """(fn's result, [(name, thread)] of zen's ranges, the calling thread's id) of ``fn`` under a profiler of
    every thread."""
    with profile(activities=[ProfilerActivity.CPU],
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        with torch.profiler.record_function("test::caller"):
            result = fn()
    events = prof.events()
    caller = next(e.thread for e in events if e.name == "test::caller")
    # zen's kernels show as ops "zen::<op>"; its ranges are "zen::<scheme>::<phase>"
    ranges = [(e.name, e.thread) for e in events if e.name.startswith("zen::") and e.name.count("::") == 2]
    return result, ranges, caller


def _hook_steps(rank, world):
    torch.manual_seed(0)

    class TwoTables(torch.nn.Module):  # two embeddings of 2 MiB each: with bucket_cap_mb=1, a bucket each
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.EmbeddingBag(8192, 64), torch.nn.EmbeddingBag(8192, 64)

        def forward(self, tokens):
            return self.a(tokens) + self.b(tokens)

    model = DDP(TwoTables(), bucket_cap_mb=1)
    state = zen.ZenState(dense_threshold=0.5)  # by density: sparse travel, whatever this machine's timings
    model.register_comm_hook(state, zen.zen_hook)
    g = torch.Generator().manual_seed(rank)

    def step():
        model(torch.randint(0, 8192, (32, 4), generator=g)).square().mean().backward()

    for _ in range(3):  # past the first step's check and DDP's rebuild of its buckets
        step()
    before = state.summary()["buckets"]

    def two_steps():
        step()
        step()

    _, ranges, caller = profiled(two_steps)
    return state.summary()["buckets"] - before, ranges, caller, state.summary()["schemes"]


def test_two_hook_steps_show_each_phase_once_per_bucket():
    for calls, ranges, caller, schemes in run_ranks(2, _hook_steps):
        assert calls == 4 and set(schemes) == {"zen"}, (calls, schemes)  # 2 buckets, 2 steps, all sparse
        names = [name for name, _ in ranges]
        for phase in ZEN_PHASES:
            assert names.count(f"zen::zen::{phase}") == calls, (phase, names)
        assert names.count("zen::zen::scan") >= calls, names
        lanes = {thread for name, thread in ranges if name.startswith("zen::zen::")}
        assert len(lanes) == 1 and caller not in lanes, (caller, lanes)  # on the lane, beside backward's thread


def _each_scheme(rank, world):
    out = {}
    grad = torch.zeros(4096, 8)
    grad[torch.arange(rank, 4096, 37)] = 1.0
    for scheme in zen.SCHEMES:
        stats = {}
        zen.all_reduce(grad.clone(), scheme=scheme, stats=stats)  # warm: auto's first calls measure
        _, ranges, _ = profiled(lambda: zen.all_reduce(grad.clone(), scheme=scheme, stats=stats))
        out[scheme] = (sorted(set(stats.get("phases", {}))), sorted({name for name, _ in ranges}))
    return out


def test_every_phase_a_call_records_is_a_range():
    """A call's ranges name its scheme (auto: its own scan and trial, then the pick's phases) and cover every
    phase its stats record."""
    for out in run_ranks(2, _each_scheme):
        for scheme, (recorded, ranges) in out.items():
            assert set(recorded) <= {name.split("::")[2] for name in ranges}, (scheme, recorded, ranges)
            if scheme != "auto":
                assert all(name.startswith(f"zen::{scheme}::") for name in ranges), (scheme, ranges)
        assert out["dense"][1] == ["zen::dense::agree", "zen::dense::all_reduce", "zen::dense::scan"], out["dense"]


def _node_and_topk(rank, world):
    grad = torch.zeros(4096, 16)
    grad[rank::97] = 1.0
    _, node, _ = profiled(lambda: zen.all_reduce(grad, hierarchy="node", local_size=1))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 1)))
    model.register_comm_hook(zen.ZenState(topk_ratio=0.1, warmup_steps=2), zen.zen_hook)
    for _ in range(3):
        model(torch.randn(8, 128)).sum().backward()
    _, topk, _ = profiled(lambda: model(torch.randn(8, 128)).sum().backward())
    return [name for name, _ in node], [name for name, _ in topk]


def test_node_steps_and_topk_selection_are_ranges():
    for node, topk in run_ranks(2, _node_and_topk):
        for step in ("node_scan", "intra_agree", "intra_reduce_scatter", "cross", "intra_all_gather"):
            assert node.count(f"zen::zen::{step}") == 1, (step, node)
        assert "zen::zen::partition" in node  # the cross step's own phases
        assert topk.count("zen::topk::select") == 1, topk  # one bucket, one step


def test_no_profiler_no_range():
    from zen.schemes.base import phase_range

    assert phase_range("zen", "push") is phase_range("sparcml", "merge")  # one shared no-op
    with profile(activities=[ProfilerActivity.CPU]):
        assert isinstance(phase_range("zen", "push"), torch.profiler.record_function)


def test_train_writes_a_chrome_trace_with_zen_beside_backward(tmp_path):
    """benchmarks/train.py --trace: one Chrome trace per rank, the steps on the main thread and zen's phases on
    another (its lane)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "train.py"), "--model", "deepfm",
                           "--world", "2", "--steps", "1", "--warmup", "1", "--field-vocab", "20000",
                           "--dense-threshold", "0.5", "--trace", str(tmp_path), "--trace-steps", "2"],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        steps = {e["tid"] for e in events if e["name"] == "train::zen::step"}
        zen_threads = {e["tid"] for e in events if e["name"] == "zen::zen::partition"}
        assert sum(e["name"] == "train::zen::step" for e in events) == 2, rank
        assert len(steps) == 1 and zen_threads and not zen_threads & steps, (steps, zen_threads)
