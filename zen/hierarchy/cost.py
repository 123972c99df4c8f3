"""The cost of a node call's two steps inside the node (:mod:`zen.hierarchy`), beside the cross step that the
scheme's own formulas price (the notation: :mod:`zen.cost`, docs/cost_model.md)."""
from ..cost import Profile
from ..geometry import duplex_all_to_all


def node_phases(numel: int, value_size: int, local_size: int, intra: Profile, entry_bytes: float = None,
                shard_bytes: float = 0.0) -> dict:
    """The two steps of a node call beside the cross step, on the node's links (``intra``:
    the profile of a node's ranks, probed on them), for a strided tensor of M values, G ranks per node.

    Dense (``entry_bytes`` None): the shards themselves,
        reduce-scatter  c_a2a + (G-1)/G M s_v / b_a2a + M s_v (1 + 1/G) / mu   (G shards read, one written)
        all-gather      c_a2a + (G-1)/G M s_v / b_a2a + M s_v / mu
    Sparse: E, the largest bytes of entries of one rank of the node, and S, the bytes of the entries of one
    summed shard (``shard_bytes``),
        reduce-scatter  c_a2a + (G-1)/G E / b_a2a + M s_v / mu                 (the scan of the tensor)
        all-gather      c_a2a + (G-1) S / b_a2a + M s_v / G / mu                (the scan of the summed shard)

    b_a2a at the transport that the largest piece takes (``zen.geometry.duplex_all_to_all``)."""
    g = local_size
    if g <= 1:
        return dict(intra_reduce_scatter=0.0, intra_all_gather=0.0)
    nbytes = numel * value_size

    def wire_time(sent: float, piece: float) -> float:
        rate = intra.rate("alltoall" if duplex_all_to_all(g, piece) else "alltoall_small")
        return intra.fixed("alltoall", g) + sent / rate

    if entry_bytes is None:
        wire = wire_time((g - 1) / g * nbytes, nbytes / g)
        return dict(intra_reduce_scatter=wire + nbytes * (1 + 1 / g) / intra.memory_bandwidth,
                    intra_all_gather=wire + nbytes / intra.memory_bandwidth)
    return dict(intra_reduce_scatter=wire_time((g - 1) / g * entry_bytes, entry_bytes / g)
                + nbytes / intra.memory_bandwidth,
                intra_all_gather=wire_time((g - 1) * shard_bytes, shard_bytes) + nbytes / g / intra.memory_bandwidth)
