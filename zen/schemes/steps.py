"""What a scheme's two steps hand over (:class:`zen.schemes.base.Scheme`): ``open`` states what the call's
agreement is to carry (:class:`Opening`), the call agrees it (:class:`Agreed`), and ``finish`` runs the
protocol and returns the sum as one of the forms below, which the call writes back (``write``) or hands on as
COO pieces (``pieces``).

A union's pieces hold every index that is non-zero on any rank, also where the sum is zero, so writing them
over a rank's own data leaves nothing stale; the other forms say how they are written.
"""
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from .. import ops

Tensor = torch.Tensor
Piece = Tuple[Tensor, Tensor]  # (indices, values [k] or rows [k, b]), indices disjoint from the other pieces'


@dataclass
class Opening:
    """What a scheme needs agreed before its protocol runs: ``numbers``, this rank's row of ints in the
    agreement (every rank's come back, one row each); ``payloads``, this rank's bytes for each rank, whose first
    bytes ride in the agreement's planned slots (:func:`zen.agreement.agree_and_carry`), or None; ``state``,
    what the scheme keeps from its local work for :meth:`~zen.schemes.base.Scheme.finish`."""

    numbers: List[int]
    payloads: Optional[list] = None
    state: object = None


@dataclass
class Agreed:
    """The agreement of an :class:`Opening`: ``numbers``, every rank's row (int64 [n, len]); ``arrived[q]``, the
    first ``slots[q][me]`` bytes of rank q's payload for this rank (all slots 0 once the call has agreed: a
    later opening's numbers travel in a plain all-gather and nothing rides along); ``choice``, the sums over
    the ranks of a block-size choice's counts where they rode in front (:mod:`zen.schemes.call`), else None."""

    numbers: Tensor
    arrived: List[Tensor]
    slots: List[List[int]]
    choice: Optional[List[int]] = None


class Sum:
    """A scheme's sum, as ``finish`` returns it."""

    in_place = False  # written into the call's data already (``call.dense``)

    def write(self, flat: Tensor, indices: Tensor, values: Tensor) -> None:
        """The sum into ``flat``, whose non-zero entries on this rank were (indices, values)."""
        raise NotImplementedError

    def pieces(self, width: int) -> List[Piece]:
        """The sum as COO pieces of entries of ``width`` values (entries that summed to zero may be left out)."""
        raise NotImplementedError


@dataclass
class Union(Sum):
    """The union as COO pieces. ``covers_local``: False where the union may leave out some of this rank's
    entries (global top-k's owners dropped them: they are not in the sum), so they are cleared first."""

    parts: List[Piece] = field(default_factory=list)
    covers_local: bool = True

    def write(self, flat, indices, values) -> None:
        if not self.covers_local and self.parts:
            ops.scatter_(flat, indices, torch.zeros_like(values))
        ops.scatter_pieces_(flat, self.parts)

    def pieces(self, width: int) -> List[Piece]:
        return self.parts


@dataclass
class DenseSum(Sum):
    """The sum as one dense tensor of the data's size."""

    tensor: Tensor

    def write(self, flat, indices, values) -> None:
        flat.copy_(self.tensor)

    def pieces(self, width: int) -> List[Piece]:
        return [ops.nonzero_rows(self.tensor, width)]


class InPlace(Sum):
    """Summed into the call's data (``call.dense``) by the scheme itself: nothing left to write."""

    in_place = True

    def write(self, flat, indices, values) -> None:
        pass

    def pieces(self, width: int) -> List[Piece]:
        return []
