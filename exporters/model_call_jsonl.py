"""``model_call_jsonl``: the span exporter that writes each model-call span as one NeMo Gym
``ModelCallRecord`` line in ``<dir>/<rollout_id>.capture.jsonl``.

Registered in the entry-point group ``opentelemetry_traces_exporter``, so
``OTEL_TRACES_EXPORTER=otlp,model_call_jsonl OTEL_EXPORTER_MODEL_CALL_JSONL_DIR=/data/calls`` selects it.

The record's payloads (exact request and response bodies) do not ride on the span: the capture middleware
offers them through ``otel_capture._handoff`` keyed by span id, and this exporter claims them when the
span reaches ``export()``. The middleware waits for each line to be durable before it releases the
call's terminal chunk; see ``otel_capture._handoff`` for why and how.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_capture import _handoff
from otel_capture._settings import CaptureSettings
from otel_capture._store.writer import LIBC_SYNCFS, JsonlWriter, WriterStats

_logger = logging.getLogger(__name__)


class ModelCallJsonlExporter(SpanExporter):
    """Writes model-call records durably (``flock`` + ``write`` + ``fsync``, group commit).

    ``directory`` defaults to ``OTEL_EXPORTER_MODEL_CALL_JSONL_DIR``. Without a directory the exporter
    logs one error and exports nothing (it never raises, so a misconfigured exporter cannot break the
    host app's telemetry set-up).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        fsync: Callable[[int], None] = os.fsync,
        syncfs: Callable[[int], None] | None = LIBC_SYNCFS,
    ) -> None:
        settings = CaptureSettings.from_environ(capture_dir=directory)
        self._writer: JsonlWriter | None = None
        self._shutdown = False
        if settings.capture_dir is None:
            _logger.error(
                "model_call_jsonl exporter has no directory: set OTEL_EXPORTER_MODEL_CALL_JSONL_DIR; "
                "no model-call records will be written"
            )
            return
        # fsync and syncfs are seams for tests that instrument or break the disk
        self._writer = JsonlWriter(
            settings.capture_dir, fsync=fsync, syncfs=syncfs if settings.sync == "auto" else None
        )
        _handoff.register_sink(self)

    @property
    def directory(self) -> str | None:
        return str(self._writer.root) if self._writer else None

    @property
    def stats(self) -> WriterStats:
        return self._writer.stats if self._writer else WriterStats()

    def write_call(self, call: _handoff.CapturedCall) -> concurrent.futures.Future[None]:
        """Queue one call's line; the future resolves once it is durable (or failed)."""
        if self._writer is None:
            failed: concurrent.futures.Future[None] = concurrent.futures.Future()
            failed.set_exception(RuntimeError("model_call_jsonl exporter has no directory"))
            return failed
        future = self._writer.submit(
            call.rollout_id, call.line, call.model_call_id, call.tokens_line, waiter=call.waiter
        )
        call.waiter_taken = call.waiter is not None
        return future

    def abandon_call(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """A begun call whose record could not be built: counted, logged, its rollout marked incomplete."""
        if self._writer is not None and not self._shutdown:
            self._writer.abandon(rollout_id, model_call_id, reason)

    def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """A captured call has started: a freeze before its record lands reports the rollout incomplete."""
        if self._writer is not None and not self._shutdown:
            self._writer.begin(rollout_id, model_call_id)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Hand every model-call span's record to the writer. Never raises.

        Returns once the lines are queued, not once they are durable: durability is awaited per call by
        the middleware, and by :meth:`force_flush` for everything.
        """
        if self._shutdown or self._writer is None:
            return SpanExportResult.FAILURE
        try:
            for span in spans:
                context = span.context
                if context is not None:
                    _handoff.claim_for_export(context.span_id, self)
        except Exception:  # an exporter must never raise into the SDK
            _logger.exception("model_call_jsonl export failed")
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """True once every record handed to this exporter before the call is on disk and fsynced, or
        has failed and been marked incomplete; False if that did not happen within the timeout."""
        if self._writer is None:
            return True
        return self._writer.flush(timeout_millis / 1000)

    def shutdown(self) -> None:
        """Write out what is queued and stop. Idempotent."""
        if self._shutdown:
            return
        self._shutdown = True
        _handoff.unregister_sink(self)
        if self._writer is not None:
            self._writer.close()
