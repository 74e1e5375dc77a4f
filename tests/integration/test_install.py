"""The install into another venv, as the README shows it (issue 33.7, 33.9): a wheel built from this tree,
installed into a fresh venv, works there.

* the base install runs the proxy; ``OTEL_TRACES_EXPORTER=otlp`` without an OTLP exporter installed is told
  on stderr with the package to install, instead of a bare "not found";
* with ``[auto]``, ``opentelemetry-instrument uvicorn`` captures an unmodified Starlette app's model call:
  the record on disk and the span over OTLP with the distro's default protocol (gRPC), which is what
  ``OTEL_TRACES_EXPORTER=otlp`` means when ``OTEL_EXPORTER_OTLP_PROTOCOL`` is unset.

The fresh venv takes its packages from the registry (pip's cache); where pip cannot install them the test
skips and says why, and under ``CI=true`` it fails instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from otlp_receiver import OtlpReceiver, serve_grpc
from support import recorded_json

from otel_capture import CaptureStore, read_model_call_records
from otel_capture._proxy import bind_socket, socket_url
from otel_capture._version import __version__

REPO = Path(__file__).resolve().parents[2]
WHEEL = f"otel_capture-{__version__}-py3-none-any.whl"
STARLETTE_APP = """
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

ANSWER = {answer}


async def health(request: Request) -> Response:
    return Response("ok")


async def chat(request: Request) -> Response:
    await request.body()
    return JSONResponse(ANSWER)


app = Starlette(routes=[Route("/health", health), Route("/v1/chat/completions", chat, methods=["POST"])])
"""


def _pip(venv: Path, *args: str) -> None:
    done = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            *args,
        ],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=1200,
    )
    if done.returncode != 0:
        message = f"pip install {' '.join(args)} failed: {(done.stdout + done.stderr)[-3000:]}"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A wheel of this tree (``pip wheel``, as the README shows) and a fresh venv with the wheel installed
    without extras."""
    work = tmp_path_factory.mktemp("install")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(work / "dist"), str(REPO)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    wheel = work / "dist" / WHEEL
    assert wheel.is_file(), sorted((work / "dist").iterdir())  # the name the README shows
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True, timeout=300)
    _pip(work / "venv", str(wheel))
    return work / "venv", wheel


def _env(**settings: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **settings}


def test_the_base_install_says_which_package_otlp_needs(
    fresh_venv: tuple[Path, Path], tmp_path: Path
) -> None:
    venv, _ = fresh_venv
    process = subprocess.Popen(
        [str(venv / "bin" / "otel-capture"), "proxy", "--upstream", "http://127.0.0.1:9", "--capture-dir",
         str(tmp_path / "calls")],
        env=_env(OTEL_TRACES_EXPORTER="otlp"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert process.stdout is not None
    first = process.stdout.readline()
    if first.startswith("listening on "):
        with httpx.Client(timeout=30) as client:  # answered once the app, and its provider, are built
            client.get(first.removeprefix("listening on ").strip() + "/v1/models")
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert first.startswith("listening on http://127.0.0.1:"), err
    assert "OTEL_TRACES_EXPORTER=otlp sends OTLP over grpc" in err
    assert "install opentelemetry-exporter-otlp-proto-grpc" in err
    assert "pip install 'otel-capture[auto]'" in err


def test_zero_code_from_the_wheel_with_auto_captures_a_starlette_apps_call(
    fresh_venv: tuple[Path, Path], tmp_path: Path
) -> None:
    venv, wheel = fresh_venv
    _pip(venv, f"{wheel}[auto]", "starlette")  # the model server's venv already has its framework
    answer = json.loads(recorded_json("chat"))
    (tmp_path / "app.py").write_text(STARLETTE_APP.format(answer=repr(answer)))
    capture_dir = tmp_path / "calls"
    receiver = OtlpReceiver()
    with serve_grpc(receiver) as otlp_url:
        sock = bind_socket("127.0.0.1", 0)
        env = _env(
            OTEL_SERVICE_NAME="policy-model",
            OTEL_TRACES_EXPORTER="otlp,model_call_jsonl",  # otlp with no protocol set: the distro's gRPC
            OTEL_EXPORTER_MODEL_CALL_JSONL_DIR=str(capture_dir),
            OTEL_EXPORTER_OTLP_ENDPOINT=otlp_url,
            OTEL_METRICS_EXPORTER="none",
            OTEL_LOGS_EXPORTER="none",
            OTEL_BSP_SCHEDULE_DELAY="100",
        )
        server = subprocess.Popen(
            [str(venv / "bin" / "opentelemetry-instrument"), str(venv / "bin" / "uvicorn"), "app:app",
             "--app-dir", str(tmp_path), "--fd", str(sock.fileno()), "--log-level", "warning"],
            pass_fds=[sock.fileno()],
            env=env,
            cwd=tmp_path,  # the server's own folder: opentelemetry-instrument puts the working directory on
            # PYTHONPATH, and run from this checkout it would import the tree instead of the wheel
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        url = socket_url(sock)
        try:
            with httpx.Client(base_url=url, timeout=30) as client:
                deadline = time.monotonic() + 120
                while True:
                    assert server.poll() is None, server.communicate()[0]
                    try:
                        if client.get("/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    assert time.monotonic() < deadline, "the zero-code server did not answer /health"
                    time.sleep(0.1)  # polling interval of a bounded wait for readiness
                response = client.post(
                    "/ng-rollout/r1/v1/chat/completions",
                    json={"model": "policy", "messages": [{"role": "user", "content": "Hi"}]},
                )
            if response.status_code == 200:
                receiver.wait_for(lambda r: any(s.attributes.get("rollout.id") == "r1" for s in r.spans))
        finally:
            server.send_signal(signal.SIGTERM)
            output, _ = server.communicate(timeout=60)
            sock.close()
    assert response.status_code == 200, output
    assert response.json() == answer
    assert "Failed to auto initialize" not in output, output
    [record] = read_model_call_records(CaptureStore(capture_dir), "r1")
    assert record.status_code == 200
    [span] = [s for s in receiver.spans if s.attributes.get("rollout.id") == "r1"]
    assert span.name.startswith("chat ")
    assert span.resource["service.name"] == "policy-model"
