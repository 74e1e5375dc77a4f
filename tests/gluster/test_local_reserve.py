"""A node cut off from the GlusterFS server cannot write its markers either (issue 29, item 4): its losses go
to its node-local reserve (``OTEL_CAPTURE_LOCAL_RESERVE_DIR``), named in its log and by ``check`` on that
node, and reach the shared directory once the node is back, also when its writer was SIGKILLed and
restarted in between. Node 2 then sees every lost call in its rollout's marker.

Runs only with the GlusterFS cluster (``tests/gluster_cluster.py``); the same behaviour without it, on a
tmpfs, is ``tests/integration/test_loss_reserves.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
from gluster_cluster import Gluster
from support import ReplayModelServer, serve, start_cli_proxy

pytestmark = pytest.mark.glusterfs

BOUND = 120.0  # the server's ping timeout (10 s) per blocked operation, several times over
CHUNKS = [b'{"id":"chatcmpl-9","object":"chat.completion","model":"m",', b'"choices":[]}']
LOCAL = "OTEL_CAPTURE_LOCAL_RESERVE_DIR"
CLI = [sys.executable, "-m", "otel_capture._cli.main"]


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ReplayModelServer()
    server.replies["chat"].chunks = list(CHUNKS)
    with serve(server) as url:
        yield url


def _call(url: str, rollout_id: str) -> tuple[int, bytes]:
    response = httpx.post(
        f"{url}/ng-rollout/{rollout_id}/v1/chat/completions", json={"model": "m"}, timeout=BOUND
    )
    return response.status_code, response.content


def _check(directory: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "check", str(directory)],
        capture_output=True,
        text=True,
        timeout=BOUND,
        env={**os.environ, **env},
    )


def _stop(process: subprocess.Popen[str], sig: int) -> None:
    process.send_signal(sig)
    process.wait(BOUND)
    assert process.stdout is not None
    process.stdout.close()


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def _marked(directory: Path, rollout_id: str) -> list[str]:
    path = directory / f"{rollout_id}.capture.incomplete"
    if not path.exists():
        return []
    return [orjson.loads(line)["model_call_id"] for line in path.read_bytes().splitlines() if line.strip()]


def test_a_node_cut_off_keeps_its_losses_locally_and_writes_them_once_back(
    gluster: Gluster, upstream: str, tmp_path: Path
) -> None:
    name = f"calls-{uuid.uuid4().hex[:8]}"
    node1, node2 = gluster.mounts[0] / name, gluster.mounts[1] / name
    local = tmp_path / "node1-local"  # node 1's own disk
    env = {LOCAL: str(local)}
    log = tmp_path / "node1.log"
    with log.open("ab") as stderr:
        proxy, url = start_cli_proxy(upstream, "--capture-dir", str(node1), env=env, stderr=stderr.fileno())
    restarted: subprocess.Popen[str] | None = None
    lost = [f"cut{i}" for i in range(4)]
    try:
        assert _call(url, "warm") == (200, b"".join(CHUNKS))
        gluster.cut(0)
        try:
            with ThreadPoolExecutor(len(lost)) as pool:  # together: they share the batches that time out
                answers = list(pool.map(lambda rid: _call(url, rid), lost))
            assert answers == [(200, b"".join(CHUNKS))] * len(lost)  # exact, whatever the mount did
            text = log.read_text()
            assert str(local) in text, text  # the log names where the losses are kept
            result = _check(node1, env)  # on node 1: the shared directory is unreachable from here
            assert result.returncode == 1, result.stdout
            for rid in lost:
                assert f"{rid}: lost, not yet in the incomplete marker" in result.stdout, result.stdout
            _stop(proxy, signal.SIGKILL)
            result = _check(node1, env)
            assert result.returncode == 1 and all(rid in result.stdout for rid in lost), result.stdout
        finally:
            gluster.restore(0)
            gluster.wait_connected(2)  # also when an assertion failed: the next tests need node 1 back
        with log.open("ab") as stderr:
            restarted, _ = start_cli_proxy(
                upstream, "--capture-dir", str(node1), env=env, stderr=stderr.fileno()
            )
        _until(lambda: _check(node1, env).returncode == 0, "node 1's check still fails once it is back")
    finally:
        if proxy.poll() is None:
            _stop(proxy, signal.SIGKILL)
        if restarted is not None:
            _stop(restarted, signal.SIGTERM)
    for rid in lost:  # what node 2 reads from the server
        assert len(_marked(node2, rid)) == 1, rid
    assert _check(node2, {LOCAL: str(tmp_path / "node2-local")}).returncode == 0
