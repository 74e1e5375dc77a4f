"""The legacy ``/v1/completions`` dialect (OpenAI's text completions, as vLLM and SGLang serve it for
token-in/token-out training): stream reassembly, the semconv messages and the legacy log-probs.

Shapes are vLLM's (``vllm/entrypoints/openai/completion/protocol.py`` and ``serving.py``, vLLM main at
commit d5dba2d7b0ab9b98096560c69db7126b54b14d79 and cc139d8ea6ff4db984778a3e77e95e1d1c7f1362; see
``docs/tokens.md``), which are OpenAI's plus a few fields:

- the request: ``prompt`` as text, a list of texts, a list of token ids or a list of lists of them;
  ``logprobs: N`` (``0`` asks for the sampled token's log-prob alone), vLLM's ``return_token_ids``,
  ``prompt_logprobs``, ``echo``;
- a choice: ``index``, ``text``, ``finish_reason``, ``logprobs`` (``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``, four lists, one entry per token), and vLLM's ``stop_reason``,
  ``token_ids``, ``prompt_token_ids`` and ``prompt_logprobs`` (per choice: a request with several prompts
  has choices of different prompts);
- a stream: one ``text_completion`` chunk per engine step and choice, whose choice carries that step's
  ``text``, ``logprobs`` (the four lists of the step's tokens, ``text_offset`` counted from the start of
  the text) and ``token_ids``; the choice's first chunk carries ``prompt_token_ids``, its last one the
  ``finish_reason``; then a usage chunk with ``choices: []`` (with ``stream_options.include_usage``) and
  ``data: [DONE]``.

llama.cpp's server answers ``/v1/completions`` with Chat's log-probs instead (``logprobs.content[]``, each
``{id, token, bytes, logprob, top_logprobs}``): they are joined the same way, and read as Chat's for the
tokens line.

The reassembled object is the non-streaming body: texts and the log-prob lists joined per choice (the ones
the stream sent),
``token_ids`` joined, a key vLLM sent (``stop_reason``, ``token_ids``, ``prompt_token_ids``,
``prompt_logprobs``) kept even when it stayed null, as the non-streaming body has it.
"""

from __future__ import annotations

from typing import Any

from .stream import JsonDict, _ChoicesAccumulator
from .token_values import log_prob_list, spelled_ids

__all__ = [
    "LEGACY_LOGPROB_LISTS",
    "CompletionsAccumulator",
    "completions_input",
    "completions_output",
    "legacy_log_probs",
]

LEGACY_LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
# llama.cpp's /v1/completions sends Chat's shape instead, ``logprobs.content[]`` (``{id, token, logprob}``)
_LOGPROB_LISTS = (*LEGACY_LOGPROB_LISTS, "content")
# vLLM's additions to a choice: the last non-null value wins (the first for the prompt's, sent once)
_CHOICE_EXTRAS = ("stop_reason", "prompt_token_ids", "prompt_logprobs")


class _Choice:
    __slots__ = ("extra", "finish_reason", "logprobs", "text", "token_ids")

    def __init__(self) -> None:
        self.text: JsonDict = {"text": ""}
        self.finish_reason: object = None
        self.logprobs: dict[str, list[Any]] | None = None
        self.token_ids: list[object] | None = None
        self.extra: JsonDict = {}


