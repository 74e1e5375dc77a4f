"""Zero-code capture: ``ModelCallInstrumentor`` adds the capture middleware to every Starlette and FastAPI
app, so ``opentelemetry-instrument uvicorn app:app`` captures an unmodified model server (vLLM's OpenAI
server is a FastAPI app).

Registered in the entry-point group ``opentelemetry_instrumentor`` as ``otel_capture`` (the name
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` takes). It patches ``build_middleware_stack`` on the classes, not
the ``fastapi.FastAPI`` name, so apps built by code that imported the class before instrumentation (as
vLLM does) are captured too. The stack it builds::

    LeanServerSpanMiddleware (HTTP server span, stable HTTP conventions, set once: _telemetry/server_span.py)
      ServerErrorMiddleware (the app's own)
        ModelCallCaptureMiddleware
          the app's user middleware, exception handling, router

The capture middleware goes *inside* the app's ``ServerErrorMiddleware`` because that is what the FastAPI
and Starlette instrumentations expect to find outermost; when one of them instruments the app too (the
app has ``_is_instrumented_by_opentelemetry``), it brings the HTTP server span and we add none, so there
is exactly one server span with the model-call span as its child. FastAPI's own telemetry (FastAPI 0.142
and later) stands down for an app whose stack has contrib's ``OpenTelemetryMiddleware``; ours it does not
recognise, so where we add the server span we switch FastAPI's spans, metrics and logs off for that app,
as contrib's presence did. A mounted sub-app is not captured twice: the outermost capture marks the
request's scope.

The server span honours the excluded-URL variables as contrib does (``OTEL_PYTHON_FASTAPI_EXCLUDED_URLS``,
``OTEL_PYTHON_STARLETTE_EXCLUDED_URLS``, ``OTEL_PYTHON_EXCLUDED_URLS``), and puts on spans the request
and response headers the header-capture variables (``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*``) name,
credentials always ``[REDACTED]`` (contract D37).

Zero-code captures a server's ASGI app only: a process that never builds one (a client, an eval such as
``vf-eval``, run under ``opentelemetry-instrument`` by mistake) captures nothing. When a capture directory
is configured and no app was wrapped in the process's life, that is said once at exit
(:func:`_say_if_nothing_wrapped`), where the host's logging cannot hide it (:func:`notify`), pointing to
the capture proxy for client-side processes. Only the process the user started says it, not the Pythons it
starts (they are instrumented too); a supervisor whose workers build the app (``uvicorn --workers``) says
it although its workers captured (the line names its pid).

At lifespan shutdown the tracer and meter providers are flushed before the server is told shutdown is
complete: uvicorn re-raises SIGTERM after its graceful shutdown, which ends the process without running
``atexit``, where the SDK would otherwise flush its batch processors (and lose the last spans).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
from collections.abc import Collection
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]  # untyped re-export
from opentelemetry.util.http import get_excluded_urls

from ._asgi import ASGIApp, Message, Receive, Scope, Send
from ._capture import ModelCallCaptureMiddleware
from ._correlation import server_span_details
from ._notices import notify
from ._sdk_private import instrumented_by_contrib
from ._settings import ENV_CAPTURE_DIR, CaptureSettings, HeaderCaptureSettings, WriterSettings
from ._telemetry import LeanServerSpanMiddleware

_logger = logging.getLogger(__name__)

_ORIGINAL = "_otel_capture_original_build_middleware_stack"
SCOPE_SERVER_SPAN = "otel_capture.server_span"
# Internal, not a setting: the pid of the first instrumented process of a process tree, inherited by the
# Pythons it starts (see _watch_for_an_app).
_ROOT_PID = "OTEL_CAPTURE_ZERO_CODE_ROOT_PID"


class _Watch:
    """Whether this process's instrumentation ever wrapped an app, for the one notice at exit."""

    directory: str | None = None  # the capture directory configured when instrumented (None: no notice)
    wrapped = False
    registered = False


