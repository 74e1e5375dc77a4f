"""OpenAI Responses stream reassembly: ``/v1/responses`` events -> the ``response`` object.

Part of stream reassembly; see :mod:`otel_capture._dialects.reassembly` for the rules every accumulator follows.
"""

from __future__ import annotations

from typing import Any

from .sse import SSEEvent
from .stream import JsonDict, TerminalKind, _Accumulator, _event_type, _loads

__all__ = ["ResponsesAccumulator"]

_RESPONSE_SHELLS = frozenset({"response.created", "response.in_progress", "response.queued"})
_RESPONSE_TERMINALS: dict[str, TerminalKind] = {
    "response.completed": "completed",
    "response.incomplete": "incomplete",
    "response.failed": "failed",
}
# event type -> (item list field, index field, part type, part text field, field of the full text on .done)
_PART_TEXT_EVENTS: dict[str, tuple[str, str, str, str, str]] = {
    "response.output_text": ("content", "content_index", "output_text", "text", "text"),
    "response.refusal": ("content", "content_index", "refusal", "refusal", "refusal"),
    "response.reasoning_text": ("content", "content_index", "reasoning_text", "text", "text"),
    "response.reasoning_summary_text": ("summary", "summary_index", "summary_text", "text", "text"),
}
# event type -> (item field, field of the full value on .done, item type when the item never arrived)
_ITEM_TEXT_EVENTS: dict[str, tuple[str, str, str]] = {
    "response.function_call_arguments": ("arguments", "arguments", "function_call"),
    "response.custom_tool_call_input": ("input", "input", "custom_tool_call"),
    "response.mcp_call_arguments": ("arguments", "arguments", "mcp_call"),
    "response.code_interpreter_call_code": ("code", "code", "code_interpreter_call"),
}
_PART_EVENTS: dict[str, tuple[str, str]] = {
    "response.content_part.added": ("content", "content_index"),
    "response.content_part.done": ("content", "content_index"),
    "response.reasoning_summary_part.added": ("summary", "summary_index"),
    "response.reasoning_summary_part.done": ("summary", "summary_index"),
}


def _with_streamed_logprobs(old: object, new: JsonDict) -> JsonDict:
    """``new`` (a part from a ``.done`` event), with the log-probs its deltas streamed when it carries none
    (llama.cpp's done parts say ``"logprobs": []``), so a stream cut before its terminal event keeps them."""
    if isinstance(old, dict) and old.get("logprobs") and not new.get("logprobs"):
        return {**new, "logprobs": old["logprobs"]}
    return new


def _keep_streamed_logprobs(old_parts: object, new_parts: list[Any]) -> list[Any]:
    if not isinstance(old_parts, list):
        return new_parts
    return [
        _with_streamed_logprobs(old_parts[i], part) if i < len(old_parts) and isinstance(part, dict) else part
        for i, part in enumerate(new_parts)
    ]


