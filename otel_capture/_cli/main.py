"""``otel-capture``: the command line. Library errors become one clear line on stderr and an exit code."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from . import health

if TYPE_CHECKING:
    from .._settings import ProxySettings
    from .._store import CaptureStore, RolloutState

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2

_logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    from .._store import ROLLOUT_STATES
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="otel-capture",
        description="Capture LLM model calls as OpenTelemetry spans and durable ModelCallRecord JSONL.",
    )
    parser.add_argument("--version", action="version", version=f"otel-capture {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    proxy = commands.add_parser(
        "proxy",
        help="serve the capture proxy in front of a model server",
        description="Serve the capture proxy: every call is forwarded to --upstream unchanged, and a call made "
        "under /ng-rollout/<rollout_id>/ (or with the header x-rollout-id, or the baggage entry rollout.id) "
        "becomes a span and, with a capture directory, one ModelCallRecord line of "
        "<dir>/<rollout_id>.capture.jsonl, durable before the client gets the end of its answer. Prints "
        "'listening on URL' once bound; SIGINT or SIGTERM stop it once the calls in flight are done.",
    )
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
    proxy.add_argument(
        "--max-concurrent-calls",
        type=_positive(int),
        metavar="N",
        help="answer 503 with Retry-After to calls beyond N at once (default: "
        "$OTEL_CAPTURE_MAX_CONCURRENT_CALLS, else 1024)",
    )

    ls = commands.add_parser(
        "ls",
        help="list a capture directory's rollouts: state, calls, errors, tokens, latency, damage",
        description="List the rollouts of a capture directory, one line each, damaged ones included. The "
        "columns: rollout (its id); state (live: records may still come; frozen: a snapshot was taken, "
        "later calls are refused; retired: records removed, a fence drops late calls); calls (the records "
        "read); errors (the failed calls, refused ones apart); tokens in (the prompts' tokens summed; 120+? when some calls "
        "were answered without usage, e.g. a stream sent without include_usage: their tokens are unknown, "
        "not zero; ? when no call had usage); tokens out (the answers', likewise); model s (the calls' "
        "latencies summed, in seconds: the rollout's time in the model); p50 ms (the median call latency); "
        "max ms (the longest); ttft ms (the mean time to first chunk of the streamed calls); refused (the "
        "calls the capture proxy refused for capacity, 503 with Retry-After: retries, not errors); incomplete (yes "
        "when a capture failed); damaged (2 lines: lines that are not records, skipped; torn 37 B: a last "
        "line of 37 bytes cut by a crash; unreadable: its file could not be read, e.g. its lock was held past "
        "the lock timeout). A retired rollout is listed until it is deleted. Notes follow "
        "the table, on stdout too: the calls without usage, the damaged rollouts, the model calls served "
        "without a rollout id. Exits 1 when a rollout is damaged, as check does ('otel-capture check DIR' "
        "says where).",
    )
    ls.add_argument("dir", metavar="DIR", help="the capture directory")
    states = [state for state in ROLLOUT_STATES if state != "absent"]  # ls lists only rollouts that exist
    ls.add_argument("--state", choices=states, help="only rollouts in this state")

    show = commands.add_parser(
        "show",
        help="print one rollout's calls (without ID: the same list as ls)",
        description="Print one rollout's calls, one line each as they are read. The columns: # (call_index, "
        "the line's position in the file); dialect (chat, responses, messages or completions); model (as the "
        "answer named it; a file path shortened to its file name); status (the HTTP status); tokens in (the "
        "prompt's tokens); tokens out (the answer's; both ? for a call answered without usage, e.g. a stream "
        "sent without include_usage: unknown, not zero; - when the call failed); latency ms (the whole call); "
        "ttft ms (time to first chunk); error (its category, e.g. timeout); weight (the weight version "
        "declared when the call started; 7->8 when it changed while the call ran; 7 (engine 6) when the "
        "engine reported another; - when none is known); with --trace-url, trace (the link to its trace). "
        "Exits 1 when the file is damaged: the damaged lines and a torn tail (a last line cut by a crash, "
        "with its size in bytes) are listed on stderr after the table, as check counts them. Without ID, "
        "'show DIR' is an alias of 'ls DIR'.",
    )
    show.add_argument("dir", metavar="DIR", help="the capture directory")
    show.add_argument("rollout_id", nargs="?", metavar="ID")
    show.add_argument(
        "--trace-url",
        metavar="BASE",
        help="a tracing UI's base URL: print each call's trace link, BASE/trace/TRACE_ID (Jaeger), or BASE "
        "with {trace_id} in it replaced",
    )

    check = commands.add_parser(
        "check",
        help="verify a capture directory; exit 1 on damage or on a loss not yet marked",
        description="Read every file of a capture directory and answer first, in one line: 'ok' or what is "
        "wrong and in which rollouts. Then the details, one line each: a line that is not a record, a torn "
        "last line (a crash mid-write), an entry that is not a regular file, the calls a writer could not "
        "record nor yet mark (a full filesystem), the rollouts marked incomplete, the calls that lack the "
        "token ids or log-probs they asked for, the sync the writer uses on this filesystem, the counts, "
        "and the model calls served without a rollout id. Everything is on stdout. Exits 1 on damage or "
        "on such an unmarked loss; with --strict also when a rollout is marked incomplete or a call had "
        "no rollout id.",
    )
    check.add_argument("dir", metavar="DIR", help="the capture directory")
    check.add_argument(
        "--strict",
        action="store_true",
        help="also fail when a rollout is marked incomplete or a call had no rollout id",
    )
    health.add_parser(commands)

    freeze = commands.add_parser(
        "freeze",
        help="take a snapshot of rollouts and refuse their later calls",
        description="Freeze rollouts: take a snapshot of each one's records and token lines, and from then "
        "on refuse its new records (a late call's record is dropped; the model call itself is still "
        "served). Prints 'frozen ID', the snapshot's counts, whether it is incomplete (a call was in flight "
        "or failed to be captured), its snapshot id and version. Freezing again gives the same snapshot; "
        "an id never seen is frozen empty. A retired rollout cannot be frozen (exit 1).",
    )
    freeze.add_argument("dir", metavar="DIR", help="the capture directory")
    freeze.add_argument("rollout_ids", nargs="+", metavar="ID")

    retire = commands.add_parser(
        "retire",
        help="remove rollouts' records and keep fences that refuse late calls",
        description="Retire rollouts once their captures are consumed: remove their records and token lines, "
        "and keep a fence, so the late calls of an abandoned attempt still running are dropped instead "
        "of starting a new file. Prints 'removed ID' (it had records) or 'absent ID'. Exits 1 if an id "
        "failed; running the same command again finishes it.",
    )
    retire.add_argument("dir", metavar="DIR", help="the capture directory")
    retire.add_argument("rollout_ids", nargs="+", metavar="ID")

    delete = commands.add_parser(
        "delete",
        help="remove rollouts' records and fences (before reusing an id)",
        description="Delete rollouts: remove their records, token lines and fences, so each id is absent "
        "again and can be reused; a call for it afterwards starts a new capture. Prints 'removed ID' (it "
        "had records or a fence) or 'absent ID'. Exits 1 if an id failed; running the same command again "
        "finishes it.",
    )
    delete.add_argument("dir", metavar="DIR", help="the capture directory")
    delete.add_argument("rollout_ids", nargs="+", metavar="ID")

    weight = commands.add_parser(
        "weight-version",
        help="declare the weight (policy) version in force for a capture directory",
        description="Declare the weight (policy) version in force from now on for every call captured in a "
        "directory, as a trainer does when it syncs new weights: every writer sharing the directory, on any "
        "node, stamps it on the records of calls it admits from its next batch (weight_version, and "
        "weight_version_at_end when the weights changed while a call ran). Without VERSION, print the "
        "version declared last (exit 1 if none was). A missing DIR is created as a writer creates it (0700).",
    )
    weight.add_argument("dir", metavar="DIR", help="the capture directory")
    weight.add_argument(
        "version", nargs="?", help="the version to declare; without it, print the current one"
    )

    demo = commands.add_parser(
        "demo",
        help="run a few rollouts against a real tiny model through the proxy",
        description="Start a real tiny model server (llama.cpp with Gemma 3 270M, from the demo extra), put "
        "the capture proxy in front of it, run a few rollouts with the official openai and anthropic SDKs, "
        "and print the captured calls and where their records are.",
    )
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
        if args.command == "health":
            return health.run(args)
        if args.command in ("ls", "freeze", "retire", "delete"):
            return _lifecycle(args)
        if args.command == "weight-version":
            return _weight_version(args)
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

    from .._proxy import (
        bind_socket,
        build_proxy_app,
        display_url,
        limit_client_buffers,
        server_options,
        socket_url,
    )
    from .._settings import ENV_CAPTURE_DIR, ENV_UPSTREAM, CaptureSettings, WriterSettings, upstream_url

    # every setting refused before listening: a ConfigurationError (a ValueError) is one line and exit 1
    upstream_url("--upstream", args.upstream)
    settings = CaptureSettings.from_environ()
    writer = WriterSettings.from_environ(directory=args.capture_dir)
    if writer.directory is not None:  # refused before listening (contract D26)
        from .._store import check_directory

        check_directory(writer.directory, allow_shared=writer.allow_shared_directory)
    proxy = _proxy_settings(args)
    sock = limit_client_buffers(bind_socket(args.host, args.port))
    if args.host not in ("127.0.0.1", "::1", "localhost"):  # (contract D39)
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
            "otel_capture._proxy.app:proxy_app_from_environ",
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
    from .._settings import (
        ENV_MAX_CONCURRENT_CALLS,
        ENV_MAX_REQUEST_BYTES,
        ENV_SHUTDOWN_TIMEOUT,
        ENV_UPSTREAM_TIMEOUT,
        ProxySettings,
    )

    proxy = ProxySettings.from_environ(
        upstream_timeout=args.upstream_timeout,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        max_concurrent_calls=args.max_concurrent_calls,
    )
    if args.workers > 1:
        os.environ[ENV_UPSTREAM_TIMEOUT] = repr(proxy.upstream_timeout)
        os.environ[ENV_MAX_REQUEST_BYTES] = str(proxy.max_request_bytes)
        os.environ[ENV_SHUTDOWN_TIMEOUT] = str(proxy.shutdown_timeout)
        os.environ[ENV_MAX_CONCURRENT_CALLS] = str(proxy.max_concurrent_calls)  # each worker's own cap
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
        end the proxy with exit code 0 once in-flight calls are done and records are flushed
        (contract D11)."""

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
    from .check import (
        check_answer,
        check_capture_dir,
        check_state,
        format_check,
        local_loss_lines,
        sync_report,
        uncorrelated_line,
    )

    store = CaptureStore(args.dir)
    try:
        unreachable = None if store.root.is_dir() else "is not a directory"
    except OSError as exc:  # a shared mount cut off from its server (ENOTCONN), a stale handle...
        unreachable = f"cannot be reached: {exc.strerror or exc}"
    if unreachable is not None:
        print(f"otel-capture: error: {args.dir} {unreachable}", file=sys.stderr)
        for line in local_loss_lines(store):  # kept on this node while it is unreachable (contract D44)
            print(line)
        return EXIT_ERROR
    state = check_state(store)  # the directory's own state: reserve entries, losses in memory only
    results = check_capture_dir(store, state.reserves)
    uncorrelated = uncorrelated_line(store)
    strict_failed = any(r.incomplete for r in results) or uncorrelated is not None or state.strict_failed
    failed = any(r.damaged for r in results) or state.damaged or (args.strict and strict_failed)
    print(check_answer(results, uncorrelated, strict=args.strict, state=state))  # the answer first
    *problems, summary = format_check(results, state)
    for line in problems:
        print(line)
    print(sync_report(store.root))
    print(summary)
    if uncorrelated is not None:
        print(uncorrelated)
    return EXIT_ERROR if failed else EXIT_OK


