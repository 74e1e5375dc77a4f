"""Per-dialect stream reassembly: :class:`~otel_capture._dialects.sse.SSEEvent` in, response dict out.

One accumulator per streamed call turns the events of a Responses, Chat Completions, Anthropic Messages,
legacy Completions or token-in/token-out generate stream back into the object the non-streaming endpoint would have returned, and notes the dialect's
terminal event. The official SDKs' own accumulators are the reference (``tests/unit/test_reassembly.py``
compares against them on every recorded stream); where they differ on purpose it is said below.

Rules that fix NeMo Gym's reassembly:

- the terminal event comes from each payload's JSON ``type`` (or ``data: [DONE]``), not from ``event:``
  lines alone, so a ``data:``-only stream is still seen to complete; the first terminal event wins;
- a cut Responses stream keeps what its deltas carried (text, refusals, reasoning, tool-call arguments,
  output text log-probs), attached by ``output_index``/``content_index`` or, for servers that omit them
  (llama.cpp), by ``item_id`` or to the last open item; a ``.done`` part or item that carries no log-probs
  (llama.cpp's say ``"logprobs": []``) keeps the ones its deltas streamed;
- every chat choice is kept apart by its ``index``; logprobs, ``created`` and ``system_fingerprint`` are kept,
  and so are vLLM's token ids (``return_token_ids``): the first chunk's top-level ``prompt_token_ids`` and
  each chunk's ``choices[i].token_ids``, joined per choice as the non-streaming ``choices[i].token_ids``
  (the SDK keeps only a choice's first chunk's), with the choice's last ``stop_reason``;
- Anthropic ``server_tool_use`` input and ``signature``/``citations`` deltas are kept; a tool input whose JSON
  is unfinished (a stream cut by ``max_tokens``) reads as the SDK reads it, the partial parse of jiter (which
  pydantic-core shares): ``{"a": [1], "b": "unfinish`` gives ``{"a": [1]}``; the block also keeps the text as
  ``partial_json``, since that parse drops the unfinished value at the end. Text that is not JSON at all
  (the SDK raises) is kept as ``partial_json`` and ``input`` stays as the block started.

Nothing here raises on stream content: payloads that are not JSON objects are skipped, fields of the wrong
type are ignored, and as a last resort an unexpected exception is logged, counted in ``internal_errors``
and the event skipped. :meth:`result` returns the accumulator's own dicts: read them, do not mutate them
while the stream is still being fed.

Layout: this module is the interface (:func:`accumulator_for`, :class:`StreamAccumulator`); the interface
type, the fail-safe shell and JSON helpers are in :mod:`.stream`, one accumulator per dialect in
:mod:`.responses`, :mod:`.chat`, :mod:`.messages`, :mod:`.completions` and :mod:`.generate`, each named in the dialect table (:mod:`.table`).
"""

from __future__ import annotations

from .chat import ChatCompletionsAccumulator
from .completions import CompletionsAccumulator
from .messages import MessagesAccumulator
from .responses import ResponsesAccumulator
from .stream import StreamAccumulator, TerminalKind
from .table import DIALECTS, Dialect

__all__ = [
    "ChatCompletionsAccumulator",
    "CompletionsAccumulator",
    "Dialect",
    "MessagesAccumulator",
    "ResponsesAccumulator",
    "StreamAccumulator",
    "TerminalKind",
    "accumulator_for",
]


def accumulator_for(dialect: Dialect) -> StreamAccumulator:
    """A fresh accumulator for one stream of ``dialect``; ``ValueError`` for an unknown one."""
    spec = DIALECTS.get(dialect)
    if spec is None:
        raise ValueError(f"unknown dialect {dialect!r}")
    return spec.accumulator()
