"""Many nodes, one capture directory, on a real GlusterFS volume: a capture proxy per "node", each writing
through its own FUSE mount (two clients the server sees as two hosts), with default settings.

Every acknowledged call is on the server exactly once and reads the same from both mounts; a SIGKILLed
node loses no acknowledged call; a freeze, retire or delete made through one node fences the other; a
node cut off while it holds a data file's lock loses it (the other node proceeds after the server's
timeout) and writes nothing without it; the default sync sends the brick an fsync, never a syncfs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import random
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
from gluster_cluster import Gluster
from support import RECORDED, ReplayModelServer, gym_style_read, serve, sse_chunks, start_cli_proxy

from otel_capture import CaptureStore, read_available_model_call_records
from otel_capture._store import writer as writer_module
from otel_capture._store.lifecycle_io import _append_locked
from otel_capture._store.writer import JsonlWriter

pytestmark = pytest.mark.glusterfs

CHAT_SSE = RECORDED / "openai-python/chat_completions_sse/parse_pydantic_model.7e5ea4d12e7c.sse"


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ReplayModelServer()
    server.replies["chat"].content_type = "text/event-stream"
    server.replies["chat"].chunks = sse_chunks(CHAT_SSE.read_bytes())
    server.chunk_delay = 0.001  # calls overlap, so a kill lands mid-stream for some of them
    with serve(server) as url:
        yield url


@pytest.fixture
def dirs(gluster: Gluster) -> tuple[Path, Path]:
    """One fresh capture directory, as each node sees it through its own mount."""
    name = f"calls-{uuid.uuid4().hex[:8]}"
    return gluster.mounts[0] / name, gluster.mounts[1] / name


def _stop(process: subprocess.Popen[str], sig: int = signal.SIGTERM) -> None:
    process.send_signal(sig)
    process.wait(60)
    assert process.stdout is not None
    process.stdout.close()


def _call(client: httpx.Client, url: str, rollout: str, tag: str, stream: bool) -> bool:
    """One call as a client makes it; True when the client got its terminal chunk (acknowledged)."""
    if stream:
        body = {"model": "m", "stream": True, "user": tag, "messages": [{"role": "user", "content": "x"}]}
        with client.stream("POST", f"{url}/ng-rollout/{rollout}/v1/chat/completions", json=body) as response:
            received = b"".join(response.iter_raw())
        return response.status_code == 200 and received.rstrip().endswith(b"data: [DONE]")
    response = client.post(f"{url}/ng-rollout/{rollout}/v1/responses", json={"model": "m", "user": tag})
    return response.status_code == 200 and response.json()["object"] == "response"


def _tags(capture_dir: Path) -> dict[str, list[str]]:
    """Each rollout's record tags in file order, read through one mount; asserts nothing is damaged."""
    store = CaptureStore(capture_dir)
    found: dict[str, list[str]] = {}
    for rollout_id in store.rollout_ids():
        available = read_available_model_call_records(store, rollout_id)
        assert available.invalid == [] and available.torn_tail_line is None, rollout_id
        assert [r.call_index for r in available.records] == list(range(len(available.records)))
        found[rollout_id] = [r.request["user"] for r in available.records if r.request]
    return found


def test_both_nodes_write_the_same_rollouts_at_once(
    gluster: Gluster, upstream: str, dirs: tuple[Path, Path]
) -> None:
    rollouts = [f"both-{i}" for i in range(4)]
    proxies = [start_cli_proxy(upstream, "--capture-dir", str(d)) for d in dirs]
    urls = itertools.cycle([url for _, url in proxies])
    jobs = [(next(urls), rollouts[i % 4], uuid.uuid4().hex, i % 3 == 0) for i in range(160)]

    def client(share: list[tuple[str, str, str, bool]]) -> list[str]:
        with httpx.Client(timeout=60) as http:
            return [tag for url, rollout, tag, stream in share if _call(http, url, rollout, tag, stream)]

    try:
        with ThreadPoolExecutor(8) as pool:
            acked = [tag for tags in pool.map(client, [jobs[i::8] for i in range(8)]) for tag in tags]
    finally:
        for process, _ in proxies:
            _stop(process)
    assert len(acked) == len(jobs)
    seen = [_tags(d) for d in dirs]
    assert seen[0] == seen[1], "the two mounts read different records"
    recorded = [tag for tags in seen[0].values() for tag in tags]
    assert sorted(recorded) == sorted(acked), "a call is missing or recorded twice"
    for rollout in rollouts:  # NeMo Gym's reader (shared flock, a JSON object per line) agrees on each mount
        assert {gym_style_read(d / f"{rollout}.capture.jsonl") for d in dirs} == {len(seen[0][rollout])}


