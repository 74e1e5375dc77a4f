"""The capture proxy: an ASGI app that relays model calls to an upstream server and captures them on the
way. This is its face: outside ``_proxy/``, code imports from here, never from its modules.

- :mod:`.app`: :func:`build_proxy_app` and :func:`start_proxy` (the library's, with the :class:`RunningProxy` it returns), and what ``otel-capture
  proxy`` serves it with (:func:`bind_socket`, :func:`socket_url`, :func:`display_url`,
  :func:`server_options`);
- :mod:`.guards`: the request size and concurrency limits, and :func:`limit_client_buffers`;
- :mod:`.pool` (the upstream connections) and :mod:`.redirects` (an upstream's redirects made the
  client's) are the app's own.

Below it are the capture and everything under it; above it only the flat top floor and the CLI.
"""

from __future__ import annotations

from .app import (
    RunningProxy,
    bind_socket,
    build_proxy_app,
    display_url,
    server_options,
    socket_url,
    start_proxy,
)
from .guards import limit_client_buffers

__all__ = [
    "RunningProxy",
    "bind_socket",
    "build_proxy_app",
    "display_url",
    "limit_client_buffers",
    "server_options",
    "socket_url",
    "start_proxy",
]
