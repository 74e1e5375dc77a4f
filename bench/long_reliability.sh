#!/usr/bin/env bash
# The long forms of the reliability loops that CI runs short: 50 SIGKILLs of the proxy mid-traffic, and
# 20,000 calls per client process in the load test (memory, fds and threads checked flat, every call
# captured). Loopback only; bounded in count. Takes several minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
OTEL_CAPTURE_CRASH_ITERATIONS="${OTEL_CAPTURE_CRASH_ITERATIONS:-50}" \
OTEL_CAPTURE_LOAD_CALLS="${OTEL_CAPTURE_LOAD_CALLS:-20000}" \
  "$python" -m pytest -q tests/crash tests/integration/test_load.py "$@"
