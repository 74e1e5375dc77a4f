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
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
from gluster_cluster import Gluster
from support import RECORDED, ReplayModelServer, gym_style_read, serve, sse_chunks, start_cli_proxy, submit

from otel_capture import CaptureStore, read_available_model_call_records
from otel_capture._store import JsonlWriter
from otel_capture._store import writer as writer_module
from otel_capture._store.append import _append_locked

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


def _where(tags: set[str], dirs: tuple[Path, Path], acked_by: dict[str, str], logs: list[Path]) -> str:
    """Why acknowledged calls are missing, for the failure's message: which node acknowledged each, whether
    its tag is in any file's bytes through either mount (now and a moment later: a stale read), what
    ``otel-capture check`` says, and what the proxies logged."""
    time.sleep(2)
    seen_later = {tag for tags in _tags(dirs[0]).values() for tag in tags}
    lines = [f"still missing 2 s later through node 1: {len(tags - seen_later)}"]
    store = CaptureStore(dirs[0])
    for rollout_id in store.rollout_ids():
        for record in read_available_model_call_records(store, rollout_id).records:
            if not record.request or "user" not in record.request:  # a record without the request sent
                lines.append(f"{rollout_id}: record {record.call_index} lacks its request: {record!r:.400}")
    for tag in sorted(tags):
        places = [
            f"{path.relative_to(d.parent.parent)}"
            for d in dirs
            for path in sorted(d.rglob("*"))
            if path.is_file() and tag.encode() in path.read_bytes()
        ]
        lines.append(f"{tag}: acknowledged by the {acked_by[tag]}; bytes found in {places or 'no file'}")
    check = subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "check", str(dirs[0])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines.append(f"otel-capture check (exit {check.returncode}):\n{check.stdout}{check.stderr}")
    for log in logs:
        lines.append(f"{log.name}:\n{log.read_text(errors='replace')[-4000:]}")
    return "\n".join(lines)


