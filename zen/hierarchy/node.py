"""One node call (:mod:`zen.hierarchy`): the node's agreement on its fast links, the three steps
(:mod:`zen.hierarchy.strided`, :mod:`zen.hierarchy.coo`), and errors told alike on every rank of every node."""
import dataclasses
import re
import time
from dataclasses import dataclass

import torch

from .. import agreement
from ..agreement import MismatchError, Problem
from ..schemes.base import Outcome, Request, phase_range
from ..schemes.call import call_header, run_call
from ..transport import Comm
from .coo import node_sparse
from .plan import NodePlan
from .strided import node_strided
from .topology import Topology, node_comms


@dataclass
class NodeFigures:
    """What a node call did beside its cross step (:attr:`zen.schemes.base.Outcome.node`): whether the steps
    inside the node went sparse, the nodes and their ranks, the bytes sent across and inside the nodes, and
    the call's seconds."""

    intra_sparse: bool
    nodes: int
    local_size: int
    inter_bytes: int
    intra_bytes: int
    seconds: float

    def as_stats(self) -> dict:
        return dataclasses.asdict(self)


def node_call(comm: Comm, topology: Topology, request: Request) -> Outcome:
    """The three steps of :mod:`zen.hierarchy`'s docstring, for ``comm``'s rank in ``topology`` (equal nodes)."""
    intra, cross = node_comms(comm, topology)
    for sub in (intra, cross):
        sub.check_usable()
    tensor = request.tensor
    header, detail = call_header(comm, request)
    shape, name = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else (), str(request.name)
    node = topology.node_of(comm.rank)
    plan = None
    if not detail and tensor.layout == torch.strided and tensor.numel():
        try:
            with phase_range(name, "node_scan"):
                plan = NodePlan(tensor, request.segments, request.block_size)
        except Exception as error:  # told to the node in its agreement, so every rank raises alike
            header[-1] = Problem.FAILED_BEFORE_EXCHANGE
            detail = f"{type(error).__name__}: {error}"
    try:
        with phase_range(name, "intra_agree"):
            rows = agreement.agree(intra, header, plan.counts if plan else [], detail, shape, name)
    except MismatchError as error:
        # This node cannot go on; the other nodes learn it in their cross step's agreement, whose row holds a
        # short text (n + 8 int64s): the message without its preamble and the explanations in parentheses.
        text = _group_ranks(str(error).removeprefix("zen.all_reduce: ").removeprefix(_DIFFER), topology, node)
        text = re.sub(r" \([^()]*[a-z][^()]*\)", "", text)  # the same text on every node, where it fits
        forwarded = list(header)
        forwarded[-1] = Problem.FAILED_BEFORE_EXCHANGE
        try:
            agreement.report(cross, forwarded, f"node {node}: {text}", shape=shape, scheme_name=name)
        except MismatchError:
            pass
        raise MismatchError(f"zen.all_reduce: on node {node}: {text}") from None
    except BaseException as error:  # noqa: B036  (the exchange itself failed)
        intra.fail(error)
        comm.fail(error)
        raise
    start = time.perf_counter()
    try:
        with torch.no_grad():
            if tensor.layout == torch.sparse_coo:
                phases, crossed = node_sparse(intra, cross, request)
            elif plan is None:  # nothing to sum: the cross step's agreement still checks every node
                crossed = run_call(cross, dataclasses.replace(request, segments=None, checked=tensor))
                phases = dict(intra_bytes=0)
            else:
                plan.decide(rows, intra.world)
                phases, crossed = node_strided(intra, cross, plan, request)
    except MismatchError as error:  # raised by the cross step's agreement, alike on every rank
        raise MismatchError(_cross_text(str(error), topology)) from None
    except BaseException as error:  # noqa: B036  (part-way: the ranks are out of step)
        for sub in (intra, cross, comm):
            sub.fail(error)
        raise
    intra_bytes = phases.pop("intra_bytes")
    figures = NodeFigures(intra_sparse=bool(plan and plan.sparse), nodes=len(topology.nodes),
                          local_size=len(topology.nodes[0]), inter_bytes=crossed.bytes_sent, intra_bytes=intra_bytes,
                          seconds=time.perf_counter() - start)
    return dataclasses.replace(crossed, bytes_sent=crossed.bytes_sent + intra_bytes, hierarchy="node", node=figures,
                               phases=dict(phases, **{f"cross_{k}": v for k, v in crossed.phases.items()}))


_DIFFER = "tensors or arguments differ across ranks: "


def _group_ranks(text: str, topology: Topology, node: int) -> str:
    """An error of node ``node``'s agreement, its ranks ("rank q", "ranks [q, ...]": ranks of the node) as
    ranks of the whole group."""
    rank = lambda q: topology.nodes[node][int(q)]  # noqa: E731
    text = re.sub(r"\brank (\d+)", lambda m: f"rank {rank(m.group(1))}", text)
    return re.sub(r"\branks \[([\d, ]*)\]", lambda m: f"ranks {[rank(q) for q in m.group(1).split(', ')]}", text)


def _cross_text(text: str, topology: Topology) -> str:
    """An error of a cross step's agreement as the same text on every rank: a node's forwarded failure as
    "on node k: ...", else the cross group's ranks (rank k: node k, whose ranks agreed among themselves) as
    the nodes' ranks of the whole group."""
    if "failed before the exchange: node " in text:
        return re.sub(r"rank \d+: failed before the exchange: (node \d+): ", r"on \1: ", text)
    ranks = lambda qs: sorted(r for k in qs for r in topology.nodes[int(k)])  # noqa: E731
    text = re.sub(r"\brank (\d+):", lambda m: f"node {m.group(1)} (ranks {ranks([m.group(1)])}):", text)
    return re.sub(r"\branks \[([\d, ]*)\]", lambda m: f"ranks {ranks(m.group(1).split(', '))}", text)

