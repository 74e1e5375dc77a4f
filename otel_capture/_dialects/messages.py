"""Anthropic Messages stream reassembly: ``/v1/messages`` events -> the ``message`` object.

Part of stream reassembly; see :mod:`otel_capture._dialects.reassembly` for the rules every accumulator follows.
"""

from __future__ import annotations

from pydantic_core import from_json

from .sse import SSEEvent
from .stream import JsonDict, _Accumulator, _event_type, _loads, _merge

__all__ = ["MessagesAccumulator"]

# delta type -> (block field, block type to start when the block never arrived)
_BLOCK_TEXT_DELTAS: dict[str, tuple[str, str]] = {
    "text_delta": ("text", "text"),
    "thinking_delta": ("thinking", "thinking"),
}


_STOP_FIELDS = ("stop_reason", "stop_sequence", "stop_details")


class MessagesAccumulator(_Accumulator):
    """``/v1/messages`` events -> the ``message`` object."""

    # What a chunk ending the stream contains (.deferred): ``message_stop`` or ``error``, in its JSON or
    # ``event:`` line, or a JSON escape (through which one could be spelled)
    TERMINAL_MARKERS = (b"message_stop", b"error", b"\\u")

    def __init__(self) -> None:
        super().__init__()
        self._message: JsonDict | None = None
        self._blocks: dict[int, JsonDict] = {}
        self._json: dict[int, list[str]] = {}  # block index -> input_json_delta pieces
        self._last_index: int | None = None

    def _add(self, event: SSEEvent) -> bool:
        payload = _loads(event.data)
        if payload is None:
            return False
        kind = _event_type(payload, event)
        if kind == "content_block_delta":
            return self._delta(payload)
        if kind == "content_block_start":
            return self._start_block(payload)
        if kind == "message_start":
            message = payload.get("message")
            if isinstance(message, dict) and self._message is None:
                self._message = message
                content = message.get("content")
                for index, block in enumerate(content if isinstance(content, list) else []):
                    if isinstance(block, dict):
                        self._blocks.setdefault(index, block)
        elif kind == "message_delta":
            self._message_delta(payload)
        elif kind == "message_stop":
            self._finish("completed")
        elif kind == "error":
            self._finish("error")
            self._record_error(payload.get("error", payload))
        return False

    def _start_block(self, payload: JsonDict) -> bool:
        block = payload.get("content_block")
        if not isinstance(block, dict):
            return False
        index = payload.get("index")
        if not isinstance(index, int):
            index = max(self._blocks, default=-1) + 1
        self._blocks[index] = block
        self._json.pop(index, None)
        self._last_index = index
        kind = block.get("type")
        if kind == "fallback":  # the beta SDK relabels the message with the model that served it
            target = block.get("to")
            model = target.get("model") if isinstance(target, dict) else None
            if isinstance(model, str):
                self._ensure_message()["model"] = model
        if kind in ("text", "thinking"):
            return bool(block.get(kind))
        return kind != "redacted_thinking" or bool(block.get("data"))

    def _block_for(self, payload: JsonDict, default_type: str) -> tuple[int, JsonDict]:
        index = payload.get("index")
        if not isinstance(index, int):
            index = self._last_index if self._last_index is not None else 0
        block = self._blocks.get(index)
        if block is None:  # a delta for a block that never started: keep its content anyway
            block = self._blocks[index] = {"type": default_type}
            if default_type == "tool_use":
                block["input"] = {}
        self._last_index = index
        return index, block

    def _delta(self, payload: JsonDict) -> bool:
        delta = payload.get("delta")
        if not isinstance(delta, dict):
            return False
        kind = delta.get("type")
        if kind in _BLOCK_TEXT_DELTAS:
            key, default_type = _BLOCK_TEXT_DELTAS[kind]
            text = delta.get(key)
            if not isinstance(text, str):
                return False
            _, block = self._block_for(payload, default_type)
            self._append(block, key, text)
            return bool(text)
        if kind == "input_json_delta":
            piece = delta.get("partial_json")
            if not isinstance(piece, str):
                return False
            index, _ = self._block_for(payload, "tool_use")
            self._json.setdefault(index, []).append(piece)
            return bool(piece)
        _, block = self._block_for(payload, "text")
        if kind == "signature_delta":
            signature = delta.get("signature")
            if isinstance(signature, str):
                block["signature"] = signature
        elif kind == "citations_delta":
            citations = block.get("citations")
            if isinstance(citations, list):
                citations.append(delta.get("citation"))
            else:
                block["citations"] = [delta.get("citation")]
        elif kind == "compaction_delta":
            block["content"] = delta.get("content")
            block["encrypted_content"] = delta.get("encrypted_content")
            return bool(delta.get("content"))
        else:
            for key, value in delta.items():
                if key != "type":
                    block[key] = _merge(block.get(key), value)
        return False

    def _ensure_message(self) -> JsonDict:
        if self._message is None:
            self._message = {"type": "message", "role": "assistant", "content": []}
        return self._message

    def _message_delta(self, payload: JsonDict) -> None:
        message = self._ensure_message()
        delta = payload.get("delta")
        if isinstance(delta, dict):
            for key in _STOP_FIELDS:  # set even when absent, as the SDK does
                message[key] = delta.get(key)
            for key, value in delta.items():
                if value is not None:
                    message[key] = value
        for key in ("context_management", "input_transformations"):
            if payload.get(key) is not None:
                message[key] = payload[key]
        usage = payload.get("usage")
        if isinstance(usage, dict):
            kept = message.get("usage")
            if not isinstance(kept, dict):
                kept = message["usage"] = {}
            for key, value in usage.items():  # cumulative totals: later values win, absent ones survive
                if value is not None:
                    kept[key] = value

    def _block_result(self, index: int, block: JsonDict) -> JsonDict:
        pieces = self._json.get(index)
        if not pieces:
            return block
        joined = "".join(pieces)
        if not joined:
            return block
        try:
            return {**block, "input": from_json(joined)}
        except ValueError:
            pass
        # Unfinished (``max_tokens`` or a cut stream): ``input`` is what the SDK reads, jiter's partial parse
        # (pydantic-core's is the same parser), and ``partial_json`` keeps the text that parse drops.
        try:
            return {**block, "input": from_json(joined, allow_partial=True), "partial_json": joined}
        except ValueError:  # not JSON at all: the SDK raises; the text is kept, ``input`` left as it started
            return {**block, "partial_json": joined}

    def _result(self) -> JsonDict | None:
        if self._message is None and not self._blocks:
            return None
        message = dict(self._ensure_message())
        message["content"] = [
            self._block_result(index, self._blocks[index]) for index in sorted(self._blocks)
        ]
        return message
