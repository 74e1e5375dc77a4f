"""A small but complete rollout collector with model-call capture.

    python examples/rollout_collection/collect.py --out rollouts.jsonl                # starts the tiny model
    python examples/rollout_collection/collect.py --upstream http://127.0.0.1:8000 --out rollouts.jsonl

The loop, as a NeMo Gym style collector runs it:

1. a dataset of tasks (``tasks.jsonl``) becomes rows ``{**task, "_ng_task_index", "_ng_rollout_index"}``;
2. before each dispatch round the rows' captures are cleared (:func:`clear_model_call_captures`); a retry
   round first stamps ``_ng_attempt_index`` so the retried attempt has its own id (``2-0-a1``);
3. the agent calls the model server through the capture proxy at ``base_url_for_run(proxy, row)``, so
   every call lands in ``<capture-dir>/<rollout_id>.capture.jsonl``;
4. each result becomes a rollout record with ``ng_model_call_capture`` attached
   (:func:`attach_model_call_capture` with ``drop=True``: it waits up to ``wait_s`` for the rollout's calls
   still in flight, freezes the rollout, attaches exactly that snapshot and drops exactly it; a call still
   running then is a gap naming it, and its late line is refused by the fence), and the record is written to
   ``--out`` as one JSON line, flushed and ``fsync``-ed once per round. A rollout that failed every attempt
   gets no record; its attempts' captures stay in the capture directory for inspection. Each attached
   rollout's health verdict (the attachment's ``health``) is printed, and their counts at the end.

``drop=True`` lets the captures go before the record that carries them is durable (a crash in between
loses those calls): a collector that cannot afford that freezes with :func:`freeze_model_call_capture` and
calls :meth:`FrozenCapture.drop` after its ``fsync`` (``docs/attachment.md``).

A task with ``"environment_failures": n`` simulates an environment that crashes on the first ``n``
attempts, after the agent's first model call, to show a retry and where the failed attempt's call goes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from otel_capture import (
    CaptureStore,
    attach_model_call_capture,
    base_url_for_run,
    clear_model_call_captures,
    maybe_rollout_id_from_run_body,
    start_proxy,
)

_logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
DEFAULT_TASKS = HERE / "tasks.jsonl"
MAX_TOKENS = 8
MAX_ATTEMPTS = 2
PARALLEL = 4  # the tiny model serves four calls at once
CALL_TIMEOUT_S = 120.0
VERDICTS = ("healthy", "unhealthy", "unobserved")
WAIT_S = 5.0  # how long attaching waits for a rollout's calls still in flight (the default)

Say = Callable[[str], None]


class EnvironmentCrash(RuntimeError):
    """The task's environment failed (simulated): the rollout has no result and is retried."""


# --- the agent ------------------------------------------------------------------------------------------


@dataclass
class Agent:
    """Answers a task's question with two model calls: a streamed Chat Completions answer, then a
    Responses self-check. All it does for capture is build its base URL with ``base_url_for_run``."""

    model_server_url: str
    """The capture proxy (or a model server that runs the capture middleware), without ``/v1``."""
    model: str
    max_tokens: int = MAX_TOKENS
    capture: bool | None = None
    """The correlation gate; ``None``: ``OTEL_CAPTURE_CORRELATION`` / ``OTEL_EXPORTER_MODEL_CALL_JSONL_DIR``."""

    def run(self, body: dict[str, Any]) -> dict[str, Any]:
        base_url = base_url_for_run(self.model_server_url, body, enabled=self.capture) + "/v1"
        with openai.OpenAI(
            base_url=base_url, api_key="example", max_retries=0, timeout=CALL_TIMEOUT_S
        ) as client:
            answer, answer_id = self._answer(client, body["question"])
            if body.get("environment_failures", 0) > body.get("_ng_attempt_index", 0):
                raise EnvironmentCrash(f"the environment of task {body['_ng_task_index']} crashed")
            check = client.responses.create(
                model=self.model,
                input=f"Question: {body['question']}\nAnswer: {answer}\nIs the answer right?",
                max_output_tokens=self.max_tokens,
            )
        return {
            "response": {"answer": answer, "check": check.output_text},
            "reward": 1.0 if body.get("expected", "").lower() in answer.lower() else 0.0,
            # What the agent itself saw, to compare with what was captured.
            "trajectory": [
                {"api": "chat.completions", "response_id": answer_id},
                {"api": "responses", "response_id": check.id},
            ],
        }

    def _answer(self, client: openai.OpenAI, question: str) -> tuple[str, str]:
        stream = client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": question}],
            max_tokens=self.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, response_id = [], ""
        for chunk in stream:
            response_id = chunk.id or response_id
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
        return "".join(parts), response_id


