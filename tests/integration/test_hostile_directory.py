"""A hostile or damaged capture directory (issue 15, items 1-3): links, hard links, FIFOs and dangling
links planted wherever the store reads or writes; a directory others can write.

Nothing outside the capture directory is ever written, moved or deleted; no call, process or CLI command
hangs; a rollout whose file was damaged says why it is incomplete; the response is untouched. Store
operations that could hang run in a child process with a generous bound, so a hang fails the test (and
is killed) instead of stalling the run.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import ReplayModelServer, recorded_json, serve, start_cli_proxy, submit

from otel_capture import CaptureStore, read_available_model_call_records

BOUND = 60  # seconds: only to prove "does not hang"
PRECIOUS = b"precious bytes that belong to someone else\n"
CLI = [sys.executable, "-m", "otel_capture._cli.main"]


def _tree(directory: Path) -> dict[str, bytes | str]:
    """Every entry under ``directory`` (links not followed): file bytes, or what the entry is."""
    found: dict[str, bytes | str] = {}
    for path in sorted(directory.rglob("*")):
        mode = path.lstat().st_mode
        name = str(path.relative_to(directory))
        found[name] = path.read_bytes() if stat.S_ISREG(mode) else stat.filemode(mode)[0]
    return found


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory of someone else's files, beside the capture directory (same filesystem: hard links work)."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "notes.txt").write_bytes(PRECIOUS)
    (directory / "other.capture.jsonl").write_bytes(PRECIOUS)
    return directory


def _child(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a store script in its own process, bounded: a hang is a failure, and the child is killed."""
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), *args],
            capture_output=True,
            text=True,
            timeout=BOUND,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the store hung (killed after {BOUND} s): {exc.stderr!r}")


def _populate(root: Path) -> None:
    store = CaptureStore(root)
    store.append_now("r", "c0", {"dialect": "chat"}, {"prompt_token_ids": [1]})
    store.begin_call("r", "c-begun")  # the .otel-capture tree now exists, in-flight marker included
    store.mark_incomplete("r", "c-begun", "set-up")


# --- 1. the trash: removal never follows a link --------------------------------------------------------


