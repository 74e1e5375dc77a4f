"""``model_call_jsonl``: the span exporter that writes each model call as one NeMo Gym ``ModelCallRecord``
line in ``<dir>/<rollout_id>.capture.jsonl``.

Registered in the entry-point group ``opentelemetry_traces_exporter``, so
``OTEL_TRACES_EXPORTER=otlp,model_call_jsonl OTEL_EXPORTER_MODEL_CALL_JSONL_DIR=/data/calls`` selects it.

Records do not ride on spans: the capture middleware built on this exporter's tracer provider is bound to
the exporter (it is a ``CallSink``) and hands it every finished call's line itself, whatever processor
wraps the exporter; ``export()`` has nothing left to do. See ``docs/architecture.md``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_capture import WriterSettings
from otel_capture._capture import FinishedCall
from otel_capture._store import LIBC_SYNCFS, DeclaredVersions, JsonlWriter, WriterStats

_logger = logging.getLogger(__name__)


class ModelCallJsonlExporter(SpanExporter):
    """Writes model-call records durably (``flock`` + ``write`` + ``fsync``, group commit).

    ``directory`` (or ``settings.directory``) defaults to ``OTEL_EXPORTER_MODEL_CALL_JSONL_DIR``; settings
    passed in code win over the environment. Without a directory the exporter logs one error and writes
    nothing (it never raises, so a misconfigured exporter cannot break the host app's telemetry set-up).
    ``fsync`` and ``syncfs`` are seams for tests that instrument or break the disk.
    """

    # export() does nothing with spans: on a provider whose other processors ignore spans too, the capture
    # middleware builds only each span's context, not the span (otel_capture._telemetry.spans)
    ignores_spans = True

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        settings: WriterSettings | None = None,
        fsync: Callable[[int], None] = os.fsync,
        syncfs: Callable[[int], None] | None = LIBC_SYNCFS,
    ) -> None:
        if settings is None:
            settings = WriterSettings.from_environ(directory=directory)
        elif directory is not None:
            raise TypeError("pass the directory either as `directory` or in `settings`, not both")
        self.settings = settings
        self._writer: JsonlWriter | None = None
        self._shutdown = False
        if settings.directory is None:
            _logger.error(
                "model_call_jsonl exporter has no directory: set OTEL_EXPORTER_MODEL_CALL_JSONL_DIR; "
                "no model-call records will be written"
            )
            return
        self._writer = JsonlWriter(
            settings.directory,
            fsync=fsync,
            syncfs=syncfs if settings.sync == "auto" else None,
            allow_shared_directory=settings.allow_shared_directory,
            lock_timeout_s=settings.lock_timeout_s,
        )

    @property
    def directory(self) -> str | None:
        return str(self._writer.root) if self._writer else None

    @property
    def weight_versions(self) -> DeclaredVersions | None:
        """The directory's declared weight versions as the writer last read them (no I/O): what the
        middleware puts on a call's span."""
        return self._writer.weights if self._writer else None

    @property
    def stats(self) -> WriterStats:
        return self._writer.stats if self._writer else WriterStats()

    # -- CallSink: the capture middleware's route for records ---------------------------------------------

    def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """A captured call has started: a freeze before its record lands reports the rollout incomplete."""
        if self._writer is not None:  # after shutdown the writer itself keeps no call in flight
            self._writer.begin(rollout_id, model_call_id)

    def write_call(self, call: FinishedCall) -> None:
        """Queue one call's line; its waiter is resolved once the line is durable (or failed)."""
        if self._writer is None:
            call.waiter.loop.call_soon_threadsafe(
                _fail, call.waiter.future, RuntimeError("model_call_jsonl exporter has no directory")
            )
            return
        self._writer.submit(
            call.rollout_id,
            call.line,
            call.model_call_id,
            call.tokens_line,
            waiter=call.waiter,
            weight=call.weight,
        )

    def abandon_call(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """A begun call whose record could not be built: counted, logged, its rollout marked incomplete,
        after shutdown too: the closed writer counts and marks it as it does a late line (contract D12)."""
        if self._writer is not None:
            self._writer.abandon(rollout_id, model_call_id, reason)

    def discard_call(self, rollout_id: str, model_call_id: str) -> None:
        """A begun call that was not a model call (a redirect): it ends with no line and no incomplete
        mark, and a freeze no longer reports it in flight."""
        if self._writer is not None and not self._shutdown:
            self._writer.discard(rollout_id, model_call_id)

    # -- SpanExporter -------------------------------------------------------------------------------------

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Nothing to do per span: records reach the writer through :meth:`write_call`. Never raises."""
        if self._shutdown or self._writer is None:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """True once every record handed to this exporter before the call is on disk and fsynced, or
        has failed and been marked incomplete (contract D3, D5); False if that did not happen within the
        timeout."""
        if self._writer is None:
            return True
        return self._writer.flush(timeout_millis / 1000)

    def shutdown(self) -> None:
        """Write out what is queued and stop. Idempotent."""
        if self._shutdown:
            return
        self._shutdown = True
        if self._writer is not None:
            self._writer.close()


def _fail(future: asyncio.Future[None], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
