"""Where a writer keeps the losses it cannot write into their markers, when even the capture directory
cannot take them.

* At its start (issue 30, item 3): a writer started on a filesystem already out of inodes (a pod restarted
  on a full node) has its loss reserve before it acknowledges its first call, so every call it cannot
  capture is named by ``check``, also after the writer is SIGKILLed, and written into its rollout's marker
  once room returns.
* Cut off (issue 29, item 4): a node that cannot write the shared directory at all keeps its losses in
  its node-local reserve, named in its log and by ``check`` on that node, and writes them into the shared
  directory once it can again, also when the writer restarted in between. "Cannot write" is a read-only
  tmpfs mounted over the capture directory (root ignores file modes); the real GlusterFS cut is in
  ``tests/gluster/test_local_reserve.py``.

Each proxy is the real ``otel-capture proxy`` process in front of a real uvicorn upstream, on a tmpfs made
for the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from support import ReplayModelServer, exhaust_inodes, serve, start_cli_proxy

BOUND = 60.0  # generous: how long a recovery may take on a loaded machine before the test gives up
CHUNKS = [b'{"id":"chatcmpl-9","object":"chat.completion","model":"m",', b'"choices":[]}']
CALLS = 10
CLI = [sys.executable, "-m", "otel_capture._cli.main"]
LOCAL = "OTEL_CAPTURE_LOCAL_RESERVE_DIR"


@pytest.fixture
def upstream() -> Iterator[str]:
    server = ReplayModelServer()
    server.replies["chat"].chunks = list(CHUNKS)
    with serve(server) as url:
        yield url


class _Proxies:
    """``otel-capture proxy`` processes on one directory; every one still running is killed at the end."""

    def __init__(self, upstream: str, root: Path, env: dict[str, str], log: Path) -> None:
        self.upstream, self.root, self.env = upstream, root, env
        self.running: list[subprocess.Popen[str]] = []
        self.log = log  # every proxy's stderr, appended (on a disk with room)

    def start(self) -> str:
        with self.log.open("ab") as log:
            process, url = start_cli_proxy(
                self.upstream, "--capture-dir", str(self.root), env=self.env, stderr=log.fileno()
            )
        self.running.append(process)
        return url

    def stop(self, sig: int) -> None:
        process = self.running.pop()
        process.send_signal(sig)
        assert process.wait(BOUND) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        assert process.stdout is not None
        process.stdout.close()

    def close(self) -> None:
        while self.running:
            self.stop(signal.SIGKILL)


@pytest.fixture
def proxies(upstream: str, tmp_path: Path) -> Iterator[Callable[[Path, dict[str, str]], _Proxies]]:
    made: list[_Proxies] = []

    def make(root: Path, env: dict[str, str]) -> _Proxies:
        made.append(_Proxies(upstream, root, env, tmp_path / f"proxies-{len(made)}.log"))
        return made[-1]

    yield make
    for each in made:
        each.close()


def _call(url: str, rollout_id: str) -> tuple[int, bytes]:
    response = httpx.post(
        f"{url}/ng-rollout/{rollout_id}/v1/chat/completions", json={"model": "m"}, timeout=BOUND
    )
    return response.status_code, response.content


def _check(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "check", str(root)], capture_output=True, text=True, timeout=BOUND, env={**os.environ, **env}
    )


def _marked(root: Path, rollout_id: str) -> list[str]:
    """The call ids of the rollout's marker lines, in order (a call whose in-flight marker was refused too
    is named twice, once per reason)."""
    path = root / f"{rollout_id}.capture.incomplete"
    if not path.exists():
        return []
    return [orjson.loads(line)["model_call_id"] for line in path.read_bytes().splitlines() if line.strip()]


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _named_by_check(root: Path, env: dict[str, str], rollouts: list[str]) -> str:
    result = _check(root, env)
    assert result.returncode == 1, result.stdout
    for rid in rollouts:
        assert f"{rid}: lost, not yet in the incomplete marker" in result.stdout, (rid, result.stdout)
    return result.stdout


def test_a_writer_restarted_on_a_full_disk_takes_the_reserve_its_predecessor_handed_on(
    tmpfs: Callable[[str], Path], proxies: Callable[[Path, dict[str, str]], _Proxies]
) -> None:
    disk = tmpfs("nr_inodes=200,size=16m")
    root = disk / "calls"
    env = {LOCAL: str(disk / "local")}  # the node-local reserve on the same full disk: no way out there
    run = proxies(root, env)
    url = run.start()
    assert _call(url, "warm") == (200, b"".join(CHUNKS))
    run.stop(signal.SIGTERM)  # a clean stop: it hands its reserve on rather than leaving none
    assert _check(root, env).returncode == 0

    fillers = exhaust_inodes(disk)  # the node filled up while the pod was down
    url = run.start()
    lost = [f"new{i}" for i in range(CALLS)]  # new rollouts: no inode for their files or markers
    for rid in lost:
        assert _call(url, rid) == (200, b"".join(CHUNKS))  # exact, whatever the disk did
    _named_by_check(root, env, lost)

    run.stop(signal.SIGKILL)  # nothing of those calls is in any memory now
    _named_by_check(root, env, lost)

    for filler in fillers:
        filler.unlink()
    run.start()  # the next writer writes the dead one's marks by itself
    _until(lambda: _check(root, env).returncode == 0, "check still fails after the inodes returned")
    for rid in lost:
        assert len(set(_marked(root, rid))) == 1, (rid, (root / f"{rid}.capture.incomplete").read_text())
    run.stop(signal.SIGTERM)


def test_a_first_writer_on_a_full_disk_keeps_its_losses_in_the_node_local_reserve(
    tmpfs: Callable[[str], Path], proxies: Callable[[Path, dict[str, str]], _Proxies], tmp_path: Path
) -> None:
    disk = tmpfs("nr_inodes=200,size=16m")
    root = disk / "calls"
    root.mkdir(mode=0o700)  # made by the job, never written by a writer: no reserve to hand on
    local = tmp_path / "local"  # on another filesystem, which has room
    env = {LOCAL: str(local)}
    fillers = exhaust_inodes(disk)
    run = proxies(root, env)
    url = run.start()
    lost = [f"new{i}" for i in range(CALLS)]
    for rid in lost:
        assert _call(url, rid) == (200, b"".join(CHUNKS))
    assert str(local) in _named_by_check(root, env, lost)  # and says where they are kept
    run.stop(signal.SIGKILL)
    _named_by_check(root, env, lost)

    for filler in fillers:
        filler.unlink()
    run.start()
    _until(lambda: _check(root, env).returncode == 0, "check still fails after the inodes returned")
    for rid in lost:
        assert len(set(_marked(root, rid))) == 1, (rid, (root / f"{rid}.capture.incomplete").read_text())
    run.stop(signal.SIGTERM)


def test_check_says_when_only_a_running_writer_s_memory_knows_a_loss(
    tmpfs: Callable[[str], Path], proxies: Callable[[Path, dict[str, str]], _Proxies]
) -> None:
    disk = tmpfs("nr_inodes=200,size=16m")
    root = disk / "calls"
    root.mkdir(mode=0o700)
    env = {LOCAL: str(disk / "local")}  # nowhere with room: no reserve at all
    fillers = exhaust_inodes(disk)
    run = proxies(root, env)
    url = run.start()
    assert _call(url, "new0") == (200, b"".join(CHUNKS))
    result = _check(root, env)
    assert result.returncode == 1, result.stdout
    assert "only in the memory of a running writer" in result.stdout
    for filler in fillers:
        filler.unlink()
    _until(lambda: _check(root, env).returncode == 0, "check still fails after the inodes returned")
    assert len(set(_marked(root, "new0"))) == 1
    run.stop(signal.SIGTERM)


def test_a_node_cut_off_from_the_shared_directory_keeps_its_losses_locally_until_it_can_write_them(
    tmpfs: Callable[[str], Path], proxies: Callable[[Path, dict[str, str]], _Proxies], tmp_path: Path
) -> None:
    root = tmpfs("size=16m")  # the shared directory (the mount point itself)
    local = tmp_path / "local"
    env = {LOCAL: str(local)}
    run = proxies(root, env)
    url = run.start()
    assert _call(url, "warm") == (200, b"".join(CHUNKS))
    cut = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,mode=0700", "tmpfs", str(root)], capture_output=True, text=True
    )
    assert cut.returncode == 0, cut.stderr  # from now on nothing can be written at the directory's path
    try:
        lost = [f"cut{i}" for i in range(5)]
        for rid in lost:
            assert _call(url, rid) == (200, b"".join(CHUNKS))
        assert str(local) in _named_by_check(root, env, lost)
        assert str(local) in run.log.read_text()  # the log says where the losses are kept
        run.stop(signal.SIGKILL)
        _named_by_check(root, env, lost)

        url = run.start()  # restarted while still cut off: it takes over what the dead writer kept
        assert _call(url, "cut5") == (200, b"".join(CHUNKS))
        lost.append("cut5")
        _named_by_check(root, env, lost)
    finally:
        subprocess.run(["umount", str(root)], check=True)  # reachable again
    _until(lambda: _check(root, env).returncode == 0, "check still fails once the directory is writable")
    for rid in lost:
        assert len(set(_marked(root, rid))) == 1, (rid, (root / f"{rid}.capture.incomplete").read_text())
        assert "EROFS" in (root / f"{rid}.capture.incomplete").read_text(), rid
    run.stop(signal.SIGTERM)
    assert _check(root, env).returncode == 0
