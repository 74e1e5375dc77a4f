"""A real GlusterFS on this machine for the shared-directory tests: one brick, two FUSE clients that the
server sees as two hosts.

Brought up from Debian's packages (``glusterfs-server``, ``glusterfs-client``; ``.ci/run`` installs them)
without systemd, once per test session, and torn down after it:

* three network namespaces made here: ``ocg-srv`` holds ``glusterd`` and the brick process, its loopback
  carrying the brick's address (``gluster-brick``, added to ``/etc/hosts`` when absent: a brick host must
  be a name, not 127.0.0.1); ``ocg-n1`` and ``ocg-n2`` are the two "nodes", each joined to ``ocg-srv`` by
  a veth pair. No traffic leaves these namespaces.
* ``glusterd`` runs with its own working directory under the session's temporary directory; the brick
  is a local directory there (which needs ``force``).
* the volume has the options that make a FUSE client as strict as a local disk across clients (client
  caches off, ``client.strict-locks``; see ``docs/scaling.md``; and, for speed only, no client
  io-threads), and a 10 s ping timeout so a node that is cut off loses its locks after 10 s instead
  of 42.
* each client is a ``glusterfs`` process started under ``nsenter --net=`` of its node's namespace (only
  the network namespace: the mount stays visible here), attribute, entry and negative timeouts 0.

A node is cut off by setting its veth down (:meth:`Gluster.cut`).

One cluster runs on a machine at a time (the names above, ``glusterd``'s socket): :func:`running_gluster`
holds ``/run/lock/otel-capture-gluster.lock`` while it runs, and waits for another session's cluster to
go down. Holding the lock, whatever of these names is still there was left by a session killed before its
teardown (its daemons, FUSE mounts and namespaces): it is cleared first, so one killed run does not fail
the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
import uuid
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

BRICK_HOST = "gluster-brick"
BRICK_ADDRESS = "10.77.0.1"
SERVER_NS = "ocg-srv"
NODE_NS = ("ocg-n1", "ocg-n2")
PING_TIMEOUT_S = 10
STRICT_OPTIONS = {
    "performance.write-behind": "off",
    "performance.stat-prefetch": "off",
    "performance.quick-read": "off",
    "performance.open-behind": "off",
    "performance.io-cache": "off",
    "performance.read-ahead": "off",
    "performance.readdir-ahead": "off",
    "performance.nl-cache": "off",
    "performance.client-io-threads": "off",  # no cache: one thread hand-off less per call (docs/scaling.md)
    "client.strict-locks": "on",
    "network.ping-timeout": str(PING_TIMEOUT_S),
    "server.tcp-user-timeout": str(PING_TIMEOUT_S),
    "server.keepalive-time": "5",
    "server.keepalive-interval": "2",
    "server.keepalive-count": "2",
}
"""The volume options of ``docs/scaling.md``, plus the shorter ping timeout (42 s by default)."""
FUSE_OPTIONS = ("--attribute-timeout=0", "--entry-timeout=0", "--negative-timeout=0")
LOCK = Path("/run/lock/otel-capture-gluster.lock")
LOCK_WAIT_S = 900
_TOOLS = ("glusterd", "gluster", "glusterfs", "ip", "nsenter")


class GlusterUnavailable(RuntimeError):
    """What this machine lacks to run GlusterFS (not root, no FUSE, no packages, no namespaces)."""


def not_here(reason: str) -> NoReturn:
    """A GlusterFS test that cannot run here: skipped, saying why; under ``CI=true`` failed instead (CI must
    run them: ``.ci/run`` installs the packages)."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{reason}; CI=true: the GlusterFS tests must run here", pytrace=False)
    pytest.skip(reason)


