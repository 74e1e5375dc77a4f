"""The token family: prompt and generated token ids and log-probs of one call, when the upstream returned
them. A pure function: a response object in, ``{"prompt_token_ids", "generations"}`` out; the line of
``<dir>/<rollout_id>.tokens.jsonl`` they become is the record codec's
(:func:`otel_capture._records.codec.tokens_line`).

Shapes read (whichever are present; nothing is invented):

* vLLM, Chat Completions with ``return_token_ids``: top-level ``prompt_token_ids``, and
  ``choices[i].token_ids``;
* Chat Completions ``logprobs``: ``choices[i].logprobs.content[j].logprob`` (OpenAI, vLLM, llama.cpp); the
  token id from ``content[j].id`` (llama.cpp) or from a ``"token_id:N"`` token (vLLM's
  ``return_tokens_as_token_ids``) when ``token_ids`` is absent;
* Completions (``/v1/completions``): ``choices[i].token_ids`` and each choice's ``prompt_token_ids``
  (vLLM's, with ``return_token_ids``: one prompt for all choices, or each generation its own when the
  request had several prompts), the legacy ``choices[i].logprobs.token_logprobs`` (ids from vLLM's
  ``token_id:N`` tokens), without the prompt's entries that ``echo`` puts first
  (:func:`.completions.legacy_log_probs`);
* Responses: ``output[k].content[m].logprobs[j].logprob``; NeMo Gym's vLLM model server's
  ``prompt_token_ids`` / ``generation_token_ids`` / ``generation_log_probs`` on output items; a top-level
  ``prompt_token_ids``; vLLM's ``enable_response_messages``: top-level ``input_messages`` (the prompt's ids)
  and ``output_messages`` (the generated ids), lists of ``{"type": "raw_message_tokens", "tokens": [...]}``
  joined in order, the generated ids put beside the output items' log-probs.

* token-in/token-out (:mod:`.generate`): vLLM's ``/inference/v1/generate`` is read as Chat above
  (``choices[i].token_ids``, ``logprobs.content[j].logprob``, ``prompt_token_ids``); SGLang's ``/generate``
  gives ``output_ids`` and ``meta_info.output_token_logprobs`` (:func:`.generate.sglang_generations`); for
  both the prompt's ids are the request's (``token_ids``, ``input_ids``) when the answer has none.

An odd entry (a log-prob ``null``, NaN or ±inf; an id that is not one) is ``None`` and the rest of its list is
kept (:mod:`.token_values`); that it is odd, and whether the lists agree with each other and the usage, is
:mod:`.mismatch`'s (``docs/tokens.md``, "Odd entries" and "Token integrity").

A streamed response is read from its reassembled object (:mod:`.reassembly`), which keeps what the
non-streaming body carries: vLLM's first-chunk ``prompt_token_ids`` and per-chunk ``choices[i].token_ids``
joined, the chunks' ``logprobs.content`` joined, and a Responses stream's final response (or, for a stream
cut before it, the log-probs its ``response.output_text.delta`` events carried). So a streamed call and the
same call not streamed give the same line. Anthropic Messages has no log-probs (nor does llama.cpp's
``/v1/messages``): no line.
"""

from __future__ import annotations

from typing import Any

from .completions import legacy_log_probs
from .generate import generate_prompt_ids, is_sglang_body, sglang_generations
from .token_values import id_list, log_prob_list, spelled_ids, token_id

_DICT = {dict}


def _from_logprob_entries(
    entries: Any, need_ids: bool = True
) -> tuple[list[int | None] | None, list[float | None] | None]:
    """Ids (when any entry has one) and log-probs from a list of ``{token, logprob, ...}``; an odd entry
    (not an object, a log-prob ``null``/NaN/±inf, no id among entries that have one) is ``None`` there.
    An entry's id is its ``id`` (llama.cpp), else its ``"token_id:N"`` token (vLLM). Without ``need_ids``
    (the choice has its ``token_ids``), the ids are not read: ``None``."""
    if not isinstance(entries, list) or not entries:
        return None, None
    if set(map(type, entries)) != _DICT:
        entries = [entry if isinstance(entry, dict) else {} for entry in entries]
    log_probs = log_prob_list([entry.get("logprob") for entry in entries])
    if not need_ids:
        return None, log_probs
    ids = id_list([entry.get("id") for entry in entries])
    if ids is None or None in ids:
        spelled = spelled_ids([entry.get("token") for entry in entries])
        if spelled is not None:
            ids = (
                spelled
                if ids is None
                else [i if i is not None else s for i, s in zip(ids, spelled, strict=True)]
            )
    return ids, log_probs


