"""Group commit keeps the durability contract: with the sync calls instrumented, no client receives the
end of its response before a sync that covered its line; and concurrent calls really share syncs."""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from support import RECORDED, ReplayModelServer, serve, sse_chunks

from otel_capture import ModelCallCaptureMiddleware
from otel_capture._store import LIBC_SYNCFS
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter


class SyncLog:
    """Every sync, with the tags of every line on disk at that moment; every client ack, in one order."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock = threading.Lock()
        self.events: list[tuple[str, object]] = []
        self.kinds: list[str] = []

    def _covered(self) -> set[str]:
        tags = set()
        for path in self.root.glob("*.capture.jsonl"):
            for line in path.read_bytes().splitlines():
                start = line.find(b'"user":"')
                if start != -1:
                    tags.add(line[start + 8 : line.index(b'"', start + 8)].decode())
        return tags

    def hook(self, kind: str, real: object) -> object:
        def sync(fd: int) -> None:
            real(fd)  # type: ignore[operator]  # os.fsync or libc syncfs
            with self.lock:
                self.kinds.append(kind)
                self.events.append(("sync", self._covered()))

        return sync

    def ack(self, tag: str) -> None:
        with self.lock:
            self.events.append(("ack", tag))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_no_terminal_chunk_before_a_sync_covers_its_line(tmp_path: Path, stream: bool) -> None:
    assert LIBC_SYNCFS is not None, "this machine's libc has syncfs (Linux)"
    root = tmp_path / "calls"
    log = SyncLog(root)
    upstream = ReplayModelServer()
    if stream:
        upstream.replies["chat"].content_type = "text/event-stream"
        upstream.replies["chat"].chunks = sse_chunks(
            (RECORDED / "openai-python/chat_completions_sse/parse_strict_tools.a247c49c5fcd.sse").read_bytes()
        )
    provider = TracerProvider()
    exporter = ModelCallJsonlExporter(
        root, fsync=log.hook("fsync", os.fsync), syncfs=log.hook("syncfs", LIBC_SYNCFS)
    )  # type: ignore[arg-type]
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = ModelCallCaptureMiddleware(upstream, tracer_provider=provider)

    def call(i: int) -> str:
        tag = uuid.uuid4().hex
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST",
                f"{url}/ng-rollout/gc-{i % 8}/v1/chat/completions",
                json={"model": "m", "user": tag, "stream": stream},
            ) as response,
        ):
            body = b"".join(response.iter_raw())
        assert response.status_code == 200 and body
        log.ack(tag)
        return tag

    with serve(app) as url, ThreadPoolExecutor(32) as pool:
        tags = list(pool.map(call, range(192)))
    provider.shutdown()

    covered: set[str] = set()
    for kind, value in log.events:
        if kind == "sync":
            covered |= value  # type: ignore[arg-type]
        else:
            assert value in covered, f"call {value} got its terminal chunk before any sync covered its line"
    assert len(tags) == 192
    stats = exporter.stats
    assert stats.records_written == 192
    assert stats.fsyncs < stats.records_written, "concurrent calls did not share syncs"
    assert "syncfs" in log.kinds, "no batch touched several files: the one-sync-per-batch path went untested"


def test_a_bug_in_the_writer_fails_the_calls_capture_never_hangs_a_response(tmp_path: Path) -> None:
    def broken(fd: int) -> None:
        raise RuntimeError("a bug, not an OSError")

    provider = TracerProvider()
    exporter = ModelCallJsonlExporter(tmp_path / "calls", fsync=broken, syncfs=broken)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = ModelCallCaptureMiddleware(ReplayModelServer(), tracer_provider=provider)
    with serve(app) as url:
        for i in range(3):
            response = httpx.post(f"{url}/ng-rollout/bug-{i}/v1/responses", json={"model": "m"}, timeout=30)
            assert response.status_code == 200
    provider.shutdown()
