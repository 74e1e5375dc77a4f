"""The README's Python snippets that talk to a server, run as written against the capture proxy
(``otel-capture proxy``, as the README starts it) in front of the real tiny model: only the proxy's URL and
the capture directory are the test's own (issue 33.6: the attachment snippet, copied, captured nothing)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from support import start_cli_proxy

from otel_capture.demo.tiny_model import TinyModel

pytestmark = pytest.mark.model

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_block(containing: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    [block] = [b for b in blocks if containing in b]
    return block


def test_the_attachment_snippet_attaches_the_call_it_made(
    tiny_model: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OTEL_CAPTURE_CORRELATION", "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR"):
        monkeypatch.delenv(name, raising=False)  # as in a fresh shell: the snippet must say what it needs
    capture_dir = tmp_path / "calls"
    process, url = start_cli_proxy(tiny_model.base_url, "--capture-dir", str(capture_dir))
    try:
        snippet = _python_block("attach_model_call_capture(result")
        assert '"http://127.0.0.1:41623"' in snippet and '"/data/calls"' in snippet
        code = snippet.replace('"http://127.0.0.1:41623"', repr(url)).replace(
            '"/data/calls"', repr(str(capture_dir))
        )
        namespace: dict[str, object] = {}
        exec(compile(code, "README.md (attachment)", "exec"), namespace)
        namespace["client"].close()  # type: ignore[attr-defined]  # the snippet's openai.OpenAI
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    result = namespace["result"]
    assert isinstance(result, dict)
    attachment = result["ng_model_call_capture"]
    assert attachment["rollout_id"] == "3-0-a1"
    assert "gaps" not in attachment, attachment["gaps"]
    [call] = attachment["calls"]
    assert call["status_code"] == 200
