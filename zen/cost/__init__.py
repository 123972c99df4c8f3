"""zen's cost model: the closed forms below (ZEN, OSDI 2025, for zen and SparCML), with latency and local
compute terms, for every scheme (docs/cost_model.md: what the probe measures, and the planner).

Notation: n ranks, M elements, k_r non-zeros on rank r (k their mean, d = k / M the density), U the size of
the union of all ranks' non-zeros, gamma = U / k, lambda = heaviest partition / mean partition, s_i and s_v
bytes per index and per value. A :class:`Profile` gives the group's numbers:

    b      bandwidth per rank and direction, bytes/s (links are full duplex: a rank sends and receives at b);
           b_ar, b_a2a, b_p2p: what a ring all-reduce, an all-to-all and a pairwise exchange reach per rank
           (b_a2a of all-to-alls sent over zen's duplex transport, b_a2a' of smaller ones: geometry.duplex_all_to_all)
           (measured by the probe; they differ on real transports, an all-to-all's with the number of
           peers); b where not measured
    alpha  latency of one message step, s
    mu     memory bandwidth of the streaming kernels (non-zero scan, copies, dense adds), bytes/s
    e      time per pair of the hashing kernels (zen's partition, OmniReduce's block ids), s
    m      time per pair merged by ``ops.aggregate`` from n ascending runs (zen's aggregate, agsparse's sum), s
    m_2    the same from two runs (SparCML's merges): a k-way merge's work per pair grows with k, s
    f      time per non-zero found by the scan of a dense tensor (a set bit of its 64-element masks, the
           pair written and copied out of its chunk's stage), s
    w      time per element scattered at ascending positions (the write-back of the union; the cache
           lines of the output it writes are counted apart, at mu), s
    x_e    time per index encoded into a hash bitmap (a search of I_j from the last index, and a bit set), s
    x_d    time per index decoded from a hash bitmap (a set bit found and its I_j element written; the
           cache lines of I_j it reads are counted apart, at mu), s

Wire terms. A collective finishes when its most loaded link does: an all-to-all in which rank r sends S_r
and receives R_r bytes takes  c_a2a + max_r max(S_r, R_r) / b_a2a;  a ring all-gather of R bytes per rank
takes c_ag + (n-1) R / b; a ring all-reduce of M s_v bytes c_ar + 2 (n-1)/n M s_v / b_ar; a pairwise
exchange of S bytes c_p2p + S / b_p2p. The fixed costs are
measured by the probe (``zen.predict``), or, for a profile given as (b, alpha), counted in message steps:
c_ag = (n-1) alpha (ring), c_ar = 2 (n-1) alpha (ring), c_a2a = alpha and c_p2p = alpha (all pairs at once).
Every scheme starts with the agreement (an all-gather of a few int64 per rank).

Local terms. Finding the non-zeros of a dense tensor reads all of it and writes its pairs: M s_v / mu + f per
non-zero. Hashing costs e per pair, merging m per pair (m_2 from two runs), scattering into the output w per
element plus the cache lines of the output it writes, at mu (:func:`lines_bytes`), encoding or decoding a hash
bitmap x_e or x_d per index it holds, plus its |I_j| / 8 bytes (|I_j| ~ M/n) cleared or read at mu; a decode also
reads the cache lines of I_j that hold its |U_j| indices (nearly all of I_j once the fill passes 1/16, so at 8%
fill these reads cost 8x the per-index work); copies and dense adds cost their bytes / mu. The probe measures f, e,
m, m_2, w, x_e, x_d and mu with every rank running the kernel at once (the way a call runs them), so ranks that
share a host's cores or memory bandwidth show in them.

Closed forms (equal k_r, balanced partitions, no latency, no local terms), which the functions below reduce
to and the tests check:

    dense       2 (n-1)/n M s_v / b
    agsparse    (n-1) k (s_i + s_v) / b
    zen         (n-1)/n lambda (k + min(U (s_i + s_v), U s_v + M/8) / (s_i + s_v)) (s_i + s_v) / b      (ZEN Eq. 1)
    sparcml     sum_{i=1..log2 n} min(gamma(2^(i-1)) k (s_i + s_v), M s_v) / b                      (ZEN Eq. 2)
    omnireduce  (n-1)/n (lambda_push K + lambda_pull U_b) B s_v / b, K, U_b non-zero blocks of B elements

All inputs of the exact forms are in a :class:`Workload`: measured on a group by ``zen.measure``
or estimated from a few numbers by :func:`estimate_workload`. Each scheme declares its own time, phase and
memory formulas beside its protocol (``zen.schemes.<scheme>``), written in the building blocks of
:mod:`zen.cost.terms`; :func:`predict_times` and :func:`predict_memory` apply a set of them and need no
process group (``zen.predict_times`` applies every registered scheme's). A formula that needs more than the
Workload's built-in counts reads a :class:`Statistic` its scheme declares (:mod:`zen.cost.statistics`).
"""

