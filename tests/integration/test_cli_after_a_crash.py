"""``otel-capture ls``, ``show`` and ``check`` as a user runs them (separate processes) on calls recorded by
the capture proxy (its own process, in front of a real uvicorn upstream replaying recorded bodies and
streams, called with the official openai SDK): after a crash left a damaged line and a torn tail, every
rollout is still listed and the damaged ones marked; each rollout's latency is shown; a stream answered
without usage counts as unknown tokens, never as zero; a world-writable directory is read without
following what was planted in it (issue 33, items 8, 12 and 14)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from support import RECORDED, ReplayModelServer, Reply, serve, sse_chunks, start_cli_proxy

from otel_capture import CaptureStore, read_available_model_call_records
from otel_capture._cli.show import CALL_HEADERS, ROLLOUT_HEADERS

BOUND = 60  # seconds: a bound on a hang, not a timing assertion
SSE = RECORDED / "openai-python" / "chat_completions_sse" / "parse_nothing.e2aad469b71d.sse"
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_capture", *argv],
        capture_output=True,
        text=True,
        timeout=BOUND,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def proxy(replay_server: ReplayModelServer, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The capture proxy's URL and its capture directory."""
    directory = tmp_path / "calls"
    with serve(replay_server) as upstream:
        process, url = start_cli_proxy(upstream, "--capture-dir", str(directory))
        try:
            yield url, directory
        finally:
            process.terminate()
            process.communicate(timeout=BOUND)


