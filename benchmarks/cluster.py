#!/usr/bin/env python3
"""An emulated cluster on one machine: one network namespace per host, joined through a shaped bridge.

    python benchmarks/cluster.py --ranks 8 --bandwidth 1gbit -- python my_bench.py --flag
    python benchmarks/cluster.py --ranks 8 --ranks-per-host 4 --bandwidth 1gbit -- python my_bench.py

A host runs G ranks (--ranks-per-host, default 1; the ranks N must be a multiple of G), so there are
H = N / G hosts. What it builds (all of it inside network namespaces it creates, nothing in the host's own
namespace):

    namespace zenbr:  bridge zbr0, with ports zb0 .. zb{H-1}
    namespace zenJ:   host J: lo (up) and zvJ = 10.99.0.(J+1)/24, the other end of the veth pair zbJ <-> zvJ
    /etc/netns/zenJ/hosts: names for those addresses (seen as /etc/hosts inside zenJ): zen-rank0.. when
                      G = 1 (host J is rank J), zen-host0.. when G > 1

Every link is shaped in both directions with a token bucket (tc tbf) of rate R:

    host J upload   = egress of zvJ (inside zenJ)
    host J download = egress of zbJ (inside zenbr)

so a host can send at R and receive at R at the same time (full duplex), like a host on a switch with
R-bit/s ports. A transfer from host A to host B crosses two shaped queues (zvA, then zbB); its rate is
min(R, R) = R, and an incast of several hosts into B shares B's download R. With --latency L, a netem delay
of L/2 sits under each of the two token buckets, so the one-way host-to-host delay is L (round trip 2L); this
needs the kernel's sch_netem, which not every kernel has (an error says so). TCP in the namespaces runs
reno (see CONGESTION_CONTROL).

The G ranks of a host share its link, as the GPUs of a node share its NIC: their traffic to other hosts
queues in the same two token buckets. Between themselves they talk over the host's own address, which Linux
routes through the namespace's loopback (`ip route get` says "local ... dev lo"), never through zvJ: fast
and unshaped, as within a node (cluster_selftest.py measures both).

The rate counts Ethernet frames (IP + TCP headers included, preamble and FCS not): at MTU 1500 the TCP payload
can reach at most 1448/1514 = 95.6% of R.

Rank K runs on host J = K // G as `ip netns exec zenJ <command>` with MASTER_ADDR=10.99.0.1, MASTER_PORT,
RANK=K, WORLD_SIZE=N, LOCAL_RANK=K % G, LOCAL_WORLD_SIZE=G (as torchrun sets them), GLOO_SOCKET_IFNAME=zvJ
(gloo must use the host's shaped link, and binds to its address) and ZEN_CLUSTER_BANDWIDTH_BPS /
ZEN_CLUSTER_LATENCY_S (what the links are shaped to, in bits/s and seconds);
OMP_NUM_THREADS defaults to cores // ranks (at least 1), since all ranks share this machine's cores.

Clean-up is always done: on success, failure, exceptions, Ctrl-C and SIGTERM the ranks' process groups are
killed and the namespaces deleted (which deletes the veths, the bridge and their qdiscs with them). Leftovers
of a crashed earlier run (namespaces named zenbr / zen<digits>) are removed at start. A lock file keeps two
runs from tearing down each other.

Python API:

    with EmulatedCluster(ranks=4, bandwidth="1gbit") as cluster:
        codes = cluster.run([sys.executable, "bench.py"])   # one exit code per rank

    EmulatedCluster(ranks=8, bandwidth="1gbit", ranks_per_host=4)   # 2 hosts of 4 ranks

The CLI's exit code is the ranks' (launch.exit_code). What the links really carry is measured by
benchmarks/cluster_selftest.py. The benchmarks (allreduce.py, train.py) run on this cluster with --bandwidth,
through benchmarks/launch.py (and with G ranks per host where the script has --ranks-per-host).

Requires root, `ip` and `tc` (iproute2); otherwise the CLI exits with code 2 and says why.
"""

import argparse
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

