"""How a benchmark's ranks run, the same way for every script in benchmarks/.

    ranks = launch(args, bench, args, script=__file__, argv=argv, timeout=3600)
    if ranks.results is None:        # rank 0 reports elsewhere: in its own process
        return ranks.exit_code
    report(ranks.results[0])

Three ways, picked from the parsed arguments:

    from the environment  ``args.from_env``: this process is one rank of a job launched by torchrun or by the
                          emulated cluster (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; gloo, env://)
    emulated cluster      ``args.bandwidth`` (or ``args.bandwidth_per_core``: :func:`link_rate`): root only;
                          benchmarks/cluster.py's EmulatedCluster runs the same
                          script with --from-env once per rank, each host in its own network namespace:
                          ``args.ranks_per_host`` ranks per host (1 where the script has no --ranks-per-host;
                          ``args.world`` must be a multiple of it), sharing the host's shaped link
    local                 otherwise: ``args.world`` gloo ranks over loopback (zen.testing.run_ranks)

A script without --from-env or --bandwidth (no such attribute) always runs local ranks.

`exit_code` is the one way the ranks' exit codes become the process's exit code (cluster.py's CLI, the
launcher, sweep.py). Only the standard library at import: cluster.py imports this module.
"""
import dataclasses
import os
import sys


@dataclasses.dataclass
class Launched:
    """What a launch leaves this process.

    world: the number of ranks.
    results: fn's results by rank where this process reports: every rank's (local ranks) or only rank 0's,
        the others None (rank 0 of a job from the environment); None where this process has nothing to
        report (ranks 1.. of a job from the environment, and the emulated cluster's launcher, whose rank 0
        reported in its own process).
    exit_code: the process's exit code where results is None; 0 otherwise.
    """

    world: int
    results: list = None
    exit_code: int = 0


def exit_code(codes, timed_out=False, first_failure=None):
    """The process's exit code for ranks that exited with ``codes`` (by rank, as subprocess reports them: -S
    for a death by signal S).

    124 when the ranks were killed for running out of time; 0 when every rank exited 0; else the code of the
    rank that failed first: ``first_failure`` = (rank, code) where the launcher saw which one (the others
    may just have lost their peer), else the lowest failing rank's. A death by signal S is reported as a
    shell does, 128 + S.
    """
    if timed_out:
        return 124
    if first_failure is None:
        failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
        first_failure = failed[0] if failed else None
    if first_failure is None:
        return 0
    code = first_failure[1]
    return 128 - code if code < 0 else code


def launch(args, fn, *fn_args, script=None, argv=None, timeout=3600, pg_timeout=60, cluster_timeout=None):
    """Run ``fn(rank, world, *fn_args)`` on every rank, the way ``args`` asks (see the module's docstring).

    script, argv: the calling script's path and its command-line arguments (default sys.argv[1:]), which the
        emulated cluster runs again with --from-env on every rank.
    timeout, pg_timeout: local ranks only: seconds for the whole run, and the process group's timeout.
    cluster_timeout: the emulated cluster only: seconds after which every rank is killed (exit code 124);
        None waits for as long as they run.
    A rank from the environment keeps the process group's default timeout, as torchrun's jobs do.
    """
    if getattr(args, "from_env", False):
        return _from_env(fn, fn_args)
    if getattr(args, "bandwidth", None) or getattr(args, "bandwidth_per_core", None):
        return _emulated_cluster(args, script, argv, cluster_timeout)
    from zen.testing import run_ranks

    return Launched(args.world, run_ranks(args.world, fn, *fn_args, timeout=timeout, pg_timeout=pg_timeout))


def _from_env(fn, fn_args):
    """One rank of an externally launched job; rank 0 gets its own result back, to report."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    torch.set_num_threads(1)  # one thread per rank, as zen.testing's ranks: the ranks may share the cores
    rank, world = dist.get_rank(), dist.get_world_size()
    result = fn(rank, world, *fn_args)
    dist.barrier()  # every rank tears its groups down together, after the last one's collectives
    dist.destroy_process_group()
    if rank != 0:
        return Launched(world)
    return Launched(world, [result] + [None] * (world - 1))


def link_rate(args):
    """The emulated hosts' link rate of ``args``: --bandwidth, or --bandwidth-per-core's rate x cores / ranks x the
    host's ranks (bits/s, or the text as given)."""
    from cluster import parse_bits_per_second, per_core_rate

    per_core = getattr(args, "bandwidth_per_core", None)
    if not per_core:
        return args.bandwidth
    return per_core_rate(parse_bits_per_second(per_core), args.world, getattr(args, "ranks_per_host", 1))


def link_text(args):
    """How a table names its links: the rate, and the rule where it is per core."""
    from cluster import format_bits_per_second

    rate = link_rate(args)
    if getattr(args, "bandwidth_per_core", None):
        return (f"{format_bits_per_second(rate)} per host ({args.bandwidth_per_core} per core of this machine: "
                f"rate x {os.cpu_count()} cores / {args.world} ranks)")
    return str(rate)


def _emulated_cluster(args, script, argv, timeout):
    """The same script with --from-env on every rank of an emulated cluster; their exit code comes back."""
    from cluster import EmulatedCluster

    if script is None:
        raise ValueError("launch: the emulated cluster needs the script to run on every rank")
    argv = sys.argv[1:] if argv is None else argv
    cmd = [sys.executable, os.path.abspath(script), "--from-env"] + list(argv)
    with EmulatedCluster(args.world, link_rate(args), args.latency, ranks_per_host=getattr(args, "ranks_per_host", 1),
                         workload_bytes=getattr(args, "workload_bytes", 0)) as cluster:
        codes = cluster.run(cmd, timeout=timeout)
    return Launched(args.world, exit_code=exit_code(codes, cluster.timed_out, cluster.first_failure))


# The code a results file measures (zen/testing.py, the harness, excepted): benchmarks/report.py marks a file
# measured on other code than the pages' as measured on an earlier version.
MEASURED_CODE = ("csrc", "zen", ":(exclude)zen/testing.py")


def code_version(root=None):
    """{"commit": the checkout's HEAD, "code_changed": whether its zen/ or csrc/ differ from HEAD} of the code
    this process runs (the checkout that holds this file), for a results file to record what it measured;
    {} where git or the repository is not at hand."""
    import subprocess

    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "code_changed": bool(git("status", "--porcelain", "--", *MEASURED_CODE))}
    except (OSError, subprocess.CalledProcessError):
        return {}