def unavailable() -> str | None:
    """Why GlusterFS cannot run here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "GlusterFS needs root (glusterd, FUSE mounts, network namespaces)"
    if not os.path.exists("/dev/fuse"):
        return "GlusterFS's client needs /dev/fuse"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"GlusterFS is not installed ({', '.join(missing)} missing: apt-get install glusterfs-server glusterfs-client)"
    return None


def _run(*argv: str, timeout: float = 60) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise GlusterUnavailable(
            f"{' '.join(argv)} failed ({result.returncode}): {result.stderr or result.stdout}"
        )
    return result.stdout


def _in_ns(ns: str, *argv: str, timeout: float = 60) -> str:
    return _run("nsenter", f"--net=/run/netns/{ns}", *argv, timeout=timeout)


@dataclass
class Gluster:
    """The running volume; ``mounts[0]`` is node 1's FUSE mount, ``mounts[1]`` node 2's."""

    volume: str
    work: Path
    mounts: tuple[Path, Path]
    _cleanups: list[tuple[str, object]] = field(default_factory=list)

    def gluster(self, *args: str, timeout: float = 60) -> str:
        return _run("gluster", "--mode=script", *args, timeout=timeout)

    def set_option(self, name: str, value: str) -> None:
        self.gluster("volume", "set", self.volume, name, value)

    def brick_pid(self) -> int:
        """The brick process (``glusterfsd``) serving the volume."""
        status = ElementTree.fromstring(self.gluster("volume", "status", self.volume, "--xml"))
        pid = status.findtext(".//node/pid")
        assert pid is not None and int(pid) > 0, "the brick is not running"
        return int(pid)

    def cut(self, node: int) -> None:
        """Node ``node`` (0 or 1) loses the network: its veth goes down on the server's side."""
        _in_ns(SERVER_NS, "ip", "link", "set", f"ocg-s{node + 1}", "down")

    def restore(self, node: int) -> None:
        _in_ns(SERVER_NS, "ip", "link", "set", f"ocg-s{node + 1}", "up")

    def wait_connected(self, clients: int = 2, timeout: float = 60) -> None:
        """Until the brick has ``clients`` clients connected (after a restore, a client reconnects within
        a few seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.gluster("volume", "status", self.volume, "clients")
            if f"Clients connected : {clients}" in out:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the brick does not see {clients} clients: {out}")
            time.sleep(0.5)


def _networks() -> None:
    for ns in (SERVER_NS, *NODE_NS):
        _run("ip", "netns", "add", ns)
    _in_ns(SERVER_NS, "ip", "link", "set", "lo", "up")
    _in_ns(SERVER_NS, "ip", "addr", "add", f"{BRICK_ADDRESS}/32", "dev", "lo")
    for number, ns in enumerate(NODE_NS, start=1):
        server_end, node_end = f"ocg-s{number}", f"ocg-n{number}v"
        _in_ns(SERVER_NS, "ip", "link", "add", server_end, "type", "veth", "peer", "name", node_end)
        _in_ns(SERVER_NS, "ip", "link", "set", node_end, "netns", ns)
        _in_ns(SERVER_NS, "ip", "addr", "add", f"10.77.{number}.1/24", "dev", server_end)
        _in_ns(SERVER_NS, "ip", "link", "set", server_end, "up")
        _in_ns(ns, "ip", "link", "set", "lo", "up")
        _in_ns(ns, "ip", "addr", "add", f"10.77.{number}.2/24", "dev", node_end)
        _in_ns(ns, "ip", "link", "set", node_end, "up")
        _in_ns(ns, "ip", "route", "add", f"{BRICK_ADDRESS}/32", "via", f"10.77.{number}.1")


def _hosts_entry() -> bool:
    """Name the brick's address in /etc/hosts; True when the line was added here (and is removed after)."""
    hosts = Path("/etc/hosts")
    text = hosts.read_text()
    if any(line.split()[1:2] == [BRICK_HOST] for line in text.splitlines() if line.strip()):
        return False
    with hosts.open("a") as handle:
        handle.write(("" if text.endswith("\n") or not text else "\n") + f"{BRICK_ADDRESS} {BRICK_HOST}\n")
    return True


def _drop_hosts_entry() -> None:
    hosts = Path("/etc/hosts")
    kept = [line for line in hosts.read_text().splitlines() if line.split()[1:2] != [BRICK_HOST]]
    hosts.write_text("\n".join(kept) + "\n")


def _glusterd(work: Path) -> int:
    state = work / "glusterd"
    state.mkdir()
    volfile = work / "glusterd.vol"
    volfile.write_text(
        "volume management\n"
        "    type mgmt/glusterd\n"
        f"    option working-directory {state}\n"
        "    option transport-type socket\n"
        "    option transport.socket.listen-port 24007\n"
        "    option ping-timeout 0\n"
        "    option event-threads 1\n"
        "end-volume\n"
    )
    pidfile = work / "glusterd.pid"
    _in_ns(SERVER_NS, "glusterd", "-f", str(volfile), "-p", str(pidfile), "-l", str(work / "glusterd.log"))
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(GlusterUnavailable):
            _run("gluster", "--mode=script", "pool", "list", timeout=10)
            return int(pidfile.read_text())
        if time.monotonic() > deadline:
            raise GlusterUnavailable(f"glusterd did not answer; see {work / 'glusterd.log'}")
        time.sleep(0.2)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def running_gluster(work: Path) -> Iterator[Gluster]:
    """Bring the volume and both mounts up; tear everything down after, whatever failed."""
    reason = unavailable()
    if reason is not None:
        raise GlusterUnavailable(reason)
    with _one_cluster_at_a_time():
        _clear_leftovers()
        with _cluster(work) as cluster:
            yield cluster


