"""A test session SIGKILLed while its GlusterFS cluster is up leaves the cluster's daemons, FUSE mounts and
network namespaces behind (its teardown never runs); the next session clears them and brings its own
cluster up. (A CI run once failed all seven GlusterFS tests at set-up because a killed run's namespaces
were still there.)

This file runs before the others of the folder (its name sorts first): the folder's cluster holds the
machine's GlusterFS lock while it is up, and this test brings up two clusters of its own.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from gluster_cluster import (
    LOCK,
    NODE_NS,
    SERVER_NS,
    _leftover_daemons,
    _stale_mounts,
    not_here,
    running_gluster,
    unavailable,
)

pytestmark = pytest.mark.glusterfs

BRING_UP = """
import sys, time
from pathlib import Path
from gluster_cluster import running_gluster
with running_gluster(Path(sys.argv[1])) as cluster:
    (cluster.mounts[0] / "left-behind").write_text("written before the kill")
    print(cluster.mounts[0], flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_the_next_session_clears_what_a_killed_one_left(tmp_path: Path) -> None:
    reason = unavailable()
    if reason is not None:
        not_here(reason)
    with LOCK.open("a") as lock:  # the folder's cluster is not up yet (see the docstring): fail, not wait
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pytest.fail(f"another GlusterFS cluster holds {LOCK}; run this file on its own or first")
    for work in ("killed", "next"):
        (tmp_path / work).mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    killed = subprocess.Popen(
        [sys.executable, "-c", BRING_UP, str(tmp_path / "killed")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert killed.stdout is not None
    with killed.stdout:
        first_mount = killed.stdout.readline().strip()
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
    assert first_mount, "the first session's cluster did not come up"

    left = _leftover_daemons()
    assert left, "the killed session left no daemon behind: this test would not test anything"
    assert first_mount in _stale_mounts()
    assert all(Path("/run/netns", ns).exists() for ns in (SERVER_NS, *NODE_NS))

    with running_gluster(tmp_path / "next") as cluster:
        assert first_mount not in _stale_mounts()
        assert not any(_alive(pid) for pid in left), "the killed session's daemons still run"
        (cluster.mounts[0] / "written").write_text("through node 1")
        assert (cluster.mounts[1] / "written").read_text() == "through node 1"
        assert not (cluster.mounts[1] / "left-behind").exists()  # a new volume, not the killed one's
    assert not any(Path("/run/netns", ns).exists() for ns in (SERVER_NS, *NODE_NS))
    assert not _stale_mounts()
