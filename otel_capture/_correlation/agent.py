"""Agent-side correlation helpers: NeMo Gym's names and meaning, so an agent's calls carry its rollout id.

An agent receives a run body (NeMo Gym's ``/run`` body, or a collector row) and sends model calls. These
helpers turn the body's rollout keys into the ``/ng-rollout/<id>`` URL prefix the capture middleware and
proxy read, or into the current rollout for the httpx baggage integration:

=================================  ======================================================================
``rollout_id_from_run(body)``      the rollout id, or ``None`` when correlation is off (**gated**)
``url_path_for_run(path, body)``   ``/ng-rollout/<id>`` + ``path`` (**gated**)
``base_url_for_run(url, body)``    ``url`` with the prefix, before a trailing ``/v1`` (**gated**)
``rollout_context_for_run(body)``  makes the run's id current for the calls inside the block (**gated**)
``url_path_for_request(path, r)``  copies an inbound request's prefix onto a downstream path (not gated)
``resolve_model_base_url(u, id)``  ``u`` + ``/ng-rollout/<id>`` + ``/v1`` (not gated: callers pass the id)
``rollout_headers(id)``            ``{"x-rollout-id": id}``, for a gateway that forwards only ``x-*``
                                   headers (not gated: callers pass the id; ``docs/gateways.md``)
=================================  ======================================================================

Ids follow NeMo Gym's rules (``maybe_rollout_id_from_run_body``): an explicit ``_ng_rollout_id`` wins,
else ``f"{_ng_task_index}-{_ng_rollout_index}"``; ``-a{n}`` is appended when ``_ng_attempt_index > 0``.
Unlike NeMo Gym, every id, derived ones included, must follow the one grammar
(:data:`~otel_capture._correlation.ids.ROLLOUT_ID_PATTERN`); one that does not raises
:class:`~otel_capture._correlation.ids.InvalidRolloutIdError` (a ``ValueError``).

**The gate.** NeMo Gym gates on its global config (``observability_enabled``); we read the agent's
environment through :class:`CorrelationSettings`: ``OTEL_CAPTURE_CORRELATION`` (true/false) when set,
else on exactly when ``OTEL_EXPORTER_MODEL_CALL_JSONL_DIR`` is set. An explicit ``enabled=`` argument
wins over both. The environment is read when a helper is called, never at import time. A gated helper
that is off by the environment (no ``enabled=`` argument) says so once per process, with a warning naming
the ways to turn it on: a copied snippet that sends its calls uncorrelated would otherwise be found only
later, as a rollout with no records.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .._notices import notify
from .._rollout_id import validate_rollout_id
from .._settings import ENV_CAPTURE_DIR, ENV_CORRELATION, CorrelationSettings
from .ids import (
    ROLLOUT_ID_HEADER,
    current_rollout_id,
    rollout_context,
    rollout_path_prefix,
    split_rollout_prefix,
)

_logger = logging.getLogger(__name__)


# NeMo Gym's run-body keys (``global_config.py``).
TASK_INDEX_KEY = "_ng_task_index"
ROLLOUT_INDEX_KEY = "_ng_rollout_index"
ATTEMPT_INDEX_KEY = "_ng_attempt_index"
ROLLOUT_ID_KEY = "_ng_rollout_id"
# A pydantic run body may expose the explicit id under this attribute (NeMo Gym does).
_ROLLOUT_ID_ATTRIBUTE = "capture_rollout_id"

_API_VERSION_SUFFIX = "/v1"


def capture_correlation_enabled(enabled: bool | None = None) -> bool:
    """The gate: ``enabled`` when given, else what the environment says (:class:`CorrelationSettings`)."""
    return CorrelationSettings.from_environ(enabled=enabled).enabled


_off_told = threading.Event()


def _gate(enabled: bool | None, helper: str) -> bool:
    """The gate for a gated helper. Off by the environment, it says so once per process: the helper then
    returns what it was given and the calls go out without a rollout id. An explicit ``enabled=False`` is
    the caller's choice: no word."""
    on = capture_correlation_enabled(enabled)
    if on or enabled is not None:
        return on
    if not _off_told.is_set():
        _off_told.set()
        notify(
            _logger,
            logging.WARNING,
            "%s: rollout correlation is off (%s is not true and %s is not set), so model calls go out "
            "without a rollout id and are not recorded; set %s=true (or %s, the capture directory), or "
            "pass enabled=True",
            helper,
            ENV_CORRELATION,
            ENV_CAPTURE_DIR,
            ENV_CORRELATION,
            ENV_CAPTURE_DIR,
        )
    return on