def _show(args: argparse.Namespace) -> int:
    from .._records import InvalidLine, ModelCallRecord
    from .._store import CaptureStore, scan_available_model_call_records
    from .show import iter_calls_table, torn_tail, usage_unknown

    if args.rollout_id is None:  # `show DIR`: an alias of `ls DIR`
        return _lifecycle(argparse.Namespace(command="ls", dir=args.dir, state=None))
    store = CaptureStore(args.dir)
    if not store.root.is_dir():
        print(f"otel-capture: error: {args.dir} is not a directory", file=sys.stderr)
        return EXIT_ERROR
    invalid: list[tuple[int, str]] = []  # damaged lines are reported after the table, as before
    no_usage: list[int] = []

    count, items = scan_available_model_call_records(store, args.rollout_id)

    def records() -> Iterator[ModelCallRecord]:
        for item in items:
            if isinstance(item, InvalidLine):
                invalid.append((item.line_number, item.reason))
            else:
                if usage_unknown(item):
                    no_usage.append(item.call_index)
                yield item

    # Printed as read: a rollout of any length holds one record and the column-sizing sample at a time.
    for line in iter_calls_table(records(), trace_url=args.trace_url, last_index=count - 1):
        print(line)
    if no_usage:
        print(_no_usage_note(len(no_usage), f" (# {_some(no_usage)})"))
    torn = torn_tail(store, args.rollout_id)
    if invalid:
        print(f"{len(invalid)} damaged line(s):", file=sys.stderr)
        for number, reason in invalid:
            print(f"  line {number}: {reason}", file=sys.stderr)
    if torn is not None:
        print(f"{torn.describe()}: not parsed", file=sys.stderr)
    return EXIT_ERROR if invalid or torn is not None else EXIT_OK


