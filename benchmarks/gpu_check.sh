#!/usr/bin/env bash
# On a machine with a CUDA GPU: build zen with its CUDA kernels, run the kernel tests (tests/test_kernels.py,
# tests/test_select.py) on the GPU, then benchmarks/gpu_kernels.py (speed beside a device-to-device copy;
# every result checked against the CPU op). Arguments go to gpu_kernels.py, e.g.
# `bash benchmarks/gpu_check.sh --json results/gpu.json`.
# PYTHON selects the interpreter (default python3). Exits non-zero if the build, a test or a check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

"$PY" - <<'PYEOF' || exit 1
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch " + torch.__version__)
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")
PYEOF

echo "gpu_check: building (FORCE_CUDA=1)"
FORCE_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e . || { echo "gpu_check: build FAILED"; exit 1; }
"$PY" -c "import zen._C as c, sys; sys.exit(0 if c.has_cuda_kernels() else 'gpu_check: built without the CUDA kernels')" || exit 1

# Every kernel test: the files that run on ZEN_TEST_DEVICE (tests/conftest.py's DEVICE). A missing file fails.
tests_rc=0
for kernel_tests in tests/test_kernels.py tests/test_select.py; do
  if [[ -f "$kernel_tests" ]]; then
    echo "gpu_check: $kernel_tests on cuda"
    ZEN_TEST_DEVICE=cuda "$PY" -m pytest -q "$kernel_tests" || tests_rc=$?
  else
    echo "gpu_check: $kernel_tests not found"
    tests_rc=1
  fi
done

echo "gpu_check: benchmark"
bench_rc=0
"$PY" benchmarks/gpu_kernels.py "$@" || bench_rc=$?

echo "gpu_check: tests rc=$tests_rc, benchmark rc=$bench_rc"
(( tests_rc == 0 && bench_rc == 0 ))
