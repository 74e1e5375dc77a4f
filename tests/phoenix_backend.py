"""Arize Phoenix, a real OTLP backend with a UI and a REST API, for the end-to-end test.

Phoenix (about 850 MB of dependencies) never goes into the project's venv, whose pins it could change: it
is installed once into its own venv under the cache directory (``$OTEL_CAPTURE_CACHE``, else
``~/.cache/otel-capture``), keyed by the pinned version, and reused. ``phoenix serve`` runs on free ports
on 127.0.0.1 with its data in a temporary directory, and is stopped with SIGTERM.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from support import free_port

from otel_capture._settings import cache_dir

PHOENIX_VERSION = "20.26.1"
INSTALL_TIMEOUT = 1200.0
START_TIMEOUT = 120.0


def phoenix_venv() -> Path:
    """The venv with ``arize-phoenix==PHOENIX_VERSION``, created on first use (under a file lock, so
    concurrent test runs install it once). The marker file is written only after pip succeeded."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / f"phoenix-venv-{PHOENIX_VERSION}"
    marker = venv / ".otel-capture-installed"
    with open(root / f"phoenix-venv-{PHOENIX_VERSION}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
            subprocess.run(
                [
                    str(venv / "bin" / "python"),
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    f"arize-phoenix=={PHOENIX_VERSION}",
                ],
                check=True,
                timeout=INSTALL_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
            marker.touch()
    return venv


@dataclass
class Phoenix:
    url: str

    def spans(self, project: str, **params: Any) -> list[dict[str, Any]]:
        """Every span of ``project`` matching ``params`` (REST ``/v1/projects/{project}/spans``)."""
        found: list[dict[str, Any]] = []
        cursor = None
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while True:
                query = {**params, "limit": 1000, **({"cursor": cursor} if cursor else {})}
                response = client.get(f"/v1/projects/{project}/spans", params=query)
                if response.status_code == 404:
                    return []  # the project does not exist until its first span arrives
                response.raise_for_status()
                body = response.json()
                found += body["data"]
                cursor = body.get("next_cursor")
                if not cursor:
                    return found


@contextlib.contextmanager
def running_phoenix(working_dir: Path) -> Iterator[Phoenix]:
    venv = phoenix_venv()
    port, grpc_port = free_port(), free_port()  # Phoenix binds by number; a port race here is unlikely
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))},
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_WORKING_DIR": str(working_dir),
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
    }
    log = open(working_dir / "phoenix.log", "w")  # noqa: SIM115  # closed below
    process = subprocess.Popen(
        [str(venv / "bin" / "phoenix"), "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"phoenix exited: {(working_dir / 'phoenix.log').read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError), httpx.Client(timeout=5) as client:
                if client.get(f"{url}/healthz").status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("phoenix did not answer /healthz in time")
            time.sleep(0.25)  # polling interval of a bounded wait for readiness
        yield Phoenix(url)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()