def test_sigkill_of_one_node_loses_no_acknowledged_call(
    gluster: Gluster, upstream: str, dirs: tuple[Path, Path]
) -> None:
    rollouts = [f"kill-{i}" for i in range(4)]
    survivor, survivor_url = start_cli_proxy(upstream, "--capture-dir", str(dirs[0]))
    victim, victim_url = start_cli_proxy(upstream, "--capture-dir", str(dirs[1]))
    acked: set[str] = set()
    lock = threading.Lock()
    enough = threading.Event()
    stop = threading.Event()

    def run(seed: int) -> None:
        rng = random.Random(seed)
        url = victim_url if seed % 2 else survivor_url
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                tag = uuid.uuid4().hex
                try:
                    ok = _call(http, url, rng.choice(rollouts), tag, rng.random() < 0.5)
                except httpx.HTTPError:
                    continue
                if ok:
                    with lock:
                        acked.add(tag)
                        if len(acked) >= 40:
                            enough.set()

    try:
        with ThreadPoolExecutor(8) as pool:
            clients = [pool.submit(run, seed) for seed in range(8)]
            assert enough.wait(120), "the proxies never served enough calls"
            _stop(victim, signal.SIGKILL)
            with lock:
                acked_before_kill = set(acked)
            stop.set()
            for done in clients:
                done.result(60)
    finally:
        _stop(survivor)
    assert victim.returncode == -signal.SIGKILL
    # read at once through the other node's mount: what the killed node acknowledged is on the server
    on_server = {tag for tags in _tags(dirs[0]).values() for tag in tags}
    missing = acked_before_kill - on_server
    assert not missing, f"{len(missing)} acknowledged call(s) are not on the server"


def _call_quietly(url: str, rollout: str, tag: str) -> int:
    response = httpx.post(
        f"{url}/ng-rollout/{rollout}/v1/responses", json={"model": "m", "user": tag}, timeout=60
    )
    return response.status_code


