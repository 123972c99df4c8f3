"""benchmarks/cluster.py's rules that need no root: the per-core link rate and the refusal of a world that does
not fit this machine's memory (before any rank starts)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def test_per_core_rate_gives_each_rank_its_cores_share():
    from cluster import per_core_rate

    assert per_core_rate(1e9, ranks=8, cores=2) == pytest.approx(250e6)
    assert per_core_rate(1e9, ranks=32, cores=2) == pytest.approx(62.5e6)
    assert per_core_rate(1e9, ranks=32, ranks_per_host=4, cores=2) == pytest.approx(250e6)  # 4 ranks share a host


def test_a_world_that_does_not_fit_is_refused_naming_what_it_needs():
    from cluster import RANK_BYTES, EmulatedCluster, check_memory

    check_memory(4, available=8 * 2**30)  # fits: nothing raised
    need = f"{32 * RANK_BYTES / 2**30:.1f}".replace(".", r"\.")
    with pytest.raises(ValueError, match=rf"32 ranks need about {need} GiB .* 4\.0 GiB available"):
        check_memory(32, available=4 * 2**30)
    with pytest.raises(ValueError, match=r"16 ranks need about 16\.0 GiB .*1\.0 GiB each.* or a smaller workload"):
        check_memory(16, available=12 * 2**30, workload_bytes=2**30 - RANK_BYTES)  # the script's tensors count
    too_many = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / RANK_BYTES) + 1
    with pytest.raises(ValueError, match="ranks need about"):
        EmulatedCluster(ranks=too_many, ranks_per_host=too_many)  # refused in the constructor: nothing built