class CompletionsAccumulator(_ChoicesAccumulator[_Choice]):
    """``/v1/completions`` chunks -> a ``text_completion`` object, every choice kept apart."""

    _OBJECT = "text_completion"
    _SKIPPED_TOP = frozenset({"choices", "usage", "object", "error"})

    def _add_without_choices(self, payload: JsonDict) -> None:
        if payload.get("stop") is True:
            # llama.cpp's native /completions (what it serves without /v1): its last event says "stop"
            self._finish("completed")

    def _add_choice(self, choice: JsonDict) -> bool:
        index = choice.get("index")
        if not isinstance(index, int):
            index = 0
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _Choice()
        carried = False
        text = choice.get("text")
        if isinstance(text, str) and text:
            self._append(state.text, "text", text)
            carried = True
        finish_reason = choice.get("finish_reason")
        if finish_reason:
            state.finish_reason = finish_reason
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            if state.logprobs is None:
                state.logprobs = {}
            for key in _LOGPROB_LISTS:
                values = logprobs.get(key)
                if isinstance(values, list):
                    state.logprobs.setdefault(key, []).extend(values)
        if "token_ids" in choice:
            token_ids = choice["token_ids"]
            if isinstance(token_ids, list):
                if state.token_ids is None:
                    state.token_ids = []
                state.token_ids.extend(token_ids)
                carried = carried or bool(token_ids)
            state.extra.setdefault("token_ids", None)
        for key in _CHOICE_EXTRAS:
            if key in choice:
                value, kept = choice[key], state.extra.get(key)
                if key not in state.extra or (value is not None and (kept is None or key == "stop_reason")):
                    state.extra[key] = value
        return carried

    @staticmethod
    def _choice_result(index: int, state: _Choice) -> JsonDict:
        result: JsonDict = {
            "index": index,
            "text": state.text["text"],
            "logprobs": state.logprobs,
            "finish_reason": state.finish_reason,
        }
        result.update(state.extra)
        if state.token_ids is not None:
            result["token_ids"] = state.token_ids
        return result


# -- the legacy log-probs, for the tokens line ---------------------------------------------------------


def legacy_log_probs(
    logprobs: object, token_ids: list[int | None] | None, prompt_length: int | None
) -> tuple[list[int | None] | None, list[float | None] | None]:
    """``(token ids, log-probs)`` of a choice's generated tokens from its legacy ``logprobs``
    (``token_logprobs``; ids only from vLLM's ``token_id:N`` tokens, ``return_tokens_as_token_ids``).
    An odd entry (``null``, NaN, ±inf; a token that is not ``token_id:N`` among ones that are) is ``None``.

    With ``echo`` the lists start with the prompt's tokens, the first of which has no log-prob (``null``):
    the generated ones are then the last ``len(token_ids)`` (or all after the ``prompt_length`` first);
    when neither is known nothing is returned rather than a list that mixes prompt and output.
    """
    if not isinstance(logprobs, dict):
        return None, None
    values = logprobs.get("token_logprobs")
    if not isinstance(values, list) or not values:
        return None, None
    tokens = logprobs.get("tokens")
    tokens = tokens if isinstance(tokens, list) and len(tokens) == len(values) else None
    start = 0
    if values[0] is None:  # echo: the prompt's tokens come first (or an odd first entry: told apart so)
        if token_ids is not None and len(token_ids) <= len(values):
            start = len(values) - len(token_ids)
        elif prompt_length is not None and prompt_length <= len(values):
            start = prompt_length
        else:
            return None, None
    ids = spelled_ids(tokens[start:]) if tokens is not None else None
    return ids, log_prob_list(values[start:])


# -- the semconv messages -------------------------------------------------------------------------------


def _prompt_part(prompt: object) -> dict[str, Any] | None:
    if isinstance(prompt, str):
        return {"type": "text", "content": prompt}
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        # a prompt of token ids: no text to show; the semconv's generic part says what it was
        return {"type": "token_ids", "content": f"{len(prompt)} token ids"}
    return None


def completions_input(request: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """One user message per prompt (a request may carry several, as texts or as lists of token ids)."""
    prompt = request.get("prompt")
    prompts: list[Any]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt  # several prompts (texts, or lists of token ids)
    else:
        prompts = [prompt]
    messages = []
    for one in prompts:
        part = _prompt_part(one)
        if part is not None:
            messages.append({"role": "user", "parts": [part]})
    return [], messages


def completions_output(response: dict[str, Any]) -> list[Any]:
    output: list[dict[str, Any]] = []
    for choice in response.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        text = choice.get("text")
        output.append(
            {
                "role": "assistant",
                "parts": [{"type": "text", "content": text if isinstance(text, str) else ""}],
                "finish_reason": choice.get("finish_reason") or "error",
            }
        )
    return output
