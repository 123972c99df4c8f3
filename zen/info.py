"""``python -m zen.info``: what was built and what it runs on."""
import platform

import torch


def build_info() -> dict:
    from . import _C, SCHEMES, __version__

    return {
        "zen": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu kernels": "yes",
        "openmp": "yes" if _C.has_openmp() else "no",
        "cpu threads": torch.get_num_threads(),
        "cuda kernels": "yes" if _C.has_cuda_kernels() else "no",
        "cuda (extension)": _C.cuda_version or "-",
        "cuda (torch)": torch.version.cuda or "-",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-",
        "distributed backends": ", ".join(b for b in ("gloo", "nccl", "mpi")
                                          if getattr(torch.distributed, f"is_{b}_available")()),
        "schemes": ", ".join(SCHEMES),
    }


def main():
    info = build_info()
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
