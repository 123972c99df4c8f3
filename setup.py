"""Builds zen._C, one torch extension: CPU kernels always, CUDA kernels when a CUDA torch and nvcc are here.

Switches (environment):
  FORCE_CUDA=1        build the CUDA kernels even without a visible GPU or a CUDA torch
  FORCE_ONLY_CPU=1    never build them
  TORCH_CUDA_ARCH_LIST  the GPU architectures, 7.0 or newer (default "8.0;9.0" when no GPU is visible)
  MAX_JOBS            parallel compile jobs (default: sized from cores and free memory)
  ZEN_SANITIZE=1      AddressSanitizer + UndefinedBehaviorSanitizer build (run with LD_PRELOAD of libasan)
  ZEN_DEBUG=1         -O0 -g
  ZEN_PORTABLE=1      no -mpopcnt (added on x86-64 when the building machine has POPCNT: zen builds from source
                      where it runs; the kernels fall back to an inline count without it, csrc/include/zen/bits.h)
"""
import glob
import os
import sys

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def flag(name):
    return os.environ.get(name, "0") == "1"


def default_max_jobs():
    """One job per core, at most one per 2 GiB of available memory (nvcc can take that much)."""
    try:
        with open("/proc/meminfo") as f:
            available_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
        by_memory = max(1, available_kib // (2 * 1024 * 1024))
    except (OSError, StopIteration):
        by_memory = 1
    return str(max(1, min(os.cpu_count() or 1, by_memory)))


def cpu_has_popcnt():
    """Whether this x86-64 machine has POPCNT (every x86-64 CPU since 2008 does); False elsewhere."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64") or flag("ZEN_PORTABLE"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " popcnt" in line for line in f)
    except OSError:
        return False


def with_cuda():
    if flag("FORCE_ONLY_CPU"):
        return False
    if flag("FORCE_CUDA"):
        return True
    return torch.cuda.is_available() and torch.version.cuda is not None and CUDA_HOME is not None


def extension():
    os.environ.setdefault("MAX_JOBS", default_max_jobs())
    sources = [os.path.join("csrc", "ops.cpp")] + sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    cxx = ["-O3", "-std=c++17", "-fopenmp"] + (["-mpopcnt"] if cpu_has_popcnt() else [])
    nvcc = ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]
    link = ["-fopenmp"]
    macros = []
    if flag("ZEN_DEBUG"):
        cxx = ["-O0", "-g", "-std=c++17", "-fopenmp"] + (["-mpopcnt"] if cpu_has_popcnt() else [])
    if flag("ZEN_SANITIZE"):
        san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
        cxx += san + ["-g"]
        link += san
    include_dirs = [os.path.join(HERE, "csrc", "include")]
    if not with_cuda():
        return CppExtension("zen._C", sources, include_dirs=include_dirs, define_macros=macros,
                            extra_compile_args={"cxx": cxx}, extra_link_args=link)
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    check_archs()
    nvcc += ["--threads", os.environ.get("NVCC_THREADS", "2")]
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")) + glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
    cuda_version = torch.version.cuda or "unknown"
    macros += [("ZEN_WITH_CUDA", None), ("ZEN_CUDA_VERSION", f'"{cuda_version}"')]
    return CUDAExtension("zen._C", sources, include_dirs=include_dirs, define_macros=macros,
                         extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=link)


def check_archs():
    """The CUDA kernels use warp-match intrinsics (compute capability 7.0 and later): refuse older targets with
    a message, not an nvcc error deep in the build."""
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if listed:
        archs = [a.split("+")[0] for a in listed.replace(";", " ").split()]
    else:
        archs = ["%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    old = [a for a in archs if a.replace(".", "", 1).isdigit() and float(a) < 7.0]
    if old:
        sys.exit(f"zen: the CUDA kernels need compute capability 7.0 or newer; the build targets {', '.join(old)}. "
                 "Set TORCH_CUDA_ARCH_LIST to newer architectures, or FORCE_ONLY_CPU=1 for the CPU kernels only.")


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
