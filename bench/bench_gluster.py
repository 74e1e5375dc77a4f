"""The capture proxy on a real GlusterFS mount against the same proxy on the local disk, in one run.

    python -m bench.bench_gluster [--seconds S] [--quick] [--against SRC ...] [--answer-after MS]

Needs root, ``/dev/fuse`` and Debian's ``glusterfs-server`` / ``glusterfs-client`` (``.ci/run`` installs
them) and ``wrk``. The volume is the one ``tests/gluster/`` runs on (``tests/gluster_cluster.py``: one
brick, two FUSE clients in their own network namespaces, the strict options of ``docs/scaling.md``: client
caches off, ``client.strict-locks``, FUSE timeouts 0), brought up for the run and torn down after it.

Measured side by side, non-streamed chat calls through ``otel-capture proxy``'s app (``bench._servers
proxy``) in front of one upstream that answers at once:

* 32 and 1,024 rollouts, 64 and 256 concurrent connections: the proxy writing to the local disk, then
  the same proxy writing to the mount (node 1), each in its own process, alternating which goes first;
* every rollout's file made before its first measurement (file creation is not what is compared);
* one node against two: node 1's proxy alone, then node 1's and node 2's proxies writing into the same
  directory at once (each over its own 1,024 rollouts, each at the same concurrency), their sum against
  the one node.

Every run checks that wrk saw no error and the proxies counted no failed record.

``--answer-after MS`` makes the upstream answer each call MS milliseconds after its request, as a model
server does: every call then outlasts the writer's in-flight marker delay (20 ms, D19) and gets its ``+``
and ``-`` markers, as every call of an RL run does (throughput is then about concurrency / MS, so read the
CPU per call and the brick's operations per record).

``--against SRC`` (repeatable) measures, in the same run, another pair of node proxies whose
``otel_capture`` is imported from another source tree (``git archive main | tar -x -C SRC``), in its own
directory on the mount: every mount figure gets that tree's beside it (named after ``SRC``'s last
component), for a change's before/after on a machine whose load moves.

Where the time goes, for every window on the mount (``--no-profile`` leaves it out):

* CPU ms per call of each process over the window (``/proc/PID/stat``): the proxy (or both nodes'
  proxies), each node's FUSE client ``glusterfs``, the brick ``glusterfsd``, ``glusterd``, ``wrk`` (its
  ``wait4`` rusage), and the whole machine's busy time (``/proc/stat``) per call and in cores: a window
  whose machine is busy on about every core is CPU-bound on this machine;
* the brick's operations per appended record and their mean latency, from ``gluster volume profile VOL
  info incremental`` read just before and just after the window (the profile is started once for the
  run; it measures each operation's time on the brick, from its arrival to its answer).

``--option NAME=VALUE`` (repeatable) measures, in the same run, the mount with that volume option set
(``gluster volume set``, put back after each of its windows) beside the mount as built: an option's
before/after. ``--cases 1024/256`` measures only those loads, and ``--one-node`` leaves out the two-node table: a short
run for one question, under the benchmark lock's few minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench import _harness as H
from bench._servers import REQUEST_BODY

sys.path.insert(0, str(H.REPO / "tests"))
from gluster_cluster import Gluster, running_gluster, unavailable  # the tests' fixture code, reused

CASES = ((32, 64), (32, 256), (1024, 64), (1024, 256))


@dataclass
class Run:
    rps: float
    p50_ms: float
    p99_ms: float
    records: int
    fsyncs: int
    batches: int
    failures: int
    errors: int
    calls: int = 0
    wrk_cpu: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # process label -> CPU seconds in the window
    busy: float = 0.0  # the machine's busy CPU seconds (all cores) in the window
    wall: float = 0.0
    fops: dict[str, tuple[int, float]] = field(default_factory=dict)  # brick op -> (calls, mean latency µs)


class Gauges:
    """What a window on the mount is measured with besides wrk: the CPU of the GlusterFS processes
    (``procs``: label -> pid) and the brick's operation counts (``cluster``'s volume profile)."""

    def __init__(self, procs: dict[str, int], cluster: Gluster | None) -> None:
        self.procs = procs
        self.cluster = cluster

    def cpu(self, extra: dict[str, int]) -> dict[str, float]:
        found = {}
        for label, pid in {**self.procs, **extra}.items():
            with contextlib.suppress(OSError):
                found[label] = H.cpu_seconds(pid)
        return found

    def brick_ops(self) -> dict[str, tuple[int, float]]:
        """The brick's operations since the last call: name -> (calls, mean latency µs)."""
        if self.cluster is None:
            return {}
        text = self.cluster.gluster("volume", "profile", self.cluster.volume, "info", "incremental", "--xml")
        found: dict[str, tuple[int, float]] = {}
        for fop in ElementTree.fromstring(text).iter("fop"):
            hits = int(fop.findtext("hits") or 0)
            if hits:
                found[fop.findtext("name") or "?"] = (hits, float(fop.findtext("avgLatency") or 0) / 1000)
        return found  # latencies are nanoseconds in the XML (GlusterFS 10)