@pytest.mark.parametrize("operation", ["cli retire", "cli delete", "retire_now", "drop_now"])
def test_a_trash_link_never_lets_a_removal_touch_the_directory_it_points_to(
    tmp_path: Path, outside: Path, operation: str
) -> None:
    root = tmp_path / "calls"
    _populate(root)
    trash = root / ".otel-capture" / "trash"
    if trash.exists():
        trash.rmdir()
    trash.symlink_to(outside, target_is_directory=True)
    before = _tree(outside)
    if operation.startswith("cli"):
        result = subprocess.run(
            [*CLI, operation.split()[1], str(root), "r"], capture_output=True, text=True, timeout=BOUND
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["removed", "r"]
    else:
        # In a child: the background purge of the trash has run when the process has exited.
        result = _child(
            """
            import sys
            from otel_capture import CaptureStore
            store = CaptureStore(sys.argv[1])
            if sys.argv[2] == "drop_now":
                snap = store.freeze_now("r")
                assert store.drop_now("r", snapshot_id=snap.snapshot_id, version=snap.version)
            else:
                assert store.retire_now(["r"])["removed"] == ["r"]
            store.purge_trash()
            """,
            str(root),
            operation,
        )
        assert result.returncode == 0, result.stderr
    assert _tree(outside) == before  # nothing moved in, nothing deleted
    assert sorted(p.name for p in root.iterdir()) == [".otel-capture"]  # the records are gone all the same


# --- 1 and 2. a planted entry is never written through, and never hangs ----------------------------------

# Every place the store writes: what to plant there, and what must hold afterwards.
PLANTS = {
    "data file symlink": ("r.capture.jsonl", "symlink"),
    "data file hard link": ("r.capture.jsonl", "hardlink"),
    "data file dangling link": ("r.capture.jsonl", "dangling"),
    "token file symlink": ("r.tokens.jsonl", "symlink"),
    "token file hard link": ("r.tokens.jsonl", "hardlink"),
    "incomplete marker symlink": ("r.capture.incomplete", "symlink"),
    "incomplete marker hard link": ("r.capture.incomplete", "hardlink"),
    "fence journal symlink": (".otel-capture/fences.journal", "symlink"),
    "fence journal hard link": (".otel-capture/fences.journal", "hardlink"),
    "in-flight marker symlink": (".otel-capture/inflight/r.calls", "symlink"),
    "in-flight marker hard link": (".otel-capture/inflight/r.calls", "hardlink"),
    "lock file dangling link": (f".otel-capture/locks/{zlib.crc32(b'r') % 64:02d}.lock", "dangling"),
    "journal lock dangling link": (".otel-capture/journal.lock", "dangling"),
    "state directory link": (".otel-capture", "dirlink"),
    "locks directory link": (".otel-capture/locks", "dirlink"),
    "in-flight directory link": (".otel-capture/inflight", "dirlink"),
}

# Everything the store and the writer do to a rollout, each step's outcome printed as one JSON line.
EXERCISE = """
    import asyncio, json, os, sys
    from otel_capture import CaptureStore
    from otel_capture._capture.sink import LoopWaiter
    from otel_capture._store import JsonlWriter

    store = CaptureStore(sys.argv[1])
    outcomes = {}

    def outside():
        found = {}
        for folder, dirs, files in os.walk(sys.argv[2]):
            for name in dirs + files:
                path = os.path.join(folder, name)
                found[path] = open(path, "rb").read() if os.path.isfile(path) else "dir"
        return found

    before = outside()

    def step(name, fn):
        try:
            fn()
            outcomes[name] = "ok"
        except Exception as exc:
            outcomes[name] = f"{type(exc).__name__}: {exc}"
        if outside() != before:  # checked after every step: a later step may undo an earlier write
            outcomes.setdefault("outside changed by", name)

    writer = JsonlWriter(sys.argv[1])
    step("writer.begin", lambda: (writer.begin("r", "c1"), writer.flush(60)))
    line = json.dumps({"model_call_id": "c1", "dialect": "chat", "pad": "x" * 100_000}).encode() + b"\\n"
    tokens = b'{"model_call_id": "c1", "prompt_token_ids": [1]}\\n'
    def submit_and_wait():
        async def call():
            loop = asyncio.get_running_loop()
            waiter = LoopWaiter(loop, loop.create_future())
            writer.submit("r", line, "c1", tokens, waiter)
            await asyncio.wait_for(waiter.future, 60)

        asyncio.run(call())

    step("writer", submit_and_wait)
    writer.close(60)
    marker = os.path.join(sys.argv[1], "r.capture.incomplete")
    outcomes["marker"] = open(marker).read() if os.path.isfile(marker) else None
    step("begin_call", lambda: store.begin_call("r", "c2"))
    step("append_now", lambda: store.append_now("r", "c3", {"dialect": "chat"}, {"prompt_token_ids": [2]}))
    step("mark_incomplete", lambda: store.mark_incomplete("r", "c4", "the agent gave up"))
    step("freeze_now", lambda: store.freeze_now("r"))
    step("retire_now", lambda: store.retire_now(["r"]))
    step("delete_now", lambda: store.delete_now(["r"]))
    step("purge_trash", store.purge_trash)
    print(json.dumps(outcomes))
"""


def _plant(root: Path, outside: Path, relative: str, kind: str) -> Path:
    entry = root / relative
    if entry.is_dir() and not entry.is_symlink():
        import shutil

        shutil.rmtree(entry)
    elif entry.exists() or entry.is_symlink():
        entry.unlink()
    entry.parent.mkdir(parents=True, exist_ok=True)
    target = outside / "notes.txt"
    if kind == "symlink":
        entry.symlink_to(target)
    elif kind == "hardlink":
        os.link(target, entry)
    elif kind == "dangling":
        target = outside / "created-through-a-link"
        entry.symlink_to(target)
    else:
        target = outside
        entry.symlink_to(outside, target_is_directory=True)
    return target


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_entry_is_never_written_through_and_never_hangs(
    tmp_path: Path, outside: Path, plant: str
) -> None:
    root = tmp_path / "calls"
    _populate(root)
    relative, kind = PLANTS[plant]
    _plant(root, outside, relative, kind)
    before = _tree(outside)
    result = _child(EXERCISE, str(root), str(outside))
    assert result.returncode == 0, result.stderr
    outcomes = json.loads(result.stdout)
    assert "outside changed by" not in outcomes, outcomes
    assert _tree(outside) == before, f"{plant}: something outside the capture directory changed"
    if relative.endswith(".incomplete"):
        assert outcomes["mark_incomplete"].startswith("DamagedEntryError"), outcomes
    elif relative.endswith("journal.lock"):  # only the lifecycle operations take it
        assert outcomes["retire_now"].startswith(f"DamagedEntryError: {relative}: a symbolic link"), outcomes
    else:
        # The rollout's capture fails (or its call is marked), visibly, with the entry named in the reason:
        # also when the damaged entry is the journal or a lock, which the marker is then written without.
        marker = outcomes["marker"]
        assert marker is not None and f"{relative}: a " in marker, outcomes
        assert "not a regular file" in marker or "not a directory" in marker or "hard links" in marker, marker
    if relative.startswith("r.") and not relative.endswith(".incomplete"):
        assert outcomes["writer"].startswith("DamagedEntryError"), outcomes


def test_a_planted_incomplete_marker_link_is_refused_with_a_clear_error(
    tmp_path: Path, outside: Path
) -> None:
    root = tmp_path / "calls"
    _populate(root)
    _plant(root, outside, "r.capture.incomplete", "symlink")
    with pytest.raises(OSError, match=r"r\.capture\.incomplete.*symbolic link"):
        CaptureStore(root).mark_incomplete("r", "c9", "why")
    assert (outside / "notes.txt").read_bytes() == PRECIOUS


@pytest.fixture
def upstream() -> Iterator[str]:
    with serve(ReplayModelServer()) as url:
        yield url


def test_a_dangling_data_link_or_a_fifo_never_hangs_the_proxy(
    tmp_path: Path, outside: Path, upstream: str
) -> None:
    """Before: the writer looped between ENOENT and EEXIST at full CPU forever on the dangling link, and a
    line longer than a pipe blocked forever in the FIFO; every later call hung and SIGTERM did nothing."""
    root = tmp_path / "calls"
    root.mkdir(mode=0o700)
    (root / "dangling.capture.jsonl").symlink_to(outside / "created-through-a-link")
    os.mkfifo(root / "fifo.capture.jsonl", 0o600)
    before = _tree(outside)
    process, url = start_cli_proxy(upstream, "--capture-dir", str(root))
    try:
        big = {"model": "m", "pad": "x" * 200_000}  # its record line is longer than a pipe's buffer
        for rid, body in (("dangling", {"model": "m"}), ("fifo", big), ("good", {"model": "m"})):
            response = httpx.post(f"{url}/ng-rollout/{rid}/v1/chat/completions", json=body, timeout=BOUND)
            assert response.status_code == 200 and response.content == recorded_json("chat"), rid
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=BOUND)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            pytest.fail("SIGTERM did not stop the proxy")
    assert process.returncode == 0
    assert _tree(outside) == before
    store = CaptureStore(root)
    assert len(read_available_model_call_records(store, "good").records) == 1
    for rid, what in (("dangling", "symbolic link"), ("fifo", "FIFO")):
        marker = store.incomplete_path(rid).read_text()
        assert f"{rid}.capture.jsonl" in marker and what in marker, marker
    assert stat.S_ISFIFO((root / "fifo.capture.jsonl").lstat().st_mode)  # left as found, for the operator