# --- the collector --------------------------------------------------------------------------------------


@dataclass
class Summary:
    written: list[str] = field(default_factory=list)
    """Rollout ids with a record in the output, in the order written."""
    failed_attempts: list[str] = field(default_factory=list)
    """Attempts that raised; their captures are kept."""
    given_up: list[str] = field(default_factory=list)
    """Rollouts that failed every attempt (no record)."""
    verdicts: dict[str, str] = field(default_factory=dict)
    """Each written rollout's health verdict (the attachment's ``health``): healthy, unhealthy, unobserved."""

    def health_line(self) -> str:
        """``Rollout health: N checked, H healthy, U unhealthy, O unobserved``, over the written rollouts."""
        counts = {verdict: list(self.verdicts.values()).count(verdict) for verdict in VERDICTS}
        return f"Rollout health: {len(self.verdicts)} checked, " + ", ".join(
            f"{counts[verdict]} {verdict}" for verdict in VERDICTS
        )


def load_tasks(path: Path) -> list[dict[str, Any]]:
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def rows_for(tasks: Sequence[dict[str, Any]], rollouts_per_task: int) -> list[dict[str, Any]]:
    return [
        {**task, "_ng_task_index": task_index, "_ng_rollout_index": rollout_index}
        for task_index, task in enumerate(tasks)
        for rollout_index in range(rollouts_per_task)
    ]


def rollout_id_of(row: dict[str, Any]) -> str:
    rollout_id = maybe_rollout_id_from_run_body(row)
    if rollout_id is None:
        raise ValueError(f"row names no rollout: {row!r}")
    return rollout_id


def _dispatch(agent: Agent, rows: list[dict[str, Any]]) -> list[dict[str, Any] | BaseException]:
    def run(row: dict[str, Any]) -> dict[str, Any] | BaseException:
        try:
            return agent.run(row)
        except Exception as exc:  # one failed rollout never stops the collection
            _logger.debug("rollout %s failed", maybe_rollout_id_from_run_body(row), exc_info=True)
            return exc

    with ThreadPoolExecutor(max(1, min(PARALLEL, len(rows))), thread_name_prefix="rollout") as pool:
        return list(pool.map(run, rows))


