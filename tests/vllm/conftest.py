"""The vLLM tests' fixtures, each made once per session (a vLLM start takes ~45 s and 6 GB): one vLLM API
server under zero-code capture (``opentelemetry-instrument``, configured by environment variables only,
its own spans sent with ``--otlp-traces-endpoint``), and the capture proxy, as a user runs it, in front of
that same server. The proxy marks what it records (``x-otel-capture: captured``), so the zero-code layer
behind it passes those calls through: each call has one record, written by the layer it entered first.
Both send their spans to one real OTLP receiver. ``front`` runs a test against each of the two.

Where vLLM cannot be built (no network to PyPI, no Python 3.11) the tests skip and say why; under
``CI=true`` they fail instead: CI must run them."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from otlp_receiver import OtlpReceiver
from support import free_port, serve, start_cli_proxy
from vllm_backend import (
    BAD_SETTING,
    Proxy,
    Vllm,
    VllmUnavailable,
    gemma_model,
    install_tree,
    running_vllm,
    server_command,
    server_env,
    vllm_venv,
)

from otel_capture import CaptureStore

# Our batch processor exports this often, so the spans reach the receiver while the session runs.
BSP_DELAY_MS = "200"


@pytest.fixture(scope="session")
def vllm_parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(vLLM venv, model folder, the tree under test installed for it), built on first use."""
    try:
        venv = vllm_venv()
        model = gemma_model(venv)
        site = install_tree(venv, tmp_path_factory.mktemp("vllm-site"))
    except VllmUnavailable as exc:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"{exc}; CI=true: the vLLM tests must run here", pytrace=False)
        pytest.skip(f"vLLM cannot be built here: {exc}")
    return venv, model, site


@pytest.fixture(scope="session")
def otlp() -> Iterator[tuple[OtlpReceiver, str]]:
    receiver = OtlpReceiver()
    with serve(receiver) as url:
        yield receiver, url


@pytest.fixture(scope="session")
def vllm(
    vllm_parts: tuple[Path, Path, Path],
    otlp: tuple[OtlpReceiver, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Vllm]:
    venv, model, site = vllm_parts
    _, receiver_url = otlp
    work = tmp_path_factory.mktemp("vllm")
    capture_dir = work / "calls"
    env = server_env(
        venv,
        {
            "PYTHONPATH": str(site),
            "OTEL_TRACES_EXPORTER": "otlp,model_call_jsonl",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",  # ours: OTLP/HTTP to the receiver
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",  # vLLM's (--otlp-traces-endpoint)
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver_url,
            "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": str(capture_dir),
            "OTEL_SERVICE_NAME": "vllm-under-test",
            "OTEL_BSP_SCHEDULE_DELAY": BSP_DELAY_MS,
            "OTEL_PYTHON_EXCLUDED_URLS": "/health$,/metrics$",
            BAD_SETTING[0]: BAD_SETTING[1],
        },
    )
    command = [
        str(venv / "bin" / "opentelemetry-instrument"),
        *server_command(venv, model, free_port(), "--otlp-traces-endpoint", f"{receiver_url}/v1/traces"),
    ]
    with running_vllm(command, env, work / "vllm.log") as server:
        yield Vllm(server, CaptureStore(capture_dir))


@pytest.fixture(scope="session")
def proxy(
    vllm: Vllm, otlp: tuple[OtlpReceiver, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    """``otel-capture proxy`` in front of the zero-code vLLM, with its own capture directory."""
    _, receiver_url = otlp
    capture_dir = tmp_path_factory.mktemp("proxy") / "calls"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver_url,
            "OTEL_SERVICE_NAME": "capture-proxy",
            "OTEL_BSP_SCHEDULE_DELAY": BSP_DELAY_MS,
        }
    )
    process, url = start_cli_proxy(vllm.url, "--capture-dir", str(capture_dir), env=env)
    try:
        yield Proxy(url, CaptureStore(capture_dir))
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


@pytest.fixture(params=["zero-code", "proxy"])
def front(request: pytest.FixtureRequest) -> tuple[str, CaptureStore]:
    """Where the client sends its calls, and where their records are: vLLM itself under zero-code
    capture, or the capture proxy in front of it."""
    if request.param == "zero-code":
        vllm: Vllm = request.getfixturevalue("vllm")
        return vllm.url, vllm.store
    proxy: Proxy = request.getfixturevalue("proxy")
    return proxy.url, proxy.store
