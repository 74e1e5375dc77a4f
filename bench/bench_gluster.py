"""The capture proxy on a real GlusterFS mount against the same proxy on the local disk, in one run.

    python -m bench.bench_gluster [--seconds S] [--quick] [--against SRC ...]

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

``--against SRC`` (repeatable) measures, in the same run, another pair of node proxies whose
``otel_capture`` is imported from another source tree (``git archive main | tar -x -C SRC``), in its own
directory on the mount: every mount figure gets that tree's beside it (named after ``SRC``'s last
component), for a change's before/after on a machine whose load moves.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from bench import _harness as H
from bench._servers import REQUEST_BODY

sys.path.insert(0, str(H.REPO / "tests"))
from gluster_cluster import running_gluster, unavailable  # the tests' fixture code, reused

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


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after[key] - before[key]


def _load(
    proxy: H.ServerProcess, concurrency: int, seconds: int, rollouts: int, prefix: str, out: list[Run]
) -> None:
    before = proxy.stats()
    result = H.run_load(
        proxy.url,
        body=REQUEST_BODY,
        concurrency=concurrency,
        seconds=seconds,
        rollouts=rollouts,
        prefix=prefix,
    )
    after = proxy.stats()
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
        )
    )


def measure(proxy: H.ServerProcess, concurrency: int, seconds: int, rollouts: int, prefix: str) -> Run:
    out: list[Run] = []
    _load(proxy, concurrency, seconds, rollouts, prefix, out)
    return out[0]


def measure_together(
    proxies: list[tuple[H.ServerProcess, str]], concurrency: int, seconds: int, rollouts: int
) -> list[Run]:
    """Each proxy loaded by its own wrk, all at once."""
    outs: list[list[Run]] = [[] for _ in proxies]
    threads = [
        threading.Thread(target=_load, args=(proxy, concurrency, seconds, rollouts, prefix, out))
        for (proxy, prefix), out in zip(proxies, outs, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [out[0] for out in outs]


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
            return _run(cluster.mounts, work, seconds, args.against)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(mounts: tuple[Path, Path], work: Path, seconds: int, against: list[Path]) -> int:
    local = work / "local" / "calls"
    local.parent.mkdir()
    on_mount = (mounts[0] / "calls", mounts[1] / "calls")  # one directory, seen from each node
    print(H.machine_line(local.parent), flush=True)
    print(f"GlusterFS: {H.filesystem_of(mounts[0])} at {mounts[0]} and {mounts[1]}", flush=True)
    print(f"load: {H.loadgen_name()}, {seconds} s per measurement", flush=True)
    with H.ServerProcess(H.server_argv("bare"), name="upstream") as upstream:

        def proxy(directory: Path, name: str, src: Path | None = None) -> H.ServerProcess:
            argv = _proxy_argv(src, "--upstream", upstream.url, "--capture-dir", str(directory))
            return H.ServerProcess(argv, name=name)

        with contextlib.ExitStack() as stack:
            on_disk = stack.enter_context(proxy(local, "proxy on the local disk"))
            node1 = stack.enter_context(proxy(on_mount[0], "proxy on node 1"))
            node2 = stack.enter_context(proxy(on_mount[1], "proxy on node 2"))
            variants: list[tuple[str, tuple[H.ServerProcess, H.ServerProcess]]] = [("mount", (node1, node2))]
            for n, src in enumerate(against):
                name = src.name
                variants.append(
                    (
                        name,
                        (
                            stack.enter_context(proxy(mounts[0] / f"calls-{n}", f"{name}: node 1", src)),
                            stack.enter_context(proxy(mounts[1] / f"calls-{n}", f"{name}: node 2", src)),
                        ),
                    )
                )
            for server in (on_disk, *(s for _, pair in variants for s in pair)):  # state dirs, first opens
                measure(server, 16, 1, 32, "/ng-rollout/warm-")
            seen: list[tuple[str, Run]] = []
            ok = _one_node_table(on_disk, variants, seconds, seen)
            ok &= _two_nodes_table(variants, seconds, seen)
            print(f"\nerrors and failed records: {_problems(seen)}")
            print(f"no wrk error and no failed record in any run: {ok}")
            print(
                f"windows with fewer than {COARSE_BATCHES} batches (coarse: a longer --seconds): "
                f"{_coarse(seen)}"
            )
    return 0 if ok else 1


def _one_node_table(
    on_disk: H.ServerProcess,
    variants: list[tuple[str, tuple[H.ServerProcess, H.ServerProcess]]],
    seconds: int,
    seen: list[tuple[str, Run]],
) -> bool:
    ok = True
    rows = []
    by_case: dict[tuple[int, int], dict[str, Run]] = {}
    for n, (rollouts, concurrency) in enumerate(CASES):
        prefix = f"/ng-rollout/r{rollouts}-"
        order = [("disk", on_disk), *((name, pair[0]) for name, pair in variants)]
        if concurrency == CASES[0][1]:
            for _, server in order:
                warm(server, rollouts, prefix)
        if n % 2:
            order.reverse()
        found = {name: measure(server, concurrency, seconds, rollouts, prefix) for name, server in order}
        by_case[(rollouts, concurrency)] = found
        for name, run in found.items():
            ok &= _clean(run)
            seen.append((f"{name} {rollouts}/c={concurrency}", run))
        disk, mount = found["disk"], found["mount"]
        row = [f"{rollouts:,} rollouts, c={concurrency}", disk.rps, mount.rps, H.ratio(mount.rps, disk.rps)]
        for name, _ in variants[1:]:
            row += [found[name].rps, H.ratio(found[name].rps, disk.rps)]
        row += [
            mount.p50_ms,
            mount.p99_ms,
            _fsyncs_per_record(mount),
            mount.records / mount.batches if mount.batches else None,
        ]
        rows.append(row)
    notes = []
    for name, _ in variants:
        for rollouts in (32, 1024):
            low, high = by_case[(rollouts, 64)][name], by_case[(rollouts, 256)][name]
            notes.append(f"{rollouts:,} rollouts, {name}, c=256 against c=64: {H.ratio(high.rps, low.rps)}")
        half = by_case[(1024, 256)]
        notes.append(
            f"goal ({name}): c=256 over 1,024 rollouts >= 0.5x the local disk: "
            f"{H.ratio(half[name].rps, half['disk'].rps)}"
        )
    header = ["load", "local disk", "mount", "mount/disk"]
    for name, _ in variants[1:]:
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
    variants: list[tuple[str, tuple[H.ServerProcess, H.ServerProcess]]],
    seconds: int,
    seen: list[tuple[str, Run]],
) -> bool:
    ok = True
    rows = []
    pairs = variants
    for _, (first, second) in pairs:
        warm(second, 1024, "/ng-rollout/n2-")
        warm(first, 1024, "/ng-rollout/n1-")
    for concurrency in (64, 256):
        for name, (first, second) in pairs:
            one = measure(first, concurrency, seconds, 1024, "/ng-rollout/n1-")
            two = measure_together(
                [(first, "/ng-rollout/n1-"), (second, "/ng-rollout/n2-")], concurrency, seconds, 1024
            )
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