_watch = _Watch()


class _OncePerRequest:
    """The instrumented stack for the outermost app of a request; the plain stack (its capture middleware
    then passes through) for an app mounted inside an instrumented one."""

    def __init__(self, instrumented: ASGIApp, plain: ASGIApp) -> None:
        self.app = instrumented  # ``app``: the link that tools walking a middleware stack follow
        self.plain = plain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get(SCOPE_SERVER_SPAN):
            await self.plain(scope, receive, send)
            return
        if scope["type"] == "http":
            scope[SCOPE_SERVER_SPAN] = True
        await self.app(scope, receive, send)


class _FlushAtShutdown:
    """Passes everything through; flushes the telemetry providers before ``lifespan.shutdown.complete``."""

    def __init__(self, app: ASGIApp, options: dict[str, Any]) -> None:
        self.app = app
        self.options = options

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def flushing_send(message: Message) -> None:
            if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                await asyncio.to_thread(_flush, self.options)
            await send(message)

        await self.app(scope, receive, flushing_send)


def _flush(options: dict[str, Any]) -> None:
    providers = (
        options["tracer_provider"] or trace.get_tracer_provider(),
        options["meter_provider"] or metrics.get_meter_provider(),
    )
    for provider in providers:
        flush = getattr(provider, "force_flush", None)
        if flush is None:
            continue
        try:
            flush(10_000)
        except Exception:  # telemetry never breaks the host app's shutdown
            _logger.exception("flushing %r at shutdown failed", provider)


