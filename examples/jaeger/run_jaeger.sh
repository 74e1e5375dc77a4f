#!/usr/bin/env bash
# Jaeger v2 without Docker: the binary built from its Go module (build_jaeger.sh, once), run with this
# folder's config.yaml, in the foreground (Ctrl-C stops it; traces are kept in memory only).
#
#   examples/jaeger/run_jaeger.sh
#
#   OTLP/gRPC  127.0.0.1:4317        OTLP/HTTP  http://127.0.0.1:4318
#   query API  http://127.0.0.1:16686/api/traces   (and the UI there, with a UI build: see README.md)
#
# JAEGER_BIN=/path/to/jaeger runs that binary instead (a Jaeger v2 release binary comes with the UI);
# JAEGER_OTLP_GRPC_ENDPOINT, JAEGER_OTLP_HTTP_ENDPOINT, JAEGER_QUERY_HTTP_ENDPOINT and
# JAEGER_QUERY_GRPC_ENDPOINT (host:port) move the listeners, as the tests do.
#
# Without JAEGER_BIN the binary is the one built from the Go module: the first run builds it (needs Go 1.24+;
# about 14 minutes on two cores, then cached), and its UI is a placeholder page, so a trace link must use
# the query API: otel-capture show DIR ID --trace-url 'http://127.0.0.1:16686/api/traces/{trace_id}'.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ -z "${JAEGER_BIN:-}" ]; then
  cache="${OTEL_CAPTURE_CACHE:-$HOME/.cache/otel-capture}"
  if [ ! -x "$cache/jaeger-v1.76.0/jaeger" ]; then
    echo "run_jaeger.sh: building Jaeger from its Go module first: about 14 minutes, once (then cached)" >&2
  fi
  bin="$("$here/build_jaeger.sh" | tail -n 1)"
  {
    echo "run_jaeger.sh: this Jaeger has no UI (a binary built from the module shows a placeholder page):"
    echo "  read a trace at http://127.0.0.1:16686/api/traces/<trace_id>, e.g. with"
    echo "  otel-capture show DIR ID --trace-url 'http://127.0.0.1:16686/api/traces/{trace_id}'"
    echo "  for the UI: docker compose -f examples/jaeger/compose.yaml up, or JAEGER_BIN=<a release binary>"
  } >&2
else
  bin="$JAEGER_BIN"
fi
exec "$bin" --config "$here/config.yaml"
