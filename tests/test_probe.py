"""The probe says what it is doing: it runs once per group for seconds to tens of seconds (the first
zen.predict, scheme "auto"), so it logs (logger "zen", INFO) what it probes before it starts, each phase,
and when it is done; zen itself configures no logging. Its rates stay finite where noise swamps a slope. Bad
arguments to zen.predict are refused before any exchange."""
import logging
import re
import time

import pytest
import torch

from distributed import run_ranks


def _probe_log(rank, world):
    import zen

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    log = logging.getLogger("zen")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    start = time.perf_counter()
    zen.probe_profile(message_bytes=1 << 16, repeats=1)  # the probe of the first zen.predict, at its smallest
    seconds = time.perf_counter() - start
    root = logging.getLogger()
    return ([(r.name, r.levelno, r.getMessage()) for r in records], seconds, len(root.handlers),
            [h for h in log.handlers if h is not handler])


def test_the_probe_logs_what_it_measures_and_how_long_it_took():
    for rank, (records, seconds, root_handlers, zen_handlers) in enumerate(run_ranks(2, _probe_log)):
        assert root_handlers == 0 and zen_handlers == []  # no basicConfig, no handler of zen's own
        assert all(name == "zen" and level == logging.INFO for name, level, _ in records), records
        messages = [m for _, _, m in records]
        first, last = messages[0], messages[-1]
        assert f"rank {rank} of 2: probing the group's links (gloo, cpu)" in first, first
        assert "rates (1x per size, 64 KiB up to 2 MiB per rank)" in first, first
        assert "seconds to tens of seconds" in first, first
        assert [m for m in messages if "links probed in" in m] and [m for m in messages if "calibration" in m]
        done = re.fullmatch(rf"zen: rank {rank}: probe done in ([0-9.]+) s", last)
        assert done and 0 < float(done.group(1)) <= seconds + 0.05, (last, seconds)


def test_a_rate_from_sizes_whose_times_noise_swamps_stays_finite_and_bounded():
    """t(b) = c + b / r: the slope between u and 4u gives r where their difference shows, and the 4u send less
    its fixed cost where it does not (a 4u send measured as fast as, or faster than, the u one)."""
    from zen.measurement.probe import slope_rate

    u, r, c = 1 << 20, 1e9, 1e-3
    assert slope_rate(u, c + u / r, c + 4 * u / r, c) == pytest.approx(r)
    assert slope_rate(u, c + u / r, c + 4 * u / r) == pytest.approx(r)  # the slope needs no fixed cost
    for one, four in [(2e-3, 2e-3), (3e-3, 2e-3), (2e-3, 2.1e-3)]:  # the difference lost in noise
        rate = slope_rate(u, one, four, c)
        assert rate == pytest.approx(4 * u / (four - c)) and 0 < rate < 1e10, (one, four, rate)
    assert slope_rate(u, 2e-3, 2e-3, 5e-3) == pytest.approx(4 * u / 1e-3)  # c at most half of t(4u)


def test_predict_refuses_bad_arguments_before_any_exchange():
    """Checked before the group is touched: no process group is needed to see them."""
    import zen

    with pytest.raises(ValueError, match="block_size"):
        zen.predict(torch.ones(100), block_size=0)
    with pytest.raises(TypeError, match="unsupported dtype torch.bool"):
        zen.predict(torch.ones(100, dtype=torch.bool))
    with pytest.raises(TypeError, match="strided"):
        zen.predict(torch.ones(10, 3).to_sparse(1), hierarchy="both")
    with pytest.raises(TypeError, match="torch.Tensor"):
        zen.measure([1.0, 2.0])