def test_check_show_and_freeze_skip_what_is_not_a_regular_file(tmp_path: Path) -> None:
    root = tmp_path / "calls"
    CaptureStore(root).append_now("good", "c1", {"model_call_id": "c1"})
    os.mkfifo(root / "fifo.capture.jsonl", 0o600)
    os.mkfifo(root / "fifo.tokens.jsonl", 0o600)
    (root / "loop.capture.jsonl").symlink_to(root / "loop.capture.jsonl")
    check = subprocess.run([*CLI, "check", str(root)], capture_output=True, text=True, timeout=BOUND)
    assert check.returncode == 1, check.stdout
    assert "fifo: fifo.capture.jsonl: a FIFO, not a regular file: skipped" in check.stdout
    assert "loop: loop.capture.jsonl: a symbolic link, not a regular file: skipped" in check.stdout
    assert "good:" not in check.stdout
    show = subprocess.run([*CLI, "show", str(root)], capture_output=True, text=True, timeout=BOUND)
    assert show.returncode == 0 and "good" in show.stdout and "fifo" not in show.stdout, show.stdout
    result = _child(
        """
        import sys
        from otel_capture import CaptureStore, read_model_call_records
        store = CaptureStore(sys.argv[1])
        assert read_model_call_records(store, "fifo") == []
        snap = store.freeze_now("fifo")
        print(snap.incomplete, *sorted(c.reason for c in snap.incomplete_calls), sep="\\n")
        """,
        str(root),
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "True"
    assert lines[1:] == [
        "fifo.capture.jsonl: a FIFO, not a regular file: not read",
        "fifo.tokens.jsonl: a FIFO, not a regular file: not read",
    ]


# --- 2. the durability wait has a deadline ----------------------------------------------------------------


def test_a_durability_wait_past_its_deadline_answers_the_call_and_marks_its_capture_failed(
    tmp_path: Path, upstream: str
) -> None:
    import threading

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from otel_capture import CaptureSettings, start_proxy
    from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

    disk_back = threading.Event()

    def stalled_fsync(fd: int) -> None:  # a disk (or an NFS server) that stops answering
        disk_back.wait(BOUND)
        os.fsync(fd)

    exporter = ModelCallJsonlExporter(tmp_path / "calls", fsync=stalled_fsync, syncfs=None)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        with start_proxy(
            upstream, settings=CaptureSettings(durable_timeout_s=0.5), tracer_provider=provider
        ) as proxy:
            response = httpx.post(
                f"{proxy.url}/ng-rollout/slow/v1/responses", json={"model": "m"}, timeout=BOUND
            )
            assert response.status_code == 200 and response.content == recorded_json("responses")
            disk_back.set()
            assert exporter.force_flush()
    finally:
        disk_back.set()
        provider.shutdown()
    marker = CaptureStore(tmp_path / "calls").incomplete_path("slow").read_text()
    assert "not durable within 0.5 s" in marker


# --- 3. the directory is checked ---------------------------------------------------------------------------


def _make_shared(root: Path, how: str) -> None:
    root.mkdir(mode=0o700)
    if how == "world-writable":
        root.chmod(0o777)
    else:
        os.chown(root, 65534, 65534)  # the tests run as root, as CI does


@pytest.mark.parametrize("how", ["world-writable", "owned by another user"])
def test_a_directory_others_can_write_is_refused_unless_opted_in(tmp_path: Path, how: str) -> None:
    from otel_capture import UnsafeDirectoryError
    from otel_capture._store import JsonlWriter

    root = tmp_path / "calls"
    _make_shared(root, how)
    reason = "world-writable" if how == "world-writable" else "owned by uid 65534"
    with pytest.raises(UnsafeDirectoryError, match=reason):
        CaptureStore(root, allow_shared_directory=False).retire_now(["r"])
    with pytest.raises(UnsafeDirectoryError, match=reason):
        JsonlWriter(root)
    assert list(root.iterdir()) == []  # refused before anything was written
    env = {k: v for k, v in os.environ.items() if k != "OTEL_CAPTURE_ALLOW_SHARED_DIR"}
    retire = subprocess.run(
        [*CLI, "retire", str(root), "r"], capture_output=True, text=True, timeout=BOUND, env=env
    )
    assert retire.returncode == 1 and len(retire.stderr.splitlines()) == 1 and reason in retire.stderr, (
        retire.stderr
    )
    proxy = subprocess.run(
        [*CLI, "proxy", "--upstream", "http://127.0.0.1:9", "--capture-dir", str(root)],
        capture_output=True,
        text=True,
        timeout=BOUND,
        env=env,
    )
    assert proxy.returncode == 1 and proxy.stdout == "", proxy.stdout  # never listened
    assert len(proxy.stderr.splitlines()) == 1 and reason in proxy.stderr, proxy.stderr
    assert list(root.iterdir()) == []
    # The explicit opt-in, in code and in the environment.
    assert CaptureStore(root, allow_shared_directory=True).retire_now(["r"])["absent"] == ["r"]
    opted = subprocess.run(
        [*CLI, "retire", str(root), "s"],
        capture_output=True,
        text=True,
        timeout=BOUND,
        env={**env, "OTEL_CAPTURE_ALLOW_SHARED_DIR": "1"},
    )
    assert opted.returncode == 0, opted.stderr
    JsonlWriter(root, allow_shared_directory=True).close()


def test_data_files_are_kept_0600_even_when_they_existed_with_wider_modes(tmp_path: Path) -> None:
    from otel_capture._store import JsonlWriter

    root = tmp_path / "calls"
    root.mkdir(mode=0o700)
    for name, mode in (
        ("r.capture.jsonl", 0o644),
        ("r.tokens.jsonl", 0o666),
        ("r.capture.incomplete", 0o604),
    ):
        (root / name).write_bytes(b"")
        (root / name).chmod(mode)
    writer = JsonlWriter(root)
    submit(writer, "r", b'{"model_call_id":"c1"}\n', "c1", b'{"model_call_id":"c1"}\n').result(BOUND)
    writer.close(BOUND)
    CaptureStore(root).mark_incomplete("r", "c2", "why")
    for name in ("r.capture.jsonl", "r.tokens.jsonl", "r.capture.incomplete"):
        assert stat.S_IMODE((root / name).stat().st_mode) == 0o600, name


def test_a_directory_made_world_writable_under_a_running_writer_stops_capture_there(tmp_path: Path) -> None:
    from otel_capture import UnsafeDirectoryError
    from otel_capture._store import JsonlWriter

    root = tmp_path / "calls"
    root.mkdir(mode=0o700)
    writer = JsonlWriter(root)
    try:
        submit(writer, "r", b'{"model_call_id":"c1"}\n', "c1").result(BOUND)
        assert writer.flush(BOUND)  # the state made ahead of need, after that first batch, is in place
        before = _tree(root)
        root.chmod(0o777)
        with pytest.raises(UnsafeDirectoryError, match="world-writable"):
            submit(writer, "r", b'{"model_call_id":"c2"}\n', "c2").result(BOUND)
        assert _tree(root) == before  # not even an incomplete marker is written there
        assert writer.stats.failures == 1
    finally:
        writer.close(BOUND)


@pytest.mark.parametrize("change", ["symlink", "hardlink", "renamed", "widened"])
def test_a_data_file_changed_under_a_running_writer_is_never_written_through(
    tmp_path: Path, outside: Path, change: str
) -> None:
    """The writer keeps a data file open from one batch to the next: whatever replaced it meanwhile (a
    link planted in its place, a hard link made to it, a retire's rename, a wider mode) is seen at the next
    batch, as at a first open."""
    from otel_capture import DamagedEntryError
    from otel_capture._store import JsonlWriter

    root = tmp_path / "calls"
    root.mkdir(mode=0o700)
    data = root / "r.capture.jsonl"
    writer = JsonlWriter(root)
    try:
        submit(writer, "r", b'{"model_call_id":"c1"}\n', "c1").result(BOUND)
        if change == "symlink":
            data.unlink()
            data.symlink_to(outside / "notes.txt")
        elif change == "hardlink":
            os.link(data, outside / "linked.capture.jsonl")
        elif change == "renamed":
            data.rename(root / "moved-away")
        else:
            data.chmod(0o644)
        before = _tree(outside)
        future = submit(writer, "r", b'{"model_call_id":"c2"}\n', "c2")
        if change in ("symlink", "hardlink"):
            with pytest.raises(DamagedEntryError):
                future.result(BOUND)
            assert _tree(outside) == before, "written through a file changed under the writer"
        else:
            future.result(BOUND)
        if change == "renamed":
            assert (root / "moved-away").read_bytes() == b'{"model_call_id":"c1"}\n'
            assert data.read_bytes() == b'{"model_call_id":"c2"}\n'
        if change == "widened":
            assert data.read_bytes() == b'{"model_call_id":"c1"}\n{"model_call_id":"c2"}\n'
            assert stat.S_IMODE(data.stat().st_mode) == 0o600
    finally:
        writer.close(BOUND)


def _lock_path(root: Path, rollout_id: str) -> Path:
    return root / ".otel-capture" / "locks" / f"{zlib.crc32(rollout_id.encode()) % 64:02d}.lock"


def _lock_fds(root: Path) -> list[str]:
    """This process's descriptors open on a stripe lock file of ``root``."""
    locks = str(root / ".otel-capture" / "locks") + "/"
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with_target = f"/proc/self/fd/{fd}"
        try:
            target = os.readlink(with_target)
        except OSError:
            continue
        if target.startswith(locks):
            found.append(target)
    return found


@pytest.mark.parametrize("target", ["existing", "dangling"])
def test_a_stripe_lock_file_replaced_by_a_link_under_a_running_writer_is_never_followed(
    tmp_path: Path, outside: Path, target: str
) -> None:
    """The writer keeps its stripe lock files open between batches: a link planted in place of one
    meanwhile is seen at the next batch (checked under the lock), as at a first open: nothing outside is
    locked, created or written, and the rollout says its lock file is damaged."""
    from otel_capture import DamagedEntryError
    from otel_capture._store import JsonlWriter

    root = tmp_path / "calls"
    root.mkdir(mode=0o700)
    writer = JsonlWriter(root)
    try:
        submit(writer, "r", b'{"model_call_id":"c1"}\n', "c1").result(BOUND)
        lock = _lock_path(root, "r")
        lock.unlink()
        lock.symlink_to(outside / ("notes.txt" if target == "existing" else "planted.lock"))
        before = _tree(outside)
        future = submit(writer, "r", b'{"model_call_id":"c2"}\n', "c2")
        with pytest.raises(DamagedEntryError, match=r"locks/\d\d\.lock"):
            future.result(BOUND)
        assert _tree(outside) == before, "a planted stripe lock link was followed"
        assert (root / "r.capture.jsonl").read_bytes() == b'{"model_call_id":"c1"}\n'
        assert "c2" in (root / "r.capture.incomplete").read_text()
        assert writer.stats.failures == 1
    finally:
        writer.close(BOUND)


HOLD_NEW_LOCK = """
    import fcntl, os, sys, time
    os.unlink(sys.argv[1])  # another inode takes the name
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    while True:
        time.sleep(60)
"""


def test_a_stripe_lock_file_replaced_by_another_file_is_the_one_locked(tmp_path: Path) -> None:
    """A stripe lock file replaced by another regular file (another inode) while the writer keeps the old
    one open: the writer locks the new one, as every process opening the name does. A process holding the
    new file's lock holds the writer off until the lock timeout; once it is gone, the rollout is written."""
    from otel_capture import LockTimeoutError
    from otel_capture._store import JsonlWriter

    root = tmp_path / "calls"
    root.mkdir(mode=0o700)
    writer = JsonlWriter(root, lock_timeout_s=0.5)
    try:
        submit(writer, "r", b'{"model_call_id":"c1"}\n', "c1").result(BOUND)
        lock = _lock_path(root, "r")
        with subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(HOLD_NEW_LOCK), str(lock)],
            stdout=subprocess.PIPE,
            text=True,
        ) as holder:
            try:
                assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
                future = submit(writer, "r", b'{"model_call_id":"c2"}\n', "c2")
                with pytest.raises(LockTimeoutError, match=r"locks/\d\d\.lock"):
                    future.result(BOUND)
            finally:
                holder.kill()
                holder.wait(BOUND)
        submit(writer, "r", b'{"model_call_id":"c3"}\n', "c3").result(BOUND)
        assert (root / "r.capture.jsonl").read_bytes() == b'{"model_call_id":"c1"}\n{"model_call_id":"c3"}\n'
    finally:
        writer.close(BOUND)


