#!/usr/bin/env bash
# Compiles every CUDA source of csrc/cuda with nvcc for sm_80 and sm_90, without torch: a check that the
# kernels build on a machine with no GPU (the binding, ops_cuda.cpp, needs torch's CUDA headers and is
# built by setup.py only). Objects go to a temporary directory. One line per file; exits non-zero if any
# file fails, 0 with a note if nvcc is absent.
#   usage: bash benchmarks/compile_cuda.sh            (from anywhere; paths are the repo's)
#   NVCC=/path/to/nvcc  NVCC_FLAGS="-lineinfo"  to override
set -u
cd "$(dirname "$0")/.."

NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" ]]; then
  echo "nvcc not found, skipped"
  exit 0
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
flags=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -std=c++17 -O3
       -I csrc/include --expt-relaxed-constexpr -Xcompiler -Wall ${NVCC_FLAGS:-})

echo "$("$NVCC" --version | tail -1)"
shopt -s nullglob
sources=(csrc/cuda/*.cu)
if (( ${#sources[@]} == 0 )); then
  echo "no .cu files under csrc/cuda" >&2
  exit 1
fi
failed=0
for src in "${sources[@]}"; do
  start=$(date +%s)
  if log="$("$NVCC" "${flags[@]}" -c "$src" -o "$out/$(basename "$src" .cu).o" 2>&1)"; then
    warn=""
    [[ -n "$log" ]] && warn=" (with compiler output below)"
    printf 'ok    %-28s %3ss%s\n' "$src" "$(( $(date +%s) - start ))" "$warn"
    [[ -n "$log" ]] && echo "$log"
  else
    printf 'FAIL  %-28s %3ss\n' "$src" "$(( $(date +%s) - start ))"
    echo "$log"
    failed=1
  fi
done
exit $failed
