"""Jaeger v2, a real tracing backend, for the end-to-end tests: OTLP in over gRPC and HTTP, and the HTTP
query API its UI uses (``/api/traces?service=...&tags=...``) to read the spans back.

The binary is built once from its Go module by ``examples/jaeger/build_jaeger.sh`` (the script users run;
it locks, builds under a temporary name and renames) into the cache directory (``$OTEL_CAPTURE_CACHE``,
else ``~/.cache/otel-capture``), and reused. Jaeger runs with ``examples/jaeger/config.yaml``, the file
users run, its listeners moved to free ports on 127.0.0.1 through the variables that file reads, with
in-memory storage; it is ready when its query API answers, and stopped with SIGTERM (then SIGKILL).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from support import free_port

from otel_capture._settings import cache_dir

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "jaeger"
BUILD_SCRIPT = EXAMPLE / "build_jaeger.sh"
CONFIG = EXAMPLE / "config.yaml"
# the one place the version is written is the build script
_VERSION = re.search(r"^JAEGER_VERSION=(\S+)", BUILD_SCRIPT.read_text(), re.MULTILINE)
assert _VERSION is not None, f"no JAEGER_VERSION= line in {BUILD_SCRIPT}"
JAEGER_VERSION = _VERSION.group(1)
BUILD_TIMEOUT = 1500.0  # a first build took 14 min on two busy cores (CI allows 30 for everything); with Go's caches warm, about 1 min
START_TIMEOUT = 60.0
START_ATTEMPTS = 3  # free ports are picked before Jaeger binds them: another process may take one


class JaegerUnavailable(RuntimeError):
    """Jaeger is not built and cannot be built here (no Go toolchain)."""


def jaeger_binary() -> Path:
    """The cached binary, built by the build script when missing. Raises ``JaegerUnavailable`` when it is
    missing and Go is not installed, ``RuntimeError`` when the build fails."""
    binary = cache_dir() / f"jaeger-{JAEGER_VERSION}" / "jaeger"
    if os.access(binary, os.X_OK):
        return binary
    if shutil.which("go") is None:
        raise JaegerUnavailable(
            f"Jaeger is not built ({binary} is missing) and Go is not installed to build it "
            f"(examples/jaeger/build_jaeger.sh needs Go 1.24 or newer)"
        )
    binary.parent.mkdir(parents=True, exist_ok=True)
    log = binary.parent / "build.log"
    with open(log, "w") as out:
        result = subprocess.run(
            ["bash", str(BUILD_SCRIPT), str(binary)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=BUILD_TIMEOUT,
            check=False,
        )
    if result.returncode != 0 or not os.access(binary, os.X_OK):
        raise RuntimeError(f"building Jaeger failed ({result.returncode}); {log}:\n{log.read_text()[-3000:]}")
    return binary


@dataclass
class Jaeger:
    query_url: str  # the UI and its HTTP API
    otlp_grpc: str  # OTEL_EXPORTER_OTLP_ENDPOINT for OTEL_EXPORTER_OTLP_PROTOCOL=grpc
    otlp_http: str  # ... and for http/protobuf

    def otlp_endpoint(self, protocol: str) -> str:
        return self.otlp_grpc if protocol == "grpc" else self.otlp_http

    def traces(self, service: str, tags: dict[str, str] | None = None, **params: Any) -> list[dict[str, Any]]:
        """The traces of ``service`` with a span carrying every tag in ``tags``: ``GET /api/traces``, the
        search the UI runs (each trace whole: ``traceID``, ``spans``, ``processes``)."""
        query = {"service": service, "limit": 1000, **params}
        if tags:
            query["tags"] = json.dumps(tags)
        with httpx.Client(base_url=self.query_url, timeout=30) as client:
            response = client.get("/api/traces", params=query)
        response.raise_for_status()
        data: list[dict[str, Any]] = response.json()["data"] or []
        return data

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        """One trace by id (``GET /api/traces/{id}``, what ``{UI}/trace/{id}`` shows); None if unknown."""
        with httpx.Client(base_url=self.query_url, timeout=30) as client:
            response = client.get(f"/api/traces/{trace_id}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        data = response.json()["data"]
        return data[0] if data else None

    def services(self) -> list[str]:
        with httpx.Client(base_url=self.query_url, timeout=30) as client:
            response = client.get("/api/services")
        response.raise_for_status()
        return list(response.json()["data"] or [])


def _start(binary: Path, working_dir: Path, attempt: int) -> tuple[subprocess.Popen[bytes], Jaeger, Path]:
    grpc, http, query, query_grpc = (free_port() for _ in range(4))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "JAEGER_"))},
        "JAEGER_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{grpc}",
        "JAEGER_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{http}",
        "JAEGER_QUERY_HTTP_ENDPOINT": f"127.0.0.1:{query}",
        "JAEGER_QUERY_GRPC_ENDPOINT": f"127.0.0.1:{query_grpc}",
        "JAEGER_LOG_LEVEL": "warn",
    }
    log_path = working_dir / f"jaeger-{attempt}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [str(binary), "--config", str(CONFIG)],
            env=env,
            cwd=working_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    backend = Jaeger(f"http://127.0.0.1:{query}", f"http://127.0.0.1:{grpc}", f"http://127.0.0.1:{http}")
    return process, backend, log_path


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _ready(process: subprocess.Popen[bytes], backend: Jaeger) -> bool:
    """Wait until the query API answers (True) or Jaeger exits (False); bounded by ``START_TIMEOUT``."""
    deadline = time.monotonic() + START_TIMEOUT
    while process.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            backend.services()
            return True
        if time.monotonic() > deadline:
            raise RuntimeError("Jaeger's query API did not answer in time")
        time.sleep(0.1)  # polling interval of a bounded wait for readiness
    return False


@contextlib.contextmanager
def running_jaeger(working_dir: Path, binary: Path | None = None) -> Iterator[Jaeger]:
    """Jaeger (``binary``, else the cached one, built if missing) on free ports until the block exits."""
    binary = binary if binary is not None else jaeger_binary()
    for attempt in range(START_ATTEMPTS):
        process, backend, log_path = _start(binary, working_dir, attempt)
        try:
            if _ready(process, backend):
                break
        except BaseException:
            _stop(process)
            raise
        output = log_path.read_text()
        if "address already in use" not in output or attempt == START_ATTEMPTS - 1:
            raise RuntimeError(f"Jaeger exited ({process.returncode}): {output[-3000:]}")
    try:
        yield backend
    finally:
        _stop(process)