def _some(items: Sequence[object], shown: int = 10) -> str:
    """The first ``shown`` items, comma-separated, and how many more."""
    listed = ", ".join(str(item) for item in items[:shown])
    return listed + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _no_usage_note(calls: int, where: str) -> str:
    return (
        f"?: {calls} call(s){where} answered without usage (a stream sent without "
        "stream_options={'include_usage': True}?): their tokens are unknown, not counted as zero"
    )


def _ls(store: CaptureStore, state: RolloutState | None) -> int:
    """The rollouts table, every rollout listed, damaged ones marked; then the notes, on stdout too (the
    answer, as ``check`` prints it): calls without usage, damage, calls served without a rollout id. Exit
    1 when a rollout is damaged, as ``check``."""
    from .check import uncorrelated_line
    from .show import format_rollout_summaries, rollout_summaries

    summaries = rollout_summaries(store, state=state)
    print(format_rollout_summaries(summaries))
    no_usage = [s for s in summaries if s.no_usage]
    if no_usage:
        calls = sum(s.no_usage for s in no_usage)
        print(_no_usage_note(calls, f" of {_some([s.rollout_id for s in no_usage])}"))
    for s in summaries:
        if s.unreadable is not None:
            print(f"{s.rollout_id}: unreadable: {s.unreadable}")
    damaged = [s.rollout_id for s in summaries if s.damaged]
    if damaged:
        print(
            f"damaged: {_some(damaged)} ({len(damaged)} rollout(s)): their damaged lines and torn tails are "
            f"skipped above; 'otel-capture check {store.root}' says where"
        )
    uncorrelated = uncorrelated_line(store)
    if uncorrelated is not None:
        print(uncorrelated)
    return EXIT_ERROR if damaged else EXIT_OK