def _index(choice: dict[str, Any], position: int) -> int:
    """A choice's ``index`` (an id-like integer), else its position in ``choices``."""
    index = token_id(choice.get("index"))
    return index if index is not None else position


def _usage_count(usage: Any, key: str) -> int | None:
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _echo_prompt_length(choices: list[Any], usage: Any) -> int | None:
    """With ``echo`` and neither token ids nor the prompt's ids, how many entries of each choice's legacy
    lists are the prompt's: the usage's ``prompt_tokens``, when every choice's lists start with the echo's
    ``null`` and their lengths less the prompt add up to the usage's ``completion_tokens`` (one prompt
    echoed in every choice); ``None`` otherwise (then nothing is kept rather than prompt and output mixed)."""
    prompt, completion = _usage_count(usage, "prompt_tokens"), _usage_count(usage, "completion_tokens")
    if prompt is None or completion is None:
        return None
    lengths = []
    for choice in choices:
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if not isinstance(values, list) or not values or values[0] is not None:
            return None
        lengths.append(len(values))
    return prompt if sum(lengths) - prompt * len(lengths) == completion else None


def _echo_prompt(choices: list[Any], usage: Any) -> int | None:
    """:func:`_echo_prompt_length` when some choice has neither token ids nor the prompt's ids."""
    if any(
        isinstance(c, dict) and c.get("token_ids") is None and c.get("prompt_token_ids") is None
        for c in choices
    ):
        return _echo_prompt_length(choices, usage)
    return None


def _generation(
    index: int, token_ids: list[int | None] | None, log_probs: list[float | None] | None
) -> dict[str, Any] | None:
    if token_ids is None and log_probs is None:
        return None
    return {"index": index, "token_ids": token_ids, "log_probs": log_probs}


