"""The token-in/token-out ``generate`` dialect: vLLM's ``POST /inference/v1/generate`` and SGLang's native
``POST /generate``. Stream reassembly, the semconv messages, the finish reasons and the token ids and
log-probs of the two shapes (``docs/tokens.md``, "Token-in/token-out: the generate dialect", names the
sources and their commits).

vLLM 0.32.0 (``vllm/entrypoints/scale_out/token_in_token_out/``, served with ``--enable-scale-out``):

- the request: ``token_ids`` (the prompt), ``sampling_params`` (vLLM's ``SamplingParams``: ``max_tokens``,
  ``temperature``, ``logprobs: N``, ``n``...), ``model``, ``stream``, ``stream_options``,
  ``return_token_ids`` (the prompt's ids back), ``output_mode`` (``tokens``, or ``text`` for texts too);
- the body: ``request_id``, ``model``, ``created``, ``usage`` (OpenAI's ``prompt_tokens``,
  ``completion_tokens``, ``total_tokens``), ``prompt_token_ids`` (with ``return_token_ids``), and
  ``choices[i]``: ``index``, ``finish_reason``, ``stop_reason``, ``token_ids``, ``logprobs.content[j]``
  (``{token_id, logprob, rank, top_logprobs}``; in text mode Chat's ``{token, logprob, bytes,
  top_logprobs}``), ``text`` (text mode), ``routed_experts``, ``sampling_mask``, ``weight_versions``;
- a stream: one chunk per engine step and choice (``request_id`` and one choice with that step's
  ``token_ids``, ``logprobs`` and ``text``; the first carries ``prompt_token_ids``; the last of a choice its
  ``finish_reason``), then with ``stream_options.include_usage`` a usage chunk (``choices: []``), then
  ``data: [DONE]``; an error is a ``{"error": {...}}`` chunk before ``[DONE]``. No ``model`` in a chunk.

SGLang (``python/sglang/srt/entrypoints/http_server.py``, ``managers/tokenizer_manager.py``):

- the request: ``input_ids`` (or ``text``), ``sampling_params`` (``max_new_tokens``, ``temperature``...),
  ``return_logprob``, ``top_logprobs_num``, ``stream``;
- the body: ``{"text", "output_ids", "meta_info"}`` (``text`` absent with ``skip_tokenizer_init``), maybe
  ``prompt_token_ids``; ``meta_info``: ``id``, ``finish_reason`` (``{"type": "stop" | "length" | "abort",
  ...}`` or ``null``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``weight_version``,
  with ``return_logprob`` ``output_token_logprobs`` (``[[logprob, token_id, text | null], ...]``) and
  ``input_token_logprobs``;
- a stream: ``data: <out>`` per step, then ``data: [DONE]`` (``{"error": {"message"}}`` before it on an
  error). By default every chunk is the whole answer so far (``text``, ``output_ids`` and the log-prob
  lists cumulative); with ``--incremental-streaming-output`` each carries only its step's text, ids and
  log-prob entries. A chunk says which: cumulative when its ``output_ids`` are as many as
  ``meta_info.completion_tokens`` and start with the ids so far, incremental when they add up to it.

The reassembled object is the non-streaming body: for vLLM the chunks' top-level keys (the first non-null
value; the last ``usage``) and every choice with its ``token_ids``, ``logprobs.content``, ``text`` and
``sampling_mask`` joined and its other keys' last non-null value; for SGLang ``text``, ``output_ids`` and
``meta_info`` (the last chunk's, its per-token lists joined when incremental). A batched SGLang call (a list
of prompts, or ``n > 1``: chunks of several ``index``) answers a list, which is no record's response: its
stream is not reassembled (the record keeps it raw).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .stream import JsonDict, _Accumulator

__all__ = [
    "GenerateAccumulator",
    "generate_finish_reasons",
    "generate_input",
    "generate_output",
    "generate_prompt_ids",
    "is_sglang_body",
    "sglang_facts",
    "sglang_generations",
]

# SGLang's meta_info lists with one entry per output token: sliced per chunk by incremental streaming
_SGLANG_PER_TOKEN = frozenset(
    {
        "output_token_logprobs",
        "output_top_logprobs",
        "output_token_ids_logprobs",
        "output_token_sampling_mask",
        "output_token_sampling_logprobs",
    }
)
_SGLANG_BODY = ("text", "output_ids", "meta_info")


def _int_list(value: object) -> list[int] | None:
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value
    return None


def is_sglang_body(response: Mapping[str, Any]) -> bool:
    """An SGLang native ``/generate`` answer: a ``meta_info`` object beside ``output_ids`` or ``text``."""
    return isinstance(response.get("meta_info"), dict) and ("output_ids" in response or "text" in response)


# -- stream reassembly -----------------------------------------------------------------------------------


class _VllmChoice:
    __slots__ = ("content", "fields", "has_logprobs", "sampling_mask", "text", "token_ids")

    def __init__(self) -> None:
        self.fields: JsonDict = {}  # finish_reason, stop_reason, routed_experts...: the last non-null
        self.token_ids: list[int] | None = None
        self.content: list[Any] | None = None
        self.has_logprobs = False
        self.sampling_mask: list[Any] | None = None
        self.text: JsonDict | None = None  # {"text": ...}, streamed through _Accumulator._append


class _SglangOutput:
    __slots__ = ("cumulative", "ids", "meta", "text", "top")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text: JsonDict | None = None
        self.meta: JsonDict = {}
        self.top: JsonDict = {}  # prompt_token_ids, index and what else the chunks carry
        self.cumulative = True  # SGLang's default; decided again by each chunk that can tell


def _cumulative(kept: list[int], ids: list[int], completion_tokens: object) -> bool | None:
    """Whether a chunk's ``output_ids`` are the whole output so far (``None``: it cannot tell)."""
    if not kept:
        return None  # the first chunk: both readings give the same answer
    prefix = len(ids) >= len(kept) and ids[: len(kept)] == kept
    if type(completion_tokens) is int:
        if len(kept) + len(ids) == completion_tokens:
            return False
        if prefix and len(ids) == completion_tokens:
            return True
    return prefix