BRIDGE_NS = "zenbr"
BRIDGE = "zbr0"
SUBNET_PREFIX = "10.99.0."  # host J has 10.99.0.(J+1)/24
# TCP congestion control inside the ranks' namespaces: loss-based, as Linux's default (cubic, which this
# sandbox does not let a namespace pick) is. bbr, this host's default, paces and probes on the shaped links:
# 4 ranks at 100 Mbit/s, pairwise exchanges of 1 MiB took 88-149 ms with bbr and 89-104 with reno (4 MiB:
# 9.7-11.3 MB/s against 11.4-11.7; the TCP payload's limit is 11.9), and a 16 MB dense all-reduce
# 2031-2245 ms against 2028-2035.
CONGESTION_CONTROL = "reno"
LOCK_PATH = "/run/zen-cluster.lock"
ETC_NETNS = "/etc/netns"  # `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts
MAX_HOSTS = 253  # .1 .. .253 keeps .0 and .255 (network, broadcast) free, plus slack

_OUR_NS = re.compile(r"^zen(br|\d+)$")


class ClusterSetupError(RuntimeError):
    """The cluster cannot be built here (not root, no iproute2, no netem, another run active). CLI exit code 2."""


class ClusterInterrupted(BaseException):
    """Raised in the main thread on SIGTERM/SIGHUP so that every `finally` runs (Ctrl-C raises KeyboardInterrupt)."""

    def __init__(self, signum):
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


# ----------------------------------------------------------------------------------------------------------
# units


def parse_bits_per_second(text):
    """A link rate in bits/s (not bytes/s, as zen's own parse_rate gives): '1gbit' -> 1e9. Units kbit, mbit,
    gbit, tbit (decimal, as tc) or bit; no unit means bit/s. tc shapes in bits/s, so the rate stays in them.

    tc's 'bps' means *bytes* per second, a classic source of 8x mistakes, so byte units are refused.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?bit)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"bad rate {text!r}: use e.g. 100mbit, 1gbit, 10gbit")
    scale = {None: 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}[m.group(2)]
    bps = float(m.group(1)) * scale
    if bps < 8000:
        raise ValueError(f"rate {text!r} is below 8 kbit/s")
    return bps


def parse_time(text):
    """'0.1ms' -> 1e-4 (s). Units s, ms, us; a bare number is seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"bad time {text!r}: use e.g. 0, 100us, 0.1ms")
    return float(m.group(1)) * {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}[m.group(2)]


# What one rank of a torch job holds here besides its workload's tensors (resident: torch, gloo and zen), with its
# heap trimmed between calls (benchmarks/allreduce.py: release_heap).
RANK_BYTES = 0.3 * 2**30


def per_core_rate(per_core_bps, ranks, ranks_per_host=1, cores=None):
    """A host's link rate where every rank gets ``per_core_bps`` for each core it has of this machine's:
    rate x cores / ranks per rank, times the host's ranks. Then the wire, not the shared cores, sets the time,
    as on a cluster where each worker has its own processor."""
    cores = cores or os.cpu_count() or 1
    return per_core_bps * cores / ranks * ranks_per_host