def collect(
    tasks: Sequence[dict[str, Any]],
    agent: Agent,
    store: CaptureStore,
    out: Path,
    *,
    rollouts_per_task: int = 1,
    max_attempts: int = MAX_ATTEMPTS,
    say: Say = print,
) -> Summary:
    """Run every task's rollouts, retrying failed ones; append one record per finished rollout to ``out``."""
    summary = Summary()
    pending = rows_for(tasks, rollouts_per_task)
    with out.open("a") as records:
        for attempt in range(max_attempts):
            if not pending:
                break
            if attempt > 0:  # resume: the retry is a new attempt with its own rollout id
                pending = [{**row, "_ng_attempt_index": attempt} for row in pending]
            ids = [rollout_id_of(row) for row in pending]
            # After the stamp, before dispatch: each attempt starts with no captures (and no fence).
            cleared = clear_model_call_captures(store, ids)
            if cleared["failed"]:  # never dispatch an id whose old records may still be there
                raise RuntimeError(f"could not clear the captures of {cleared['failed']}")
            say(f"attempt {attempt}: dispatching {', '.join(ids)}")
            failed, written = [], []
            for row, rollout_id, outcome in zip(pending, ids, _dispatch(agent, pending), strict=False):
                if isinstance(outcome, BaseException):
                    say(f"  {rollout_id}: failed ({type(outcome).__name__}: {outcome})")
                    failed.append(row)
                    summary.failed_attempts.append(rollout_id)
                    continue
                record = {**row, **outcome}
                attachment = attach_model_call_capture(record, store, wait_s=WAIT_S, drop=True)
                gaps = [gap["code"] for gap in attachment.get("gaps", [])]
                # the verdict a trainer acts on: train on it, or not (docs/attachment.md, "Rollout health")
                health = attachment["health"]
                checks = [check["name"] for check in health["checks"]]
                say(
                    f"  {rollout_id}: {len(attachment['calls'])} calls attached, {health['verdict']}"
                    + (f" ({', '.join(checks)})" if checks else "")
                    + (f", gaps {gaps}" if gaps else "")
                )
                summary.verdicts[rollout_id] = health["verdict"]
                records.write(json.dumps(record) + "\n")
                written.append(attachment["rollout_id"])
            # The snapshots were dropped as attached (a drop keeps a fence, so a straggling call of a
            # finished rollout cannot recreate its file); the records are made durable once per round.
            records.flush()
            os.fsync(records.fileno())
            summary.written += written
            pending = failed
    summary.given_up = [rollout_id_of(row) for row in pending]
    return summary


# --- the command ----------------------------------------------------------------------------------------


def _model_name(upstream: str) -> str:
    try:
        return str(
            httpx.get(upstream + "/v1/models", timeout=10.0).raise_for_status().json()["data"][0]["id"]
        )
    except (httpx.HTTPError, ValueError, LookupError, TypeError):
        return "default"


@contextlib.contextmanager
def _upstream(url: str | None, say: Say) -> Iterator[tuple[str, str]]:
    """(base URL, model) of the model server; starts the tiny model (llama.cpp + Gemma 3 270M) if none."""
    if url is not None:
        yield url.rstrip("/"), _model_name(url.rstrip("/"))
        return
    from otel_capture.demo.tiny_model import start_tiny_model  # the demo's model server

    say("starting the tiny model (llama.cpp + Gemma 3 270M, CPU)")
    with start_tiny_model() as model:
        yield model.base_url, model.model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--upstream", help="model server URL (without /v1); default: start the tiny model")
    parser.add_argument("--tasks", type=Path, default=DEFAULT_TASKS, help="JSONL dataset of tasks")
    parser.add_argument(
        "--out", type=Path, required=True, help="JSONL file the rollout records are appended to"
    )
    parser.add_argument("--capture-dir", type=Path, help="capture directory (default: a new temporary one)")
    parser.add_argument("--rollouts-per-task", type=int, default=1)
    parser.add_argument("--max-attempts", type=int, default=MAX_ATTEMPTS)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = parser.parse_args(argv)

    capture_dir = args.capture_dir or Path(tempfile.mkdtemp(prefix="rollout-captures-"))
    store = CaptureStore(capture_dir.resolve())
    tasks = load_tasks(args.tasks)
    with (
        _upstream(args.upstream, print) as (upstream, model),
        start_proxy(upstream, str(store.root)) as proxy,
    ):
        print(f"capture proxy {proxy.url} -> {upstream}; captures in {store.root}")
        # This collector runs its agents in-process and knows capture is on: it opens the gate itself.
        agent = Agent(proxy.url, model, max_tokens=args.max_tokens, capture=True)
        summary = collect(
            tasks,
            agent,
            store,
            args.out,
            rollouts_per_task=args.rollouts_per_task,
            max_attempts=args.max_attempts,
        )
    print(f"{len(summary.written)} rollout records appended to {args.out}")
    print(summary.health_line())
    if summary.failed_attempts:
        print(f"failed attempts (captures kept in {store.root}): {', '.join(summary.failed_attempts)}")
    if summary.given_up:
        print(f"no record after {args.max_attempts} attempts: {', '.join(summary.given_up)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
