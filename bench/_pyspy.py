"""py-spy's samples of a server, by whose code they were in: ``--profile`` of ``bench_vllm``.

Each sample goes to the innermost frame outside the standard library (otel_capture, the OpenTelemetry SDK
and API, vLLM, uvicorn, Starlette and FastAPI, pydantic, ...); a sample wholly in the standard library is
the event loop's.
"""

from __future__ import annotations

import collections
import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import _harness as H

OWNERS = (
    ("/otel_capture/", "otel_capture"),
    ("/opentelemetry/", "OpenTelemetry SDK/API"),
    ("/vllm/", "vLLM"),
    ("/uvicorn/", "uvicorn"),
    ("/starlette/", "Starlette/FastAPI"),
    ("/fastapi/", "Starlette/FastAPI"),
    ("/pydantic", "pydantic"),
    ("/transformers/", "transformers/tokenizers"),
    ("/tokenizers/", "transformers/tokenizers"),
    ("/zmq/", "zmq"),
    ("/aiohttp/", "aiohttp"),
    ("/torch/", "torch"),
)


def owner_of(frame: str) -> str | None:
    """Whose code a py-spy frame (``function (path:line)``) is in; ``None`` for the standard library
    (transparent: a sample there goes to the code that called it) and frames without a path."""
    for marker, name in OWNERS:
        if marker in frame:
            return name
    if "site-packages/" in frame:
        return "other packages"
    return None


def by_owner(
    text: str,
    owner: Callable[[str], str | None] = owner_of,
    default: str = "stdlib (loop)",
    writers: tuple[str, ...] = (),
) -> collections.Counter[str]:
    """Samples per owner in py-spy's ``--format raw`` text (``frame;frame;... count``, outermost first):
    each to the innermost frame ``owner`` names, ``default`` when it names none. With ``--threads`` a stack
    begins with its thread (``thread (TID): NAME``, named by no owner); a sample of a thread named in
    ``writers`` is counted apart, as ``writer: <owner>``."""
    owners: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        frames = stack.split(";")
        name = next((o for o in map(owner, reversed(frames)) if o is not None), default)
        if writers and any(frames[0].endswith(": " + thread) for thread in writers):
            name = "writer: " + name
        owners[name] += int(count_text)
    return owners


def shares(raw: Path) -> tuple[collections.Counter[str], int]:
    """Samples per owner in a py-spy ``--format raw`` file, and all its samples."""
    owners = by_owner(raw.read_text(errors="replace"))
    return owners, sum(owners.values())


@contextlib.contextmanager
def sampling(pid: int, raw: Path, *, threads: bool = False) -> Iterator[None]:
    """py-spy records ``pid`` (samples holding the GIL, 1,000 a second) into ``raw`` while the block runs;
    ``threads``: each stack begins with its thread (``thread (TID): NAME``)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    sampler = subprocess.Popen(
        [py_spy, "record", "--pid", str(pid), "--format", "raw", "--gil", "--nonblocking",
         "--rate", "1000", "--full-filenames", "--output", str(raw), *(["--threads"] if threads else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(1.0)  # py-spy attaches before the calls begin
        yield
    finally:
        sampler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        sampler.wait(timeout=60)


def report_shares(shares: dict[str, tuple[collections.Counter[str], int]], what: str) -> None:
    """A table of each mode's samples by owner (``captured`` and ``passed``), ordered by the captured share."""
    owners = sorted(
        {o for counter, _ in shares.values() for o in counter}, key=lambda o: -shares["captured"][0][o]
    )
    rows = []
    for owner in owners:
        row: list[Any] = [owner]
        for mode in ("captured", "passed"):
            counter, total = shares[mode]
            row.append(f"{100 * counter[owner] / total:.1f} %" if total else "-")
        rows.append(row)
    H.print_table(
        f"py-spy samples holding the GIL, {what}, by whose code they were in (innermost frame "
        "outside the standard library)",
        ["code", "captured", "passed"],
        rows,
        [f"samples: captured {shares['captured'][1]}, passed {shares['passed'][1]}"],
    )
