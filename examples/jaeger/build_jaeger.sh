#!/usr/bin/env bash
# Build Jaeger v2 from its Go module, once, and print the binary's path (the last line of output).
#
#   examples/jaeger/build_jaeger.sh [DEST]
#
# DEST defaults to $OTEL_CAPTURE_CACHE/jaeger-v1.76.0/jaeger ($OTEL_CAPTURE_CACHE: ~/.cache/otel-capture),
# where the tests look for it too. An existing binary is reused; building needs Go (1.24 or newer) and
# the Go module proxy, and takes minutes the first time (about 14 min on two busy cores).
#
# Why not `go install github.com/jaegertracing/jaeger/cmd/jaeger@v1.76.0`: Go refuses it because
# Jaeger's go.mod has replace directives. Built as a dependency of a throwaway module, it builds.
# Concurrent runs build once: check-and-build happens under a lock (flock on DEST.lock; never removed,
# so no one locks a file that another is about to delete), and the binary is written under a temporary
# name and renamed, so a half-written binary is never seen under DEST.
#
# The binary serves Jaeger's query API; its UI is a placeholder page (the UI's assets are built with npm
# and embedded only in the release binaries and the Docker image): see README.md here.
set -euo pipefail

JAEGER_MODULE=github.com/jaegertracing/jaeger
JAEGER_VERSION=v1.76.0 # Jaeger v2.13.0

cache="${OTEL_CAPTURE_CACHE:-$HOME/.cache/otel-capture}"
dest="${1:-$cache/jaeger-$JAEGER_VERSION/jaeger}"

if [ -x "$dest" ]; then
  echo "$dest"
  exit 0
fi
if ! command -v go >/dev/null 2>&1; then
  echo "build_jaeger.sh: Go is not installed (https://go.dev/dl/); with Docker, use compose.yaml instead" >&2
  exit 3
fi
mkdir -p "$(dirname "$dest")"
exec 9>>"$dest.lock"
if command -v flock >/dev/null 2>&1; then
  flock 9 # another run may be building: wait for it, then find its binary below
fi
if [ -x "$dest" ]; then
  echo "$dest"
  exit 0
fi

work="$(mktemp -d)"
partial="$dest.partial.$$"
trap 'rm -rf "$work" "$partial"' EXIT
echo "building Jaeger $JAEGER_VERSION from the Go module into $dest (minutes the first time)" >&2
started=$SECONDS
(
  cd "$work"
  go mod init otel-capture.local/jaeger-build >/dev/null 2>&1
  go get -tool "$JAEGER_MODULE/cmd/jaeger@$JAEGER_VERSION"
  go build -o "$partial" "$JAEGER_MODULE/cmd/jaeger"
)
mv -f "$partial" "$dest"
echo "built $dest in $((SECONDS - started)) s ($(du -h "$dest" | cut -f1))" >&2
echo "$dest"