class ResponsesAccumulator(_Accumulator):
    """``/v1/responses`` events -> the ``response`` object."""

    # What a chunk ending the stream contains (.deferred): a terminal type, in its JSON or ``event:`` line
    # (``complete`` is in response.completed and response.incomplete: one scan for both), or a JSON escape
    # (through which one could be spelled)
    TERMINAL_MARKERS = (b"complete", b"response.failed", b"error", b"\\u")

    def __init__(self) -> None:
        super().__init__()
        self._shell: JsonDict | None = None  # latest response.created / in_progress / queued
        self._final: JsonDict | None = None  # the first terminal event's response
        self._items: dict[int, JsonDict] = {}  # output_index -> item, added then replaced when done
        self._index_by_id: dict[str, int] = {}
        self._last_index: int | None = None

    def _add(self, event: SSEEvent) -> bool:
        payload = _loads(event.data)
        if payload is None:
            return False
        kind = _event_type(payload, event)
        if kind is None:
            return False
        if kind in _RESPONSE_SHELLS:
            response = payload.get("response")
            if isinstance(response, dict):
                self._shell = response
            return False
        if kind in _RESPONSE_TERMINALS:
            return self._terminal(_RESPONSE_TERMINALS[kind], payload)
        if kind == "error":
            self._finish("error")
            error = payload.get("error")
            self._record_error(
                error if isinstance(error, dict) else {k: v for k, v in payload.items() if k != "type"}
            )
            return False
        if kind in ("response.output_item.added", "response.output_item.done"):
            return self._put_item(payload, done=kind.endswith(".done"))
        if kind in _PART_EVENTS:
            return self._put_part(payload, *_PART_EVENTS[kind])
        if kind == "response.output_text.annotation.added":
            return self._add_annotation(payload)
        stem, _, suffix = kind.rpartition(".")
        if suffix in ("delta", "done"):
            if stem in _PART_TEXT_EVENTS:
                return self._part_text(payload, suffix == "done", *_PART_TEXT_EVENTS[stem])
            if stem in _ITEM_TEXT_EVENTS:
                return self._item_text(payload, suffix == "done", *_ITEM_TEXT_EVENTS[stem])
        return False

    def _terminal(self, kind: TerminalKind, payload: JsonDict) -> bool:
        self._finish(kind)
        response = payload.get("response")
        if not isinstance(response, dict):
            return False
        if self._final is None:
            self._final = response
        if kind == "failed":
            self._record_error(response.get("error"))
        output = response.get("output")
        return isinstance(output, list) and bool(output)

    def _put_item(self, payload: JsonDict, *, done: bool) -> bool:
        item = payload.get("item")
        if not isinstance(item, dict):
            return False
        index = payload.get("output_index")
        item_id = item.get("id")
        if not isinstance(index, int):
            known = self._index_by_id.get(item_id) if isinstance(item_id, str) else None
            if known is not None:
                index = known
            elif done and not isinstance(item_id, str) and self._last_index is not None:
                index = self._last_index  # an id-less server: done closes the item it last opened
            else:
                index = max(self._items, default=-1) + 1
        old = self._items.get(index)
        if done and old is not None and isinstance(item.get("content"), list):
            item = {**item, "content": _keep_streamed_logprobs(old.get("content"), item["content"])}
        self._items[index] = item
        if isinstance(item_id, str):
            self._index_by_id[item_id] = index
        self._last_index = index
        if done:
            return True
        return item.get("type") != "message" and item.get("type") != "reasoning"

    def _item_for(self, payload: JsonDict, default_type: str) -> JsonDict:
        """The item an event refers to: by output_index, else item_id, else the last one opened."""
        index = payload.get("output_index")
        if isinstance(index, int) and index in self._items:
            return self._items[index]
        item_id = payload.get("item_id")
        if isinstance(item_id, str) and item_id in self._index_by_id:
            return self._items[self._index_by_id[item_id]]
        if not isinstance(index, int) and not isinstance(item_id, str) and self._last_index is not None:
            return self._items[self._last_index]
        # The item was never announced: make one so the delta is not lost.
        item: JsonDict = {"type": default_type, "status": "in_progress"}
        if isinstance(item_id, str):
            item["id"] = item_id
        if default_type == "message":
            item["role"] = "assistant"
        self._put_item({"item": item, "output_index": index}, done=False)
        return item

    def _part_list(self, item: JsonDict, field: str) -> list[Any]:
        parts = item.get(field)
        if not isinstance(parts, list):
            parts = item[field] = []
        return parts

    def _put_part(self, payload: JsonDict, field: str, index_field: str) -> bool:
        part = payload.get("part")
        if not isinstance(part, dict):
            return False
        item = self._item_for(payload, "reasoning" if field == "summary" else "message")
        parts = self._part_list(item, field)
        index = payload.get(index_field)
        if isinstance(index, int) and 0 <= index < len(parts):
            parts[index] = _with_streamed_logprobs(parts[index], part)
        elif not isinstance(index, int) and parts and parts[-1].get("type") == part.get("type"):
            parts[-1] = _with_streamed_logprobs(parts[-1], part)  # index-less: done replaces the last part
        else:
            parts.append(part)
        return False

    def _part_for(
        self, payload: JsonDict, field: str, index_field: str, part_type: str, key: str
    ) -> JsonDict:
        item = self._item_for(
            payload, "reasoning" if part_type.startswith(("reasoning", "summary")) else "message"
        )
        parts = self._part_list(item, field)
        index = payload.get(index_field)
        if isinstance(index, int) and 0 <= index < len(parts) and isinstance(parts[index], dict):
            part: JsonDict = parts[index]
            return part
        if not isinstance(index, int):
            for candidate in reversed(parts):
                if isinstance(candidate, dict) and candidate.get("type") == part_type:
                    return candidate
        part = {"type": part_type, key: ""}
        if part_type == "output_text":
            part["annotations"] = []
        parts.append(part)
        return part

    def _part_text(
        self, payload: JsonDict, done: bool, field: str, index_field: str, part_type: str, key: str, full: str
    ) -> bool:
        text = payload.get(full if done else "delta")
        if not isinstance(text, str):
            return False
        part = self._part_for(payload, field, index_field, part_type, key)
        if done:
            self._set(part, key, text)
            return False
        self._append(part, key, text)
        logprobs = payload.get("logprobs")
        if isinstance(logprobs, list) and logprobs:
            kept = part.get("logprobs")
            if isinstance(kept, list):
                kept.extend(logprobs)
            else:
                part["logprobs"] = list(logprobs)
        return bool(text)

    def _item_text(self, payload: JsonDict, done: bool, key: str, full: str, default_type: str) -> bool:
        text = payload.get(full if done else "delta")
        if not isinstance(text, str):
            return False
        item = self._item_for(payload, default_type)
        if done:
            self._set(item, key, text)
        else:
            self._append(item, key, text)
        return bool(text) and not done

    def _add_annotation(self, payload: JsonDict) -> bool:
        annotation = payload.get("annotation")
        if annotation is None:
            return False
        part = self._part_for(payload, "content", "content_index", "output_text", "text")
        annotations = part.get("annotations")
        if isinstance(annotations, list):
            annotations.append(annotation)
        else:
            part["annotations"] = [annotation]
        return False

    def _output(self) -> list[JsonDict]:
        return [self._items[index] for index in sorted(self._items)]

    def _result(self) -> JsonDict | None:
        if self._final is not None:
            if self._final.get("output") is None:
                # A terminal event may leave out the output; rebuild it from the items, as the SDK does.
                return {**self._final, "output": self._output()}
            return self._final
        if self._shell is None and not self._items:
            return None
        return {**(self._shell or {"object": "response"}), "output": self._output()}