NO_GAUGES = Gauges({}, None)


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after[key] - before[key]


def _load(
    proxy: H.ServerProcess, concurrency: int, seconds: int, rollouts: int, prefix: str, out: list[Run]
) -> None:
    before = proxy.stats()
    cpu_before = H.cpu_seconds(proxy.pid)
    result = H.run_load(
        proxy.url,
        body=REQUEST_BODY,
        concurrency=concurrency,
        seconds=seconds,
        rollouts=rollouts,
        prefix=prefix,
    )
    after = proxy.stats()
    cpu = H.cpu_seconds(proxy.pid) - cpu_before
    out.append(
        Run(
            result.rps,
            result.p50_ms,
            result.p99_ms,
            _delta(after, before, "records"),
            _delta(after, before, "fsyncs"),
            _delta(after, before, "batches"),
            _delta(after, before, "failures"),
            result.errors,
            result.requests,
            result.loadgen_cpu,
            {"proxy": cpu},
        )
    )


def measure(
    proxy: H.ServerProcess,
    concurrency: int,
    seconds: int,
    rollouts: int,
    prefix: str,
    gauges: Gauges = NO_GAUGES,
) -> Run:
    return measure_together([(proxy, prefix)], concurrency, seconds, rollouts, gauges)[0]


def measure_together(
    proxies: list[tuple[H.ServerProcess, str]],
    concurrency: int,
    seconds: int,
    rollouts: int,
    gauges: Gauges = NO_GAUGES,
) -> list[Run]:
    """Each proxy loaded by its own wrk, all at once; the window's GlusterFS CPU, machine busy time and
    brick operations (``gauges``) go to the first run (they are the window's, not one proxy's)."""
    outs: list[list[Run]] = [[] for _ in proxies]
    threads = [
        threading.Thread(target=_load, args=(proxy, concurrency, seconds, rollouts, prefix, out))
        for (proxy, prefix), out in zip(proxies, outs, strict=True)
    ]
    gauges.brick_ops()  # the interval starts here
    cpu_before, busy_before, start = gauges.cpu({}), H.system_busy_seconds(), time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, busy = time.monotonic() - start, H.system_busy_seconds() - busy_before
    cpu_after = gauges.cpu({})
    runs = [out[0] for out in outs]
    first = runs[0]
    first.cpu.update(
        {label: cpu_after[label] - cpu_before[label] for label in cpu_after if label in cpu_before}
    )
    first.busy, first.wall, first.fops = busy, wall, gauges.brick_ops()
    return runs


def warm(proxy: H.ServerProcess, rollouts: int, prefix: str) -> None:
    """Until every rollout's file exists: a run then measures appends, not the files' creation (each a
    CREATE and a directory sync on the server), whichever load comes first."""
    start = proxy.stats()["records"]
    for _ in range(20):
        H.run_load(proxy.url, body=REQUEST_BODY, concurrency=64, seconds=2, rollouts=rollouts, prefix=prefix)
        if proxy.stats()["records"] - start >= rollouts:
            return


def _proxy_argv(src: Path | None, *extra: str) -> list[str]:
    """``bench._servers proxy`` from this tree, or from ``src`` (its ``otel_capture`` and ``bench``)."""
    if src is None:
        return H.server_argv("proxy", *extra)
    code = (
        f"import runpy, sys; sys.path.insert(0, {str(src)!r}); "
        "runpy.run_module('bench._servers', run_name='__main__')"
    )
    return [H.PYTHON, "-c", code, "proxy", *extra]


def _fsyncs_per_record(run: Run) -> float | None:
    return run.fsyncs / run.records if run.records else None


def _clean(run: Run) -> bool:
    return run.errors == 0 and run.failures == 0


COARSE_BATCHES = 5
"""A window that saw fewer of the writer's batches than this measured a handful of batches: coarse."""


def _coarse(runs: list[tuple[str, Run]]) -> str:
    coarse = [f"{label} ({run.batches})" for label, run in runs if run.batches < COARSE_BATCHES]
    return "; ".join(coarse) or "none"


