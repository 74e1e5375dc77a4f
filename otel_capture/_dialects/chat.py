"""OpenAI Chat Completions stream reassembly: chunks -> a ``chat.completion``, every choice kept apart.

Part of stream reassembly; see :mod:`otel_capture._dialects.reassembly` for the rules every accumulator follows.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from .sse import SSEEvent
from .stream import _LATEST_TOP, JsonDict, _ChoicesAccumulator, _merge, _Text

_logger = logging.getLogger(__name__)

__all__ = ["ChatCompletionsAccumulator"]

_CHAT_TEXT_FIELDS = frozenset({"content", "refusal", "reasoning_content", "reasoning"})
_ERROR = frozenset({"error"})


# How many usual chunks one add_data call reads for a template at most (:func:`_template`): a stream whose
# chunks differ in more than their content (log-probs, usage in each) is not looked at again and again
_TEMPLATE_ATTEMPTS = 8
# What a template's content is replaced by to check it: no quote, backslash or control character
_PROBE = "otel-capture:template-probe"


def _template(data: str, content: str) -> tuple[str, str] | None:
    """``(prefix, suffix)`` such that ``data`` is ``prefix + content + suffix`` and the JSON text
    ``prefix + c + suffix`` is ``data``'s with its one choice's delta content ``c`` instead, for every
    printable ``c`` without a quote or a backslash; ``None`` when ``data`` is not written so.

    The content is looked for as a quoted string with nothing to escape, and checked by parsing the text
    with a probe in its place: the parse must be ``data``'s but for that content. Any other such ``c``
    then lexes the same around it (nothing in it ends or escapes a string), so it is that content too."""
    if '"' in content or "\\" in content or not content.isprintable():
        return None
    at = data.rfind(f'"{content}"')
    if at < 0:
        return None
    prefix, suffix = data[: at + 1], data[at + 1 + len(content) :]
    try:
        probed = orjson.loads(prefix + _PROBE + suffix)
        expected = orjson.loads(data)
        expected["choices"][0]["delta"]["content"] = _PROBE
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return (prefix, suffix) if probed == expected else None


class _ChatChoice:
    __slots__ = (
        "extra",
        "finish_reason",
        "logprobs",
        "message",
        "token_ids",
        "tool_ids",
        "tool_last",
        "tools",
    )

    def __init__(self) -> None:
        self.message: JsonDict = {"role": None, "content": None, "refusal": None}
        self.tools: dict[int, JsonDict] = {}
        self.tool_ids: dict[str, int] = {}
        self.tool_last: int | None = None
        self.finish_reason: object = None
        self.logprobs: JsonDict | None = None
        self.token_ids: list[object] | None = None  # vLLM's per-chunk ``token_ids``, joined
        # vLLM's ``stop_reason`` (its last non-null value) and ``token_ids`` (null), once a chunk sent the key
        self.extra: JsonDict = {}


class ChatCompletionsAccumulator(_ChoicesAccumulator[_ChatChoice]):
    """``/v1/chat/completions`` chunks -> a ``chat.completion`` object, every choice kept apart."""

    _OBJECT = "chat.completion"
    _SKIPPED_TOP = frozenset({"choices", "usage", "object", "error", "obfuscation"})

    def add_data(self, datas: list[str]) -> None:
        """The usual chunk is read here in one loop, with what :meth:`add` would do to it and nothing else
        (as five calls deep it was 55 % of a streamed event's CPU; with vLLM's token ids and log-probs, 80 %):
        its top-level keys already settled and no ``error``, one choice already begun whose delta is only a
        ``content`` string, no finish reason or stop reason; its ``token_ids`` (a list, or null) and
        ``logprobs`` (an object, or null) are taken as :meth:`add` takes them. Any other event goes through
        :meth:`add`.

        Such a chunk with neither log-probs nor token ids is the text of the usual chunk before it with only
        its content changed (:func:`_template`); the next ones that are that text around another plain
        content are not parsed at all: their content is appended, and everything else they say was just
        taken from the one before (what nothing in between could have changed)."""
        event = SSEEvent(None, "")
        add = self.add
        loads = orjson.loads
        settled = self._settled_top
        plain = settled - _ERROR  # the top-level keys of a chunk read here; again when add settled more
        known = len(settled)
        top = self._top
        states = self._choices
        texts = self._texts
        group = _Text._GROUP
        merge_logprobs = self._merge_logprobs
        last: _ChatChoice | None = None  # the choice whose content ``tail`` is (looked up again after add)
        tail: list[str] = []  # its content's pieces (_Text.add, inlined)
        groups: list[str] = []
        payload: Any
        content: Any
        choice: Any
        delta: Any
        # the text of the last usual chunk around its content (_template), while nothing else came after it
        prefix = suffix = ""
        around = 0  # len(prefix) + len(suffix); 0: no template
        attempts = _TEMPLATE_ATTEMPTS
        for data in datas:
            if around and len(data) >= around and data.startswith(prefix) and data.endswith(suffix):
                content = data[len(prefix) : len(data) - len(suffix)]
                if '"' not in content and "\\" not in content and content.isprintable():
                    tail.append(content)
                    if len(tail) >= group:
                        groups.append("".join(tail))
                        tail.clear()
                    continue
            around = 0
            try:
                try:
                    payload = loads(data)
                except ValueError:  # [DONE], NaN and the like: add reads it, leniently
                    payload = None
                choices = (
                    payload.get("choices") if type(payload) is dict and plain.issuperset(payload) else None
                )
                choice = choices[0] if type(choices) is list and len(choices) == 1 else None
                delta = choice.get("delta") if type(choice) is dict else None
                content = delta.get("content") if type(delta) is dict and len(delta) == 1 else None
                index = choice.get("index", 0) if type(content) is str else None
                state = states.get(index) if type(index) is int else None
                logprobs = choice.get("logprobs") if state is not None else None
                if (
                    state is None
                    or (logprobs is not None and type(logprobs) is not dict)
                    or choice.get("finish_reason")
                    or "stop_reason" in choice
                ):
                    event.data = data
                    add(event)
                    last = None
                    if len(settled) != known:
                        plain = settled - _ERROR
                        known = len(settled)
                    continue
                for key in _LATEST_TOP:
                    value = payload.get(key)
                    if value is not None:
                        top[key] = value
                usage = payload.get("usage")
                if type(usage) is dict:
                    self._usage = usage
                if state is not last:
                    message = state.message
                    text = texts.get((id(message), "content"))
                    if text is None:
                        text = texts[(id(message), "content")] = _Text(message, "content")
                    tail, groups = text.tail, text.groups
                    last = state
                tail.append(content)
                if len(tail) >= group:
                    groups.append("".join(tail))
                    tail.clear()
                if logprobs is not None:
                    # vLLM's usual chunk: ``{"content": [its token's entry]}``, the choice's list begun
                    kept = state.logprobs.get("content") if state.logprobs is not None else None
                    tokens = logprobs.get("content")
                    if type(kept) is list and type(tokens) is list and len(logprobs) == 1:
                        kept.extend(tokens)
                    else:
                        merge_logprobs(state, logprobs)
                if "token_ids" in choice:
                    token_ids = choice["token_ids"]
                    if type(token_ids) is list:
                        if state.token_ids is None:
                            state.token_ids = []
                        state.token_ids.extend(token_ids)
                    state.extra.setdefault("token_ids", None)
                elif logprobs is None and attempts:
                    attempts -= 1
                    found = _template(data, content)
                    if found is not None:
                        prefix, suffix = found
                        around = len(prefix) + len(suffix)
            except Exception:  # telemetry never breaks the host app; the tests assert this stays at 0
                self.internal_errors += 1
                last = None
                around = 0
                _logger.debug("skipped a stream event that could not be reassembled", exc_info=True)

    def _add_choice(self, choice: JsonDict) -> bool:
        index = choice.get("index")
        if not isinstance(index, int):
            index = 0
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _ChatChoice()
        carried = False
        delta = choice.get("delta")
        if isinstance(delta, dict):
            carried = self._merge_delta(state, delta)
        finish_reason = choice.get("finish_reason")
        if finish_reason:
            state.finish_reason = finish_reason
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            self._merge_logprobs(state, logprobs)
        if "token_ids" in choice:
            token_ids = choice["token_ids"]
            if isinstance(token_ids, list):
                if state.token_ids is None:
                    state.token_ids = []
                state.token_ids.extend(token_ids)
            state.extra.setdefault("token_ids", None)  # sent as null only: null, as the non-streaming body
        if "stop_reason" in choice:
            stop_reason = choice["stop_reason"]
            if stop_reason is not None or "stop_reason" not in state.extra:
                state.extra["stop_reason"] = stop_reason
        return carried

    @staticmethod
    def _merge_logprobs(state: _ChatChoice, logprobs: JsonDict) -> None:
        if state.logprobs is None:
            state.logprobs = {"content": None, "refusal": None}
        for key in ("content", "refusal"):
            tokens = logprobs.get(key)
            if isinstance(tokens, list):
                kept = state.logprobs.get(key)
                if isinstance(kept, list):
                    kept.extend(tokens)
                else:
                    state.logprobs[key] = list(tokens)

    def _merge_delta(self, state: _ChatChoice, delta: JsonDict) -> bool:
        message = state.message
        carried = False
        for key, value in delta.items():
            if key in _CHAT_TEXT_FIELDS:
                if isinstance(value, str):
                    self._append(message, key, value)
                    carried = carried or bool(value)
            elif key == "tool_calls":
                if isinstance(value, list):
                    for call in value:
                        if isinstance(call, dict) and self._merge_tool_call(state, call):
                            carried = True
            elif key == "role":
                if isinstance(value, str) and value:
                    message["role"] = value
            elif value is not None:
                message[key] = _merge(message.get(key), value)
                carried = carried or key in ("function_call", "audio")
        return carried

    def _merge_tool_call(self, state: _ChatChoice, delta: JsonDict) -> bool:
        index = delta.get("index")
        call_id = delta.get("id")
        if not isinstance(index, int):  # a server that omits the index: new id -> new call
            if isinstance(call_id, str) and call_id and call_id not in state.tool_ids:
                index = max(state.tools, default=-1) + 1
            else:
                index = state.tool_ids.get(call_id, state.tool_last) if isinstance(call_id, str) else None
                index = state.tool_last if index is None else index
                index = 0 if index is None else index
        call = state.tools.get(index)
        if call is None:
            call = state.tools[index] = {}
        state.tool_last = index
        if isinstance(call_id, str) and call_id:
            state.tool_ids[call_id] = index
        carried = False
        for key, value in delta.items():
            if key == "function":
                if isinstance(value, dict):
                    carried = self._merge_function(call, value) or carried
            elif key in ("id", "type"):
                if isinstance(value, str) and value:
                    call[key] = value
                    carried = True
            elif key != "index" and value is not None:
                call[key] = _merge(call.get(key), value)
        return carried

    def _merge_function(self, call: JsonDict, delta: JsonDict) -> bool:
        function = call.get("function")
        if not isinstance(function, dict):
            function = call["function"] = {}
        carried = False
        for key, value in delta.items():
            if key == "arguments":
                if isinstance(value, str):
                    self._append(function, "arguments", value)
                    carried = carried or bool(value)
            elif key == "name":
                if isinstance(value, str) and value:
                    function["name"] = value
                    carried = True
            elif value is not None:
                function[key] = _merge(function.get(key), value)
        return carried

    @staticmethod
    def _choice_result(index: int, state: _ChatChoice) -> JsonDict:
        message = dict(state.message)
        if message.get("role") is None:
            message["role"] = "assistant"
        if state.tools:
            calls = []
            for call_index in sorted(state.tools):
                call = {"id": None, "type": "function", **state.tools[call_index]}
                function = call.get("function")
                function = dict(function) if isinstance(function, dict) else {}
                function.setdefault("name", None)
                function.setdefault("arguments", "")
                call["function"] = function
                calls.append(call)
            message["tool_calls"] = calls
        result: JsonDict = {
            "index": index,
            "message": message,
            "finish_reason": state.finish_reason,
            "logprobs": state.logprobs,
        }
        result.update(state.extra)
        if state.token_ids is not None:
            result["token_ids"] = state.token_ids
        return result