def test_sigkill_of_one_node_loses_no_acknowledged_call(
    gluster: Gluster, upstream: str, dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    rollouts = [f"kill-{i}" for i in range(4)]
    logs = [tmp_path / "survivor.log", tmp_path / "victim.log"]
    with logs[0].open("ab") as out:
        survivor, survivor_url = start_cli_proxy(upstream, "--capture-dir", str(dirs[0]), stderr=out.fileno())
    with logs[1].open("ab") as out:
        victim, victim_url = start_cli_proxy(upstream, "--capture-dir", str(dirs[1]), stderr=out.fileno())
    acked: set[str] = set()
    acked_by: dict[str, str] = {}
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
                        acked_by[tag] = "victim" if url == victim_url else "survivor"
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
    assert not missing, f"{len(missing)} acknowledged call(s) are not on the server\n" + _where(
        missing, dirs, acked_by, logs
    )


def _call_quietly(url: str, rollout: str, tag: str) -> int:
    response = httpx.post(
        f"{url}/ng-rollout/{rollout}/v1/responses", json={"model": "m", "user": tag}, timeout=60
    )
    return response.status_code


def test_lifecycle_through_one_node_fences_the_other(
    gluster: Gluster, upstream: str, dirs: tuple[Path, Path]
) -> None:
    """Node 1's proxy calls four rollouts without a pause while the trainer on node 2 freezes one, retires
    one, drops one and deletes one: within the same second, node 1 writes none of the fenced lines."""
    writer_proxy, url = start_cli_proxy(upstream, "--capture-dir", str(dirs[0]))
    other = CaptureStore(dirs[1])  # the trainer, on the other node
    rollouts = ["fz", "rt", "dl", "dp"]
    stop = threading.Event()
    calls: list[tuple[str, str, float, float, int]] = []  # rollout, tag, begun, answered, status

    def traffic() -> None:
        while not stop.is_set():
            for rollout in rollouts:
                tag = uuid.uuid4().hex
                begun = time.monotonic()
                status = _call_quietly(url, rollout, tag)
                calls.append((rollout, tag, begun, time.monotonic(), status))

    def called_after(rollout: str, moment: float) -> bool:
        """A call of ``rollout`` that began after ``moment`` has been answered."""
        return any(r == rollout and begun > moment for r, _, begun, _, _ in list(calls))

    def wait_for(condition: Callable[[], bool], what: str) -> None:
        """Calls through the mount are slow on a loaded machine: wait for the traffic, not for a time."""
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline, f"the traffic never reached {what}"
            time.sleep(0.05)

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: all(called_after(r, 0.0) for r in rollouts), "every rollout")
        frozen = other.freeze_now("fz")
        fenced_at = {"fz": time.monotonic()}
        other.retire_now(["rt"])
        fenced_at["rt"] = time.monotonic()
        snapshot = other.freeze_now("dp")
        assert other.drop_now("dp", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        fenced_at["dp"] = time.monotonic()
        # node 1 keeps calling every rollout meanwhile: until each fenced one had a call begun after its fence
        wait_for(lambda: all(called_after(r, at) for r, at in fenced_at.items()), "the fenced rollouts")
        delete_started = time.monotonic()
        other.delete_now(["dl"])
        wait_for(lambda: called_after("dl", delete_started), "dl after its delete")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        _stop(writer_proxy)
    assert {status for *_, status in calls} == {200}, "a fenced call's response was changed"
    tags = _tags(dirs[1])
    assert tags.get("fz", []) == [r.request["user"] for r in frozen.records if r.request], (
        "a line reached the frozen rollout after its freeze"
    )
    assert "rt" not in tags and "dp" not in tags, "a line reached a retired or dropped rollout"
    answered_before_delete = {tag for r, tag, _, done, _ in calls if r == "dl" and done < delete_started}
    assert answered_before_delete, "no call of dl was answered before the delete: the test proved nothing"
    assert not answered_before_delete & set(tags.get("dl", [])), (
        "a call answered before the delete survived it"
    )


def test_a_node_cut_off_while_holding_locks_is_fenced(
    gluster: Gluster, upstream: str, dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 holds two data files' locks when its network goes: its capture writer holds ``r``'s, another
    writer of it holds ``x``'s. The server takes both away after its timeout and node 2 writes both; node 1,
    back, writes nothing without the locks (its writer marks ``r`` incomplete with the reason, and its
    append path does not cut ``x`` back over node 2's line), then captures ``r`` again."""
    monkeypatch.setattr(writer_module, "IDLE_CLOSE", 3600.0)  # node 1 keeps r's file open through the cut
    node1 = JsonlWriter(dirs[0])
    assert submit(node1, "r", b'{"model_call_id": "before"}\n', "before").result(30) is None
    kept = [fd for name, (fd, _, _) in node1._files._files.items() if name == "r.capture.jsonl"]
    assert kept, "node 1's writer did not keep r's file open"
    # What the writer holds in the middle of its append: an flock belongs to the open file description,
    # shared by every use of it, so node 1's writer owns this lock.
    fcntl.flock(kept[0], fcntl.LOCK_EX)
    x_path = dirs[0] / "x.capture.jsonl"
    x_path.write_bytes(b'{"n": 1}\n')
    x_fd = os.open(x_path, os.O_RDWR | os.O_APPEND)
    fcntl.flock(x_fd, fcntl.LOCK_EX)
    proxy2, url2 = start_cli_proxy(upstream, "--capture-dir", str(dirs[1]))
    try:
        gluster.cut(0)
        try:
            # node 2 waits on the lock until the server gives up on node 1 (~10 s here), then writes
            assert _call_quietly(url2, "r", "node2") == 200
            other = os.open(dirs[1] / "x.capture.jsonl", os.O_RDWR | os.O_APPEND)
            fcntl.flock(other, fcntl.LOCK_EX)  # granted: the server gave up on node 1 already
            os.write(other, b'{"n": 2}\n')
            os.close(other)
        finally:
            gluster.restore(0)
        gluster.wait_connected(2)
        attempt = submit(node1, "r", b'{"model_call_id": "after"}\n', "after")
        assert attempt is not None
        error = attempt.exception(60)
        assert isinstance(error, OSError) and error.errno == errno.EBADFD, error
        assert "fenced" in str(error)
        assert submit(node1, "r", b'{"model_call_id": "again"}\n', "again").result(60) is None
        with pytest.raises(OSError, match="fenced") as raised:
            _append_locked(x_fd, b'{"n": 3}\n', "x.capture.jsonl", 5.0)
        assert raised.value.errno == errno.EBADFD
    finally:
        node1.close()
        _stop(proxy2)
        with contextlib.suppress(
            OSError
        ):  # closing a fenced descriptor says EBADFD; it is closed all the same
            os.close(x_fd)
    written = [
        orjson.loads(line).get("model_call_id")
        for line in (dirs[1] / "r.capture.jsonl").read_bytes().splitlines()
    ]
    assert "after" not in written, "node 1 wrote a line without the lock"
    assert written[0] == "before" and written[-1] == "again" and len(written) == 3
    assert CaptureStore(dirs[1]).is_incomplete("r")
    assert "fenced" in (dirs[1] / "r.capture.incomplete").read_text()
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
            wrap=(
                "strace",
                "-f",
                "-qq",
                "--seccomp-bpf",
                "-e",
                "trace=fsync,fdatasync,syncfs",
                "-o",
                str(trace),
            ),
        )
        try:
            rollouts = [f"sync-{i}" for i in range(8)]
            with ThreadPoolExecutor(16) as pool:  # concurrent calls over several rollouts: multi-file batches
                codes = list(pool.map(lambda i: _call_quietly(url, rollouts[i % 8], str(i)), range(48)))
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
    assert codes == [200] * 48
    calls = trace.read_text()
    assert "syncfs(" not in calls, "the writer issued syncfs on a FUSE mount"
    client_fsyncs = len(re.findall(r"\bf(?:data)?sync\(", calls))
    assert client_fsyncs >= 8
    # "%-latency Avg Min Max-latency No.-of-calls Fop" rows: the brick's count of FSYNC calls received
    brick_fsyncs = sum(int(n) for n in re.findall(r"(\d+)\s+FSYNC\s*$", profile, re.MULTILINE))
    assert brick_fsyncs >= 8, f"the brick received {brick_fsyncs} fsync(s):\n{profile}"
    assert sum(len(t) for t in _tags(dirs[1]).values()) == 48


def test_check_and_the_writer_say_fsync_per_file_on_the_mount(
    gluster: Gluster, dirs: tuple[Path, Path]
) -> None:
    writer = JsonlWriter(dirs[0])
    writer.close()
    assert writer.sync_choice.kind == "fsync"
    assert writer.sync_choice.fs_name == "fuse.glusterfs"
    result = subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "check", str(gluster.mounts[1])],
        capture_output=True,
        text=True,
        check=True,
    )
    assert next(line for line in result.stdout.splitlines() if line.startswith("sync: ")) == (
        "sync: one fsync per file (fuse.glusterfs, f_type 0x65735546: a network or FUSE filesystem, "
        "where syncfs does not reach the server)"
    )