class GenerateAccumulator(_Accumulator):
    """vLLM generate chunks or SGLang ``/generate`` chunks -> the non-streaming body of either."""

    def __init__(self) -> None:
        super().__init__()
        self._top: JsonDict = {}
        self._usage: object = None
        self._choices: dict[int, _VllmChoice] = {}
        self._sglang: dict[int | None, _SglangOutput] = {}
        self._seen = False

    def _add(self, event: Any) -> bool:
        payload = self._chunk_payload(event)
        if payload is None:
            return False
        self._seen = True
        if payload.get("error") is not None or event.event == "error":
            return False  # an error chunk carries nothing else here (the error was kept)
        if isinstance(payload.get("choices"), list):
            return self._add_vllm(payload)
        if any(key in payload for key in _SGLANG_BODY):
            return self._add_sglang(payload)
        return False

    # vLLM

    def _add_vllm(self, payload: JsonDict) -> bool:
        top = self._top
        for key, value in payload.items():
            if key not in ("choices", "usage") and top.get(key) is None:
                top[key] = value
        if isinstance(payload.get("usage"), dict):
            self._usage = payload["usage"]
        carried = False
        for choice in payload["choices"]:
            if isinstance(choice, dict) and self._add_vllm_choice(choice):
                carried = True
        return carried

    def _add_vllm_choice(self, choice: JsonDict) -> bool:
        index = choice.get("index")
        index = index if type(index) is int else 0
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _VllmChoice()
        carried = False
        for key, value in choice.items():
            if key == "index":
                continue
            if key == "token_ids":
                if isinstance(value, list):
                    state.token_ids = (state.token_ids or []) + value
                    carried = carried or bool(value)
            elif key == "logprobs":
                state.has_logprobs = True
                content = value.get("content") if isinstance(value, dict) else None
                if isinstance(content, list):
                    state.content = (state.content or []) + content
            elif key == "sampling_mask":
                if isinstance(value, list):
                    state.sampling_mask = (state.sampling_mask or []) + value
                else:
                    state.fields.setdefault(key, None)
            elif key == "text":
                if state.text is None:
                    state.text = {"text": ""}
                if isinstance(value, str) and value:
                    self._append(state.text, "text", value)
                    carried = True
            elif value is not None or key not in state.fields:
                state.fields[key] = value
        return carried

    # SGLang

    def _add_sglang(self, payload: JsonDict) -> bool:
        key = payload.get("index")
        key = key if type(key) is int else None  # an int, as SGLang sends it (and hashable)
        state = self._sglang.get(key)
        if state is None:
            state = self._sglang[key] = _SglangOutput()
        meta = payload.get("meta_info")
        meta = meta if isinstance(meta, dict) else {}
        ids = _int_list(payload.get("output_ids"))
        before = len(state.ids)
        if ids is not None:
            decided = _cumulative(state.ids, ids, meta.get("completion_tokens"))
            if decided is not None:
                state.cumulative = decided
            state.ids = list(ids) if state.cumulative or not state.ids else state.ids + ids
        cumulative = state.cumulative
        carried = len(state.ids) > before
        text = payload.get("text")
        if isinstance(text, str):
            if state.text is None:
                state.text = {"text": ""}
            if cumulative:
                carried = carried or len(text) > len(state.text.get("text") or "")
                self._set(state.text, "text", text)
            elif text:
                self._append(state.text, "text", text)
                carried = True
        for name, value in meta.items():
            if name in _SGLANG_PER_TOKEN and isinstance(value, list) and not cumulative:
                kept = state.meta.get(name)
                state.meta[name] = (kept if isinstance(kept, list) else []) + value
            else:
                state.meta[name] = value
        for name, value in payload.items():
            if name not in _SGLANG_BODY and (value is not None or name not in state.top):
                state.top[name] = value
        return carried

    def _result(self) -> JsonDict | None:
        if not self._seen:
            return None
        if self._choices or not self._sglang:
            return self._vllm_result()
        if len(self._sglang) > 1:
            return None  # a batch answers a list: no record response (the raw stream is kept)
        state = next(iter(self._sglang.values()))
        result: JsonDict = {}
        if state.text is not None:
            result["text"] = state.text["text"]
        result["output_ids"] = state.ids
        result["meta_info"] = state.meta
        for name, value in state.top.items():
            result.setdefault(name, value)
        return result

    def _vllm_result(self) -> JsonDict:
        result: JsonDict = dict(self._top)
        choices = []
        for index in sorted(self._choices):
            state = self._choices[index]
            choice: JsonDict = {"index": index}
            if state.text is not None:
                choice["text"] = state.text["text"]
            choice.update(state.fields)
            choice["token_ids"] = state.token_ids
            if state.has_logprobs:
                choice["logprobs"] = None if state.content is None else {"content": state.content}
            if state.sampling_mask is not None:
                choice["sampling_mask"] = state.sampling_mask
            choices.append(choice)
        result["choices"] = choices
        if self._usage is not None:
            result["usage"] = self._usage
        return result


