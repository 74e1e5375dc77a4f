"""One settings object, read from the environment once, never at import time (DESIGN §8).

Precedence: constructor argument, then our variable, then the standard ``OTEL_*`` variable, then the
default. A bad value is logged with its name and replaced by the default. Tests pass ``environ=``
instead of patching ``os.environ``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

_logger = logging.getLogger(__name__)

ENV_CAPTURE_DIR = "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR"
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_MAX_BODY_BYTES = "OTEL_CAPTURE_MAX_BODY_BYTES"
ENV_KEEP_RAW_STREAM = "OTEL_CAPTURE_KEEP_RAW_STREAM"

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024

_T = TypeVar("_T")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True, slots=True)
class CaptureSettings:
    capture_dir: Path | None = None
    """Where records go; ``None`` means spans only, no records."""
    service_name: str | None = None
    """The model server's name, written as the record's ``model_ref.name``."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Cap on each raw body kept in memory and on disk; longer bodies are cut and flagged ``truncated``."""
    keep_raw_stream: bool = False
    """Keep the raw SSE text (``response_raw``) for clean streams too, not only for partial ones."""

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        capture_dir: str | os.PathLike[str] | None = None,
        service_name: str | None = None,
        max_body_bytes: int | None = None,
        keep_raw_stream: bool | None = None,
    ) -> CaptureSettings:
        env = os.environ if environ is None else environ
        return cls(
            capture_dir=_pick(
                _path(os.fspath(capture_dir)) if capture_dir is not None else None,
                env, ENV_CAPTURE_DIR, _path, None,
            ),
            service_name=_pick(service_name, env, ENV_SERVICE_NAME, _nonempty, None),
            max_body_bytes=_pick(max_body_bytes, env, ENV_MAX_BODY_BYTES, _positive_int, DEFAULT_MAX_BODY_BYTES),
            keep_raw_stream=_pick(keep_raw_stream, env, ENV_KEEP_RAW_STREAM, _bool, False),
        )


def _pick(
    given: _T | None, env: Mapping[str, str], name: str, parse: Callable[[str], _T], default: _T
) -> _T:
    if given is not None:
        return given
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        _logger.warning("ignoring %s=%r (%s); using the default %r", name, raw, exc, default)
        return default


def _path(raw: str) -> Path:
    if not raw.strip():
        raise ValueError("empty path")
    return Path(raw).expanduser().absolute()


def _nonempty(raw: str) -> str:
    if not raw.strip():
        raise ValueError("empty")
    return raw.strip()


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("must be true or false")
