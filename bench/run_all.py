"""Run every benchmark in ``bench/`` and print each one's tables.

    python -m bench.run_all [--quick] [--only NAME[,NAME...]]

Runs each ``bench/bench_*.py`` (``bench_vllm``, ``bench_gluster`` and ``bench_where``, which needs py-spy, only when ``--only`` names them) as ``python -m bench.<name>`` in its own process, one after the other
(never two at once: they would measure each other), ``bench_goals.py`` first (issue #12's goals, each
against its baseline, met or missed), passing ``--quick`` along, streaming its output as it comes. Exits
non-zero when a benchmark fails (its own checks included: the writers benchmark fails when a line is torn
or missing).

``--quick`` is a smoke run (about two minutes in all): shorter runs, smaller files. The full run takes
about eight minutes on a 2-core machine. Install ``wrk`` first
(``apt-get install wrk``) for the HTTP benchmarks; without it they fall back, clearly labelled, to a
Python load generator that is slower and may itself be the limit.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ON_REQUEST = {"bench_vllm.py", "bench_gluster.py", "bench_where.py"}  # heavy, or py-spy: only when named


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run of every benchmark")
    parser.add_argument("--only", help="comma-separated benchmark names, e.g. reader,writers")
    args = parser.parse_args()
    # the goals first (issue #12's table), then every other benchmark in name order
    scripts = sorted(BENCH.glob("bench_*.py"), key=lambda s: (s.name != "bench_goals.py", s.name))
    if not args.only:  # vLLM (6 GB, two starts, a build on first use) runs only when named
        scripts = [s for s in scripts if s.name not in ON_REQUEST]
    if args.only:
        wanted = {
            f"bench_{name.removeprefix('bench_').removesuffix('.py')}.py" for name in args.only.split(",")
        }
        scripts = [s for s in scripts if s.name in wanted]
    failed = []
    timings = []
    for script in scripts:
        print(f"\n######## {script.name}{' --quick' if args.quick else ''}", flush=True)
        t0 = time.monotonic()
        module = f"bench.{script.stem}"
        code = subprocess.call(
            [sys.executable, "-m", module, *(["--quick"] if args.quick else [])], cwd=BENCH.parent
        )
        timings.append((script.name, time.monotonic() - t0, code))
        if code != 0:
            failed.append(script.name)
    print("\n######## summary")
    for name, seconds, code in timings:
        print(f"{name:32s} {seconds:6.0f} s  {'ok' if code == 0 else f'FAILED (exit {code})'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