def _problems(runs: list[tuple[str, Run]]) -> str:
    bad = [
        f"{label}: {run.errors} wrk error(s), {run.failures} failed record(s)"
        for label, run in runs
        if not _clean(run)
    ]
    return "; ".join(bad) or "none"


GLUSTER_PROCESSES = ("glusterfs node 1", "glusterfs node 2", "glusterfsd (brick)", "glusterd")


def _cases(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((int(r), int(c)) for r, c in (case.split("/") for case in text.split(",")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=10, help="seconds per measurement (default 10)")
    parser.add_argument("--quick", action="store_true", help="3-second measurements")
    parser.add_argument(
        "--against",
        type=Path,
        action="append",
        default=[],
        help="another source tree whose proxy is measured beside this one's (repeatable)",
    )
    parser.add_argument(
        "--cases",
        type=_cases,
        default=CASES,
        help="ROLLOUTS/CONCURRENCY,... (default 32/64,32/256,1024/64,1024/256)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        help="NAME=VALUE[,NAME=VALUE]: the mount with these volume options, measured beside it (repeatable)",
    )
    parser.add_argument("--one-node", action="store_true", help="leave out the two-node table")
    parser.add_argument(
        "--answer-after",
        type=float,
        default=0,
        metavar="MS",
        help="the upstream answers MS ms after each request, as a model server does (default: at once)",
    )
    parser.add_argument(
        "--no-profile", action="store_true", help="no brick profile (gluster volume profile) in the windows"
    )
    args = parser.parse_args()
    seconds = 3 if args.quick else args.seconds
    reason = unavailable()
    if reason is not None:
        print(f"cannot run GlusterFS here: {reason}")
        return 1
    if not H.wrk_available():
        print("wrk is not installed (apt-get install wrk)")
        return 1
    work = Path(tempfile.mkdtemp(prefix="bench-gluster-"))
    try:
        (work / "gluster").mkdir()
        with running_gluster(work / "gluster") as cluster:
            gauges = _gauges(cluster, profile=not args.no_profile)
            options = [dict(pair.split("=", 1) for pair in option.split(",")) for option in args.option]
            plan = Plan(
                seconds,
                args.cases,
                not args.one_node,
                gauges,
                cluster,
                options,
                answer_after_ms=args.answer_after,
            )
            return _run(cluster.mounts, work, plan, args.against)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _gauges(cluster: Gluster, *, profile: bool) -> Gauges:
    pids = [int((cluster.work / f"client{n}.pid").read_text()) for n in (1, 2)]
    pids += [cluster.brick_pid(), int((cluster.work / "glusterd.pid").read_text())]
    if profile:
        cluster.gluster("volume", "profile", cluster.volume, "start")
    return Gauges(dict(zip(GLUSTER_PROCESSES, pids, strict=True)), cluster if profile else None)


@dataclass
class Variant:
    """A pair of node proxies measured on the mount, with the volume ``options`` set around each window."""

    name: str
    nodes: tuple[H.ServerProcess, H.ServerProcess]
    options: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def _options_set(cluster: Gluster | None, options: dict[str, str]) -> Iterator[None]:
    """The volume ``options`` set for the block, then put back as they were."""
    if not options or cluster is None:
        yield
        return
    before: dict[str, str | None] = {}  # None: the default (put back by a reset)
    for name, value in options.items():
        out = cluster.gluster("volume", "get", cluster.volume, name)
        line = out.strip().splitlines()[-1]  # "<name>  <value>" or "<name>  <value> (DEFAULT)"
        before[name] = None if line.endswith("(DEFAULT)") else line.split()[-1]
        cluster.set_option(name, value)
    time.sleep(OPTION_SETTLE_S)
    try:
        yield
    finally:
        for name, old in before.items():
            if old is None:
                cluster.gluster("volume", "reset", cluster.volume, name)
            else:
                cluster.set_option(name, old)
        time.sleep(OPTION_SETTLE_S)


OPTION_SETTLE_S = 2.0
"""How long the clients and the brick are given to take a changed volume option into their graphs."""


@dataclass
class Plan:
    seconds: int
    cases: tuple[tuple[int, int], ...]
    two_nodes: bool
    gauges: Gauges
    cluster: Gluster
    options: list[dict[str, str]] = field(default_factory=list)  # --option, each its own variant
    answer_after_ms: float = 0.0  # --answer-after: the upstream's answer this long after the request
    windows: list[tuple[str, list[Run]]] = field(default_factory=list)  # every measured window, in order


def _run(mounts: tuple[Path, Path], work: Path, plan: Plan, against: list[Path]) -> int:
    local = work / "local" / "calls"
    local.parent.mkdir()
    on_mount = (mounts[0] / "calls", mounts[1] / "calls")  # one directory, seen from each node
    print(H.machine_line(local.parent), flush=True)
    print(f"GlusterFS: {H.filesystem_of(mounts[0])} at {mounts[0]} and {mounts[1]}", flush=True)
    print(f"load: {H.loadgen_name()}, {plan.seconds} s per measurement", flush=True)
    slow = ("--answer-after", f"{plan.answer_after_ms:g}") if plan.answer_after_ms else ()
    with H.ServerProcess(H.server_argv("bare", *slow), name="upstream") as upstream:

        def proxy(directory: Path, name: str, src: Path | None = None) -> H.ServerProcess:
            argv = _proxy_argv(src, "--upstream", upstream.url, "--capture-dir", str(directory))
            return H.ServerProcess(argv, name=name)

        with contextlib.ExitStack() as stack:
            on_disk = stack.enter_context(proxy(local, "proxy on the local disk"))
            node1 = stack.enter_context(proxy(on_mount[0], "proxy on node 1"))
            node2 = stack.enter_context(proxy(on_mount[1], "proxy on node 2"))
            variants = [Variant("mount", (node1, node2))]
            for n, src in enumerate(against):
                name = src.name
                nodes = (
                    stack.enter_context(proxy(mounts[0] / f"calls-{n}", f"{name}: node 1", src)),
                    stack.enter_context(proxy(mounts[1] / f"calls-{n}", f"{name}: node 2", src)),
                )
                variants.append(Variant(name, nodes))
            for options in plan.options:  # the mount's own proxies, the volume changed around each window
                label = "+" + ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in options.items())
                variants.append(Variant(label, (node1, node2), options))
            plan.gauges.procs["upstream"] = upstream.pid
            for server in (on_disk, *(s for v in variants for s in v.nodes)):  # state dirs, first opens
                measure(server, 16, 1, 32, "/ng-rollout/warm-")
            seen: list[tuple[str, Run]] = []
            ok = _one_node_table(on_disk, variants, plan, seen)
            if plan.two_nodes:
                ok &= _two_nodes_table(variants, plan, seen)
            _profile_tables(plan)
            print(f"\nerrors and failed records: {_problems(seen)}")
            print(f"no wrk error and no failed record in any run: {ok}")
            print(
                f"windows with fewer than {COARSE_BATCHES} batches (coarse: a longer --seconds): "
                f"{_coarse(seen)}"
            )
    return 0 if ok else 1


def _profile_tables(plan: Plan) -> None:
    """Where each window's time went: CPU per call by process, and the brick's operations per record."""
    cores = os.cpu_count() or 1
    rows = []
    for label, runs in plan.windows:
        first, calls = runs[0], sum(run.calls for run in runs)
        if not calls or not first.wall:
            continue

        def per_call(seconds: float | None, calls: int = calls) -> float | None:
            return None if seconds is None else seconds * 1000 / calls

        proxies, wrk = sum(run.cpu.get("proxy", 0.0) for run in runs), sum(run.wrk_cpu for run in runs)
        gluster = [first.cpu.get(name) for name in (*GLUSTER_PROCESSES, "upstream")]
        named = proxies + wrk + sum(x or 0.0 for x in gluster)
        rows.append(
            [
                label,
                calls / first.wall,
                per_call(proxies),
                *(per_call(x) for x in gluster),
                per_call(wrk),
                per_call(named),
                per_call(first.busy),
                f"{first.busy / first.wall:.2f} of {cores}",
            ]
        )
    H.print_table(
        "where the CPU goes: CPU ms per call of each process over the window (the proxies' sum for two nodes)",
        ["window", "req/s", "proxy", *GLUSTER_PROCESSES, "upstream", "wrk", "these", "machine", "busy cores"],
        rows,
        [
            "machine: every process of the machine (other sessions' too), from /proc/stat; a window whose",
            "machine is busy on about every core is CPU-bound here, one well below is waiting (latency-bound)",
        ],
    )
    rows = []
    for label, runs in plan.windows:
        records = sum(run.records for run in runs)
        fops = runs[0].fops
        if not records or not fops:
            continue
        spent = {name: hits * mean for name, (hits, mean) in fops.items()}
        total = sum(spent.values()) or 1.0
        rows.append([label, "all", sum(hits for hits, _ in fops.values()) / records, None, 1.0])
        for name in sorted(spent, key=spent.__getitem__, reverse=True):
            hits, mean = fops[name]
            if spent[name] / total >= 0.01:
                rows.append(["", name, hits / records, mean, spent[name] / total])
    H.print_table(
        "the brick's operations per appended record (gluster volume profile, each window's interval)",
        ["window", "operation", "per record", "mean µs on the brick", "share of brick time"],
        rows,
        ["operations under 1 % of the brick's time are left out of the rows (counted in 'all')"],
    )


def _one_node_table(
    on_disk: H.ServerProcess,
    variants: list[Variant],
    plan: Plan,
    seen: list[tuple[str, Run]],
) -> bool:
    ok = True
    rows = []
    by_case: dict[tuple[int, int], dict[str, Run]] = {}
    warmed: set[int] = set()
    for n, (rollouts, concurrency) in enumerate(plan.cases):
        prefix = f"/ng-rollout/r{rollouts}-"
        order = [("disk", on_disk, {}), *((v.name, v.nodes[0], v.options) for v in variants)]
        if rollouts not in warmed:
            warmed.add(rollouts)
            for _, server, _ in order:
                warm(server, rollouts, prefix)
        if n % 2:
            order.reverse()
        found = {}
        for name, server, options in order:
            with _options_set(plan.cluster, options):
                run = measure(server, concurrency, plan.seconds, rollouts, prefix, plan.gauges)
            found[name] = run
            plan.windows.append((f"{name} {rollouts}/c={concurrency}", [run]))
        by_case[(rollouts, concurrency)] = found
        for name, run in found.items():
            ok &= _clean(run)
            seen.append((f"{name} {rollouts}/c={concurrency}", run))
        disk, mount = found["disk"], found["mount"]
        row = [f"{rollouts:,} rollouts, c={concurrency}", disk.rps, mount.rps, H.ratio(mount.rps, disk.rps)]
        for v in variants[1:]:
            row += [found[v.name].rps, H.ratio(found[v.name].rps, disk.rps)]
        row += [
            mount.p50_ms,
            mount.p99_ms,
            _fsyncs_per_record(mount),
            mount.records / mount.batches if mount.batches else None,
        ]
        rows.append(row)
    notes = []
    for name in (v.name for v in variants):
        for rollouts in (32, 1024):
            low, high = by_case.get((rollouts, 64)), by_case.get((rollouts, 256))
            if low and high:
                ratio = H.ratio(high[name].rps, low[name].rps)
                notes.append(f"{rollouts:,} rollouts, {name}, c=256 against c=64: {ratio}")
        half = by_case.get((1024, 256))
        if half:
            notes.append(
                f"goal ({name}): c=256 over 1,024 rollouts >= 0.5x the local disk: "
                f"{H.ratio(half[name].rps, half['disk'].rps)}"
            )
    header = ["load", "local disk", "mount", "mount/disk"]
    for name in (v.name for v in variants[1:]):
        header += [name, f"{name}/disk"]
    header += ["mount p50 ms", "mount p99 ms", "fsyncs/record", "records/batch"]
    H.print_table(
        "the capture proxy, non-streamed chat calls: local disk against the GlusterFS mount (req/s)",
        header,
        rows,
        notes,
    )
    return ok


def _two_nodes_table(
    variants: list[Variant],
    plan: Plan,
    seen: list[tuple[str, Run]],
) -> bool:
    ok = True
    rows = []
    for v in variants:
        warm(v.nodes[1], 1024, "/ng-rollout/n2-")
        warm(v.nodes[0], 1024, "/ng-rollout/n1-")
    for concurrency in (64, 256):
        for v in variants:
            name, (first, second) = v.name, v.nodes
            with _options_set(plan.cluster, v.options):
                one = measure(first, concurrency, plan.seconds, 1024, "/ng-rollout/n1-", plan.gauges)
                two = measure_together(
                    [(first, "/ng-rollout/n1-"), (second, "/ng-rollout/n2-")],
                    concurrency,
                    plan.seconds,
                    1024,
                    plan.gauges,
                )
            plan.windows.append((f"{name}: one node, c={concurrency}", [one]))
            plan.windows.append((f"{name}: two nodes, c={concurrency} each", two))
            ok &= _clean(one) and all(_clean(run) for run in two)
            seen.extend(
                [
                    (f"{name}: one node c={concurrency}", one),
                    *((f"{name}: two nodes c={concurrency}", run) for run in two),
                ]
            )
            total = sum(run.rps for run in two)
            rows.append(
                [
                    f"{name}: 1,024 rollouts per node, c={concurrency} per node",
                    one.rps,
                    two[0].rps,
                    two[1].rps,
                    total,
                    H.ratio(total, one.rps),
                ]
            )
    H.print_table(
        "one node against two writing into one directory on the mount at once (req/s)",
        ["load", "one node", "two: node 1", "two: node 2", "two: sum", "two/one"],
        rows,
    )
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
