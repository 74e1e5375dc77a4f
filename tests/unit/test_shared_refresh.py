"""The batch's shared journal refresh (``_store.append.SharedRefresh``): one ``lstat`` serves the stripes
held while it runs, and never a caller that came after it began (contract L4)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, cast

import pytest

from otel_capture._store.append import SharedRefresh
from otel_capture._store.dirstate import DirState


class _Journal:
    """Counts refreshes; the first one waits for ``release`` (so callers arrive while it runs)."""

    def __init__(self, error: OSError | None = None) -> None:
        self.begun = 0
        self.started = threading.Event()
        self.release = threading.Event()
        self.error = error

    def refresh(self, state_fd: int | None = None) -> None:
        self.begun += 1
        if self.begun == 1:
            self.started.set()
            assert self.release.wait(30)
        if self.error is not None:
            raise self.error


def _shared(tmp_path: Path, journal: _Journal) -> tuple[SharedRefresh, Any]:
    state = DirState(tmp_path)
    state.journal = cast(Any, journal)
    dirs = state.dirs()
    return SharedRefresh(state, dirs), dirs


def _waiting(shared: SharedRefresh, count: int) -> None:
    # Until ``count`` callers wait for the refresh under way (the Condition's waiters: CPython's own list).
    while len(shared._changed._waiters) < count:  # type: ignore[attr-defined]  # CPython's Condition
        threading.Event().wait(0.001)


def test_callers_that_arrive_during_a_refresh_share_the_next_one_not_that_one(tmp_path: Path) -> None:
    journal = _Journal()
    shared, dirs = _shared(tmp_path, journal)
    first = threading.Thread(target=shared)
    first.start()
    assert journal.started.wait(30)
    seen: list[int] = []
    later = [threading.Thread(target=lambda: (shared(), seen.append(journal.begun))) for _ in range(5)]
    for thread in later:
        thread.start()
    _waiting(shared, 5)
    journal.release.set()
    for thread in (first, *later):
        thread.join(30)
    dirs.close()
    assert journal.begun == 2  # the one under way, then one for all five
    assert seen == [2] * 5  # none was served by the refresh that began before it called


def test_a_lone_caller_refreshes_each_time(tmp_path: Path) -> None:
    journal = _Journal()
    journal.release.set()
    shared, dirs = _shared(tmp_path, journal)
    for _ in range(3):
        shared()
    dirs.close()
    assert journal.begun == 3


def test_the_refresh_error_reaches_every_caller_that_shared_it(tmp_path: Path) -> None:
    journal = _Journal(OSError(77, "the journal is gone"))
    shared, dirs = _shared(tmp_path, journal)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            shared()
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    threads[0].start()
    assert journal.started.wait(30)
    for thread in threads[1:]:
        thread.start()
    _waiting(shared, 3)
    journal.release.set()
    for thread in threads:
        thread.join(30)
    dirs.close()
    assert journal.begun == 2
    assert len(errors) == 4 and all(exc.errno == 77 for exc in errors)


def test_the_first_refresh_error_is_raised_to_its_own_caller(tmp_path: Path) -> None:
    journal = _Journal(OSError(5, "EIO"))
    journal.release.set()
    shared, dirs = _shared(tmp_path, journal)
    with pytest.raises(OSError, match="EIO"):
        shared()
    dirs.close()
