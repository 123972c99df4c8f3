"""The cost model's formulas against hand-computed values and the closed forms of zen.cost's docstring; the
estimates' properties; the planner command. No process group needed."""
import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zen import cost
from zen.cost import Profile, Workload, estimate_workload, terms
from zen.geometry import DUPLEX_ALL_TO_ALL_BYTES, DUPLEX_PAIR_BYTES, doubling_groups, duplex_all_to_all
from zen.planner import embedding_workload, expected_distinct, main, workload_from_indices, zipf_probabilities
from zen.measurement.timing import call_seconds, clock_id
from zen.prediction import predict_times
from zen.schemes import AllGatherSparse, BalancedParallelism, Dense, OmniReduce, SparCML, registered
from zen.units import parse_rate, parse_time

from reference import partition_of

B = 1e9  # bytes/s
NO_LOCAL = dict(memory_bandwidth=1e300, element_time=0.0, write_time=0.0, found_time=0.0, merge_time=0.0,
                merge2_time=0.0, encode_time=0.0, decode_time=0.0)
WIRE_ONLY = Profile(bandwidth=B, latency=0.0, **NO_LOCAL)


def agree_bytes(n, ints):
    """The agreement all-gather's wire time: (n-1) * 8 bytes per int of its row (13 header fields, the count of
    the extra ints, and max(extra, n + ceil(n / 4) + 8) slots)."""
    return (n - 1) * 8 * (13 + 1 + max(ints, n + -(-n // 4) + 8)) / B


def uniform(numel, n, nnz, gamma, **kw):
    return estimate_workload(numel, n, nnz, gamma, hash_imbalance=1.0, **kw)


# Measurements written out in plain torch (the partition hash from tests/reference.py), to check zen's.
def hash_loads(indices, n, seed):
    """[rank][partition]: how many of each rank's indices hash to each partition."""
    return [[sum(partition_of(i, seed, n) == j for i in idx.tolist()) for j in range(n)] for idx in indices]


def block_loads(indices, numel, block_size, n):
    """[rank][owner]: distinct blocks of each rank's indices in each owner's range (owner w holds blocks
    [w B / n, (w + 1) B / n) of the B = ceil(numel / block_size) blocks)."""
    blocks = -(-numel // block_size)
    out = []
    for idx in indices:
        mine = torch.unique(idx // block_size)
        out.append([int(((mine >= w * blocks // n) & (mine < (w + 1) * blocks // n)).sum()) for w in range(n)])
    return out


def imbalance(loads):
    """The busiest partition's load over the mean, loads summed over the ranks."""
    totals = [sum(col) for col in zip(*loads)]
    return max(totals) * len(totals) / sum(totals) if sum(totals) else 1.0


# ---------------------------------------------------------------------------------------------------------
# closed forms (wire only)


def test_dense_is_the_ring():
    w = uniform(10**6, 4, 1000, 2.0)
    assert Dense.time(w, WIRE_ONLY) == pytest.approx(2 * 3 / 4 * 4e6 / B + agree_bytes(4, 0), rel=1e-12)
    assert cost.dense_bytes(10**6, 4, 4) == 6e6
    assert cost.dense_bytes(10**6, 1, 4) == 0.0


def test_agsparse_is_n_minus_1_k():
    n, k = 5, 2000
    w = uniform(10**6, n, k, 3.0)
    assert AllGatherSparse.time(w, WIRE_ONLY) == pytest.approx((n - 1) * k * 8 / B + agree_bytes(n, 1), rel=1e-12)


def test_agsparse_uneven_takes_the_busiest_link():
    w = uniform(10**6, 3, 100, 3.0)
    w.nnz = [100, 1000, 10]  # rank 1 sends 2 * 1000 pairs; rank 2 receives 1100
    assert AllGatherSparse.time(w, WIRE_ONLY) == pytest.approx(2000 * 8 / B + agree_bytes(3, 1), rel=1e-12)


def test_measured_rates_replace_the_bandwidth_per_primitive():
    """A primitive's measured rate replaces b in its wire term only (the agreement's all-gather keeps b)."""
    n, k = 4, 2000
    w = uniform(10**6, n, k, 2.0)
    slow_a2a = Profile(bandwidth=B, latency=0.0, **NO_LOCAL,
                       rates=(("alltoall", B / 2), ("allreduce", B / 4), ("p2p", B / 8)))
    assert AllGatherSparse.time(w, slow_a2a) == pytest.approx(2 * (n - 1) * k * 8 / B + agree_bytes(n, 1), rel=1e-12)
    assert Dense.time(w, slow_a2a) == pytest.approx(4 * 2 * 3 / 4 * 4e6 / B + agree_bytes(n, 0), rel=1e-12)
    wire = SparCML.time(w, WIRE_ONLY) - agree_bytes(n, 1)
    assert SparCML.time(w, slow_a2a) - agree_bytes(n, 1) == pytest.approx(8 * wire, rel=1e-12)
    with pytest.raises(ValueError, match="rates"):
        Profile(bandwidth=B, latency=0.0, rates=(("p2p", 0.0),))


def test_small_all_to_alls_run_at_the_backends_own_rate():
    """An all-to-all whose largest piece is under DUPLEX_ALL_TO_ALL_BYTES (DUPLEX_PAIR_BYTES between two ranks)
    runs at "alltoall_small" (the
    transport ``Comm.all_to_all`` picks for it), one from it on at "alltoall"; unmeasured, small is big."""
    n = 4
    p = Profile(bandwidth=B, latency=0.0, **NO_LOCAL, rates=(("alltoall", B), ("alltoall_small", B / 2)))
    small, large = 1000, DUPLEX_ALL_TO_ALL_BYTES // 8 + 1  # pairs per rank (8 bytes each)
    for k, rate in ((small, B / 2), (large, B)):
        w = uniform(10**7, n, k, 2.0)
        assert AllGatherSparse.time(w, p) == pytest.approx((n - 1) * k * 8 / rate + agree_bytes(n, 1), rel=1e-12)
    assert Profile(bandwidth=B, latency=0.0, rates=(("alltoall", B / 3),)).rate("alltoall_small") == B / 3
    # Between two ranks the duplex transport takes over from DUPLEX_PAIR_BYTES (one peer: one message each way).
    assert not duplex_all_to_all(2, DUPLEX_PAIR_BYTES - 1) and duplex_all_to_all(2, DUPLEX_PAIR_BYTES)
    assert not duplex_all_to_all(4, DUPLEX_PAIR_BYTES) and duplex_all_to_all(4, DUPLEX_ALL_TO_ALL_BYTES)
    k = DUPLEX_PAIR_BYTES // 8
    assert AllGatherSparse.time(uniform(10**7, 2, k, 2.0), p) == pytest.approx(k * 8 / B + agree_bytes(2, 1), rel=1e-12)


def test_calibration_adds_each_schemes_missed_fixed_cost():
    w = uniform(10**6, 4, 2000, 2.0)
    calibrated = Profile(bandwidth=B, latency=0.0, **NO_LOCAL,
                         calibration=(("zen", 0.5), ("dense", 0.25)))
    base, shifted = predict_times(w, WIRE_ONLY), predict_times(w, calibrated)
    assert shifted["zen"] == pytest.approx(base["zen"] + 0.5, rel=1e-12)
    assert shifted["dense"] == pytest.approx(base["dense"] + 0.25, rel=1e-12)
    assert shifted["agsparse"] == base["agsparse"]


def test_calibration_is_interpolated_between_the_small_and_the_large_call():
    small, large = cost.CALIBRATION_NUMELS
    p = Profile(bandwidth=B, latency=0.0, **NO_LOCAL, calibration=(("zen", 0.5), ("dense", 0.25)),
                calibration_large=(("zen", 1.5),))
    assert p.miss("zen", 1000) == p.miss("zen", small) == 0.5
    assert p.miss("zen", (small + large) // 2) == pytest.approx(1.0, abs=1e-6)
    assert p.miss("zen", large) == p.miss("zen", 100 * large) == 1.5  # held, not extrapolated
    assert p.miss("dense", large) == 0.25 and p.miss("agsparse", large) == 0.0
    w = uniform(large, 4, 2000, 2.0)
    assert predict_times(w, p)["zen"] == pytest.approx(predict_times(w, WIRE_ONLY)["zen"] + 1.5, rel=1e-12)


def test_profile_travels_whole_between_ranks():
    """Rank 0's profile reaches every rank through one int64 row: every field, both calibrations."""
    from zen.measurement.store import decode, encode

    p = Profile(bandwidth=1.25e8, latency=5e-5, memory_bandwidth=3e9, element_time=9e-9, write_time=5e-9,
                found_time=4e-9, merge_time=3e-8, merge2_time=2e-8, encode_time=2e-8, decode_time=7e-9,
                call_overhead=8e-5,
                overheads=(("allgather", 6e-4), ("p2p", 3e-4)), rates=(("alltoall", 1.1e8),),
                calibration=(("dense", 0.0), ("zen", 8e-4)), calibration_large=(("zen", 0.05),))
    schemes = list(registered())
    assert decode(encode(p, schemes), schemes) == p
    assert len(encode(None, schemes)) == len(encode(p, schemes))


@pytest.mark.parametrize("gamma", [1.0, 3.5, 8.0])
def test_zen_is_equation_1(gamma):
    """(n-1)/n (k + gamma k) (s_i + s_v) / b with COO pulls, each piece padded to its slot: 2% and 2 standard
    deviations over what is expected in steady state (the push: the k / n pairs sent to each owner; the pull:
    the union U_j = k gamma / n, at most the k pairs received) and a 16-byte header in the pull. The agreement
    carries n counts, gamma and n union fractions, and the push's slots."""
    n, k, numel = 8, 10_000, 10**8
    w = uniform(numel, n, k, gamma)
    expected = (n - 1) / n * (k + gamma * k) * 8 / B
    union_j = k * gamma / n
    slot = 16 + 8 * min(k, math.ceil(1.02 * union_j + 2 * math.sqrt(union_j) + 4))
    push = (n - 1) * 8 * math.ceil(1.02 * k / n + 2 * math.sqrt(k / n) + 4) / B
    assert BalancedParallelism.time(w, WIRE_ONLY) == pytest.approx(
        push + (n - 1) * slot / B + agree_bytes(n, n + 1 + -(-n // 4)), rel=1e-9)
    assert cost.balanced_bytes(numel, k / numel, n, gamma, 1.0, 4, 4) / B == pytest.approx(expected, rel=1e-9)


def test_zen_pull_switches_to_the_bitmap_and_scales_with_imbalance():
    n, numel = 4, 1 << 20
    k = numel // 8  # union density n/8 = 50% > 1/32: the bitmap wins
    w = estimate_workload(numel, n, k, 4.0, hash_imbalance=1.0)
    union = w.union
    pull = (n - 1) / n * (union * 4 + numel / 8)
    push = (n - 1) * 8 * math.ceil(1.02 * k / n + 2 * math.sqrt(k / n) + 4)  # k / n pairs per slot, padded
    # gamma = n: the union is the bound, so its slot has no padding, only the 16-byte header
    assert BalancedParallelism.time(w, WIRE_ONLY) == pytest.approx(
        (push + pull) / B + agree_bytes(n, n + 1 + -(-n // 4)) + (n - 1) * 16 / B, rel=1e-9)
    heavy = estimate_workload(numel, n, k, 4.0, hash_imbalance=1.5)
    assert heavy.hash_imbalance == pytest.approx(1.5)
    assert BalancedParallelism.time(heavy, WIRE_ONLY) > BalancedParallelism.time(w, WIRE_ONLY) * 1.4


def test_sparcml_is_equation_2():
    """Power of two: sum_{i=1..log2 n} gamma(2^(i-1)) k (s_i + s_v) / b; disjoint ranks: gamma(m) = m."""
    n, k, numel = 8, 1000, 10**8
    w = estimate_workload(numel, n, k, float(n))
    expected = sum(2 ** (i - 1) * k * 8 for i in range(1, 4)) / B
    assert SparCML.time(w, WIRE_ONLY) == pytest.approx(expected + agree_bytes(n, 1), rel=1e-12)


def test_sparcml_messages_stop_at_dense():
    n, numel = 4, 1000
    w = estimate_workload(numel, n, 400, 4.0)  # 400 pairs = 3200 B < 4000 B dense; the union of 2 is dense
    steps = [min(400 * 8, 4000), min(800 * 8, 4000)]
    assert SparCML.time(w, WIRE_ONLY) == pytest.approx(sum(steps) / B + agree_bytes(n, 1), rel=1e-12)


def test_sparcml_folds_the_extra_ranks():
    """n = 3: rank 2 folds into 0 (k), one doubling step (the fold's union 2k), unfold of the union 3k."""
    k, numel = 100, 10**6
    w = estimate_workload(numel, 3, k, 3.0)
    expected = (k * 8 + 2 * k * 8 + 3 * k * 8) / B
    assert SparCML.time(w, WIRE_ONLY) == pytest.approx(expected + agree_bytes(3, 1), rel=1e-12)
    alpha = 1e-5
    with_latency = Profile(bandwidth=B, latency=alpha, **NO_LOCAL)
    # agreement ring (2 alpha), fold (1), step with header (2), unfold with header (2)
    assert SparCML.time(w, with_latency) == pytest.approx(expected + agree_bytes(3, 1) + 7 * alpha, rel=1e-9)


def test_omnireduce_blocks():
    """(n-1)/n (K + U_b) B s_v / b plus a bitmap of each owner's range per non-empty piece."""
    n, numel, bs = 4, 1 << 20, 256
    w = estimate_workload(numel, n, 1000, 2.0, block_nnz=400, block_union=800, hash_imbalance=1.0)
    ranges = numel // bs // n
    push = (n - 1) * (100 * bs * 4 + ranges / 8)
    pull = (n - 1) * (200 * bs * 4 + ranges / 8)
    assert OmniReduce.time(w, WIRE_ONLY) == pytest.approx(
        (push + pull) / B + agree_bytes(n, n) + (n - 1) * 8 / B, rel=1e-12)
    skewed = estimate_workload(numel, n, 1000, 2.0, block_nnz=400, block_union=800, block_imbalance=(3.0, 3.0))
    assert skewed.block_imbalance == pytest.approx(3.0)
    assert OmniReduce.time(skewed, WIRE_ONLY) > 2.5 * (push + pull) / B


def test_latency_terms_count_message_steps():
    p = Profile(bandwidth=B, latency=1e-5)
    assert p.fixed("allgather", 5) == pytest.approx(4e-5)
    assert p.fixed("allreduce", 5) == pytest.approx(8e-5)
    assert p.fixed("alltoall", 5) == p.fixed("p2p", 5) == pytest.approx(1e-5)
    assert p.fixed("allreduce", 1) == 0.0
    measured = Profile(bandwidth=B, latency=1e-5, overheads=(("alltoall", 3e-4),))
    assert measured.fixed("alltoall", 5) == 3e-4 and measured.fixed("p2p", 5) == 1e-5
    w = uniform(10**6, 5, 1000, 2.0)
    assert Dense.time(w, p) - Dense.time(w, WIRE_ONLY) == pytest.approx(4e-5 + 8e-5)


def test_local_terms():
    """The non-zero scan reads the tensor: M s_v / mu; the write-back of the union U writes its cache lines,
    a line per element while U is sparse; each block of 16 the scan finds a non-zero in costs f; a COO input
    skips all three. (One rank, to leave the wire terms out: the scheme's formula alone, which a real call at
    world size 1 never reaches, see test_one_rank_and_empty_tensors_cost_the_call_only.)"""
    slow_memory = Profile(bandwidth=1e300, latency=0.0, **dict(NO_LOCAL, memory_bandwidth=1e6))
    w = uniform(10**6, 1, 1000, 1.0)
    span = sum(w.block_union) * w.block_size  # the union's elements lie in its non-zero blocks
    assert cost.lines_bytes(w.union, span, 4) == pytest.approx(1000 * 64, rel=0.07)
    assert AllGatherSparse.time(w, slow_memory) == pytest.approx((4e6 + cost.lines_bytes(w.union, span, 4)) / 1e6)
    packed = dataclasses.replace(w, block_union=[1000 / 256])  # the same union in 4 full blocks: 1000 * 4 bytes
    assert AllGatherSparse.time(packed, slow_memory) == pytest.approx((4e6 + 4000) / 1e6, rel=1e-3)
    slow_finding = Profile(bandwidth=1e300, latency=0.0, **dict(NO_LOCAL, found_time=1e-6))
    assert AllGatherSparse.time(w, slow_finding) == pytest.approx(1000 * 1e-6)  # f per non-zero found
    w.dense_input = False
    assert AllGatherSparse.time(w, slow_memory) == pytest.approx(0.0, abs=1e-9)


def test_dense_densifies_coo_input_into_each_ranks_blocks():
    """COO input to dense: densify (M s_v) and find the union after (M s_v), both at mu, plus the scatter of
    k_r, whose lines are counted over rank r's own non-zero blocks: packed pairs write fewer lines."""
    slow_memory = Profile(bandwidth=1e300, latency=0.0, **dict(NO_LOCAL, memory_bandwidth=1e6))
    w = dataclasses.replace(uniform(10**6, 2, 1000, 1.0), dense_input=False)
    nothing_local = Profile(bandwidth=1e300, latency=0.0, **NO_LOCAL)
    span = sum(w.block_counts[0]) * w.block_size
    densify = Dense.time(w, slow_memory) - Dense.time(w, nothing_local)
    assert densify == pytest.approx((2 * 4e6 + cost.lines_bytes(1000, span, 4)) / 1e6)
    packed = dataclasses.replace(w, block_counts=[[1000 / 256 / 2] * 2] * 2)  # 4 full blocks: 4000 bytes
    assert Dense.time(packed, slow_memory) - Dense.time(packed, nothing_local) == pytest.approx(
        (2 * 4e6 + 4000) / 1e6, rel=1e-3)


def test_bitmap_coding_costs_per_index_plus_its_bytes():
    """Encode: x_e |U_r| + |I_r| / 8 / mu on the rank with the largest union piece; decode: the sum over
    the n bitmap pieces of x_d |U_j| + |I_j| / 8 / mu + the lines of I_j read / mu; nothing where COO wins."""
    n, numel = 4, 1 << 20
    coding = dict(NO_LOCAL, memory_bandwidth=1e9, encode_time=3e-9, decode_time=2e-9)
    w = estimate_workload(numel, n, numel // 8, 4.0, hash_imbalance=1.2)  # union 50%: the bitmap wins
    phases = BalancedParallelism.phases(w, Profile(bandwidth=1e300, latency=0.0, **coding))
    bitmap_bytes = numel / n / 8 / 1e9
    assert phases["encode"] == pytest.approx(max(w.hash_union) * 3e-9 + bitmap_bytes, rel=1e-9)
    lines = sum(cost.lines_bytes(u, numel / n, 4) for u in w.hash_union)
    assert numel * 4 * 0.99 < lines <= numel * 4  # half full: nearly every line of every I_j
    assert phases["decode"] == pytest.approx(w.union * 2e-9 + n * bitmap_bytes + lines / 1e9, rel=1e-9)
    sparse = estimate_workload(numel, n, numel // 1000, 4.0)  # union 0.4%: COO
    phases = BalancedParallelism.phases(sparse, Profile(bandwidth=1e300, latency=0.0, **coding))
    assert phases["encode"] == 0.0 and phases["decode"] == 0.0


def test_lines_bytes_counts_the_cache_lines_touched():
    span = 1 << 16
    assert cost.lines_bytes(span, span, 4) == span * 4 and cost.lines_bytes(0, span, 4) == 0.0
    assert cost.lines_bytes(span / 16, span, 4) == pytest.approx(span * 4 * (1 - (15 / 16) ** 16))
    assert cost.lines_bytes(10, span, 4) == pytest.approx(10 * 64, rel=0.01)  # sparse: a line per read
    sizes = [cost.lines_bytes(c, span, 8) for c in (1, 100, 1000, 10000, span)]
    assert sizes == sorted(sizes)


def test_profile_validates():
    with pytest.raises(ValueError, match="bandwidth"):
        Profile(bandwidth=0, latency=0)
    with pytest.raises(ValueError, match="latency"):
        Profile(bandwidth=1, latency=-1)


# ---------------------------------------------------------------------------------------------------------
# choices


def test_sparse_workloads_choose_a_sparse_scheme_and_dense_ones_dense():
    p = Profile(bandwidth=125e6, latency=50e-6)
    sparse = predict_times(uniform(10**7, 8, 1000, 4.0), p)
    assert cost.choose(sparse) != "dense"
    dense = predict_times(uniform(10**5, 8, 9 * 10**4, 1.1), p)
    assert cost.choose(dense) == "dense"
    assert set(predict_times(uniform(10**5, 8, 10, 1.0), p, ["zen", "dense"])) == {"zen", "dense", "auto"}


def test_one_rank_and_empty_tensors_cost_the_call_only():
    # One rank: zen.all_reduce checks the tensor and returns before any scheme runs (the sum over one rank is
    # the tensor itself; tests/test_reliability.py checks that), so every scheme costs the call and no memory.
    p = Profile(bandwidth=B, latency=1e-5, call_overhead=2e-5)
    assert set(predict_times(uniform(10**6, 1, 1000, 1.0), p).values()) == {2e-5}
    empty = predict_times(uniform(0, 4, 0, 1.0), p)
    assert list(empty.values()) == pytest.approx([2e-5 + 3e-5 + agree_bytes(4, 0)] * 6)  # call + agreement ring
    assert set(cost.predict_memory(uniform(10**6, 1, 1000, 1.0), registered()).values()) == {0.0}


def test_choose_breaks_ties_in_order():
    assert cost.choose({"zen": 1.0, "dense": 1.0, "auto": 1.0}) == "zen"
    assert cost.choose({"dense": 2.0, "sparcml": 1.0}) == "sparcml"


# ---------------------------------------------------------------------------------------------------------
# memory


def test_memory():
    w = uniform(1 << 20, 8, 1000, 4.0)
    memory = cost.predict_memory(w, registered())
    assert memory["dense"] == 0.0
    assert set(memory) == {"dense", "agsparse", "sparcml", "omnireduce", "zen"}
    # the all-gather holds every rank's piece: it grows with n, zen's buffers do not
    wide = uniform(1 << 20, 64, 1000, 4.0)
    assert AllGatherSparse.memory(wide) > 4 * AllGatherSparse.memory(w)
    assert BalancedParallelism.memory(wide) < 2 * BalancedParallelism.memory(w)
    # zen's bitmap pull caches the index sets: M int32 indices
    dense_union = uniform(1 << 20, 8, 1 << 17, 8.0)
    assert BalancedParallelism.memory(dense_union) >= (1 << 20) * 4
    # the aggregate's scratch: count indices and count sums (accumulated in at least 4 bytes), and the output
    assert terms.aggregate_bytes(1000, 10, dense_union) == 1000 * (4 + 4) + 10 * (4 + 4)
    half = uniform(1 << 20, 8, 1 << 17, 8.0, value_size=2)
    assert terms.aggregate_bytes(1000, 10, half) == 1000 * (4 + 4) + 10 * (4 + 2)


# ---------------------------------------------------------------------------------------------------------
# estimates


@given(nnz=st.floats(1, 1e6), n=st.integers(2, 64), ratio=st.floats(0, 1))
def test_union_growth_passes_through_its_ends(nnz, n, ratio):
    gamma = 1 + ratio * (n - 1)
    growth = cost.union_growth(nnz, gamma, n)
    assert growth(1) == pytest.approx(1.0, rel=1e-6)
    assert growth(n) == pytest.approx(gamma, rel=1e-6)
    values = [growth(m) for m in range(1, n + 1)]
    assert all(b >= a - 1e-9 for a, b in zip(values, values[1:]))  # grows
    assert all(v <= m + 1e-9 for m, v in enumerate(values, 1))  # at most m


def test_uniform_growth_is_balls_in_bins():
    growth = cost.uniform_growth(100, 1000)
    assert growth(2) == pytest.approx(1000 * (1 - 0.9 ** 2) / 100)
    assert cost.uniform_growth(100, 100)(5) == 1.0


def test_hash_imbalance_estimate():
    assert cost.hash_imbalance_estimate(1e4, 8) == pytest.approx(1 + math.sqrt(2 * 7 * math.log(8) / 1e4))
    assert cost.hash_imbalance_estimate(1e4, 1) == 1.0


def test_doubling_groups():
    assert doubling_groups(5) == [[[0, 4], [1], [2], [3]], [[0, 4, 1], [2, 3]], [[0, 4, 1, 2, 3]]]
    assert doubling_groups(1) == [[[0]]]
    assert doubling_groups(3) == [[[0, 2], [1]], [[0, 2, 1]]]


def test_expected_distinct_rows():
    """Uniform p = 1/V: V (1 - (1 - 1/V)^T) distinct rows; Zipf: fewer (hot rows repeat)."""
    rows, tokens = 1000, 500
    uniform_p = zipf_probabilities(rows, 0.0)
    assert expected_distinct(uniform_p, tokens).sum() == pytest.approx(rows * (1 - (1 - 1 / rows) ** tokens))
    assert expected_distinct(zipf_probabilities(rows, 1.0), tokens).sum() < expected_distinct(uniform_p, tokens).sum()


def union_of(indices, ranks):
    return torch.unique(torch.cat([indices[r] for r in ranks])).numel()


def test_workload_from_indices_against_plain_torch():
    """The one-process measurement (what the planner and the benchmarks measure with) against the same
    quantities counted here in plain torch: non-zeros, union, hash loads, block loads, doubling unions."""
    numel, n, block_size = 5000, 3, 64
    gen = torch.Generator().manual_seed(1)
    indices = [torch.unique(torch.randint(0, numel, (k,), generator=gen)) for k in (400, 50, 900)]
    indices[1] = torch.cat([indices[1], torch.arange(4000, 4100)])  # a dense run: few blocks
    w = workload_from_indices(indices, numel, block_size=block_size, seed=5)
    union = torch.unique(torch.cat(indices))
    assert w.nnz == [i.numel() for i in indices] and w.union == union.numel()
    assert w.hash_counts == hash_loads(indices, n, seed=5) and w.hash_union == hash_loads([union], n, seed=5)[0]
    assert w.block_counts == block_loads(indices, numel, block_size, n)
    assert w.block_union == block_loads([union], numel, block_size, n)[0]
    assert w.doubling_unions == [[union_of(indices, g) for g in level] for level in doubling_groups(n)]
    assert w.gamma == pytest.approx(union.numel() / (sum(i.numel() for i in indices) / n))
    assert w.hash_imbalance == pytest.approx(imbalance(hash_loads(indices, n, seed=5)))


def test_embedding_workload_against_sampling():
    """The expected-value workload against sampled Zipf batches, measured in plain torch (within a few %)."""
    rows, dim, tokens, world, block_size = 2000, 4, 300, 4, 16
    w = embedding_workload(rows, dim, tokens, world, zipf=1.0, block_size=block_size)
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor(zipf_probabilities(rows, 1.0))
    samples = []
    for _ in range(20):
        per_rank = []
        for _ in range(world):
            drawn = torch.unique(torch.multinomial(p, tokens, replacement=True, generator=gen))
            per_rank.append((drawn[:, None] * dim + torch.arange(dim)).view(-1))
        union = torch.unique(torch.cat(per_rank))
        blocks = block_loads(per_rank, rows * dim, block_size, world)
        samples.append(dict(nnz=sum(i.numel() for i in per_rank) / world, union=union.numel(),
                            blocks=sum(map(sum, blocks)) / world, imbalance=imbalance(blocks),
                            block_union=block_loads([union], rows * dim, block_size, world)[0],
                            doubling=[[union_of(per_rank, g) for g in level] for level in doubling_groups(world)]))
    mean = lambda key: sum(s[key] for s in samples) / len(samples)  # noqa: E731
    assert w.nnz[0] == pytest.approx(mean("nnz"), rel=0.03)
    assert w.union == pytest.approx(mean("union"), rel=0.03)
    assert sum(w.block_counts[0]) == pytest.approx(mean("blocks"), rel=0.03)
    assert w.block_union == pytest.approx([sum(s["block_union"][j] for s in samples) / len(samples)
                                           for j in range(world)], rel=0.05)
    assert w.block_imbalance == pytest.approx(mean("imbalance"), rel=0.05)
    for level, sampled in zip(w.doubling_unions, zip(*[s["doubling"] for s in samples])):
        assert level == pytest.approx([sum(g) / len(g) for g in zip(*sampled)], rel=0.03)


def test_parse_units():
    assert parse_rate("1gbit") == 1.25e8
    assert parse_rate("10GB/s") == 1e10
    assert parse_rate(5e6) == 5e6
    assert parse_time("50us") == pytest.approx(5e-5)
    assert parse_time("0.1ms") == pytest.approx(1e-4)
    with pytest.raises(ValueError):
        parse_rate("1gbps")


def test_a_calls_time_starts_when_the_last_rank_starts_it():
    # Two calls on three ranks; rank 2 starts each 4 s late and the ranks end 1 s apart.
    starts = [[0.0, 10.0], [0.0, 10.0], [4.0, 14.0]]
    ends = [[5.0, 15.0], [6.0, 17.0], [5.0, 16.0]]
    assert call_seconds(starts, ends, [7, 7, 7]) == [2.0, 3.0]  # one clock: last end - last start
    assert call_seconds(starts, ends, [7, 8, 7]) == [6.0, 7.0]  # clocks apart: the slowest rank's own time
    assert clock_id() == clock_id()


# ---------------------------------------------------------------------------------------------------------
# the planner command


def test_planner_embedding(capsys):
    assert main(["--embedding", "100000x64", "--batch-tokens", "2048", "--world", "8", "--bandwidth", "1gbit",
                 "--latency", "50us"]) == 0
    text = capsys.readouterr().out
    for scheme in ("dense", "agsparse", "sparcml", "omnireduce", "zen"):
        assert f"  {scheme} " in text
    assert "recommendation: scheme=" in text


def test_planner_json_and_gradients(tmp_path, capsys):
    gen = torch.Generator().manual_seed(0)
    paths = []
    for rank in range(2):
        grad = torch.zeros(500, 16)
        grad[torch.randint(0, 500, (40,), generator=gen)] = 1.0
        paths.append(str(tmp_path / f"rank{rank}.pt"))
        torch.save(grad, paths[-1])
    argv = ["--gradient", *paths, "--world", "2", "--bandwidth", "10gbit", "--latency", "20us", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    tensor = result["tensors"][0]
    assert set(tensor["times"]) == {"dense", "agsparse", "sparcml", "omnireduce", "zen", "auto"}
    # two files for two ranks: the exact workload, measured here with plain torch
    grads = [torch.load(p).view(-1) for p in paths]
    union = int(((grads[0] != 0) | (grads[1] != 0)).sum())
    mean_nnz = sum(int((g != 0).sum()) for g in grads) / 2
    assert tensor["numel"] == 8000 and tensor["density"] == pytest.approx(mean_nnz / 8000)
    assert tensor["gamma"] == pytest.approx(union / mean_nnz)
    indices = [torch.nonzero(g).view(-1) for g in grads]
    assert tensor["hash_imbalance"] == pytest.approx(imbalance(hash_loads(indices, 2, seed=0)))
    assert tensor["block_imbalance"] == pytest.approx(imbalance(block_loads(indices, 8000, 256, 2)))
    # fewer files than ranks: extrapolated
    assert main(["--gradient", paths[0], "--world", "8", "--bandwidth", "1gbit", "--latency", "50us"]) == 0
    assert "recommendation" in capsys.readouterr().out


def test_planner_rejects_bad_input(capsys):
    """argparse's error exit (status 2), naming what is wrong; an exit(0) or a bare exit would not do."""
    with pytest.raises(SystemExit) as exited:
        main(["--embedding", "100x", "--batch-tokens", "5", "--world", "2", "--bandwidth", "1gbit", "--latency", "1us"])
    assert exited.value.code == 2
    assert "error: --embedding '100x': expected ROWSxDIM" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["--world", "2", "--bandwidth", "1gbit", "--latency", "1us"])
    assert exited.value.code == 2
    assert "error: give --embedding ROWSxDIM (with --batch-tokens) or --gradient FILE.pt" in capsys.readouterr().err


def test_the_slot_rule_is_one_rule_for_one_count_and_for_a_plan():
    """push.plan sizes an n x n plan with cost.slot_counts; it must give slot_count's integers exactly (both
    ends of every push message size its slot from them), including around perfect squares and large counts."""
    from zen.schemes.balanced.cost import slot_count, slot_counts

    counts = sorted({c for k in range(1, 3000) for c in (0, k, k * k, k * k - 1, k * k + 1, 37 * k ** 2 + k)})
    assert slot_counts(torch.tensor(counts)).tolist() == [slot_count(c) for c in counts]
