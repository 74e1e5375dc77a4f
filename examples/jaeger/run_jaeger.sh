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
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${JAEGER_BIN:-$("$here/build_jaeger.sh" | tail -n 1)}"
exec "$bin" --config "$here/config.yaml"