def test_the_writer_s_kept_stripe_lock_files_are_closed_when_it_stops(tmp_path: Path) -> None:
    """At most one kept descriptor per stripe while the writer runs; none once it is closed, and none left
    by the store's lifecycle operations (they open a lock file per hold)."""
    from otel_capture._store import JsonlWriter

    root = tmp_path / "calls"
    root.mkdir(mode=0o700)
    writer = JsonlWriter(root)
    try:
        for i in range(200):
            submit(writer, f"r{i}", b'{"model_call_id":"c1"}\n', "c1")
        assert writer.flush(BOUND)
        kept = _lock_fds(root)
        assert kept and len(kept) == len(set(kept)) <= 64
        store = CaptureStore(root)
        store.freeze_now("r1")
        store.retire_now(["r2"])
        store.mark_incomplete("r3", "c9", "why")
        assert _lock_fds(root) == kept
    finally:
        writer.close(BOUND)
    assert _lock_fds(root) == []


# --- the uncorrelated counts: the writer's checks and its no-follow I/O ---------------------------------


def test_a_directory_the_writer_refuses_gets_no_uncorrelated_count(tmp_path: Path) -> None:
    """A world-writable capture directory is refused by the writer; the count of calls served without a
    rollout id is not written there either (the same check), and saying so never raises."""
    from otel_capture import UnsafeDirectoryError
    from otel_capture._store import JsonlWriter, UncorrelatedCounter
    from otel_capture._store.names import UNCORRELATED_PREFIX as PREFIX

    root = tmp_path / "calls"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(UnsafeDirectoryError, match="world-writable"):
        JsonlWriter(root)
    counter = UncorrelatedCounter(root)
    counter.count("chat")
    counter.write()
    assert [p.name for p in root.iterdir() if p.name.startswith(PREFIX)] == []


