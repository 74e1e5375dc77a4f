"""otel-capture: every LLM model call as an OpenTelemetry span and a durable NeMo Gym ModelCallRecord line."""

from ._attach import (
    FrozenCapture,
    attach_model_call_capture,
    build_model_call_capture,
    clear_model_call_captures,
    freeze_model_call_capture,
)
from ._capture.middleware import ModelCallCaptureMiddleware
from ._capture.sink import CallSink, FinishedCall, LoopWaiter
from ._correlation.agent import (
    base_url_for_run,
    capture_correlation_enabled,
    maybe_rollout_id_from_run_body,
    resolve_model_base_url,
    rollout_context_for_run,
    rollout_headers,
    rollout_id_from_run,
    url_path_for_request,
    url_path_for_run,
)
from ._correlation.baggage import (
    async_rollout_baggage_hook,
    inject_rollout_baggage,
    instrument_http_client,
    rollout_baggage_hook,
)
from ._correlation.ids import (
    ROLLOUT_ID_PATTERN,
    current_rollout_id,
    is_valid_rollout_id,
    rollout_context,
    validate_rollout_id,
)
from ._dialects.tokens import extract_tokens
from ._errors import CaptureError, InvalidRolloutIdError
from ._instrumentor import ModelCallInstrumentor
from ._proxy.app import build_proxy_app, start_proxy
from ._records import CaptureReadError, InvalidLine, ModelCallRecord
from ._settings import CaptureSettings, CorrelationSettings, ProxySettings, WriterSettings
from ._store import (
    AvailableRecords,
    CaptureFrozenError,
    CaptureRetiredError,
    CaptureSnapshot,
    CaptureStateError,
    CaptureStore,
    DamagedEntryError,
    IncompleteCall,
    LockTimeoutError,
    RemovalResult,
    UnsafeDirectoryError,
    WriterStats,
    aggregate_model_call_metrics,
    read_available_model_call_records,
    read_model_call_records,
    validate_rollout_ids,
)
from ._version import __version__

__all__ = [
    "ROLLOUT_ID_PATTERN",
    "AvailableRecords",
    "CallSink",
    "CaptureError",
    "CaptureFrozenError",
    "CaptureReadError",
    "CaptureRetiredError",
    "CaptureSettings",
    "CaptureSnapshot",
    "CaptureStateError",
    "CaptureStore",
    "CorrelationSettings",
    "DamagedEntryError",
    "FinishedCall",
    "FrozenCapture",
    "IncompleteCall",
    "InvalidLine",
    "InvalidRolloutIdError",
    "LockTimeoutError",
    "LoopWaiter",
    "ModelCallCaptureMiddleware",
    "ModelCallInstrumentor",
    "ModelCallRecord",
    "ProxySettings",
    "RemovalResult",
    "UnsafeDirectoryError",
    "WriterSettings",
    "WriterStats",
    "__version__",
    "aggregate_model_call_metrics",
    "async_rollout_baggage_hook",
    "attach_model_call_capture",
    "base_url_for_run",
    "build_model_call_capture",
    "build_proxy_app",
    "capture_correlation_enabled",
    "clear_model_call_captures",
    "current_rollout_id",
    "extract_tokens",
    "freeze_model_call_capture",
    "inject_rollout_baggage",
    "instrument_http_client",
    "is_valid_rollout_id",
    "maybe_rollout_id_from_run_body",
    "read_available_model_call_records",
    "read_model_call_records",
    "resolve_model_base_url",
    "rollout_baggage_hook",
    "rollout_context",
    "rollout_context_for_run",
    "rollout_headers",
    "rollout_id_from_run",
    "start_proxy",
    "url_path_for_request",
    "url_path_for_run",
    "validate_rollout_id",
    "validate_rollout_ids",
]