def _chat_generations(choices: Any, usage: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if not isinstance(choices, list):
        return found
    echo_prompt: int | None = None
    echo_read = False  # looked for only when a legacy list without the prompt's ids needs it
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        index = _index(choice, position)
        token_ids = id_list(choice.get("token_ids"))
        log_probs = None
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            if isinstance(logprobs.get("token_logprobs"), list):  # /v1/completions' legacy lists
                prompt = id_list(choice.get("prompt_token_ids"))
                if prompt is None and not echo_read:
                    echo_prompt, echo_read = _echo_prompt(choices, usage), True
                ids, log_probs = legacy_log_probs(
                    logprobs, token_ids, echo_prompt if prompt is None else len(prompt)
                )
            else:
                ids, log_probs = _from_logprob_entries(logprobs.get("content"), token_ids is None)
            token_ids = token_ids if token_ids is not None else ids
        generation = _generation(index, token_ids, log_probs)
        if generation is not None:
            found.append(generation)
    return found


def _choice_prompts(choices: Any, generations: list[dict[str, Any]]) -> list[int | None] | None:
    """vLLM's ``/v1/completions`` puts ``prompt_token_ids`` on each choice: the one prompt of them all; for
    a request of several prompts (choices of different prompts) each generation carries its own."""
    if not isinstance(choices, list):
        return None
    prompts: dict[int, list[int | None]] = {}
    for position, choice in enumerate(choices):
        if isinstance(choice, dict) and (ids := id_list(choice.get("prompt_token_ids"))) is not None:
            prompts[_index(choice, position)] = ids
    distinct = {tuple(ids) for ids in prompts.values()}
    if len(distinct) == 1:
        return next(iter(prompts.values()))
    for generation in generations:
        if generation["index"] in prompts:
            generation["prompt_token_ids"] = prompts[generation["index"]]
    return None


def _responses_generations(output: Any) -> tuple[list[dict[str, Any]], list[int | None] | None]:
    found: list[dict[str, Any]] = []
    prompt: list[int | None] | None = None
    if not isinstance(output, list):
        return found, prompt
    for position, item in enumerate(output):
        if not isinstance(item, dict):
            continue
        prompt = prompt or id_list(item.get("prompt_token_ids"))
        token_ids = id_list(item.get("generation_token_ids"))
        log_probs = log_prob_list(item.get("generation_log_probs"))
        contents = item.get("content")
        if token_ids is None and log_probs is None and isinstance(contents, list):
            for part in contents:
                if isinstance(part, dict) and part.get("logprobs"):
                    ids, probs = _from_logprob_entries(part.get("logprobs"))
                    token_ids = (token_ids or []) + ids if ids is not None else token_ids
                    log_probs = (log_probs or []) + probs if probs is not None else log_probs
        generation = _generation(position, token_ids, log_probs)
        if generation is not None:
            found.append(generation)
    return found, prompt


def _raw_message_tokens(messages: Any) -> list[int | None] | None:
    """vLLM's ``input_messages`` / ``output_messages`` (``enable_response_messages``): the ``tokens`` of
    its ``raw_message_tokens`` entries joined; ``None`` when there is none or one is not a list of ids."""
    if not isinstance(messages, list) or not messages:
        return None
    joined: list[int | None] = []
    for message in messages:
        if not isinstance(message, dict) or message.get("type") != "raw_message_tokens":
            return None
        tokens = id_list(message.get("tokens"))
        if tokens is None:
            return None
        joined += tokens
    return joined


def _with_output_ids(generations: list[dict[str, Any]], output: Any, ids: list[int | None]) -> None:
    """Put a Responses call's generated ids (``output_messages``) beside its log-probs: into the one
    generation without ids, or a new generation (the first message item's position) when there is none.
    Several generations without ids cannot be told apart: left as they are."""
    missing = [g for g in generations if g["token_ids"] is None]
    if len(missing) == 1:
        missing[0]["token_ids"] = ids
    elif not generations:
        index = 0
        if isinstance(output, list):
            index = next(
                (
                    i
                    for i, item in enumerate(output)
                    if isinstance(item, dict) and item.get("type") == "message"
                ),
                0,
            )
        generations.append({"index": index, "token_ids": ids, "log_probs": None})


def _carries_none(response: dict[str, Any]) -> bool:
    """Whether an answer has none of the keys any shape above reads tokens from (most answers: a Chat or
    Completions answer without token ids or log-probs), so that :func:`extract_tokens` need not read it."""
    if "prompt_token_ids" in response or "output" in response or "meta_info" in response:
        return False
    choices = response.get("choices")
    if type(choices) is not list:
        return choices is None
    for choice in choices:
        if (
            type(choice) is not dict
            or choice.get("token_ids") is not None
            or choice.get("prompt_token_ids") is not None
            or choice.get("logprobs") is not None
        ):
            return False
    return True


def extract_tokens(
    response: dict[str, Any] | None, request: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """``{"prompt_token_ids", "generations"}`` from a response object; ``None`` when it carries none. The
    ``request`` gives a token-in/token-out call's prompt ids when the answer does not repeat them."""
    if not isinstance(response, dict):
        return None
    if _carries_none(response):
        return None
    prompt = id_list(response.get("prompt_token_ids"))
    generations = _chat_generations(response.get("choices"), response.get("usage"))
    if not generations and is_sglang_body(response):
        generations = sglang_generations(response)
    if prompt is None:
        prompt = _choice_prompts(response.get("choices"), generations)
    if "output" in response:
        more, item_prompt = _responses_generations(response.get("output"))
        generations += more
        prompt = prompt if prompt is not None else item_prompt
        if prompt is None:
            prompt = _raw_message_tokens(response.get("input_messages"))
        output_ids = _raw_message_tokens(response.get("output_messages"))
        if output_ids is not None:
            _with_output_ids(generations, response.get("output"), output_ids)
    if prompt is None and not generations:
        return None
    return with_request_prompt({"prompt_token_ids": prompt, "generations": generations}, request)


def with_request_prompt(found: dict[str, Any], request: dict[str, Any] | None) -> dict[str, Any]:
    """``found`` (:func:`extract_tokens` of a response alone) with a token-in/token-out request's prompt
    ids when the answer has generations but did not repeat them: what ``extract_tokens(response, request)``
    returns, without reading the response again (a new dict when it adds them)."""
    if found["prompt_token_ids"] is None and found["generations"] and request is not None:
        prompt = id_list(generate_prompt_ids(request))
        if prompt is not None:
            return {**found, "prompt_token_ids": prompt}
    return found
