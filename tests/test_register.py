"""A scheme written outside the package: registered with ``zen.register_scheme``, it is exact against
``dist.all_reduce`` and ``zen.predict`` and ``auto`` consider it; one whose formulas read a statistic of its
own declares it, and ``zen.measure`` measures it."""
import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist

import zen
from cases import KINDS, make
from distributed import run_ranks
from zen import cost
from zen.cost import terms
from zen.cost.statistics import combine_columns, local_columns


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


class Pages(cost.Statistic):
    """The pages of ``page`` entries holding each rank's non-zeros: local [P_r = |{i // page : i in I_r}|],
    combined as [P_0, ..., P_{n-1}]. Estimate: k_r non-zeros spread uniformly over M entries fill each of the
    ceil(M / page) pages with probability 1 - (1 - k_r / M)^page."""

    name = "pages"

    def __init__(self, page: int = 64):
        self.page = page

    def size(self, n):
        return 1

    def local(self, indices, numel, n, seed):
        return [torch.unique_consecutive(indices // self.page).numel()]

    def combine(self, rows, n):
        return [row[0] for row in rows]

    def estimate(self, w):
        pages = -(-w.numel // self.page)
        return [pages * -math.expm1(self.page * math.log1p(-min(k / w.numel, 1 - 1e-16))) for k in w.nnz]


class PagedGather(zen.Scheme):
    """Every rank's non-zero pages all-gathered whole (page ids, and each page's values and presence flags,
    padded to the most pages on a rank), summed locally. Its formulas read the pages per rank, a statistic
    no built-in scheme measures."""

    statistics = (Pages(),)

    def reduce_coo(self, call, indices, values, numel):
        page, indices = self.statistics[0].page, indices.long()
        pages = torch.unique(indices // page)
        counts = call.agree([pages.numel()])[:, 0].tolist()
        width = max(counts)
        if width == 0:
            return []
        ids = torch.zeros(width, dtype=torch.int64)
        ids[:pages.numel()] = pages
        slots = torch.searchsorted(pages, indices // page) * page + indices % page
        page_values = torch.zeros(width * page, dtype=values.dtype).index_put_((slots,), values)
        present = torch.zeros(width * page, dtype=torch.uint8).index_put_(
            (slots,), torch.ones_like(slots, dtype=torch.uint8))
        gathered = []
        for mine in (ids, page_values, present):
            every = [torch.empty_like(mine) for _ in counts]
            dist.all_gather(every, mine, group=call.comm.group)
            gathered.append(every)
        total = torch.zeros(numel, dtype=values.dtype)
        seen = torch.zeros(numel, dtype=torch.bool)
        for k, i, v, held in zip(counts, *gathered):
            entries = (i[:k, None] * page + torch.arange(page)).reshape(-1)
            held = held[:k * page].bool()
            total.index_add_(0, entries[held], v[:k * page][held])
            seen[entries[held]] = True
        union = torch.nonzero(seen).reshape(-1)
        return [(union, total[union])]

    @staticmethod
    def page_bytes(w):
        """Bytes of the most pages on a rank, padded to: an 8-byte id, ``page`` values and flags each."""
        return max(w.statistic("pages")) * (8 + PagedGather.statistics[0].page * (w.value_size + 1))

    @staticmethod
    def phases(w, p):
        """agree: the page counts; gather: three ring all-gathers of the padded pages."""
        gather = 3 * p.fixed("allgather", w.n) + (w.n - 1) * PagedGather.page_bytes(w) / p.bandwidth
        return dict(scan=terms.scan(w, p), agree=terms.agree(1, w, p), gather=gather,
                    scatter=terms.write_back(w.union, w, p))

    @staticmethod
    def memory(w):
        return w.n * PagedGather.page_bytes(w) + w.numel * (w.value_size + 1)


class LongestRun(cost.Statistic):
    """The longest run of consecutive indices on any rank: local [its length on rank r], combined by max.
    No closed form."""

    name = "longest_run"

    def size(self, n):
        return 1

    def local(self, indices, numel, n, seed):
        if indices.numel() == 0:
            return [0]
        ends = torch.nonzero(torch.diff(indices) != 1).reshape(-1)
        edges = torch.cat([torch.tensor([-1]), ends, torch.tensor([indices.numel() - 1])])
        return [int(torch.diff(edges).max())]

    def combine(self, rows, n):
        return max(row[0] for row in rows)


class RunGather(GatherAll):
    """GatherAll, its time plus a write per entry of the longest run (a formula on a statistic without an
    estimate)."""

    statistics = (LongestRun(),)

    @classmethod
    def time(cls, w, p):
        return GatherAll.time(w, p) + w.statistic("longest_run") * p.write_time


class Peeking(GatherAll):
    """Reads the pages without declaring them."""

    @staticmethod
    def memory(w):
        return max(w.statistic("pages"))


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


def test_register_checks_the_statistics():
    for declared in (("pages",), [Pages()], (Pages(), None)):
        bad = type("Bad", (PagedGather,), dict(statistics=declared))
        with pytest.raises(TypeError, match="Bad.statistics must be a tuple of zen.cost.Statistic"):
            zen.register_scheme("bad", bad)
    unnamed = type("Unnamed", (Pages,), dict(name="two words"))
    with pytest.raises(ValueError, match="name 'two words' is not an identifier"):
        zen.register_scheme("bad", type("Bad", (PagedGather,), dict(statistics=(unnamed(),))))
    with pytest.raises(ValueError, match="'bad' declares statistic 'pages' as .*one name, one statistic"):
        zen.register_scheme("bad", type("Bad", (PagedGather,), dict(statistics=(Pages(), Pages(page=128)))))
    assert "bad" not in zen.SCHEMES
    assert Pages() == Pages(64) and Pages() != Pages(128) and Pages() != LongestRun()


def test_a_formula_reads_only_the_statistics_its_scheme_declares():
    profile = zen.Profile(bandwidth=125e6, latency=50e-6)
    w = cost.estimate_workload(1 << 16, 4, 1000, 2.0, statistics=(Pages(), LongestRun()))
    density = 1000 / (1 << 16)
    assert w.statistics == {"pages": pytest.approx([1024 * (1 - (1 - density) ** 64)] * 4)}  # no run: no estimate
    times = cost.predict_times(w, profile, {"paged": PagedGather})
    assert times["paged"] == pytest.approx(PagedGather.time(w, profile))
    with pytest.raises(LookupError, match="no statistic 'pages'.*declares in its `statistics`"):
        cost.predict_memory(w, {"peeking": Peeking})
    with pytest.raises(ValueError, match="scheme 'runs' reads the workload statistic 'longest_run'.*estimate"):
        cost.predict_times(w, profile, {"runs": RunGather})
    # Computed from index sets with the statistic's own local and combine, it predicts.
    indices = [torch.tensor(i, dtype=torch.int64) for i in ([3, 4, 5, 9], [0, 1, 2, 3, 4, 5, 6, 100], [], [7])]
    rows = [local_columns((LongestRun(),), i, 1 << 16, 4, 0) for i in indices]
    assert rows == [[3], [7], [0], [1]] and combine_columns((LongestRun(),), rows, 4) == {"longest_run": 7}
    runs = dataclasses.replace(w, statistics={"longest_run": 7})
    assert cost.predict_times(runs, profile, {"runs": RunGather})["runs"] == pytest.approx(
        GatherAll.time(runs, profile) + 7 * profile.write_time)
    # The values travel with the workload, e.g. through a results file's JSON.
    assert zen.Workload(**json.loads(json.dumps(dataclasses.asdict(w)))).statistics == w.statistics


def _wrong_kinds(scheme, rank, world):
    """The kinds of tensor (cases.KINDS) on which ``scheme`` differs from dist.all_reduce (NaN where it has NaN)."""
    import zen

    wrong = []
    for i, kind in enumerate(KINDS):
        x = make(kind, 3001, 0.05, rank, world, seed=i)
        ref = x.clone()
        dist.all_reduce(ref)
        zen.all_reduce(x, scheme=scheme)
        if not torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(ref, nan=7.0)):
            wrong.append(kind)
    return wrong


def _registered_scheme(rank, world):
    import zen
    from zen.auto import Auto

    zen.register_scheme("gatherall", GatherAll)
    assert "gatherall" in zen.SCHEMES
    wrong = _wrong_kinds("gatherall", rank, world)
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


def _paged_scheme(rank, world):
    import zen
    from zen.auto import Auto
    from zen.planner import workload_from_indices

    zen.register_scheme("paged", PagedGather)
    wrong = _wrong_kinds("paged", rank, world)
    x = make("skewed", 3001, 0.05, rank, world, seed=0)
    profile = zen.set_profile(bandwidth="1gbit", latency="50us")
    predicted = zen.predict(x)
    measured = zen.measure(x)
    indices = torch.nonzero(x).reshape(-1)
    everyone = [None] * world
    dist.all_gather_object(everyone, indices)
    offline = workload_from_indices(everyone, x.numel())
    more_pages = dataclasses.replace(measured, statistics={"pages": [2 * p for p in measured.statistic("pages")]})
    stats = {}
    zen.all_reduce(x.clone(), scheme=Auto(), stats=stats)
    coarse = type("Coarse", (PagedGather,), dict(name="coarse", statistics=(Pages(page=128),)))
    with pytest.raises(ValueError, match="'coarse' declares statistic 'pages' as .* but 'paged' declares it"):
        zen.register_scheme("coarse", coarse)
    return dict(wrong=wrong, predicted=predicted["paged"], formula=PagedGather.time(measured, profile),
                more_pages=PagedGather.time(more_pages, profile), measured=measured.statistics,
                offline=offline.statistics, indices=indices.tolist(), auto=sorted(stats["auto"]["predicted"]))


def test_a_scheme_declares_a_statistic_of_its_own():
    """A registered scheme whose time reads pages per rank: exact, and its prediction on a group uses the pages
    measured there, which are every rank's own (counted here from the ranks' indices) and those the planner
    computes from the same index sets."""
    results = run_ranks(3, _paged_scheme)
    pages = [len({i // 64 for i in r["indices"]}) for r in results]
    assert min(pages) > 0
    for r in results:
        assert r["wrong"] == []
        assert r["measured"] == r["offline"] == {"pages": pages}
        assert r["predicted"] == pytest.approx(r["formula"]) and r["more_pages"] > r["formula"]
        assert "paged" in r["auto"]
