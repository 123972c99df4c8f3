"""Which ranks share a node, and the two sub-groups a hierarchical call runs on: the ranks of this rank's node
(fast links) and the ranks of the same local rank on every node (the network).

A group of N nodes of G ranks each: node k holds group ranks nodes[k]; local rank l of every node forms the
cross group l, one rank per node. The nodes come from, in this order:

    local_size=G given       blocks of G consecutive group ranks (torchrun's layout)
    LOCAL_WORLD_SIZE=G       set alike on every rank (torchrun and benchmarks/cluster.py set it): ranks whose
                             global rank // G is equal share a node
    hostnames                ranks on one host share a node

Every rank takes part in one exchange, an agreement (:func:`zen.agreement.agree`) with the header of the
call that needs the nodes, so all ranks agree on the nodes or all raise: where a rank starts that call flat
(it takes part in the same exchange, its call's agreement) or with another ``hierarchy`` or ``local_size``,
every rank raises :class:`zen.MismatchError` naming them.
"""
import os
import socket
import zlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch.distributed as dist

from .. import agreement
from ..transport import Comm


@dataclass(frozen=True)
class Topology:
    """The nodes of a group: ``nodes[k]`` the group ranks of node k, ascending; nodes ordered by their first rank.
    ``source``: how they were found ("local_size", "LOCAL_WORLD_SIZE" or "hostname")."""

    nodes: Tuple[Tuple[int, ...], ...]
    source: str

    @property
    def local_size(self) -> Optional[int]:
        """G, the ranks per node, where every node has as many; None where they differ."""
        sizes = {len(node) for node in self.nodes}
        return sizes.pop() if len(sizes) == 1 else None

    def node_of(self, rank: int) -> int:
        return next(k for k, node in enumerate(self.nodes) if rank in node)

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def cross_ranks(self, local_rank: int) -> Tuple[int, ...]:
        """The group ranks of local rank ``local_rank`` on every node (equal nodes only)."""
        return tuple(node[local_rank] for node in self.nodes)

    def describe(self) -> str:
        if self.local_size is not None:
            return f"{len(self.nodes)} nodes x {self.local_size} ranks (from {self.source})"
        return f"nodes of unequal sizes {[len(node) for node in self.nodes]} (from {self.source})"


def _env_local_size() -> int:
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "0")), 0)
    except ValueError:
        return 0


def detect(comm: Comm, local_size: Optional[int] = None, header: Optional[list] = None, detail: str = "",
           shape=(), scheme_name: str = "") -> Topology:
    """The nodes of ``comm``'s group (collective: one agreement on it; on its lane). ``local_size``: ranks per
    node, given alike on every rank, or None to find it (see the module docstring). ``header``, ``detail``,
    ``shape``, ``scheme_name``: the agreement's arguments for the call that needs the nodes (by default a
    header that names only ``hierarchy="node"`` and ``local_size``)."""
    if header is None:
        header = [0] * len(agreement.HEADER_FIELDS)
        header[agreement.HEADER_FIELDS.index("hierarchy")] = agreement.hierarchy_code(("node", local_size))
    host = zlib.crc32(socket.gethostname().encode())
    global_rank = dist.get_global_rank(comm.group, comm.rank)
    rows = agreement.agree(comm, header, [_env_local_size(), host, global_rank], detail, shape, scheme_name)
    rows = rows.tolist()
    if local_size:
        blocks = [tuple(range(start, min(start + local_size, comm.world))) for start in range(0, comm.world, local_size)]
        return Topology(tuple(blocks), "local_size")
    env = {row[0] for row in rows}
    if len(env) == 1 and env != {0}:
        g = env.pop()
        return Topology(_grouped([row[2] // g for row in rows]), "LOCAL_WORLD_SIZE")
    return Topology(_grouped([row[1] for row in rows]), "hostname")


def _grouped(keys) -> Tuple[Tuple[int, ...], ...]:
    """Group ranks with equal keys, the groups ordered by their first rank."""
    nodes = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    return tuple(tuple(node) for node in nodes.values())


def node_comms(comm: Comm, topology: Topology) -> Tuple[Comm, Comm]:
    """(intra, cross): the sub-groups of this rank's node and of its local rank across the nodes (equal nodes
    only), created by their members on first use and cached on ``comm``."""
    tag = f":nodes{zlib.crc32(repr(topology.nodes).encode()):08x}"
    k = topology.node_of(comm.rank)
    local = topology.nodes[k].index(comm.rank)
    intra = comm.sub_comm(list(topology.nodes[k]), f"{tag}:node{k}")
    cross = comm.sub_comm(list(topology.cross_ranks(local)), f"{tag}:cross{local}")
    return intra, cross
