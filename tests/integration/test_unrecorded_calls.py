"""Nothing silent (issue 33): a call that is served and not recorded, because its rollout id breaks the
grammar or because its rollout is frozen or retired, is answered as ever, warned, metered, and counted in
the capture directory, so ``otel-capture check`` and ``ls`` (separate processes, as a user runs them)
show it apart from calls with no rollout id at all. Through the real proxy with the official SDK."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support import ReplayModelServer, Telemetry, metric_points, recorded_json, serve

from otel_capture import CaptureStore, ModelCallCaptureMiddleware, read_model_call_records, start_proxy
from otel_capture import _attributes as A
from otel_capture._store import UncorrelatedCounter, read_uncorrelated
from otel_capture._store.uncorrelated import UncorrelatedSummary
from otel_capture._telemetry.metrics import LATE_CALLS, UNCORRELATED_CALLS

CHAT_ID = json.loads(recorded_json("chat"))["id"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", *args], capture_output=True, text=True, check=False
    )


def _chat(base_url: str, **kwargs: object) -> str:
    with openai.OpenAI(base_url=base_url, api_key="k", max_retries=0, **kwargs) as client:  # type: ignore[arg-type]
        return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).id


def _wait_until(directory: Path, done: Callable[[UncorrelatedSummary], bool]) -> None:
    deadline = time.monotonic() + 30  # a bounded wait: the counts are written within a second
    while not done(summary := read_uncorrelated(directory)):
        assert time.monotonic() < deadline, summary
        time.sleep(0.05)  # polling interval of a bounded wait


def test_an_id_outside_the_grammar_is_served_counted_apart_and_listed_by_check_and_ls(
    tmp_path: Path, replay_server: ReplayModelServer, caplog: pytest.LogCaptureFixture
) -> None:
    """inspect-ai's sample id ``city 9`` in the prefix or the header: the eval's calls are answered (they
    were a 400), nothing is recorded, and check and ls name the kind, apart from calls with no id."""
    root = tmp_path / "calls"
    with (
        caplog.at_level(logging.WARNING, logger="otel_capture"),
        serve(replay_server) as upstream,
        start_proxy(upstream, str(root)) as proxy,
    ):
        assert _chat(f"{proxy.url}/ng-rollout/city%209/v1") == CHAT_ID
        assert _chat(f"{proxy.url}/v1", default_headers={"x-rollout-id": "city 9"}) == CHAT_ID
        assert _chat(f"{proxy.url}/v1") == CHAT_ID  # no id at all: the other kind
        assert _chat(f"{proxy.url}/ng-rollout/ok-1/v1") == CHAT_ID
        _wait_until(root, lambda s: s.invalid.calls == 2 and s.calls == 1)
    # the upstream saw every call, without the prefix or the header
    assert [path for _, path, _ in replay_server.seen] == ["/v1/chat/completions"] * 4
    assert not [h for h in replay_server.headers_seen if "x-rollout-id" in h]
    assert CaptureStore(root).rollout_ids() == ["ok-1"]
    assert not [p for p in root.iterdir() if "city" in p.name]  # never a file name
    invalid = [r.getMessage() for r in caplog.records if "not a rollout id" in r.getMessage()]
    assert len(invalid) == 1 and "'city 9'" in invalid[0]  # once (rate-limited), the id escaped

    check = _cli("check", str(root))
    assert check.returncode == 0, check.stdout  # nothing on disk is damaged
    answer = check.stdout.splitlines()[0]
    assert answer.startswith("ok: 1 rollout(s)") and "with an invalid rollout id" in answer
    invalid_line = (
        "2 model call(s) with a rollout id outside the grammar (invalid_id) were served and not recorded"
    )
    no_id_line = "1 model call(s) without a rollout id were served and not recorded"
    assert invalid_line in check.stdout and no_id_line in check.stdout
    assert "city" not in check.stdout  # the hostile id is in no count
    assert _cli("check", str(root), "--strict").returncode == 1
    ls = _cli("ls", str(root))
    assert ls.returncode == 0 and invalid_line in ls.stdout and no_id_line in ls.stdout


def test_a_late_call_to_a_frozen_rollout_is_answered_warned_metered_and_shown_by_check_and_ls(
    tmp_path: Path, replay_server: ReplayModelServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The README's sections in order: freeze ``0-0``, then the agent's calls with ``0-0``. They are
    answered and not recorded (the lifecycle working, contract L9), and no longer silently."""
    root = tmp_path / "calls"
    with (
        caplog.at_level(logging.WARNING, logger="otel_capture"),
        serve(replay_server) as upstream,
        start_proxy(upstream, str(root)) as proxy,
    ):
        assert _chat(f"{proxy.url}/ng-rollout/0-0/v1") == CHAT_ID
        CaptureStore(root).freeze_now("0-0")
        for _ in range(2):
            assert _chat(f"{proxy.url}/ng-rollout/0-0/v1") == CHAT_ID  # answered as ever
        _wait_until(root, lambda s: s.late.calls == 2)
    assert len(read_model_call_records(CaptureStore(root), "0-0")) == 1  # the call before the freeze
    late = [r.getMessage() for r in caplog.records if "frozen or retired" in r.getMessage()]
    assert len(late) == 1 and "rollout 0-0" in late[0]  # once, then once a minute at most

    check = _cli("check", str(root))
    assert check.returncode == 0, check.stdout
    assert "late to a frozen or retired rollout" in check.stdout.splitlines()[0]
    line = "2 late model call(s) to a frozen or retired rollout were answered and not recorded (0-0: 2;"
    assert line in check.stdout
    assert _cli("check", str(root), "--strict").returncode == 1
    ls = _cli("ls", str(root))
    assert ls.returncode == 0 and line in ls.stdout


def test_late_and_invalid_id_calls_are_metered(
    telemetry: Telemetry, replay_server: ReplayModelServer
) -> None:
    reader = InMemoryMetricReader()
    app = ModelCallCaptureMiddleware(
        replay_server,
        tracer_provider=telemetry.provider,
        meter_provider=MeterProvider(metric_readers=[reader]),
    )
    with serve(app) as url:
        assert _chat(f"{url}/ng-rollout/r-1/v1") == CHAT_ID
        telemetry.store.freeze_now("r-1")
        assert _chat(f"{url}/ng-rollout/r-1/v1") == CHAT_ID
        assert _chat(f"{url}/ng-rollout/bad%20id/v1") == CHAT_ID
    (late,) = metric_points(reader, LATE_CALLS)
    assert (late.value, late.attributes[A.MODEL_CALL_DIALECT]) == (1, "chat")
    (uncorrelated,) = metric_points(reader, UNCORRELATED_CALLS)
    assert uncorrelated.value == 1  # the invalid id: served without a usable one


def test_counts_written_by_an_older_version_are_still_read(tmp_path: Path) -> None:
    """A counts file without the new kinds (written before issue 33) reads as calls without an id."""
    counter = UncorrelatedCounter(tmp_path)
    counter.path.write_text(json.dumps({"calls": 2, "by_dialect": {"chat": 2}, "first": 1.0, "last": 2.0}))
    summary = read_uncorrelated(tmp_path)
    assert (summary.calls, summary.invalid.calls, summary.late.calls) == (2, 0, 0)
    assert summary.lines() == [summary.describe()]
