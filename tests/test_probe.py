"""The probe says what it is doing: it runs once per group for seconds to tens of seconds (the first
zen.predict, scheme "auto"), so the group's first rank prints one line (stderr, no logging setup needed) of
what it probes, about how long it takes and how to skip it before it starts; it logs (logger "zen", INFO)
each phase and when it is done; zen itself configures no logging. Its rates stay finite where noise swamps a slope. Bad
arguments to zen.predict are refused before any exchange."""
import contextlib
import io
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
    printed = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(printed):
        zen.probe_profile(message_bytes=1 << 16, repeats=1)  # the probe of the first zen.predict, at its smallest
    seconds = time.perf_counter() - start
    root = logging.getLogger()
    return ([(r.name, r.levelno, r.getMessage()) for r in records], seconds, len(root.handlers),
            [h for h in log.handlers if h is not handler], printed.getvalue())


def test_the_probe_logs_what_it_measures_and_how_long_it_took():
    for rank, (records, seconds, root_handlers, zen_handlers, printed) in enumerate(run_ranks(2, _probe_log)):
        assert root_handlers == 0 and zen_handlers == []  # no basicConfig, no handler of zen's own
        assert all(name == "zen" and level == logging.INFO for name, level, _ in records), records
        lines = printed.splitlines()
        if rank == 0:  # one line, before the probe: what, about how long, how to skip it
            assert len(lines) == 1, lines
            assert "zen: probing the links of a group of 2 ranks (gloo, cpu)" in lines[0], lines
            assert "64 KiB up to 2 MiB per rank" in lines[0] and "about 10-30 s" in lines[0], lines
            assert "zen.set_profile(group, bandwidth=..., latency=...) skips it" in lines[0], lines
        else:
            assert lines == [], lines
        messages = [m for _, _, m in records]
        assert [m for m in messages if "links probed in" in m] and [m for m in messages if "calibration" in m]
        done = re.fullmatch(rf"zen: rank {rank}: probe done in ([0-9.]+) s", messages[-1])
        assert done and 0 < float(done.group(1)) <= seconds + 0.05, (messages[-1], seconds)


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
