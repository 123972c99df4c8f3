"""benchmarks/simulate.py: its workloads are the drawn batches' own statistics, counted exactly, and its
validation compares a measured row with the simulation at that row's world, link and dim."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@pytest.fixture(scope="module")
def simulator():
    from simulate import Simulator, build_parser

    return Simulator(build_parser().parse_args(["--bandwidth", "1gbit", "--latency", "50us"]))


def test_the_workload_counts_the_drawn_batches(simulator):
    """The union, every rank's rows and the hash loads of the union, against the batches drawn here."""
    import workloads
    from zen import ops

    n = 5
    w = simulator.workload(n, 64)
    rows = [torch.unique(workloads.batch_token_ids(simulator.corpus, 2048, r, 0, 0)) for r in range(n)]
    union = torch.unique(torch.cat(rows))
    assert w.nnz == [r.numel() for r in rows]
    assert w.union == union.numel()
    loads = torch.bincount(ops.hash_partition(union.int(), n, 0).long(), minlength=n).tolist()
    assert w.hash_union == loads and sum(loads) == union.numel()
    assert w.numel == simulator.corpus.vocab_size and w.value_size == 64 * 4 and w.row_size == 64


def test_validation_compares_at_the_rows_world_link_and_dim(simulator, tmp_path):
    from simulate import validate

    vocab = simulator.corpus.vocab_size
    rows = [dict(scheme=s, data="text", world=4, numel=vocab * 32, link_bps=500e6, time_median=0.05)
            for s in ("dense", "zen")] + [dict(scheme="zen", data="uniform", world=4, numel=10, link_bps=1e9,
                                                time_median=1.0)]  # not the text workload: left out
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(rows))
    cells, mape = validate(simulator, [str(path)])
    assert [(c["scheme"], c["world"], c["dim"], c["link_Bps"]) for c in cells] == [
        ("dense", 4, 32, 62.5e6), ("zen", 4, 32, 62.5e6)]
    for c in cells:
        expected = simulator.times(4, 32, 62.5e6)[c["scheme"]]
        assert c["simulated_s"] == expected and c["error"] == pytest.approx((expected - 0.05) / 0.05)
        assert mape[c["scheme"]] == pytest.approx(100 * abs(c["error"]))


def test_probed_profiles_lie_on_lines_in_n(tmp_path):
    """--probed: a field at a probed world is the probe's; between two it is on their line in n, beyond them on
    the nearest two's (never below 0); rates follow the link as the probed fraction of it."""
    import dataclasses

    from simulate import Probed
    from zen.cost import Profile

    def probed(n, fixed, link_bps, rate):
        p = Profile(bandwidth=rate, latency=fixed, overheads=(("alltoall", fixed),), rates=(("alltoall", rate),),
                    calibration=(("zen", -fixed),))
        return dict(scheme="zen", world=n, link_bps=link_bps, profile=dataclasses.asdict(p))

    path = tmp_path / "probed.json"
    # fixed cost 1 ms at 2 ranks, 3 ms at 4; both probed at 90% of their link
    path.write_text(json.dumps([probed(2, 1e-3, 8e8, 0.9e8), probed(4, 3e-3, 4e8, 0.45e8)]))
    lines = Probed([str(path)])
    assert lines.worlds == [2, 4]
    at2, at3, at8 = lines.at(2, 1e8), lines.at(3, 1e8), lines.at(8, 1e8)
    assert dict(at2.overheads)["alltoall"] == pytest.approx(1e-3)
    assert dict(at3.overheads)["alltoall"] == pytest.approx(2e-3)
    assert dict(at8.overheads)["alltoall"] == pytest.approx(7e-3)  # 3 ms + 1 ms per rank past 4
    assert dict(at8.calibration)["zen"] == pytest.approx(-7e-3)  # a miss keeps its sign
    assert at3.bandwidth == pytest.approx(0.9e8) and dict(at3.rates)["alltoall"] == pytest.approx(0.9e8)
    path.write_text(json.dumps([probed(2, 3e-3, 8e8, 0.9e8), probed(4, 1e-3, 4e8, 0.45e8)]))
    assert dict(Probed([str(path)]).at(8, 1e8).overheads)["alltoall"] == 0.0  # a falling line stops at 0
