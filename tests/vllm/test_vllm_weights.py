"""The engine's weight version on a real vLLM 0.32.0 (``VLLM_SERVER_DEV_MODE=1``: its RL routes), zero-code
and through the capture proxy, the trainer's calls going where the model calls go: a stream during which
the trainer calls ``/update_weight_version`` records the version at admission, the one at its end and
both in order; a call admitted after records the new one; a ``/pause?mode=keep`` ... update ...
``/resume`` around a running stream is named on it. The RL routes stay unrecorded (issue 32, items 1, 3)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import httpx
import pytest
from vllm_backend import MODEL_NAME

from otel_capture import CaptureStore, build_model_call_capture, read_model_call_records

pytestmark = pytest.mark.vllm

TIMEOUT = 300
# long enough that the trainer's calls (milliseconds) land while it streams (seconds on two cores)
LONG = {"max_tokens": 24, "ignore_eos": True, "temperature": 0}


def _rl(url: str, path: str, body: dict[str, str] | None = None) -> dict[str, object]:
    answer = httpx.post(url + path, json=body, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    reply: dict[str, object] = answer.json()
    return reply


def _chat(url: str, rollout_id: str) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    answer = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"x-rollout-id": rollout_id}, timeout=TIMEOUT
    )
    assert answer.status_code == 200, answer.text


class _Stream:
    """A streamed chat call in a thread; ``first`` is set once its first content chunk arrived."""

    def __init__(self, url: str, rollout_id: str) -> None:
        self.first = threading.Event()
        self.lines: list[str] = []
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(url, rollout_id))
        self._thread.start()

    def _run(self, url: str, rollout_id: str) -> None:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Count."}],
            "stream": True,
            **LONG,
        }
        try:
            with httpx.stream(
                "POST",
                f"{url}/v1/chat/completions",
                json=body,
                headers={"x-rollout-id": rollout_id},
                timeout=TIMEOUT,
            ) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data:"):
                        self.lines.append(line)
                        if len(self.lines) >= 2:
                            self.first.set()
        except BaseException as exc:  # reported by join
            self.errors.append(exc)
        finally:
            self.first.set()

    def join(self) -> None:
        self._thread.join(TIMEOUT)
        assert not self._thread.is_alive() and not self.errors, self.errors
        assert self.lines[-1] == "data: [DONE]"


@pytest.fixture
def resumed(front: tuple[str, CaptureStore]) -> Iterator[str]:
    """The front's URL; the engine is resumed afterwards whatever happened (one engine for the session)."""
    url = front[0]
    yield url
    httpx.post(url + "/resume", timeout=TIMEOUT)


def test_a_stream_during_an_update_records_both_versions_and_a_call_after_the_new_one(
    front: tuple[str, CaptureStore], resumed: str, request: pytest.FixtureRequest
) -> None:
    url, store = front
    rollout_id = f"weights-{uuid.uuid4().hex[:8]}"
    _chat(url, rollout_id)  # before any update here: the version the engine held (read at start, or seen)
    before, after = f"b-{rollout_id}", f"a-{rollout_id}"
    assert _rl(url, "/update_weight_version", {"new_version": before}) == {
        "success": True,
        "new_version": before,
    }
    stream = _Stream(url, rollout_id)
    assert stream.first.wait(TIMEOUT)
    _rl(url, "/update_weight_version", {"new_version": after})  # the trainer, while the call streams
    stream.join()
    _chat(url, rollout_id)
    assert httpx.get(url + "/weight_info", timeout=TIMEOUT).json() == {"weight_version": after}

    first, across, later = read_model_call_records(store, rollout_id)  # the RL routes: unrecorded
    if request.node.callspec.params["front"] == "zero-code":
        assert first.engine_weight_version is not None  # zero-code: read from the engine at start
    assert (across.engine_weight_version, across.engine_weight_version_at_end) == (before, after)
    assert across.engine_weight_versions == [before, after] and across.engine_pauses is None
    assert across.weight_version_sources == {
        "engine_weight_version": "engine_update",
        "engine_weight_version_at_end": "engine_update",
    }
    assert (later.engine_weight_version, later.engine_weight_version_at_end) == (after, None)
    calls = build_model_call_capture(store, rollout_id)
    assert "gaps" not in calls and calls["calls"][1]["engine_weight_versions"] == [before, after]


def test_a_kept_pause_and_an_update_around_a_running_stream_are_named_on_it(
    front: tuple[str, CaptureStore], resumed: str
) -> None:
    url, store = front
    rollout_id = f"paused-{uuid.uuid4().hex[:8]}"
    old, new = f"o-{rollout_id}", f"n-{rollout_id}"
    _rl(url, "/update_weight_version", {"new_version": old})
    stream = _Stream(url, rollout_id)
    assert stream.first.wait(TIMEOUT)
    assert _rl(url, "/pause?mode=keep") == {"status": "paused"}
    assert httpx.get(url + "/is_paused", timeout=TIMEOUT).json() == {"is_paused": True}
    _rl(url, "/update_weight_version", {"new_version": new})
    assert _rl(url, "/resume") == {"status": "resumed"}
    stream.join()

    [record] = read_model_call_records(store, rollout_id)
    assert (record.engine_weight_version, record.engine_weight_version_at_end) == (old, new)
    assert record.engine_weight_versions == [old, new]
    [pause] = record.engine_pauses or []
    assert pause["mode"] == "keep"
    assert record.started_at is not None and record.completed_at is not None
    assert record.started_at <= pause["paused_at"] <= pause["resumed_at"] <= record.completed_at
    assert record.error_category is None and record.finish_reason == "length"  # kept, not aborted
    assert "gaps" not in build_model_call_capture(store, rollout_id)