def test_an_opted_in_shared_directory_gets_its_uncorrelated_count(tmp_path: Path) -> None:
    """Where the writer was told to use a shared directory, the count is written as before."""
    from otel_capture._store import JsonlWriter, UncorrelatedCounter, read_uncorrelated

    root = tmp_path / "calls"
    root.mkdir()
    root.chmod(0o777)
    JsonlWriter(root, allow_shared_directory=True).close(BOUND)
    counter = UncorrelatedCounter(root)
    counter.count("chat")
    counter.write()
    assert read_uncorrelated(root).calls == 1


@pytest.mark.parametrize("planted", ["temporary name", "counter name"])
def test_a_planted_link_never_lets_the_uncorrelated_count_write_outside(
    tmp_path: Path, outside: Path, planted: str
) -> None:
    """A link planted where the counter writes (its temporary name, or the file itself) is never written
    through: the file outside keeps its bytes, and the count is in the directory as a file of its own."""
    from otel_capture._store import UncorrelatedCounter, read_uncorrelated

    root = tmp_path / "calls"
    root.mkdir(mode=0o700)
    counter = UncorrelatedCounter(root)
    name = counter.path.name + ".tmp" if planted == "temporary name" else counter.path.name
    (root / name).symlink_to(outside / "notes.txt")
    before = _tree(outside)
    for _ in range(2):
        counter.count("chat")
        counter.write()
    assert _tree(outside) == before
    assert stat.S_ISREG(counter.path.lstat().st_mode)
    assert read_uncorrelated(root).calls == 2
