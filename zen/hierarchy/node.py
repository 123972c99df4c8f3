"""One node call (:mod:`zen.hierarchy`): the node's agreement on its fast links, the three steps
(:mod:`zen.hierarchy.strided`, :mod:`zen.hierarchy.coo`), and errors told alike on every rank of every node."""
import re
import time

import torch

from .. import agreement
from ..agreement import MismatchError, Problem
from ..schemes.base import phase_range
from ..schemes.call import call_header, run_call
from ..transport import Comm
from .coo import node_sparse
from .plan import Scan
from .strided import node_strided
from .topology import Topology, node_comms


def node_call(comm: Comm, topology: Topology, tensor, scheme, scheme_name, stats, allowed, block_size, segments,
              value_dtype, setting) -> None:
    """The three steps of :mod:`zen.hierarchy`'s docstring, for ``comm``'s rank in ``topology`` (equal nodes);
    ``setting``: the call's (hierarchy, local_size), for its agreements."""
    intra, cross = node_comms(comm, topology)
    for sub in (intra, cross):
        sub.check_usable()
    header, detail, shape, name = call_header(comm, tensor, scheme, scheme_name, allowed, block_size, setting,
                                              value_dtype)
    node = topology.node_of(comm.rank)
    scan = None
    if not detail and tensor.layout == torch.strided and tensor.numel():
        try:
            with phase_range(name, "node_scan"):
                scan = Scan(tensor, segments, block_size)
        except Exception as error:  # told to the node in its agreement, so every rank raises alike
            header[-1] = Problem.FAILED_BEFORE_EXCHANGE
            detail = f"{type(error).__name__}: {error}"
    try:
        with phase_range(name, "intra_agree"):
            rows = agreement.agree(intra, header, scan.counts if scan else [], detail, shape, name)
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
    cross_stats = {}
    start = time.perf_counter()
    try:
        with torch.no_grad():
            if tensor.layout == torch.sparse_coo:
                phases = node_sparse(intra, cross, tensor, scheme, name, cross_stats, allowed, block_size, setting)
            elif scan is None:  # nothing to sum: the cross step's agreement still checks every node
                run_call(cross, tensor, scheme, name, cross_stats, allowed, block_size, whole=tensor, hierarchy=setting)
                phases = dict(intra_bytes=0)
            else:
                scan.plan(rows, intra.world)
                phases = node_strided(intra, cross, tensor, scan, scheme, name, cross_stats, allowed, block_size,
                                      value_dtype, setting)
    except MismatchError as error:  # raised by the cross step's agreement, alike on every rank
        raise MismatchError(_cross_text(str(error), topology)) from None
    except BaseException as error:  # noqa: B036  (part-way: the ranks are out of step)
        for sub in (intra, cross, comm):
            sub.fail(error)
        raise
    intra_bytes = phases.pop("intra_bytes")
    result = dict(cross_stats, hierarchy="node", intra_sparse=bool(scan and scan.sparse), nodes=len(topology.nodes),
                  local_size=len(topology.nodes[0]),
                  inter_bytes=cross_stats.get("bytes_sent", 0), intra_bytes=intra_bytes,
                  bytes_sent=cross_stats.get("bytes_sent", 0) + intra_bytes,
                  phases=dict(phases, **{f"cross_{k}": v for k, v in cross_stats.get("phases", {}).items()}),
                  seconds=time.perf_counter() - start)
    comm.last_stats = result
    if stats is not None:
        stats.update(result)


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

