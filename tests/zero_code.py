"""Test support for the zero-code set-up: the unmodified FastAPI model app (``tests/model_app.py``) served
by ``opentelemetry-instrument uvicorn`` in a child process, configured by environment variables only."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from otel_capture._proxy import bind_socket, socket_url

TESTS = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen[str]

    def stop(self) -> str:
        """SIGTERM (uvicorn shuts down gracefully; the SDK flushes its batch processors at exit); returns
        the child's output."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        output, _ = self.process.communicate(timeout=60)
        return output


@contextlib.contextmanager
def instrumented_model_server(
    env: dict[str, str], timeout: float = 60, app: str = "model_app:app"
) -> Iterator[ServerProcess]:
    """Start the model app (``app``: ``module:attribute`` in tests/) under ``opentelemetry-instrument`` on a
    socket bound here (port 0), and wait until it answers ``/health`` (a bounded deadline)."""
    sock = bind_socket("127.0.0.1", 0)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    child_env.update(env)
    process = subprocess.Popen(
        [
            str(BIN / "opentelemetry-instrument"),
            str(BIN / "uvicorn"),
            app,
            "--app-dir",
            str(TESTS),
            "--fd",
            str(sock.fileno()),
            "--log-level",
            "warning",
        ],
        pass_fds=[sock.fileno()],
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = ServerProcess(socket_url(sock), process)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the instrumented model server exited: {server.stop()}")
            try:
                with httpx.Client(timeout=5) as client:
                    if client.get(f"{server.url}/health").status_code == 200:
                        break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the instrumented model server did not answer /health in time")
            time.sleep(0.05)  # polling interval of a bounded wait for readiness
        yield server
    finally:
        sock.close()
        if process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.stop()
        if process.poll() is None:
            process.kill()
            process.wait()