# --- ids ------------------------------------------------------------------------------------------------


def _body_value(body: Any, key: str) -> Any:
    """``body[key]`` for a mapping; for an object (a pydantic model), its attribute or its extra field."""
    if isinstance(body, Mapping):
        return body.get(key)
    extra = getattr(body, "model_extra", None)
    if isinstance(extra, Mapping) and key in extra:
        return extra[key]
    return getattr(body, key, None)


def maybe_rollout_id_from_run_body(body: Any) -> str | None:
    """The rollout id a run body names, whatever the gate says (NeMo Gym's function of the same name).

    An explicit ``_ng_rollout_id`` (or a ``capture_rollout_id`` attribute) wins; else
    ``f"{_ng_task_index}-{_ng_rollout_index}"``, ``None`` when either is missing. ``-a{n}`` is appended
    when ``int(_ng_attempt_index) > 0``, to explicit ids too. Raises
    :class:`~otel_capture._correlation.ids.InvalidRolloutIdError` (a ``ValueError``) when the id breaks the
    grammar, explicit or derived, and ``ValueError`` for an attempt index that is not an integer.
    """
    explicit = _body_value(body, ROLLOUT_ID_KEY)
    if explicit is None and not isinstance(body, Mapping):
        explicit = getattr(body, _ROLLOUT_ID_ATTRIBUTE, None)
    if explicit is not None:
        rollout_id = validate_rollout_id(explicit)
    else:
        task, rollout = _body_value(body, TASK_INDEX_KEY), _body_value(body, ROLLOUT_INDEX_KEY)
        if task is None or rollout is None:
            return None
        rollout_id = f"{task}-{rollout}"
    attempt = _body_value(body, ATTEMPT_INDEX_KEY)
    if attempt is not None:
        try:
            number = int(attempt)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{ATTEMPT_INDEX_KEY} must be an integer, not {attempt!r}") from exc
        if number > 0:
            rollout_id = f"{rollout_id}-a{number}"
    return validate_rollout_id(rollout_id)


def rollout_id_from_run(body: Any, *, enabled: bool | None = None) -> str | None:
    """The run's rollout id, or ``None`` when correlation is off (then the body is not looked at)."""
    return _rollout_id_if_on(body, enabled, "rollout_id_from_run")


def _rollout_id_if_on(body: Any, enabled: bool | None, helper: str) -> str | None:
    if not _gate(enabled, helper):
        return None
    return maybe_rollout_id_from_run_body(body)


# --- URLs -----------------------------------------------------------------------------------------------


def _join(prefix: str, url_path: str) -> str:
    return prefix + (url_path if url_path.startswith("/") or not url_path else "/" + url_path)


def _prefixed_base_url(base_url: str, rollout_id: str) -> str:
    """``base_url`` with ``/ng-rollout/<id>`` appended, kept before a trailing ``/v1`` (an OpenAI-style
    base URL), so the SDK's own path still follows it."""
    base = base_url.rstrip("/")
    prefix = rollout_path_prefix(rollout_id)
    if base.endswith(_API_VERSION_SUFFIX):
        return base[: -len(_API_VERSION_SUFFIX)] + prefix + _API_VERSION_SUFFIX
    return base + prefix


def url_path_for_run(url_path: str, body: Any, *, enabled: bool | None = None) -> str:
    """``/ng-rollout/<id>`` + ``url_path`` for the run's rollout; ``url_path`` unchanged when correlation
    is off or the body names no rollout."""
    rollout_id = _rollout_id_if_on(body, enabled, "url_path_for_run")
    if rollout_id is None:
        return url_path
    return _join(rollout_path_prefix(rollout_id), url_path)


