"""Several writers on the same rollouts: a proxy with ``--workers 3`` and two more proxies, all writing one
capture directory, while NeMo Gym-style readers read the same files. No line is lost, none interleaved,
``call_index`` stays dense."""

from __future__ import annotations

import itertools
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from support import ReplayModelServer, gym_style_read, serve, start_cli_proxy

from otel_capture import CaptureStore, read_available_model_call_records

ROLLOUTS = ["multi-0", "multi-1", "multi-2"]


def test_many_processes_write_the_same_rollouts_while_readers_read(tmp_path: Path) -> None:
    capture_dir = tmp_path / "calls"
    with serve(ReplayModelServer()) as upstream:
        args = ("--capture-dir", str(capture_dir))
        proxies = [
            start_cli_proxy(upstream, *args, "--workers", "3"),
            start_cli_proxy(upstream, *args),
            start_cli_proxy(upstream, *args),
        ]
        urls = itertools.cycle([url for _, url in proxies])
        stop = threading.Event()
        reader_errors: list[BaseException] = []
        reads = [0]

        def reader() -> None:
            while not stop.is_set():
                try:
                    for rollout in ROLLOUTS:
                        gym_style_read(capture_dir / f"{rollout}.capture.jsonl")
                    reads[0] += 1
                except BaseException as exc:  # collected and asserted below
                    reader_errors.append(exc)
                    return

        def client(jobs: list[tuple[str, str, str]]) -> list[str]:
            sent = []
            with httpx.Client(timeout=30) as http:
                for url, rollout, tag in jobs:
                    response = http.post(
                        f"{url}/ng-rollout/{rollout}/v1/chat/completions", json={"model": "m", "user": tag}
                    )
                    assert response.status_code == 200
                    sent.append(tag)
            return sent

        jobs = [(next(urls), ROLLOUTS[i % 3], uuid.uuid4().hex) for i in range(240)]
        readers = [threading.Thread(target=reader) for _ in range(2)]
        for thread in readers:
            thread.start()
        try:
            with ThreadPoolExecutor(8) as pool:
                sent = [tag for tags in pool.map(client, [jobs[i::8] for i in range(8)]) for tag in tags]
        finally:
            stop.set()
            for thread in readers:
                thread.join(30)
            for process, _ in proxies:
                process.send_signal(signal.SIGTERM)
            for process, _ in proxies:
                process.communicate(timeout=60)

    assert reader_errors == []
    assert reads[0] > 0
    store = CaptureStore(capture_dir)
    recorded: list[str] = []
    for rollout in ROLLOUTS:
        available = read_available_model_call_records(store, rollout)
        assert available.invalid == [] and not available.torn_tail and not available.incomplete
        assert [r.call_index for r in available.records] == list(range(len(available.records)))
        assert all(r.request is not None for r in available.records)
        recorded += [r.request["user"] for r in available.records if r.request]
    assert sorted(recorded) == sorted(sent)
    assert len(recorded) == 240
