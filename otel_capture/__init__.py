"""otel-capture: every LLM model call as an OpenTelemetry span and a durable NeMo Gym ModelCallRecord line."""

from ._correlation import (
    ROLLOUT_ID_PATTERN,
    InvalidRolloutIdError,
    is_valid_rollout_id,
    validate_rollout_id,
)
from ._middleware import ModelCallCaptureMiddleware
from ._proxy import build_proxy_app, start_proxy
from ._records import (
    ModelCallRecord,
    aggregate_model_call_metrics,
    read_available_model_call_records,
    read_model_call_records,
)
from ._settings import CaptureSettings
from ._store import CaptureStore
from ._version import __version__

__all__ = [
    "ROLLOUT_ID_PATTERN",
    "CaptureSettings",
    "CaptureStore",
    "InvalidRolloutIdError",
    "ModelCallCaptureMiddleware",
    "ModelCallRecord",
    "__version__",
    "aggregate_model_call_metrics",
    "build_proxy_app",
    "is_valid_rollout_id",
    "read_available_model_call_records",
    "read_model_call_records",
    "start_proxy",
    "validate_rollout_id",
]
