"""Schedules of the exchanges whose messages differ per peer, as MPI libraries run them at scale: which peers
a rank talks to in which round (Thakur, Rabenseifner and Gropp, IJHPCA 2005).

    "direct"    every message posted at once: one round, but each rank receives from n-1 peers at the same
                moment (on shallow switch buffers and shaped links, TCP incast)
    "pairwise"  personalised all-to-all in n-1 rounds: in round k, rank r sends to r+k and receives from r-k,
                one peer each way
    "ring"      all-gather in n-1 rounds: in round k, rank r sends to r+1 the piece it received in round k-1
                (its own first) and receives from r-1; bandwidth-optimal, one neighbour each way
    "bruck"     all-gather in ceil(log2 n) rounds (Bruck et al., 1997): in the round of distance d, rank r
                sends the pieces of ranks r .. r+m-1 it holds to r-d and receives those of r+d .. r+d+m-1
                from r+d, m = min(d, n-d); the pieces a rank holds double every round, any n

:func:`zen.transport.Comm.all_to_all` and :meth:`all_gather_bytes` pick one per call with :func:`choose`, from
the world size and the call's largest piece, which every rank knows alike (the schemes size every message
from their agreement). :func:`forced` fixes the choice, for tests and measurements.
"""
import contextlib
from typing import List, Optional, Tuple

import torch

from . import wire
from .geometry import duplex_all_to_all

SCHEDULES = ("direct", "pairwise", "ring", "bruck")
# From this many ranks on, an exchange whose pieces go point to point (their size passes the duplex rule) runs
# in rounds with one peer each way: below it the fan-in of n-1 flows costs less than n-2 rounds' latency.
ROUNDS_FROM_RANKS = 12
_forced: Optional[str] = None


@contextlib.contextmanager
def forced(schedule: Optional[str]):
    """Run every exchange started inside with ``schedule`` (alike on every rank: each rank must force the same)."""
    global _forced
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedules.forced: schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    before, _forced = _forced, schedule
    try:
        yield
    finally:
        _forced = before


def choose(n: int, largest: int, gather: bool) -> str:
    """The schedule of an exchange of n ranks whose largest message is ``largest`` bytes: "direct" for small
    pieces or few ranks, else "ring" for an all-gather (``gather``) and "pairwise" for an all-to-all."""
    if _forced is not None:
        return "pairwise" if _forced in ("ring", "bruck") and not gather else _forced
    if n < ROUNDS_FROM_RANKS or not duplex_all_to_all(n, largest):
        return "direct"
    return "ring" if gather else "pairwise"


def pairwise_rounds(n: int, me: int) -> List[Tuple[int, int]]:
    """(peer sent to, peer received from) of each of the n-1 rounds of the pairwise exchange."""
    return [((me + k) % n, (me - k) % n) for k in range(1, n)]


def ring_rounds(n: int, me: int) -> List[Tuple[int, int]]:
    """(piece sent, piece received) of each of the n-1 rounds of the ring all-gather: piece q is rank q's; a
    rank sends to me+1 and receives from me-1."""
    return [((me - k) % n, (me - k - 1) % n) for k in range(n - 1)]


def bruck_rounds(n: int, me: int) -> List[Tuple[int, int, List[int], List[int]]]:
    """(peer sent to, peer received from, pieces sent, pieces received) of each round of the Bruck all-gather:
    piece q is rank q's."""
    rounds, d = [], 1
    while d < n:
        m = min(d, n - d)
        rounds.append(((me - d) % n, (me + d) % n, [(me + i) % n for i in range(m)],
                       [(me + d + i) % n for i in range(m)]))
        d *= 2
    return rounds


def all_gather_in_rounds(exchange, schedule: str, pieces: List[torch.Tensor], n: int, me: int) -> None:
    """Fill ``pieces`` (byte tensors, piece q rank q's, this rank's own filled) by "ring" or "bruck" rounds;
    ``exchange(sends, recvs)`` is the transport's point-to-point exchange (``zen.transport.Comm.exchange``)."""
    if schedule == "ring":
        for sent, received in ring_rounds(n, me):
            exchange([((me + 1) % n, pieces[sent])], [((me - 1) % n, pieces[received])])
        return
    for to, source, sent, received in bruck_rounds(n, me):
        sizes = [pieces[q].numel() for q in received]
        inbox = torch.empty(sum(sizes), dtype=torch.uint8, device=pieces[me].device)
        exchange([(to, torch.cat([pieces[q] for q in sent]))], [(source, inbox)])
        for q, part in zip(received, wire.split(inbox, sizes)):
            pieces[q].copy_(part)
