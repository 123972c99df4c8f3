"""The node steps of ``zen.predict(hierarchy="node")`` (:func:`zen.prediction.predict`): what a node call does
inside the node before its cross step, and the two steps' predicted seconds on the node's own profile; the
cross step is predicted as a flat call on the cross group."""
from ..agreement import MismatchError
from ..cost import Workload
from ..measurement.probe import probe_now
from ..measurement.store import cached_profile, set_profile
from .cost import node_phases
from .plan import NodePlan
from .policy import HIERARCHY
from .topology import node_comms


def node_shard(comm, tensor, local_size) -> tuple:
    """(intra, cross, plan, shard): the node's groups, its plan of ``tensor`` from every node rank's counts, and
    this rank's summed shard (summed dense, on a copy: the same sums), as a node call has them before its cross
    step (collective, on ``comm``'s lane)."""
    topology = HIERARCHY.topology(comm, local_size)
    if topology.local_size is None:
        raise MismatchError(f"zen.predict: hierarchy='node' needs nodes of equal size; {topology.describe()}")
    intra, cross = node_comms(comm, topology)
    plan = NodePlan(tensor.detach().clone(), None, None)
    plan.decide(intra.all_gather_ints(plan.counts), intra.world)
    intra.reduce_scatter(plan.flat, plan.bounds)
    return intra, cross, plan, plan.flat[plan.bounds[intra.rank]:plan.bounds[intra.rank + 1]]


def node_step_times(intra, plan: NodePlan, workload: Workload) -> dict:
    """Predicted seconds of the two steps inside the node (:func:`zen.hierarchy.cost.node_phases`) on the
    node's profile (probed on ``intra``'s ranks, once), ``workload`` that of the summed shards."""
    intra_profile = cached_profile(intra.user_group)
    if intra_profile is None:
        intra_profile = set_profile(intra.user_group, probe_now(intra))
    shard_bytes = sum(workload.nnz) / workload.n * (8 + workload.value_size)
    return node_phases(plan.flat.numel(), plan.flat.element_size(), intra.world, intra_profile,
                       max(plan.entry_bytes) if plan.sparse else None, shard_bytes)
