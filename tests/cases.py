"""Data for the multi-rank tests: each rank builds its own tensor from (case, rank), deterministically."""
import torch

KINDS = ["uniform", "skewed", "same", "disjoint", "edges", "some_empty", "all_empty", "dense", "nan_inf"]


def make(kind: str, numel: int, density: float, rank: int, world: int, seed: int, dtype=torch.float32,
         exact: bool = True) -> torch.Tensor:
    """A flat tensor of ``numel`` elements for ``rank``. ``exact``: values are multiples of 1/2 in [-8, 8),
    so every summation order gives the same sum in every dtype (bit-exact comparison)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    mask = torch.zeros(numel, dtype=torch.bool)
    if kind == "uniform":
        mask = torch.rand(numel, generator=g) < density
    elif kind == "skewed":  # Zipf-like: small indices hot, as frequency-ordered embedding rows
        pos = (torch.rand(max(1, int(numel * density)), generator=g) ** 3 * numel).long()
        mask[pos] = True
    elif kind == "same":  # every rank the same indices: union = one rank's set
        mask = torch.rand(numel, generator=torch.Generator().manual_seed(seed)) < density
    elif kind == "disjoint":
        mask = (torch.arange(numel) % world == rank) & (torch.rand(numel, generator=g) < density * world)
    elif kind == "edges":
        mask[0] = mask[-1] = True
    elif kind == "some_empty":
        if rank % 2 == 1:
            mask = torch.rand(numel, generator=g) < density
    elif kind == "dense":
        mask[:] = True
    elif kind == "nan_inf":
        mask = torch.rand(numel, generator=g) < density
    if exact:
        values = torch.randint(1, 16, (numel,), generator=g).float() * 0.5 * (torch.randint(0, 2, (numel,), generator=g) * 2 - 1)
    else:
        values = torch.randn(numel, generator=g)
    x = torch.where(mask, values, torch.zeros(())).to(dtype)
    if kind == "nan_inf" and numel >= 3 and dtype.is_floating_point:
        x[rank % numel] = float("nan") if rank == 0 else float("inf")
        x[-1] = -float("inf") if rank == world - 1 else x[-1]
    return x
