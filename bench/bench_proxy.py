"""Goal 3's proxy before and after a change, side by side in one run.

    python bench/bench_proxy.py [--quick] [--before REV] [--after REV] [--seconds N] [--rounds N]

As ``bench_goals.py`` goal 3 (wrk at 64 concurrent, 32 rollouts, an upstream that answers at once in its own
process, rotated rounds, best round kept): the upstream called directly; ``otel-capture proxy`` with
``--capture-dir`` and without, each with the package as it was at ``--before`` and as it is at ``--after``;
and the bench-only aiohttp forwarder (``bench_forwarders.py``), the hop with nothing else. Each revision is a
``git archive`` on ``PYTHONPATH`` (with this checkout's ``bench/``, so only the package differs), as
``bench_server_span.py`` does. ``--before`` defaults to the merge base of ``HEAD`` and ``main``,
``--after`` to ``HEAD``. Absolute figures
(req/s, CPU per call) stand beside every ratio; see docs/performance.md.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H
import bench_goals as G
from bench_server_span import _snapshot


def _proxy_argv(source: Path, capture_dir: Path | None) -> list[str]:
    argv = [H.PYTHON, str(source / "bench" / "_servers.py"), "proxy", "--upstream", "{upstream}"]
    return [*argv, "--capture-dir", str(capture_dir)] if capture_dir is not None else argv


def _imported_from(source: Path) -> str:
    """Where a server started with ``PYTHONPATH=source`` imports ``otel_capture`` from (checked; ``-P``:
    as a script, the working directory is not on ``sys.path``)."""
    argv = [H.PYTHON, "-P", "-c", "import otel_capture; print(otel_capture.__file__)"]
    env = {**H._clean_environ(), "PYTHONPATH": str(source)}
    where = subprocess.run(argv, env=env, cwd=H.REPO, capture_output=True, text=True, check=True)
    if not where.stdout.strip().startswith(str(source)):
        raise RuntimeError(f"a server from {source} would import otel_capture from {where.stdout.strip()}")
    return where.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="package revision before (default: the merge base with main)")
    parser.add_argument("--after", default="HEAD", help="package revision after (default HEAD)")
    parser.add_argument("--quick", action="store_true", help="one round of 2 s")
    parser.add_argument("--seconds", type=int, help="seconds per measured run (default 3; quick 2)")
    parser.add_argument("--rounds", type=int, help="rotated rounds per server (default 2; quick 1)")
    parser.add_argument("--python-loadgen", action="store_true")
    args = parser.parse_args(argv)
    seconds = args.seconds or (2 if args.quick else 3)
    rounds = args.rounds or (1 if args.quick else 2)
    if args.before is None:
        args.before = subprocess.run(
            ["git", "merge-base", "HEAD", "main"], cwd=H.REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    revs = {
        tag: subprocess.run(
            ["git", "rev-parse", "--short", rev], cwd=H.REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        for tag, rev in (("before", args.before), ("after", args.after))
    }
    print(
        f"== bench_proxy: goal 3's proxy at {revs['before']} and {revs['after']}, {G.CONCURRENCY} concurrent =="
    )
    print(H.machine_line())
    print(
        f"load generator: {H.loadgen_name(args.python_loadgen)}; {rounds} round(s) x {seconds} s per server, rotated"
    )
    t0 = time.monotonic()
    data = Path(tempfile.mkdtemp(prefix="otel-capture-bench-proxy-"))
    try:
        sources = {tag: _snapshot(revs[tag], data / f"src-{tag}") for tag in ("before", "after")}
        for source in sources.values():
            _imported_from(source)
        specs = [
            G.Spec("upstream", H.server_argv("bare")),
            G.Spec(
                "fwd-aiohttp", H.server_argv("fwd-aiohttp", "--upstream", "{upstream}"), upstream="upstream"
            ),
        ]
        for tag, source in sources.items():
            directory = data / f"capture-{tag}"
            env = {"PYTHONPATH": str(source)}
            specs.append(
                G.Spec(
                    f"proxy-{tag}",
                    _proxy_argv(source, directory),
                    env,
                    capture_dir=directory,
                    upstream="upstream",
                )
            )
            specs.append(G.Spec(f"off-{tag}", _proxy_argv(source, None), env, upstream="upstream"))
        names = [s.name for s in specs]
        with G.Servers() as servers:
            for spec in specs:
                servers.start(spec)
            runs = G.rounds_of(
                servers,
                names,
                rounds,
                seconds,
                args.python_loadgen,
                upstreams={n: "upstream" for n in names[1:]},
            )
            disk = G._disk_check(servers, ["proxy-before", "proxy-after"])
    finally:
        shutil.rmtree(data, ignore_errors=True)
    base = runs["upstream"]
    b, a = revs["before"], revs["after"]
    rows = [
        ("upstream called directly", base, None),
        ("forwarder: one aiohttp session, alone", runs["fwd-aiohttp"], base),
        (f"proxy with capture, {b}", runs["proxy-before"], base),
        (f"proxy with capture, {a}", runs["proxy-after"], base),
        (f"proxy without --capture-dir, {b}", runs["off-before"], base),
        (f"proxy without --capture-dir, {a}", runs["off-after"], base),
    ]
    notes = [*disk]
    for what, label in (("proxy", "with capture"), ("off", "without --capture-dir")):
        before, after = runs[f"{what}-before"], runs[f"{what}-after"]
        notes.append(
            f"proxy {label}: {before.cpu_us or 0:.0f} -> {after.cpu_us or 0:.0f} us CPU per call "
            f"({(after.cpu_us or 0) - (before.cpu_us or 0):+.0f} us), {before.rps:,.0f} -> {after.rps:,.0f} req/s "
            f"({after.rps / before.rps:.2f}x)"
        )
    notes.append(f"took {time.monotonic() - t0:.0f} s")
    G.run_table(f"goal 3's proxy at {b} and {a}, {G.CONCURRENCY} concurrent", rows, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