class ModelCallInstrumentor(BaseInstrumentor):  # type: ignore[misc]  # BaseInstrumentor is untyped
    """Captures model calls in every Starlette/FastAPI app built after :meth:`instrument`.

    ``instrument()`` takes optional ``tracer_provider``, ``meter_provider`` and ``settings``
    (:class:`~otel_capture.CaptureSettings`); without them the global providers and the environment
    (read once per app) are used, as ``opentelemetry-instrument`` needs.
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        # 0.33 routes on path minus root_path (ASGI spec), where the capture puts the /ng-rollout/<id> prefix
        return ("starlette >= 0.33",)

    def _instrument(self, **kwargs: Any) -> None:
        import starlette.applications  # a ModuleNotFoundError tells the auto-instrumentation loader to skip us

        options = {k: kwargs.get(k) for k in ("tracer_provider", "meter_provider", "settings")}
        _watch_for_an_app()
        classes: list[Any] = [starlette.applications.Starlette]
        try:
            import fastapi.applications

            classes.append(fastapi.applications.FastAPI)  # it overrides build_middleware_stack
        except ImportError:
            pass
        for cls in classes:
            if _ORIGINAL in vars(cls):
                continue
            original = vars(cls)["build_middleware_stack"]
            setattr(cls, _ORIGINAL, original)
            cls.build_middleware_stack = _patched(original, options)

    def _uninstrument(self, **kwargs: Any) -> None:
        _watch.directory = None  # switched off on purpose: nothing to say at exit
        for module_name, class_name in (
            ("starlette.applications", "Starlette"),
            ("fastapi.applications", "FastAPI"),
        ):
            module = __import__(module_name, fromlist=[class_name])
            cls = getattr(module, class_name, None)
            if cls is not None and _ORIGINAL in vars(cls):
                cls.build_middleware_stack = vars(cls)[_ORIGINAL]
                delattr(cls, _ORIGINAL)


def _patched(original: Any, options: dict[str, Any]) -> Any:
    def build_middleware_stack(self: Any) -> ASGIApp:
        stack: ASGIApp = original(self)
        try:
            return _instrument_stack(self, stack, options)
        except Exception:  # telemetry never breaks the host app: serve it uninstrumented
            _logger.exception("otel-capture could not instrument %r; serving it without capture", self)
            return stack

    build_middleware_stack.__doc__ = original.__doc__
    build_middleware_stack.__wrapped__ = original  # type: ignore[attr-defined]  # functools.wraps convention
    return build_middleware_stack


def _watch_for_an_app() -> None:
    """With a capture directory configured, say at exit if no app was ever wrapped (registered once)."""
    try:
        directory = WriterSettings.from_environ().directory
    except Exception:  # a bad setting is reported where it is used; this is only a hint
        return
    if directory is None:
        return
    # Only the process the user started speaks (opentelemetry-instrument execs it). Every Python it starts
    # (multiprocessing's children and resource tracker, vLLM's engine cores, uvicorn's workers) is
    # instrumented too, through PYTHONPATH, and serves no app by design; they inherit this mark.
    if os.environ.setdefault(_ROOT_PID, str(os.getpid())) != str(os.getpid()):
        return
    _watch.directory = str(directory)
    if not _watch.registered:
        _watch.registered = True
        atexit.register(_say_if_nothing_wrapped)


def _say_if_nothing_wrapped() -> None:
    if _watch.wrapped or _watch.directory is None:
        return
    notify(
        _logger,
        logging.WARNING,
        "otel-capture zero-code captured nothing in process %d: %s is %s, but no Starlette or FastAPI app "
        "was built in it. Zero-code captures a model server's ASGI app (opentelemetry-instrument uvicorn "
        "app:app, vLLM's OpenAI server); for a client-side process (an agent, an eval such as vf-eval) run "
        "the capture proxy in front of the model server (otel-capture proxy --upstream <model server URL>) "
        "and point the client at it; see the README, 'Use it'",
        os.getpid(),
        ENV_CAPTURE_DIR,
        _watch.directory,
    )


def _instrument_stack(app: Any, stack: ASGIApp, options: dict[str, Any]) -> ASGIApp:
    from starlette.middleware.errors import ServerErrorMiddleware

    _watch.wrapped = True
    settings: CaptureSettings | None = options["settings"]
    capture_kwargs: dict[str, Any] = {
        "tracer_provider": options["tracer_provider"],
        "meter_provider": options["meter_provider"],
        "settings": settings if settings is not None else CaptureSettings.from_environ(),
    }
    if isinstance(stack, ServerErrorMiddleware):
        stack.app = _FlushAtShutdown(ModelCallCaptureMiddleware(stack.app, **capture_kwargs), options)
    else:  # an unexpected stack shape: capture around all of it
        stack = _FlushAtShutdown(ModelCallCaptureMiddleware(stack, **capture_kwargs), options)
    if instrumented_by_contrib(app):
        return stack  # the FastAPI/Starlette instrumentation wraps this in its own HTTP server span
    is_fastapi = any(c.__module__.startswith("fastapi") for c in type(app).__mro__)
    headers = HeaderCaptureSettings.from_environ()  # OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*
    server = LeanServerSpanMiddleware(
        stack,
        tracer_provider=options["tracer_provider"],
        meter_provider=options["meter_provider"],
        excluded_urls=get_excluded_urls("FASTAPI" if is_fastapi else "STARLETTE"),
        default_span_details=server_span_details,  # named without the rollout prefix
        capture_request_headers=headers.capture_request_headers,
        capture_response_headers=headers.capture_response_headers,
        sanitize_headers=headers.sanitize_headers,
    )
    if is_fastapi:
        _without_fastapi_server_telemetry(app)
    return _OncePerRequest(server, stack)


def _without_fastapi_server_telemetry(app: Any) -> None:
    """Switch FastAPI's own request telemetry off for ``app`` (its spans, metrics and logs): the stack
    brings the HTTP server span. FastAPI does that itself when it finds contrib's middleware in the stack;
    ours it does not know (``FastAPI(telemetry=...)`` is the documented switch, kept in ``_telemetry``)."""
    config = getattr(app, "_telemetry", None)
    if isinstance(config, dict):
        config.update(tracing=False, metrics=False, logs=False)
