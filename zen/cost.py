"""The cost formulas of the design notes, in bytes sent per rank (divide by bandwidth for seconds).

Notation: n ranks, M elements, d mean density per rank, gamma = |union| / (M d), lambda = heaviest
partition / mean partition, s_i and s_v bytes per index and per value.
"""


def dense_bytes(numel: int, n: int, value_size: int) -> float:
    """Ring allreduce: 2 (n-1)/n * M s_v."""
    return 2.0 * (n - 1) / n * numel * value_size if n > 1 else 0.0


def balanced_bytes(numel: int, density: float, n: int, gamma: float, imbalance: float, index_size: int,
                   value_size: int) -> float:
    """Balanced Parallelism (ZEN Eq. 1, with the hash-bitmap pull):

    push = (n-1)/n * lambda * M d (s_i + s_v)
    pull = (n-1)/n * lambda * min(U (s_i + s_v), U s_v + M / 8),  U = min(M, gamma M d)
    """
    if n <= 1:
        return 0.0
    nnz = numel * density
    union = min(float(numel), gamma * nnz)
    push = nnz * (index_size + value_size)
    pull = min(union * (index_size + value_size), union * value_size + numel / 8.0)
    return (n - 1) / n * imbalance * (push + pull)
