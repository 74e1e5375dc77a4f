"""A writer batch's per-file work: each stripe's rollouts appended under one hold of the stripe
(:func:`.append.fenced_append_stripe`), one stripe after another on a local filesystem, concurrently on a
network or FUSE filesystem.

Why concurrently there: each call of an append (the stripe's ``flock``, the journal's ``lstat``, the data
file's ``flock``, ``lstat``, ``write``, unlock, its ``fsync``) is a round trip to a server, so a batch over
hundreds of rollouts cost the sum of their trains; run by a bounded pool, it costs about its slowest
stripe. Each rollout is still written by one thread, under its stripe and its data file's own lock, its
lines in the order they were queued (contract D7, D8, L4); a stripe whose lock or a file whose lock is
stuck holds only that stripe's worker. On a network filesystem a worker also ``fsync``\\ s its stripe's
files once it let the stripe go (each file's only sync) (contract D4); nothing is acknowledged before every
worker of the batch is done (contract D3). The journal's ``lstat`` after each stripe is taken is shared by
the stripes held at once (:class:`.append.SharedRefresh`): one round trip a wave, not one a stripe. On a local disk the work is CPU and one ``syncfs`` covers the
batch: threads would only add switches, so it stays on the writer thread, and the journal's ``lstat`` is
shared there too, by the stripes it can take at once (:func:`.append.fenced_append_wave`).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

from .append import AppendJob, AppendOutcome, SharedRefresh, fenced_append_stripe, fenced_append_wave
from .dirstate import DirState
from .fs import AppendFiles, DirFds
from .locks import LockFiles
from .sync import Fsync

POOL_THREADS = 32
"""Stripes written at once on a network filesystem (a batch has at most 64: one per stripe)."""
POOL_THREAD_NAME = "otel-capture-io"


@dataclass
class StripeResult:
    """What one stripe's worker did: each job's outcome or error and, when ``synced``, whether its files'
    ``fsync``\\ s all succeeded (the first error) and how many there were."""

    jobs: list[AppendJob]
    results: list[AppendOutcome | OSError]
    synced: bool = False
    sync_error: OSError | None = None
    fsyncs: int = 0


class BatchIO:
    """Runs a batch's stripes: inline, or on a pool of :data:`POOL_THREADS` threads when ``pooled`` (the
    capture directory is on a network or FUSE filesystem: :attr:`.fstype.SyncChoice.shared`)."""

    def __init__(self, pooled: bool, fsync: Fsync, threads: int = POOL_THREADS) -> None:
        self._fsync = fsync
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=POOL_THREAD_NAME)
            if pooled
            else None
        )

    @property
    def pooled(self) -> bool:
        return self._pool is not None

    def run(
        self,
        state: DirState,
        dirs: DirFds,
        stripes: dict[int, list[AppendJob]],
        *,
        file_mode: int,
        files: AppendFiles,
        lock_files: LockFiles,
    ) -> list[StripeResult]:
        """Every stripe's jobs, in the order given. Waits for every worker before returning or raising (a
        worker's bug is raised here, after the others are done: none outlives the batch)."""
        if self._pool is None or len(stripes) < 2:
            waves = fenced_append_wave(
                state, dirs, stripes, file_mode=file_mode, files=files, lock_files=lock_files
            )
            return [StripeResult(jobs, results) for jobs, results in waves]
        refresh = SharedRefresh(state, dirs)  # the journal's lstat, shared by the stripes held at once
        futures = [
            self._pool.submit(self._stripe, state, dirs, stripe, jobs, file_mode, files, lock_files, refresh)
            for stripe, jobs in stripes.items()
        ]
        concurrent.futures.wait(futures)
        return [future.result() for future in futures]

    def _stripe(
        self,
        state: DirState,
        dirs: DirFds,
        stripe: int,
        jobs: list[AppendJob],
        file_mode: int,
        files: AppendFiles,
        lock_files: LockFiles,
        refresh: SharedRefresh,
    ) -> StripeResult:
        results = fenced_append_stripe(
            state,
            dirs,
            stripe,
            jobs,
            file_mode=file_mode,
            files=files,
            lock_files=lock_files,
            refresh=refresh,
        )
        done = StripeResult(jobs, results, synced=True)
        for result in results:  # the stripe is free again: its files are synced outside it
            if isinstance(result, OSError):
                continue
            for fd in result.fds:
                try:
                    self._fsync(fd)  # the only sync that reaches the server (contract D4)
                except OSError as exc:
                    done.sync_error = done.sync_error or exc
                done.fsyncs += 1
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
