"""Inside vLLM, which sets the root logger to ERROR, the user still hears of what is not captured or not as
configured: a bad setting, a model call without a rollout id (also counted in the capture directory, so
``otel-capture check`` says so), and a capture failure."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from vllm_backend import BAD_SETTING, MODEL_NAME, Vllm

pytestmark = pytest.mark.vllm

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _wait_for_output(vllm: Vllm, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while text not in (output := vllm.server.output()):
        assert time.monotonic() < deadline, f"{text!r} not in vLLM's output: {output[-3000:]}"
        time.sleep(0.1)  # polling interval of a bounded wait
    return output


def _check(vllm: Vllm) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "check", str(vllm.store.root)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_bad_setting_is_seen(vllm: Vllm) -> None:
    name, value = BAD_SETTING
    _wait_for_output(vllm, f"ignoring {name}={value!r}")


def test_an_uncorrelated_call_is_seen_in_the_log_and_in_check(vllm: Vllm) -> None:
    with httpx.Client(timeout=300) as client:
        assert client.post(f"{vllm.url}/v1/chat/completions", json=CHAT).status_code == 200
    _wait_for_output(vllm, "has no rollout id")
    deadline = time.monotonic() + 60
    while "without a rollout id" not in (check := _check(vllm)).stdout:
        assert time.monotonic() < deadline, check.stdout  # written within a second of the call
        time.sleep(0.2)  # polling interval of a bounded wait
    assert check.returncode == 0, check.stdout
    assert "1 model call(s) without a rollout id were served and not recorded (1 chat;" in check.stdout


def test_a_capture_failure_is_seen_and_the_call_still_answered(vllm: Vllm) -> None:
    # a directory where the rollout's data file belongs: the writer refuses it (never follows it)
    vllm.store.root.mkdir(parents=True, exist_ok=True)
    (vllm.store.root / "cannot-write.capture.jsonl").mkdir()
    with httpx.Client(timeout=300) as client:
        response = client.post(f"{vllm.url}/ng-rollout/cannot-write/v1/chat/completions", json=CHAT)
    assert response.status_code == 200 and response.json()["choices"]  # capture never fails the call
    _wait_for_output(vllm, "rollout cannot-write failed")  # the writer's error, root logger or not