def _client(url: str, rollout_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/ng-rollout/{rollout_id}/v1", api_key="k", max_retries=0)


def _stream(replay_server: ReplayModelServer, url: str, rollout_id: str, *, usage: bool) -> None:
    """A streamed chat call; without ``usage`` the upstream sends no usage chunk, as a server does for a
    request without ``stream_options={"include_usage": True}``."""
    chunks = sse_chunks(SSE.read_bytes())
    if not usage:
        chunks = [chunk for chunk in chunks if b'"usage"' not in chunk]
    replay_server.replies["chat"] = Reply(content_type="text/event-stream", chunks=chunks)
    options: dict[str, bool] = {"include_usage": True} if usage else {}
    with _client(url, rollout_id) as client:
        stream = client.chat.completions.create(
            model="gpt-4o", messages=MESSAGES, stream=True, stream_options=options or openai.NOT_GIVEN
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _table(stdout: str) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """``ls``'s header cells, its rows by rollout (the last cell, the damage, may hold spaces) and the notes
    below the table."""
    header, *rest = stdout.splitlines()
    rows = [line for line in rest if line.split()[1:2] in (["live"], ["frozen"], ["retired"])]
    assert rest[: len(rows)] == rows, stdout  # the table, then the notes
    cells = [row.split(None, len(ROLLOUT_HEADERS) - 1) for row in rows]
    return [c.strip() for c in header.split("  ") if c], {c[0]: c for c in cells}, rest[len(rows) :]


def test_ls_lists_every_rollout_after_a_crash_and_show_names_the_torn_tail(
    proxy: tuple[str, Path], replay_server: ReplayModelServer
) -> None:
    url, directory = proxy
    for rollout_id in ("bad", "ok", "torn"):
        with _client(url, rollout_id) as client:
            client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
            client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    # what a crash leaves: a writer killed mid-append (a torn tail); a line a foreign writer spoiled
    torn_bytes = b'{"model_call_id": "cut-short", "status'
    with (directory / "torn.capture.jsonl").open("ab") as torn:
        torn.write(torn_bytes)
    with (directory / "bad.capture.jsonl").open("ab") as bad:
        bad.write(b"{not json\n")

    ls = cli("ls", str(directory))
    assert ls.returncode == 1, ls.stderr  # as check: damage fails
    _, rows, notes = _table(ls.stdout)
    assert sorted(rows) == ["bad", "ok", "torn"]  # every rollout, damaged ones included
    assert [rows[r][2] for r in ("bad", "ok", "torn")] == ["2", "2", "2"]  # their readable calls
    assert rows["bad"][-1] == "1 line"
    assert rows["torn"][-1] == f"torn {len(torn_bytes)} B"
    assert rows["ok"][-1] == "-"
    assert notes and notes[0].startswith("damaged: bad, torn (2 rollout(s))")
    assert ls.stderr == ""

    show = cli("show", str(directory), "torn")
    assert show.returncode == 1
    assert len(show.stdout.splitlines()) == 3  # the header and the two calls
    assert f"torn tail: line 3, {len(torn_bytes)} bytes with no newline" in show.stderr
    clean = cli("show", str(directory), "ok")
    assert (clean.returncode, clean.stderr) == (0, "")

    check = cli("check", str(directory))
    assert check.returncode == 1
    answer = check.stdout.splitlines()[0]  # the answer first, in plain words
    assert answer.startswith("NOT OK: 2 of 3 rollout(s) damaged (bad, torn): ")
    assert "a torn last line" in answer and "lines that are not records" in answer


def test_ls_and_show_give_latency_and_never_count_a_stream_without_usage_as_zero_tokens(
    proxy: tuple[str, Path], replay_server: ReplayModelServer
) -> None:
    url, directory = proxy
    with _client(url, "plain") as client:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    _stream(replay_server, url, "streams", usage=True)
    _stream(replay_server, url, "streams", usage=False)
    _stream(replay_server, url, "blind", usage=False)

    store = CaptureStore(directory)
    records = {
        rid: read_available_model_call_records(store, rid).records for rid in ("plain", "streams", "blind")
    }
    ls = cli("ls", str(directory))
    assert ls.returncode == 0, ls.stdout + ls.stderr
    header, rows, notes = _table(ls.stdout)
    assert header[:4] == ["rollout", "state", "calls", "errors"]
    latency = {name: ROLLOUT_HEADERS.index(name) for name in ("model s", "p50 ms", "max ms", "ttft ms")}
    for rid, calls in records.items():
        row = rows[rid]
        took = [r.latency_total_ms for r in calls if r.latency_total_ms is not None]
        assert len(took) == len(calls)
        assert row[latency["max ms"]] == f"{max(took):.1f}"
        assert row[latency["model s"]] == f"{sum(took) / 1000:.2f}"
    assert rows["plain"][latency["ttft ms"]] == "-"  # not a stream
    streamed_ttft = [r.latency_ttft_ms for r in records["streams"]]
    assert all(t is not None for t in streamed_ttft)
    # the one streamed call with usage counts its tokens; the other is unknown, not zero
    with_usage = next(r for r in records["streams"] if r.tokens_in is not None)
    assert rows["streams"][4:6] == [f"{with_usage.tokens_in}+?", f"{with_usage.tokens_out}+?"]
    assert rows["blind"][4:6] == ["?", "?"]
    assert rows["plain"][4].isdigit()
    assert notes == [notes[0]] and notes[0].startswith(
        "?: 2 call(s) of blind, streams answered without usage"
    )

    show = cli("show", str(directory), "streams")
    assert show.returncode == 0, show.stderr
    _, first, second, note = show.stdout.splitlines()
    tokens = [line.split()[4:6] for line in (first, second)]
    assert tokens == [[str(with_usage.tokens_in), str(with_usage.tokens_out)], ["?", "?"]]
    assert note.startswith("?: 1 call(s) (# 1) answered without usage")


@pytest.mark.parametrize(
    ("command", "columns"), [("show", (*CALL_HEADERS, "trace")), ("ls", ROLLOUT_HEADERS)]
)
def test_the_help_names_every_column_and_what_it_holds(command: str, columns: tuple[str, ...]) -> None:
    description = " ".join(cli(command, "--help").stdout.split())
    for column in columns:
        assert f"{column} (" in description, column  # each column named, then what it holds


def test_read_only_commands_read_a_world_writable_directory_without_following_what_was_planted(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "open-to-all"
    store = CaptureStore(directory)
    store.append_now("mine", "c1", {"model_call_id": "c1", "status_code": 200})
    secret = tmp_path / "secret.capture.jsonl"
    secret.write_bytes(b'{"model_call_id": "planted", "status_code": 200}\n')
    os.symlink(secret, directory / "planted.capture.jsonl")  # what another user could plant
    directory.chmod(0o777)
    try:
        ls = cli("ls", str(directory))
        _, rows, _ = _table(ls.stdout)
        assert ls.returncode == 0 and sorted(rows) == ["mine"]  # read; the link is not a rollout
        show = cli("show", str(directory), "planted")
        assert show.returncode == 0 and len(show.stdout.splitlines()) == 1  # the header only: not followed
        check = cli("check", str(directory))
        assert check.returncode == 1  # a planted entry is damage
        assert "planted.capture.jsonl: a symbolic link" in check.stdout
        freeze = cli("freeze", str(directory), "mine")  # a command that writes refuses the directory
        assert freeze.returncode == 1 and "world-writable" in freeze.stderr
    finally:
        directory.chmod(0o700)


def test_ls_lists_a_rollout_it_cannot_read_as_unreadable_and_the_others_as_usual(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    for rollout_id in ("stuck", "fine"):
        store.append_now(rollout_id, "c1", {"model_call_id": "c1", "status_code": 200, "latency_ms": 5.0})
    with store.data_path("stuck").open("rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # a process that holds the file's lock and never lets go
        ls = cli("ls", str(tmp_path), env={"OTEL_CAPTURE_LOCK_TIMEOUT_S": "0.2"})
    assert ls.returncode == 1  # as check: a file it cannot read fails
    _, rows, notes = _table(ls.stdout)
    assert rows["stuck"][-1] == "unreadable" and rows["fine"][-1] == "-"
    assert rows["fine"][2] == "1" and rows["fine"][ROLLOUT_HEADERS.index("max ms")] == "5.0"
    assert any(note.startswith("stuck: unreadable: LockTimeoutError: ") for note in notes), notes
