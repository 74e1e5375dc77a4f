"""The writer's sync follows the capture directory's filesystem: ``syncfs`` only on a local one, one
``fsync`` per file on a network or FUSE filesystem (where ``syncfs`` never reaches the server) and on any
type not known to be local; ``OTEL_CAPTURE_SYNC=fsync`` wins; ``check`` says which and why. The FUSE case
runs on a real GlusterFS mount in ``tests/gluster/``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_capture._store import JsonlWriter, choose_sync
from otel_capture._store.fstype import mount_of, statfs_type


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs mounted for the test (needs root; skipped without it, failing under CI=true)."""
    point = tmp_path / "tmpfs"
    point.mkdir()
    if os.geteuid() != 0:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail("mounting a tmpfs needs root; CI=true: this test must run", pytrace=False)
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(point)], check=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_local_tmpfs_takes_syncfs_and_says_why(tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert statfs_type(tmpfs) == 0x01021994
    assert mount_of(tmpfs) == (str(tmpfs), "tmpfs")
    with caplog.at_level(logging.INFO, logger="otel_capture._store.writer"):
        writer = JsonlWriter(tmpfs / "calls")  # not made yet: judged by the directory it will be made in
    writer.close()
    assert writer.sync_choice.kind == "syncfs"
    assert "tmpfs, f_type 0x1021994: a local filesystem" in writer.sync_choice.reason
    assert any("one syncfs per batch" in r.getMessage() for r in caplog.records)


def test_the_setting_fsync_wins_on_a_local_filesystem(tmpfs: Path) -> None:
    writer = JsonlWriter(tmpfs / "calls", syncfs=None)  # what sync="fsync" / OTEL_CAPTURE_SYNC=fsync passes
    writer.close()
    assert writer.sync_choice.kind == "fsync" and "OTEL_CAPTURE_SYNC=fsync" in writer.sync_choice.reason


def test_a_filesystem_not_known_to_be_local_gets_fsync_per_file() -> None:
    choice = choose_sync("/proc", syncfs_allowed=True)  # procfs: neither local storage nor a known share
    assert choice.kind == "fsync" and "not known to be local" in choice.reason


def test_check_says_the_mode_in_force_and_why(tmpfs: Path) -> None:
    def check(**env: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "otel_capture._cli.main", "check", str(tmpfs)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, **env},
        )
        return next(line for line in result.stdout.splitlines() if line.startswith("sync: "))  # a detail

    assert check(OTEL_CAPTURE_SYNC="auto").startswith("sync: one syncfs per batch of several files (tmpfs")
    assert check(OTEL_CAPTURE_SYNC="fsync") == (
        "sync: one fsync per file (OTEL_CAPTURE_SYNC=fsync (or sync='fsync') asks for it)"
    )


def test_mountinfo_names_the_mount_on_top_and_unescapes_its_path(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        "30 22 0:40 / /shared\\040data rw - nfs4 server:/export rw,vers=4.2\n"
        "31 30 0:41 / /shared\\040data/calls rw - fuse.glusterfs gluster-brick:vol rw\n"
    )
    assert mount_of("/shared data/calls/x", str(info)) == ("/shared data/calls", "fuse.glusterfs")
    assert mount_of("/shared data/other", str(info)) == ("/shared data", "nfs4")
    assert mount_of("/shared datax", str(info)) == ("/", "ext4")
