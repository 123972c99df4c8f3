"""Every script of examples/ runs through its real launcher at 2 CPU processes over gloo, with ``--check``: the
embedding model's parameters equal the same training's without zen's hook, and zen sent under 0.5x the bytes
of a dense all-reduce. The check lines are printed (CI's log shows them).

Lightning and Accelerate are in the test environment (``make test`` installs examples/requirements.txt); where
one is missing the test skips, except in CI (CI=true), where it fails."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def needs(module: str) -> None:
    if os.environ.get("CI", "").lower() != "true":
        pytest.importorskip(module)
    else:
        __import__(module)  # CI installs it: a missing one is a failure, not a skip


def launched(command, capsys) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                                                              "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{out[-6000:]}"
    lines = [line for line in done.stdout.splitlines() if re.match(r"(embedding|dense top-k|check):", line)]
    with capsys.disabled():
        print(f"\n$ {' '.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in command)}")
        for line in lines:
            print(f"  {line}")
    return "\n".join(lines)


def check_printed(printed: str) -> None:
    """The example printed each model's summary once, and its check passed."""
    assert len(re.findall(r"^embedding: loss [\d.]+, zen sent [\d.]+x", printed, re.M)) == 1, printed
    assert len(re.findall(r"^dense top-k: loss [\d.]+, zen sent [\d.]+x", printed, re.M)) == 1, printed
    assert re.search(r"^check: embedding parameters equal plain DDP's; bytes 0\.\d+x dense \(< 0.5x\): OK$",
                     printed, re.M), printed


def test_torchrun_example(capsys):
    check_printed(launched([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "examples/torchrun_ddp.py", "--check"], capsys))


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_lightning_example(strategy, capsys):
    needs("lightning")
    # Lightning's own launcher: the script starts the second process itself (ddp_spawn: both, from the script).
    check_printed(launched([sys.executable, "examples/lightning_ddp.py", "--check", "--strategy", strategy], capsys))


@pytest.mark.parametrize("precision", ["no", "bf16"])  # bf16: autocast on CPU (fp32 gradients, as on GPUs)
def test_accelerate_example(precision, capsys):
    needs("accelerate")
    check_printed(launched([os.path.join(BIN, "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                            "--num_machines", "1", "--mixed_precision", precision, "--dynamo_backend", "no",
                            "--main_process_port", str(free_port()), "examples/accelerate_ddp.py", "--check"], capsys))


def test_the_check_can_fail():
    """The torchrun example's check refuses parameters one ulp apart at 2 ranks, and bytes at 0.5x dense."""
    spec = importlib.util.spec_from_file_location("torchrun_ddp", os.path.join(ROOT, "examples", "torchrun_ddp.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, plain = example.dense_model(), example.dense_model()
    assert example.check(model, plain, 0.1, 2).startswith("check: embedding parameters equal")
    with pytest.raises(AssertionError, match="not under 0.5x"):
        example.check(model, plain, 0.5, 2)
    with torch.no_grad():
        plain[0].bias[3] = torch.nextafter(plain[0].bias[3], torch.tensor(1.0))
    with pytest.raises(AssertionError, match="differ from plain DDP's"):
        example.check(model, plain, 0.1, 2)
    assert "within" in example.check(model, plain, 0.1, 4)
