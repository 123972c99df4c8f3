"""Every Python block of README.md runs as written, at 2 ranks under torchrun: the first page's code works."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def test_the_readme_has_python_blocks():
    assert len(python_blocks()) >= 4


@pytest.mark.parametrize("number", range(len(python_blocks())))
def test_readme_block_runs_at_two_ranks(number, tmp_path):
    script = tmp_path / f"block_{number}.py"
    script.write_text(python_blocks()[number])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"README block {number} failed:\n{python_blocks()[number]}\n{done.stdout}\n{done.stderr}"
