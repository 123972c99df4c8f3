"""Smoke test of benchmarks/dense_model.py: 2 local ranks, 3 steps, plain DDP and PowerSGD (compressing from
step 2), run as a user runs it; the JSON it writes is checked, and PowerSGD's bytes against the formula of
the script's docstring, computed here from the model's parameter shapes."""
import json
import math
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "dense_model.py")


def test_dense_model_smoke(tmp_path):
    out = tmp_path / "dense.json"
    cmd = [sys.executable, SCRIPT, "--world", "2", "--steps", "3", "--warmup-steps", "2", "--variants",
           "plain,powersgd", "--eval-every", "2", "--eval-batches", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "powersgd" in proc.stdout and "checks OK" in proc.stdout

    s = json.loads(out.read_text())
    plain, psgd = s["variants"]
    assert [plain["variant"], psgd["variant"]] == ["plain", "powersgd"]
    assert s["eval_steps"] == [0, 2, 3]
    for r in (plain, psgd):
        assert len(r["loss"]) == 3 and len(r["step_s"]) == 3 and len(r["eval_loss"]) == 3
        assert all(math.isfinite(x) for x in r["loss"] + r["eval_loss"])
        assert all(t > 0 for t in r["step_s"])
        assert r["rank_max_abs_diff"] == 0.0
    # same weights, same batches: the first loss and the first held-out loss are the same in every variant
    assert plain["loss"][0] == psgd["loss"][0]
    assert plain["eval_loss"][0] == psgd["eval_loss"][0]
    # an untrained model over V words starts near log V
    assert abs(plain["loss"][0] - math.log(s["vocab"])) < 0.5

    # bytes per rank: a ring all-reduce of every parameter (2 (n-1)/n x 4 bytes, n = 2), PowerSGD's too
    # before it starts; then P and Q for every matrix it compresses, the rest whole
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import dense_model

    c = s["config"]
    model = dense_model.GPT(s["vocab"], c["dim"], c["layers"], c["heads"], c["seq"], c["tie_head"])
    numel = sum(p.numel() for p in model.parameters())
    assert s["params"] == numel
    compressed = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, c["powersgd_rank"])
        compressed += (n + m) * r if p.dim() > 1 and (n + m) * r * 2 < n * m else p.numel()
    assert plain["bytes_per_step"] == [4.0 * numel] * 3
    assert psgd["bytes_per_step"] == [4.0 * numel, 4.0 * numel, 4.0 * compressed]
    assert psgd["bytes_per_step_after_warmup"] < plain["bytes_per_step_after_warmup"] / 10
    assert torch.tensor(plain["loss"]).isfinite().all()
