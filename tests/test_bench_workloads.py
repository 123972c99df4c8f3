"""benchmarks/allreduce.py's model workloads (--workload gpt-topk, deepfm): deterministic per (seed, rank, step),
different across ranks, as dense as they claim, exact in a 2-rank run; and their weak-scaling blocks in
benchmarks/README.md, written only from the files measured so far."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import allreduce  # noqa: E402


def options(workload, *extra):
    return allreduce.build_parser().parse_args(["--workload", workload, *extra])


def fresh(args, rank, step):
    """The workload's tensor made anew (not the process's cached copy)."""
    allreduce._CACHE.clear()
    numel, density = allreduce.cases(args)[0]
    x = allreduce.workload_tensor(args, numel, density, rank, step)
    assert x.numel() == numel
    return x


def test_gpt_topk_is_deterministic_differs_across_ranks_and_keeps_its_ratio():
    args = options("gpt-topk")
    x = fresh(args, 0, 0)
    assert x.dim() == 1 and x.dtype == torch.float32
    assert torch.equal(x, fresh(args, 0, 0))  # another forward and backward, the same tensor
    assert torch.equal(x, allreduce.workload_tensor(args, x.numel(), 0.01, 0, 0))  # the cached copy
    assert int((x != 0).sum()) == round(0.01 * x.numel())  # exactly the top 1%
    other_rank, other_step = fresh(args, 1, 0), fresh(args, 0, 1)
    for y in (other_rank, other_step):
        assert int((y != 0).sum()) == int((x != 0).sum()) and not torch.equal((y != 0), (x != 0))
    # a smaller model and another ratio follow their options (the vocabulary as cached: another cap tokenises anew)
    small = fresh(options("gpt-topk", "--gpt-dim", "32", "--gpt-layers", "1", "--topk-ratio", "0.05"), 0, 0)
    assert small.numel() < x.numel() and int((small != 0).sum()) == round(0.05 * small.numel())


def test_deepfm_is_non_zero_on_exactly_the_rows_its_batch_touched():
    args = options("deepfm")
    x = fresh(args, 0, 0)
    assert x.shape == (26 * 10000, 16)  # the table's shape: zen may reduce it as rows
    assert torch.equal(x, fresh(args, 0, 0))
    touched = torch.unique(allreduce.deepfm_batch_ids(args, 0, 0))
    rows = torch.nonzero((x != 0).any(1)).view(-1)
    assert torch.equal(rows, touched)
    assert bool((x[touched] != 0).all())  # every entry of a touched row
    assert int((x != 0).sum()) == touched.numel() * 16
    for rank, step in ((1, 0), (0, 1)):
        y = fresh(args, rank, step)
        assert torch.equal(torch.nonzero((y != 0).any(1)).view(-1),
                           torch.unique(allreduce.deepfm_batch_ids(args, rank, step)))
        assert not torch.equal(y, x)
    # every field's ids fall in its own block of rows, and the Zipf head is hot: id 0 of field 0 is in the batch
    assert int(touched.max()) < 26 * 10000 and 0 in touched.tolist()


@pytest.mark.parametrize("workload", ["gpt-topk", "deepfm"])
def test_a_two_rank_run_is_exact(workload, tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "allreduce.py"), "--world", "2",
                           "--workload", workload, "--iters", "1", "--warmup", "0", "--min-seconds", "0",
                           "--no-predict", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())
    assert {r["scheme"] for r in rows} >= {"dense", "zen"}
    assert all(r["wrong"] == 0 and r["data"] == workload for r in rows), done.stdout  # every scheme's sum exact


def test_the_memory_rule_takes_32_ranks_of_either_workload():
    """The emulated cluster's refusal (cluster.check_memory, with what allreduce.py counts a rank holds): 32 ranks
    of either workload at its defaults fit in 23 GiB, the memory of the machine the series was planned on."""
    from cluster import RANK_BYTES, check_memory

    for workload in ("gpt-topk", "deepfm"):
        args = options(workload)
        numel = max(n for n, _ in allreduce.cases(args))
        workload_bytes = allreduce.TENSOR_COPIES * numel * 4 + allreduce.resident_bytes(args)
        check_memory(32, available=23 * 2**30, workload_bytes=workload_bytes)
        assert 32 * (RANK_BYTES + workload_bytes) < 23 * 2**30


def report(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "report.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_weak_scaling_blocks_show_the_files_that_exist(tmp_path):
    """No file: the block says it is not measured yet; some: their rows, and the world sizes still missing."""
    for page in ("README.md", "benchmarks/README.md", "docs/cost_model.md"):
        os.makedirs((tmp_path / page).parent, exist_ok=True)
        shutil.copy(os.path.join(ROOT, page), tmp_path / page)
    shutil.copytree(os.path.join(ROOT, "results"), tmp_path / "results")
    for stem in ("weak_topk", "weak_deepfm"):
        for n in (2, 4, 8, 16, 24, 32):
            (tmp_path / "results" / f"{stem}_{n}.json").unlink(missing_ok=True)
    where = ["--root", str(tmp_path), "--results", str(tmp_path / "results")]
    assert report(*where).returncode == 0
    assert report("--check", *where).returncode == 0
    page = (tmp_path / "benchmarks" / "README.md").read_text()
    assert "*Not measured yet: no `results/weak_topk_N.json`" in page
    assert "*Not measured yet: no `results/weak_deepfm_N.json`" in page

    rows = json.loads(open(os.path.join(ROOT, "results", "weak_text32_4.json")).read())  # any weak-scaling rows
    (tmp_path / "results" / "weak_topk_4.json").write_text(json.dumps(rows))
    assert report("--check", *where).returncode == 1  # the block follows its files
    assert report(*where).returncode == 0
    page = (tmp_path / "benchmarks" / "README.md").read_text()
    block = page.split("<!-- report:weak_topk_2,")[1].split("<!-- /report:")[0]
    assert "| 4 | 500 Mbit/s |" in block and "*Not measured yet at 2, 8, 16, 24 and 32 ranks.*" in block
    assert "*Not measured yet: no `results/weak_deepfm_N.json`" in page
    assert report("--check", *where).returncode == 0
