"""Plain-Python/torch references for the kernels: written from the documented definitions, used only as
test oracles (the library itself uses the one C++ definition in csrc/include/zen/hash.h)."""
import torch

MASK64 = (1 << 64) - 1


def fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & MASK64
    k ^= k >> 33
    k = (k * 0xC4CEB93FE53A87EB) & MASK64
    k ^= k >> 33
    return k


def partition_of(index: int, seed: int, n: int) -> int:
    """h0 as documented: the top 32 bits of fmix64(index ^ seed), multiplied by n, shifted down 32."""
    h = fmix64((index & MASK64) ^ (seed & MASK64))
    return ((h >> 32) * n) >> 32


def nonzero(dense: torch.Tensor):
    idx = torch.nonzero(dense != 0).view(-1)
    return idx, dense[idx]


def aggregate(indices: torch.Tensor, values: torch.Tensor):
    """Union ascending with summed values (sums in float64 for floats: an oracle, not a kernel)."""
    union, inverse = torch.unique(indices.long(), return_inverse=True)
    acc = torch.float64 if values.is_floating_point() else torch.int64
    sums = torch.zeros(union.numel(), dtype=acc).index_add_(0, inverse, values.to(acc))
    return union, sums.to(values.dtype)


def index_sets(numel: int, n: int, seed: int):
    parts = torch.tensor([partition_of(i, seed, n) for i in range(numel)], dtype=torch.int64)
    return [torch.nonzero(parts == j).view(-1) for j in range(n)]