def _lifecycle(args: argparse.Namespace) -> int:
    """``ls``: the rollouts table (:func:`.show.format_rollouts_table`). ``freeze``: one ``frozen <id> ...``
    line per id. ``retire``/``delete``: one ``<outcome> <id>`` line per id (``removed``, ``absent``). An id
    that failed is one error line on stderr and exit 1 (the same command finishes it)."""
    from .._store import CaptureStore

    store = CaptureStore(args.dir)
    if not store.root.is_dir():
        print(f"otel-capture: error: {args.dir} is not a directory", file=sys.stderr)
        return EXIT_ERROR
    if args.command == "ls":
        return _ls(store, args.state)
    if args.command == "freeze":
        return _freeze(store, args.rollout_ids)
    operation = store.retire_now if args.command == "retire" else store.delete_now
    result = operation(args.rollout_ids)
    for outcome in ("removed", "absent"):
        for rollout_id in result[outcome]:
            print(f"{outcome}\t{rollout_id}")
    for rollout_id, reason in result["failed"].items():
        print(f"otel-capture: error: {args.command} {rollout_id}: {reason}", file=sys.stderr)
    return EXIT_ERROR if result["failed"] else EXIT_OK


def _freeze(store: CaptureStore, rollout_ids: list[str]) -> int:
    """Each id frozen in turn (``freeze_now``); the ids are validated whole first, so a bad one changes
    nothing. A rollout that cannot be frozen (retired, its fence line damaged, a lock held too long) is an
    error line and exit 1; the others are frozen all the same."""
    from .. import (
        CaptureFrozenError,
        CaptureStateError,
        DamagedEntryError,
        LockTimeoutError,
        validate_rollout_ids,
    )

    failed = False
    for rollout_id in validate_rollout_ids(rollout_ids):
        try:
            snap = store.freeze_now(rollout_id)
        except (CaptureFrozenError, CaptureStateError, DamagedEntryError, LockTimeoutError) as exc:
            print(f"otel-capture: error: freeze {rollout_id}: {exc}", file=sys.stderr)
            failed = True
            continue
        state = "incomplete" if snap.incomplete else "complete"
        counts = f"{_count(len(snap.records), 'record')}\t{_count(len(snap.tokens), 'token line')}\t{state}"
        print(f"frozen\t{rollout_id}\t{counts}\tsnapshot {snap.snapshot_id}\tversion {snap.version}")
    return EXIT_ERROR if failed else EXIT_OK


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _weight_version(args: argparse.Namespace) -> int:
    """Declare ``version`` for the directory (what a trainer runs when it syncs weights), or print the
    version declared last (nothing, exit 1, before any declaration)."""
    from .._store import CaptureStore

    store = CaptureStore(args.dir)
    if args.version is not None:  # made as a writer makes it when missing: 0700, refused when shared
        store.set_weight_version(args.version)
        return EXIT_OK
    if not store.root.is_dir():
        print(f"otel-capture: error: {args.dir} is not a directory", file=sys.stderr)
        return EXIT_ERROR
    current = store.weight_version()
    if current is None:
        print(f"otel-capture: no weight version declared for {args.dir}", file=sys.stderr)
        return EXIT_ERROR
    print(current)
    return EXIT_OK


def _run_demo() -> Callable[..., int]:
    """The demo's entry point, imported by name: ``otel_capture.demo`` is installed from ``examples/demo``
    (the build's package-dir mapping), which a type checker reading the source tree cannot follow."""
    import importlib

    run_demo: Callable[..., int] = importlib.import_module("otel_capture.demo.run").run_demo
    return run_demo


if __name__ == "__main__":
    sys.exit(main())