@contextlib.contextmanager
def _one_cluster_at_a_time() -> Iterator[None]:
    """Hold the machine's GlusterFS lock; wait (``LOCK_WAIT_S``) while another session's cluster is up."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise GlusterUnavailable(
                        f"another session's GlusterFS cluster has held {LOCK} for over {LOCK_WAIT_S} s"
                    ) from None
                time.sleep(1)
        yield
    finally:
        os.close(fd)


def _stale_mounts() -> list[str]:
    """This file's FUSE mounts still in the mount table (``/proc/mounts`` escapes a space as ``\\040``)."""
    found = []
    for line in Path("/proc/mounts").read_text().splitlines():
        source, target, fstype = line.split()[:3]
        if fstype == "fuse.glusterfs" and source.startswith(f"{BRICK_HOST}:ocg"):
            found.append(target.encode().decode("unicode_escape"))
    return found


def _leftover_daemons() -> list[int]:
    """This file's GlusterFS processes: ``glusterd``, the brick and the clients, each started in one of the
    namespaces above (a killed session's may be in namespaces already deleted) or naming the brick's host."""
    own_net = os.readlink("/proc/self/ns/net")
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if (proc / "comm").read_text().strip() not in ("glusterd", "glusterfsd", "glusterfs"):
                continue
            names_brick = BRICK_HOST.encode() in (proc / "cmdline").read_bytes()
            if names_brick or os.readlink(proc / "ns" / "net") != own_net:
                found.append(int(proc.name))
    return found


def _clear_leftovers() -> None:
    """Clear what a killed session left: only called under the lock, so none of it belongs to a live one."""
    for target in _stale_mounts():
        subprocess.run(["umount", "-l", target], capture_output=True, check=False, timeout=30)
    for pid in _leftover_daemons():
        _kill(pid)
    for ns in (SERVER_NS, *NODE_NS):
        if Path("/run/netns", ns).exists():
            _run("ip", "netns", "del", ns)


@contextlib.contextmanager
def _cluster(work: Path) -> Iterator[Gluster]:
    volume = f"ocg{uuid.uuid4().hex[:8]}"
    mounts = (work / "node1", work / "node2")
    pids: list[int] = []
    mounted: list[Path] = []
    added_host = False
    try:
        _networks()
        added_host = _hosts_entry()
        pids.append(_glusterd(work))
        brick = work / "brick"
        brick.mkdir()
        cluster = Gluster(volume, work, mounts)
        cluster.gluster("volume", "create", volume, f"{BRICK_HOST}:{brick}", "force")
        for name, value in STRICT_OPTIONS.items():
            cluster.set_option(name, value)
        cluster.gluster("volume", "start", volume)
        pids.append(cluster.brick_pid())
        for number, (ns, mount) in enumerate(zip(NODE_NS, mounts, strict=True), start=1):
            mount.mkdir()
            pidfile = work / f"client{number}.pid"
            _in_ns(
                ns,
                "glusterfs",
                f"--volfile-server={BRICK_HOST}",
                f"--volfile-id={volume}",
                *FUSE_OPTIONS,
                f"--pid-file={pidfile}",
                f"--log-file={work / f'client{number}.log'}",
                str(mount),
            )
            mounted.append(mount)
            pids.append(int(pidfile.read_text()))
            if not os.path.ismount(mount):
                raise GlusterUnavailable(f"the FUSE mount {mount} did not come up; see client{number}.log")
        cluster.wait_connected(2)
        yield cluster
    finally:
        for mount in reversed(mounted):
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False, timeout=30)
        if pids:
            subprocess.run(
                ["gluster", "--mode=script", "volume", "stop", volume, "force"],
                capture_output=True,
                check=False,
                timeout=60,
            )
        for pid in reversed(pids):
            _kill(pid)
        for ns in (SERVER_NS, *NODE_NS):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False, timeout=30)
        if added_host:
            _drop_hosts_entry()
