#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer check of the C++ kernels: builds zen._C with ZEN_SANITIZE=1
# (setup.py: -fsanitize=address,undefined -fno-sanitize-recover=undefined) in a throwaway copy of the
# repository, so the shared build is never replaced, then runs the kernel tests and the decoder fuzz tests
# against that build with libasan preloaded. Any out-of-bounds access or undefined behaviour aborts the run
# with a report; exit status is pytest's.
#   usage: bash benchmarks/sanitize.sh [extra pytest args]
#   PYTHON=/path/to/python (default: .venv/bin/python if present, else python3)
#   ZEN_ASAN_DIR=/some/dir  build there and keep it (default: a temporary directory, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
PYTHON="$(command -v "$PYTHON" || echo "$PYTHON")"
[[ "$PYTHON" = /* ]] || PYTHON="$PWD/$PYTHON"
if [[ -n "${ZEN_ASAN_DIR:-}" ]]; then
  work="$ZEN_ASAN_DIR"
  mkdir -p "$work"
else
  work="$(mktemp -d /tmp/zen-asan.XXXXXX)"
  trap 'rm -rf "$work"' EXIT
fi

# Sources only (no .git, no build outputs, no virtual environment).
tar --exclude=./.git --exclude=./build --exclude=./.venv --exclude='*.so' --exclude='*.egg-info' -cf - . \
  | tar -xf - -C "$work"
echo "building the sanitized extension in $work"
(cd "$work" && ZEN_SANITIZE=1 FORCE_ONLY_CPU=1 "$PYTHON" setup.py -q build_ext --inplace >/dev/null)

libasan="$(gcc -print-file-name=libasan.so)"
# libstdc++ too: python itself does not link it, and ASan must find the real __cxa_throw when it starts,
# or the first C++ exception (every TORCH_CHECK) aborts with "real___cxa_throw != 0".
libstdcxx="$(gcc -print-file-name=libstdc++.so)"
cd "$work"
# PYTHONPATH puts the copy's zen ahead of an editable install of the real one; check that it did.
export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" - <<'EOF'
import importlib.util, os
origin = importlib.util.find_spec("zen").origin
assert origin.startswith(os.environ["PYTHONPATH"].split(":")[0]), origin
EOF
echo "running under $libasan"
LD_PRELOAD="$libasan $libstdcxx" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_fuzz.py "$@"