def base_url_for_run(base_url: str, body: Any, *, enabled: bool | None = None) -> str:
    """``base_url`` + ``/ng-rollout/<id>`` for the run's rollout; unchanged when correlation is off or the
    body names no rollout.

    As in NeMo Gym the caller appends ``/v1`` (for the OpenAI SDK; the Anthropic SDK appends
    ``/v1/messages`` itself). A ``base_url`` that already ends in ``/v1`` keeps it last:
    ``http://h/v1`` becomes ``http://h/ng-rollout/<id>/v1``.
    """
    rollout_id = _rollout_id_if_on(body, enabled, "base_url_for_run")
    if rollout_id is None:
        return base_url
    return _prefixed_base_url(base_url, rollout_id)


def _inbound_rollout_id(request: Any) -> str | None:
    path_params = getattr(request, "path_params", None)
    if isinstance(path_params, Mapping) and path_params.get("rollout_id") is not None:
        return str(path_params["rollout_id"])
    scope = getattr(request, "scope", request)
    if not isinstance(scope, Mapping):
        return None
    raw_path = scope.get("raw_path") or str(scope.get("path", "")).encode()
    split = split_rollout_prefix(raw_path.decode("latin-1"))
    return split[0] if split is not None else None


def url_path_for_request(url_path: str, request: Any | None) -> str:
    """Carry an inbound request's rollout prefix onto a downstream ``url_path`` (not gated, as in NeMo Gym).

    ``request`` is a Starlette/FastAPI ``Request`` (or an ASGI scope): the id comes from a
    ``{rollout_id}`` path parameter (NeMo Gym's prefixed twin routes), else from an
    ``/ng-rollout/<id>/...`` request path. ``url_path`` is unchanged when there is neither. An id that
    breaks the grammar raises :class:`~otel_capture._correlation.ids.InvalidRolloutIdError`.
    """
    if request is None:
        return url_path
    rollout_id = _inbound_rollout_id(request)
    if rollout_id is None:
        return url_path
    return _join(rollout_path_prefix(rollout_id), url_path)


def resolve_model_base_url(base_url: str, rollout_id: str | None = None) -> str:
    """The OpenAI-style base URL of a model server for a rollout: ``base_url`` + ``/ng-rollout/<id>`` +
    ``/v1`` (without the prefix when ``rollout_id`` is ``None``).

    Not gated, as in NeMo Gym: callers pass ``rollout_id_from_run(body)``, which is ``None`` when
    correlation is off. NeMo Gym takes a model server's config name; we take its URL. A ``base_url``
    already ending in ``/v1`` is not given a second one.
    """
    base = base_url.rstrip("/").removesuffix(_API_VERSION_SUFFIX)
    if rollout_id is None:
        return base + _API_VERSION_SUFFIX
    return _prefixed_base_url(base, rollout_id) + _API_VERSION_SUFFIX


def rollout_headers(rollout_id: str | None = None) -> dict[str, str]:
    """``{"x-rollout-id": id}`` for ``rollout_id``, else the current rollout (:func:`rollout_context`);
    ``{}`` when there is neither. For a path through a gateway that drops the URL prefix and ``baggage``
    but forwards ``x-*`` headers: pass it as an SDK's ``default_headers`` or ``extra_headers``. The capture
    reads it after the URL prefix and before baggage, and removes it before the model server sees it."""
    rollout_id = rollout_id if rollout_id is not None else current_rollout_id()
    if rollout_id is None:
        return {}
    return {ROLLOUT_ID_HEADER: validate_rollout_id(rollout_id)}


# --- the current rollout --------------------------------------------------------------------------------


@contextmanager
def rollout_context_for_run(body: Any, *, enabled: bool | None = None) -> Iterator[str | None]:
    """Make the run's rollout the current one inside the block (what the httpx baggage integration
    reads with :func:`~otel_capture._correlation.ids.current_rollout_id`), as NeMo Gym's agents wrap
    ``/run`` in ``rollout_context(rollout_id_from_run(body))``. When correlation is off or the body names
    no rollout, the block runs with no current rollout. Yields the id (or ``None``)."""
    with rollout_context(_rollout_id_if_on(body, enabled, "rollout_context_for_run")) as rollout_id:
        yield rollout_id
