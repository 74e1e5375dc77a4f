"""``otel-capture show --trace-url`` / ``demo --trace-url``: each call's link to its trace in a tracing UI."""

from __future__ import annotations

from otel_capture import ModelCallRecord
from otel_capture._cli.show import format_calls_table, trace_link

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_a_base_url_links_to_jaegers_trace_page_and_a_template_to_any_uis() -> None:
    assert trace_link("http://127.0.0.1:16686", TRACE) == f"http://127.0.0.1:16686/trace/{TRACE}"
    assert trace_link("http://127.0.0.1:16686/", TRACE) == f"http://127.0.0.1:16686/trace/{TRACE}"
    phoenix = "http://127.0.0.1:6006/redirects/traces/{trace_id}"
    assert trace_link(phoenix, TRACE) == f"http://127.0.0.1:6006/redirects/traces/{TRACE}"
    assert trace_link("http://127.0.0.1:16686", None) == "-"  # a record written without a span


def test_the_calls_table_ends_each_line_with_its_link_only_when_asked() -> None:
    records = [
        ModelCallRecord(call_index=0, dialect="chat", status_code=200, trace_id=TRACE),
        ModelCallRecord(call_index=1, dialect="chat", status_code=200, trace_id=None),
    ]
    header, first, second = format_calls_table(records, trace_url="http://j:16686").splitlines()
    assert header.split()[-1] == "trace"
    assert first.split()[-1] == f"http://j:16686/trace/{TRACE}"
    assert second.split()[-1] == "-"
    assert "trace" not in format_calls_table(records).splitlines()[0]
