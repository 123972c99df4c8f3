"""A scheme written outside the package: registered with ``zen.register_scheme``, it is exact against
``dist.all_reduce`` and ``zen.predict`` and ``auto`` consider it."""
import pytest
import torch
import torch.distributed as dist

import zen
from cases import KINDS, make
from distributed import run_ranks
from zen.cost import terms


class GatherAll(zen.Scheme):
    """The naive all-reduce: every rank's COO pairs, padded to the longest, all-gathered, summed locally."""

    def reduce_coo(self, call, indices, values, numel):
        counts = call.agree([indices.numel()])[:, 0].tolist()
        width = max(counts)
        if width == 0:
            return []
        idx = torch.zeros(width, dtype=torch.int64)
        val = torch.zeros(width, dtype=values.dtype)
        idx[:indices.numel()], val[:values.numel()] = indices, values
        every_idx = [torch.empty_like(idx) for _ in counts]
        every_val = [torch.empty_like(val) for _ in counts]
        dist.all_gather(every_idx, idx, group=call.comm.group)
        dist.all_gather(every_val, val, group=call.comm.group)
        total = torch.zeros(numel, dtype=values.dtype)
        for k, i, v in zip(counts, every_idx, every_val):
            total.index_add_(0, i[:k], v[:k])
        union = torch.unique(torch.cat([i[:k] for k, i in zip(counts, every_idx)]))
        return [(union, total[union])]  # every index of the union, also where the sum is zero

    @staticmethod
    def phases(w, p):
        """agree: the counts; gather: two ring all-gathers of k_max pairs per rank (padded)."""
        padded = terms.coo(max(w.nnz), w)
        gather = 2 * p.fixed("allgather", w.n) + (w.n - 1) * padded / p.bandwidth
        return dict(scan=terms.scan(w, p), agree=terms.agree(1, w, p), gather=gather,
                    scatter=terms.write_back(w.union, w, p))

    @staticmethod
    def memory(w):
        return w.n * terms.coo(max(w.nnz), w) + w.numel * w.value_size


class Incomplete(zen.Scheme):
    def reduce_coo(self, call, indices, values, numel):
        return []


def test_register_checks_the_interface():
    with pytest.raises(TypeError, match="phases or time.*memory"):
        zen.register_scheme("incomplete", Incomplete)
    with pytest.raises(ValueError, match="reserved"):
        zen.register_scheme("auto", GatherAll)
    with pytest.raises(TypeError, match="subclass of zen.Scheme"):
        zen.register_scheme("plain", object)
    with pytest.raises(ValueError, match="already registered"):
        zen.register_scheme("zen", GatherAll)
    assert "incomplete" not in zen.SCHEMES and "plain" not in zen.SCHEMES


def _registered_scheme(rank, world):
    import zen
    from zen.auto import Auto

    zen.register_scheme("gatherall", GatherAll)
    assert "gatherall" in zen.SCHEMES
    wrong = []
    for i, kind in enumerate(KINDS):
        x = make(kind, 3001, 0.05, rank, world, seed=i)
        ref = x.clone()
        dist.all_reduce(ref)
        zen.all_reduce(x, scheme="gatherall")
        if not torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(ref, nan=7.0)):
            wrong.append(kind)
    x = make("uniform", 3001, 0.05, rank, world, seed=0)
    zen.set_profile(bandwidth="1gbit", latency="50us")
    predicted = zen.predict(x)
    stats = {}
    zen.all_reduce(x.clone(), scheme=Auto(), stats=stats)
    shared = {}
    zen.all_reduce(x.clone(), scheme="auto", stats=shared)
    return wrong, predicted, sorted(stats["auto"]["predicted"]), sorted(shared["auto"]["predicted"])


def test_registered_scheme_is_exact_and_considered():
    for wrong, predicted, auto_candidates, shared_candidates in run_ranks(3, _registered_scheme):
        assert wrong == []
        assert "gatherall" in predicted and predicted["gatherall"] > 0
        assert "gatherall" in auto_candidates and "gatherall" in shared_candidates