def test_lifecycle_through_one_node_fences_the_other(
    gluster: Gluster, upstream: str, dirs: tuple[Path, Path]
) -> None:
    writer_proxy, url = start_cli_proxy(upstream, "--capture-dir", str(dirs[0]))
    other = CaptureStore(dirs[1])  # the trainer, on the other node
    rollouts = ["fz", "rt", "dl", "dp"]
    stop = threading.Event()
    statuses: list[int] = []
    started_after: dict[str, list[str]] = {r: [] for r in rollouts}  # tags of calls begun after the fence
    fenced_at: dict[str, float] = {}

    def traffic() -> None:
        while not stop.is_set():
            for rollout in rollouts:
                tag = uuid.uuid4().hex
                begun = time.monotonic()
                statuses.append(_call_quietly(url, rollout, tag))
                if rollout in fenced_at and begun > fenced_at[rollout]:
                    started_after[rollout].append(tag)

    try:
        threads = [threading.Thread(target=traffic) for _ in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        frozen = other.freeze_now("fz")
        fenced_at["fz"] = time.monotonic()
        other.retire_now(["rt"])
        fenced_at["rt"] = time.monotonic()
        dropped_snapshot = other.freeze_now("dp")
        assert other.drop_now(
            "dp", snapshot_id=dropped_snapshot.snapshot_id, version=dropped_snapshot.version
        )
        fenced_at["dp"] = time.monotonic()
        time.sleep(1.5)  # the writer keeps calling every rollout meanwhile
        other.delete_now(["dl"])
        deleted_at = time.monotonic()
        time.sleep(1.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        _stop(writer_proxy)
    assert set(statuses) == {200}, "a fenced call's response was changed"
    for rollout in ("fz", "rt", "dp"):
        assert started_after[rollout], f"no call of {rollout} began after its fence: the test proved nothing"
    tags = _tags(dirs[1])
    assert tags.get("fz", []) == [r.request["user"] for r in frozen.records if r.request], (
        "a line reached the frozen rollout after its freeze"
    )
    assert "rt" not in tags and "dp" not in tags, "a line reached a retired or dropped rollout"
    assert deleted_at  # a deleted id captures again from empty: only calls begun after the delete
    assert len(tags.get("dl", [])) < sum(1 for s in statuses) // 4


def test_a_node_cut_off_while_holding_a_lock_is_fenced(
    gluster: Gluster, upstream: str, dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1's writer holds ``r``'s data file lock when its network goes; the server takes the lock away
    after its timeout, node 2 writes; node 1, back, writes nothing without the lock and marks ``r``
    incomplete with the reason."""
    monkeypatch.setattr(writer_module, "IDLE_CLOSE", 3600.0)  # node 1 keeps r's file open through the cut
    node1 = JsonlWriter(dirs[0])
    assert node1.submit("r", b'{"model_call_id": "before"}\n', "before").result(30) is None  # type: ignore[union-attr]
    kept = [fd for name, (fd, _, _) in node1._files._files.items() if name == "r.capture.jsonl"]
    assert kept, "node 1's writer did not keep r's file open"
    # what a writer holds in the middle of its append (an flock on an open file description is shared by
    # every use of that description, so node 1's writer owns this lock)
    fcntl.flock(kept[0], fcntl.LOCK_EX)
    proxy2, url2 = start_cli_proxy(upstream, "--capture-dir", str(dirs[1]))
    try:
        gluster.cut(0)
        try:
            # node 2 waits on the lock until the server gives up on node 1 (ping timeout ~10 s), then writes
            assert _call_quietly(url2, "r", "node2") == 200
        finally:
            gluster.restore(0)
        gluster.wait_connected(2)
        attempt = node1.submit("r", b'{"model_call_id": "after"}\n', "after")
        assert attempt is not None
        error = attempt.exception(60)
        assert isinstance(error, OSError) and error.errno == errno.EBADFD, error
        assert "fenced" in str(error)
        assert node1.submit("r", b'{"model_call_id": "again"}\n', "again").result(60) is None  # type: ignore[union-attr]
    finally:
        node1.close()
        _stop(proxy2)
    lines = [orjson.loads(line) for line in (dirs[1] / "r.capture.jsonl").read_bytes().splitlines()]
    written = [line.get("model_call_id") for line in lines]
    assert "after" not in written, "node 1 wrote a line without the lock"
    assert written[0] == "before" and written[-1] == "again" and len(written) == 3
    assert CaptureStore(dirs[1]).is_incomplete("r")
    assert "fenced" in (dirs[1] / "r.capture.incomplete").read_text()


def test_a_fenced_descriptor_is_never_cut_back(gluster: Gluster, dirs: tuple[Path, Path]) -> None:
    """The append path on a descriptor whose lock the server took away: EBADFD, said as a fence, and the
    file (with the other node's line) left as it is."""
    dirs[0].mkdir(mode=0o700)
    path = dirs[0] / "x.capture.jsonl"
    path.write_bytes(b'{"n": 1}\n')
    fd = os.open(path, os.O_RDWR | os.O_APPEND)
    fcntl.flock(fd, fcntl.LOCK_EX)
    gluster.cut(0)
    try:
        other = os.open(dirs[1] / "x.capture.jsonl", os.O_RDWR | os.O_APPEND)
        fcntl.flock(other, fcntl.LOCK_EX)  # granted once the server gave up on node 1
        os.write(other, b'{"n": 2}\n')
        os.close(other)
    finally:
        gluster.restore(0)
    gluster.wait_connected(2)
    with pytest.raises(OSError, match="fenced") as raised:
        _append_locked(fd, b'{"n": 3}\n', "x.capture.jsonl", 5.0)
    assert raised.value.errno == errno.EBADFD
    with contextlib.suppress(
        OSError
    ):  # closing a fenced descriptor says EBADFD too; it is closed all the same
        os.close(fd)
    assert (dirs[1] / "x.capture.jsonl").read_bytes() == b'{"n": 1}\n{"n": 2}\n'


def test_the_default_sync_sends_the_brick_fsyncs_and_never_syncfs(
    gluster: Gluster, upstream: str, dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    trace = tmp_path / "strace.out"
    gluster.gluster("volume", "profile", gluster.volume, "start")
    try:
        gluster.gluster("volume", "profile", gluster.volume, "info", "clear")
        proxy, url = start_cli_proxy(
            upstream,
            "--capture-dir",
            str(dirs[0]),
            wrap=("strace", "-f", "-qq", "-e", "trace=fsync,fdatasync,syncfs", "-o", str(trace)),
        )
        try:
            rollouts = [f"sync-{i}" for i in range(8)]
            with ThreadPoolExecutor(16) as pool:  # concurrent calls over several rollouts: multi-file batches
                codes = list(pool.map(lambda i: _call_quietly(url, rollouts[i % 8], str(i)), range(96)))
        finally:
            # the proxy is strace's child: it gets the signal (strace leaves when it has exited)
            proxy_pid = int(Path(f"/proc/{proxy.pid}/task/{proxy.pid}/children").read_text().split()[0])
            os.kill(proxy_pid, signal.SIGTERM)
            proxy.wait(60)
            assert proxy.stdout is not None
            proxy.stdout.close()
        profile = gluster.gluster("volume", "profile", gluster.volume, "info", "cumulative")
    finally:
        gluster.gluster("volume", "profile", gluster.volume, "stop")
    assert codes == [200] * 96
    calls = trace.read_text()
    assert "syncfs(" not in calls, "the writer issued syncfs on a FUSE mount"
    client_fsyncs = len(re.findall(r"\bf(?:data)?sync\(", calls))
    assert client_fsyncs >= 8
    # "%-latency Avg Min Max-latency No.-of-calls Fop" rows: the brick's count of FSYNC calls received
    brick_fsyncs = sum(int(n) for n in re.findall(r"(\d+)\s+FSYNC\s*$", profile, re.MULTILINE))
    assert brick_fsyncs >= 8, f"the brick received {brick_fsyncs} fsync(s):\n{profile}"
    assert sum(len(t) for t in _tags(dirs[1]).values()) == 96
