"""Multi-rank nodes: summed inside a node first, sparse across nodes (``hierarchy="node"``), the flat protocol
(``"flat"``), or whichever runs faster (``"auto"``).

With N nodes of G ranks (:mod:`zen.hierarchy.topology`), a node call on a tensor of M values runs three steps:

    1 reduce-scatter inside the node: local rank l receives shard l (M/G values, cut at row boundaries) of
      every rank of its node and sums them; (G-1)/G M s_v bytes per rank over the node's fast links
    2 local rank l all-reduces its shard with the chosen scheme across the nodes, over cross group l (one
      rank per node); the G cross groups run at once, so every rank's network card is busy. The scheme sees
      the density after the node's sum, so its dense switch decides on that
    3 all-gather inside the node: every rank receives the G summed shards; (G-1)/G M s_v bytes per rank

A sparse COO tensor (``nn.Embedding(sparse=True)``) stays sparse: step 1 sends each rank's rows of shard l to
local rank l, which sums them; step 2 reduces the shard's rows; step 3 gathers the summed rows.

Across the network a node sends its shards' union instead of its G ranks' entries: where the ranks of a node
share indices (the same words in a batch) the node sends fewer bytes, and each rank pulls only 1/G of the
union. What a node call costs beyond the cross step is the two steps on the fast links: dense (s_v M bytes
per rank in all), or sparse (each rank's entries, then the summed shards' entries) where the node's entries
take fewer bytes than the tensor (:class:`zen.hierarchy.plan.NodePlan`,
:func:`zen.hierarchy.cost.node_phases`).

Errors as in the flat call: bad input on any rank makes every rank raise a :class:`zen.MismatchError`. The
node's agreement (on its fast links) comes first; a node that fails it reports to the other nodes in the
cross step's agreement, where they raise too. Every rank must use the same ``hierarchy`` and ``local_size``:
the first call that looks for the nodes does so in an agreement on the whole group, where a rank that runs
flat (or with another setting) meets it, and every rank raises :class:`zen.MismatchError` naming them. Once
the nodes are known, a rank that changes its setting alone starts on other groups than its peers: they wait
on each other until the group's timeout, then raise :class:`zen.PeerError`.

The package, by part:

    policy      ``hierarchy=`` "flat", "node" or "auto": the choice per call, timed for "auto" (:data:`HIERARCHY`)
    node        one node call: its agreements on the node and across the nodes, its errors
    plan        the node's plan of a strided tensor (:class:`NodePlan`): blocks, shards, sparse or dense inside
    strided     the three steps on a strided tensor
    coo         the three steps on a sparse COO tensor
    topology    which ranks share a node; the intra-node and cross-node groups
    cost        the node steps' formulas (:func:`node_phases`)
    prediction  the node steps of ``zen.predict(hierarchy="node")``
"""
from .cost import node_phases
from .node import node_call
from .plan import NodePlan, shard_bounds, shard_segments
from .policy import HIERARCHY, Hierarchy, check_hierarchy
from .prediction import node_shard, node_step_times
from .topology import Topology, detect, node_comms

__all__ = ["HIERARCHY", "Hierarchy", "check_hierarchy", "node_call", "NodePlan", "shard_bounds", "shard_segments",
           "Topology", "detect", "node_comms", "node_phases", "node_shard", "node_step_times"]
