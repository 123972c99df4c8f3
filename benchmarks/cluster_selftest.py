#!/usr/bin/env python3
"""Self-test of the emulated cluster (benchmarks/cluster.py): what its shaped links really carry.

    sudo python benchmarks/cluster_selftest.py --ranks 8 --bandwidth 1gbit
    sudo python benchmarks/cluster_selftest.py --ranks 4 --ranks-per-host 2 --bandwidth 100mbit

Builds an EmulatedCluster of N ranks, G per host (--ranks-per-host, default 1; at least 2 hosts), then
measures, with plain TCP sockets between the ranks:

1. rank 0 -> rank G (the first rank of the next host), one TCP stream: goodput / R (expect >= 0.9;
   1448/1514 = 0.956 is the TCP ceiling at MTU 1500).
2. every rank K -> rank K+G mod N at once: every host's upload and download busy, (N/G)*R in total through
   the bridge; shows whether this machine's CPUs can carry that much shaped traffic. With G > 1, G streams
   share each host's link: each should get about R/G, a host's G streams together about R.
3. 1-byte TCP ping-pong rank 0 <-> rank G: median round trip (2 x latency + software overhead).
4. With G > 1 only, within host 0: a stream rank 0 -> rank 1 and a ping-pong between them, and the bytes
   that host 0's shaped link (zv0) sent meanwhile. Ranks of one host talk over its own address, which
   Linux routes through the loopback: expect far more than R (at least INTRA_HOST_MIN x R) and (almost)
   nothing on zv0.

Exit code 0 when the single stream reaches 90% of the shaped rate (and, with G > 1, test 4 meets its
expectation), 1 when not, 2 when the cluster cannot be built (as cluster.py). The measuring ends run inside the namespaces as this same file with a role
as first argument (`cluster_selftest.py _sink PORT` etc.; standard library only).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from cluster import (CONGESTION_CONTROL, ClusterSetupError, EmulatedCluster, check_prerequisites,
                     format_bits_per_second, run_on)

PORT = 5201  # streams that run at once use PORT, PORT + 1, ... (several sinks may share a host)
INTRA_HOST_MIN = 2.0  # ranks of one host must exchange at least this many times the shaped rate


def selftest(cluster, seconds=2.0):
    """Measure one stream, all links at once and the round-trip time on a built cluster (inside its `with`
    block), and with several ranks per host a stream and the round trip within a host. Returns a dict (rates
    in bit/s) and prints a summary; 'ok' is result 1 >= 0.9 (and result 4 as expected)."""
    if cluster.hosts < 2:
        raise ValueError("the self-test needs at least 2 hosts")
    me = os.path.abspath(__file__)
    G = cluster.ranks_per_host

    def streams(pairs):
        sinks = [cluster.popen(dst, [sys.executable, me, "_sink", str(PORT + i)], stdout=subprocess.PIPE)
                 for i, (_, dst) in enumerate(pairs)]
        sources = [cluster.popen(src, [sys.executable, me, "_source", cluster.address(dst), str(PORT + i),
                                       str(seconds)])
                   for i, (src, dst) in enumerate(pairs)]
        for p in sources:
            p.wait(timeout=seconds + 30)
        rates = []
        for p in sinks:
            out, _ = p.communicate(timeout=30)
            rates.append(json.loads(out)["bps"])
        return rates

    def ping_pong(a, b):
        echo = cluster.popen(b, [sys.executable, me, "_echo", str(PORT)])
        ping = cluster.popen(a, [sys.executable, me, "_ping", cluster.address(b), str(PORT), "200"],
                             stdout=subprocess.PIPE)
        out, _ = ping.communicate(timeout=60)
        echo.wait(timeout=10)
        return json.loads(out)["rtt_s"]

    one = streams([(0, G)])[0]
    ring = streams([(k, (k + G) % cluster.ranks) for k in range(cluster.ranks)])
    # ring[k] leaves host k // G: a host's upload carries the G streams ring[hG .. hG + G - 1]
    host_totals = [sum(ring[h * G:(h + 1) * G]) for h in range(cluster.hosts)]
    rtt = ping_pong(0, G)
    R = cluster.bandwidth_bps
    fmt = format_bits_per_second
    result = {
        "rate_bps": R,
        "single_stream_bps": one,
        "single_stream_fraction": one / R,
        "ring_min_bps": min(ring),
        "ring_mean_bps": statistics.mean(ring),
        "ring_min_fraction": min(ring) / R,
        "rtt_median_s": rtt,
        "ok": one / R >= 0.9,
    }
    if G == 1:
        print(f"selftest: shaped rate {fmt(R)} per link and direction\n"
              f"  rank0 -> rank1, 1 stream:      {fmt(one)} = {100 * one / R:.1f}% of rate\n"
              f"  ring k -> k+1, {cluster.ranks} streams at once: min {fmt(min(ring))} "
              f"({100 * min(ring) / R:.1f}%), mean {fmt(statistics.mean(ring))} "
              f"({100 * statistics.mean(ring) / R:.1f}%)\n"
              f"  TCP ping-pong RTT (median):    {rtt * 1e6:.0f} us\n"
              f"  {'PASS' if result['ok'] else 'FAIL'} (single stream >= 90% of the shaped rate)",
              file=sys.stderr, flush=True)
        return result

    # Within host 0: the stream must not touch the shaped link, whose counter says what it sent meanwhile.
    ns, dev = cluster.namespace(0), cluster.interface(0)
    before = _tx_bytes(ns, dev)
    intra = streams([(0, 1)])[0]
    on_link = _tx_bytes(ns, dev) - before
    intra_bytes = intra / 8 * seconds
    intra_rtt = ping_pong(0, 1)
    intra_ok = intra >= INTRA_HOST_MIN * R and on_link < 0.01 * intra_bytes
    result.update({
        "ranks_per_host": G,
        "host_total_min_bps": min(host_totals),
        "host_total_min_fraction": min(host_totals) / R,
        "intra_host_bps": intra,
        "intra_host_over_rate": intra / R,
        "intra_host_link_bytes": on_link,
        "intra_host_rtt_median_s": intra_rtt,
        "ok": result["ok"] and intra_ok,
    })
    print(f"selftest: shaped rate {fmt(R)} per link and direction, {cluster.hosts} hosts of {G} ranks\n"
          f"  between hosts, rank0 -> rank{G}, 1 stream: {fmt(one)} = {100 * one / R:.1f}% of rate\n"
          f"  ring k -> k+{G}, {cluster.ranks} streams at once: per stream min {fmt(min(ring))} "
          f"({100 * min(ring) / R:.1f}%), mean {fmt(statistics.mean(ring))} "
          f"({100 * statistics.mean(ring) / R:.1f}%); per host ({G} streams) min {fmt(min(host_totals))} "
          f"({100 * min(host_totals) / R:.1f}%)\n"
          f"  between hosts, TCP ping-pong RTT (median): {rtt * 1e6:.0f} us\n"
          f"  within host 0, rank0 -> rank1, 1 stream: {fmt(intra)} = {intra / R:.1f}x the rate; "
          f"{dev} sent {on_link} bytes meanwhile (the stream ~{intra_bytes / 1e6:.0f} MB)\n"
          f"  within host 0, TCP ping-pong RTT (median): {intra_rtt * 1e6:.0f} us\n"
          f"  {'PASS' if result['ok'] else 'FAIL'} (single stream between hosts >= 90% of the shaped rate; "
          f"within a host >= {INTRA_HOST_MIN:g}x the rate, < 1% of its bytes on the shaped link)",
          file=sys.stderr, flush=True)
    return result


def _tx_bytes(ns, dev):
    """Bytes that interface dev in namespace ns has sent (its counter, from `ip -s link`)."""
    out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)[0]["stats64"]["tx"]["bytes"]


# ----------------------------------------------------------------------------------------------------------
# the measuring ends, run inside the namespaces as `cluster_selftest.py _sink PORT` etc. (stdlib only)


def _role_sink(port):
    """Accept one connection, count bytes to EOF, print goodput (bit/s) from first to last byte."""
    srv = socket.create_server(("0.0.0.0", int(port)), reuse_port=False)
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    total, t_first, t_last = 0, None, None
    while True:
        n = conn.recv_into(buf)
        if n == 0:
            break
        now = time.perf_counter()
        if t_first is None:
            t_first = now
            first_n = n  # the first chunk arrived before the clock started: not part of the timed bytes
        total += n
        t_last = now
    timed = total - first_n
    print(json.dumps({"bytes": total, "bps": 8 * timed / max(t_last - t_first, 1e-9)}))


def _connect(addr, port, tries=200):
    for _ in range(tries):
        try:
            return socket.create_connection((addr, int(port)), timeout=5)
        except OSError:
            time.sleep(0.05)  # the peer may not listen yet
    raise SystemExit(f"cannot connect to {addr}:{port}")


def _role_source(addr, port, seconds):
    s = _connect(addr, port)
    chunk = b"\0" * (1 << 20)
    end = time.perf_counter() + float(seconds)
    while time.perf_counter() < end:
        s.sendall(chunk)
    s.close()


def _role_echo(port):
    srv = socket.create_server(("0.0.0.0", int(port)))
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = conn.recv(1)
        if not b:
            break
        conn.sendall(b)


def _role_ping(addr, port, count):
    s = _connect(addr, port)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(int(count)):
        t0 = time.perf_counter()
        s.sendall(b"x")
        s.recv(1)
        rtts.append(time.perf_counter() - t0)
    s.close()
    print(json.dumps({"rtt_s": statistics.median(rtts)}))


_ROLES = {"_sink": _role_sink, "_source": _role_source, "_echo": _role_echo, "_ping": _role_ping}


# ----------------------------------------------------------------------------------------------------------
# CLI


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _ROLES:
        _ROLES[argv[0]](*argv[1:])
        return 0
    ap = argparse.ArgumentParser(
        prog="cluster_selftest.py",
        description="Build an emulated cluster and measure what its shaped links carry (root).")
    ap.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help="ranks sharing one host's namespace and link, a divisor of --ranks (default 1)")
    ap.add_argument("--bandwidth", default="1gbit", help="rate of every link, each direction (default 1gbit)")
    ap.add_argument("--latency", default="0", help="one-way host-to-host delay, e.g. 0.1ms (needs sch_netem)")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--queue-ms", type=float, default=50.0, help="queue depth of every shaped link, in ms at rate")
    ap.add_argument("--congestion-control", default=CONGESTION_CONTROL,
                    help=f"TCP congestion control in the ranks' namespaces (default {CONGESTION_CONTROL}; '' keeps "
                         "the kernel's default)")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each stream test (default 2)")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.ranks_per_host >= 1 and args.ranks < 2 * args.ranks_per_host:
        ap.error("the self-test needs at least 2 hosts (--ranks at least 2 x --ranks-per-host)")
    try:
        check_prerequisites()
        cluster = EmulatedCluster(args.ranks, args.bandwidth, args.latency, mtu=args.mtu, queue_ms=args.queue_ms,
                                  verbose=not args.quiet, congestion_control=args.congestion_control,
                                  ranks_per_host=args.ranks_per_host)
    except (ClusterSetupError, ValueError) as e:
        print(f"cluster_selftest.py: error: {e}", file=sys.stderr)
        return 2
    return run_on(cluster, lambda c: 0 if selftest(c, args.seconds)["ok"] else 1, "cluster_selftest.py")


if __name__ == "__main__":
    sys.exit(main())