# -- finish reasons, tokens and record facts ---------------------------------------------------------------


def _sglang_finish_reason(meta: Mapping[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        reason = reason.get("type")
    return reason if isinstance(reason, str) else None


def generate_finish_reasons(response: Mapping[str, Any]) -> list[str]:
    """vLLM: each choice's ``finish_reason``; SGLang: ``meta_info.finish_reason.type``."""
    choices = response.get("choices")
    if isinstance(choices, list):
        return [
            reason
            for choice in choices
            if isinstance(choice, Mapping) and isinstance(reason := choice.get("finish_reason"), str)
        ]
    meta = response.get("meta_info")
    reason = _sglang_finish_reason(meta) if isinstance(meta, Mapping) else None
    return [reason] if reason is not None else []


def generate_prompt_ids(request: object) -> list[int] | None:
    """The prompt's token ids a generate request sent: vLLM's ``token_ids``, SGLang's ``input_ids`` (one
    prompt; a batch, a list of lists, gives ``None``)."""
    if not isinstance(request, Mapping):
        return None
    for key in ("token_ids", "input_ids"):
        ids = _int_list(request.get(key))
        if ids is not None:
            return ids
    return None


def sglang_generations(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The one generation of an SGLang answer: ``output_ids`` and the log-probs of
    ``meta_info.output_token_logprobs`` (ids from its entries when ``output_ids`` is absent)."""
    meta = response.get("meta_info")
    meta = meta if isinstance(meta, Mapping) else {}
    token_ids = _int_list(response.get("output_ids"))
    log_probs: list[float] | None = None
    entries = meta.get("output_token_logprobs")
    if isinstance(entries, list) and entries:
        values: list[float] = []
        ids: list[int] = []
        for entry in entries:
            if not isinstance(entry, list) or len(entry) < 2:
                values = []
                break
            logprob, token_id = entry[0], entry[1]
            if type(logprob) not in (int, float) or type(token_id) is not int:
                values = []
                break
            values.append(float(logprob))
            ids.append(token_id)
        if values:
            log_probs = values
            token_ids = token_ids if token_ids is not None else ids
    if token_ids is None and log_probs is None:
        return []
    index = response.get("index")
    return [{"index": index if type(index) is int else 0, "token_ids": token_ids, "log_probs": log_probs}]


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def sglang_facts(response: Mapping[str, Any]) -> dict[str, Any]:
    """The record facts an SGLang answer carries in ``meta_info`` (NeMo Gym's rules find none there):
    ``response_id``, ``finish_reason``, ``tokens_in``/``tokens_out``/``tokens_total``,
    ``tokens_reasoning`` and the cache read."""
    meta = response.get("meta_info")
    if not isinstance(meta, Mapping):
        return {}
    tokens_in, tokens_out = _count(meta.get("prompt_tokens")), _count(meta.get("completion_tokens"))
    cached = _count(meta.get("cached_tokens"))
    response_id = meta.get("id")
    return {
        "response_id": response_id if isinstance(response_id, str) else None,
        "finish_reason": _sglang_finish_reason(meta),
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "tokens_total": None if tokens_in is None or tokens_out is None else tokens_in + tokens_out,
        "tokens_reasoning": _count(meta.get("reasoning_tokens")),
        "cached_tokens": cached,
        "cache_hit": None if cached is None else cached > 0,
    }


# -- the semconv messages ------------------------------------------------------------------------------------


def _ids_part(ids: list[int]) -> dict[str, Any]:
    # token ids are no text to show; the semconv's generic part says what they were
    return {"type": "token_ids", "content": f"{len(ids)} token ids"}


def generate_input(request: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """One user message: the prompt's text (SGLang's ``text``) or how many token ids it was."""
    text = request.get("text")
    if isinstance(text, str):
        return [], [{"role": "user", "parts": [{"type": "text", "content": text}]}]
    ids = generate_prompt_ids(request)
    if ids is not None:
        return [], [{"role": "user", "parts": [_ids_part(ids)]}]
    return [], []


def _output_message(text: object, ids: object, reason: str | None) -> dict[str, Any]:
    if isinstance(text, str):
        part: dict[str, Any] = {"type": "text", "content": text}
    else:
        part = _ids_part(_int_list(ids) or [])
    return {"role": "assistant", "parts": [part], "finish_reason": reason or "error"}


def generate_output(response: dict[str, Any]) -> list[Any]:
    """One assistant message per vLLM choice, or SGLang's one: its text, else how many token ids."""
    choices = response.get("choices")
    if isinstance(choices, list):
        return [
            _output_message(
                choice.get("text"),
                choice.get("token_ids"),
                reason if isinstance(reason := choice.get("finish_reason"), str) else None,
            )
            for choice in choices
            if isinstance(choice, dict)
        ]
    if is_sglang_body(response):
        reasons = generate_finish_reasons(response)
        return [_output_message(response.get("text"), response.get("output_ids"), next(iter(reasons), None))]
    return []
