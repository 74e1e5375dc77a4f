"""The store is a floor of its own: importing it loads neither the tracing SDK nor any module of the
floors above it (capture, telemetry, proxy). Checked in a fresh interpreter, where nothing else was
imported first.

``otel_capture/__init__.py`` imports the whole package (it is the public face), so the child stands in
an empty ``otel_capture`` package for it and imports ``otel_capture._store`` alone: what is loaded then
is exactly what the store itself pulls in."""

from __future__ import annotations

import subprocess
import sys
import textwrap

ABOVE_THE_STORE = ("opentelemetry", "otel_capture._capture", "otel_capture._telemetry", "otel_capture._proxy")

CHILD = textwrap.dedent(
    """
    import importlib.util, sys, types
    spec = importlib.util.find_spec("otel_capture")
    package = types.ModuleType("otel_capture")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["otel_capture"] = package
    import otel_capture._store
    above = sorted(m for m in sys.modules if m.startswith(tuple(sys.argv[1:])))
    assert not above, above
    """
)


def test_importing_the_store_loads_nothing_above_it() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, *ABOVE_THE_STORE], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_the_writer_s_completion_signal_is_the_sink_s() -> None:
    """The middleware and the writer share one ``LoopWaiter``: the sink re-exports the store's."""
    from otel_capture._capture import sink
    from otel_capture._store import LoopWaiter

    assert sink.LoopWaiter is LoopWaiter
