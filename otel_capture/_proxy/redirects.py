"""The capture proxy's redirects: an upstream's ``Location`` made to lead back through the proxy, with the
rollout, instead of straight to the upstream (where the call that follows would go uncaptured).

A ``Location`` on the upstream's origin (absolute with the upstream's ``scheme://host:port``, an absolute
path, or a relative reference, resolved against the URL the proxy requested) becomes the same place on the
proxy: the upstream's base path (``--upstream http://host/base``) taken off, and the proxy's ``root_path``
put on (the ``/ng-rollout/<id>`` prefix the request came with, behind the server's own root path, as a
Starlette app builds its URLs). An absolute ``Location`` stays absolute, on the scheme and ``Host`` the
client used; any other stays an absolute path. Query and fragment are kept. A ``Location`` on another
origin, or outside the upstream's base path (the proxy cannot reach it), is left as it is.
"""

from __future__ import annotations

from yarl import URL

from .._asgi import Scope


def proxied_location(
    location: str, *, requested: URL, upstream: URL, root_path: str, client: URL | None
) -> str:
    """``location`` from an upstream's redirect, as the client must follow it to come back through the
    proxy. ``requested`` is the URL the proxy sent the request to, ``upstream`` the ``--upstream`` URL,
    ``root_path`` the request's ASGI ``root_path`` (prefix included), ``client`` the origin the client used
    (``None`` when unknown: an absolute ``Location`` then becomes an absolute path)."""
    try:
        given = URL(location, encoded=True)  # as sent: nothing re-quoted
        target = requested.join(given)
    except ValueError:
        return location  # not a URL yarl reads: the client would fail on it either way
    if (target.scheme, target.host, target.port) != (upstream.scheme, upstream.host, upstream.port):
        return location
    base = upstream.raw_path.rstrip("/")
    path = target.raw_path
    if base:
        if path != base and not path.startswith(base + "/"):
            return location
        path = path[len(base) :] or "/"
    path = URL.build(path=root_path.rstrip("/")).raw_path + path
    if given.is_absolute() and client is not None:
        scheme, authority = client.scheme, client.raw_authority
    else:
        scheme, authority = "", ""
    return str(
        URL.build(
            scheme=scheme,
            authority=authority,
            path=path,
            query_string=target.raw_query_string,
            fragment=target.raw_fragment,
            encoded=True,
        )
    )


def client_origin(scope: Scope) -> URL | None:
    """``scheme://host[:port]`` as the client addressed this server (its ``Host`` header, else the server's
    own address), or ``None`` when neither reads as one."""
    scheme = str(scope.get("scheme", "http"))
    host = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"host"), None)
    if host is None:
        server = scope.get("server")
        if not server or server[1] is None:
            return None
        host = f"[{server[0]}]:{server[1]}" if ":" in server[0] else f"{server[0]}:{server[1]}"
    try:
        return URL.build(scheme=scheme, authority=host.strip())
    except ValueError:
        return None


def relocate(
    headers: list[tuple[bytes, bytes]], scope: Scope, requested: URL, upstream: URL
) -> list[tuple[bytes, bytes]]:
    """An upstream's ``3xx`` response headers with each ``Location`` made :func:`proxied_location`."""
    if not any(k.lower() == b"location" for k, _ in headers):
        return headers
    client = client_origin(scope)
    root_path = str(scope.get("root_path", ""))
    return [
        (
            k,
            proxied_location(
                v.decode("latin-1"),
                requested=requested,
                upstream=upstream,
                root_path=root_path,
                client=client,
            ).encode("latin-1"),
        )
        if k.lower() == b"location"
        else (k, v)
        for k, v in headers
    ]