def check_memory(ranks, available=None, workload_bytes=0):
    """ValueError, before any rank starts, where ``ranks`` torch ranks (RANK_BYTES each, and ``workload_bytes``
    more each for what the script holds) would not fit the memory this machine has available (MemAvailable of
    /proc/meminfo)."""
    if available is None:
        try:
            with open("/proc/meminfo") as f:
                available = int(re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024
        except (OSError, AttributeError):
            return
    each = RANK_BYTES + workload_bytes
    need = ranks * each
    if need > available:
        raise ValueError(f"{ranks} ranks need about {need / 2**30:.1f} GiB of memory ({each / 2**30:.1f} GiB "
                         f"each); this machine has {available / 2**30:.1f} GiB available: use fewer ranks"
                         + (" or a smaller workload" if workload_bytes else ""))


def format_bits_per_second(bps):
    """A rate in bits/s as text: 1e9 -> '1 Gbit/s'."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.0f} bit/s"


# ----------------------------------------------------------------------------------------------------------
# small helpers around iproute2


def _sh(args, check=True):
    """Run one iproute2 command; raise ClusterSetupError with its stderr when it fails and check is set."""
    res = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and res.returncode != 0:
        raise ClusterSetupError(f"command failed ({res.returncode}): {' '.join(args)}\n{res.stderr.strip()}")
    return res


def check_prerequisites():
    """Root and iproute2 (`ip`, `tc`) are needed; say plainly which one is missing."""
    if os.geteuid() != 0:
        raise ClusterSetupError("the emulated cluster needs root (network namespaces, veths, tc); "
                                "run as root, or run the benchmark on loopback without cluster.py")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterSetupError(f"missing {' and '.join(missing)}: install iproute2 (apt-get install iproute2)")


def our_namespaces():
    """Names of existing namespaces that this tool creates (zenbr, zen0, zen1, ...)."""
    res = _sh(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if _OUR_NS.match(n)]


def _kill_namespace_pids(ns):
    """SIGKILL every process still living in one of our namespaces (a namespace stays alive while they do)."""
    res = _sh(["ip", "netns", "pids", ns], check=False)
    for tok in res.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def remove_namespaces():
    """Delete all our namespaces. Deleting a namespace deletes its veth ends (and so the peers), the bridge and
    every qdisc on them, so with our /etc/netns/<name> files this is the whole clean-up. Returns the names."""
    names = our_namespaces()
    for ns in names:
        _kill_namespace_pids(ns)
    for ns in names:
        _sh(["ip", "netns", "del", ns], check=False)
    if os.path.isdir(ETC_NETNS):
        for name in os.listdir(ETC_NETNS):
            if _OUR_NS.match(name):
                shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
        try:
            os.rmdir(ETC_NETNS)  # only succeeds when empty, i.e. nobody else keeps files there
        except OSError:
            pass
    return names


def netem_available():
    """sch_netem is optional in kernels; probe it on the loopback of our (fresh) bridge namespace."""
    res = _sh(["tc", "-n", BRIDGE_NS, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us"], check=False)
    if res.returncode == 0:
        _sh(["tc", "-n", BRIDGE_NS, "qdisc", "del", "dev", "lo", "root"], check=False)
        return True
    return False


def take_lock():
    """One cluster at a time on this machine: an exclusive flock, released by the kernel if we die."""
    os.makedirs(os.path.dirname(LOCK_PATH), exist_ok=True)
    f = open(LOCK_PATH, "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ClusterSetupError(f"another emulated cluster is running (lock {LOCK_PATH} is held)")
    return f


def cleanup_leftovers():
    """Remove what a crashed earlier run left (never a live run's: that one holds the lock)."""
    lock = take_lock()
    try:
        return remove_namespaces()
    finally:
        lock.close()


# ----------------------------------------------------------------------------------------------------------
# the cluster


class EmulatedCluster:
    """H = ranks / ranks_per_host namespaces zen0..zen{H-1} (hosts) on a bridge, every link shaped to
    `bandwidth` in both directions; rank K runs on host K // ranks_per_host.

    bandwidth: text as parse_bits_per_second takes it ('1gbit'), or a number of bits/s (kept in
    `bandwidth_bps`, bits/s); latency: text ('0.1ms') or seconds; ranks_per_host: G, ranks that share one
    host (its namespace, address and shaped link); ranks must be a multiple of it.

    Use as a context manager; `run(cmd)` runs cmd once per rank and returns the list of exit codes
    (negative: killed by that signal, as subprocess reports it). `first_failure` holds (rank, code) of the
    first rank, in time, that exited non-zero, or None; `timed_out` says whether run()'s timeout struck.
    """

    def __init__(self, ranks, bandwidth="1gbit", latency=0.0, master_port=29500, mtu=1500,
                 queue_ms=50.0, verbose=True, congestion_control=CONGESTION_CONTROL, ranks_per_host=1,
                 workload_bytes=0):
        ranks, per_host = int(ranks), int(ranks_per_host)
        if per_host < 1:
            raise ValueError(f"ranks per host must be at least 1, not {per_host}")
        if not 1 <= ranks <= MAX_HOSTS * per_host:
            raise ValueError(f"ranks must be in 1..{MAX_HOSTS * per_host}")
        if ranks % per_host != 0:
            raise ValueError(f"{ranks} ranks do not split into hosts of {per_host}: "
                             f"ranks must be a multiple of ranks per host")
        check_memory(ranks, workload_bytes=workload_bytes)
        self.ranks = ranks
        self.ranks_per_host = per_host
        self.hosts = ranks // per_host
        self.bandwidth_bps = parse_bits_per_second(bandwidth) if isinstance(bandwidth, str) else float(bandwidth)
        self.latency_s = parse_time(latency) if isinstance(latency, str) else float(latency)
        self.master_port = int(master_port)
        self.mtu = int(mtu)
        self.queue_ms = float(queue_ms)
        self.congestion_control = congestion_control
        self.verbose = verbose
        self.first_failure = None
        self.timed_out = False
        self._lock_file = None
        self._old_handlers = {}
        self._built = False
        self._procs = []

    # names and addresses ------------------------------------------------------------------------------
    @staticmethod
    def host_namespace(host):
        return f"zen{host}"

    @staticmethod
    def host_interface(host):
        """The veth end inside host's namespace: its shaped link (what GLOO_SOCKET_IFNAME names)."""
        return f"zv{host}"

    @staticmethod
    def host_address(host):
        return f"{SUBNET_PREFIX}{host + 1}"

    @staticmethod
    def host_port(host):
        """The bridge's port for host (in the bridge namespace)."""
        return f"zb{host}"

    def host_name(self, host):
        """host's name in the hosts files: zen-rankJ with one rank per host (host J is rank J), else zen-hostJ."""
        return f"zen-rank{host}" if self.ranks_per_host == 1 else f"zen-host{host}"

    def host(self, rank):
        return rank // self.ranks_per_host

    def local_rank(self, rank):
        return rank % self.ranks_per_host

    def namespace(self, rank):
        return self.host_namespace(self.host(rank))

    def interface(self, rank):
        """The shaped veth end of rank's host (what GLOO_SOCKET_IFNAME names)."""
        return self.host_interface(self.host(rank))

    def address(self, rank):
        """rank's host's address; ranks of one host reach each other on it through the loopback."""
        return self.host_address(self.host(rank))

    def _log(self, msg):
        if self.verbose:
            print(f"[cluster] {msg}", file=sys.stderr, flush=True)

    # context manager ----------------------------------------------------------------------------------
    def __enter__(self):
        check_prerequisites()
        self._take_lock()
        self._install_signal_handlers()
        try:
            stale = remove_namespaces()
            if stale:
                self._log(f"removed leftovers of an earlier run: {' '.join(stale)}")
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    def close(self):
        """Kill what we started, delete the namespaces, release the lock. Safe to call twice."""
        ignored = self._ignore_signals()  # a second Ctrl-C must not interrupt the clean-up itself
        try:
            self._kill_all()
            removed = remove_namespaces()
            if self._built:
                self._log(f"removed {len(removed)} namespaces")
            self._built = False
        finally:
            self._restore_signal_handlers(ignored)
            self._release_lock()

    # locking and signals ------------------------------------------------------------------------------
    def _take_lock(self):
        self._lock_file = take_lock()

    def _release_lock(self):
        if self._lock_file is not None:
            self._lock_file.close()  # closing the file releases the flock
            self._lock_file = None

    def _install_signal_handlers(self):
        # Only the main thread may set handlers; elsewhere the caller owns signal handling.
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            raise ClusterInterrupted(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _ignore_signals(self):
        """Ignore INT/TERM/HUP while cleaning up; returns the handlers in place before."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def _restore_signal_handlers(self, ignored):
        """Leaving the cluster: put back the handlers from before __enter__ (ours for TERM/HUP go away)."""
        for sig, current in ignored.items():
            signal.signal(sig, self._old_handlers.get(sig, current))
        self._old_handlers = {}

    # building -----------------------------------------------------------------------------------------
    def _gso_bytes(self):
        """Largest packet TCP may hand the veths at once (``gso_max_size``): R x 0.5 ms, within 8-64 KiB."""
        return int(min(64 * 1024, max(8 * 1024, self.bandwidth_bps / 8.0 * 0.5e-3)))

    def _tbf_args(self):
        """Token bucket for rate R (bit/s).

        burst: 1 ms worth of tokens at R, and at least two of the largest packets (``_gso_bytes``), which
        then fit whole (tbf would otherwise split them into MTU segments, costing CPU we do not have). A
        full bucket lets a message of up to the burst pass at the veth's own speed, not at R: with a fixed
        128 KiB burst, a 100 Mbit/s link carried 32 and 128 KiB messages at 92 and 138 MB/s (512 KiB: 15,
        8 MiB: 12.1). Packets are capped to match (the veths' gso_max_size) so the burst can stay small.
        limit: the queue, `queue_ms` worth of bytes at rate R plus the burst, deep enough that an incast of
        all ranks into one port queues instead of dropping.
        """
        rate_Bps = self.bandwidth_bps / 8.0
        burst = int(max(2 * self._gso_bytes(), rate_Bps * 1e-3))
        limit = int(rate_Bps * self.queue_ms * 1e-3) + burst
        return ["tbf", "rate", f"{int(self.bandwidth_bps)}bit", "burst", str(burst), "limit", str(limit)]

    def _shape(self, ns, dev):
        _sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:"] + self._tbf_args())
        if self.latency_s > 0:
            # Half the one-way delay on each of the two queues a packet crosses (sender's up, receiver's down).
            half_us = max(1, int(round(self.latency_s * 1e6 / 2)))
            _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                 "netem", "delay", f"{half_us}us", "limit", "100000"])

    def _build(self):
        t0 = time.monotonic()
        _sh(["ip", "netns", "add", BRIDGE_NS])
        self._built = True  # from here on, close() has something to remove
        if self.latency_s > 0 and not netem_available():
            raise ClusterSetupError("--latency needs the kernel's netem qdisc (sch_netem), which this kernel "
                                    "lacks; use --latency 0 (bandwidth shaping with tbf still works)")
        _sh(["ip", "-n", BRIDGE_NS, "link", "set", "lo", "up"])
        _sh(["ip", "-n", BRIDGE_NS, "link", "add", BRIDGE, "type", "bridge"])
        _sh(["ip", "-n", BRIDGE_NS, "link", "set", BRIDGE, "up"])
        for host in range(self.hosts):
            ns, dev, port = self.host_namespace(host), self.host_interface(host), self.host_port(host)
            _sh(["ip", "netns", "add", ns])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.congestion_control:
                _sh(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                     f"net.ipv4.tcp_congestion_control={self.congestion_control}"])
            # Created inside the bridge namespace with the peer placed straight into the host's namespace:
            # no interface ever appears in the host namespace.
            gso = ["gso_max_size", str(self._gso_bytes())]
            _sh(["ip", "-n", BRIDGE_NS, "link", "add", port, "mtu", str(self.mtu)] + gso + ["type", "veth",
                 "peer", "name", dev, "mtu", str(self.mtu)] + gso + ["netns", ns])
            _sh(["ip", "-n", BRIDGE_NS, "link", "set", port, "master", BRIDGE, "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{self.host_address(host)}/24", "dev", dev])
            _sh(["ip", "-n", ns, "link", "set", dev, "up"])
            self._shape(ns, dev)            # host's upload
            self._shape(BRIDGE_NS, port)    # host's download
            self._write_hosts(ns)
        where = "" if self.ranks_per_host == 1 else f" ({self.hosts} hosts of {self.ranks_per_host})"
        self._log(f"{self.ranks} ranks{where} on {BRIDGE_NS}/{BRIDGE}, every link "
                  f"{format_bits_per_second(self.bandwidth_bps)} each way, one-way latency "
                  f"{self.latency_s * 1e3:g} ms, MTU {self.mtu} (built in {time.monotonic() - t0:.1f} s)")

    def _write_hosts(self, ns):
        """Name every host's address (host_name: zen-rank0 ... or zen-host0 ...): gloo and c10d look up the
        peer's name, and without an entry that lookup goes to DNS servers unreachable from the namespace (a
        warning, or a delay)."""
        os.makedirs(os.path.join(ETC_NETNS, ns), exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{self.host_address(h)} {self.host_name(h)}" for h in range(self.hosts)]
        # c10d's store listens on a dual-stack socket and sees peers as ::ffff:10.99.0.x
        lines += [f"::ffff:{self.host_address(h)} {self.host_name(h)}" for h in range(self.hosts)]
        with open(os.path.join(ETC_NETNS, ns, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    # running ------------------------------------------------------------------------------------------
    def rank_env(self, rank, base=None):
        env = dict(os.environ if base is None else base)
        env.update({
            "MASTER_ADDR": self.address(0),
            "MASTER_PORT": str(self.master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.ranks),
            "LOCAL_RANK": str(self.local_rank(rank)),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_host),
            "GLOO_SOCKET_IFNAME": self.interface(rank),
            "ZEN_CLUSTER_BANDWIDTH_BPS": str(int(self.bandwidth_bps)),
            "ZEN_CLUSTER_LATENCY_S": repr(self.latency_s),
        })
        # N ranks share this machine's cores: without this every rank would start one thread per core.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.ranks)))
        return env

    def popen(self, rank, cmd, env=None, stdout=None, stderr=None):
        """Start cmd in rank's namespace, in its own process group (which close() kills) but in this
        process's session: with the kernel's autogroup scheduling, a session is a scheduling group, and
        ranks in sessions of their own were scheduled by each one's CPU history (8 ranks on 2 cores, 1 Gbit/s:
        zen at 4M elements and 0.1% took 35-62 ms after an idle 50 ms and 63-87 ms when each rank had
        checked its last result or spun 30 ms before that pause; 35-50 in every case in one session)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.namespace(rank)] + list(cmd),
                             env=self.rank_env(rank, env), stdout=stdout, stderr=stderr,
                             stdin=subprocess.DEVNULL, process_group=0)
        self._procs.append(p)
        return p

    def run(self, cmd, env=None, all_stdout=False, fail_grace=10.0, timeout=None):
        """Run `cmd` (a list) once per rank, wait for all, return their exit codes (by rank).

        Rank 0's stdout and stderr pass through unchanged; other ranks' stderr is forwarded line by line as
        "[rank K] ...", their stdout dropped unless all_stdout. When a rank fails, the others get `fail_grace`
        seconds to finish (a collective peer would hang otherwise) and are then killed. `timeout` (s) kills all
        ranks, which then report -SIGKILL / -SIGTERM.
        """
        if not self._built:
            raise RuntimeError("run() outside the `with EmulatedCluster(...)` block")
        cmd = list(cmd)
        self.first_failure = None
        self.timed_out = False
        procs, pumps = [], []
        out_lock = threading.Lock()
        try:
            for rank in range(self.ranks):
                if rank == 0:
                    p = self.popen(rank, cmd, env)
                else:
                    p = self.popen(rank, cmd, env, stdout=subprocess.PIPE if all_stdout else subprocess.DEVNULL,
                                   stderr=subprocess.PIPE)
                    pumps.append(_pump(p.stderr, sys.stderr, f"[rank {rank}] ", out_lock))
                    if all_stdout:
                        pumps.append(_pump(p.stdout, sys.stdout, f"[rank {rank}] ", out_lock))
                procs.append(p)
            deadline = None if timeout is None else time.monotonic() + timeout
            kill_at = None
            while True:
                states = [p.poll() for p in procs]  # poll every rank (any() would stop at the first live one)
                if all(c is not None for c in states):
                    break
                now = time.monotonic()
                if self.first_failure is None:
                    failed = [(rank, c) for rank, c in enumerate(states) if c not in (None, 0)]
                    if failed:
                        self.first_failure = failed[0]
                        kill_at = now + fail_grace
                        self._log(f"rank {failed[0][0]} exited with {failed[0][1]}; "
                                  f"stopping the others in {fail_grace:g} s unless they finish")
                if deadline is not None and now >= deadline:
                    self.timed_out = True
                    self._log(f"timeout after {timeout:g} s: killing all ranks")
                    self._kill_all()
                    break
                if kill_at is not None and now >= kill_at:
                    self._kill_all()
                    break
                time.sleep(0.05)
            codes = [p.wait() for p in procs]
            if self.first_failure is None:
                bad = [(r, c) for r, c in enumerate(codes) if c != 0]
                self.first_failure = bad[0] if bad else None
            return codes
        finally:
            self._kill_all()
            for host in range(self.hosts):
                # processes that left their process group (setsid, daemons) still hold our pipes open
                _kill_namespace_pids(self.host_namespace(host))
            for t in pumps:
                t.join(timeout=2.0)

    def _kill_all(self):
        """SIGTERM each live rank's process group, SIGKILL whatever is left 3 s later."""
        live = [p for p in self._procs if p.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            end = time.monotonic() + 3.0
            while time.monotonic() < end and any(p.poll() is None for p in live):
                time.sleep(0.05)
            live = [p for p in live if p.poll() is None]
            if not live:
                break
        for p in self._procs:
            if p.poll() is None:
                p.wait()
        self._procs = [p for p in self._procs if p.returncode is None]


def _pump(src, dst, prefix, lock):
    """Forward lines from a child's pipe to our stream with a prefix (a thread per pipe)."""
    def loop():
        for line in iter(src.readline, b""):
            with lock:
                if hasattr(dst, "buffer"):
                    dst.buffer.write(prefix.encode() + line)
                else:  # a replaced stream (e.g. under pytest) takes text
                    dst.write(prefix + line.decode(errors="replace"))
                dst.flush()
        src.close()
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


# ----------------------------------------------------------------------------------------------------------
# CLI


def main(argv=None):
    from launch import exit_code

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        prog="cluster.py",
        description="Run a command once per rank, each host (a network namespace running --ranks-per-host ranks) "
                    "behind a shaped link.",
        epilog="example: cluster.py --ranks 8 --bandwidth 1gbit -- python bench.py --size 1e7")
    ap.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help="ranks sharing one host's namespace and link, a divisor of --ranks (default 1)")
    ap.add_argument("--bandwidth", default="1gbit", help="rate of every link, each direction (default 1gbit)")
    ap.add_argument("--bandwidth-per-core", default=None,
                    help="instead of --bandwidth: this rate per core of this machine for every rank, each host's "
                         "link rate x cores / ranks x its ranks (e.g. 1gbit: 62.5 Mbit/s per host at 32 ranks "
                         "on 2 cores)")
    ap.add_argument("--latency", default="0", help="one-way host-to-host delay, e.g. 0.1ms (needs sch_netem)")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--queue-ms", type=float, default=50.0, help="queue depth of every shaped link, in ms at rate")
    ap.add_argument("--congestion-control", default=CONGESTION_CONTROL,
                    help=f"TCP congestion control in the ranks' namespaces (default {CONGESTION_CONTROL}; '' keeps "
                         "the kernel's default)")
    ap.add_argument("--cleanup", action="store_true", help="only remove leftovers of an earlier run, then exit")
    ap.add_argument("--all-stdout", action="store_true", help="also forward ranks 1.. stdout, prefixed")
    ap.add_argument("--fail-grace", type=float, default=10.0, help="seconds the others get after a rank fails")
    ap.add_argument("--timeout", type=float, default=None,
                    help="kill all ranks after this many seconds (exit code 124)")
    ap.add_argument("-q", "--quiet", action="store_true")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments to run on every rank")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd and not args.cleanup:
        ap.error("nothing to run: give `-- command ...` or --cleanup (the links' self-test: cluster_selftest.py)")
    try:
        check_prerequisites()
        if args.cleanup:
            print(f"removed: {' '.join(cleanup_leftovers()) or 'nothing'}", file=sys.stderr)
            return 0
        bandwidth = args.bandwidth
        if args.bandwidth_per_core:
            bandwidth = per_core_rate(parse_bits_per_second(args.bandwidth_per_core), args.ranks, args.ranks_per_host)
        cluster = EmulatedCluster(args.ranks, bandwidth, args.latency, args.master_port, args.mtu,
                                  args.queue_ms, verbose=not args.quiet, congestion_control=args.congestion_control,
                                  ranks_per_host=args.ranks_per_host)
    except (ClusterSetupError, ValueError) as e:
        print(f"cluster.py: error: {e}", file=sys.stderr)
        return 2

    def run(cluster):
        codes = cluster.run(cmd, all_stdout=args.all_stdout, fail_grace=args.fail_grace, timeout=args.timeout)
        if cluster.timed_out:
            print(f"cluster.py: timed out after {args.timeout:g} s (exit codes {codes})", file=sys.stderr)
        elif cluster.first_failure is not None:
            rank, code = cluster.first_failure
            print(f"cluster.py: rank {rank} failed first, exit code {code} (all: {codes})", file=sys.stderr)
        return exit_code(codes, cluster.timed_out, cluster.first_failure)

    return run_on(cluster, run, "cluster.py")


def run_on(cluster, body, prog: str) -> int:
    """A CLI's exit code for ``body(cluster)`` run inside the cluster: its own, or 2 for a setup error, 130 for
    Ctrl-C, 128 + the signal for a SIGTERM/SIGHUP (the cluster is cleaned up in every case)."""
    try:
        with cluster:
            return body(cluster)
    except ClusterSetupError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted, cleaned up", file=sys.stderr)
        return 130
    except ClusterInterrupted as e:
        print(f"{prog}: {e}, cleaned up", file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
