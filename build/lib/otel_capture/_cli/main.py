"""``otel-capture``: the command line. Library errors become one clear line on stderr and an exit code."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from .._settings import ProxySettings
    from .._store import CaptureStore

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2

_logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otel-capture",
        description="Capture LLM model calls as OpenTelemetry spans and durable ModelCallRecord JSONL.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    proxy = commands.add_parser("proxy", help="serve the capture proxy in front of a model server")
    proxy.add_argument(
        "--upstream", required=True, help="the model server's base URL, e.g. http://127.0.0.1:8000"
    )
    proxy.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    proxy.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default)")
    proxy.add_argument("--workers", type=int, default=1, help="worker processes sharing the port (default 1)")
    proxy.add_argument(
        "--capture-dir",
        help="where records go (default: $OTEL_EXPORTER_MODEL_CALL_JSONL_DIR; without either, spans only)",
    )
    proxy.add_argument(
        "--upstream-timeout",
        type=_positive(float),
        metavar="SECONDS",
        help="give up on an upstream silent this long: 504, or a cut stream (default: "
        "$OTEL_CAPTURE_UPSTREAM_TIMEOUT, else 600)",
    )
    proxy.add_argument(
        "--max-request-bytes",
        type=_positive(int),
        metavar="BYTES",
        help="answer 413 to a larger request body (default: $OTEL_CAPTURE_MAX_REQUEST_BYTES, else 64 MiB)",
    )
    proxy.add_argument(
        "--shutdown-timeout",
        type=_positive(int),
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, cancel calls still running after this long (default: "
        "$OTEL_CAPTURE_SHUTDOWN_TIMEOUT, else 25)",
    )

    show = commands.add_parser("show", help="list a capture directory's rollouts, or one rollout's calls")
    show.add_argument("dir")
    show.add_argument("rollout_id", nargs="?")
    show.add_argument(
        "--trace-url",
        metavar="BASE",
        help="a tracing UI's base URL: print each call's trace link, BASE/trace/TRACE_ID (Jaeger), or BASE "
        "with {trace_id} in it replaced",
    )

    check = commands.add_parser("check", help="verify a capture directory; exit 1 on damage")
    check.add_argument("dir")
    check.add_argument(
        "--strict",
        action="store_true",
        help="also fail when a rollout is marked incomplete or a call had no rollout id",
    )

    ls = commands.add_parser("ls", help="list a capture directory's rollouts and their lifecycle state")
    ls.add_argument("dir")
    ls.add_argument("--state", choices=("live", "frozen", "retired"), help="only rollouts in this state")

    retire = commands.add_parser(
        "retire", help="remove rollouts' records and keep fences that refuse late calls"
    )
    retire.add_argument("dir")
    retire.add_argument("rollout_ids", nargs="+", metavar="ID")

    delete = commands.add_parser("delete", help="remove rollouts' records and fences (before reusing an id)")
    delete.add_argument("dir")
    delete.add_argument("rollout_ids", nargs="+", metavar="ID")

    demo = commands.add_parser("demo", help="run a few rollouts against a real tiny model through the proxy")
    demo.add_argument("--upstream", help="use this model server instead of starting the embedded tiny model")
    demo.add_argument("--capture-dir", help="where records go (default: a new temporary directory)")
    demo.add_argument("--rollouts", type=int, default=3, help="how many rollouts (default 3)")
    demo.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="also send the spans over OTLP/HTTP to URL, e.g. Jaeger's http://127.0.0.1:4318 (needs "
        "otel-capture[auto]; the standard OTEL_TRACES_EXPORTER etc. work too)",
    )
    demo.add_argument(
        "--trace-url",
        metavar="BASE",
        help="a tracing UI's base URL, e.g. Jaeger's http://127.0.0.1:16686: print each call's trace link",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "proxy":
            return _proxy(args)
        if args.command == "show":
            return _show(args)
        if args.command == "check":
            return _check(args)
        if args.command in ("ls", "retire", "delete"):
            return _lifecycle(args)
        if args.command == "demo":
            return _run_demo()(
                upstream=args.upstream,
                capture_dir=args.capture_dir,
                rollouts=args.rollouts,
                otlp_endpoint=args.otlp_endpoint,
                trace_url=args.trace_url,
            )
    except (ValueError, OSError) as exc:
        print(f"otel-capture: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_ERROR
    return EXIT_USAGE


def _proxy(args: argparse.Namespace) -> int:
    import uvicorn

    from .._proxy import bind_socket, build_proxy_app, display_url, server_options, socket_url
    from .._settings import ENV_CAPTURE_DIR, ENV_UPSTREAM, CaptureSettings, WriterSettings

    settings = CaptureSettings.from_environ()
    writer = WriterSettings.from_environ(directory=args.capture_dir)
    if writer.directory is not None:  # refused before listening: a directory others can write never starts
        from .._store import check_directory

        check_directory(writer.directory, allow_shared=writer.allow_shared_directory)
    proxy = _proxy_settings(args)
    sock = bind_socket(args.host, args.port)
    if args.host not in ("127.0.0.1", "::1", "localhost"):
        print(
            f"otel-capture: warning: binding {args.host}: the proxy is reachable from other machines",
            file=sys.stderr,
        )
    print(f"listening on {socket_url(sock)}", flush=True)
    where = writer.directory if writer.directory is not None else "nowhere (spans only)"
    print(f"upstream {display_url(args.upstream)}; records to {where}", flush=True)
    if args.workers > 1:
        # uvicorn's supervisor starts the workers on the socket we bound; each builds its own app and writer
        # from the environment (they share the capture files through flock).
        os.environ[ENV_UPSTREAM] = args.upstream
        if writer.directory is not None:
            os.environ[ENV_CAPTURE_DIR] = str(writer.directory)
        uvicorn.run(
            "otel_capture._proxy:proxy_app_from_environ",
            factory=True,
            fd=sock.fileno(),
            workers=args.workers,
            **server_options(proxy),
        )
        return EXIT_OK
    app = build_proxy_app(args.upstream, settings=settings, writer=writer, proxy=proxy)
    server = _server_class()(uvicorn.Config(app, **server_options(proxy)))
    server.run(sockets=[sock])
    print("stopped; every acknowledged record is on disk", flush=True)
    return EXIT_OK


def _proxy_settings(args: argparse.Namespace) -> ProxySettings:
    """The flags, else the variables. With ``--workers`` each worker builds its app from the environment,
    so the values are handed down as variables too."""
    from .._settings import ENV_MAX_REQUEST_BYTES, ENV_SHUTDOWN_TIMEOUT, ENV_UPSTREAM_TIMEOUT, ProxySettings

    proxy = ProxySettings.from_environ(
        upstream_timeout=args.upstream_timeout,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
    )
    if args.workers > 1:
        os.environ[ENV_UPSTREAM_TIMEOUT] = repr(proxy.upstream_timeout)
        os.environ[ENV_MAX_REQUEST_BYTES] = str(proxy.max_request_bytes)
        os.environ[ENV_SHUTDOWN_TIMEOUT] = str(proxy.shutdown_timeout)
    return proxy


def _positive(kind: type[float] | type[int]) -> Callable[[str], float]:
    """An argparse type: a positive ``kind``."""

    def parse(raw: str) -> float:
        value = kind(raw)
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a positive number, not {raw}")
        return value

    return parse


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, minus re-raising the signal after its graceful shutdown: SIGINT and SIGTERM
        end the proxy with exit code 0 once in-flight calls are done and records are flushed."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def _check(args: argparse.Namespace) -> int:
    from .._store import CaptureStore
    from .check import check_capture_dir, format_check, uncorrelated_line

    store = CaptureStore(args.dir)
    if not store.root.is_dir():
        print(f"otel-capture: error: {args.dir} is not a directory", file=sys.stderr)
        return EXIT_ERROR
    results = check_capture_dir(store)
    for line in format_check(results):
        print(line)
    uncorrelated = uncorrelated_line(store)
    if uncorrelated is not None:
        print(uncorrelated)
    strict_failed = any(r.incomplete for r in results) or uncorrelated is not None
    failed = any(r.damaged for r in results) or (args.strict and strict_failed)
    return EXIT_ERROR if failed else EXIT_OK


def _show(args: argparse.Namespace) -> int:
    from .._records import InvalidLine, ModelCallRecord
    from .._store import CaptureStore, scan_available_model_call_records
    from .show import format_rollouts_table, iter_calls_table

    store = CaptureStore(args.dir)
    if not store.root.is_dir():
        print(f"otel-capture: error: {args.dir} is not a directory", file=sys.stderr)
        return EXIT_ERROR
    if args.rollout_id is None:
        print(format_rollouts_table(store))
        _print_uncorrelated(store)
        return EXIT_OK
    invalid: list[tuple[int, str]] = []  # damaged lines are reported after the table, as before

    count, items = scan_available_model_call_records(store, args.rollout_id)

    def records() -> Iterator[ModelCallRecord]:
        for item in items:
            if isinstance(item, InvalidLine):
                invalid.append((item.line_number, item.reason))
            else:
                yield item

    # Printed as read: a rollout of any length holds one record and the column-sizing sample at a time.
    for line in iter_calls_table(records(), trace_url=args.trace_url, last_index=count - 1):
        print(line)
    if invalid:
        print(f"{len(invalid)} damaged line(s):", file=sys.stderr)
        for number, reason in invalid:
            print(f"  line {number}: {reason}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def _print_uncorrelated(store: CaptureStore, file: TextIO | None = None) -> None:
    from .check import uncorrelated_line

    line = uncorrelated_line(store)
    if line is not None:
        print(line, file=file)


def _lifecycle(args: argparse.Namespace) -> int:
    """``ls``: one ``<id> <state>`` line per rollout. ``retire``/``delete``: one ``<outcome> <id>`` line per
    id (``removed``, ``absent``, ``failed``); exit 1 if any id failed (the same command finishes it)."""
    from .._store import CaptureStore

    store = CaptureStore(args.dir)
    if not store.root.is_dir():
        print(f"otel-capture: error: {args.dir} is not a directory", file=sys.stderr)
        return EXIT_ERROR
    if args.command == "ls":
        for rollout_id, state in store.list_rollouts(args.state).items():
            print(f"{rollout_id}\t{state}")
        _print_uncorrelated(store, file=sys.stderr)  # stdout stays one rollout a line
        return EXIT_OK
    operation = store.retire_now if args.command == "retire" else store.delete_now
    result = operation(args.rollout_ids)
    for outcome in ("removed", "absent"):
        for rollout_id in result[outcome]:
            print(f"{outcome}\t{rollout_id}")
    for rollout_id, reason in result["failed"].items():
        print(f"otel-capture: error: {args.command} {rollout_id}: {reason}", file=sys.stderr)
    return EXIT_ERROR if result["failed"] else EXIT_OK


def _run_demo() -> Callable[..., int]:
    """The demo's entry point, imported by name: ``otel_capture.demo`` is installed from ``examples/demo``
    (the build's package-dir mapping), which a type checker reading the source tree cannot follow."""
    import importlib

    run_demo: Callable[..., int] = importlib.import_module("otel_capture.demo.run").run_demo
    return run_demo


if __name__ == "__main__":
    sys.exit(main())
