"""The LiteLLM recipe of docs/gateways.md, run as the page shows it: agent → LiteLLM's proxy (its
``config.yaml`` and start command, from the page) → the capture proxy → the real tiny model. Each rollout's
calls land in its own file, once each, although LiteLLM rebuilds the URL (the prefix is gone): the
``x-rollout-id`` header crosses it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support import free_port
from tool_venvs import LITELLM, CaptureProxy, docs_block

from otel_capture import read_model_call_records

pytestmark = pytest.mark.recipes

START_TIMEOUT = 300.0  # LiteLLM's proxy imports for tens of seconds on a busy machine
MASTER_KEY = "sk-recipe-test-master-key"


def _start_command() -> list[str]:
    """The page's command that starts LiteLLM: its last line, with the port the test picked."""
    lines = [
        line.split("  #")[0].strip()
        for line in docs_block("started, with the capture proxy", "bash").splitlines()
    ]
    [command] = [line for line in lines if "litellm --config" in line]
    return shlex.split(command)


@pytest.fixture
def litellm(
    tool: Callable[[str, list[str]], Path],
    start_capture_proxy: Callable[..., CaptureProxy],
    tmp_path: Path,
) -> Iterator[tuple[str, CaptureProxy]]:
    venv = tool("litellm", LITELLM)
    capture = start_capture_proxy()
    config = docs_block("**LiteLLM** (proxy)", "yaml")
    assert "http://127.0.0.1:8000/v1" in config  # the page's capture proxy, replaced by the test's
    (tmp_path / "config.yaml").write_text(config.replace("http://127.0.0.1:8000", capture.url))
    port = free_port()
    command = _start_command()
    at = next(i for i, word in enumerate(command) if "=" not in word)  # VAR=value words, then the program
    assignments, program, args = command[:at], command[at], command[at + 1 :]
    env = {**os.environ, **dict(a.split("=", 1) for a in assignments), "LITELLM_MASTER_KEY": MASTER_KEY}
    args = [
        str(port) if previous == "--port" else arg
        for previous, arg in zip(["", *args[:-1]], args, strict=True)
    ]
    assert program == "litellm" and "--config" in args
    log = open(tmp_path / "litellm.log", "w")  # noqa: SIM115  # closed below
    process = subprocess.Popen(
        [str(venv / "bin" / program), *args], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert process.poll() is None, (tmp_path / "litellm.log").read_text()[-5000:]
            try:
                with httpx.Client(timeout=5) as client:
                    if client.get(f"{url}/health/liveliness").status_code == 200:
                        break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "litellm.log").read_text()[-5000:]
            time.sleep(0.5)  # polling interval of a bounded wait for readiness
        yield url, capture
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def test_the_litellm_recipe_records_each_rollouts_calls_in_its_own_file(
    litellm: tuple[str, CaptureProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, capture = litellm
    monkeypatch.setenv("LITELLM_MASTER_KEY", MASTER_KEY)
    agent = docs_block("agent sends the master key", "python")
    for rollout_id in ("0-0", "0-1"):
        code = agent.replace("http://127.0.0.1:4000", url).replace('"0-0"', f'"{rollout_id}"')
        namespace: dict[str, object] = {}
        exec(compile(code, "docs/gateways.md (LiteLLM agent)", "exec"), namespace)  # the page's agent, as is
        assert isinstance(namespace["client"], openai.OpenAI)
        namespace["client"].close()
    assert capture.store.rollout_ids() == ["0-0", "0-1"]
    for rollout_id in ("0-0", "0-1"):
        [record] = read_model_call_records(capture.store, rollout_id)
        assert record.status_code == 200
        assert record.request["model"] == "policy"  # the model name LiteLLM sends on