from typing import Dict, Mapping

from .estimate import estimate_workload, hash_imbalance_estimate, skewed_loads, uniform_growth, union_growth
from .model import CALIBRATION_NUMELS, LOCAL_TIMES, PRIMITIVES, RATES, Profile, Workload
from .statistics import Statistic, for_scheme
from .terms import agree, balanced_bytes, dense_bytes, lines_bytes

__all__ = ["Profile", "Workload", "Statistic", "LOCAL_TIMES", "CALIBRATION_NUMELS", "PRIMITIVES", "RATES",
           "predict_times", "predict_memory", "choose", "estimate_workload", "hash_imbalance_estimate", "skewed_loads",
           "uniform_growth", "union_growth", "dense_bytes", "balanced_bytes", "lines_bytes"]


def predict_times(w: Workload, profile: Profile, formulas: Mapping) -> Dict[str, float]:
    """Predicted seconds of every scheme of ``formulas`` ({name: its scheme class, whose ``time(w, p)`` is
    its formula}) for workload ``w`` on ``profile``, each plus the profile's calibrated miss; "auto" is the
    smallest of them (what ``scheme="auto"`` picks). Each formula sees the statistics its scheme declares
    (:func:`zen.cost.statistics.for_scheme`). No collectives.

    >>> from zen.schemes import registered
    >>> w = estimate_workload(numel=10**6, n=8, nnz=10**4, gamma=4.0)
    >>> t = predict_times(w, Profile(bandwidth=125e6, latency=50e-6), registered())
    >>> min(t, key=t.get) in t
    True
    """
    names = [name for name in formulas if name != "auto"]
    if w.n <= 1:  # zen.all_reduce returns at once on one rank
        times = {name: profile.call_overhead for name in names}
    elif w.numel == 0:  # only the agreement runs
        times = {name: profile.call_overhead + agree(0, w, profile) for name in names}
    else:
        times = {name: formulas[name].time(for_scheme(w, name, formulas[name]), profile)
                 + profile.miss(name, w.numel) for name in names}
    times["auto"] = min(times.values())
    return times


def choose(times: Dict[str, float]) -> str:
    """The scheme with the smallest predicted time (ties: the first in ``times``' order); never "auto"."""
    names = [s for s in times if s != "auto"]
    return min(names, key=lambda s: (times[s], names.index(s)))


def predict_memory(w: Workload, formulas: Mapping) -> Dict[str, float]:
    """Predicted extra memory (bytes per rank, peak of the scheme's buffers and caches; the input tensor,
    allocator slack and the backend's own buffers not counted) of every scheme of ``formulas`` (whose
    ``memory(w)`` is its formula) for workload ``w``."""
    names = [name for name in formulas if name != "auto"]
    if w.n <= 1 or w.numel == 0:  # nothing is reduced
        return {name: 0.0 for name in names}
    return {name: formulas[name].memory(for_scheme(w, name, formulas[name])) for name in names}
