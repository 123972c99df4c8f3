"""Exchange schedules (zen.schedules): every scheme is exact against dist.all_reduce under each schedule forced,
at 1-6 ranks, in every dtype, as rows and as elements; a forced schedule really runs (one peer each way per
round for "pairwise" and "ring"); the choice needs enough ranks and large pieces."""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def _schedules(rank, world):
    import zen
    from zen import schedules
    from zen.transport import Comm

    peers_per_round = []
    exchange = Comm.exchange

    def recording(self, sends, recvs):
        peers_per_round.append((len({p for p, t in sends if t.numel()}), len({p for p, t in recvs if t.numel()})))
        return exchange(self, sends, recvs)

    Comm.exchange = recording
    failures, seen = [], {}
    g = torch.Generator().manual_seed(100 + rank)
    for schedule in schedules.SCHEDULES:
        peers_per_round.clear()
        with schedules.forced(schedule):
            for scheme in ("zen", "agsparse", "sparcml", "omnireduce", "dense"):
                for dtype in DTYPES:
                    for block_size in (1, 8):
                        x = torch.zeros(600, 8, dtype=dtype)
                        rows = torch.randint(0, 600, (30,), generator=g)
                        x[rows] = torch.randint(-3, 4, (30, 8), generator=g).to(dtype)
                        want = x.clone()
                        dist.all_reduce(want)
                        zen.all_reduce(x, scheme=scheme, block_size=block_size)
                        if not torch.equal(x, want):
                            failures.append((schedule, scheme, str(dtype), block_size))
        seen[schedule] = sorted(set(peers_per_round))
    return failures, seen


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6])
def test_every_schedule_is_exact(world):
    for failures, seen in run_ranks(world, _schedules, timeout=600):
        assert failures == []
        if world > 2:  # one peer each way per round; "direct" posts to every peer at once
            assert seen["pairwise"] and all(s <= 1 and r <= 1 for s, r in seen["pairwise"]), seen
            assert seen["ring"] and all(s <= 1 and r <= 1 for s, r in seen["ring"]), seen
            assert seen["bruck"] and all(s <= 1 and r <= 1 for s, r in seen["bruck"]), seen


def test_the_choice_needs_ranks_and_large_pieces():
    from zen import schedules

    assert schedules.choose(8, 1 << 30, gather=True) == "direct"  # few ranks: one round, fan-in and all
    assert schedules.choose(32, 1 << 10, gather=False) == "direct"  # small pieces: the backend's all-to-all
    assert schedules.choose(32, 1 << 20, gather=True) == "ring"
    assert schedules.choose(32, 1 << 20, gather=False) == "pairwise"
    with schedules.forced("ring"):
        assert schedules.choose(2, 8, gather=True) == "ring" and schedules.choose(2, 8, gather=False) == "pairwise"
    with pytest.raises(ValueError, match="schedule must be one of"):
        with schedules.forced("butterfly"):
            pass


def test_ring_and_pairwise_rounds_cover_every_peer_once():
    from zen import schedules

    for n in range(1, 9):
        for me in range(n):
            pairs = schedules.pairwise_rounds(n, me)
            assert sorted(p for p, _ in pairs) == sorted(q for q in range(n) if q != me)
            assert sorted(q for _, q in pairs) == sorted(q for q in range(n) if q != me)
            ring = schedules.ring_rounds(n, me)
            assert sorted(r for _, r in ring) == sorted(q for q in range(n) if q != me)
            # what a rank sends in round k is what it received in round k-1 (its own piece first)
            assert [s for s, _ in ring] == ([me] + [r for _, r in ring[:-1]] if n > 1 else [])


def test_bruck_rounds_gather_every_piece_in_log_rounds():
    """Simulated over all ranks: each round a rank sends only pieces it holds, exactly what its peer expects,
    and after ceil(log2 n) rounds every rank holds every piece."""
    import math

    from zen import schedules

    for n in range(1, 18):
        held = [{r} for r in range(n)]
        rounds = [schedules.bruck_rounds(n, r) for r in range(n)]
        assert all(len(r) == math.ceil(math.log2(n)) for r in rounds)
        for k in range(len(rounds[0])):
            new = [set(h) for h in held]
            for r in range(n):
                to, source, sent, received = rounds[r][k]
                assert set(sent) <= held[r]
                assert rounds[source][k][0] == r and rounds[source][k][2] == received
                new[r] |= set(received)
            held = new
        assert all(h == set(range(n)) for h in held), n
