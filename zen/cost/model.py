"""The cost model's inputs: a group's speeds (:class:`Profile`) and what one all-reduce must move
(:class:`Workload`). Pure data; no collectives."""
from dataclasses import dataclass, field
from typing import Any, Dict, Sequence

# The Profile's local kernel times (s), each >= 0; settable by name in zen.measurement.store.make_profile.
LOCAL_TIMES = ("element_time", "write_time", "found_time", "merge_time", "merge2_time", "encode_time",
               "decode_time")
# Sizes (elements) of the small and the large calibration call (zen.measurement.calibration).
CALIBRATION_NUMELS = (1 << 16, 1 << 22)
# The keys of the Profile's measured tables.
PRIMITIVES = ("allgather", "allreduce", "alltoall", "p2p")
RATES = ("allreduce", "alltoall", "alltoall_small", "p2p")


@dataclass(frozen=True)
class Profile:
    """A group's speeds. ``overheads`` holds measured fixed costs (s) of one call of a primitive:
    "allgather", "allreduce", "alltoall", "p2p"; a primitive not in it costs its message steps * latency.
    ``rates`` holds measured bytes/s per rank of "allreduce", "alltoall", "alltoall_small" and "p2p"; one not
    in it runs at ``bandwidth``. ``call_overhead``: the fixed cost of one zen call (the lane hand-off).
    ``calibration`` and ``calibration_large`` hold, per scheme, the seconds its formula missed on a measured
    call of ``CALIBRATION_NUMELS[0]`` and of ``CALIBRATION_NUMELS[1]`` elements (costs the per-primitive and
    per-element terms leave out; ``zen.measurement.calibration``); :meth:`miss` interpolates them for a call."""

    # metadata "unit": how the codec carries the field (zen.measurement.store): "B/s" as int bytes/s, "s" as
    # int picoseconds; "keys": the names of a table's entries ("schemes": the registered schemes').
    bandwidth: float = field(metadata={"unit": "B/s"})
    latency: float = field(metadata={"unit": "s"})
    memory_bandwidth: float = field(default=10e9, metadata={"unit": "B/s"})
    element_time: float = field(default=5e-9, metadata={"unit": "s"})
    write_time: float = field(default=2e-9, metadata={"unit": "s"})
    found_time: float = field(default=10e-9, metadata={"unit": "s"})
    merge_time: float = field(default=20e-9, metadata={"unit": "s"})
    merge2_time: float = field(default=15e-9, metadata={"unit": "s"})
    encode_time: float = field(default=20e-9, metadata={"unit": "s"})
    decode_time: float = field(default=8e-9, metadata={"unit": "s"})
    call_overhead: float = field(default=0.0, metadata={"unit": "s"})
    overheads: tuple = field(default=(), metadata={"unit": "s", "keys": PRIMITIVES})
    rates: tuple = field(default=(), metadata={"unit": "B/s", "keys": RATES})
    calibration: tuple = field(default=(), metadata={"unit": "s", "keys": "schemes"})
    calibration_large: tuple = field(default=(), metadata={"unit": "s", "keys": "schemes"})

    def __post_init__(self):
        if not self.bandwidth > 0:
            raise ValueError(f"Profile: bandwidth must be > 0 bytes/s; got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"Profile: latency must be >= 0 s; got {self.latency!r}")
        if not self.memory_bandwidth > 0:
            raise ValueError(f"Profile: memory_bandwidth must be > 0 bytes/s; got {self.memory_bandwidth!r}")
        for name in LOCAL_TIMES:
            if not getattr(self, name) >= 0:
                raise ValueError(f"Profile: {name} must be >= 0 s; got {getattr(self, name)!r}")
        if not all(rate > 0 for _, rate in self.rates):
            raise ValueError(f"Profile: rates must be > 0 bytes/s; got {self.rates!r}")

    def fixed(self, primitive: str, n: int) -> float:
        """Fixed cost of one call of ``primitive`` on n ranks."""
        if n <= 1:
            return 0.0
        measured = dict(self.overheads).get(primitive)
        if measured is not None:
            return measured
        steps = {"allgather": n - 1, "allreduce": 2 * (n - 1), "alltoall": 1, "p2p": 1}[primitive]
        return steps * self.latency

    def miss(self, scheme: str, numel: int) -> float:
        """Seconds added to ``scheme``'s formula for a call of ``numel`` elements: the small calibration's
        miss c_s up to M_s = CALIBRATION_NUMELS[0] elements, the large one's c_l from M_l = CALIBRATION_NUMELS[1]
        on, linear in M between them: c_s + (c_l - c_s) (M - M_s) / (M_l - M_s). Not extrapolated: the
        large call's miss (ranks that share cores waiting on each other after every local phase) grows
        with M, but slower than M. A scheme without a large calibration keeps c_s; 0 without any."""
        small = dict(self.calibration).get(scheme, 0.0)
        large = dict(self.calibration_large).get(scheme, small)
        lo, hi = CALIBRATION_NUMELS
        share = min(max((numel - lo) / (hi - lo), 0.0), 1.0)
        return small + (large - small) * share

    def rate(self, primitive: str) -> float:
        """Bytes/s per rank that ``primitive`` reaches ("allreduce", "alltoall", "alltoall_small", "p2p");
        "alltoall_small" (the backend's own all-to-all, where zen sends small ones) is "alltoall"'s where
        not measured."""
        rates = dict(self.rates)
        if primitive == "alltoall_small" and primitive not in rates:
            primitive = "alltoall"
        return rates.get(primitive, self.bandwidth)


@dataclass
class Workload:
    """What the formulas need to know about one all-reduce (counts may be fractional estimates).

    Counts are of entries: elements, or rows of b values where the call reduces rows; then numel is the
    number of rows, value_size the bytes of a row (b s_v) and block_size OmniReduce's block in rows, so
    every formula in bytes holds unchanged. row_size: b (1 for elements). row_choice: the call chooses its
    block size (its agreement carries 2 more counts).

    nnz[r]: non-zeros of rank r. union: |U|. hash_counts[r][j]: non-zeros of rank r that h0 sends to
    partition j; hash_union[j] = |U_j|. doubling_unions[s][g]: SparCML's running union after s doubling
    steps in core group g (core ranks [g 2^s, (g+1) 2^s) with the ranks folded into them); the last level
    has one group, the union. block_counts[r][w]: non-zero blocks of rank r in owner w's range;
    block_union[w]: non-zero blocks of the union in that range. dense_input: the tensor is strided (its
    non-zeros must be found and the union written back), not sparse COO.

    statistics: {name: value} of the statistics that schemes declare beyond these
    (:class:`zen.cost.Statistic`; formulas read one with :meth:`statistic`).
    """

    numel: int
    n: int
    nnz: Sequence[float]
    union: float
    hash_counts: Sequence[Sequence[float]]
    hash_union: Sequence[float]
    doubling_unions: Sequence[Sequence[float]]
    block_counts: Sequence[Sequence[float]]
    block_union: Sequence[float]
    index_size: int = 4
    value_size: int = 4
    block_size: int = 256
    dense_input: bool = True
    row_size: int = 1
    row_choice: bool = False
    statistics: Dict[str, Any] = field(default_factory=dict)

    def statistic(self, name: str) -> Any:
        """The value of the declared statistic ``name``; a LookupError naming it where the workload holds none
        (a formula reads only the statistics its scheme declares in ``statistics``)."""
        if name not in self.statistics:
            held = ", ".join(repr(key) for key in self.statistics) or "none"
            raise LookupError(f"the workload holds no statistic {name!r} (it holds {held}): a scheme's formulas "
                              f"read only the statistics the scheme declares in its `statistics`")
        return self.statistics[name]

    @property
    def gamma(self) -> float:
        mean = sum(self.nnz) / self.n
        return self.union / mean if mean else 0.0

    @property
    def hash_imbalance(self) -> float:
        loads = [sum(row[j] for row in self.hash_counts) for j in range(self.n)]
        return max(loads) * self.n / sum(loads) if sum(loads) else 1.0

    @property
    def block_imbalance(self) -> float:
        loads = [sum(row[w] for row in self.block_counts) for w in range(self.n)]
        return max(loads) * self.n / sum(loads) if sum(loads) else 1.0

