"""`otel-capture demo` end to end: real tiny model, real capture proxy, official SDKs, records on disk."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from otel_capture import CaptureStore, read_model_call_records
from otel_capture.demo.run import run_demo
from otel_capture.demo.tiny_model import TinyModel

pytestmark = pytest.mark.model


def test_demo_captures_every_call_of_every_rollout(tiny_model: TinyModel, tmp_path: Path) -> None:
    out = io.StringIO()
    code = run_demo(upstream=tiny_model.base_url, capture_dir=str(tmp_path), rollouts=2, out=out)
    printed = out.getvalue()
    assert code == 0, printed
    store = CaptureStore(tmp_path)
    assert store.rollout_ids() == ["demo-0", "demo-1"]
    for rollout_id in ("demo-0", "demo-1"):
        assert store.data_path(rollout_id).is_file()
        assert not store.is_incomplete(rollout_id)
        records = read_model_call_records(store, rollout_id)
        # Calls of one rollout run one after another, so the append order is the call order.
        assert [r.dialect for r in records] == ["responses", "chat", "messages"]
        for record in records:
            assert record.status_code == 200
            assert record.error_category is None
            assert record.model == tiny_model.model
            assert record.tokens_in is not None and record.tokens_in > 0
            assert record.tokens_out is not None and record.tokens_out > 0
            assert record.latency_total_ms is not None and record.latency_total_ms > 0
        assert f"rollout {rollout_id}: {store.data_path(rollout_id)}" in printed
    assert printed.count("gemma-3-270m-q4_k_m.gguf") == 6  # one table line per call, model shortened
    assert "tokens in" in printed and "incomplete" in printed
    assert str(tmp_path) in printed


def test_demo_refuses_a_directory_that_already_holds_demo_rollouts(
    tiny_model: TinyModel, tmp_path: Path
) -> None:
    CaptureStore(tmp_path).data_path("demo-0").write_text("")
    out = io.StringIO()
    assert run_demo(upstream=tiny_model.base_url, capture_dir=str(tmp_path), rollouts=1, out=out) == 1
    assert CaptureStore(tmp_path).data_path("demo-0").read_text() == ""
